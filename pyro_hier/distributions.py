"""Distributions the guides emit. :class:`StickingTheLanding` samples with live parameters and scores with
detached ones, which turns Pyro's reparameterised ELBO gradient into the lower-variance "sticking the landing"
estimator without touching the ELBO classes."""

from __future__ import annotations

import math
from typing import ClassVar

import pyro.distributions as dist
import torch
from torch.distributions import constraints
from torch.distributions.utils import _standard_normal, lazy_property

__all__ = ["CholeskyPrecisionNormal", "ConjugateScorer", "StickingTheLanding", "unwrap"]


class StickingTheLanding(dist.TorchDistribution):
    r"""A reparameterised distribution whose ``log_prob`` does not depend on the variational parameters.

    With :math:`u = g_\phi(\varepsilon)`, the reparameterised ELBO gradient is

    .. math::

        \nabla_\phi \big[\log p(x, u) - \log q_\phi(u)\big]
        = \big(\nabla_u \log p(x, u) - \nabla_u \log q_\phi(u)\big)\,\nabla_\phi g_\phi(\varepsilon)
          \;-\; \nabla_\phi \log q_\phi(u)\big|_{u\ \mathrm{fixed}} .

    The last (score) term has expectation zero, so dropping it keeps the gradient unbiased; when
    :math:`q_\phi` equals the posterior the first term is zero for every :math:`\varepsilon`, so the estimator's
    variance vanishes at the optimum (Roeder, Wu & Duvenaud 2017). This class drops it: ``rsample`` draws from
    ``sampler`` (live parameters) and ``log_prob`` evaluates ``scorer`` — the same distribution built from detached
    parameters, but from the *live* values of anything that is not a parameter (e.g. the sampled parents of a
    conditional), so the value path stays differentiable. Values and densities are those of ``sampler``; only
    gradients change, and for any ELBO class that scores guide sites with ``log_prob`` (``Trace_ELBO``,
    ``TraceGraph_ELBO``, ``TraceEnum_ELBO``, vectorised particles included).

    Example::

        loc, scale = params()
        q = StickingTheLanding(dist.Normal(loc, scale), dist.Normal(loc.detach(), scale.detach()))
        pyro.sample("u", q)

    Reference: G. Roeder, Y. Wu, D. Duvenaud, *Sticking the Landing: Simple, Lower-Variance Gradient Estimators for
    Variational Inference*, NeurIPS 2017.
    """

    arg_constraints: ClassVar[dict] = {}
    has_rsample = True

    def __init__(self, sampler: dist.TorchDistribution, scorer: dist.TorchDistribution, validate_args=None) -> None:
        if not sampler.has_rsample:
            raise ValueError(f"sticking the landing needs a reparameterised sampler, got {type(sampler).__name__}")
        if sampler.batch_shape != scorer.batch_shape or sampler.event_shape != scorer.event_shape:
            raise ValueError(
                "sampler and scorer must have the same shapes, got "
                f"{tuple(sampler.batch_shape)}/{tuple(sampler.event_shape)} and "
                f"{tuple(scorer.batch_shape)}/{tuple(scorer.event_shape)}"
            )
        self.sampler = sampler
        self.scorer = scorer
        super().__init__(sampler.batch_shape, sampler.event_shape, validate_args=False)

    @constraints.dependent_property
    def support(self):
        return self.sampler.support

    @property
    def mean(self) -> torch.Tensor:
        return self.sampler.mean

    @property
    def variance(self) -> torch.Tensor:
        return self.sampler.variance

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        return self.sampler.rsample(sample_shape)

    def sample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        return self.sampler.sample(sample_shape)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return self.scorer.log_prob(value)

    def entropy(self) -> torch.Tensor:
        return self.sampler.entropy()

    def expand(self, batch_shape, _instance=None) -> StickingTheLanding:
        batch_shape = torch.Size(batch_shape)
        if batch_shape == self.batch_shape:  # (Pyro's plates expand every site's distribution: mostly to its shape)
            return self
        return StickingTheLanding(self.sampler.expand(batch_shape), self.scorer.expand(batch_shape))


class CholeskyPrecisionNormal(dist.TorchDistribution):
    r"""The multivariate normal :math:`\mathcal N(\ell, (C C^\top)^{-1})` given by the lower Cholesky factor
    :math:`C` of its *precision*: a draw is :math:`\ell + C^{-\top}\varepsilon` (one triangular solve with a vector)
    and the log density :math:`-\tfrac12\lVert C^\top (u - \ell)\rVert^2 + \sum_k \log C_{kk} -
    \tfrac d2 \log 2\pi`, so neither needs the covariance's factor (``MultivariateNormal(precision_matrix=...)``
    inverts a triangular matrix for it). The same distribution as ``MultivariateNormal(loc, precision_matrix=C Cᵀ)``;
    its draws from the same normal variates differ (another root of the covariance).

    Example::

        tril = torch.linalg.cholesky(precision)
        q = CholeskyPrecisionNormal(torch.cholesky_solve(eta.unsqueeze(-1), tril).squeeze(-1), tril)
    """

    arg_constraints: ClassVar[dict] = {}
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, loc: torch.Tensor, precision_tril: torch.Tensor, validate_args=None) -> None:
        d = loc.shape[-1]
        if precision_tril.shape[-2:] != (d, d):
            raise ValueError(
                f"precision_tril must be (..., {d}, {d}) for loc (..., {d}), got {tuple(precision_tril.shape)}"
            )
        batch = torch.broadcast_shapes(loc.shape[:-1], precision_tril.shape[:-2])
        self.loc = loc.expand((*batch, d))
        self.precision_tril = precision_tril.expand((*batch, d, d))
        super().__init__(batch, torch.Size((d,)), validate_args=False)

    @property
    def mean(self) -> torch.Tensor:
        return self.loc

    @lazy_property
    def _inverse_tril(self) -> torch.Tensor:  # C⁻¹ (lower triangular): Σ = C⁻ᵀ C⁻¹
        eye = torch.eye(self.loc.shape[-1], dtype=self.loc.dtype, device=self.loc.device)
        return torch.linalg.solve_triangular(self.precision_tril, eye, upper=False)

    @property
    def covariance_matrix(self) -> torch.Tensor:
        inv = self._inverse_tril
        return inv.mT @ inv

    @property
    def variance(self) -> torch.Tensor:
        return self._inverse_tril.pow(2).sum(-2)

    @property
    def scale_tril(self) -> torch.Tensor:
        return torch.linalg.cholesky(self.covariance_matrix)

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        shape = self._extended_shape(sample_shape)
        eps = _standard_normal(shape, dtype=self.loc.dtype, device=self.loc.device)
        white = torch.linalg.solve_triangular(self.precision_tril.mT, eps.unsqueeze(-1), upper=True).squeeze(-1)
        return self.loc + white

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        m = (self.precision_tril.mT @ (value - self.loc).unsqueeze(-1)).squeeze(-1)
        half_log_det = self.precision_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return -0.5 * (self.loc.shape[-1] * math.log(2 * math.pi) + m.pow(2).sum(-1)) + half_log_det

    def entropy(self) -> torch.Tensor:
        half_log_det = self.precision_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return 0.5 * self.loc.shape[-1] * (1.0 + math.log(2 * math.pi)) - half_log_det

    def expand(self, batch_shape, _instance=None) -> CholeskyPrecisionNormal:
        batch_shape = torch.Size(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        d = self.event_shape
        return CholeskyPrecisionNormal(
            self.loc.expand(batch_shape + d), self.precision_tril.expand(batch_shape + d + d)
        )


class ConjugateScorer(dist.TorchDistribution):
    r"""The scorer of :class:`StickingTheLanding` for a conjugate conditional whose prior part is live and whose
    pseudo-observation is held: :math:`q(u) = \mathcal N(\ell, P^{-1})` with

    .. math::

        P = \operatorname{diag}(p_0) + \Lambda, \qquad \ell = P^{-1}(p_0 \odot m_0 + \eta),

    :math:`(m_0, p_0)` the prior conditional's mean and precision (diagonal) at the parents' draws, with gradients,
    and :math:`(\Lambda, \eta)` the pseudo-observation, held (the variational parameters). ``log_prob`` has the value
    of q's log density and the gradients of that density rebuilt from :math:`(m_0, p_0)` and the held
    :math:`(\Lambda, \eta)`, in closed form from the sampler's own ``loc`` :math:`\ell` and precision factor
    ``precision_tril`` :math:`C` (:math:`C C^\top = P`), so no second factorisation of :math:`P` is made. With
    :math:`r = u - \ell`:

    .. math::

        \partial_u \log q = -P r, \qquad \partial_{m_0} \log q = p_0 \odot r, \qquad
        \partial_{p_0} \log q = \tfrac12 \operatorname{diag}(P^{-1}) - \tfrac12 r \odot r + r \odot (m_0 - \ell).

    The first is that of the held Gaussian; the others enter as a zero-valued term
    :math:`g^\top (x - x_{\text{stop}})`.

    Example::

        loc, tril = gaussian_update(prior, lam, natural, precision_tril=True)   # the sampler's, with gradients
        q = StickingTheLanding(CholeskyPrecisionNormal(loc, tril),
                               ConjugateScorer(loc, tril, prior.loc, prior.precision))

    Reference: G. Roeder, Y. Wu, D. Duvenaud, *Sticking the Landing*, NeurIPS 2017; C. M. Bishop, *Pattern
    Recognition and Machine Learning*, 2006, §2.3.3.
    """

    arg_constraints: ClassVar[dict] = {}
    support = constraints.real_vector

    def __init__(
        self,
        loc: torch.Tensor,
        precision_tril: torch.Tensor,
        prior_loc: torch.Tensor,
        prior_precision: torch.Tensor,
        validate_args=None,
    ) -> None:
        self.held = CholeskyPrecisionNormal(loc.detach(), precision_tril.detach())
        self.prior_loc, self.prior_precision = prior_loc, prior_precision
        super().__init__(self.held.batch_shape, self.held.event_shape, validate_args=False)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        log_q = self.held.log_prob(value)
        loc = self.held.loc
        with torch.no_grad():
            r = value - loc
            m0, p0 = self.prior_loc.detach(), self.prior_precision.detach()
            grad_p0 = 0.5 * self.held.variance - 0.5 * r * r + r * (m0 - loc)
            grad_m0 = p0 * r
        m0, p0 = self.prior_loc, self.prior_precision
        term = grad_p0 * (p0 - p0.detach()) + grad_m0 * (m0 - m0.detach())
        return log_q + term.sum(-1)

    def expand(self, batch_shape, _instance=None) -> ConjugateScorer:
        batch_shape = torch.Size(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        d = self.event_shape
        held = self.held.expand(batch_shape)
        return ConjugateScorer(
            held.loc,
            held.precision_tril,
            self.prior_loc.expand(batch_shape + d),
            self.prior_precision.expand(batch_shape + d),
        )


def unwrap(fn: torch.distributions.Distribution) -> torch.distributions.Distribution:
    """The distribution behind Pyro's shape wrappers (``Independent`` from ``to_event``, ``ExpandedDistribution``
    from ``expand``, ``MaskedDistribution`` from ``mask``).

    Example: ``unwrap(Normal(0, 1).expand([3]).to_event(1))`` is the ``Normal``."""
    while isinstance(fn, dist.Independent | dist.MaskedDistribution | dist.ExpandedDistribution):
        fn = fn.base_dist
    return fn

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

from pyro_hier.transforms import positive, scale_tril_from_raw

__all__ = [
    "CholeskyPrecisionNormal",
    "ConjugateNormal",
    "ConjugateScorer",
    "HeldConjugateNormal",
    "StickingTheLanding",
    "unwrap",
]


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
    def inverse_tril(self) -> torch.Tensor:
        """:math:`C^{-1}` (lower triangular): the covariance is :math:`C^{-\top} C^{-1}`."""
        return self._inverse_tril

    @property
    def covariance_matrix(self) -> torch.Tensor:
        inv = self._inverse_tril
        return inv.mT @ inv

    @property
    def variance(self) -> torch.Tensor:
        return torch.linalg.vector_norm(self._inverse_tril, dim=-2).square()

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


def _sum_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad`` summed over the dimensions that broadcasting added to or stretched in a tensor of ``shape``."""
    if grad.shape == shape:
        return grad
    lead = grad.dim() - len(shape)
    if lead > 0:
        grad = grad.sum(tuple(range(lead)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(stretched, keepdim=True) if stretched else grad


def _mv(matrix: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    return (matrix @ vector.unsqueeze(-1)).squeeze(-1)


def _inverse_solve(inverse_tril: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """:math:`(C C^\top)^{-1} b = C^{-\top} (C^{-1} b)` from ``inverse_tril`` :math:`C^{-1}` (two products)."""
    return _mv(inverse_tril.mT, _mv(inverse_tril, vector))


def _precision_solve(tril: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """:math:`(C C^\top)^{-1} b` for the lower factor ``tril`` :math:`C` and vectors ``b (..., d)`` (broadcast)."""
    d = vector.shape[-1]
    batch = torch.broadcast_shapes(vector.shape[:-1], tril.shape[:-2])
    tril = tril.expand((*batch, d, d))
    white = torch.linalg.solve_triangular(tril, vector.expand((*batch, d)).unsqueeze(-1), upper=False)
    return torch.linalg.solve_triangular(tril.mT, white, upper=True).squeeze(-1)


class _PerturbedDraw(torch.autograd.Function):
    r"""The draw of :class:`ConjugateNormal`, :math:`u = \ell + P^{-1}(A\varepsilon_1 + \sqrt{p_0}\odot\varepsilon_2)`,
    given (``u``, made from the held parts without gradient, by :func:`_perturbed_parts`), with the gradients of its
    class docstring in the differentiable inputs ``raw, fisher_sd, mean, offset, prior_precision, prior_loc``.
    ``parts``: what the backward pass reads besides the incoming gradient, all computed in the forward pass
    (:math:`C^{-1}`, :math:`A`, :math:`L`, :math:`s`, :math:`R`, :math:`M - u`,
    :math:`\varepsilon_1 + A^\top M - A^\top u`, :math:`m_0 - u + \varepsilon_2 / (2\sqrt{p_0})`, :math:`p_0`): the
    forward pass is then the return of ``u`` alone, and under a ``torch.jit`` trace their arithmetic is replayed by the
    graph rather than in Python."""

    @staticmethod
    def forward(ctx, raw, fisher_sd, mean, offset, prior_precision, prior_loc, u, *parts):
        ctx.save_for_backward(*parts)
        ctx.shapes = [t.shape for t in (raw, fisher_sd, mean, offset, prior_precision, prior_loc)]
        return u.clone()

    @staticmethod
    def backward(ctx, grad):
        inverse_tril, root, factor, scale, fisher_sd, mean_gap, right_first, prior_weight, p0 = ctx.saved_tensors
        v = _inverse_solve(inverse_tril, grad)  # P⁻¹ ḡ
        batch = v.shape[:-1]
        root_v = _mv(root.expand((*batch, *root.shape[-2:])).mT, v)  # Aᵀv
        # ∂/∂A = X Yᵀ, X = (v, M − u), Y = (ε₁ + AᵀM − Aᵀu, Aᵀv): from b and from P (∂/∂P = −v uᵀ)
        left = torch.stack([v, mean_gap.expand(v.shape)], -1)
        right = torch.stack([right_first.expand(v.shape), root_v], -1)
        needs = ctx.needs_input_grad
        grad_raw = grad_sd = None
        if needs[0] or needs[1]:
            factor_right = factor @ right  # L Y
        if needs[0]:  # A = R L, L = diag(s)(I + tril₋₁(W)), s = exp(diag W)
            r_left = fisher_sd.mT @ left  # Rᵀ X: ∂L = Rᵀ X Yᵀ
            grad_raw = (scale.unsqueeze(-1) * r_left) @ right.mT  # s ⊙ ∂L, then the strict lower triangle of it
            grad_raw = grad_raw.tril_(-1)
            grad_raw.diagonal(dim1=-2, dim2=-1).copy_((r_left * factor_right).sum(-1))  # Σ_j ∂L_ij L_ij
            grad_raw = _sum_to(grad_raw, ctx.shapes[0])
        if needs[1]:  # ∂R = ∂A Lᵀ
            grad_sd = _sum_to(left @ factor_right.mT, ctx.shapes[1])
        grad_mean = _sum_to(_mv(root, root_v), ctx.shapes[2]) if needs[2] else None
        grad_offset = _sum_to(v, ctx.shapes[3]) if needs[3] else None
        grad_p0 = _sum_to(v * prior_weight, ctx.shapes[4]) if needs[4] else None
        grad_m0 = _sum_to(v * p0, ctx.shapes[5]) if needs[5] else None
        return grad_raw, grad_sd, grad_mean, grad_offset, grad_p0, grad_m0, None, *(None for _ in range(9))


class ConjugateNormal(CholeskyPrecisionNormal):
    r"""A conjugate conditional :math:`\mathcal N(P^{-1}\eta,\ P^{-1})` given by its parts,

    .. math::

        P = \operatorname{diag}(p_0) + A A^\top, \qquad \eta = p_0 \odot m_0 + A A^\top M + c, \\
        A = R\,L, \quad L = \operatorname{diag}(s)\,(I + \operatorname{tril}_{-1} W), \\
        s = e^{\operatorname{diag} W},

    :math:`(m_0, p_0)` the prior conditional's mean and precision (diagonal), :math:`A` the root of the
    pseudo-observation's precision, :math:`M` and :math:`c` what makes its natural parameter: the branch guide's dense
    conjugate level (:func:`~pyro_hier.conjugate.conjugate_conditional`, :func:`~pyro_hier.conjugate.conjugate_offset`:
    :math:`R` the reference curvature's root, :math:`L` the relative factor of
    :func:`~pyro_hier.transforms.scale_tril_from_raw` with raw :math:`W`, :math:`c = \bar P_0 (M - \bar m_0)`).
    Draws are reparameterised by *perturbation*: with :math:`\varepsilon_1, \varepsilon_2 \sim \mathcal N(0, I_d)`,

    .. math::

        u = P^{-1}\big(\eta + A\varepsilon_1 + \sqrt{p_0}\odot\varepsilon_2\big), \qquad
        \operatorname{Cov}(u) = P^{-1}(A A^\top + \operatorname{diag} p_0) P^{-1} = P^{-1},

    so ``u`` has exactly this distribution (Papandreou & Yuille's perturb-and-MAP, exact for Gaussians), and its
    derivatives need no derivative of a factorisation: with :math:`\bar g` the gradient in :math:`u` and
    :math:`v = P^{-1}\bar g`, :math:`\partial/\partial P = -v u^\top` and :math:`\partial/\partial b = v`, so that
    :math:`\partial_A = X Y^\top` with :math:`X = (v,\ M - u)`, :math:`Y = (\varepsilon_1 + A^\top M - A^\top u,\
    A^\top v)` (rank 2), and

    .. math::

        \partial_M = A A^\top v, \quad \partial_c = v, \quad
        \partial_{p_0} = v \odot (m_0 - u) + v \odot \varepsilon_2 / (2\sqrt{p_0}), \quad \partial_{m_0} = p_0 \odot v,
        \\
        \partial_{W_{ij}} = s_i\,(R^\top X Y^\top)_{ij}\ (j < i), \qquad
        \partial_{W_{ii}} = \textstyle\sum_k (R^\top X)_{ik} (L Y)_{ik}, \qquad \partial_R = X (L Y)^\top:

    products with :math:`C^{-1}`, :math:`C` the Cholesky factor of :math:`P` (both made once, without gradient), and
    products of rank 2, where the draw :math:`\ell + C^{-\top}\varepsilon` of :class:`CholeskyPrecisionNormal`
    differentiates through the factorisation and every matrix product (matrix triangular solves per element). Same
    distribution, another reparameterisation of it: the ELBO's gradient has the same expectation.

    ``loc`` and ``precision_tril`` (:math:`C`) are held (no gradient: for :class:`ConjugateScorer`, summaries and
    moments); :meth:`rsample` and :meth:`log_prob` carry the gradients in :math:`W, R, M, c, m_0, p_0`.

    Example::

        q = ConjugateNormal(fisher_sd, raw, mean, offset, prior.loc, prior.precision)
        q = StickingTheLanding(q, ConjugateScorer(q.loc, q.precision_tril, prior.loc, prior.precision))

    Reference: G. Papandreou, A. Yuille, *Gaussian sampling by local perturbations*, NeurIPS 2010.
    """

    def __init__(
        self,
        fisher_sd: torch.Tensor,
        raw: torch.Tensor,
        mean: torch.Tensor,
        offset: torch.Tensor,
        prior_loc: torch.Tensor,
        prior_precision: torch.Tensor,
        validate_args=None,
    ) -> None:
        d = mean.shape[-1]
        if raw.shape[-2:] != (d, d) or fisher_sd.shape[-2:] != (d, d):
            raise ValueError(
                f"fisher_sd and raw must be (..., {d}, {d}) for mean (..., {d}), got {tuple(fisher_sd.shape)} and "
                f"{tuple(raw.shape)}"
            )
        self.fisher_sd, self.raw, self.mean_param, self.offset = fisher_sd, raw, mean, offset
        self.prior_loc, self.prior_precision = prior_loc, prior_precision
        batch = torch.broadcast_shapes(
            fisher_sd.shape[:-2],
            raw.shape[:-2],
            mean.shape[:-1],
            offset.shape[:-1],
            prior_loc.shape[:-1],
            prior_precision.shape[:-1],
        )
        with torch.no_grad():
            # (detached explicitly: a ``torch.jit`` trace does not record ``no_grad``, and its replay would otherwise
            # record these products, the factorisation and the solves for autograd and differentiate them backwards)
            fisher_sd, raw, mean, offset = fisher_sd.detach(), raw.detach(), mean.detach(), offset.detach()
            prior_loc, prior_precision = prior_loc.detach(), prior_precision.detach()
            self.scale = positive(raw.diagonal(dim1=-2, dim2=-1))
            factor = raw.tril(-1)
            factor.diagonal(dim1=-2, dim2=-1).fill_(1.0)
            self.factor = factor.mul_(self.scale.unsqueeze(-1))  # L
            self.root = fisher_sd @ self.factor  # A = R L
            precision = self.root @ self.root.mT
            if precision.shape[:-2] != batch:
                precision = precision.expand((*batch, d, d)).clone()
            precision.diagonal(dim1=-2, dim2=-1).add_(prior_precision)
            tril = torch.linalg.cholesky(precision)
            self.root_mean = _mv(self.root.mT, mean)  # AᵀM
            eta = prior_precision * prior_loc + _mv(self.root, self.root_mean) + offset
            eye = torch.eye(d, dtype=tril.dtype, device=tril.device)
            inverse_tril = torch.linalg.solve_triangular(tril, eye, upper=False)  # C⁻¹: solves are products with it
            loc = _inverse_solve(inverse_tril, eta)
        super().__init__(loc, tril, validate_args=False)
        self._inverse_tril = inverse_tril.expand(self.precision_tril.shape)

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        shape = self._extended_shape(sample_shape)
        eps_root, eps_prior = _standard_normal((2, *shape), dtype=self.loc.dtype, device=self.loc.device)
        with torch.no_grad():  # (the draw and what its backward pass reads: from held or detached parts alone)
            mean, p0, m0 = self.mean_param.detach(), self.prior_precision.detach(), self.prior_loc.detach()
            noise = _mv(self.root, eps_root) + p0.sqrt() * eps_prior
            u = self.loc + _inverse_solve(self._inverse_tril, noise)
            parts = (
                self._inverse_tril,
                self.root,
                self.factor,
                self.scale,
                self.fisher_sd.detach(),
                mean - u,  # M − u
                eps_root + self.root_mean - _mv(self.root.mT, u),  # ε₁ + AᵀM − Aᵀu
                m0 - u + eps_prior * (0.5 * p0.rsqrt()),  # ∂u/∂p₀ = v ⊙ (m₀ − u + ε₂ / (2√p₀))
                p0,
            )
        return _PerturbedDraw.apply(
            self.raw, self.fisher_sd, self.mean_param, self.offset, self.prior_precision, self.prior_loc, u, *parts
        )

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """The log density with gradients in every part (a factorisation with autograd: the branch guide scores
        with :class:`ConjugateScorer` instead)."""
        d = self.loc.shape[-1]
        root = self.fisher_sd @ scale_tril_from_raw(self.raw)
        precision = root @ root.mT + torch.diag_embed(self.prior_precision.expand(self.loc.shape))
        eta = self.prior_precision * self.prior_loc + _mv(root, _mv(root.mT, self.mean_param)) + self.offset
        tril = torch.linalg.cholesky(precision)
        loc = _precision_solve(tril, eta)
        m = _mv(tril.mT, value - loc)
        half_log_det = tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return -0.5 * (d * math.log(2 * math.pi) + m.pow(2).sum(-1)) + half_log_det

    def expand(self, batch_shape, _instance=None) -> ConjugateNormal:
        batch_shape = torch.Size(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        d = self.event_shape
        return ConjugateNormal(
            self.fisher_sd.expand(batch_shape + d + d),
            self.raw.expand(batch_shape + d + d),
            self.mean_param.expand(batch_shape + d),
            self.offset.expand(batch_shape + d),
            self.prior_loc.expand(batch_shape + d),
            self.prior_precision.expand(batch_shape + d),
        )


class HeldConjugateNormal(ConjugateNormal):
    r""":class:`ConjugateNormal` whose pseudo-observation is held (no gradient): the prior conditional
    :math:`(m_0, p_0)` (diagonal precision, with gradients) times a Gaussian pseudo-observation given in natural
    parameters, precision :math:`\Lambda` and natural parameter :math:`\eta`,

    .. math::

        q = \mathcal N(P^{-1}(p_0 \odot m_0 + \eta),\ P^{-1}), \qquad P = \operatorname{diag}(p_0) + \Lambda,

    drawn by perturbation, :math:`u = P^{-1}(p_0 \odot m_0 + \eta + A\varepsilon_1 + \sqrt{p_0}\odot\varepsilon_2)`
    with ``root`` :math:`A` any root of :math:`\Lambda` (:math:`A A^\top = \Lambda`, e.g. from its
    eigendecomposition): :class:`ConjugateNormal` with :math:`R = A`, :math:`L = I`, :math:`M = 0` and
    :math:`c = \eta`, built from :math:`\Lambda` itself (one Cholesky factorisation of :math:`P` and one inverse of
    its factor, without the products that make :math:`A L`, :math:`(AL)(AL)^\top` and :math:`A A^\top M`). The draw's
    gradients are :class:`ConjugateNormal`'s in :math:`m_0` and :math:`p_0` (:math:`\partial_{m_0} = p_0 \odot v`,
    :math:`\partial_{p_0} = v \odot (m_0 - u) + v \odot \varepsilon_2 / (2\sqrt{p_0})`, :math:`v = P^{-1}\bar g`);
    none reaches :math:`\Lambda`, :math:`\eta` or :math:`A`.

    Example (a level's q from the model's expansion ``(lam, eta)`` of its likelihood, the prior conditional live)::

        values, vectors = torch.linalg.eigh(lam)
        root = vectors * values.clamp(min=0).sqrt().unsqueeze(-2)
        q = HeldConjugateNormal(root, lam, eta, prior.loc, prior.precision)
        q = StickingTheLanding(q, ConjugateScorer(q.loc, q.precision_tril, prior.loc, prior.precision))
    """

    def __init__(
        self,
        root: torch.Tensor,
        precision: torch.Tensor,
        natural: torch.Tensor,
        prior_loc: torch.Tensor,
        prior_precision: torch.Tensor,
        validate_args=None,
    ) -> None:
        d = natural.shape[-1]
        if root.shape[-2:] != (d, d) or precision.shape[-2:] != (d, d):
            raise ValueError(
                f"root and precision must be (..., {d}, {d}) for natural (..., {d}), got {tuple(root.shape)} and "
                f"{tuple(precision.shape)}"
            )
        batch = torch.broadcast_shapes(
            root.shape[:-2], precision.shape[:-2], natural.shape[:-1], prior_loc.shape[:-1], prior_precision.shape[:-1]
        )
        with torch.no_grad():  # (inputs detached explicitly: a ``torch.jit`` trace does not record ``no_grad``)
            precision, natural_held = precision.detach(), natural.detach()
            prior_loc_held, prior_precision_held = prior_loc.detach(), prior_precision.detach()
            total = precision.expand((*batch, d, d)).clone()
            total.diagonal(dim1=-2, dim2=-1).add_(prior_precision_held)
            tril = torch.linalg.cholesky(total)
            eye = torch.eye(d, dtype=tril.dtype, device=tril.device)
            inverse_tril = torch.linalg.solve_triangular(tril, eye, upper=False)
            loc = _inverse_solve(inverse_tril, prior_precision_held * prior_loc_held + natural_held)
        self.fisher_sd, self.raw = root, natural.new_zeros((d, d))  # (L = I: raw W = 0)
        self.mean_param, self.offset = natural.new_zeros((d,)).expand(natural.shape), natural
        self.prior_loc, self.prior_precision = prior_loc, prior_precision
        self.scale, self.factor, self.root = natural.new_ones((d,)), eye, root
        self.root_mean = natural.new_zeros((d,)).expand((*batch, d))  # AᵀM = 0
        CholeskyPrecisionNormal.__init__(self, loc, tril, validate_args=False)
        self._inverse_tril = inverse_tril


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
    :math:`g^\top (x - x_{\text{stop}})`. ``inverse_tril``: :math:`C^{-1}` when the sampler has made it already
    (:attr:`CholeskyPrecisionNormal.inverse_tril`), for :math:`\operatorname{diag}(P^{-1})`.

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
        inverse_tril: torch.Tensor | None = None,
    ) -> None:
        self.held = CholeskyPrecisionNormal(loc.detach(), precision_tril.detach())
        if inverse_tril is not None:  # (the sampler's C⁻¹, made already: not made again)
            self.held._inverse_tril = inverse_tril.detach().expand(self.held.precision_tril.shape)
        self.prior_loc, self.prior_precision = prior_loc, prior_precision
        super().__init__(self.held.batch_shape, self.held.event_shape, validate_args=False)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        log_q = self.held.log_prob(value)
        loc = self.held.loc
        with torch.no_grad():  # (detached explicitly: a ``torch.jit`` trace does not record ``no_grad``)
            r = value.detach() - loc
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

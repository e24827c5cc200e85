r"""Hierarchical variational models (Ranganath, Tran & Blei 2016): a mean-field *variational likelihood* whose
parameters get a *variational prior*, for continuous and discrete latents alike.

The guide :class:`AutoHierarchicalVM` samples, for every element of a plate level, the likelihood parameters
:math:`\lambda \sim q(\lambda; \theta)` (a reparameterisable mixture of diagonal Gaussians, or a normalizing flow), then
every latent coordinate :math:`z_d \sim q(z_d \mid \lambda_d)` independently (Normal in unconstrained space for a
continuous site; Bernoulli, Categorical, Poisson or Binomial for a discrete one). The entropy of the marginal
:math:`q(z) = \int q(\lambda) \prod_d q(z_d \mid \lambda_d)\, d\lambda` is bounded with an auxiliary
:math:`r(\lambda \mid z; \phi)`, which gives the hierarchical ELBO (eq. 5)

.. math::

    \tilde{\mathcal L} = \mathbb E_{q(z, \lambda)}\big[\log p(x, z) + \log r(\lambda \mid z)
        - \textstyle\sum_d \log q(z_d \mid \lambda_d) - \log q(\lambda)\big] \;\le\; \log p(x).

**How the loss stays correct.** A guide-side ``pyro.factor`` holding :math:`\log r` would be left out of the
score-function learning signal of ``Trace_ELBO`` (it only counts sites the model also has), a silently wrong gradient
for discrete :math:`z`. Here :math:`\log r` is instead part of the log-density that each latent *site* reports: the
site of :math:`z_d` is a :class:`HVMSiteDistribution` with

- ``log_prob(z) = log q(z | λ) − log r_d(λ | z)`` (what every Pyro ELBO subtracts, so the loss is eq. 5, and the
  score-function learning signal of ``Trace_ELBO``, ``TraceGraph_ELBO`` and ``TraceEnum_ELBO`` contains
  :math:`\log r`, as eq. 8 requires);
- ``score_parts``: score function :math:`\log q(z \mid \lambda)` only (the density :math:`z` is really drawn from)
  and the pathwise term :math:`-\log r` (the reparameterised gradient through :math:`\lambda` and :math:`\phi`).

The reported joint density is then :math:`q(\lambda) q(z \mid \lambda) / r(\lambda \mid z)`, so importance weights
built from it, :math:`p(x, z)\, r(\lambda \mid z) / (q(\lambda) q(z \mid \lambda))`, still average to
:math:`p(x)` (auxiliary-variable importance sampling). ``TraceMeanField_ELBO`` cannot score a discrete site and is
refused with an error; see :class:`AutoHierarchicalVM`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import pyro
import pyro.distributions as dist
import pyro.distributions.transforms as T
import torch
from pyro.distributions.score_parts import ScoreParts
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide.initialization import init_to_feasible
from pyro.nn import AutoRegressiveNN, PyroModule, PyroParam
from pyro.ops.tensor_utils import periodic_repeat
from torch import nn
from torch.distributions import constraints, register_kl

from pyro_hier.conjugate import capture_priors, element_curvature, gaussian_prior
from pyro_hier.distributions import unwrap
from pyro_hier.errors import StructureError
from pyro_hier.guides.base import (
    HierarchicalGuide,
    concat_broadcast,
    empirical_quantiles,
    parameter_keys,
    stored_param,
    strip_trailing_ones,
)
from pyro_hier.optim import tail_average_update
from pyro_hier.plates import element_selection, enter_plates
from pyro_hier.sparse import select_elements
from pyro_hier.structure import LatentSite, ModelStructure
from pyro_hier.transforms import positive, positive_inv

__all__ = ["AutoHierarchicalVM", "HVMSiteDistribution", "ImplicitMixtureOfDiagNormals"]

_PRIORS = ("mixture", "flow")
#: continuous sites: the share of q(z)'s initial variance in the spread of λ's location (the rest is q(z | λ)'s)
_LOC_SPREAD_FRACTION = 0.5
#: continuous sites: the initial spread of λ₂ (the log-sd of q(z | λ)) around its centre, in units of init_scale
_LOGSCALE_SPREAD = 0.5
#: the mixture prior's logits are this times their free parameters: Adam then moves the weights a fifth as fast as
#: the components. At full speed the weights of a symmetric start drifted apart while the components separated, so
#: q's median wandered up to 0.15 sd from a prior-only posterior's over the first 100 steps of Adam(0.02) (6 seeds);
#: at a fifth, within 0.05
_LOGIT_SCALE = 0.2
_MAX_CATEGORIES = 64
#: default mixture components of a level with a discrete site (continuous-only levels: 1; see AutoHierarchicalVM)
DISCRETE_COMPONENTS = 4
#: the mixture prior's r(λ | z) has sd σ_k e^γ(z) with |γ| < MAX_STRETCH (a factor of e^5 ≈ 150 either way)
MAX_STRETCH = 5.0
#: the slopes of a site on its parents (:meth:`AutoHierarchicalVM._affine`) that the model does not give (its prior
#: conditional is not Gaussian) are this times their free parameters, so Adam moves them at a tenth of the rate of the
#: other parameters (model-read slopes: :data:`READ_SLOPE_RATE`). At full rate the model-read slopes left the
#: model's non-centred start within 250 steps of the drop-in loop, while λ's scales were still near their init, and
#: the centred eight schools' tau collapsed (0.08 of its posterior sd, max error 0.93 sd)
SLOPE_RATE = 0.1
#: the rate multiplier of slopes the model gives (:meth:`AutoHierarchicalVM._model_slopes`, read again every
#: :data:`SLOPE_REFRESH` calls): Adam's changes on top of the reading move at a hundredth of its rate. At a tenth, on
#: radon (Uniform priors) at Adam's rate 0.05 (the drop-in loop, 3 seeds) what Adam added to the reads while the
#: globals were far from their posterior stayed: the county scale ended 0.73-0.80 sd off (AutoNormal 0.55-0.76); at a
#: hundredth 0.64-0.71
READ_SLOPE_RATE = 0.01
#: the rate multiplier of λ's location parameters in plate levels (the mixture's component means, the flow's
#: location): they are this times their free parameters, so Adam moves them at this fraction of its rate. What limits
#: accuracy at high rates is their jitter: Adam's steps keep every group's location moving about its optimum by an
#: amount that grows with the rate, and the population scale, fitted to the spread of the group effects, grows with
#: it. On radon (Uniform priors, the drop-in loop, seed 0) the county scale's mean ended 0.23 / 0.33 / 0.63 posterior
#: sds high at Adam's rates 0.01 / 0.02 / 0.05 at full rate (AutoNormal at 0.05: 0.57), 0.44 at half, 0.35 at 0.3
#: (0.15 at rate 0.01); the same multiplier on the globals' locations (0.59) or on r's parameters (0.67) did not help.
#: Slower is not safer: at 0.3, 1,000 steps at rate 0.03 on radon with HalfNormal priors collapsed the county scale
#: (0.06 of its posterior sd, max error 33 sd) before the counties spread out; at a half 0.40 (full rate 0.58). At a
#: half, radon at rate 0.05 (3 seeds, worst) ended 0.50 / 0.49 (Uniform / HalfNormal priors; Uniform at full rate 0.71,
#: AutoNormal 0.76 / 0.75), but the centred eight schools at rate 0.05 ended 0.99 / 1.44 / 0.26 (seeds 0 / 1 / 2; tau
#: collapsed on seed 0), against 0.44 / 0.44 (seeds 0 / 1) at the full rate (AutoNormal 0.46 / 0.49 / 0.46). The rule
#: that serves both is not a rate but the control variate of :meth:`AutoHierarchicalVM._location_control_variate`: it
#: takes the noise that drives the jitter out of the locations' gradient. With it, at the full rate, radon at 0.05
#: ended 0.38-0.44 (both priors, 3 seeds) and the centred eight schools 0.41-0.44 (AutoNormal 0.55-0.76, 0.46-0.49)
LOCAL_RATE = 1.0
#: the memory (in training calls) of the running moments behind the globals' control variate
#: (:meth:`AutoHierarchicalVM._update_global_control_variate`), and the training calls before it is applied (its first
#: estimates, from a few draws, would add noise rather than take it out)
GLOBAL_CV_MEMORY = 100
#: the fraction of the training calls so far that the tail average of q's parameters remembers (outside training q
#: uses that average: ``Predictive``, ``median``, ``quantiles``). In the drop-in loop on the synthetic regression
#: (seed 0) the max error of the means went from 0.148 to 0.098 sd. Corrected for the parameters' drift (Brown's
#: double smoothing: the first average plus 1 + f times its excess over an average of itself), it removed the lag
#: behind the non-centred eight schools' mean at Adam's rate 0.005 (max error seeds 0-2 0.133 / 0.119 / 0.163 → 0.118
#: / 0.125 / 0.145), but extrapolated the centred eight schools' tau at rate 0.01, still drifting up at the end, to
#: 0.51 posterior sds high (0.20 plain; seed 0): not used
TAIL_FRACTION = 0.25
#: every this many training calls, continuous levels' slopes on their parents are read from the model again at the
#: current centre of q (:meth:`AutoHierarchicalVM._refresh_slopes`). Read once, at the init values, they stayed
#: where those values put them: on radon (Uniform priors, init at sd 50 for both scales) a one-home county's
#: log-sd slope on the county scale ended at 0.18, where the posterior's is 0.96, and q of the county scale at 0.32
#: of its posterior sd (max error 0.74 sd; 0.52 with the refresh)
SLOPE_REFRESH = 20


# ---- the variational prior: a reparameterisable mixture of diagonal Gaussians -------------------------------------
class ImplicitMixtureOfDiagNormals(TorchDistribution):
    r"""Mixture of diagonal Gaussians :math:`\sum_k \pi_k \mathcal N(x; \mu_k, \operatorname{diag}\sigma_k^2)` with
    pathwise (implicit) gradients, in any dimension ``D ≥ 1``.

    A sample is drawn as usual (component, then Gaussian); its gradient follows the distributional transform
    (Graves 2016; implicit reparameterisation, Figurnov et al. 2018): coordinate :math:`d` solves
    :math:`F_d(x_d \mid x_{<d}; \theta) = u_d` for the conditional CDF
    :math:`F_d = \sum_k w_k(x_{<d}) \Phi((x_d - \mu_{kd})/\sigma_{kd})` with weights
    :math:`w_k \propto \pi_k \prod_{d' < d} \mathcal N(x_{d'}; \mu_{kd'}, \sigma_{kd'})`, so

    .. math::

        dx_d = \sum_k \rho_k\,(d\mu_{kd} + \varepsilon_k\, d\sigma_{kd}) - \sum_k dw_k\, \Phi_k(x_d) / p_d(x_d),

    with responsibilities :math:`\rho_k = w_k \mathcal N_k(x_d) / p_d(x_d)` and
    :math:`\varepsilon_k = (x_d - \mu_{kd}) / \sigma_{kd}`. The returned sample has the drawn value and exactly these
    derivatives (with respect to the parameters and, through :math:`w_k`, to the earlier coordinates). Pyro's
    ``MixtureOfDiagNormals`` has another valid pathwise gradient but does not support ``D = 1``, which every
    Bernoulli element of a plate needs here.

    :param locs: ``(..., K, D)`` component means.
    :param scales: ``(..., K, D)`` component standard deviations.
    :param logits: ``(..., K)`` unnormalised log weights.

    Example::

        q = ImplicitMixtureOfDiagNormals(torch.zeros(3, 1), torch.ones(3, 1), torch.zeros(3))
        x = q.rsample((100,))  # (100, 1), differentiable in the parameters
    """

    arg_constraints: ClassVar[dict] = {
        "locs": constraints.real,
        "scales": constraints.positive,
        "logits": constraints.real,
    }
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, locs: torch.Tensor, scales: torch.Tensor, logits: torch.Tensor, validate_args=None) -> None:
        if locs.dim() < 2 or scales.shape != locs.shape or logits.shape != locs.shape[:-1]:
            raise ValueError(
                f"expected locs and scales of shape (..., K, D) and logits (..., K); got {tuple(locs.shape)}, "
                f"{tuple(scales.shape)}, {tuple(logits.shape)}"
            )
        self.locs, self.scales, self.logits = locs, scales, logits
        super().__init__(locs.shape[:-2], locs.shape[-1:], validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        batch_shape = torch.Size(batch_shape)
        if batch_shape == self.batch_shape:  # (Pyro's plates expand every site's distribution)
            return self
        k, d = self.locs.shape[-2:]
        return ImplicitMixtureOfDiagNormals(
            self.locs.expand((*batch_shape, k, d)),
            self.scales.expand((*batch_shape, k, d)),
            self.logits.expand((*batch_shape, k)),
            validate_args=False,
        )

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        draw = getattr(self, "_draw", None)
        if draw is not None and draw[0] is value:  # one component, at its own draw (see _NoiseNormal.log_prob)
            return (-0.5 * draw[1].pow(2) - self.scales[..., 0, :].log() - 0.5 * math.log(2 * math.pi)).sum(-1)
        eps = (value.unsqueeze(-2) - self.locs) / self.scales
        log_n = (-0.5 * eps.pow(2) - self.scales.log() - 0.5 * math.log(2 * math.pi)).sum(-1)
        if log_n.shape[-1] == 1:  # one component: its weight is 1
            return log_n[..., 0]
        return torch.logsumexp(torch.log_softmax(self.logits, -1) + log_n, -1)

    def rsample(self, sample_shape=()) -> torch.Tensor:
        shape = self._extended_shape(sample_shape)
        k, d = self.locs.shape[-2:]
        if k == 1:  # one component: the implicit gradient is the usual reparameterised one
            eps = torch.randn(shape, dtype=self.locs.dtype, device=self.locs.device)
            x = self.locs[..., 0, :] + self.scales[..., 0, :] * eps
            self._draw = (x, eps)
            return x
        locs = self.locs.expand((*shape[:-1], k, d))
        scales = self.scales.expand((*shape[:-1], k, d))
        log_w = torch.log_softmax(self.logits, -1).expand((*shape[:-1], k))
        # the draw and the terms of its implicit gradient are computed from detached tensors (not under no_grad, which
        # torch.jit.trace does not record: JitTrace_ELBO would then differentiate them too)
        which = torch.distributions.Categorical(logits=log_w.detach()).sample()
        index = which[..., None, None].expand((*shape[:-1], 1, d))
        x = locs.detach().gather(-2, index).squeeze(-2) + scales.detach().gather(-2, index).squeeze(-2) * torch.randn(
            shape, dtype=locs.dtype, device=locs.device
        )
        if not (locs.requires_grad or scales.requires_grad or log_w.requires_grad):
            return x
        coords = []
        for j in range(d):
            xj, mu, sd = x[..., j], locs[..., j], scales[..., j]
            mu_, sd_, log_w_ = mu.detach(), sd.detach(), log_w.detach()
            eps = (xj.unsqueeze(-1) - mu_) / sd_
            log_n = -0.5 * eps.pow(2) - sd_.log() - 0.5 * math.log(2 * math.pi)
            log_joint = log_w_ + log_n
            log_p = torch.logsumexp(log_joint, -1, keepdim=True)
            rho = (log_joint - log_p).exp()
            # Φ_k / p, or −Q_k / p right of the mixture's median (equal since Σ dw_k = 0; no cancellation)
            log_cdf = torch.special.log_ndtr(eps)
            right = torch.logsumexp(log_w_ + log_cdf, -1, keepdim=True) > math.log(0.5)
            ratio = torch.where(right, -(torch.special.log_ndtr(-eps) - log_p).exp(), (log_cdf - log_p).exp())
            w = log_w.exp()
            delta = (rho * ((mu - mu.detach()) + eps * (sd - sd.detach()))).sum(-1) - ((w - w.detach()) * ratio).sum(-1)
            xj = xj + delta
            coords.append(xj)
            if j + 1 < d:  # weights of the next coordinate's conditional, differentiable in x_{≤j}
                log_w = log_w + dist.Normal(mu, sd).log_prob(xj.unsqueeze(-1))
                log_w = log_w - torch.logsumexp(log_w, -1, keepdim=True)
        return torch.stack(coords, -1)


# ---- the latent sites: variational likelihood with the auxiliary term in its density ------------------------------
class HVMSiteDistribution(TorchDistribution):
    r"""The distribution :class:`AutoHierarchicalVM` gives a latent site: draws come from the variational likelihood
    ``base`` :math:`= q(z \mid \lambda)`; the reported density is :math:`q(z \mid \lambda) / r(\lambda \mid z)`.

    ``score_parts`` splits the two as Pyro's gradient estimators need: the score function is
    :math:`\log q(z \mid \lambda)` alone (for a non-reparameterised ``base``) and :math:`-\log r` is a pathwise term;
    for a reparameterised ``base`` (continuous sites) everything is pathwise.

    :param base: :math:`q(z \mid \lambda)`.
    :param log_r: ``log_r(z)``: :math:`\log r(\lambda \mid z)` of the site's coordinates, shaped like
        ``base.log_prob(z)`` (broadcastable).
    """

    arg_constraints: ClassVar[dict] = {}

    def __init__(self, base: TorchDistribution, log_r: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.base = base
        self.log_r = log_r
        super().__init__(base.batch_shape, base.event_shape, validate_args=False)

    @property
    def has_rsample(self) -> bool:
        return self.base.has_rsample

    @constraints.dependent_property
    def support(self):
        return self.base.support

    def expand(self, batch_shape, _instance=None):
        if torch.Size(batch_shape) == self.batch_shape:  # (Pyro's plates expand every site's distribution)
            return self
        return HVMSiteDistribution(self.base.expand(batch_shape), self.log_r)

    def sample(self, sample_shape=()) -> torch.Tensor:
        return self.base.sample(sample_shape)

    def rsample(self, sample_shape=()) -> torch.Tensor:
        return self.base.rsample(sample_shape)

    def _parts(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Pyro's ELBOs ask for log_prob and score_parts of the same value: computed once (log r reads the whole
        # element, the costliest part of a step after the model)
        cached = getattr(self, "_cached", None)
        if cached is not None and cached[0] is value:
            return cached[1]
        log_q = self.base.log_prob(value)
        log_q, log_r = torch.broadcast_tensors(log_q, self.log_r(value))
        self._cached = (value, (log_q, log_r))
        return log_q, log_r

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        log_q, log_r = self._parts(value)
        return log_q - log_r

    def score_parts(self, value: torch.Tensor) -> ScoreParts:
        log_q, log_r = self._parts(value)
        log_prob = log_q - log_r
        if self.has_rsample:
            return ScoreParts(log_prob=log_prob, score_function=0, entropy_term=log_prob)
        return ScoreParts(log_prob=log_prob, score_function=log_q, entropy_term=-log_r)


@register_kl(HVMSiteDistribution, torch.distributions.Distribution)
def _refuse_analytic_kl(p, q):
    raise TypeError(
        "AutoHierarchicalVM: an analytic KL divergence was requested for one of its discrete latent sites (this is "
        "what TraceMeanField_ELBO does). Its guide density q(z|λ)/r(λ|z) has no closed-form KL, and "
        "TraceMeanField_ELBO has no score-function estimator for discrete sites. Train with Trace_ELBO, "
        "TraceGraph_ELBO (lower variance) or TraceEnum_ELBO."
    )


# ---- per-site variational likelihood families ---------------------------------------------------------------------
@dataclass(frozen=True)
class _SiteSpec:
    """How one latent site is represented: its family, value shape per element and block of λ."""

    name: str
    family: str  # "normal" | "bernoulli" | "categorical" | "poisson" | "binomial"
    elem_shape: torch.Size  # value shape per plate element (globals: the whole shape)
    event_dim: int  # event dims of the sampled value (unconstrained space for continuous sites)
    batch_dims: int  # non-plate batch dims kept inside elem_shape (globals only)
    offset: int  # start of the site's block in the element's λ
    low: int = 0  # categorical: smallest value
    count: int = 0  # categorical: number of values; binomial: total count
    key: str = ""  # the site's name as a parameter name (see pyro_hier.guides.base.parameter_keys)

    @cached_property
    def continuous(self) -> bool:
        return self.family == "normal"

    @cached_property
    def num_params(self) -> int:
        return {"normal": 2, "categorical": self.count}.get(self.family, 1)

    @cached_property
    def num_features(self) -> int:
        return {"normal": 3, "bernoulli": 2, "categorical": self.count}.get(self.family, 3)

    @cached_property
    def num_coords(self) -> int:
        return math.prod(self.elem_shape)

    @cached_property
    def size(self) -> int:
        return self.num_coords * self.num_params

    def normal(self, loc: torch.Tensor, raw_scale: torch.Tensor) -> TorchDistribution:
        """``q(z | λ)`` of a continuous site from its location and free log-sd, ``(..., *elem_shape)`` each: what
        :meth:`likelihood` gives for their stack ``(..., *elem_shape, 2)``."""
        # (not validated: the guide's own parameters, the sd through the positive map; a NaN still shows in the loss)
        d = _NoiseNormal(loc, positive(raw_scale), validate_args=False)
        return d.to_event(self.event_dim) if self.event_dim else d

    def likelihood(self, params: torch.Tensor, *, event: bool = True) -> TorchDistribution:
        """``q(z | λ)`` from ``params`` of shape ``(..., *elem_shape, P)`` (``event=False``: one factor per
        coordinate, no event dims)."""
        if self.family == "normal":
            # (not validated: the guide's own parameters, the sd through the positive map; a NaN still shows in the
            # loss, which Pyro checks)
            d = dist.Normal(params[..., 0], positive(params[..., 1]), validate_args=False)
        elif self.family == "bernoulli":
            d = dist.Bernoulli(logits=params[..., 0])
        elif self.family == "categorical":
            d = _ShiftedCategorical(params, self.low)
        elif self.family == "poisson":
            d = dist.Poisson(params[..., 0].clamp(max=30.0).exp())
        else:
            d = dist.Binomial(self.count, logits=params[..., 0])
        return d.to_event(self.event_dim) if (event and self.event_dim) else d

    def features(self, z: torch.Tensor, standard: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Features of the value by which ``r(λ | z)`` depends on ``z``: ``(..., *elem_shape, F)``.

        Continuous sites: ``(1, t, t²)`` with ``t = (z − c) / s`` standardised by ``standard = (c, s)``, the centre
        and sd of ``q(z)`` (:meth:`AutoHierarchicalVM._standardisers`). Features of the raw unconstrained value
        made ``r``'s log-sd ``b·f`` quadratic in a value far from 0 (``u ≈ −5`` for an sd under a Uniform(0, 100)
        prior): one step on ``b`` moved it by ``25 lr``, and ``e^{b·f}`` overflowed the loss."""
        if self.family == "bernoulli":
            return torch.stack([torch.ones_like(z), z], -1)
        if self.family == "categorical":
            return nn.functional.one_hot((z - self.low).long(), self.count).to(z.dtype)
        if self.family == "normal":
            t = z if standard is None else (z - standard[0]) / standard[1]
        elif self.family == "poisson":
            t = z.log1p()
        else:
            p = (z + 0.5) / (self.count + 1)
            t = p.log() - (-p).log1p()
        return torch.stack([torch.ones_like(t), t, t * t], -1)


class _NoiseNormal(dist.Normal):
    r"""``Normal`` whose density at its own last reparameterised draw :math:`x = \mu + \sigma\varepsilon` is computed
    from the noise: :math:`-\varepsilon^2/2 - \log\sigma - \log\sqrt{2\pi}` with :math:`\varepsilon` a constant.
    As a function of the parameters (``x`` moving with them) that is the density's value and its total derivative
    exactly (:math:`(x - \mu)/\sigma = \varepsilon` whatever they are), in three steps of the gradient's graph
    instead of nine; Pyro's ELBOs score a draw at itself. Any other value (a replayed one) takes the usual formula."""

    def rsample(self, sample_shape=()) -> torch.Tensor:
        shape = self._extended_shape(torch.Size(sample_shape))
        eps = torch.distributions.utils._standard_normal(shape, dtype=self.loc.dtype, device=self.loc.device)
        x = self.loc + eps * self.scale
        self._draw = (x, eps)
        return x

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        draw = getattr(self, "_draw", None)
        if draw is not None and draw[0] is value:
            return -0.5 * draw[1].pow(2) - self.scale.log() - 0.5 * math.log(2 * math.pi)
        return super().log_prob(value)


class _ShiftedCategorical(dist.Categorical):
    """Categorical over ``low, low + 1, …`` (value = index + low), with float values like the model's site."""

    def __init__(self, logits: torch.Tensor, low: int) -> None:
        self.low = low
        super().__init__(logits=logits)

    def expand(self, batch_shape, _instance=None):
        return _ShiftedCategorical(self.logits.expand(torch.Size(batch_shape) + self.logits.shape[-1:]), self.low)

    def sample(self, sample_shape=()):
        return super().sample(sample_shape) + self.low

    def log_prob(self, value):
        return super().log_prob((value - self.low).long())


@dataclass(frozen=True)
class _Level:
    """Latent sites sharing one set of plates; every plate element has its own λ of length ``numel``."""

    name: str
    plates: tuple[str, ...]
    sites: tuple[_SiteSpec, ...]
    batch_shape: torch.Size
    key: str = ""  # the level's name as a parameter name

    @cached_property
    def numel(self) -> int:
        return sum(s.size for s in self.sites)


def _family(site: LatentSite) -> tuple[str, int, int]:
    """``(family, low, count)`` for a site, from its support (and distribution for Binomial)."""
    if not site.discrete:
        return "normal", 0, 0
    support = site.support
    while hasattr(support, "base_constraint"):  # independent(...), a mixture's constraint
        support = support.base_constraint
    fn = unwrap(site.fn)
    if support is constraints.boolean:
        return "bernoulli", 0, 0
    if support is constraints.nonnegative_integer:
        return "poisson", 0, 0
    if isinstance(support, constraints.integer_interval):
        if isinstance(fn, torch.distributions.Binomial):
            n = torch.as_tensor(fn.total_count)
            if n.numel() and bool((n == n.reshape(-1)[0]).all()) and float(n.reshape(-1)[0]).is_integer():
                return "binomial", 0, int(n.reshape(-1)[0])
            raise StructureError(
                f"site '{site.name}' is Binomial with varying total_count; AutoHierarchicalVM needs one total_count "
                "per site (split the site, or enumerate it with infer={'enumerate': 'parallel'})"
            )
        low, high = support.lower_bound, support.upper_bound
        if isinstance(low, int | float) and isinstance(high, int | float) and 0 < high - low + 1 <= _MAX_CATEGORIES:
            return "categorical", int(low), int(high - low + 1)
    raise StructureError(
        f"site '{site.name}' has discrete support {site.support} that AutoHierarchicalVM has no variational "
        "likelihood for (it handles boolean → Bernoulli, integer_interval → Categorical/Binomial, "
        "nonnegative_integer → Poisson). Enumerate the site with infer={'enumerate': 'parallel'} and TraceEnum_ELBO "
        "(Pyro's tutorial: https://pyro.ai/examples/enumeration.html)."
    )


# ---- the guide ----------------------------------------------------------------------------------------------------
class AutoHierarchicalVM(HierarchicalGuide):
    r"""Hierarchical variational model (Ranganath, Tran & Blei 2016) as an autoguide: a mean-field variational
    likelihood whose parameters :math:`\lambda` have a flexible variational prior, so the guide can be correlated and
    multimodal, for **discrete latents without enumeration** as well as for continuous ones.

    Latent sites are grouped by their plates into levels (the globals, and one level per set of plates). Every
    element :math:`i` of a level has its own

    - variational prior :math:`q(\lambda_i; \theta_i)`: ``prior="mixture"`` — a mixture of ``num_components``
      diagonal Gaussians (:class:`ImplicitMixtureOfDiagNormals`, pathwise gradients); ``prior="flow"`` —
      :math:`\lambda_i = \mu_i + \sigma_i \odot g(\varepsilon)`, :math:`\varepsilon \sim \mathcal N(0, I)`, with
      :math:`g` a Pyro spline (autoregressive) flow of ``flow_layers`` layers shared by the level's elements;
    - variational likelihood :math:`\prod_d q(z_{i,d} \mid \lambda_{i,d})`, one factor per latent coordinate, chosen
      from the site's support: Normal :math:`(\lambda_1, e^{\lambda_2})` in unconstrained space for continuous sites
      (then mapped with ``biject_to`` as ``AutoNormal`` does), Bernoulli(logits), Categorical(logits),
      Poisson(:math:`e^\lambda`), Binomial(logits);
    - auxiliary :math:`r(\lambda_i \mid z_i)`, the paper's factorised *inverse flow* (eq. 9):
      :math:`\lambda_0 = L\lambda` with :math:`L` unit lower triangular, then
      :math:`r(\lambda \mid z) = \prod_j \mathcal N(\lambda_{0,j};\ a_j^\top f(z_{c(j)}),\ e^{2 b_j^\top f(z_{c(j)})})`
      where coordinate :math:`j` of :math:`\lambda` parameterises latent coordinate :math:`c(j)` and :math:`f` are
      features of one value (indicator/one-hot for Bernoulli and Categorical; :math:`(1, t, t^2)` with
      :math:`t = \log(1 + z)` for counts, the logit of :math:`(z + ½)/(n + 1)` for Binomial, :math:`u` itself for
      continuous sites). Each term of :math:`\log r` depends on one latent coordinate, which keeps the
      score-function learning signal local (eq. 8).

    **Conditioning on the parents** (``condition_on_parents=True``, continuous sites). A continuous site of a plate
    level depends on the continuous values of its *parent* levels (the globals, and outer plate levels whose
    elements it reads one each, nested or gathered by index: :meth:`_level_parents`) through an affine map:
    :math:`z_c = \bar w_c + a_c + e^{b_c} (w_c - \bar w_c)` with :math:`w` the HVM draw above, :math:`\bar w_c` the
    centre of :math:`q(w_c)` (a constant of each step) and
    :math:`(a_c, b_c) = S_c\,(u_{\text{pa}} - \bar u_{\text{pa}})` linear in the parents' unconstrained values
    (centred). The stretch acts about the centre, so the map does not depend on
    where the origin of the unconstrained space lies (stretched about 0, radon's county effects, near 1.4, moved by 1.4
    b with the county scale, and q of that scale shrank to 0.08 of its posterior sd). Each level is then an HVM
    conditioned on its parents, :math:`q(z) = \prod_\ell q(z_\ell \mid z_{\text{pa}(\ell)})`, and the bound holds level
    by level with ``r`` reading :math:`w`. The slopes :math:`S` are read from the model: for a Gaussian prior
    conditional :math:`\mathcal N(m_0, P^{-1})` and a rest of the model of curvature :math:`H`, the Gaussian conditional
    posterior's location moves with a parent :math:`p` by :math:`\rho\,(m_0' - 2 (\log \mathrm{sd}_0)' (m_0 - u))` and
    its log-sd by :math:`\rho\,(\log \mathrm{sd}_0)'` with the shrinkage :math:`\rho = P / (P + H)`, so weakly
    identified groups are non-centred (:math:`\theta_i = \mu + \tau w_i`) and well identified ones centred. The reading
    is done at the init values and again every :data:`SLOPE_REFRESH` training calls at the centre of ``q`` (Adam's
    changes on top are kept, at :data:`READ_SLOPE_RATE` times its rate; slopes the model does not give are learnt
    from zero at :data:`SLOPE_RATE` times its rate). This lets ``q`` express the dependence of group
    effects on the population location and scale that mean-field families miss (a funnel's). A level whose
    children follow it is read with them following (:meth:`_children_schur`): its shrinkage is that of its
    marginal, the children integrated out.

    **Averaging.** Outside training (``Predictive``, ``median``, ``quantiles``: calls without gradients) ``q`` uses the
    tail average of its parameters over about the last :data:`TAIL_FRACTION` of the training steps (Polyak–Ruppert),
    for levels of continuous sites without a subsampled plate; ``r``'s parameters are not averaged (they do not enter
    the draws). The average is state without gradients (:meth:`state_parameters`).

    **Variance reduction.** The gradient of λ's locations in plate levels carries a control variate
    (:meth:`_location_control_variate`): the model's curvature times each element's own draw noise, zero on average,
    is taken out of it, exactly for a Gaussian conditional. Without it Adam kept every group's location jittering
    about its optimum by an amount growing with the rate, and the population scale, fitted to the spread of the group
    effects, absorbed the jitter: in the drop-in loop at Adam's rate 0.05 radon's county scale ended 0.64-0.71
    posterior sds high (3 seeds; AutoNormal's max error 0.55-0.76), with the control variate 0.38-0.44. The global
    locations of sites with a Gaussian prior carry one too (:meth:`_global_control_variate`), with the curvature
    estimated from the run itself, since the children follow the globals through their slopes
    (:meth:`_update_global_control_variate`). A global's own draw noise was most of its location's gradient noise,
    and Adam, whose steps shrink with the gradient's signal-to-noise ratio, left the non-centred eight schools' mean
    (posterior 4.41 ± 3.31) at 4.22-4.34 after 5,000 steps at rate 0.005 (seeds 0-2; AutoNormal 4.25-4.28), its tail
    average at 4.12-4.24; with it the last iterate was at 4.47-4.49 and the average at 4.39-4.40.

    **Rates.** The locations of λ in plate levels are :data:`LOCAL_RATE` times their free parameters (1 by default: at
    a half, radon at Adam's rate 0.05 gained, the county scale's error 0.63 → 0.44 posterior sds, but the centred eight
    schools lost, tau collapsing on one seed of three). Slopes: :data:`READ_SLOPE_RATE`, :data:`SLOPE_RATE` (above).

    Elements of a plate are independent given the parents; their parameters have the plates' full sizes and are
    sliced by the model's own subsample indices, so minibatch training is unbiased.

    **Loss.** Use Pyro's ``Trace_ELBO`` (also vectorised or JIT), ``TraceGraph_ELBO`` (lower variance for discrete
    sites: each score is weighted by its downstream costs only) or ``TraceEnum_ELBO`` (when other discrete sites of
    the model are enumerated). All three give unbiased gradients of the hierarchical ELBO, because :math:`\log r` is
    part of each site's reported density (:class:`HVMSiteDistribution`) rather than a guide factor that
    ``Trace_ELBO`` would leave out of the learning signal; the tests check the gradients of all three against the
    exact gradient by enumeration. ``TraceMeanField_ELBO`` raises for discrete sites (it has no score-function
    estimator). The loss is :math:`-\tilde{\mathcal L}`, a bound looser than the ELBO of :math:`q(z)` itself by
    :math:`\mathbb E_q\,\mathrm{KL}(q(\lambda \mid z) \,\|\, r(\lambda \mid z))`.

    **Summaries.** ``median`` and ``quantiles`` are Monte Carlo estimates from ``num_summary_samples`` draws (with a
    fixed seed, so repeated calls agree and the 0.5 quantile equals the median); for the mixture prior,
    :meth:`log_marginal` gives :math:`\log q(z)` of discrete global sites by quadrature.

    Example::

        guide = AutoHierarchicalVM(model, prior="mixture", num_components=4)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), TraceGraph_ELBO())
        for step in range(2000):
            svi.step(data)
        samples = Predictive(model, guide=guide, num_samples=100)(data)

    :param model: a Pyro model. Discrete sites marked for enumeration are left to ``TraceEnum_ELBO``; every other
        latent site (continuous or discrete) is covered.
    :param prior: ``"mixture"`` or ``"flow"``.
    :param num_components: mixture components of every level (``prior="mixture"``). Default: 1 for a level whose sites
        are all continuous, :data:`DISCRETE_COMPONENTS` (4) for a level with a discrete site, where the mixture is
        what correlates the coordinates of an element. In the drop-in loop (``ClippedAdam(lr=0.01)`` decaying ×0.1
        over 5,000 steps, one particle; ``benchmarks/dropin.py``) more components cost speed and accuracy on
        continuous models: radon (Uniform priors, seed 0) max mean error 4.99 sd with 4 components, 1.35 with 2,
        0.63 with 1 (AutoNormal 0.66), at 3.2× / 2.2× AutoNormal's step time for 4 / 1. Pass a number to get the
        multimodal guide everywhere.
    :param flow_layers: spline layers of the flow (``prior="flow"``).
    :param flow_hidden: hidden width of the autoregressive networks of the flow (at least the level's number of λ
        coordinates, which a masked autoregressive network needs).
    :param init_loc_fn: initial locations of continuous sites (as in ``AutoNormal``).
    :param init_scale: initial sd of ``q(z)`` for continuous sites in unconstrained space (split between
        ``q(z | λ)`` and the spread of λ, half of the variance each), and of λ for discrete sites.
    :param init_spread: continuous sites: sd of the random offsets of the mixture components' means at the start,
        in units of ``init_scale / 2`` (discrete sites start each component at the link of one prior draw).
    :param num_summary_samples: draws behind ``median`` and ``quantiles``.
    :param baseline_beta: if given (e.g. ``0.9``), ``TraceGraph_ELBO`` subtracts a running-average baseline with this
        decay from each discrete site's learning signal (unbiased; lowers the score-function variance). Other ELBOs
        ignore it. Pyro keeps that average per particle, so keep ``num_particles`` fixed during a run.
    :param condition_on_parents: condition continuous sites of plate levels on the globals' values (above);
        ``False``: levels independent, as in the original HVM.
    :param create_plates: optional plates to use instead of the model's (as in ``AutoNormal``).

    Reference: R. Ranganath, D. Tran, D. Blei, *Hierarchical Variational Models*, ICML 2016.
    """

    def __init__(
        self,
        model: Callable,
        *,
        prior: str = "mixture",
        num_components: int | None = None,
        flow_layers: int = 2,
        flow_hidden: int = 16,
        init_loc_fn: Callable = init_to_feasible,
        init_scale: float = 0.1,
        init_spread: float = 1.0,
        num_summary_samples: int = 2000,
        baseline_beta: float | None = None,
        condition_on_parents: bool = True,
        create_plates: Callable | None = None,
    ) -> None:
        if prior not in _PRIORS:
            raise ValueError(f"prior must be one of {_PRIORS}, got {prior!r}")
        for label, value in (
            ("num_components", 1 if num_components is None else num_components),
            ("flow_layers", flow_layers),
            ("flow_hidden", flow_hidden),
            ("num_summary_samples", num_summary_samples),
        ):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{label} must be a positive integer, got {value!r}")
        for label, value in (("init_scale", init_scale), ("init_spread", init_spread)):
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{label} must be a positive number, got {value!r}")
        if baseline_beta is not None and not (isinstance(baseline_beta, int | float) and 0 <= baseline_beta < 1):
            raise ValueError(f"baseline_beta must be None or in [0, 1), got {baseline_beta!r}")
        self.baseline_beta = baseline_beta
        self.condition_on_parents = bool(condition_on_parents)
        self.prior = prior
        self.num_components = num_components
        self.flow_layers = flow_layers
        self.flow_hidden = flow_hidden
        self._init_scale = float(init_scale)
        self._init_spread = float(init_spread)
        self.num_summary_samples = num_summary_samples
        super().__init__(model, init_loc_fn=init_loc_fn, create_plates=create_plates)

    def components(self, level: _Level) -> int:
        """Mixture components of a level's prior: ``num_components`` if given, else 1 for a level of continuous sites
        only and :data:`DISCRETE_COMPONENTS` for a level with a discrete site (see the class docstring)."""
        if self.num_components is not None:
            return self.num_components
        return 1 if all(s.continuous for s in level.sites) else DISCRETE_COMPONENTS

    # ---- structure ----------------------------------------------------------------------------------------------
    def _check_sites(self, structure: ModelStructure) -> None:
        if not self._sites(structure):
            raise StructureError(
                "the model has no latent sites that are not enumerated: AutoHierarchicalVM has nothing to approximate"
            )
        for name in self._sites(structure):
            site = structure.latent[name]
            _family(site)
            if site.plates:
                shape = site.unconstrained_shape if not site.discrete else site.shape
                event_dim = site.unconstrained_event_dim if not site.discrete else site.event_dim
                batch_len = len(shape) - event_dim
                for pos in range(batch_len):
                    if pos - batch_len not in site.plate_dims and shape[pos] != 1:
                        raise StructureError(
                            f"site '{name}' has a batch dim {pos - batch_len} of size {shape[pos]} that is not a "
                            "plate. Declare per-element vectors as events (e.g. .to_event(1)) or put that dim in a "
                            "pyro.plate."
                        )

    @staticmethod
    def _sites(structure: ModelStructure) -> tuple[str, ...]:
        return tuple(n for n, s in structure.latent.items() if not s.enumerated)

    @property
    def guide_sites(self) -> tuple[str, ...]:
        """The latent sites this guide samples: every latent site that is not enumerated, discrete ones included."""
        assert self.structure is not None
        return self._sites(self.structure)

    def _build_levels(self, structure: ModelStructure) -> tuple[_Level, ...]:
        groups: dict[frozenset[str], list[str]] = {}
        for name in self.guide_sites:
            groups.setdefault(frozenset(structure.latent[name].plates), []).append(name)
        order = {n: i for i, n in enumerate(structure.latent)}
        site_keys = parameter_keys(self.guide_sites)
        level_names = {k: "__".join(sorted(k, key=list(structure.plates).index)) or "globals" for k in groups}
        level_keys = parameter_keys(list(level_names.values()))
        keys = sorted(groups, key=lambda k: (len(k), min(order[n] for n in groups[k])))
        levels = []
        for key in keys:
            plates = tuple(sorted(key, key=list(structure.plates).index))
            batch = [1] * max((-structure.plates[p].dim for p in plates), default=0)
            for p in plates:
                batch[structure.plates[p].dim] = structure.plates[p].size
            specs, offset = [], 0
            for name in groups[key]:
                site = structure.latent[name]
                family, low, count = _family(site)
                shape = site.unconstrained_shape if not site.discrete else site.shape
                event_dim = site.unconstrained_event_dim if not site.discrete else site.event_dim
                if plates:
                    elem, batch_dims = shape[len(shape) - event_dim :], 0
                else:
                    elem, batch_dims = shape, len(shape) - event_dim
                spec = _SiteSpec(
                    name, family, torch.Size(elem), event_dim, batch_dims, offset, low, count, site_keys[name]
                )
                specs.append(spec)
                offset += spec.size
            name = "__".join(plates) or "globals"
            levels.append(_Level(name, plates, tuple(specs), torch.Size(batch), level_keys[name]))
        return tuple(levels)

    # ---- parameters ---------------------------------------------------------------------------------------------
    def _setup_guide(self, structure: ModelStructure) -> None:
        self.__dict__["_param_keys"] = {}  # (see _level_param_keys; filled once the averages are known)
        self.levels: tuple[_Level, ...] = self._build_levels(structure)
        self.prior_params = PyroModule()
        self.aux_params = PyroModule()
        self.flows = nn.ModuleDict()
        self.parents: dict[str, tuple[str, ...]] = self._level_parents(self.levels, structure)
        if not self.condition_on_parents:
            self.parents = {name: () for name in self.parents}
        reads, precisions = self._read_slopes()
        for level in self.levels:
            self._setup_level(level, reads.get(level.name, {}), precisions.get(level.name, {}))
        # the tail average of q's parameters (see _element_params): state without gradients, kept as parameters so
        # that Pyro's param store, state_dict and pickling carry it; levels of continuous sites only, without a
        # subsampled plate
        self.averages = PyroModule()
        self._averaged: tuple[str, ...] = tuple(
            attr
            for level in self.levels
            if all(s.continuous for s in level.sites) and not any(structure.plates[p].subsampled for p in level.plates)
            for attr in self._q_keys(level)
        )
        for attr in self._averaged:
            event_dim = self.prior_params._pyro_params[attr][1]
            value = getattr(self.prior_params, attr).detach().clone()
            setattr(self.averages, attr, PyroParam(value, constraints.real, event_dim=event_dim))
            getattr(self.averages, attr)  # (read once: a trace of this call records the parameter, not its init)
        if self._averaged:
            self.averages.count = PyroParam(torch.zeros(()).to(value), constraints.real)
            _ = self.averages.count

    def _q_keys(self, level: _Level) -> list[str]:
        """The level's parameters of ``q(z)`` itself (``prior_params``: λ's prior and the slopes on the parents),
        not of ``r``."""
        keys = [f"{level.key}_{k}" for k in self._prior_keys()]
        if self.parents[level.name]:
            keys += [f"{spec.key}_slopes" for spec in level.sites if spec.continuous]
        return keys

    def state_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The guide's parameters that are state, not optimised (no gradient reaches them): the tail average of
        ``q``'s parameters and its count, the last slopes read from the model, the conditional precisions of the
        control variate (:meth:`_location_control_variate`) and the globals' estimated precisions and the moments
        behind them (:meth:`_update_global_control_variate`). Leave them out of hand-built optimisers."""
        out = {f"averages.{k}": v for k, v in self.averages.named_parameters()}
        for module in ("slope_reads", "precisions"):
            if hasattr(self, module):
                out.update({f"{module}.{k}": v for k, v in getattr(self, module).named_parameters()})
        return out

    def _attach_hook(self) -> None:
        """Hook :meth:`_update_averages` onto the gradient accumulation of one of q's parameters (once per tensor:
        again after unpickling, loading or moving): it then follows any training loop, eager or JIT-compiled, and a
        call that is not followed by a backward pass (a summary, a manual call) changes nothing."""
        leaf = self.prior_params._parameters[f"{self._averaged[0]}_unconstrained"]  # (direct: no attribute walk)
        hooked = getattr(self, "_hooked", None)
        if (hooked is not None and hooked() is leaf) or not leaf.requires_grad:
            return
        self._hooked = weakref.ref(leaf)
        guide = weakref.ref(self)
        leaf.register_post_accumulate_grad_hook(lambda t, guide=guide: _average_hook(guide))

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_hooked"] = None  # gradient hooks are not pickled: the first training call installs them again
        state.pop("_untraced_params", None)  # (tensors of this process, see _element_params)
        state.pop("_global_cv", None)  # (this process's last training call, see _global_control_variate)
        return state

    @torch.no_grad()
    def _update_averages(self) -> None:
        """After a training step's backward pass: add the current parameters to their tail average (about the last
        :data:`TAIL_FRACTION` of the steps so far; :func:`~pyro_hier.optim.tail_average_update`). Read as the raw
        tensors, so ``SVI``'s parameter capture does not see them."""
        held, live = self.averages._parameters, self.prior_params._parameters  # (direct: no attribute walk)
        count = held["count_unconstrained"]
        count.add_(1)
        averages = [held[f"{attr}_unconstrained"] for attr in self._averaged]
        values = [live[f"{attr}_unconstrained"] for attr in self._averaged]
        tail_average_update(averages, values, int(count), TAIL_FRACTION)  # (one fused update of all of them)

    def _use_average(self) -> bool:
        """Outside training (``Predictive``, ``median``, ``quantiles``: any call without gradients) ``q`` uses the tail
        average of its parameters instead of the last iterate."""
        return (
            bool(self._averaged)
            and not torch.is_grad_enabled()
            and float(self.averages._parameters["count_unconstrained"]) > 0
        )

    def _level_parents(self, levels: tuple[_Level, ...], structure: ModelStructure) -> dict[str, tuple[str, ...]]:
        """Each plate level's *parents*: the global level, if it has a continuous site, and every earlier plate level
        of continuous sites whose elements the level's continuous sites read one each (:meth:`_outer_index`: an
        outer plate the level is nested in, or a plate gathered by one index, ``b[..., state_of_county]`` in a plate
        of counties). A level's continuous sites are conditioned on their parents' continuous values
        (:meth:`_affine`). The nested and the gathered formulation of a model get the same parents. Without the outer
        levels a county was conditioned on its prior's scale but not on its location, half a non-centred form: with
        the state effects drawn independently of the counties, the counties' spread about their state no longer
        shrank with the scale, and ``q`` kept the scale from small values (``unseen.py``'s ``nested``, seeds 0-2:
        ``s_a`` 0.31-0.36 posterior sds high; 0.04-0.05 without any conditioning)."""
        index: dict[tuple[str, str], torch.Tensor] = {}
        out = {}
        for i, level in enumerate(levels):
            if not level.plates or not any(s.continuous for s in level.sites):
                out[level.name] = ()
                continue
            parents = [lv.name for lv in levels if not lv.plates and any(s.continuous for s in lv.sites)]
            for outer in levels[:i]:
                if not outer.plates or not all(s.continuous for s in outer.sites):
                    continue
                found = self._outer_index(level, outer, structure)
                if found is not None:
                    parents.append(outer.name)
                    index[(level.name, outer.name)] = found
            out[level.name] = tuple(parents)
        self.__dict__["_parent_index"] = index
        return out

    @staticmethod
    def _outer_index(level: _Level, outer: _Level, structure: ModelStructure) -> torch.Tensor | None:
        """For a plate level and an earlier plate level ``outer``, the flat position in ``outer``'s elements of the
        one element that each of the level's elements reads, ``(prod(level.batch_shape),)``; ``None`` if there is
        no such map. Two cases: ``outer``'s plates are all plates of the level (nested: the element at the same
        position), or ``outer`` has one plate, not the level's, which the level's continuous sites read from
        ``outer``'s sites with one index, the same for every reading (gathered, :attr:`ModelStructure.gathers`). No
        map where a plate of either level is subsampled (the index would change from call to call)."""
        if any(structure.plates[p].subsampled for p in (*level.plates, *outer.plates)):
            return None
        size = math.prod(level.batch_shape)
        if set(outer.plates) < set(level.plates):
            grid = torch.arange(math.prod(outer.batch_shape)).reshape(outer.batch_shape)
            lead = len(level.batch_shape) - len(outer.batch_shape)
            return grid.reshape((1,) * lead + grid.shape).expand(level.batch_shape).reshape(size)
        if len(outer.plates) != 1 or outer.plates[0] in level.plates:
            return None
        sources = {s.name for s in outer.sites}
        index = None
        for spec in level.sites:
            if not spec.continuous:
                continue
            try:
                gathers = structure.gathers_of(spec.name)
            except StructureError:
                return None
            for g in gathers:
                if g.source not in sources:
                    continue
                if g.plate != outer.plates[0] or g.index.numel() != size or bool((g.index < 0).any()):
                    return None
                flat = g.index.reshape(size)
                if index is not None and not torch.equal(index, flat):
                    return None
                index = flat
        return None if index is None else index.cpu()

    def _parent_inputs(
        self, level: _Level, parent_values: dict[str, torch.Tensor], plates: dict[str, pyro.plate] | None = None
    ) -> torch.Tensor | None:
        """What the level's :meth:`_affine` reads: its parents' values (:meth:`_parent_values`), an outer level's
        taken at the element each of the level's elements reads (:meth:`_outer_index`), side by side. On a call
        whose ``plates`` subsample either level, each of the call's elements of the level reads its outer element's
        position among the call's elements of the outer level (:meth:`_call_outer_positions`)."""
        parents = self.parents[level.name]
        if not parents:
            return None
        index = self.__dict__.get("_parent_index", {})
        by_name = {lv.name: lv for lv in self.levels}
        parts = []
        for name in parents:
            x = parent_values[name]
            outer = index.get((level.name, name))
            if outer is not None:
                p = by_name[name]
                n = len(p.batch_shape) + 1
                lead = x.shape[: x.dim() - n]
                positions, shape, outer_shape = self._call_outer_positions(level, p, outer, plates)
                x = x.expand((*lead, *outer_shape, x.shape[-1])).reshape((*lead, -1, x.shape[-1]))
                x = x.index_select(-2, positions.to(x.device)).reshape((*lead, *shape, x.shape[-1]))
            parts.append(x)
        return parts[0] if len(parts) == 1 else concat_broadcast(parts)

    def _call_outer_positions(
        self, level: _Level, outer_level: _Level, outer: torch.Tensor, plates: dict[str, pyro.plate] | None
    ) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
        """``(positions, shape, outer_shape)``: for each of this call's elements of ``level`` (batch ``shape``), the
        position of the outer element it reads (``outer``: full flat indices, :meth:`_outer_index`) among this call's
        elements of ``outer_level`` (batch ``outer_shape``); ``outer`` itself at full sizes when neither level is
        subsampled on this call."""
        assert self.structure is not None
        st = self.structure
        names = (*level.plates, *outer_level.plates)
        if plates is None or all(int(plates[q].subsample_size) == st.plates[q].size for q in names if q in plates):
            return outer, tuple(level.batch_shape), tuple(outer_level.batch_shape)

        def call_flat(lv: _Level) -> torch.Tensor:  # the full flat index of each of the call's elements
            grid = torch.arange(math.prod(lv.batch_shape), device=outer.device).reshape((*lv.batch_shape, 1))
            dims = [st.plates[q].dim for q in lv.plates]
            return select_elements(grid, element_selection(plates, lv.plates, dims), 1)[..., 0]

        mine, theirs = call_flat(level), call_flat(outer_level)
        lookup = torch.full((math.prod(outer_level.batch_shape),), -1, dtype=torch.long, device=outer.device)
        lookup[theirs.reshape(-1)] = torch.arange(theirs.numel(), device=outer.device)
        positions = lookup[outer.to(mine.device)[mine.reshape(-1)]]
        if bool((positions < 0).any()):
            raise StructureError(
                f"plate level '{level.name}' reads elements of '{outer_level.name}' that are not in this call's "
                f"subsample of plate(s) {list(outer_level.plates)}: subsample the outer plate with the elements its "
                "inner elements read (or not at all)"
            )
        return positions, tuple(mine.shape), tuple(theirs.shape)

    def _num_parent_coords(self, level: _Level) -> int:
        by_name = {lv.name: lv for lv in self.levels}
        return sum(s.num_coords for p in self.parents[level.name] for s in by_name[p].sites if s.continuous)

    def _siblings(self, level: _Level, spec: _SiteSpec) -> list[_SiteSpec]:
        """The continuous sites of the level before ``spec`` that it is conditioned on (:meth:`_site_inputs`): all of
        them, for a continuous site of a plate level with parents (none otherwise)."""
        if not (spec.continuous and level.plates and self.parents[level.name]):
            return []
        out = []
        for other in level.sites:
            if other is spec:
                return out
            if other.continuous:
                out.append(other)
        return out

    def _num_sibling_coords(self, level: _Level, spec: _SiteSpec) -> int:
        return sum(s.num_coords for s in self._siblings(level, spec))

    def _site_inputs(
        self,
        level: _Level,
        spec: _SiteSpec,
        x: torch.Tensor | None,
        unconstrained: dict[str, torch.Tensor],
        params: dict[str, torch.Tensor],
    ) -> torch.Tensor | None:
        r"""What the site's :meth:`_affine` reads: the parents' values ``x`` (:meth:`_parent_inputs`) and, after them,
        the element's earlier continuous sites less the centre of their ``q(w)`` (:meth:`_siblings`), so that
        ``q`` of an element is :math:`q(z_1 \mid \mathrm{pa})\, q(z_2 \mid z_1, \mathrm{pa}) \cdots`, each factor
        Gaussian with a location (and log-sd) affine in what it reads. The slopes on the siblings are the Gaussian
        conditional's, :math:`-\Lambda_{21} / \Lambda_{22}` from the model's curvature (:meth:`_shrinkage`). With the
        coordinates of an element independent, a group of ``unseen.py``'s ``hetero`` with five observations, whose
        location's posterior is skewed towards the population mean by its own noise scale (skewness 1.0), was at
        best (the optimum of that family, the globals at their posterior means, by quadrature) 0.28 posterior sds off
        with sd ratio 0.68; the noise scale's log affine in the location: 0.06 off, sd ratio 0.79."""
        siblings = self._siblings(level, spec)
        if not siblings or x is None:
            return x
        parts = [x]
        for other in siblings:
            centre = self._standardiser(level, other, params)[0].detach()
            batch = centre.shape[: centre.dim() - len(other.elem_shape)]
            u = unconstrained[other.name]
            u = u.reshape((*u.shape[: u.dim() - len(other.elem_shape)], other.num_coords))
            parts.append(u - centre.reshape((*batch, -1)))
        return concat_broadcast(parts)

    def _init_site(self, level: _Level, spec: _SiteSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Initial λ of a site: its centre ``level.batch_shape + (size,)``, one start per mixture component
        ``level.batch_shape + (K, size)`` and the initial sd of λ around them (the mixture components' or the flow's
        scale), ``level.batch_shape + (size,)``.

        Continuous sites, with ``s = init_scale``: ``q(z | λ)`` has sd ``s/√2`` and the location ``λ₁`` spreads
        with variance ``s²/2`` — components of sd ``s/2`` offset by ``±(s/2)·init_spread·ε`` in antithetic pairs (a
        zero offset for odd K; random ``ε`` scaled to mean square 1 over the components), or the flow's scale
        ``s/√2`` — so ``q(z)`` starts with sd ``s`` (with ``init_spread = 1``) and, being symmetric about the init
        location, with its median there, as ``AutoNormal``'s does. Discrete sites: the prior's mean, and for the
        components the link of one (smoothed) prior draw each, so the components start spread over the prior's
        support; λ's sd is ``s``."""
        assert self.structure is not None
        site = self.structure.latent[spec.name]
        k = self.components(level)
        lead = level.batch_shape
        s = self._init_scale
        if spec.continuous:
            u = self._init_unconstrained(site)
            f = _LOC_SPREAD_FRACTION
            lam = torch.stack([u, torch.full_like(u, math.log(s * math.sqrt(1 - f)))], -1).reshape((*lead, -1))
            loc_sd = s * math.sqrt(f / 2) if self.prior == "mixture" and k > 1 else s * math.sqrt(f)
            sd = torch.stack([torch.full_like(u, loc_sd), torch.full_like(u, s * _LOGSCALE_SPREAD)], -1).reshape(
                (*lead, -1)
            )
            offset_sd = s * math.sqrt(f / 2) * self._init_spread
            offset = torch.stack([torch.full_like(u, offset_sd), torch.zeros_like(u)], -1)
            offset = offset.reshape((*lead, 1, -1))
            half = torch.randn((*lead, k // 2, lam.shape[-1]), dtype=lam.dtype, device=lam.device)
            noise = torch.cat([half, -half, torch.zeros_like(lam).unsqueeze(-2)[..., : k % 2, :]], dim=-2)
            if k > 1:  # mean square exactly 1 over the components: the spread is init_scale, not only on average
                noise = noise / noise.pow(2).mean(-2, keepdim=True).sqrt()
            return lam, lam.unsqueeze(-2) + offset * noise, sd
        fn = self.prototype_trace.nodes[spec.name]["fn"]
        with torch.no_grad():
            draws = fn.sample((256,))
            base = unwrap(fn)
            dtype = draws.dtype if draws.is_floating_point() else getattr(base, "logits", base.mean).dtype
            draws = draws.to(dtype)
            for p in site.plates:
                info = self.structure.plates[p]
                if info.subsampled:
                    draws = periodic_repeat(draws, info.size, info.dim - site.event_dim).contiguous()
            draws = draws.expand((256, *site.shape))
        if spec.family == "categorical":
            index = (draws - spec.low).round().long().clamp(0, spec.count - 1)
            freq = nn.functional.one_hot(index, spec.count).to(dtype).mean(0)
            mean = (0.7 * freq + 0.3 / spec.count).log()
        else:
            mean = self._link(spec, draws.mean(0))
        starts = self._link(spec, draws[:k]).reshape((k, *lead, -1)).movedim(0, -2)
        mean = mean.reshape((*lead, -1))
        return mean, starts, torch.full_like(mean, s)

    @staticmethod
    def _link(spec: _SiteSpec, value: torch.Tensor) -> torch.Tensor:
        """λ whose likelihood has mean near ``value`` (smoothed away from the boundary): ``value.shape + (P,)``."""
        if spec.family == "bernoulli":
            m = 0.25 + 0.5 * value
            return (m.log() - (-m).log1p()).unsqueeze(-1)
        if spec.family == "poisson":
            return (value + 0.5).log().unsqueeze(-1)
        if spec.family == "binomial":
            m = (value + 0.5) / (spec.count + 1)
            return (m.log() - (-m).log1p()).unsqueeze(-1)
        # categorical: a draw → mostly its own value; the mean → the frequencies
        index = (value - spec.low).round().long().clamp(0, spec.count - 1)
        probs = 0.7 * nn.functional.one_hot(index, spec.count).to(value.dtype) + 0.3 / spec.count
        return probs.log()

    def _setup_level(self, level: _Level, read: dict[str, torch.Tensor], precisions: dict[str, torch.Tensor]) -> None:
        """The level's parameters; ``read`` and ``precisions``: its slopes on its parents read from the model and the
        conditional precisions behind them (:meth:`_read_slopes`)."""
        inits, starts, sds = zip(*(self._init_site(level, s) for s in level.sites))
        init, sd = torch.cat(inits, -1), torch.cat(sds, -1)
        d = level.numel
        name = level.key
        if self.prior == "mixture":
            k = self.components(level)
            locs = torch.cat(starts, -1)
            scales = sd.unsqueeze(-2).expand(locs.shape).clone()
            locs = locs / self._rate(level, f"{name}_locs")
            setattr(self.prior_params, f"{name}_locs", PyroParam(locs, constraints.real, event_dim=2))
            setattr(self.prior_params, f"{name}_scales", PyroParam(positive_inv(scales), event_dim=2))
            logits = init.new_zeros((*init.shape[:-1], k))
            setattr(self.prior_params, f"{name}_logits", PyroParam(logits, constraints.real, event_dim=1))
        else:
            loc = init / self._rate(level, f"{name}_loc")
            setattr(self.prior_params, f"{name}_loc", PyroParam(loc, constraints.real, event_dim=1))
            setattr(self.prior_params, f"{name}_scale", PyroParam(positive_inv(sd), event_dim=1))
            self.flows[name] = self._make_flow(d).to(dtype=init.dtype, device=init.device)
        # auxiliary r(λ | z): the inverse flow's unit-lower-triangular L, then per-coordinate Normal(a·f, exp(b·f))
        if d > 1 and self.prior == "flow":
            mix = init.new_zeros((*init.shape[:-1], d, d))
            setattr(self.aux_params, f"{name}_mix", PyroParam(mix, constraints.real, event_dim=2))
        for spec, lam in zip(level.sites, inits):
            p, f = spec.num_params, spec.num_features
            shape = level.batch_shape + spec.elem_shape + (p, f)
            lam = lam.reshape(level.batch_shape + spec.elem_shape + (p,))
            a = lam.new_zeros(shape)
            b = lam.new_zeros(shape)
            if self.prior == "flow":  # r's means and sds themselves (mixture prior: offsets from the components)
                if spec.family == "categorical":  # one-hot features: the table holds the mean for every value
                    a = a + lam.unsqueeze(-1)
                else:
                    a[..., 0] = lam
                b[..., 0] = math.log(max(self._init_scale, 0.5))
            # the weights of r's location (or shift) and log-sd (or log-stretch) in one parameter, ``(..., 2, P, F)``:
            # one read and one optimiser visit a step (Adam's steps are elementwise, the same as for two)
            weights = torch.stack([a, b], -3)
            event_dim = len(spec.elem_shape) + 3 if level.plates else weights.dim()
            setattr(self.aux_params, f"{spec.key}_r_weights", PyroParam(weights, constraints.real, event_dim=event_dim))
        n_par = self._num_parent_coords(level)
        if self._has_global_control_variate(level):
            # the globals' control variate (see _update_global_control_variate): the precision it applies to each
            # coordinate and the running moments E[g δ], E[δ²] it is estimated from, state without gradients
            if not hasattr(self, "precisions"):
                self.precisions = PyroModule()
            zeros = init.new_zeros(level.numel // 2)
            setattr(self.precisions, f"{name}_cv_precision", PyroParam(zeros.clone(), constraints.real))
            getattr(self.precisions, f"{name}_cv_precision")
            moments = zeros.new_zeros((2, len(zeros)))
            setattr(self.precisions, f"{name}_cv_moments", PyroParam(moments, constraints.real))
            getattr(self.precisions, f"{name}_cv_moments")
            self.__dict__["_global_cv_gaussian"] = self._gaussian_coordinates(level)
        if self._has_control_variate(level):
            for spec in level.sites:
                if spec.name in precisions:
                    # the conditional precision of each coordinate (state without gradients, read with the slopes;
                    # see _location_control_variate)
                    if not hasattr(self, "precisions"):
                        self.precisions = PyroModule()
                    value = precisions[spec.name].to(init).clone()
                    setattr(self.precisions, f"{spec.key}_precision", PyroParam(value, constraints.real, event_dim=1))
                    getattr(self.precisions, f"{spec.key}_precision")
        for spec in level.sites:
            if spec.continuous and n_par:  # slopes of the location and log-sd on the parents (see _model_slopes)
                width = n_par + self._num_sibling_coords(level, spec)
                slopes = init.new_zeros((*level.batch_shape, spec.num_coords, 2, width))
                if spec.name in read:
                    slopes = read[spec.name].to(slopes) / READ_SLOPE_RATE
                    # the last read (state without gradients, see _refresh_slopes), in the slopes' free units
                    if not hasattr(self, "slope_reads"):
                        self.slope_reads = PyroModule()
                    setattr(self.slope_reads, spec.key, PyroParam(slopes.clone(), constraints.real, event_dim=3))
                    getattr(self.slope_reads, spec.key)  # (read once, as the averages are)
                setattr(self.prior_params, f"{spec.key}_slopes", PyroParam(slopes, constraints.real, event_dim=3))

    def _make_flow(self, d: int) -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(self.flow_layers):
            if d == 1:
                layers.append(T.Spline(1, count_bins=8, bound=4.0))
            else:
                # a fixed variable order (T.spline_autoregressive draws one at random into a buffer, which Pyro's
                # param store does not save); the layers are interleaved with reversals
                bins = 8
                arn = AutoRegressiveNN(  # a masked network needs at least as many hidden units as inputs
                    d, [max(self.flow_hidden, d)], param_dims=[bins, bins, bins - 1, bins], permutation=torch.arange(d)
                )
                layers.append(T.SplineAutoregressive(d, arn, count_bins=bins, bound=4.0))
            _start_as_identity(layers[-1])
        return nn.ModuleList(layers)

    # ---- the free parameters of a level ------------------------------------------------------------------------
    def _element_params(
        self, level: _Level, plates: dict[str, pyro.plate] | None = None, average: bool | None = None
    ) -> dict[str, torch.Tensor]:
        """Every free parameter of the level (``prior_params`` and ``aux_params``, by attribute name), cut to the
        elements of the guide's ``plates`` on this call (:func:`~pyro_hier.sparse.select_elements`: sparse gradients
        for :class:`~pyro_hier.optim.LazyAdam`); full size for ``None``. Read outside the plates, which would slice
        them too. ``average``: whether ``q``'s parameters are their tail averages (:meth:`_use_average`, by default
        asked here). In a call without gradients, outside ``torch.jit`` tracing (``Predictive``'s), the parameters
        are the store's tensors taken without ``pyro.param`` statements (:func:`~pyro_hier.guides.base.stored_param`):
        nothing optimises what such a call reads."""
        name = level.key
        single = self.prior == "mixture" and self.components(level) == 1
        selection = None
        if plates is not None and level.plates:
            assert self.structure is not None
            dims = [self.structure.plates[p].dim for p in level.plates]
            selection = element_selection(plates, level.plates, dims)
        out = {}
        if average is None:
            average = self._use_average()
        untraced = not torch.is_grad_enabled() and not torch.jit.is_tracing()
        read = []
        for module, attr, rate, averaged in self._level_param_keys(level):
            params = self.averages if average and averaged else self._modules[module]
            value = stored_param(params, attr) if untraced else getattr(params, attr)
            read.append(value)
            if selection is not None:
                value = select_elements(value, selection, params._pyro_params[attr][1])
            out[attr] = value if rate == 1.0 else rate * value
        if untraced and (selection is None or all(i is None for i in selection.values())):
            # calls without gradients (Predictive's, one per draw) on the same tensors, unchanged since (an optimiser
            # step or a load writes in place, which bumps their versions, or replaces them), every element: the last
            # such call's parameters, with what was derived from them there (λ's sds, the standardisers)
            key = (average, tuple((id(v), v._version, v.dtype, v.device) for v in read))
            cache = self.__dict__.setdefault("_untraced_params", {})
            last = cache.get(level.name)
            if last is not None and last[0] == key:
                return last[1]
            cache[level.name] = (key, out, read)  # (holding the tensors read: their ids are not reused meanwhile)
        if single:
            out[f"{name}_logits"] = out[f"{name}_locs"].new_zeros(out[f"{name}_locs"].shape[:-1])
        return out

    def _level_param_keys(self, level: _Level) -> list[tuple[str, str, float, bool]]:
        """What :meth:`_element_params` reads for a level, found once: ``(module, attribute, rate, averaged)``."""
        cache = self.__dict__.setdefault("_param_keys", {})
        keys = cache.get(level.name)
        if keys is not None:
            return keys
        name = level.key
        # one mixture component: its weight is 1 whatever the logits, which are then left unread (no gradient, and one
        # parameter fewer for the optimiser to visit on every step)
        single = self.prior == "mixture" and self.components(level) == 1
        pairs = [("prior_params", f"{name}_{k}") for k in self._prior_keys() if not (single and k == "logits")]
        if level.numel > 1 and self.prior == "flow":
            pairs.append(("aux_params", f"{name}_mix"))
        pairs += [("aux_params", f"{spec.key}_r_weights") for spec in level.sites]
        if self.parents[level.name]:
            pairs += [("prior_params", f"{spec.key}_slopes") for spec in level.sites if spec.continuous]
        averaged = getattr(self, "_averaged", None)
        keys = [
            (module, attr, self._rate(level, attr), module == "prior_params" and attr in (averaged or ()))
            for module, attr in pairs
        ]
        if averaged is not None:  # (set up)
            cache[level.name] = keys
        return keys

    def _rate(self, level: _Level, attr: str) -> float:
        """The factor between a parameter of ``q(λ)`` and its free parameter: :data:`LOCAL_RATE` for the locations of a
        plate level, 1 otherwise (slopes: :meth:`_slope_rate`; mixture logits: ``_LOGIT_SCALE``)."""
        return LOCAL_RATE if level.plates and attr in (f"{level.key}_locs", f"{level.key}_loc") else 1.0

    def _prior_keys(self) -> tuple[str, ...]:
        return ("locs", "scales", "logits") if self.prior == "mixture" else ("loc", "scale")

    # ---- the distributions --------------------------------------------------------------------------------------
    def _prior(self, level: _Level, params: dict[str, torch.Tensor] | None = None) -> TorchDistribution:
        """``q(λ; θ)`` of the level's elements (``params``: :meth:`_element_params`, full size by default)."""
        name = level.key
        params = self._element_params(level) if params is None else params
        if self.prior == "mixture":
            locs = params[f"{name}_locs"]
            scales = self._mixture_scales(level, params)
            return ImplicitMixtureOfDiagNormals(
                locs, scales, _LOGIT_SCALE * params[f"{name}_logits"], validate_args=False
            )
        loc = params[f"{name}_loc"]
        scale = self._mixture_scales(level, params)
        base = dist.Normal(torch.zeros_like(loc), torch.ones_like(loc)).to_event(1)
        transforms: list = []
        for i, layer in enumerate(self.flows[name]):
            if i and level.numel > 1:  # reverse the order between autoregressive layers
                transforms.append(T.Permute(torch.arange(level.numel - 1, -1, -1, device=loc.device)))
            transforms.append(layer)
        # cached, as the spline layers are: log q(λ) of a draw then needs no autoregressive inverse (d network passes)
        transforms.append(T.AffineTransform(loc, scale, event_dim=1, cache_size=1))
        return dist.TransformedDistribution(base, transforms)

    def _inverse_flow(
        self, level: _Level, lam: torch.Tensor, params: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        if level.numel == 1 or self.prior != "flow":
            return lam
        params = self._element_params(level) if params is None else params
        mix = params[f"{level.key}_mix"].tril(-1)
        return lam + (mix @ lam.unsqueeze(-1)).squeeze(-1)

    def _block(self, level: _Level, spec: _SiteSpec, x: torch.Tensor) -> torch.Tensor:
        """The site's part of a level's λ-shaped tensor ``x``, as ``(..., *elem_shape, P)``."""
        block = x[..., spec.offset : spec.offset + spec.size]
        lead = block.shape[:-1]
        if not level.plates and spec.batch_dims:
            lead = strip_trailing_ones(lead, spec.batch_dims)
        return block.reshape(lead + spec.elem_shape + (spec.num_params,))

    def _site_distribution(
        self,
        level: _Level,
        spec: _SiteSpec,
        lam: torch.Tensor,
        lam0: torch.Tensor,
        values: dict[str, torch.Tensor],
        element_params: dict[str, torch.Tensor] | None = None,
        affine: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> HVMSiteDistribution:
        """The site's :class:`HVMSiteDistribution`. ``values`` holds the element's earlier sites (unconstrained for
        continuous ones, as ``w`` of :meth:`_affine`): the mixture prior's ``r`` needs the whole element, so its
        ``log r`` sits on the level's last site (earlier sites carry none); the flow prior's factorised ``r`` puts
        each site's terms on it. ``element_params``: :meth:`_element_params` (full size by default). ``affine``:
        ``(a, b, c)`` of :meth:`_affine`; ``q(z | λ)`` is then the law of ``c + a + e^b (w − c)`` for
        ``w ~ q(w | λ)`` and ``r`` reads ``w = c + (z − a − c) e^{−b}``."""
        if element_params is None:
            element_params = self._element_params(level)
        params = self._block(level, spec, lam)
        to_w = _identity
        if spec.continuous:  # q(z | λ) from λ's location and log-sd (their stack, unstacked again, cost two steps)
            loc, raw = params[..., 0], params[..., 1]
            if affine is not None:
                a, b, c = affine
                loc, raw = a + c + b.exp() * (loc - c), b + raw

                def to_w(z: torch.Tensor) -> torch.Tensor:
                    return c + (z - a - c) * (-b).exp()

            likelihood = spec.normal(loc, raw)
        else:
            likelihood = spec.likelihood(params)
        if self.prior == "mixture":
            cv = self._location_control_variate(level, spec, element_params, affine, to_w)
            if spec is not level.sites[-1]:
                return HVMSiteDistribution(likelihood, cv or (lambda z: z.new_zeros(())))

            def log_r(z: torch.Tensor) -> torch.Tensor:
                # r's parameters are gathered when a density is asked for (a draw that is never scored, e.g. in
                # Predictive, needs none)
                out = self._log_r_mixture(
                    level, lam, {**values, spec.name: to_w(z)}, self._mixture_r_params(level, element_params)
                )
                return out if cv is None else out + cv(z)

            return HVMSiteDistribution(likelihood, log_r)
        target = self._block(level, spec, lam0)
        weights = element_params[f"{spec.key}_r_weights"]
        mean_w, scale_w = weights[..., 0, :, :], weights[..., 1, :, :]
        event_dim = spec.event_dim

        standard = self._standardiser(level, spec, element_params)

        def log_r(z: torch.Tensor) -> torch.Tensor:
            f = spec.features(to_w(z), standard).to(mean_w.dtype).unsqueeze(-2)  # (..., *elem, 1, F)
            loc = (mean_w * f).sum(-1)
            log_scale = (scale_w * f).sum(-1)
            log_n = -0.5 * ((target - loc) / log_scale.exp()).pow(2) - log_scale - 0.5 * math.log(2 * math.pi)
            return sum_rightmost(log_n.sum(-1), event_dim)

        return HVMSiteDistribution(likelihood, log_r)

    def _has_control_variate(self, level: _Level) -> bool:
        """Whether the level's continuous sites get :meth:`_location_control_variate`: a plate level of the mixture
        prior with one component (λ's location is then the mean of its draws)."""
        return bool(level.plates) and self.prior == "mixture" and self.components(level) == 1

    def _has_global_control_variate(self, level: _Level) -> bool:
        """Whether the level gets the globals' control variate (:meth:`_update_global_control_variate`): the global
        level of the mixture prior with one component, all its sites continuous, one of them with a Gaussian prior
        (:meth:`_gaussian_coordinates`)."""
        return (
            not level.plates
            and self.prior == "mixture"
            and self.components(level) == 1
            and all(s.continuous for s in level.sites)
            and bool(self._gaussian_coordinates(level).any())
        )

    def _gaussian_coordinates(self, level: _Level) -> torch.Tensor:
        """Which of the level's coordinates (sites in order, each flattened) belong to a site whose prior is Gaussian
        in its unconstrained space (:func:`~pyro_hier.conjugate.gaussian_prior`), ``(C,)`` booleans: where the
        globals' control variate applies. A scale's log under a HalfCauchy or Uniform prior is not: with the control
        variate on it too, the centred eight schools' ``tau`` at Adam's rate 0.05 ended 0.54 posterior sds high
        (seed 0; AutoNormal 0.46, 0.43 with the means' alone; both with a drift-corrected tail average, see
        :data:`TAIL_FRACTION`) and the non-centred one's at rate 0.005 was slower (seeds 0-2: max error 0.146 / 0.131
        / 0.183 against 0.133 / 0.119 / 0.163 with the means' alone)."""
        assert self.structure is not None and self.prototype_trace is not None
        parts = []
        for spec in level.sites:
            fn = self.prototype_trace.nodes[spec.name]["fn"]
            gaussian = gaussian_prior(fn, self.structure.latent[spec.name].support) is not None
            parts.append(torch.full((spec.num_coords,), gaussian))
        return torch.cat(parts)

    def _location_control_variate(
        self,
        level: _Level,
        spec: _SiteSpec,
        params: dict[str, torch.Tensor],
        affine: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        to_w: Callable[[torch.Tensor], torch.Tensor],
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        r"""A control variate for the gradient of λ's locations of a plate level (``None`` where it does not apply:
        another prior or several components, a site without a Gaussian prior conditional, a subsampled plate, a call
        without gradients or under ``torch.jit.trace``), as a term of the site's ``log r`` whose value is zero.

        An element's value is :math:`z = \bar z + e^{b}(w - \mu)` with :math:`\mu` the location of
        :math:`\lambda_1` (free parameter), :math:`w - \mu = s_1 \varepsilon_1 + e^{\lambda_2}\varepsilon_w` the
        element's own noise and :math:`\bar z = c + a + e^b(\mu - c)` (:meth:`_affine`; :math:`a, b` depend on the
        parents' draws only). Near the conditional posterior the model's gradient is
        :math:`\nabla_z \log p \approx -\Lambda (z - z^*)`, with :math:`\Lambda = P + H` the conditional
        precision (the prior's plus the data's curvature, read with the slopes, :meth:`_shrinkage`), so the
        single-draw gradient of the loss with respect to :math:`\mu` is

        .. math::

            \Lambda e^{b} (\bar z - z^*) + \Lambda e^{2b} (w - \mu),

        and the second term, zero on average, is noise of sd :math:`\Lambda e^{2b}\,\mathrm{sd}(w)`, about the
        posterior precision times the posterior sd. Adam divides steps by the gradient's root mean square, so in
        steady state every location jitters about its optimum by an amount that grows with the rate; the population
        scale, fitted to the spread of the group effects, absorbs that jitter as if it were spread of the effects
        (radon at Adam's rate 0.05: the county scale 0.6-0.7 posterior sds high). The term added to the loss,

        .. math::

            -\Lambda\, e^{2b}\, \mathrm{sg}(w - \mu)\, (\mu - \mathrm{sg}(\mu)),

        (:math:`\mathrm{sg}`: stop-gradient) has value 0 and gradient :math:`-\Lambda e^{2b}(w - \mu)`: it takes the
        noise term out, exactly for a Gaussian conditional. Its expectation is zero given the parents
        (:math:`\varepsilon_1, \varepsilon_w` are independent of them and of :math:`\Lambda`, read from the model
        every :data:`SLOPE_REFRESH` calls), so the gradient stays unbiased whatever :math:`\Lambda`: a stale or
        rough :math:`\Lambda` only removes less of the noise (more than twice the true value would add some).
        The gradients of λ's scales and of everything else are untouched. The site's ``log r`` gets
        :math:`+\Lambda e^{2b}\ldots` (its density is subtracted in the loss, so this adds the term above)."""
        held = self._modules.get("precisions")
        attr = f"{spec.key}_precision" if level.plates else f"{level.key}_cv_precision"
        if held is None or attr not in held._pyro_params or not torch.is_grad_enabled() or torch.jit.is_tracing():
            return None
        locs = params[f"{level.key}_locs"]
        if not locs.requires_grad:
            return None
        if not level.plates:
            return self._global_control_variate(level, spec, locs)
        mu = self._block(level, spec, locs[..., 0, :])[..., 0]  # (*batch, *elem)
        # read as the raw tensor (state, as the tail averages are: SVI's parameter capture does not see it)
        precision = held._parameters[f"{attr}_unconstrained"].detach().reshape(mu.shape)
        weight = precision if affine is None else precision * (2 * affine[1]).exp().detach()
        step = mu - mu.detach()
        n = len(spec.elem_shape)

        def cv(z: torch.Tensor) -> torch.Tensor:
            term = weight * (to_w(z) - mu).detach() * step
            return sum_rightmost(term, n)

        return cv

    def _global_control_variate(
        self, level: _Level, spec: _SiteSpec, locs: torch.Tensor
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        r"""The control variate of :meth:`_location_control_variate` for a global site, with a precision estimated
        from the training run itself (:meth:`_update_global_control_variate`): ``None`` until
        :data:`GLOBAL_CV_MEMORY` training calls have fed the estimate. A global's value is
        :math:`z = \mu + \delta` with :math:`\delta = s_1\varepsilon_1 + e^{\lambda_2}\varepsilon_w` its own draw
        noise; the term added to the loss is :math:`-\hat\Lambda\, \mathrm{sg}(\delta)\, (\mu - \mathrm{sg}(\mu))`
        (value 0, gradient :math:`-\hat\Lambda \delta`, zero on average: unbiased whatever :math:`\hat\Lambda`,
        which depends on earlier calls' draws only)."""
        mu = self._block(level, spec, locs[..., 0, :])[..., 0]  # (*elem)
        leaf = self.prior_params._parameters[f"{level.key}_locs_unconstrained"]
        pending = self.__dict__.setdefault("_global_cv", {})
        if spec is level.sites[0] or pending.get("leaf") is not leaf:  # (a new call)
            pending.clear()
            pending.update(leaf=leaf, level=level, deltas={})
            # the leaf's gradient so far (several particles in turn each add theirs): the update reads this call's
            # increment
            pending["before"] = None if leaf.grad is None else leaf.grad.detach().clone()
            count = float(self.averages._parameters["count_unconstrained"].detach())
            precision = self.precisions._parameters[f"{level.key}_cv_precision_unconstrained"].detach()
            pending["active"] = count >= GLOBAL_CV_MEMORY
            pending["precision"] = precision.clone() if pending["active"] else torch.zeros_like(precision)
        active = pending["active"]
        start = spec.offset // 2
        weight = pending["precision"][start : start + spec.num_coords].reshape(spec.elem_shape)
        deltas = pending["deltas"]
        step = mu - mu.detach()
        n = len(spec.elem_shape)

        def cv(z: torch.Tensor) -> torch.Tensor:
            delta = (z - mu).detach()
            deltas[spec.key] = delta.reshape((-1, spec.num_coords)).mean(0)  # (vectorised particles: their mean)
            if not active:
                return z.new_zeros(())
            return sum_rightmost(weight * delta * step, n)

        return cv

    @torch.no_grad()
    def _update_global_control_variate(self) -> None:
        r"""After a training call's backward pass: update the precision :math:`\hat\Lambda` of the globals' control
        variate (:meth:`_global_control_variate`), coordinate by coordinate.

        Near the optimum the one-draw gradient of the loss in a global location :math:`\mu` is
        :math:`g = \bar g + \Lambda \delta + \eta`, with :math:`\delta` the global's own draw noise,
        :math:`\Lambda` the curvature of :math:`-\log p` along the guide's map (the children follow the global
        through their slopes, so it is not the model's conditional precision, which :meth:`_shrinkage` reads for the
        plate levels) and :math:`\eta` the other draws' noise, uncorrelated with :math:`\delta`. The regression
        slope :math:`\Lambda = \mathbb E[g \delta] / \mathbb E[\delta^2]` is estimated from running moments over
        about the last :data:`GLOBAL_CV_MEMORY` calls, with :math:`g` the gradient without the control variate
        (the call's gradient plus the :math:`\hat\Lambda \delta` it took out); negative estimates are cut to 0."""
        pending = self.__dict__.get("_global_cv")
        if not pending or pending["leaf"].grad is None:
            return
        level, deltas = pending["level"], pending["deltas"]
        if len(deltas) != len(level.sites):  # (a call whose draws were not all scored)
            return
        grad = pending["leaf"].grad if pending["before"] is None else pending["leaf"].grad - pending["before"]
        delta = deltas[level.sites[0].key] if len(deltas) == 1 else torch.cat([deltas[s.key] for s in level.sites])
        g = grad[..., 0, 0::2].reshape(delta.shape) + pending["precision"] * delta  # (the locations: every other λ)
        held = self.precisions._parameters
        moments = held[f"{level.key}_cv_moments_unconstrained"]
        count = float(self.averages._parameters["count_unconstrained"].detach()) + 1
        moments.lerp_(torch.stack([g * delta, delta * delta]), max(1.0 / count, 1.0 / GLOBAL_CV_MEMORY))
        estimate = moments[0] / moments[1].clamp(min=torch.finfo(moments.dtype).tiny)
        gaussian = self.__dict__["_global_cv_gaussian"].to(estimate.device)
        held[f"{level.key}_cv_precision_unconstrained"].copy_(estimate.clamp(min=0.0) * gaussian)
        deltas.clear()

    def _slope_rate(self, spec: _SiteSpec) -> float:
        """The factor between a site's slopes and their free parameters: :data:`READ_SLOPE_RATE` where the model gives
        them (:meth:`_model_slopes`), :data:`SLOPE_RATE` where Adam learns them from zero."""
        reads = self._modules.get("slope_reads")
        return READ_SLOPE_RATE if reads is not None and spec.key in reads._pyro_params else SLOPE_RATE

    def _affine(
        self, level: _Level, spec: _SiteSpec, x: torch.Tensor | None, params: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        r"""The site's conditioning on its parents: ``(a, b, c)``, each ``(..., *elem_shape)``, with
        :math:`(a, b)_c = S_c\, x` for the slopes :math:`S_c` (2 × parents' coordinates) of coordinate :math:`c` and
        the parents' standardised values ``x`` (:meth:`_parent_values`), ``b`` kept within ±``MAX_STRETCH``
        smoothly, and ``c`` the centre of ``q(w)`` (:meth:`_standardiser`, a constant of the step) about which
        ``e^b`` stretches. ``None`` for a discrete site or a level without parents."""
        if x is None or not spec.continuous:
            return None
        slopes = self._slope_rate(spec) * params[f"{spec.key}_slopes"]  # (*batch, C, 2, n)
        t = (slopes * x[..., None, None, :]).sum(-1)  # (..., C, 2)
        t = t.reshape(t.shape[:-2] + spec.elem_shape + (2,))
        cut = (lambda x: x) if torch.jit.is_tracing() else torch.Tensor.detach
        centre = cut(self._standardiser(level, spec, params)[0])
        return t[..., 0], MAX_STRETCH * torch.tanh(t[..., 1] / MAX_STRETCH), centre

    def _parent_values(
        self, level: _Level, lam: torch.Tensor, values: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The level's continuous values less the centre of ``q(w)`` (:meth:`_standardiser`), ``(*lam.shape[:-1],
        C)``: what its children's :meth:`_affine` reads. Unscaled, so the slopes are in the model's own units (a
        Gaussian child's location moves one-for-one with its parent location, its log-sd with its parent log-scale)
        and :meth:`_model_slopes` can start them at the prior conditional's. The centre is a constant of each step,
        so moving a parent's location moves its children with it, as a non-centred parameterisation does (with the
        centre's gradient, the centred eight schools' ``tau`` collapsed to 0.12 of its posterior sd)."""
        lead = lam.shape[:-1]
        parts = []
        cut = (lambda x: x) if torch.jit.is_tracing() else torch.Tensor.detach
        for spec in level.sites:
            if spec.continuous:
                centre = cut(self._standardiser(level, spec, params)[0])
                batch = centre.shape[: centre.dim() - len(spec.elem_shape)]
                u = values[spec.name].reshape((*lead, spec.num_coords))
                parts.append(u - centre.reshape((*batch, -1)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    @torch.no_grad()
    def _refresh_slopes(self, args: tuple, kwargs: dict) -> None:
        r"""Read the slopes of the continuous sites on their parents from the model again (:meth:`_model_slopes`),
        now at the centre of the current ``q`` (discrete sites at their init values), and move every slope parameter
        and its tail average by the change of the read since the last one: the slopes stay the model's reading plus
        what Adam learnt on top of it. The reads are state without gradients (``slope_reads``, in the slopes' free
        units), so ``state_dict`` and pickling carry them. Called every :data:`SLOPE_REFRESH` training calls."""
        assert self.structure is not None and self.prototype_trace is not None
        st = self.structure
        values = {n: self.prototype_trace.nodes[n]["value"].detach() for n in self.guide_sites}
        for level in self.levels:
            if any(st.plates[p].subsampled for p in level.plates):
                continue
            params = self._element_params(level)
            for spec in level.sites:
                if spec.continuous:
                    site = st.latent[spec.name]
                    u = self._standardiser(level, spec, params)[0].reshape(site.unconstrained_shape)
                    values[spec.name] = torch.distributions.biject_to(site.support)(u)
        reads, all_precisions = self._read_slopes(values, args, kwargs)
        for level in self.levels:
            if level.name not in reads:
                continue
            read, precisions = reads[level.name], all_precisions[level.name]
            held = getattr(self, "precisions", None)
            for name, value in precisions.items():
                attr = f"{next(s.key for s in level.sites if s.name == name)}_precision"
                if held is not None and attr in held._pyro_params:
                    held.get_parameter(f"{attr}_unconstrained").copy_(value)
            for spec in level.sites:
                if spec.name not in read or spec.key not in self.slope_reads._pyro_params:
                    continue
                old = self.slope_reads.get_parameter(f"{spec.key}_unconstrained")
                new = read[spec.name].to(old) / self._slope_rate(spec)
                delta = new - old
                self.prior_params.get_parameter(f"{spec.key}_slopes_unconstrained").add_(delta)
                attr = f"{spec.key}_slopes"
                if attr in self._averaged:
                    self.averages.get_parameter(f"{attr}_unconstrained").add_(delta)
                old.copy_(new)

    def _read_slopes(
        self, values: dict[str, torch.Tensor] | None = None, args: tuple | None = None, kwargs: dict | None = None
    ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
        """Every level's slopes on its parents and the conditional precisions behind them (:meth:`_model_slopes`), by
        level and site, at ``values`` (default: the init values). Levels are read children first: a level whose
        children follow it (an outer plate level, :meth:`_level_parents`) is identified along that map, not with its
        children held fixed (:meth:`_children_schur`)."""
        reads: dict[str, dict[str, torch.Tensor]] = {}
        precisions: dict[str, dict[str, torch.Tensor]] = {}
        for level in reversed(self.levels):
            if not self._num_parent_coords(level):
                continue
            precision: dict[str, torch.Tensor] = {}
            schur = self._children_schur(level, reads, precisions)
            reads[level.name] = self._model_slopes(level, values, args, kwargs, precision, schur)
            precisions[level.name] = precision
        return reads, precisions

    def _children_schur(
        self,
        level: _Level,
        reads: dict[str, dict[str, torch.Tensor]],
        precisions: dict[str, dict[str, torch.Tensor]],
    ) -> dict[str, torch.Tensor]:
        r"""How much of a level's curvature its children take with them when they follow it, per coordinate of its
        continuous sites, ``(*level.batch_shape, C)`` by site: :math:`\sum_c s_{c}^2 \Lambda_c` over the child
        coordinates :math:`c` reading each element, with :math:`s_c` the child's location slope on the coordinate
        (:meth:`_model_slopes`) and :math:`\Lambda_c` its conditional precision (:meth:`_shrinkage`).

        The curvature :math:`H` of the rest of the model is read with the children held at their values; along the
        guide's map they move by :math:`s_c` per unit of the parent, which leaves the Schur complement
        :math:`H - \sum_c s_c^2 \Lambda_c` (exact for Gaussian conditionals: a child of prior :math:`\mathcal N(b,
        P^{-1})` and data curvature :math:`H_c` has :math:`s_c = \rho_c = P / (P + H_c)` and contributes
        :math:`P` at fixed children, :math:`P (1 - \rho_c)`, its marginal's precision, along the map). Read with the
        children fixed, a state of ``unseen.py``'s ``nested`` looked identified by its counties and was drawn centred,
        not shrinking with its scale: the states' scale ended 0.19-0.22 posterior sds high."""
        if not self.condition_on_parents:
            return {}
        index = self.__dict__.get("_parent_index", {})
        by_name = {lv.name: lv for lv in self.levels}
        coords = [s for s in level.sites if s.continuous]
        width = sum(s.num_coords for s in coords)
        total = None
        for child_name, read in reads.items():
            child = by_name[child_name]
            outer = index.get((child_name, level.name))
            if outer is None:
                continue
            offset = 0
            for p in self.parents[child_name]:
                if p == level.name:
                    break
                offset += sum(s.num_coords for s in by_name[p].sites if s.continuous)
            for spec in child.sites:
                if spec.name not in read or spec.name not in precisions.get(child_name, {}):
                    continue
                slope = read[spec.name][..., 0, offset : offset + width]  # (*child batch, C_child, C)
                weight = precisions[child_name][spec.name].reshape(slope.shape[:-1]).to(slope)
                term = (slope.pow(2) * weight.unsqueeze(-1)).sum(-2).reshape(-1, width)
                if total is None:
                    total = term.new_zeros((math.prod(level.batch_shape), width))
                total = total.index_add(0, outer.to(term.device), term)
        if total is None:
            return {}
        total = total.reshape((*level.batch_shape, width))
        out, start = {}, 0
        for spec in coords:
            out[spec.name] = total[..., start : start + spec.num_coords]
            start += spec.num_coords
        return out

    def _model_slopes(
        self,
        level: _Level,
        values: dict[str, torch.Tensor] | None = None,
        args: tuple | None = None,
        kwargs: dict | None = None,
        precisions: dict[str, torch.Tensor] | None = None,
        schur: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        r"""Slopes of the level's continuous sites on their parents, read from the model at ``values`` (default: the
        init values; ``args``/``kwargs``: the model's, default those of the first call): for a site whose
        prior conditional is Gaussian in its unconstrained space (:func:`~pyro_hier.conjugate.gaussian_prior`), the
        derivatives of its location :math:`m_0` and log-sd with respect to each parent coordinate (central
        differences), times the shrinkage :math:`\rho` (:meth:`_shrinkage`), the location's plus
        :math:`-2 \rho (\log \mathrm{sd}_0)' (m_0 - u)` at the site's value :math:`u` (a Gaussian conditional
        posterior's location moves with the prior's precision too). ``q(z | parents)`` then follows the model's own
        non-centred form, e.g.
        :math:`\theta_i = \mu + \tau\, w_i` for :math:`\theta_i \sim \mathcal N(\mu, \tau)`: a funnel's
        scale can leave zero (the centred eight schools: mean-field collapsed :math:`\tau` to 0.07 of its
        posterior sd, with max error 1.26 sd). Sites with another prior, and levels with a subsampled plate (the
        init values are not at full size there), start at zero slopes. ``precisions``, if given, receives the
        conditional posterior's precision of each coordinate of the sites read (:meth:`_shrinkage`)."""
        assert self.structure is not None and self.prototype_trace is not None
        st = self.structure
        by_name = {lv.name: lv for lv in self.levels}
        parents = [by_name[p] for p in self.parents[level.name]]
        if not parents or any(st.plates[p].subsampled for lv in (level, *parents) for p in lv.plates):
            return {}
        if values is None:
            values = {n: self.prototype_trace.nodes[n]["value"].detach() for n in self.guide_sites}
        if args is None:
            args, kwargs = st.args, st.kwargs
        wanted = [s.name for s in level.sites if s.continuous]
        columns = [(s.name, c) for lv in parents for s in lv.sites if s.continuous for c in range(s.num_coords)]
        rows: dict[str, list[torch.Tensor]] = {n: [] for n in wanted}
        h = 1e-2
        for name, c in columns:
            transform = torch.distributions.biject_to(st.latent[name].support)
            u = transform.inv(values[name])
            spec = next(s for lv in parents for s in lv.sites if s.name == name)
            moments = []
            for sign in (1.0, -1.0):
                shifted = u.reshape(-1, spec.num_coords).clone()
                shifted[:, c] += sign * h
                # the same random numbers in both runs (sites the guide does not sample, e.g. enumerated ones, are
                # drawn from the model), and the caller's generator left as it was
                with _seeded():
                    # (the user's model, the init strategy after the given values: it makes none it throws away;
                    # not validated: the model's own runs check the same arguments)
                    fns, _ = capture_priors(
                        self.reading_model,
                        args,
                        kwargs,
                        {**values, name: transform(shifted.reshape(u.shape))},
                        wanted,
                        validate=False,
                        init=self.site_init,
                    )
                moments.append({n: gaussian_prior(fns[n], st.latent[n].support) for n in wanted})
            for n in wanted:
                plus, minus = moments[0][n], moments[1][n]
                if plus is None or minus is None or not plus.diagonal:
                    rows[n] = []
                    wanted = [w for w in wanted if w != n]
                    continue
                d_loc = (plus.loc - minus.loc) / (2 * h)
                d_log_sd = -0.5 * (plus.precision.log() - minus.precision.log()) / (2 * h)
                # the conditional posterior's location moves with the prior's precision too: ρ (m₀' − 2 (log sd₀)'
                # (m₀ − u)), at the site's value u (see the docstring)
                u0 = torch.distributions.biject_to(st.latent[n].support).inv(values[n])
                m0 = 0.5 * (plus.loc + minus.loc)
                d_loc = d_loc - 2 * d_log_sd * (m0 - u0.reshape((*level.batch_shape, -1)).to(d_loc))
                d_loc, d_log_sd = torch.broadcast_tensors(d_loc, d_log_sd)
                rows[n].append(torch.stack([d_loc, d_log_sd], -1))
        sibling_slopes: dict[str, torch.Tensor] = {}
        shrink, precision = self._shrinkage(level, values, wanted, args, kwargs, schur, sibling_slopes)
        if precisions is not None:
            precisions.update(precision)
        out = {}
        for spec in level.sites:
            if spec.name in wanted and rows[spec.name]:
                slopes = torch.stack(rows[spec.name], -1)  # (*fn batch, C, 2, n)
                slopes = slopes.expand((*slopes.shape[:-3], spec.num_coords, 2, len(columns))).reshape(
                    (*level.batch_shape, spec.num_coords, 2, len(columns))
                )
                out[spec.name] = slopes * shrink[spec.name][..., None, None]
                siblings = sibling_slopes.get(spec.name)
                if siblings is not None:  # (location only: the log-sd's slopes on the siblings start at 0)
                    block = torch.stack([siblings, torch.zeros_like(siblings)], -2).to(out[spec.name])
                    out[spec.name] = torch.cat([out[spec.name], block], -1)
        return out

    def _shrinkage(
        self,
        level: _Level,
        values: dict[str, torch.Tensor],
        names: list[str],
        args: tuple,
        kwargs: dict,
        schur: dict[str, torch.Tensor] | None = None,
        sibling_slopes: dict[str, torch.Tensor] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        r"""Per coordinate of the level's sites ``names`` (Gaussian prior conditionals), the share
        :math:`\rho = P / (P + H)` of the prior's precision :math:`P` in the conditional posterior's, with :math:`H`
        the curvature of the rest of the model (:func:`~pyro_hier.conjugate.element_curvature`) at the init values,
        ``(*batch, C)``. For a Gaussian prior and a Gaussian likelihood the posterior's location moves with the
        parents' by :math:`\rho` times the prior's slope (and its log-sd by :math:`\rho` times that of the prior):
        weakly identified elements start non-centred, well identified ones centred. Returns ``ρ`` and the
        conditional posterior's precision :math:`P + H` (what :meth:`_location_control_variate` reads), by site."""
        assert self.structure is not None
        st = self.structure
        if not names:
            return {}, {}
        specs = [s for s in level.sites if s.name in names]
        us = {s.name: torch.distributions.biject_to(st.latent[s.name].support).inv(values[s.name]) for s in specs}
        level_u = torch.cat([us[s.name].reshape((*level.batch_shape, s.num_coords)) for s in specs], -1)

        def to_values(u: torch.Tensor) -> dict[str, torch.Tensor]:
            out, start = {}, 0
            for spec in specs:
                part = u[..., start : start + spec.num_coords].reshape(us[spec.name].shape)
                out[spec.name] = torch.distributions.biject_to(st.latent[spec.name].support)(part)
                start += spec.num_coords
            return out

        # (the user's model: every latent site the guide samples is given, and the init strategy would draw values
        # to throw away; the enumerated ones are drawn from the model, as that strategy would; not validated: the
        # model's own runs check the same arguments)
        with _seeded(), pyro.validation_enabled(False):
            curvature = element_curvature(self.reading_model, args, kwargs, values, level_u, to_values, 1.0)
            fns, _ = capture_priors(
                self.reading_model, args, kwargs, values, names, validate=False, init=self.site_init
            )
        h = curvature.diagonal(dim1=-2, dim2=-1).clamp(min=0.0)
        starts, start = {}, 0
        for spec in specs:
            starts[spec.name] = start
            start += spec.num_coords
        total, rest = {}, {}
        for spec in specs:
            prec = gaussian_prior(fns[spec.name], st.latent[spec.name].support).precision
            prec = prec.expand((*prec.shape[:-1], spec.num_coords)).reshape((*level.batch_shape, spec.num_coords))
            i = starts[spec.name]
            rest[spec.name] = h[..., i : i + spec.num_coords]
            if schur is not None and spec.name in schur:  # (the children follow the level: see _children_schur)
                rest[spec.name] = (rest[spec.name] - schur[spec.name].to(h)).clamp(min=0.0)
            total[spec.name] = prec + rest[spec.name]
        # the element's later sites follow its earlier ones (_site_inputs) by the Gaussian conditional's slope
        # -Λ_ji / Λ_jj; an earlier site is then identified along that map: its curvature less Σ_j s_ji² Λ_jj (as for
        # children, _children_schur)
        taken = {spec.name: torch.zeros_like(total[spec.name]) for spec in specs}
        out = {}
        for spec in reversed(specs):  # (a site's later siblings are done: its own precision is final)
            prec = total[spec.name] - rest[spec.name]
            total[spec.name] = prec + (rest[spec.name] - taken[spec.name]).clamp(min=0.0)
            out[spec.name] = prec / total[spec.name]
            siblings = self._siblings(level, spec)
            if not siblings:
                continue
            i = starts[spec.name]
            blocks = []
            for other in siblings:
                if other.name not in starts:  # (a sibling without a Gaussian prior: no curvature read)
                    blocks.append(h.new_zeros((*h.shape[:-1], spec.num_coords, other.num_coords)))
                    continue
                k = starts[other.name]
                cross = curvature[..., i : i + spec.num_coords, k : k + other.num_coords]
                slope = -cross / total[spec.name].unsqueeze(-1)
                blocks.append(slope)
                taken[other.name] = taken[other.name] + (slope.pow(2) * total[spec.name].unsqueeze(-1)).sum(-2)
            if sibling_slopes is not None:
                sibling_slopes[spec.name] = torch.cat(blocks, -1)
        return out, total

    def _standardiser(
        self, level: _Level, spec: _SiteSpec, params: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Centre and sd of ``q(w)`` (:meth:`_affine`) for each coordinate of a continuous site,
        ``(*batch, *elem_shape)`` each (``None`` for a discrete site): what :meth:`_SiteSpec.features` standardises
        ``w`` by, and :meth:`_parent_values` a parent's value. Any function of the parameters is a valid ``r``; these
        follow ``q`` as it moves, so ``r``'s coefficients stay of order one.

        The centre keeps its gradient: translating λ's locations then translates ``λ``, ``w`` and ``r`` together, so
        ``r`` adds nothing to the locations' gradient, which is ``AutoNormal``'s, ``∂ log p / ∂z``. With a detached
        centre it carried noise of order ``1/sd(λ)`` (Adam's steps shrank accordingly: eight schools' ``mu`` was still
        0.7 sd short after 5,000 steps of the drop-in loop, where ``AutoNormal`` arrives in 1,000). The sd is a
        constant of each step: with its gradient flowing, the drop-in loop on radon (seed 0) ended at 1.47 / 1.32 sd
        (Uniform / HalfNormal priors) instead of 0.66 / 0.35."""
        if not spec.continuous:
            return None
        # computed once per call, for the whole level at once: ``params`` (:meth:`_element_params`) is built afresh
        # for every call, and the standardisers are read by the sites' r, the children's affine maps and the level's
        # parent values
        key = f"_standard:{spec.key}"
        if key not in params:
            centre, sd = params.get("_standard:") or self._level_standardiser(level, params)
            params["_standard:"] = (centre, sd)
            start = 0
            for other in level.sites:
                if other.continuous:
                    cut = slice(start, start + other.num_coords)
                    shape = (*centre.shape[:-1], *other.elem_shape)
                    params[f"_standard:{other.key}"] = (centre[..., cut].reshape(shape), sd[..., cut].reshape(shape))
                    start += other.num_coords
        return params[key]

    def _level_standardiser(self, level: _Level, params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_standardiser` of all the level's continuous coordinates, ``(*batch, C)`` each (in the order of the
        level's sites)."""
        continuous = [s for s in level.sites if s.continuous]
        whole = sum(s.size for s in continuous) == level.numel

        def pairs(x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., C, 2): each coordinate's (location, log-sd)
            if not whole:
                x = torch.cat([x[..., s.offset : s.offset + s.size] for s in continuous], -1)
            return x.reshape((*x.shape[:-1], -1, 2))

        # constants of r for this step (detached), except under torch.jit.trace: there the detached copies biased
        # JitTrace_ELBO (prior-only median −0.1 to −0.17 after 100 steps, 4 seeds; within ±0.05 with the gradient)
        cut = (lambda x: x) if torch.jit.is_tracing() else torch.Tensor.detach
        name = level.key
        if self.prior == "mixture":
            live = pairs(params[f"{name}_locs"])  # (*batch, K, C, 2)
            locs, sds = cut(live), pairs(cut(self._mixture_scales(level, params)))
            mean = locs[..., 0]
            var = sds[..., 0].pow(2) + (2 * locs[..., 1] + 2 * sds[..., 1].pow(2)).exp()
            if live.shape[-3] == 1:  # one component: its weight is 1 (the same numbers, fewer operations)
                return live[..., 0, :, 0], var[..., 0, :].sqrt()
            pi = torch.softmax(_LOGIT_SCALE * cut(params[f"{name}_logits"]), -1).unsqueeze(-1)  # (*batch, K, 1)
            centre = (pi * mean).sum(-2)
            var = (pi * (var + (mean - centre.unsqueeze(-2)).pow(2))).sum(-2)
            centre = (pi * live[..., 0]).sum(-2)
        else:
            live = pairs(params[f"{name}_loc"])  # (*batch, C, 2)
            loc, sd = cut(live), pairs(cut(self._mixture_scales(level, params)))
            centre = live[..., 0]
            var = sd[..., 0].pow(2) + (2 * loc[..., 1] + 2 * sd[..., 1].pow(2)).exp()
        return centre, var.sqrt()

    def _mixture_scales(self, level: _Level, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """λ's sds in ``q(λ)`` (the mixture components' or the flow's scale): the positive map of their free
        parameters, computed once per call (``params``: :meth:`_element_params`, built afresh for every call; read by
        ``q(λ)``, ``r`` and the standardisers)."""
        key = "_scales:"
        if key not in params:
            params[key] = positive(params[f"{level.key}_{'scales' if self.prior == 'mixture' else 'scale'}"])
        return params[key]

    def _mixture_r_params(self, level: _Level, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        name = level.key
        locs = params[f"{name}_locs"]
        out = {
            "locs": locs,
            "scales": self._mixture_scales(level, params),
            # (one component: its weight is 1, the logits unread)
            "log_pi": None if locs.shape[-2] == 1 else torch.log_softmax(_LOGIT_SCALE * params[f"{name}_logits"], -1),
        }
        for spec in level.sites:
            out[f"{spec.name}_r_weights"] = params[f"{spec.key}_r_weights"]
            out[f"{spec.name}_standard"] = self._standardiser(level, spec, params)
        return out

    def _log_r_mixture(
        self, level: _Level, lam: torch.Tensor, values: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        r"""``log r(λ | z)`` of one element for the mixture prior: a mixture matched to ``q(λ)``,

        .. math::

            r(\lambda \mid z) = \sum_k w_k(z)\, \mathcal N\big(\lambda;\ \mu_k + \sigma_k \odot \delta(z),\
                \operatorname{diag}(\sigma_k e^{\gamma(z)})^2\big), \qquad
            w_k(z) \propto \pi_k\, q(z \mid \mu_k),

        with :math:`\delta_j, \gamma_j` linear in features of the latent coordinate that :math:`\lambda_j`
        parameterises (free parameters ``φ``). When the components are narrow, :math:`w_k(z)` is the posterior
        probability of component :math:`k` given :math:`z` and ``r`` is close to :math:`q(\lambda \mid z)`; a
        single Gaussian ``r`` would leave a gap of up to the entropy of that component posterior.

        The shift is in units of the component's sd :math:`\sigma_k` (held constant within a step; any ``r`` gives
        a valid bound), so ``φ`` is of order one whatever λ's spread: an Adam step moves the shift by about ``lr``
        sds, and its gradient is of order one too. In λ's own units its gradients were of order
        :math:`1/\sigma_k` (``ClippedAdam``, the drop-in loop's optimiser, clamps every element to ±10: on radon with
        HalfNormal priors q of the county scale collapsed, max error 0.685 sd), and each step moved the shift by
        ``lr`` in λ's units, many of λ's sds when those are small: on the demo's synthetic regression (N = 50, the
        drop-in loop) the bound was 31 nats looser than the ELBO of the same ``q`` (5.9 in sd units)."""
        locs, scales, log_w = params["locs"], params["scales"], params["log_pi"]  # (*batch, K, D), ..., (*batch, K)
        shifts, log_stretch = [], []
        single = locs.shape[-2] == 1
        for spec in level.sites:
            z = values[spec.name]
            n = len(spec.elem_shape)
            f = spec.features(z, params[f"{spec.name}_standard"]).to(locs.dtype)  # (..., *elem, F)
            both = (params[f"{spec.name}_r_weights"] * f[..., None, None, :]).sum(-1)  # (..., *elem, 2, P)
            for out, i in ((shifts, 0), (log_stretch, 1)):
                t = both[..., i, :]  # (..., *elem, P)
                lead = t.shape[: t.dim() - n - 1]
                out.append(t.reshape((*lead, *(1,) * spec.batch_dims, spec.size)))
            if single:  # one component: w(z) = 1
                continue
            block = locs[..., spec.offset : spec.offset + spec.size]
            comp = block.reshape((*block.shape[:-1], *spec.elem_shape, spec.num_params))
            zk = z.reshape((*z.shape[: z.dim() - n], 1, *spec.elem_shape))
            log_q = spec.likelihood(comp, event=False).log_prob(zk)  # (..., K, *elem)
            log_w = log_w + log_q.sum(tuple(range(-n, 0))) if n else log_w + log_q
        # (one site: its terms as they are)
        shift = (shifts[0] if len(shifts) == 1 else concat_broadcast(shifts)).unsqueeze(-2)
        stretch = log_stretch[0] if len(log_stretch) == 1 else concat_broadcast(log_stretch)
        # r's sd is the component's times e^γ, γ kept within ±MAX_STRETCH smoothly: far in q's tails the quadratic
        # feature would otherwise make r arbitrarily narrow and the bound -∞ (1e38 per group measured)
        stretch = MAX_STRETCH * torch.tanh(stretch / MAX_STRETCH)
        sd = scales * stretch.unsqueeze(-2).exp()
        # the shift is in units of the component's sd, a constant of the step (see the docstring)
        cut = (lambda x: x) if torch.jit.is_tracing() else torch.Tensor.detach
        eps = (lam.unsqueeze(-2) - locs - shift * cut(scales)) / sd
        log_n = (-0.5 * eps.pow(2) - sd.log() - 0.5 * math.log(2 * math.pi)).sum(-1)  # (..., K)
        if single:
            return log_n[..., 0]
        log_w = log_w - torch.logsumexp(log_w, -1, keepdim=True)
        return torch.logsumexp(log_w + log_n, -1)

    def _discrete_infer(self) -> dict:
        """``infer`` of discrete sites: TraceGraph_ELBO's decaying-average baseline (other ELBOs ignore it)."""
        if self.baseline_beta is None:
            return {}
        return {"baseline": {"use_decaying_avg_baseline": True, "baseline_beta": self.baseline_beta}}

    def _sample_site(self, name: str, fn: HVMSiteDistribution, infer: dict | None = None) -> torch.Tensor:
        """Sample one site of the guide (a hook: tests replace it to check what a wrong placement of log r does)."""
        return pyro.sample(name, fn, infer=infer or {})

    # ---- sampling -----------------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Sample every latent site that is not enumerated; returns ``{site: value}`` (constrained)."""
        self._require_setup(*args, **kwargs)
        if self.prior == "flow":  # adopt the param store's values (e.g. after pyro.get_param_store().load(...))
            pyro.module(self._pyro_get_fullname("flows"), self._modules["flows"], update_module_params=True)
        plates = self._create_plates(*args, **kwargs)
        if self._averaged and torch.is_grad_enabled():
            self._attach_hook()
            if "slope_reads" in self._modules and not torch.jit.is_tracing():
                n = int(self.averages._parameters["count_unconstrained"])
                if n > 0 and n % SLOPE_REFRESH == 0 and n != getattr(self, "_last_refresh", -1):
                    self._last_refresh = n
                    self._refresh_slopes(args, kwargs)
        result: dict[str, torch.Tensor] = {}
        parent_values: dict[str, torch.Tensor] = {}
        wanted = {p for ps in self.parents.values() for p in ps}
        average = self._use_average()
        for level in self.levels:
            params = self._element_params(level, plates, average)  # read (and cut to the subsample) outside the plates
            x = self._parent_inputs(level, parent_values, plates)
            with ExitStack() as stack:
                enter_plates(stack, plates, level.plates)
                lam = pyro.sample(
                    f"_{self._pyro_name}_{level.name}_lambda", self._prior(level, params), infer={"is_auxiliary": True}
                )
                lam0 = self._inverse_flow(level, lam, params)
                values: dict[str, torch.Tensor] = {}  # what r reads: w of continuous sites (see _affine)
                unconstrained: dict[str, torch.Tensor] = {}
                for spec in level.sites:
                    affine = self._affine(level, spec, self._site_inputs(level, spec, x, unconstrained, params), params)
                    fn = self._site_distribution(level, spec, lam, lam0, values, params, affine)
                    if spec.continuous:
                        u = self._sample_site(
                            f"_{self._pyro_name}_{spec.name}_unconstrained", fn, {"is_auxiliary": True}
                        )
                        unconstrained[spec.name] = u
                        if affine is None:
                            values[spec.name] = u
                        elif spec is not level.sites[-1]:  # (the last site's r reads its own value: to_w in log_r)
                            a, b, c = affine
                            values[spec.name] = c + (u - a - c) * (-b).exp()
                        result[spec.name] = self._emit(spec.name, u)
                    else:
                        values[spec.name] = result[spec.name] = self._sample_site(spec.name, fn, self._discrete_infer())
                if level.name in wanted:
                    parent_values[level.name] = self._parent_values(level, lam, unconstrained, params)
        return result

    # ---- summaries ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _draws(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """``num_summary_samples`` draws at full plate size, with a fixed seed (the caller's RNG is left untouched);
        continuous sites in unconstrained space. Leading dim: the draws."""
        self._require_setup(*args, **kwargs)
        assert self.structure is not None
        full = {
            n: pyro.plate(n, p.size, dim=p.dim)
            for n, p in self.structure.plates.items()
            if p.dim is not None and n in self._guide_plate_names()
        }
        saved = self.create_plates
        self.create_plates = lambda *a, **k: list(full.values())
        param = next(iter(self.parameters()), None)
        devices = [param.device] if param is not None and param.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), pyro.poutine.block():
                torch.manual_seed(0)
                dim = -self.structure.max_plate_nesting - 1
                with pyro.plate("_hvm_summary_draws", self.num_summary_samples, dim=dim):
                    values = self.forward(*args, **kwargs)
        finally:
            self.create_plates = saved
        out = {}
        for name, v in values.items():
            site = self.structure.latent[name]
            if not site.discrete:
                v = torch.distributions.biject_to(site.support).inv(v)
            shape = site.unconstrained_shape if not site.discrete else site.shape
            out[name] = v.reshape((self.num_summary_samples, *tuple(shape)))
        return out

    @torch.no_grad()
    def quantiles(self, quantiles: list[float] | torch.Tensor, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Marginal quantiles of every latent site (Monte Carlo, ``num_summary_samples`` draws, taken in unconstrained
        space for continuous sites), full size; the quantile dim comes first. Discrete sites return values of their
        support (lower empirical quantile).

        Example::

            guide.quantiles([0.05, 0.5, 0.95], data)["z"].shape  # (3, *z.shape)
        """
        draws = self._draws(*args, **kwargs)
        out = {}
        for name, v in draws.items():
            site = self.structure.latent[name]
            value = empirical_quantiles(v, quantiles, discrete=site.discrete)
            out[name] = value if site.discrete else self._constrain(name, value)
        return out

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Marginal medians of every latent site (the 0.5 quantile of :meth:`quantiles`), full size."""
        return {k: v[0] for k, v in self.quantiles([0.5], *args, **kwargs).items()}

    @torch.no_grad()
    def log_marginal(self, values: dict[str, torch.Tensor], *, num_nodes: int = 64) -> torch.Tensor:
        r""":math:`\log q(z)` of the *global* latent sites at the given values, integrating :math:`\lambda` out.

        With the mixture prior, every component is a product of one-dimensional Gaussians, so
        :math:`q(z) = \sum_k \pi_k \prod_j \int \mathcal N(\lambda_j; \mu_{kj}, \sigma_{kj}) q(z_j \mid \lambda_j)
        d\lambda_j`; each integral is computed by Gauss–Hermite quadrature with ``num_nodes`` nodes (error: compare
        with ``2 * num_nodes``). Needs ``prior="mixture"``, sites with one parameter per coordinate (Bernoulli,
        Poisson, Binomial) and every global site in ``values``, each with one leading batch dim.

        Example::

            grid = torch.cartesian_prod(torch.arange(30.0), torch.arange(30.0))
            log_q = guide.log_marginal({"z": grid})  # (900,)
        """
        if self.prior != "mixture":
            raise ValueError("log_marginal needs prior='mixture' (a flow prior has no product form to integrate)")
        if self.prototype_trace is None:
            raise RuntimeError("the guide has no parameters yet: call it once (or train it) first")
        level = next((lv for lv in self.levels if not lv.plates), None)
        if level is None or set(values) != {s.name for s in level.sites}:
            names = [] if level is None else [s.name for s in level.sites]
            raise ValueError(f"log_marginal takes values of exactly the global latent sites {names}")
        for spec in level.sites:
            if spec.num_params != 1:
                raise ValueError(
                    f"site '{spec.name}' ({spec.family}) has {spec.num_params} parameters per coordinate; "
                    "log_marginal integrates one-parameter families (Bernoulli, Poisson, Binomial) only"
                )
        locs = self._rate(level, f"{level.key}_locs") * getattr(self.prior_params, f"{level.key}_locs")  # (K, D)
        scales = positive(getattr(self.prior_params, f"{level.key}_scales"))
        log_pi = torch.log_softmax(_LOGIT_SCALE * getattr(self.prior_params, f"{level.key}_logits"), -1)
        x, w = _gauss_hermite(num_nodes, locs.dtype, locs.device)
        lam = locs.unsqueeze(-1) + math.sqrt(2.0) * scales.unsqueeze(-1) * x  # (K, D, nodes)
        total = None
        for spec in level.sites:
            z = values[spec.name]
            n = z.shape[0]
            z = z.reshape(n, spec.num_coords)  # (n, C)
            block = lam[:, spec.offset : spec.offset + spec.size]  # (K, C, nodes)
            params = block.permute(0, 2, 1).reshape(lam.shape[0], num_nodes, *spec.elem_shape, 1)
            like = spec.likelihood(params.unsqueeze(1), event=False)  # batch (K, 1, nodes, *elem)
            log_q = like.log_prob(z.reshape(1, n, 1, *spec.elem_shape).to(locs.dtype))
            log_q = log_q.reshape(lam.shape[0], n, num_nodes, -1)  # per coordinate
            per_coord = torch.logsumexp(log_q + w.log().reshape(1, 1, -1, 1), 2) - 0.5 * math.log(math.pi)
            term = per_coord.sum(-1)  # (K, n)
            total = term if total is None else total + term
        return torch.logsumexp(log_pi.unsqueeze(-1) + total, 0)


@contextmanager
def _seeded(seed: int = 0) -> Iterator[None]:
    """Model reads with fixed random numbers (the same draws of sites the guide does not sample in every read) that
    leave the caller's CPU generator as it was. Seeds the CPU generator only: ``torch.manual_seed`` would also queue
    seeds for every lazily initialised accelerator, recording a stack trace each time (a tenth of a slope refresh's
    CPU time on radon), and leave them seeded outside the fork."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _average_hook(guide: weakref.ref) -> None:
    live = guide()
    if live is not None:
        live._update_global_control_variate()
        live._update_averages()


def _start_as_identity(layer: nn.Module) -> None:
    """Set a Pyro rational-spline layer (``Spline``, or ``SplineAutoregressive`` with its network's readout zeroed) to
    the identity map: equal bin widths and heights and unit knot derivatives. The flow prior then starts as
    ``N(loc, scale²)``, with its median at the init location. Pyro initialises splines at random."""
    with torch.no_grad():
        if isinstance(layer, T.Spline):
            widths, heights, derivatives = (
                layer.unnormalized_widths,
                layer.unnormalized_heights,
                layer.unnormalized_derivatives,
            )
            widths.zero_()
            heights.zero_()
            derivatives.fill_(_IDENTITY_DERIVATIVE)
            return
        if isinstance(layer, T.SplineAutoregressive):
            readout = layer.arn.layers[-1]
            readout.weight.zero_()
            k = layer.spline.count_bins
            bias = readout.bias.view(-1, layer.arn.input_dim)  # rows: widths (k), heights (k), derivatives (k-1), …
            bias.zero_()
            bias[2 * k : 3 * k - 1] = _IDENTITY_DERIVATIVE
            return
    raise TypeError(f"no identity initialisation for {type(layer).__name__}")


#: ``softplus(x) + 1e-3 = 1``: the unnormalised knot derivative of an identity spline (Pyro's ``min_derivative``)
_IDENTITY_DERIVATIVE = math.log(math.expm1(1.0 - 1e-3))


def _gauss_hermite(n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights of ∫ e^{-x²} f(x) dx ≈ Σ w_i f(x_i) (Golub–Welsch)."""
    i = torch.arange(1, n, dtype=torch.float64)
    jacobi = torch.diag(torch.sqrt(i / 2), 1) + torch.diag(torch.sqrt(i / 2), -1)
    nodes, vecs = torch.linalg.eigh(jacobi)
    weights = math.sqrt(math.pi) * vecs[0].pow(2)
    return nodes.to(dtype=dtype, device=device), weights.to(dtype=dtype, device=device)

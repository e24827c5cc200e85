r"""The conjugate conditional of the branch guides: each group's prior conditional, as the model states it, updated by
a Gaussian pseudo-observation.

In a hierarchical model the posterior conditional of a group's latents given everything above them is their prior
conditional times the group's likelihood, :math:`p(u_i \mid \theta, y) \propto p(u_i \mid \mathrm{pa}_i)\,
p(y_i \mid u_i, \theta)`. When the prior conditional is Gaussian in the site's unconstrained space (``Normal`` with real
support, ``LogNormal`` in log space, ``MultivariateNormal``; :func:`gaussian_prior`) and the likelihood is replaced by a
Gaussian *pseudo-observation* :math:`\mathcal N(t_i;\ u_i, \Lambda_i^{-1})`, the update is closed form:

.. math::

    q(u_i \mid \mathrm{pa}_i) = \mathcal N(P_i^{-1}\eta_i,\ P_i^{-1}), \qquad
    P_i = P_0 + \Lambda_i, \qquad \eta_i = P_0 m_0 + \Lambda_i t_i,

with :math:`(m_0, P_0^{-1})` the prior conditional's mean and covariance *at the ancestors' sampled values*. The family
contains the exact posterior conditional of Gaussian hierarchies (radon's county effects: :math:`\Lambda_i = n_i /
\sigma^2`, :math:`t_i` the county's mean residual; eight schools: :math:`\Lambda_j = 1/\sigma_j^2`, :math:`t_j = y_j`)
and keeps the funnel: a group with little data has :math:`\Lambda_i \ll P_0` and follows its prior's scale, a group
with much data follows its own.

**Parameterisation** (:func:`conjugate_conditional`). Optimising :math:`(t_i, \Lambda_i)` directly is badly
conditioned: an optimiser step in :math:`t_i` moves the conditional mean only by the data's weight
:math:`\Lambda_i / (P_0 + \Lambda_i)` times the step, and :math:`\Lambda_i \propto 1/\sigma^2` must follow the
observation scale across orders of magnitude while it is learnt. Both are expressed against a *reference* — the
prior conditional :math:`(\bar m_0, \bar P_0)` and the curvature :math:`\bar F_i` of the rest of the model
(:func:`element_expansion`) at the globals' variational mean :math:`\bar\theta` and the groups' reference means:

.. math::

    \bar\Lambda_i = D_i L_i L_i^\top D_i,\quad D_i = \operatorname{diag}(\bar F_i)^{1/2}, \qquad
    \Lambda_i(\theta) = E\,\bar\Lambda_i\,E,\quad E = \operatorname{diag}(e^{C_i (\theta - \bar\theta)}), \\
    (\Lambda t)_i(\theta) = \bar\Lambda_i \bar m_0 + (\bar P_0 + \bar\Lambda_i)(\bar M_i - \bar m_0)
        + B_i (\theta - \bar\theta).

The free parameters are :math:`\bar M_i` (the conditional mean at the reference: a step moves it one for one) and
:math:`L_i` (unit at the start, so the pseudo-observation starts with the likelihood's own Fisher information,
Laplace-style, and only learns a correction). :math:`B_i, C_i` (``covariance="dense"``) are not learnt: they are how
the likelihood's own Gaussian expansion — its natural parameter :math:`F c + g` and the log of its precision's
diagonal — moves with the globals, read from the model by central differences (radon: the county's summed residual
moves with the floor effect, its precision with the noise scale). The shift acts on the natural parameter, so no
curvature is inverted: where the likelihood is nearly flat in some direction the shift moves the mean by at most
the prior's scale. Learnt slopes, one set per group, random-walked under one-particle noise — worst when each group
is seen in a few steps only — and collapsed radon's county scale at Adam's rate 0.05.

The reference is redone every few steps of each group, and the parameters are moved with it so that :math:`q` stays
the same (:func:`rebase`): the reference is a change of coordinates, not of family. A group seen for the first time
starts at one Newton step from its initial value (:func:`newton_mean`), exact for a Gaussian likelihood, so that the
groups do not have to walk to their data at the optimiser's rate while the globals, which see every group at each
step, run ahead to make up for them (on minibatches of 100 of 1,000 groups, that ran the globals 60 posterior sds
away). Holding the reference fixed within a step drops from the gradient a term proportional to
:math:`\partial \mathcal L / \partial (t_i, \Lambda_i)`, which vanishes at every optimum over the group's parameters,
so the fixed points are those of the exact gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample
from torch.distributions import biject_to, constraints

from pyro_hier.plates import PlateCall, PlateRecorder, ReplaySubsamples

__all__ = [
    "GaussianPrior",
    "Unobserved",
    "capture_priors",
    "conditional_mode",
    "conjugate_conditional",
    "conjugate_offset",
    "cubature_points",
    "element_curvature",
    "element_expansion",
    "gaussian_kl",
    "gaussian_log_normaliser",
    "gaussian_prior",
    "gaussian_update",
    "joint_expansion",
    "levels_expansion",
    "line_searched_mean",
    "newton_mean",
    "newton_step",
    "precision_to_scale_tril",
    "psd_part",
    "psd_root",
    "pseudo_observation",
    "rebase",
    "rest_log_density",
    "smoothed_expansion",
    "smoothed_pseudo_observation",
    "trust_region_step",
    "warm_conditional_mode",
]


@dataclass
class GaussianPrior:
    """A prior conditional in a site's (or a level's) unconstrained space, one vector per batch element:
    ``loc (..., d)`` and either the precision's diagonal ``precision (..., d)`` or the full ``precision (..., d, d)``.
    """

    loc: torch.Tensor
    precision: torch.Tensor

    @property
    def diagonal(self) -> bool:
        return self.precision.dim() == self.loc.dim()

    def full_precision(self) -> torch.Tensor:
        return torch.diag_embed(self.precision) if self.diagonal else self.precision

    @staticmethod
    def concat(parts: list[GaussianPrior]) -> GaussianPrior:
        """The block-diagonal prior of independent parts, concatenated along the last dim."""
        batch = torch.broadcast_shapes(*(p.loc.shape[:-1] for p in parts))
        locs = torch.cat([p.loc.expand(batch + p.loc.shape[-1:]) for p in parts], -1)
        if all(p.diagonal for p in parts):
            precs = torch.cat([p.precision.expand(batch + p.precision.shape[-1:]) for p in parts], -1)
            return GaussianPrior(locs, precs)
        return GaussianPrior(locs, _block_diag_batched([p.full_precision() for p in parts], batch))


def _block_diag_batched(blocks: list[torch.Tensor], batch: torch.Size) -> torch.Tensor:
    d = sum(b.shape[-1] for b in blocks)
    like = blocks[0]
    out = like.new_zeros((*batch, d, d))
    start = 0
    for b in blocks:
        k = b.shape[-1]
        out[..., start : start + k, start : start + k] = b.expand((*batch, k, k))
        start += k
    return out


def _base(fn):
    while isinstance(fn, dist.Independent | dist.ExpandedDistribution | dist.MaskedDistribution):
        fn = fn.base_dist
    return fn


def _is_real(support: constraints.Constraint) -> bool:
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return type(support) is type(constraints.real)  # (by type: an unpickled constraint is another instance)


def _is_positive(support: constraints.Constraint) -> bool:
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return type(support) is type(constraints.positive) and float(support.lower_bound) == 0.0


def gaussian_prior(fn, support: constraints.Constraint) -> GaussianPrior | None:
    """``fn`` as a Gaussian over the unconstrained value ``biject_to(support).inv(z)``, one vector per element of
    ``fn.batch_shape`` (its event flattened): ``None`` when it is not Gaussian there.

    Recognised: ``Normal`` with real support, ``LogNormal`` (Gaussian in log space, which is where
    ``biject_to(positive)`` maps), ``MultivariateNormal``, each possibly expanded, masked, or with batch dims
    reinterpreted as events (``.to_event``)."""
    base = _base(fn)
    batch, event = fn.batch_shape, fn.event_shape
    if isinstance(base, torch.distributions.LogNormal) and _is_positive(support):
        loc, scale = base.loc, base.scale
    elif isinstance(base, torch.distributions.Normal) and _is_real(support):
        loc, scale = base.loc, base.scale
    elif isinstance(base, torch.distributions.MultivariateNormal) and _is_real(support) and len(event) == 1:
        loc = base.loc.expand(batch + event)
        precision = base.precision_matrix.expand(batch + event + event)
        return GaussianPrior(loc, precision)
    else:
        return None
    shape = batch + event
    loc = loc.expand(shape).reshape((*batch, -1))
    precision = scale.expand(shape).reshape((*batch, -1)).pow(-2)
    return GaussianPrior(loc, precision)


def precision_to_scale_tril(precision: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of ``precision⁻¹`` from one Cholesky and one triangular solve: with ``J`` the reversal
    permutation and ``J Λ J = R Rᵀ``, ``Λ⁻¹ = (J R⁻ᵀ J)(J R⁻ᵀ J)ᵀ`` and ``J R⁻ᵀ J`` is lower triangular."""
    flipped = torch.linalg.cholesky(precision.flip(-2, -1))
    eye = torch.eye(precision.shape[-1], dtype=precision.dtype, device=precision.device)
    return torch.linalg.solve_triangular(flipped.mT, eye, upper=True).flip(-2, -1)


def psd_root(matrix: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """A lower-triangular root of a symmetric matrix made positive definite: its eigenvalues clamped below at the
    smallest of ``floor (..., d)`` (a curvature is not positive definite where the likelihood is not log-concave, or
    where an element has no data)."""
    sym = 0.5 * (matrix + matrix.mT)
    values, vectors = torch.linalg.eigh(sym)
    values = values.clamp(min=floor.min(-1, keepdim=True).values)
    return torch.linalg.cholesky((vectors * values.unsqueeze(-2)) @ vectors.mT)


def psd_part(matrix: torch.Tensor) -> torch.Tensor:
    """A symmetric matrix with its negative eigenvalues set to zero (a curvature where the likelihood is not
    log-concave): the precision of a model's pseudo-observation (:class:`~pyro_hier.AutoAmortizedBranchGuide`,
    :class:`~pyro_hier.AutoPlateAmortizedFlow`)."""
    sym = 0.5 * (matrix + matrix.mT)
    if sym.shape[-1] == 1:
        return sym.clamp(min=0.0)
    values, vectors = torch.linalg.eigh(sym)
    return (vectors * values.clamp(min=0.0).unsqueeze(-2)) @ vectors.mT


def pseudo_observation(
    gradient: torch.Tensor, curvature: torch.Tensor, centre: torch.Tensor, diagonal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The Gaussian potential of a second-order expansion of the rest of the model at ``centre`` :math:`c`, with
    gradient :math:`g` and curvature :math:`F` (minus the Hessian): precision :math:`\Lambda = F_+` (its
    positive semi-definite part, :func:`psd_part`; the clamped diagonal when ``diagonal``) and natural parameter
    :math:`\eta = \Lambda c + g`, so that :math:`\log p \approx \eta^\top u - \tfrac12 u^\top \Lambda u` near
    :math:`c`. Returns ``(precision, natural)``: ``(…, d, d)`` and ``(…, d)``, or ``(…, d)`` twice when ``diagonal``."""
    if diagonal:
        info = curvature.diagonal(dim1=-2, dim2=-1).clamp(min=0.0)
        return info, info * centre + gradient
    info = psd_part(curvature)
    return info, (info @ centre.unsqueeze(-1)).squeeze(-1) + gradient


# ---- running the model ----------------------------------------------------------------------------------------------
class _Reached(Exception):
    """Raised inside the model to stop it once every wanted prior conditional has been seen."""


class _PriorCapture(ReplaySubsamples):
    def __init__(self, values: dict[str, torch.Tensor], wanted: set[str], subsamples: dict) -> None:
        super().__init__(subsamples)
        self.values, self.wanted = values, wanted
        self.fns: dict[str, object] = {}

    def _pyro_sample(self, msg) -> None:
        super()._pyro_sample(msg)
        if isinstance(msg["fn"], _Subsample) or msg["is_observed"]:
            return
        name = msg["name"]
        if name in self.wanted:
            self.fns[name] = msg["fn"]
            if self.wanted <= self.fns.keys():
                raise _Reached
        if name in self.values:
            msg["value"], msg["done"] = self.values[name], True


def capture_priors(
    model: Callable,
    args: tuple,
    kwargs: dict,
    values: dict[str, torch.Tensor],
    wanted: Iterable[str],
    subsamples: dict[str, torch.Tensor] | None = None,
    *,
    validate: bool = True,
    init: Callable[[dict], torch.Tensor] | None = None,
) -> tuple[dict[str, object], dict[str, PlateCall]]:
    """Run ``model`` hidden from outer handlers, with the latent ``values`` given, until every site in ``wanted`` has
    been reached (the model stops there): ``({site: its prior conditional}, {plate: PlateCall of this call})``.
    Latent sites before them that are not in ``values`` are sampled from the model, as in a plain run; plates the
    model subsamples at random take the indices in ``subsamples`` (those of the guide's call). ``validate=False``:
    without validating the distributions' arguments (for a guide's call, whose model's own run checks the same ones;
    the checks read the tensors, a good part of a small model's run). ``init``: the init strategy of the latent sites
    that are neither given nor wanted (as ``InitMessenger(init)(model)`` would give them; a guide passes the user's
    model and its own strategy), applied after the given values are set, so that it makes no value it would throw
    away."""
    wanted = set(wanted)
    capture = _PriorCapture(values, wanted, subsamples or {})
    plates = PlateRecorder()
    initial = nullcontext() if init is None else InitMessenger(init)
    try:
        with poutine.block(), plates, initial, capture, nullcontext() if validate else pyro.validation_enabled(False):
            model(*args, **kwargs)
    except _Reached:
        pass
    missing = wanted - capture.fns.keys()
    if missing:
        raise RuntimeError(f"the model did not sample the latent site(s) {sorted(missing)} in this call")
    return capture.fns, plates.calls


def element_expansion(
    model: Callable,
    args: tuple,
    kwargs: dict,
    values: dict[str, torch.Tensor],
    level_u: torch.Tensor,
    to_values: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    plate_scale: float,
    subsamples: dict[str, torch.Tensor] | None = None,
    observed: Iterable[str] = (),
    collapse: Callable[[poutine.Trace], tuple[set[str], torch.Tensor, float]] | None = None,
    curvature: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""The second-order expansion of the rest of the model at each element of a level: the gradient
    :math:`g_i = \partial \log p(\text{everything but the level's own prior}) / \partial u_i` ``(..., d)`` and the
    curvature blocks :math:`F_i = -\partial^2 \log p(\ldots) / \partial u_i^2` ``(..., d, d)``, at the level's
    unconstrained element vectors ``level_u (..., d)``, with the other latent sites held at ``values``.

    ``to_values(u)`` maps element vectors to the level's sites' constrained values. Elements of a plate are
    conditionally independent in a hierarchical model, so the Hessian is block diagonal across them and ``d``
    Hessian-vector products (one per coordinate, all elements at once) give every block. Log densities are weighted by
    each site's scale divided by ``plate_scale`` (the level's plates' subsampling factor): a group's own data count
    once, and an observation plate subsampled on its own is scaled up to the whole.

    ``collapse(trace)``, if given, replaces some sites' log densities by a term of its own: it returns ``(sites,
    log_z, scale)``, the sites it covers, its log density (any shape, summed) and their scale. A level below this one
    whose conditional is its prior times a Gaussian pseudo-observation is integrated out this way
    (:func:`gaussian_log_normaliser`), so the expansion is that of the level's marginal likelihood.

    ``curvature=False``: the gradient alone (no Hessian-vector products), with ``None`` for the curvature.

    :raises Unobserved: if a site of ``observed`` is sampled, not observed, in this call (its data omitted, as in
        ``Predictive(model, guide=guide)`` with ``obs=None``): the expansion would read a draw as data.
    """
    with torch.enable_grad():
        u = level_u.detach().clone().requires_grad_(True)
        own = to_values(u)
        total = rest_log_density(model, args, kwargs, values, own, plate_scale, subsamples, observed, collapse)
        d = u.shape[-1]
        flat = u.new_zeros((*u.shape, d)) if curvature else None
        if not total.requires_grad:  # nothing in the model reads the level (e.g. a latent observation): no curvature
            return torch.zeros_like(u), flat
        (grad,) = torch.autograd.grad(total, u, create_graph=curvature, allow_unused=True)
        if grad is None:
            return torch.zeros_like(u), flat
        if not curvature or not grad.requires_grad:  # (read only linearly: no curvature)
            return grad.detach(), flat
        columns = []
        for k in range(d):
            probe = torch.zeros_like(u)
            probe[..., k] = 1.0
            (col,) = torch.autograd.grad(grad, u, grad_outputs=probe, retain_graph=k + 1 < d, allow_unused=True)
            columns.append(torch.zeros_like(u) if col is None else -col)
    return grad.detach(), torch.stack(columns, -1).detach()


def rest_log_density(
    model: Callable,
    args: tuple,
    kwargs: dict,
    values: dict[str, torch.Tensor],
    own: dict[str, torch.Tensor],
    plate_scale: float,
    subsamples: dict[str, torch.Tensor] | None = None,
    observed: Iterable[str] = (),
    collapse: Callable[[poutine.Trace], tuple[set[str], torch.Tensor, float]] | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """The model's log density on the call ``args``, ``kwargs`` with its latent sites at ``values`` and ``own``, less
    the sites of ``own`` (differentiable in ``own``'s values): the "rest of the model" that
    :func:`element_expansion` and :func:`joint_expansion` expand. Each site's log density is weighted by its scale
    divided by ``plate_scale``; ``collapse`` and ``observed`` as in :func:`element_expansion`. The model's run is
    hidden from the caller's handlers, its plates that Pyro subsamples at random given ``subsamples``.
    ``validate=False``: without validating the distributions' arguments (a quarter of a small model's run; for a
    guide's reads at values in their supports, whose data the model's own run checks)."""
    checks = nullcontext() if validate else pyro.validation_enabled(False)
    total = next(iter(own.values())).new_zeros(()) if own else torch.zeros(())
    if collapse is None and not observed:  # (no trace needed: the log densities summed as the model runs)
        summed = _RestLogDensity({**values, **own}, own, plate_scale)
        with poutine.block(), ReplaySubsamples(subsamples or {}), checks, summed:
            model(*args, **kwargs)
        return sum(summed.terms, total)
    with poutine.block(), ReplaySubsamples(subsamples or {}), checks:  # (hidden from the caller's handlers)
        trace = poutine.trace(poutine.condition(model, {**values, **own})).get_trace(*args, **kwargs)
    missing = [n for n in observed if n in trace.nodes and not trace.nodes[n]["is_observed"]]
    if missing:
        raise Unobserved(f"the observed site(s) {missing} are not observed in this call")
    covered: set[str] = set()
    if collapse is not None:
        covered, log_z, scale = collapse(trace)
        total = total + (log_z * (scale / plate_scale)).sum()
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or name in own or name in covered or isinstance(site["fn"], _Subsample):
            continue
        log_p = site["fn"].log_prob(site["value"])
        if site["mask"] is not None and site["mask"] is not True:
            log_p = log_p * site["mask"]
        total = total + (log_p * (site["scale"] / plate_scale)).sum()
    return total


class _RestLogDensity(Messenger):
    """:func:`rest_log_density` without a trace: conditions the model on ``values`` (as ``poutine.condition``) and
    collects each sample site's weighted log density but those of ``own`` and of the plates, in the model's order
    (the same sum as the trace's), at each site's final scale and mask."""

    def __init__(self, values: dict[str, torch.Tensor], own: dict[str, torch.Tensor], plate_scale: float) -> None:
        super().__init__()
        self.values, self.own, self.plate_scale = values, own, plate_scale
        self.terms: list[torch.Tensor] = []

    def _pyro_sample(self, msg) -> None:
        if msg["name"] in self.values and not isinstance(msg["fn"], _Subsample):
            msg["value"], msg["is_observed"] = self.values[msg["name"]], True

    def _pyro_post_sample(self, msg) -> None:
        if msg["name"] in self.own or isinstance(msg["fn"], _Subsample):
            return
        log_p = msg["fn"].log_prob(msg["value"])
        if msg["mask"] is not None and msg["mask"] is not True:
            log_p = log_p * msg["mask"]
        self.terms.append((log_p * (msg["scale"] / self.plate_scale)).sum())


def joint_expansion(
    model: Callable,
    args: tuple,
    kwargs: dict,
    values: dict[str, torch.Tensor],
    level_u: torch.Tensor,
    to_values: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    globals_v: torch.Tensor,
    to_globals: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    plate_scale: float,
    subsamples: dict[str, torch.Tensor] | None = None,
    direction: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    r"""The second-order expansion of the rest of the model (:func:`rest_log_density`: all but the level's and the
    globals' own sites) jointly in a level's element vectors ``level_u (..., d)`` and the globals ``globals_v
    (d_v,)``, from one run of the model: with :math:`H` its Hessian in :math:`(u, v)` and :math:`F = -H`,

    - ``direction=None``: :math:`(g_u, F_{uu}, g_v, F_{vv}, F_{uv})`, shapes ``(..., d)``, ``(..., d, d)`` (the blocks
      per element, from ``d`` Hessian-vector products with every element's coordinate at once, as
      :func:`element_expansion`), ``(d_v,)``, ``(d_v, d_v)`` and ``(..., d, d_v)`` (``d_v`` products, one per global
      coordinate: exact whatever the plate structure);
    - ``direction=(δu, δv)``: :math:`(g_u, g_v, (F δ)_u, (F δ)_v)` by one Hessian-vector product.

    Every output is linear in the model's log density, so sums over blocks of rows (:func:`~pyro_hier.plates.
    row_blocks`) add up. Where each row reads at most one element of the level, :math:`F_{uu}` is block diagonal and
    the two forms agree: :math:`(F\delta)_u = F_{uu,i}\,\delta u_i + F_{uv,i}\,\delta v` per element.

    Example (the counties of a gathered radon model and its globals, as :class:`~pyro_hier.AutoBranchGuide`'s rows'
    control variate reads them)::

        g_u, f_uu, g_v, f_vv, f_uv = joint_expansion(
            model, args, kwargs, values, a_ref, to_county_values, theta_ref, to_global_values, 1.0
        )

    Reference: R. Johnson, T. Zhang, *Accelerating Stochastic Gradient Descent using Predictive Variance Reduction*,
    NeurIPS 2013 (the control variate this expansion serves)."""
    if direction is not None:
        gradients, g_v, products = levels_expansion(
            model,
            args,
            kwargs,
            values,
            [(level_u, to_values)],
            globals_v,
            to_globals,
            plate_scale,
            subsamples,
            directions=[((direction[0],), direction[1])],
        )
        (product_u,), product_v = products[0]
        return gradients[0], g_v, product_u, product_v
    gradients, curvatures, g_v, f_vv, crosses = levels_expansion(
        model, args, kwargs, values, [(level_u, to_values)], globals_v, to_globals, plate_scale, subsamples
    )
    return gradients[0], curvatures[0], g_v, f_vv, crosses[0]


def levels_expansion(
    model: Callable,
    args: tuple,
    kwargs: dict,
    values: dict[str, torch.Tensor],
    levels: Sequence[tuple[torch.Tensor, Callable[[torch.Tensor], dict[str, torch.Tensor]]]],
    globals_v: torch.Tensor | None,
    to_globals: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None,
    plate_scale: float,
    subsamples: dict[str, torch.Tensor] | None = None,
    directions: Sequence[tuple[Sequence[torch.Tensor | None], torch.Tensor | None]] | None = None,
    validate: bool = True,
) -> tuple:
    r"""The second-order expansion of the rest of the model (:func:`rest_log_density`: all but the levels' and the
    globals' own sites) jointly in several levels' element vectors :math:`u_\ell` (``levels``: pairs ``(u_ℓ (..., d_ℓ),
    to_values_ℓ)``) and the globals ``globals_v (d_v,)`` (``None``: none), from *one* run of the model. With :math:`H`
    its Hessian in :math:`(u_1, \dots, u_k, v)` and :math:`F = -H`:

    - ``directions=None``: ``(gradients, curvatures, g_v, F_vv, crosses)``: per level :math:`g_\ell` ``(..., d_ℓ)``
      and the blocks :math:`F_{\ell\ell,i}` ``(..., d_ℓ, d_ℓ)`` per element (``d_ℓ`` Hessian-vector products with
      every element's coordinate at once: the blocks where each row of the likelihood reads at most one element of the
      level, as :func:`element_expansion`), and from ``d_v`` products (exact whatever the plate structure)
      :math:`g_v` ``(d_v,)``, :math:`F_{vv}` ``(d_v, d_v)`` and per level :math:`F_{\ell v}` ``(..., d_ℓ, d_v)``
      (``None`` for the three without globals). The blocks between two levels (:math:`F_{\ell m}`, dense for crossed
      levels) are not read;
    - ``directions``: a list of products :math:`F\delta`, each ``(δ_levels, δ_v)`` with ``None`` for a zero part:
      ``(gradients, g_v, products)``, each product ``(per-level parts of Fδ, its globals' part)`` — one
      Hessian-vector product each, on the same run.

    ``validate=False``: the model's run does not validate its distributions' arguments (:func:`rest_log_density`).

    Every output is linear in the model's log density, so sums over blocks of rows (:func:`~pyro_hier.plates.
    row_blocks`) add up. :func:`joint_expansion` is the one-level case.

    Example (the crossed students and questions of an item-response model and its globals, as
    :class:`~pyro_hier.AutoBranchGuide`'s rows' control variate reads them on a call's rows, one product per level)::

        (g_a, g_b), g_v, ((fa, _), fv_a), ((_, fb), fv_b) = levels_expansion(
            model, args, kwargs, values, [(a_ref, to_ability), (b_ref, to_difficulty)], theta_ref, to_globals, 1.0,
            directions=[((da, None), dv), ((None, db), None)],
        )

    Reference: B. A. Pearlmutter, *Fast Exact Multiplication by the Hessian*, Neural Computation 1994 (the products).
    """
    with torch.enable_grad():
        us = [u.detach().clone().requires_grad_(True) for u, _ in levels]
        v = None if globals_v is None else globals_v.detach().clone().requires_grad_(True)
        own: dict[str, torch.Tensor] = {}
        for u, (_, to_values) in zip(us, levels, strict=True):
            own.update(to_values(u))
        if v is not None:
            assert to_globals is not None
            own.update(to_globals(v))
        total = rest_log_density(model, args, kwargs, values, own, plate_scale, subsamples, validate=validate)
        inputs = [*us, *([] if v is None else [v])]
        if total.requires_grad:
            grads = torch.autograd.grad(total, inputs, create_graph=True, allow_unused=True)
            grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True)]
        else:  # nothing in the model reads them
            grads = [torch.zeros_like(x) for x in inputs]

        def product(parts: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
            pairs = zip(grads, parts, strict=True)
            inner = sum(((g * p).sum() for g, p in pairs if p is not None), total.new_zeros(()))
            if not inner.requires_grad:  # (read only linearly, or not at all)
                return [torch.zeros_like(x) for x in inputs]
            cols = torch.autograd.grad(inner, inputs, retain_graph=True, allow_unused=True)
            return [torch.zeros_like(x) if c is None else -c.detach() for x, c in zip(inputs, cols, strict=True)]

        k = len(us)
        gradients = tuple(g.detach() for g in grads[:k])
        g_v = None if v is None else grads[k].detach()
        if directions is not None:
            products = []
            for levels_part, v_part in directions:
                out = product([*levels_part, *([] if v is None else [v_part])])
                products.append((tuple(out[:k]), None if v is None else out[k]))
            return gradients, g_v, tuple(products)
        curvatures = []
        for index, u in enumerate(us):
            eye = torch.eye(u.shape[-1], dtype=u.dtype, device=u.device)
            columns = []
            for j in range(u.shape[-1]):
                parts: list[torch.Tensor | None] = [None] * len(inputs)
                parts[index] = eye[j].expand_as(u)
                columns.append(product(parts)[index])
            curvatures.append(torch.stack(columns, -1))
        if v is None:
            return gradients, tuple(curvatures), None, None, None
        eye_v = torch.eye(v.shape[-1], dtype=v.dtype, device=v.device)
        by_v = []
        for j in range(v.shape[-1]):
            parts = [None] * len(inputs)
            parts[k] = eye_v[j]
            by_v.append(product(parts))
        f_vv = torch.stack([col[k] for col in by_v], -1)
        crosses = tuple(torch.stack([col[index] for col in by_v], -1) for index in range(k))
    return gradients, tuple(curvatures), g_v, f_vv, crosses


class Unobserved(LookupError):
    """:func:`element_expansion` was asked to expand a likelihood whose data this call omits."""


def element_curvature(
    model: Callable,
    args: tuple,
    kwargs: dict,
    values: dict[str, torch.Tensor],
    level_u: torch.Tensor,
    to_values: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    plate_scale: float,
    subsamples: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The curvature blocks of :func:`element_expansion` alone, ``(..., d, d)``."""
    return element_expansion(model, args, kwargs, values, level_u, to_values, plate_scale, subsamples)[1]


# ---- the conditional ------------------------------------------------------------------------------------------------
def conjugate_conditional(
    prior: GaussianPrior,
    ref_loc: torch.Tensor,
    ref_precision: torch.Tensor,
    fisher_sd: torch.Tensor,
    mean: torch.Tensor,
    factor: torch.Tensor,
    shift: torch.Tensor | None = None,
    log_stretch: torch.Tensor | None = None,
    precision_tril: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(loc, scale)`` of :math:`q(u \mid \mathrm{pa})` (module docstring), ``scale`` the sd ``(..., d)`` when
    ``factor`` is a vector (independent coordinates) and the lower Cholesky factor of the covariance ``(..., d, d)``
    when it is a matrix.

    :param prior: the prior conditional at the ancestors' sampled values.
    :param ref_loc, ref_precision: the reference prior conditional :math:`(\bar m_0, \bar P_0)` (``ref_precision``
        diagonal ``(..., d)`` or full ``(..., d, d)``).
    :param fisher_sd: the reference curvature's root: :math:`\operatorname{diag}(\bar F)^{1/2}` ``(..., d)`` for
        independent coordinates, or its lower Cholesky factor ``(..., d, d)``.
    :param mean: :math:`\bar M`, the conditional mean at the reference.
    :param factor: :math:`L` (``(..., d, d)``, lower triangular with a positive diagonal) or its diagonal ``(..., d)``.
    :param shift: :math:`B (\theta - \bar\theta)` (``(..., d)``), added to the pseudo-observation's natural
        parameter :math:`\Lambda t`, or ``None``.
    :param log_stretch: :math:`C (\theta - \bar\theta)` (``(..., d)``), the log of its precision's stretch, or
        ``None``.
    :param precision_tril: for a matrix ``factor``, return the lower Cholesky factor of q's precision instead of its
        covariance's (:func:`gaussian_update`).
    """
    if factor.dim() == mean.dim():  # independent coordinates: everything elementwise
        lam_ref = (fisher_sd * factor).pow(2)
        p_ref = ref_precision if ref_precision.dim() == mean.dim() else ref_precision.diagonal(dim1=-2, dim2=-1)
        lam = lam_ref if log_stretch is None else lam_ref * (2 * log_stretch).exp()
        natural = lam_ref * ref_loc + (p_ref + lam_ref) * (mean - ref_loc)
        if shift is not None:
            natural = natural + shift
        if not prior.diagonal:  # (independent coordinates: the prior's precision diagonal)
            prior = GaussianPrior(prior.loc, prior.precision.diagonal(dim1=-2, dim2=-1))
        return gaussian_update(prior, lam, natural)
    # R L with R the reference curvature's Cholesky factor (its sds when only those are kept): Λ̄ = R L LᵀRᵀ
    root = _root(fisher_sd, factor, mean)
    lam_ref = root @ root.mT
    p_ref = ref_precision if ref_precision.dim() > mean.dim() else torch.diag_embed(ref_precision)
    # Λ̄ t̄ = Λ̄ m̄0 + (P̄0 + Λ̄)(M̄ − m̄0) = Λ̄ M̄ + P̄0 (M̄ − m̄0)
    natural = (lam_ref @ mean.unsqueeze(-1) + p_ref @ (mean - ref_loc).unsqueeze(-1)).squeeze(-1)
    if shift is not None:
        natural = natural + shift
    if log_stretch is not None:
        e = log_stretch.exp()
        lam = e.unsqueeze(-1) * lam_ref * e.unsqueeze(-2)
    else:
        lam = lam_ref
    return gaussian_update(prior, lam, natural, precision_tril=precision_tril)


def conjugate_offset(ref_loc: torch.Tensor, ref_precision: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    r""":math:`c = \bar P_0 (\bar M - \bar m_0)`: the pseudo-observation's natural parameter of
    :func:`conjugate_conditional` (a matrix ``factor``, no shift) less :math:`\bar\Lambda \bar M`, so that
    :math:`\bar\Lambda \bar t = \bar\Lambda \bar M + c` and :math:`q = \mathcal N(P^{-1}\eta, P^{-1})` with
    :math:`P = P_0 + \bar\Lambda`, :math:`\eta = P_0 m_0 + \bar\Lambda \bar M + c`
    (:class:`~pyro_hier.distributions.ConjugateNormal`; ``ref_precision`` diagonal ``(..., d)`` or full)."""
    if ref_precision.dim() > mean.dim():
        return (ref_precision @ (mean - ref_loc).unsqueeze(-1)).squeeze(-1)
    return ref_precision * (mean - ref_loc)


def gaussian_update(
    prior: GaussianPrior, precision: torch.Tensor, natural: torch.Tensor, precision_tril: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The prior conditional times a Gaussian pseudo-observation given in natural parameters: ``(loc, scale)`` of

    .. math:: \mathcal N\big((P_0 + \Lambda)^{-1}(P_0 m_0 + \eta),\ (P_0 + \Lambda)^{-1}\big),

    with :math:`\Lambda` = ``precision`` and :math:`\eta` = ``natural`` (``(..., d)``: :math:`\Lambda t` of the
    pseudo-observation :math:`\mathcal N(t;\ u, \Lambda^{-1})`). ``scale`` is the sd ``(..., d)`` when the prior's
    precision and ``precision`` are both diagonal (vectors ``(..., d)``), else the lower Cholesky factor of the
    covariance ``(..., d, d)`` — or, with ``precision_tril=True``, of the precision :math:`P_0 + \Lambda` (one
    Cholesky factorisation and two triangular solves with a vector:
    :class:`~pyro_hier.distributions.CholeskyPrecisionNormal` samples and scores from it). :math:`\Lambda` need not
    be invertible (a group with fewer observations than dimensions)."""
    if prior.diagonal and precision.dim() == natural.dim():
        total = prior.precision + precision
        return (prior.precision * prior.loc + natural) / total, total.rsqrt()
    lam = precision if precision.dim() > natural.dim() else torch.diag_embed(precision)
    if prior.diagonal:  # (elementwise: no matrix product with a diagonal matrix)
        total = lam + torch.diag_embed(prior.precision)
        eta = prior.precision * prior.loc + natural
    else:
        total = prior.precision + lam
        eta = (prior.precision @ prior.loc.unsqueeze(-1)).squeeze(-1) + natural
    if precision_tril:
        tril = torch.linalg.cholesky(total)
        batch = torch.broadcast_shapes(tril.shape[:-2], eta.shape[:-1])
        d = eta.shape[-1]
        tril = tril.expand((*batch, d, d))
        white = torch.linalg.solve_triangular(tril, eta.expand((*batch, d)).unsqueeze(-1), upper=False)
        return torch.linalg.solve_triangular(tril.mT, white, upper=True).squeeze(-1), tril  # (C Cᵀ)⁻¹ η
    scale_tril = precision_to_scale_tril(total)  # (one factorisation for both: loc = L Lᵀ e)
    loc = (scale_tril @ (scale_tril.mT @ eta.unsqueeze(-1))).squeeze(-1)
    return loc, scale_tril


def gaussian_log_normaliser(prior: GaussianPrior, precision: torch.Tensor, natural: torch.Tensor) -> torch.Tensor:
    r"""The log of the integral of a Gaussian pseudo-observation against the prior conditional, one per element:

    .. math::

        \log \int \mathcal N(u;\ m_0, P_0^{-1})\, e^{\eta^\top u - \frac12 u^\top \Lambda u}\, du
        = \tfrac12 e^\top P^{-1} e - \tfrac12 m_0^\top P_0 m_0 + \tfrac12 \log|P_0| - \tfrac12 \log|P|,
        \qquad P = P_0 + \Lambda,\ e = P_0 m_0 + \eta,

    with :math:`\Lambda` = ``precision`` (``(..., d, d)``, or its diagonal ``(..., d)``; need not be invertible) and
    :math:`\eta` = ``natural`` ``(..., d)``. As a function of the prior's mean and precision (of the parents' values)
    it is the marginal likelihood of the level's elements under the pseudo-observation: the message a conjugate
    level sends to its parents. For a pseudo-observation :math:`\mathcal N(t;\ u, \Lambda^{-1})` it equals
    :math:`\log \mathcal N(t;\ m_0, P_0^{-1} + \Lambda^{-1})` up to a constant in :math:`(m_0, P_0)`.

    Example (one coordinate: a group mean ``t`` of ``n`` observations of noise ``σ`` under ``N(a, s²)``)::

        prior = GaussianPrior(loc=a.unsqueeze(-1), precision=torch.full_like(a, s**-2).unsqueeze(-1))
        lam = torch.full_like(t, n / sigma**2)
        log_z = gaussian_log_normaliser(prior, lam, lam * t)  # log N(t; a, s² + σ²/n) + const, per group

    Reference: C. M. Bishop, *Pattern Recognition and Machine Learning*, 2006, §2.3.3 (the marginal of a linear
    Gaussian model)."""
    if prior.diagonal and precision.dim() == natural.dim():
        total = prior.precision + precision
        e = prior.precision * prior.loc + natural
        terms = e.pow(2) / total - prior.precision * prior.loc.pow(2) + prior.precision.log() - total.log()
        return 0.5 * terms.sum(-1)
    p0 = prior.full_precision()
    lam = precision if precision.dim() > natural.dim() else torch.diag_embed(precision)
    p0, lam = torch.broadcast_tensors(p0, lam)
    chol = torch.linalg.cholesky(p0 + lam)
    chol0 = torch.linalg.cholesky(p0)
    e = (p0 @ prior.loc.unsqueeze(-1)).squeeze(-1) + natural
    white = torch.linalg.solve_triangular(chol, e.unsqueeze(-1), upper=False).squeeze(-1)
    prior_root = (chol0.mT @ prior.loc.unsqueeze(-1)).squeeze(-1)
    log_dets = chol0.diagonal(dim1=-2, dim2=-1).log().sum(-1) - chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return 0.5 * (white.pow(2).sum(-1) - prior_root.pow(2).sum(-1)) + log_dets


def _root(fisher_sd: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``R L``: the reference curvature's root times the relative factor (both as matrices)."""
    if factor.dim() == mean.dim():
        factor = torch.diag_embed(factor)
    return fisher_sd.unsqueeze(-1) * factor if fisher_sd.dim() == mean.dim() else fisher_sd @ factor


def newton_mean(prior: GaussianPrior, centre: torch.Tensor, gradient: torch.Tensor, fisher_sd: torch.Tensor):
    r"""One Newton step on :math:`\log p(u_i \mid \mathrm{pa}_i) + \log p(\text{rest} \mid u_i)` from ``centre``,
    with the rest's ``gradient`` there and its curvature's root ``fisher_sd`` (diagonal ``(..., d)`` or lower
    triangular ``(..., d, d)``):

    .. math:: \bar M_i = c_i + (P_0 + \bar F_i)^{-1}\,\bigl(g_i - P_0 (c_i - m_0)\bigr).

    For a Gaussian likelihood this is the exact posterior conditional mean at the reference; it is where a conjugate
    level's conditional mean starts (:class:`~pyro_hier.AutoBranchGuide`), so that the groups do not have to walk
    there at the optimiser's rate while the globals, which see every group, run ahead to make up for them."""
    residual = gradient - (prior.full_precision() @ (centre - prior.loc).unsqueeze(-1)).squeeze(-1)
    if fisher_sd.dim() == centre.dim() and prior.diagonal:
        return centre + residual / (prior.precision + fisher_sd.pow(2))
    root = fisher_sd.unsqueeze(-1) * torch.eye(centre.shape[-1], dtype=centre.dtype, device=centre.device)
    root = root if fisher_sd.dim() == centre.dim() else fisher_sd
    hessian = prior.full_precision() + root @ root.mT
    return centre + torch.linalg.solve(hessian, residual.unsqueeze(-1)).squeeze(-1)


#: bisection steps of :func:`line_searched_mean` where a Newton step overshoots (the step is then found to 1/256)
LINE_SEARCH_STEPS = 8


def line_searched_mean(
    prior: GaussianPrior,
    centre: torch.Tensor,
    gradient: torch.Tensor,
    fisher_sd: torch.Tensor,
    rest_gradient: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    r""":func:`newton_mean`, with each element's step shortened where it overshoots: along the Newton direction
        :math:`\delta_i` of :math:`arphi_i(u) = \log p(u \mid \mathrm{pa}_i) + \log p(	ext{rest} \mid u)`, the step
        length :math:`lpha_i \in (0, 1]` is the full step where the directional derivative
        :math:`h_i'(lpha) =
    ablaarphi_i(c_i + lpha\delta_i) \cdot \delta_i` is still non-negative at
        :math:`lpha = 1` (always so, to rounding, for a Gaussian likelihood: one extra gradient), and otherwise the root
        of :math:`h_i'` found by :data:`LINE_SEARCH_STEPS` bisections (for a log-concave :math:`arphi_i`, the maximum
        along the direction). ``rest_gradient(u)`` is the rest's gradient at element vectors ``u (..., d)``
        (:func:`element_expansion`'s first output); elements are conditionally independent, so one call serves all.

        Where the rest's curvature at the centre is wrong or nearly zero — a logistic likelihood's autograd Hessian is
        zero at logits exactly 0, and the model's initial values are often exactly 0 — the plain Newton step can land
        tens of prior sds away (the herd effects of a binomial mixed model started at −10 to −29 and took the herds'
        scale down with them); the line search keeps the start on the near side of the element's conditional mode."""
    target = newton_mean(prior, centre, gradient, fisher_sd)
    direction = target - centre
    p0 = prior.full_precision()

    def slope(alpha: torch.Tensor) -> torch.Tensor:
        u = centre + alpha.unsqueeze(-1) * direction
        grad = rest_gradient(u) - (p0 @ (u - prior.loc).unsqueeze(-1)).squeeze(-1)
        return (grad * direction).sum(-1)

    ones = centre.new_ones(centre.shape[:-1])
    at_start, at_end = slope(torch.zeros_like(ones)), slope(ones)
    accept = (at_end >= -1e-6 * at_start.abs()) | ~torch.isfinite(at_end)
    if bool(accept.all()):
        return target
    lo, hi = torch.zeros_like(ones), ones
    for _ in range(LINE_SEARCH_STEPS):
        mid = (lo + hi) / 2
        up = slope(mid) >= 0
        lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
    alpha = torch.where(accept, ones, (lo + hi) / 2)
    return centre + alpha.unsqueeze(-1) * direction


def conditional_mode(
    prior: GaussianPrior,
    centre: torch.Tensor,
    gradient: torch.Tensor,
    curvature: torch.Tensor,
    rest_expansion: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    floor: torch.Tensor,
    diagonal: bool,
    steps: int,
    tolerance: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Move each element from ``centre`` towards the mode of its conditional posterior
    :math:`\log p(u_i \mid \mathrm{pa}_i) + \log p(\text{rest} \mid u_i)`: up to ``steps`` Newton steps, each
    line-searched (:func:`line_searched_mean`), stopped once no element moves by more than ``tolerance`` of its prior
    sds. ``gradient`` and ``curvature`` are the rest's at ``centre`` (:func:`element_expansion`), and
    ``rest_expansion(u, curvature=True)`` gives them at element vectors ``u``; the curvature's eigenvalues (its
    diagonal when ``diagonal``) are kept above ``floor (..., d)``. Returns ``(centre, gradient, curvature)`` at the last
    point: there the expansion is the likelihood's Laplace approximation, where at the prior's mean it is one Newton
    step short of it (a logistic likelihood's curvature at logits exactly 0 can be zero: the line search keeps the
    first step on the near side of the mode).

    Example (a level's elements, the rest of the model held at ``values``)::

        expand = lambda u, curvature=True: element_expansion(model, args, kwargs, values, u, to_values, 1.0,
                                                             curvature=curvature)
        g, F = expand(prior.loc)
        mode, g, F = conditional_mode(prior, prior.loc, g, F, expand, 1e-2 * prior.precision, True, 8, 1e-6)

    Reference: J. Nocedal, S. Wright, *Numerical Optimization*, 2006, ch. 3 (line-search Newton methods)."""
    p0 = prior.precision if prior.diagonal else prior.precision.diagonal(dim1=-2, dim2=-1)
    for _ in range(steps):
        if diagonal or centre.shape[-1] == 1:
            root = curvature.diagonal(dim1=-2, dim2=-1).clamp(min=floor).sqrt()
        else:
            root = psd_root(curvature, floor)
        target = line_searched_mean(prior, centre, gradient, root, lambda u: rest_expansion(u, curvature=False)[0])
        target = torch.where(torch.isfinite(target), target, centre)
        step = ((target - centre).abs() * p0.sqrt()).amax()
        centre = target
        gradient, curvature = rest_expansion(centre)
        if float(step) < tolerance:
            break
    return centre, gradient, curvature


def newton_step(
    prior: GaussianPrior,
    gradient: torch.Tensor,
    curvature: torch.Tensor,
    centre: torch.Tensor,
    diagonal: bool,
    floor: torch.Tensor,
) -> tuple[torch.Tensor, bool, float]:
    r"""One plain Newton step from ``centre`` :math:`c` towards each element's conditional mode: the mean of the prior
    conditional times the expansion there (:func:`pseudo_observation`, :func:`gaussian_update`),

    .. math:: c' = (P_0 + F_+)^{-1}\bigl(P_0 m_0 + F_+ c + g\bigr),

    with ``gradient`` :math:`g` and ``curvature`` :math:`F` the rest's at :math:`c`. Returns ``(c', within, step)``:
    whether every element's step is within one conditional sd (:math:`|\Delta u_k| \sqrt{F_{kk} + P_{0,kk}} \le 1`,
    :math:`F_{kk}` kept above ``floor``: near the mode, where a plain step does not overshoot far) and the largest step
    in prior sds (as :func:`conditional_mode` measures it)."""
    info, natural = pseudo_observation(gradient, curvature, centre, diagonal)
    mean, _ = gaussian_update(prior, info, natural)
    p0 = prior.precision if prior.diagonal else prior.precision.diagonal(dim1=-2, dim2=-1)
    f = curvature.diagonal(dim1=-2, dim2=-1).clamp(min=floor)
    moved = (mean - centre).abs()
    size = (moved * (f + p0).sqrt()).amax()
    within = bool(torch.isfinite(mean).all()) and float(size) <= 1.0
    return mean, within, float((moved * p0.sqrt()).amax())


def warm_conditional_mode(
    prior: GaussianPrior,
    centre: torch.Tensor,
    gradient: torch.Tensor,
    curvature: torch.Tensor,
    rest_expansion: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    floor: torch.Tensor,
    diagonal: bool,
    steps: int,
    tolerance: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    r"""Plain Newton steps (:func:`newton_step`) to each element's conditional mode from a warm start ``centre`` (the
    mode of a previous read, where the rest's expansion is ``gradient``, ``curvature``), while every step stays within
    one conditional sd, at most ``steps`` of them, stopped once none moves an element by more than ``tolerance`` prior
    sds — the stopping rule of :func:`conditional_mode`, so both end at the same mode to that tolerance. Near the
    mode a Newton step converges quadratically and needs no line search: each step costs one expansion
    (``rest_expansion(u)``: the rest's gradient and curvature at ``u``), where a line-searched step costs two
    gradients more, and up to :data:`LINE_SEARCH_STEPS` more where rounding makes the directional derivative at the
    full step a hair negative. Returns ``(centre, gradient, curvature, converged)``; where it did not converge (a step
    left the region, or ``steps`` ran out) continue with :func:`conditional_mode` from the returned point.

    Example::

        centre, g, F, done = warm_conditional_mode(prior, last_mode, *expand(last_mode), expand, floor, True, 8, 1e-6)
        if not done:
            centre, g, F = conditional_mode(prior, centre, g, F, expand, floor, True, 8, 1e-6)"""
    for _ in range(steps):
        mean, within, step = newton_step(prior, gradient, curvature, centre, diagonal, floor)
        if not within:
            return centre, gradient, curvature, False
        centre = mean
        gradient, curvature = rest_expansion(centre)
        if step < tolerance:
            return centre, gradient, curvature, True
    return centre, gradient, curvature, False


def cubature_points(mean: torch.Tensor, scale: torch.Tensor, dims: int | None = None) -> list[torch.Tensor]:
    r"""The points of the third-degree spherical cubature rule for :math:`\mathcal N(m, S S^\top)` in its ``d``
    coordinates, :math:`[m + r S e_1,\ m - r S e_1,\ m + r S e_2, \dots]` (:math:`2d` points of equal weight,
    exact for polynomials of degree 3), with ``mean`` :math:`m` ``(..., d)``, ``scale`` :math:`S` lower triangular
    ``(..., d, d)`` or the sds ``(..., d)``, and :math:`r = \sqrt{D}`, :math:`D` = ``dims`` (default ``d``). A larger
    ``dims`` makes them this block's points of the rule on a joint of :math:`D` coordinates with a block-diagonal
    :math:`S` (the other blocks at their means; weights :math:`1/(2D)`).

    Example::

        points = cubature_points(loc, sd)                  # E_q[f] ≈ mean of f over the points
        expected = sum(f(u) for u in points) / len(points)

    Reference: A. H. Stroud, *Approximate Calculation of Multiple Integrals*, 1971."""
    d = mean.shape[-1]
    radius = float(dims if dims is not None else d) ** 0.5
    points = []
    for k in range(d):
        if scale.dim() == mean.dim():
            offset = torch.zeros_like(mean)
            offset[..., k] = radius * scale[..., k]
        else:
            offset = radius * scale[..., :, k]
        points += [mean + offset, mean - offset]
    return points


def smoothed_expansion(
    rest_gradient: Callable[[torch.Tensor], torch.Tensor], mean: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The rest of the model's gradient and curvature *averaged over* :math:`q = \mathcal N(m, S S^\top)`, one per
    element: :math:`(E_q[g(u)],\ E_q[F(u)])`, with ``rest_gradient(u)`` the rest's gradient at element vectors ``u
    (..., d)`` (:func:`element_expansion` with ``curvature=False``), ``mean`` :math:`m` ``(..., d)`` and ``scale``
    :math:`S`, lower triangular ``(..., d, d)`` or the sds ``(..., d)`` (then :math:`E_q[F]` is its diagonal ``(...,
    d)``).

    The expectations take the third-degree spherical cubature rule, the :math:`2d` points :math:`u_{\pm k} = m \pm
    \sqrt d\, S e_k` of equal weight (exact for polynomials of degree 3), and the curvature from the gradients alone
    by Stein's lemma, :math:`E_q[\nabla^2 \log p] = \Sigma^{-1} E_q[(u - m)\, g(u)^\top]`, here
    :math:`S^{-\top} G^\top / (2\sqrt d)` with the columns of :math:`G` the differences :math:`g(u_{+k}) -
    g(u_{-k})` (symmetrised): :math:`2d` gradients, no Hessian-vector product. Exact where the rest is quadratic in
    the level (it is then the expansion at any point).

    This is what a Gaussian q's optimal pseudo-observation is made of: at the optimum of the ELBO over a Gaussian
    :math:`q(u_i) \propto p(u_i \mid \mathrm{pa}_i)\,\mathcal N(t_i;\ u_i, \Lambda_i^{-1})` (the conjugate
    conditional), :math:`\Lambda_i = E_q[F]` and :math:`\Lambda_i t_i = E_q[g] + E_q[F]\, m` (Opper & Archambeau
    2009), and setting them so from the current q is the conjugate-computation step of Khan & Lin (2017) with step
    size 1; :func:`newton_mean` with these in place of the expansion at the mean gives the new q's mean.

    Example::

        g, F = smoothed_expansion(lambda u: element_expansion(..., u, ..., curvature=False)[0], loc, scale_tril)
        mean = newton_mean(prior, loc, g, psd_root(F, floor))

    References: M. Opper, C. Archambeau, *The Variational Gaussian Approximation Revisited*, Neural Computation 2009;
    M. E. Khan, W. Lin, *Conjugate-Computation Variational Inference*, AISTATS 2017; A. H. Stroud, *Approximate
    Calculation of Multiple Integrals*, 1971 (the spherical rule)."""
    d = mean.shape[-1]
    radius = d**0.5
    diagonal = scale.dim() == mean.dim()
    total, differences = torch.zeros_like(mean), []
    points = cubature_points(mean, scale)
    for k in range(d):
        plus, minus = rest_gradient(points[2 * k]), rest_gradient(points[2 * k + 1])
        total = total + plus + minus
        differences.append(plus - minus)
    expected_gradient = total / (2 * d)
    columns = torch.stack(differences, -1)  # (..., d, d): column k is g(u_{+k}) - g(u_{-k})
    if diagonal:
        return expected_gradient, -columns.diagonal(dim1=-2, dim2=-1) / (2 * radius * scale)
    jacobian = torch.linalg.solve_triangular(scale.mT, columns.mT, upper=True) / (2 * radius)
    return expected_gradient, -0.5 * (jacobian + jacobian.mT)


def smoothed_pseudo_observation(
    prior: GaussianPrior,
    precision: torch.Tensor,
    natural: torch.Tensor,
    rest_gradient: Callable[[torch.Tensor], torch.Tensor],
    diagonal: bool,
    steps: int,
    tolerance: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The Gaussian pseudo-observation that makes :math:`q(u_i) \propto p(u_i \mid \mathrm{pa}_i)\,
    \exp(u_i^\top\eta_i - \tfrac12 u_i^\top\Lambda_i u_i)` the optimum of the ELBO over Gaussians, found by
    fixed-point steps from the pseudo-observation ``(precision, natural)`` :math:`(\Lambda_i, \eta_i)` (typically the
    likelihood's Laplace expansion at the conditional mode, :func:`conditional_mode` then :func:`pseudo_observation`):
    each step takes q (:func:`gaussian_update`), the rest of the model's gradient and curvature averaged over it
    (:func:`smoothed_expansion`), and sets

    .. math:: \Lambda_i \leftarrow E_q[F]_+, \qquad \eta_i \leftarrow \Lambda_i\, m_q + E_q[g]

    (Opper & Archambeau 2009's stationary conditions; Khan & Lin 2017's conjugate-computation step of size 1), up to
    ``steps`` times, stopped once a step moved no element's mean by more than ``tolerance`` of its sd under q (each
    step costs ``2d`` gradients of the rest; from the conditional mode the first moves q most of the way: typically
    two are taken).
    ``rest_gradient(u)`` is the rest's gradient at element vectors ``u (..., d)`` (:func:`element_expansion` with
    ``curvature=False``). Elements whose averaged expansion is not finite keep their last pseudo-observation.

    Where the likelihood is skewed in :math:`u_i` (a binomial group with few successes, Poisson counts near zero) the
    Laplace expansion centres q at the conditional mode, off the conditional mean by a tenth of a posterior sd and
    more; one or two such steps put q's mean within a hundredth of an sd of it (one-dimensional binomial groups,
    checked against quadrature). Exact in one step — no change — where the rest is quadratic in the level.

    Example::

        info, natural = pseudo_observation(g, F, mode, diagonal=False)
        info, natural = smoothed_pseudo_observation(prior, info, natural, lambda u: expand(u, curvature=False)[0],
                                                    False, 4, 1e-3)

    References: M. Opper, C. Archambeau, *The Variational Gaussian Approximation Revisited*, Neural Computation 2009;
    M. E. Khan, W. Lin, *Conjugate-Computation Variational Inference*, AISTATS 2017."""
    last = None
    for _ in range(steps):
        loc, scale = gaussian_update(prior, precision, natural)
        sd = scale if scale.dim() == loc.dim() else scale.pow(2).sum(-1).sqrt()
        if last is not None and float(((loc - last).abs() / sd).amax()) < tolerance:
            break  # (the last step moved q's mean by less than the tolerance: no further expansion)
        last = loc
        gradient, curvature = smoothed_expansion(rest_gradient, loc, scale)
        if diagonal and curvature.dim() > loc.dim():  # (a prior with a full precision: its diagonal kept)
            curvature = curvature.diagonal(dim1=-2, dim2=-1)
        new_info = curvature.clamp(min=0.0) if diagonal else psd_part(torch.nan_to_num(curvature))
        new_natural = (new_info * loc if diagonal else (new_info @ loc.unsqueeze(-1)).squeeze(-1)) + gradient
        ok = torch.isfinite(new_natural).all(-1) & torch.isfinite(new_info.flatten(-1 if diagonal else -2)).all(-1)
        ok = ok & torch.isfinite(curvature.flatten(-1 if diagonal else -2)).all(-1)
        new_info = torch.where(ok.unsqueeze(-1) if diagonal else ok[..., None, None], new_info, precision)
        new_natural = torch.where(ok.unsqueeze(-1), new_natural, natural)
        precision, natural = trust_region_step(prior, (precision, natural), (new_info, new_natural), (loc, scale))
    return precision, natural


#: the largest KL divergence (nats) of q after one fixed-point step of its pseudo-observation from q before it
#: (:func:`trust_region_step`)
STEP_MAX_KL = 0.5
#: halvings of such a step before an element keeps its pseudo-observation
STEP_HALVINGS = 10


def gaussian_kl(loc: torch.Tensor, scale: torch.Tensor, loc0: torch.Tensor, scale0: torch.Tensor) -> torch.Tensor:
    r""":math:`\mathrm{KL}(\mathcal N(m, S S^\top)\,\|\,\mathcal N(m_0, S_0 S_0^\top))`, one per element, with
    ``scale`` and ``scale0`` the sds ``(..., d)`` or the lower Cholesky factors of the covariances ``(..., d, d)`` (as
    :func:`gaussian_update` returns them):

    .. math:: \tfrac12\big[\lVert S_0^{-1} S\rVert_F^2 + \lVert S_0^{-1}(m - m_0)\rVert^2 - d\big]
        + \textstyle\sum_k \log (S_0)_{kk} - \sum_k \log S_{kk}.

    Example::

        loc, scale = gaussian_update(prior, info, natural)
        kl = gaussian_kl(loc, scale, loc0, scale0)          # one per element; 0 where the two are equal

    Reference: S. Kullback, R. A. Leibler, *On Information and Sufficiency*, Ann. Math. Statist. 1951."""
    d = loc.shape[-1]
    if scale.dim() == loc.dim():
        ratio, white = (scale / scale0).pow(2).sum(-1), (loc - loc0) / scale0
        logdet = scale0.log().sum(-1) - scale.log().sum(-1)
    else:
        ratio = torch.linalg.solve_triangular(scale0, scale, upper=False).pow(2).sum((-2, -1))
        white = torch.linalg.solve_triangular(scale0, (loc - loc0).unsqueeze(-1), upper=False).squeeze(-1)
        diag, diag0 = scale.diagonal(dim1=-2, dim2=-1), scale0.diagonal(dim1=-2, dim2=-1)
        logdet = diag0.log().sum(-1) - diag.log().sum(-1)
    return 0.5 * (ratio + white.pow(2).sum(-1) - d) + logdet


def trust_region_step(
    prior: GaussianPrior,
    old: tuple[torch.Tensor, torch.Tensor],
    new: tuple[torch.Tensor, torch.Tensor],
    q: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_kl: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""A step of a pseudo-observation from ``old`` :math:`(\Lambda, \eta)` towards ``new`` :math:`(\Lambda', \eta')`:
    per element the longest of :math:`\rho = 1, \tfrac12, \tfrac14, \dots` (:data:`STEP_HALVINGS` halvings, else
    :math:`\rho = 0`) whose q is within ``max_kl`` nats (default :data:`STEP_MAX_KL`) of the old q,

    .. math:: (\Lambda_\rho, \eta_\rho) = (1 - \rho)(\Lambda, \eta) + \rho(\Lambda', \eta'), \qquad
        \mathrm{KL}(q_\rho \,\|\, q) \le \kappa,

    :math:`q_\rho \propto p(u \mid \mathrm{pa})\, \exp(u^\top \eta_\rho - \tfrac12 u^\top \Lambda_\rho u)`
    (:func:`gaussian_update`; a convex combination keeps :math:`\Lambda_\rho` positive semi-definite). This is Khan &
    Lin's conjugate-computation step of size :math:`\rho`, which converges for small enough sizes where the full step
    (the fixed-point iteration of :func:`smoothed_pseudo_observation`) can oscillate and diverge: where the likelihood
    is not log-concave in the element (a group's location and log noise scale under Normal observations) and the
    cubature's curvature is far from that of a Gaussian there. Where the full step stays within :math:`\kappa`
    (typically every step from the Laplace expansion of a log-concave likelihood) it is the full step. ``q``: the old
    q's ``(loc, scale)`` when already at hand.

    Example::

        new = (new_info, new_natural)                 # what a full fixed-point step proposes
        info, natural = trust_region_step(prior, (info, natural), new, max_kl=0.5)

    Reference: M. E. Khan, W. Lin, *Conjugate-Computation Variational Inference*, AISTATS 2017."""
    kappa = STEP_MAX_KL if max_kl is None else max_kl
    loc0, scale0 = gaussian_update(prior, *old) if q is None else q
    (info0, nat0), (info1, nat1) = old, new
    matrix = info0.dim() > nat0.dim()
    rho = loc0.new_ones(loc0.shape[:-1])

    def at(rho: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = rho[..., None, None] if matrix else rho.unsqueeze(-1)
        return info0 + r * (info1 - info0), nat0 + rho.unsqueeze(-1) * (nat1 - nat0)

    for _ in range(STEP_HALVINGS + 1):
        info, natural = at(rho)
        far = ~(gaussian_kl(*gaussian_update(prior, info, natural), loc0, scale0) <= kappa)  # (not finite: far)
        if not bool(far.any()):
            return info, natural
        rho = torch.where(far, 0.5 * rho, rho)
    return at(torch.where(far, torch.zeros_like(rho), rho))


def rebase(
    old: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mean: torch.Tensor,
    factor: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The parameters :math:`(\bar M', L')` against a ``new`` reference ``(ref_loc, ref_precision, fisher_sd)`` that
    give the same :math:`q` as :math:`(\bar M, L)` against the ``old`` one (arguments as in
    :func:`conjugate_conditional`): the pseudo-observation at the globals' mean, :math:`\bar\Lambda = R L L^\top R^\top`
    and :math:`\bar\Lambda \bar t = (\bar P_0 + \bar\Lambda)\bar M - \bar P_0 \bar m_0`, is kept:

    .. math:: L' = R'^{-1} R L, \qquad
              \bar M' = (\bar P_0' + \bar\Lambda)^{-1}\bigl(\bar P_0' \bar m_0' + \bar\Lambda \bar t\bigr).

    A refreshed reference is thus a change of coordinates only: ``q`` does not jump when it is redone, however far the
    globals moved since (or however few times a subsampled group was seen)."""
    (m_old, p_old, r_old), (m_new, p_new, r_new) = old, new
    if factor.dim() == mean.dim() and r_old.dim() == mean.dim():  # independent coordinates: elementwise
        lam = (r_old * factor).pow(2)
        p_old = p_old if p_old.dim() == mean.dim() else p_old.diagonal(dim1=-2, dim2=-1)
        p_new = p_new if p_new.dim() == mean.dim() else p_new.diagonal(dim1=-2, dim2=-1)
        lam_t = (p_old + lam) * mean - p_old * m_old
        return (p_new * m_new + lam_t) / (p_new + lam), r_old * factor / r_new
    root = _root(r_old, factor, mean)
    lam = root @ root.mT
    full = [p if p.dim() > mean.dim() else torch.diag_embed(p) for p in (p_old, p_new)]
    lam_t = ((full[0] + lam) @ mean.unsqueeze(-1) - full[0] @ m_old.unsqueeze(-1)).squeeze(-1)
    rhs = (full[1] @ m_new.unsqueeze(-1)).squeeze(-1) + lam_t
    new_mean = torch.linalg.solve(full[1] + lam, rhs.unsqueeze(-1)).squeeze(-1)
    r_new = r_new if r_new.dim() > mean.dim() else torch.diag_embed(r_new)
    return new_mean, torch.linalg.solve_triangular(r_new, root, upper=False)


def unconstrained_numel(fn, support: constraints.Constraint) -> int:
    """Numbers per batch element of ``fn``'s value in unconstrained space."""
    return biject_to(support).inv.forward_shape(fn.event_shape).numel()

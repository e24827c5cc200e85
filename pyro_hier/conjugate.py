r"""The model's own prior conditional of a latent site, read as a Gaussian in unconstrained space, and its conjugate
update by a Gaussian pseudo-observation: the conditional form of the branch guides.

In a hierarchical model the posterior conditional of a group's effects given everything above them is the prior
conditional times the group's likelihood, :math:`p(u_i \mid \theta, y) \propto p(u_i \mid \mathrm{pa}_i)\,
p(y_i \mid u_i, \theta)`. When the prior conditional is Gaussian in the site's unconstrained space (``Normal`` with
real support, ``LogNormal`` in log space, ``MultivariateNormal``) and the likelihood is replaced by a Gaussian
*pseudo-observation* :math:`\mathcal N(t_i;\ u_i, \Lambda_i^{-1})`, the update is closed form:

.. math::

    q(u_i \mid \mathrm{pa}_i) = \mathcal N(P_i^{-1}\eta_i,\ P_i^{-1}), \qquad
    P_i = S_0^{-1} + \Lambda_i, \qquad \eta_i = S_0^{-1} m_0 + \Lambda_i t_i,

with :math:`(m_0, S_0)` the prior conditional's mean and covariance. This contains the exact posterior conditional of
Gaussian hierarchies (radon's county effects: :math:`\Lambda_i = n_i/\sigma^2`, :math:`t_i` the county's mean
residual), and keeps the funnel: a group with little data has :math:`\Lambda_i \ll S_0^{-1}` and follows its prior's
scale, a group with much data follows its own.

**Parameterisation.** Optimising :math:`(t_i, \Lambda_i)` directly is badly conditioned for groups the prior
dominates: an optimiser step in :math:`t_i` moves the conditional mean only by the data's weight
:math:`w = \Lambda_i/(S_0^{-1} + \Lambda_i)` times the step. The free parameter is instead :math:`\bar M_i`, the
conditional mean at a *reference* prior conditional :math:`(\bar m_0, \bar S_0)` (the prior at the globals' current
variational mean, held fixed within a step), from which :math:`t_i = \bar m_0 + \Lambda_i^{-1}\bar P_i
(\bar M_i - \bar m_0)`; substituted into :math:`\eta`,

.. math::

    \eta_i = S_0^{-1} m_0 + (\bar S_0^{-1} + \Lambda_i)\,\bar M_i - \bar S_0^{-1} \bar m_0
             \;(+\ \Lambda_i B_i z),

which needs no inverse of :math:`\Lambda_i`, gives :math:`q`'s mean :math:`\bar M_i` exactly at the reference and
moves it one-for-one with :math:`\bar M_i` near it. (Treating the reference as fixed within a step drops from the
gradient a term proportional to :math:`\partial\mathcal L/\partial t_i`, which vanishes at every optimum over the
local parameters, so the fixed points are those of the exact gradient.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample
from torch.distributions import biject_to, constraints

from pyro_hier.plates import PlateCall, PlateRecorder

__all__ = ["GaussianPrior", "PriorCapture", "capture_priors", "gaussian_prior", "precision_to_scale_tril"]


@dataclass
class GaussianPrior:
    """A prior conditional in a site's unconstrained space: ``loc (..., d)`` and either ``scale (..., d)``
    (independent coordinates) or ``scale_tril (..., d, d)``."""

    loc: torch.Tensor
    scale: torch.Tensor | None = None
    scale_tril: torch.Tensor | None = None

    @property
    def diagonal(self) -> bool:
        return self.scale_tril is None

    def precision(self) -> torch.Tensor:
        """``S₀⁻¹``: ``(..., d)`` for a diagonal prior, else ``(..., d, d)``."""
        if self.diagonal:
            return self.scale.pow(-2)
        eye = torch.eye(self.loc.shape[-1], dtype=self.loc.dtype, device=self.loc.device)
        inv = torch.linalg.solve_triangular(self.scale_tril, eye.expand_as(self.scale_tril), upper=False)
        return inv.mT @ inv


def _unwrap(fn) -> tuple[object, int]:
    """The innermost distribution under Independent / Expanded / Masked wrappers, and the event dims the
    ``Independent`` wrappers added."""
    reinterpreted = 0
    while isinstance(fn, dist.Independent | dist.ExpandedDistribution | dist.MaskedDistribution):
        if isinstance(fn, dist.Independent):
            reinterpreted += fn.reinterpreted_batch_ndims
        fn = fn.base_dist
    return fn, reinterpreted


def gaussian_prior(fn, support: constraints.Constraint) -> GaussianPrior | None:
    """``fn`` as a Gaussian over the unconstrained value ``biject_to(support).inv(z)``, flattened to one vector per
    element of the batch shape ``fn.batch_shape``: ``loc (*batch, d)``; ``None`` when it is not Gaussian there.

    Recognised: ``Normal`` with real support, ``LogNormal`` (Gaussian in log space, which is what
    ``biject_to(positive)`` maps to), ``MultivariateNormal``, each possibly expanded, masked or with batch dims
    reinterpreted as events (``.to_event``)."""
    base, _ = _unwrap(fn)
    batch = fn.batch_shape
    event = fn.event_shape
    if isinstance(base, dist.LogNormal) and support is constraints.positive or (
        isinstance(base, dist.LogNormal)
        and isinstance(support, constraints.independent)
        and support.base_constraint is constraints.positive
    ):
        loc, scale = base.loc, base.scale
    elif type(base) is dist.Normal and _is_real(support):
        loc, scale = base.loc, base.scale
    elif type(base) is dist.MultivariateNormal and _is_real(support) and not event[:-1]:
        loc = base.loc.expand(batch + event)
        tril = base.scale_tril.expand(batch + event + event)
        return GaussianPrior(loc, scale_tril=tril)
    else:
        return None
    shape = batch + event
    loc, scale = torch.broadcast_tensors(loc, scale)
    loc = loc.expand(shape).reshape((*batch, -1))
    scale = scale.expand(shape).reshape((*batch, -1))
    return GaussianPrior(loc, scale=scale)


def _is_real(support: constraints.Constraint) -> bool:
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support is constraints.real or isinstance(support, type(constraints.real_vector)) and (
        support is constraints.real_vector
    )


def precision_to_scale_tril(precision: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of ``precision⁻¹`` from one Cholesky and one triangular solve: with ``J`` the reversal
    permutation and ``J Λ J = R Rᵀ``, ``Λ⁻¹ = (J R⁻ᵀ J)(J R⁻ᵀ J)ᵀ`` and ``J R⁻ᵀ J`` is lower triangular."""
    flipped = torch.linalg.cholesky(precision.flip(-2, -1))
    eye = torch.eye(precision.shape[-1], dtype=precision.dtype, device=precision.device)
    return torch.linalg.solve_triangular(flipped.mT, eye, upper=True).flip(-2, -1)


class _Captured(Exception):
    """Raised inside the model to stop it once every wanted prior conditional has been seen."""


class PriorCapture(Messenger):
    """Runs a model with some latent sites' values given and records the distributions (prior conditionals) of the
    ``wanted`` sites, and the plates the model opens; stops the model after the last wanted site.

    Latent sites not in ``values`` and not wanted take a value from their distribution only if they come before the
    last wanted site and are needed by it (they are sampled, as in a plain model run)."""

    def __init__(self, values: dict[str, torch.Tensor], wanted: Iterable[str]) -> None:
        super().__init__()
        self.values = values
        self.wanted = set(wanted)
        self.fns: dict[str, object] = {}

    def _pyro_sample(self, msg) -> None:
        if isinstance(msg["fn"], _Subsample) or msg["is_observed"]:
            return
        name = msg["name"]
        if name in self.wanted:
            self.fns[name] = msg["fn"]
            if self.wanted <= self.fns.keys():
                raise _Captured
        if name in self.values:
            msg["value"] = self.values[name]
            msg["done"] = True


def capture_priors(
    model: Callable, args: tuple, kwargs: dict, values: dict[str, torch.Tensor], wanted: Iterable[str]
) -> tuple[dict[str, object], dict[str, PlateCall]]:
    """Run ``model`` hidden from outer handlers with the latent ``values`` given, until every site in ``wanted`` has
    been reached: returns ``({site: prior conditional}, {plate: PlateCall})``."""
    capture = PriorCapture(values, wanted)
    plates = PlateRecorder()
    try:
        with poutine.block(), plates, capture:
            model(*args, **kwargs)
    except _Captured:
        pass
    missing = capture.wanted - capture.fns.keys()
    if missing:
        raise RuntimeError(f"internal error: the model did not reach the latent sites {sorted(missing)}")
    return capture.fns, plates.calls


def unconstrained_dim(fn, support: constraints.Constraint) -> int:
    """Numbers per batch element of ``fn``'s value in unconstrained space."""
    return biject_to(support).inv.forward_shape(fn.event_shape).numel()

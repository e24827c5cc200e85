"""Measuring a fitted guide: ELBO with its Monte Carlo error, posterior moments, parameter count, moment errors.

Shared by the tests, the benchmarks and the demo, so that every number the project reports is computed one way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pyro
import torch
from pyro import poutine
from pyro.infer import Predictive

from pyro_hier.problems.base import Moments
from pyro_hier.structure import inspect_model

__all__ = ["MomentError", "count_parameters", "elbo_estimate", "moment_error", "posterior_moments"]


def _max_plate_nesting(model: Callable, args: tuple, kwargs: dict) -> int:
    return inspect_model(model, args, kwargs, num_calls=1).max_plate_nesting


@torch.no_grad()
def elbo_estimate(
    model: Callable,
    guide: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    num_particles: int = 1000,
    batch_size: int = 100,
    max_plate_nesting: int | None = None,
) -> tuple[float, float]:
    """Monte Carlo estimate of the ELBO, ``E_q[log p(x, z) - log q(z)]``, and its standard error.

    Particles are vectorised in batches of ``batch_size`` under an outer plate, so each particle's
    ``log p - log q`` (with Pyro's plate scaling) is available and the standard error is ``sd / sqrt(num_particles)``.

    :returns: ``(elbo, standard_error)`` as floats.

    Example::

        p = synthetic_regression(num_groups=10)
        elbo, se = elbo_estimate(p.model, guide, p.args, num_particles=1000)
        gap = p.log_evidence - elbo  # the KL divergence from q to the posterior, ± se
    """
    kwargs = {} if kwargs is None else kwargs
    if max_plate_nesting is None:
        max_plate_nesting = _max_plate_nesting(model, args, kwargs)
    values = []
    remaining = num_particles
    while remaining > 0:
        size = min(batch_size, remaining)
        remaining -= size
        with pyro.plate("_elbo_particles", size, dim=-max_plate_nesting - 1):
            guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
            model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
        log_p = _per_particle(model_trace, size, max_plate_nesting)
        # a guide that runs the model inside itself (Pyro's AutoMessenger guides) records the model's observed
        # sites too: they are not part of q
        values.append(log_p - _per_particle(guide_trace, size, max_plate_nesting, latent_only=True))
    w = torch.cat(values)
    if not torch.isfinite(w).all():
        raise ValueError("the ELBO has non-finite particles: the guide puts mass where the model has none")
    return float(w.mean()), float(w.std() / math.sqrt(w.numel()))


def _per_particle(
    trace: poutine.Trace, size: int, max_plate_nesting: int, *, latent_only: bool = False
) -> torch.Tensor:
    """Sum of each particle's scaled log densities (of latent sites only with ``latent_only``); the particle plate
    sits at dim ``-max_plate_nesting - 1``."""
    trace.compute_log_prob()
    total = torch.zeros(size, dtype=torch.float64)
    for site in trace.nodes.values():
        if site["type"] != "sample" or "log_prob" not in site or (latent_only and site["is_observed"]):
            continue
        lp = site["log_prob"].detach().to(device="cpu", dtype=torch.float64)  # already scaled by Pyro
        if lp.dim() > max_plate_nesting:
            lp = lp.movedim(-max_plate_nesting - 1, 0)
            total = total + lp.reshape(lp.shape[0], -1).sum(-1)
        else:
            total = total + lp.sum()
    return total


@torch.no_grad()
def posterior_moments(
    model: Callable,
    guide: Callable,
    sites: list[str],
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    num_samples: int = 1000,
) -> dict[str, Moments]:
    """Mean and sd of each site under the guide (constrained space), from ``num_samples`` draws of
    :class:`~pyro.infer.Predictive`.

    Example::

        p = radon_mn()
        q = posterior_moments(p.model, guide, list(p.moments), p.args, p.kwargs)
        moment_error(q, p.moments).max_mean_error  # worst |E_q - E_ref| / sd_ref
    """
    samples = Predictive(model, guide=guide, num_samples=num_samples, return_sites=sites, parallel=True)(
        *args, **(kwargs or {})
    )
    return {s: Moments(samples[s].mean(0), samples[s].std(0)) for s in sites}


@dataclass(frozen=True)
class MomentError:
    """How far approximate moments are from reference ones, over every element of every compared site.

    :ivar max_mean_error: ``max |mean_q - mean_ref| / sd_ref``.
    :ivar min_sd_ratio: ``min sd_q / sd_ref``.
    :ivar max_sd_ratio: ``max sd_q / sd_ref``.
    """

    max_mean_error: float
    min_sd_ratio: float
    max_sd_ratio: float


def moment_error(approx: Mapping[str, Moments], reference: Mapping[str, Moments]) -> MomentError:
    """Compare ``approx`` to ``reference`` on the sites they share (shapes must broadcast to the reference's)."""
    errs, ratios = [], []
    for name, ref in reference.items():
        if name not in approx:
            continue
        q = approx[name]
        mean = q.mean.reshape(ref.mean.shape).to(ref.mean)
        sd = q.sd.reshape(ref.sd.shape).to(ref.sd)
        errs.append(((mean - ref.mean).abs() / ref.sd).flatten())
        ratios.append((sd / ref.sd).flatten())
    if not errs:
        raise ValueError(f"no site in common between {sorted(approx)} and {sorted(reference)}")
    e, r = torch.cat(errs), torch.cat(ratios)
    return MomentError(float(e.max()), float(r.min()), float(r.max()))


def count_parameters(module: torch.nn.Module) -> int:
    """Number of scalar parameters of a (built) guide that are optimised: a guide's gradient-free state
    (``state_parameters()``, e.g. the tail average of its parameters) is not counted."""
    state = getattr(module, "state_parameters", None)
    skip = set() if state is None else {id(p) for p in state().values()}
    return sum(p.numel() for p in module.parameters() if id(p) not in skip)

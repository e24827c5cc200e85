"""A three-level nested linear-Gaussian model (plate inside plate inside plate), with exact answers."""

from __future__ import annotations

import functools

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

from pyro_hier.plates import gathered_rows

from .linear_gaussian import LinearGaussianProblem, LinearGaussianSystem

__all__ = ["three_level", "three_level_gathered_model", "three_level_model"]


def three_level_model(
    y: torch.Tensor,
    subsample: torch.Tensor | None = None,
    *,
    scale_mu: float = 1.0,
    scale_region: float = 1.0,
    scale_group: float = 0.5,
    scale_obs: float = 1.0,
) -> None:
    """``mu ~ N(0, s0²)``; ``a_r ~ N(mu, s1²)``; ``b_rg ~ N(a_r, s2²)``; ``y_rgj ~ N(b_rg, σ²)``.

    Args:
        y: ``(R, G, n)`` observations.
        subsample: optional ``LongTensor`` of region indices for the top plate ``"regions"``.

    Sites: ``"mu"`` ``()``, ``"a"`` ``(R, 1, 1)`` (plate ``"regions"``, ``dim=-3``), ``"b"`` ``(R, G, 1)`` (plate
    ``"groups"``, ``dim=-2``), ``"y"`` ``(R, G, n)`` (plate ``"obs"``, ``dim=-1``).
    """
    R, G, n = y.shape
    mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), scale_mu))
    with pyro.plate("regions", R, subsample=subsample, dim=-3) as idx:
        a = pyro.sample("a", dist.Normal(mu, scale_region))
        with pyro.plate("groups", G, dim=-2):
            b = pyro.sample("b", dist.Normal(a, scale_group))
            with pyro.plate("obs", n, dim=-1):
                pyro.sample("y", dist.Normal(b, scale_obs), obs=y if subsample is None else y[idx])


def three_level_gathered_model(
    y: torch.Tensor,
    group_region: torch.Tensor,
    obs_group: torch.Tensor,
    num_regions: int,
    subsample: torch.Tensor | None = None,
    *,
    scale_mu: float = 1.0,
    scale_region: float = 1.0,
    scale_group: float = 0.5,
    scale_obs: float = 1.0,
) -> None:
    """:func:`three_level_model` written as most users write it: flat plates gathering their parents by an index
    chain, ``b_g ~ N(a[group_region[g]], s2²)``, ``y_j ~ N(b[obs_group[j]], σ²)``.

    Args:
        y: ``(M,)`` observations.
        group_region: ``(G_total,)`` the region of each group.
        obs_group: ``(M,)`` the group of each observation.
        num_regions: size of the plate ``"regions"``.
        subsample: optional ``LongTensor`` of region indices: their groups and their groups' observations are kept
            (:func:`pyro_hier.plates.gathered_rows`, twice), weighted ``R / len(subsample)`` as the regions.

    Sites: ``"mu"`` ``()``, ``"a"`` ``(R,)`` (plate ``"regions"``), ``"b"`` ``(G_total,)`` (plate ``"groups"``),
    ``"y"`` ``(M,)`` (plate ``"obs"``), all plates at ``dim=-1``.
    """
    mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), scale_mu))
    with pyro.plate("regions", num_regions, subsample=subsample, dim=-1):
        a = pyro.sample("a", dist.Normal(mu, scale_region))
    groups = gathered_rows(group_region, num_regions, subsample)
    with (
        pyro.plate("groups", group_region.shape[0], subsample=groups.rows, dim=-1),
        poutine.scale(scale=groups.scale),
    ):
        b = pyro.sample("b", dist.Normal(a[..., groups.group], scale_group))
    obs = gathered_rows(obs_group, group_region.shape[0], groups.rows)
    # the observations of the kept groups, weighted as their regions: (R / |S|) per observation in all
    scale = 1.0 if groups.rows is None else (num_regions / subsample.numel()) * obs.rows.numel() / obs_group.numel()
    with pyro.plate("obs", obs_group.shape[0], subsample=obs.rows, dim=-1), poutine.scale(scale=scale):
        pyro.sample("y", dist.Normal(b[..., obs.group], scale_obs), obs=y if obs.rows is None else y[obs.rows])


def _three_level_system(
    R: int, G: int, n: int, s0: float, s1: float, s2: float, sigma: float, device: torch.device | str | None
) -> LinearGaussianSystem:
    f64 = torch.float64
    L = 1 + R + R * G
    M = R * G * n
    c = torch.zeros(L, dtype=f64, device=device)
    W = torch.zeros(L, L, dtype=f64, device=device)
    a_idx = 1 + torch.arange(R, device=device)
    W[a_idx, 0] = 1.0  # a_r = mu + s1 xi
    b_idx = 1 + R + torch.arange(R * G, device=device)
    W[b_idx, 1 + torch.arange(R * G, device=device) // G] = 1.0  # b_rg = a_r + s2 xi
    s = torch.cat(
        [
            torch.full((1,), s0, dtype=f64, device=device),
            torch.full((R,), s1, dtype=f64, device=device),
            torch.full((R * G,), s2, dtype=f64, device=device),
        ]
    )
    obs = torch.arange(M, device=device)
    A = torch.sparse_coo_tensor(
        torch.stack([obs, 1 + R + obs // n]), torch.ones(M, dtype=f64, device=device), (M, L), check_invariants=True
    )
    r = torch.full((M,), sigma**2, dtype=f64, device=device)
    return LinearGaussianSystem(c, W, s, A, r, sites={"mu": (), "a": (R, 1, 1), "b": (R, G, 1)})


def three_level(
    num_regions: int = 5,
    num_groups: int = 4,
    num_obs: int = 10,
    *,
    scale_mu: float = 1.0,
    scale_region: float = 1.0,
    scale_group: float = 0.5,
    scale_obs: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    gathered: bool = False,
) -> LinearGaussianProblem:
    """Three nested plates of Gaussian random effects, with exact answers.

    Model (``R = num_regions``, ``G = num_groups``, ``n = num_obs``; ``s0, s1, s2, σ`` = ``scale_mu``,
    ``scale_region``, ``scale_group``, ``scale_obs``)::

        mu ~ N(0, s0²)                                               site "mu", value ()
        a_r | mu ~ N(mu, s1²)          plate "regions" (R, dim=-3)   site "a",  value (R, 1, 1)
        b_rg | a_r ~ N(a_r, s2²)       plate "groups"  (G, dim=-2)   site "b",  value (R, G, 1)
        y_rgj | b_rg ~ N(b_rg, σ²)     plate "obs"     (n, dim=-1)   site "y",  value (R, G, n)

    ``problem.model`` is :func:`three_level_model` with the scales bound, called as ``model(y, subsample=None)``;
    ``subsample`` indexes the top plate ``"regions"``. Data are drawn from the model with
    ``torch.Generator().manual_seed(seed)`` (CPU, float64) and cast to ``dtype``/``device``.

    Exact answers: the latents ``w = (mu, a, b)`` (``L = 1 + R + R G``) follow the structural equations
    ``a_r = mu + s1 ξ``, ``b_rg = a_r + s2 ξ`` and ``y = A w + ε`` with ``A`` selecting ``b_rg``; a
    :class:`LinearGaussianSystem` gives ``log p(y)`` and the posterior in ``O(L³ + M)`` (Bishop 2006, §2.3.3).

    ``gathered=True`` gives the same model and data written with flat plates and an index chain
    (:func:`three_level_gathered_model`: ``args = (y (R G n,), group_region, obs_group, R)``, groups numbered
    region-major, observations group-major, the nested values flattened), whose sites ``"a"``, ``"b"`` have shapes
    ``(R,)`` and ``(R G,)``; the exact answers are the same numbers.

    Returns:
        A :class:`LinearGaussianProblem`; ``moments`` has ``"mu"``, ``"a"``, ``"b"`` at the shapes above.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    f64 = torch.float64
    R, G, n = num_regions, num_groups, num_obs
    mu = scale_mu * torch.randn((), generator=gen, dtype=f64)
    a = mu + scale_region * torch.randn(R, 1, 1, generator=gen, dtype=f64)
    b = a + scale_group * torch.randn(R, G, 1, generator=gen, dtype=f64)
    y = b + scale_obs * torch.randn(R, G, n, generator=gen, dtype=f64)
    y = y.to(dtype=dtype, device=device)

    system = _three_level_system(R, G, n, scale_mu, scale_region, scale_group, scale_obs, y.device)
    y_flat = y.to(f64).reshape(-1)
    scales = {"scale_mu": scale_mu, "scale_region": scale_region, "scale_group": scale_group, "scale_obs": scale_obs}
    model, args = functools.partial(three_level_model, **scales), (y,)
    if gathered:
        system.sites = {"mu": (), "a": (R,), "b": (R * G,)}
        group_region = torch.arange(R, device=y.device).repeat_interleave(G)
        obs_group = torch.arange(R * G, device=y.device).repeat_interleave(n)
        model, args = (
            functools.partial(three_level_gathered_model, **scales),
            (y.reshape(-1), group_region, obs_group, R),
        )
    return LinearGaussianProblem(
        name=f"three_level(R={R}, G={G}, n={n}, seed={seed}{', gathered' if gathered else ''})",
        model=model,
        args=args,
        kwargs={},
        log_evidence=float(system.log_evidence(y_flat)),
        moments=system.moments(y_flat),
        reference="Three-level nested Gaussian random effects (Gelman & Hill 2007, ch. 11-13); exact by Gaussian "
        "conditioning in information form (Bishop 2006, §2.3.3).",
        system=system,
        y_flat=y_flat,
    )

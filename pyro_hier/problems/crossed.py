"""Crossed (non-nested) random effects: row and column plates sharing observations, with exact answers."""

from __future__ import annotations

import functools

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

from pyro_hier.plates import gathered_rows

from .linear_gaussian import LinearGaussianProblem, LinearGaussianSystem

__all__ = ["crossed_effects", "crossed_gathered_model", "crossed_model"]


def crossed_model(
    y: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale_mu: float = 1.0,
    scale_row: float = 1.0,
    scale_col: float = 1.0,
    scale_obs: float = 1.0,
) -> None:
    """``mu ~ N(0, s0²)``; ``a_r ~ N(0, sa²)``; ``b_c ~ N(0, sb²)``; ``y_rc ~ N(mu + a_r + b_c, σ²)``.

    Args:
        y: ``(R, C)`` observations (entries where ``mask`` is False are ignored).
        mask: optional ``(R, C)`` bool tensor of observed cells.

    Sites: ``"mu"`` ``()``, ``"a"`` ``(R, 1)`` (plate ``"rows"``, ``dim=-2``), ``"b"`` ``(C,)`` (plate ``"cols"``,
    ``dim=-1``), ``"y"`` ``(R, C)`` (both plates).
    """
    R, C = y.shape
    mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), scale_mu))
    rows = pyro.plate("rows", R, dim=-2)
    cols = pyro.plate("cols", C, dim=-1)
    with rows:
        a = pyro.sample("a", dist.Normal(y.new_zeros(()), scale_row))
    with cols:
        b = pyro.sample("b", dist.Normal(y.new_zeros(()), scale_col))
    with rows, cols:
        d = dist.Normal(mu + a + b, scale_obs)
        if mask is not None:
            d = d.mask(mask)
        pyro.sample("y", d, obs=y)


def crossed_gathered_model(
    y: torch.Tensor,
    row: torch.Tensor,
    col: torch.Tensor,
    num_rows: int,
    num_cols: int,
    subsample: torch.Tensor | None = None,
    *,
    scale_mu: float = 1.0,
    scale_row: float = 1.0,
    scale_col: float = 1.0,
    scale_obs: float = 1.0,
) -> None:
    """:func:`crossed_model` written as item-response models usually are: one flat plate of observed cells, each
    gathering its row's and its column's effect, ``y_k ~ N(mu + a[row[k]] + b[col[k]], σ²)``.

    Args:
        y: ``(M,)`` observations (the observed cells only).
        row, col: ``(M,)`` each cell's row and column.
        subsample: optional ``LongTensor`` of row indices: their cells are kept (:func:`pyro_hier.plates.
            gathered_rows`), weighted ``R / len(subsample)``; all columns stay.

    Sites: ``"mu"`` ``()``, ``"a"`` ``(R,)`` (plate ``"rows"``), ``"b"`` ``(C,)`` (plate ``"cols"``), ``"y"``
    ``(M,)`` (plate ``"cells"``), all plates at ``dim=-1``.
    """
    mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), scale_mu))
    rows = pyro.plate("rows", num_rows, subsample=subsample, dim=-1)
    cols = pyro.plate("cols", num_cols, dim=-1)
    with rows:
        a = pyro.sample("a", dist.Normal(y.new_zeros(()), scale_row))
    with cols:
        b = pyro.sample("b", dist.Normal(y.new_zeros(()), scale_col))
    cells = gathered_rows(row, num_rows, subsample)
    kept = (lambda t: t) if cells.rows is None else (lambda t: t[cells.rows])
    with pyro.plate("cells", y.shape[0], subsample=cells.rows, dim=-1), poutine.scale(scale=cells.scale):
        pyro.sample("y", dist.Normal(mu + a[..., cells.group] + b[..., kept(col)], scale_obs), obs=kept(y))


def _crossed_system(
    mask: torch.Tensor, s0: float, sa: float, sb: float, sigma: float, device: torch.device | str | None
) -> LinearGaussianSystem:
    f64 = torch.float64
    R, C = mask.shape
    L = 1 + R + C
    cells = mask.reshape(-1).nonzero().squeeze(-1)  # observed cells in row-major order
    M = cells.numel()
    c = torch.zeros(L, dtype=f64, device=device)
    W = torch.zeros(L, L, dtype=f64, device=device)
    s = torch.cat(
        [
            torch.full((1,), s0, dtype=f64, device=device),
            torch.full((R,), sa, dtype=f64, device=device),
            torch.full((C,), sb, dtype=f64, device=device),
        ]
    )
    obs = torch.arange(M, device=device)
    rows = torch.cat([obs, obs, obs])
    cols = torch.cat([torch.zeros_like(cells), 1 + cells // C, 1 + R + cells % C])
    A = torch.sparse_coo_tensor(
        torch.stack([rows, cols]), torch.ones(3 * M, dtype=f64, device=device), (M, L), check_invariants=True
    )
    r = torch.full((M,), sigma**2, dtype=f64, device=device)
    return LinearGaussianSystem(c, W, s, A, r, sites={"mu": (), "a": (R, 1), "b": (C,)})


def crossed_effects(
    num_rows: int = 8,
    num_cols: int = 6,
    *,
    missing_prob: float = 0.0,
    scale_mu: float = 1.0,
    scale_row: float = 1.0,
    scale_col: float = 1.0,
    scale_obs: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    gathered: bool = False,
) -> LinearGaussianProblem:
    """Crossed random effects on an ``R × C`` grid, with exact answers.

    Model (``R = num_rows``, ``C = num_cols``; ``s0, sa, sb, σ`` = ``scale_mu``, ``scale_row``, ``scale_col``,
    ``scale_obs``)::

        mu ~ N(0, s0²)                                         site "mu", value ()
        a_r ~ N(0, sa²)               plate "rows" (R, dim=-2)  site "a",  value (R, 1)
        b_c ~ N(0, sb²)               plate "cols" (C, dim=-1)  site "b",  value (C,)
        y_rc ~ N(mu + a_r + b_c, σ²)  both plates               site "y",  value (R, C)

    The plates are crossed, not nested: every observation depends on one row effect and one column effect, so the
    posterior does not factorise over either plate. With ``missing_prob > 0`` each cell is independently unobserved
    with that probability; the model then takes ``mask`` (``(R, C)`` bool, in ``problem.kwargs``) and masks the
    likelihood of the missing cells (their ``y`` entries are set to 0). ``problem.model`` is
    :func:`crossed_model` with the scales bound. Data are drawn with ``torch.Generator().manual_seed(seed)`` (CPU,
    float64) and cast to ``dtype``/``device``.

    Exact answers: latents ``w = (mu, a, b)`` (``L = 1 + R + C``) are independent a priori and the observed cells give
    ``y = A w + ε`` with three ones per row of ``A``; a :class:`LinearGaussianSystem` gives ``log p(y)`` and the
    posterior in ``O(L³ + M)`` (Bishop 2006, §2.3.3).

    ``gathered=True`` gives the same model and data with one flat plate of the observed cells (row-major)
    gathering their row and column effects (:func:`crossed_gathered_model`: ``args = (y (M,), row, col, R, C)``),
    whose sites ``"a"``, ``"b"`` have shapes ``(R,)`` and ``(C,)``; the exact answers are the same numbers.

    Returns:
        A :class:`LinearGaussianProblem`; ``moments`` has ``"mu"``, ``"a"``, ``"b"`` at the shapes above.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    f64 = torch.float64
    R, C = num_rows, num_cols
    mu = scale_mu * torch.randn((), generator=gen, dtype=f64)
    a = scale_row * torch.randn(R, 1, generator=gen, dtype=f64)
    b = scale_col * torch.randn(C, generator=gen, dtype=f64)
    y = mu + a + b + scale_obs * torch.randn(R, C, generator=gen, dtype=f64)
    if missing_prob > 0:
        mask = torch.rand(R, C, generator=gen, dtype=f64) >= missing_prob
        y = torch.where(mask, y, torch.zeros_like(y))
    else:
        mask = torch.ones(R, C, dtype=torch.bool)
    y = y.to(dtype=dtype, device=device)
    mask = mask.to(device=y.device)

    system = _crossed_system(mask, scale_mu, scale_row, scale_col, scale_obs, y.device)
    y_flat = y.to(f64).reshape(-1)[mask.reshape(-1)]
    scales = {"scale_mu": scale_mu, "scale_row": scale_row, "scale_col": scale_col, "scale_obs": scale_obs}
    model, args = functools.partial(crossed_model, **scales), (y,)
    kwargs = {"mask": mask} if missing_prob > 0 else {}
    layout = ", gathered" if gathered else ""
    if gathered:
        system.sites = {"mu": (), "a": (R,), "b": (C,)}
        cells = mask.reshape(-1).nonzero().squeeze(-1)
        row, col = cells // C, cells % C
        model = functools.partial(crossed_gathered_model, **scales)
        args, kwargs = (y.reshape(-1)[cells], row, col, R, C), {}
    return LinearGaussianProblem(
        name=f"crossed_effects(R={R}, C={C}, missing_prob={missing_prob}, seed={seed}{layout})",
        model=model,
        args=args,
        kwargs=kwargs,
        log_evidence=float(system.log_evidence(y_flat)),
        moments=system.moments(y_flat),
        reference="Crossed random effects (Gelman & Hill 2007, §13.5); exact by Gaussian conditioning in "
        "information form (Bishop 2006, §2.3.3).",
        system=system,
        y_flat=y_flat,
    )

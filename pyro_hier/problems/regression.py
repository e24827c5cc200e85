"""Synthetic hierarchical linear regression of Agrawal & Domke (NeurIPS 2021), with exact answers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pyro
import pyro.distributions as dist
import torch

from .base import Moments, Problem
from .linear_gaussian import LinearGaussianSystem

__all__ = ["RegressionProblem", "regression_covariates", "regression_model", "synthetic_regression"]

_REFERENCE = (
    "Agrawal & Domke, Amortized Variational Inference for Simple Hierarchical Models, NeurIPS 2021, §7.1 and "
    "appendix G.2 (synthetic hierarchical regression); exact answers by the Woodbury / push-through identities."
)


def regression_model(x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None = None) -> None:
    """``theta ~ N(0, I_D)``; ``z_i ~ N(theta, I_D)``; ``y_ij ~ N(x_ij · z_i, 1)``.

    Args:
        x: ``(N, n, D)`` covariates.
        y: ``(N, n)`` responses.
        subsample: optional ``LongTensor`` of group indices for the ``"groups"`` plate.

    Sites: ``"theta"`` (value ``(D,)``), ``"z"`` (value ``(N, 1, D)`` in plate ``"groups"``, ``dim=-2``),
    ``"y"`` (value ``(N, n)``, plates ``"groups"`` and ``"obs"`` (``dim=-1``)).
    """
    N, n, D = x.shape
    theta = pyro.sample("theta", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    with pyro.plate("groups", N, subsample=subsample, dim=-2) as idx:
        z = pyro.sample("z", dist.Normal(theta, 1.0).to_event(1))
        xb, yb = (x, y) if subsample is None else (x[idx], y[idx])  # no copy of the full data
        mean = (xb @ z.transpose(-1, -2)).squeeze(-1)  # (..., N, n, D) @ (..., N, D, 1)
        with pyro.plate("obs", n, dim=-1):
            pyro.sample("y", dist.Normal(mean, 1.0), obs=yb)


def regression_covariates(x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None = None) -> torch.Tensor:
    """Each observation's covariates ``x_ij`` (``(N, n, D)``, full size): the ``local_features`` an amortized guide
    needs for :func:`regression_model` (the responses ``y_ij`` it finds in the model itself)."""
    return x


@dataclass
class RegressionProblem(Problem):
    """:class:`Problem` with the exact Gaussian posterior of :func:`synthetic_regression`.

    With ``G_i = x_i^T x_i``, ``P_i = (I + G_i)^{-1}``, ``v_i = x_i^T y_i``:

    - ``p(theta | y) = N(theta_mean, theta_cov)``;
    - ``p(z_i | theta, y) = N(P_i v_i + P_i theta, P_i)`` (see :meth:`branch_conditionals`);
    - ``p(z_i | y) = N(P_i (m + v_i), P_i + P_i S P_i)`` (see :meth:`z_posterior`).
    """

    x: torch.Tensor | None = field(default=None, repr=False)
    y: torch.Tensor | None = field(default=None, repr=False)
    theta_mean: torch.Tensor | None = field(default=None, repr=False)
    theta_cov: torch.Tensor | None = field(default=None, repr=False)
    P: torch.Tensor | None = field(default=None, repr=False)
    Pv: torch.Tensor | None = field(default=None, repr=False)
    true_theta: torch.Tensor | None = field(default=None, repr=False)
    true_z: torch.Tensor | None = field(default=None, repr=False)

    def branch_conditionals(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mu, A, Sigma)`` with ``p(z_i | theta, y) = N(mu_i + A_i theta, Sigma_i)``.

        Shapes ``(N, D)``, ``(N, D, D)``, ``(N, D, D)`` (float64); here ``mu_i = P_i x_i^T y_i`` and
        ``A_i = Sigma_i = P_i``.
        """
        return self.Pv, self.P, self.P

    def theta_posterior(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean ``(D,)`` and covariance ``(D, D)`` of ``p(theta | y)``."""
        return self.theta_mean, self.theta_cov

    def z_posterior(self, groups: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean ``(N, D)`` and covariance ``(N, D, D)`` of the marginals ``p(z_i | y)`` (optionally of ``groups``)."""
        P = self.P if groups is None else self.P[groups]
        Pv = self.Pv if groups is None else self.Pv[groups]
        mean = Pv + P @ self.theta_mean
        cov = P + P @ self.theta_cov @ P
        return mean, cov

    def linear_gaussian_system(self) -> LinearGaussianSystem:
        """The same model as a :class:`LinearGaussianSystem` over ``w = (theta, z)`` (for checks on small sizes)."""
        return _regression_system(self.x, self.y)


def _regression_system(x: torch.Tensor, y: torch.Tensor) -> LinearGaussianSystem:
    x = x.to(torch.float64)
    N, n, D = x.shape
    L = D + N * D
    dev = x.device
    c = torch.zeros(L, dtype=torch.float64, device=dev)
    W = torch.zeros(L, L, dtype=torch.float64, device=dev)
    zi = torch.arange(D, L, device=dev)
    W[zi, zi % D] = 1.0  # z_{i,d} = theta_d + xi
    s = torch.ones(L, dtype=torch.float64, device=dev)
    # row (i, j) of A holds x_ij on the columns of z_i
    rows = torch.arange(N * n, device=dev).repeat_interleave(D)
    cols = (D + torch.arange(N, device=dev).repeat_interleave(n * D) * D) + torch.arange(D, device=dev).repeat(N * n)
    A = torch.sparse_coo_tensor(torch.stack([rows, cols]), x.reshape(-1), (N * n, L), check_invariants=True)
    r = torch.ones(N * n, dtype=torch.float64, device=dev)
    return LinearGaussianSystem(c, W, s, A, r, sites={"theta": (D,), "z": (N, 1, D)})


def _exact_regression(x: torch.Tensor, y: torch.Tensor, chunk_size: int) -> dict[str, torch.Tensor]:
    """Exact quantities in ``O(N n D²)``, looping over chunks of groups to bound memory."""
    N, n, D = x.shape
    f64 = torch.float64
    eye = torch.eye(D, dtype=f64, device=x.device)
    P = torch.empty(N, D, D, dtype=f64, device=x.device)
    Pv = torch.empty(N, D, dtype=f64, device=x.device)
    sum_P = torch.zeros(D, D, dtype=f64, device=x.device)
    const = torch.zeros((), dtype=f64, device=x.device)
    for start in range(0, N, chunk_size):
        sl = slice(start, min(start + chunk_size, N))
        xc, yc = x[sl].to(f64), y[sl].to(f64)
        G = xc.transpose(-1, -2) @ xc  # (k, D, D)
        v = (xc.transpose(-1, -2) @ yc.unsqueeze(-1)).squeeze(-1)  # (k, D)
        chol = torch.linalg.cholesky(eye + G)
        Pc = torch.cholesky_inverse(chol)
        Pc = 0.5 * (Pc + Pc.transpose(-1, -2))
        Pvc = (Pc @ v.unsqueeze(-1)).squeeze(-1)
        logdet = 2.0 * torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum()
        quad = (yc * yc).sum() - (v * Pvc).sum()
        const = const - 0.5 * logdet - 0.5 * quad
        P[sl], Pv[sl] = Pc, Pvc
        sum_P += Pc.sum(0)
    Lam = (N + 1) * eye - sum_P  # I + sum_i (I - P_i)
    b = Pv.sum(0)
    chol_lam = torch.linalg.cholesky(Lam)
    S = torch.cholesky_inverse(chol_lam)
    m = torch.cholesky_solve(b.unsqueeze(-1), chol_lam).squeeze(-1)
    log_ev = (
        const - 0.5 * N * n * math.log(2 * math.pi) + 0.5 * (b * m).sum() - torch.log(torch.diagonal(chol_lam)).sum()
    )
    return {"log_evidence": log_ev, "theta_mean": m, "theta_cov": S, "P": P, "Pv": Pv}


def synthetic_regression(
    num_groups: int = 10,
    num_obs: int = 100,
    dim: int = 10,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    chunk_size: int = 8192,
) -> RegressionProblem:
    """Synthetic hierarchical regression (Agrawal & Domke 2021, §7.1 / appendix G.2) with exact answers.

    Model (``N = num_groups``, ``n = num_obs``, ``D = dim``)::

        theta ~ N(0, I_D)
        z_i | theta ~ N(theta, I_D)                 i = 1..N        site "z", value (N, 1, D)
        y_ij | z_i ~ N(x_ij · z_i, 1)               j = 1..n        site "y", value (N, n)

    with covariates ``x_ij ~ N(0, I_D)`` generated once (``x``: ``(N, n, D)``, ``y``: ``(N, n)``, in
    ``problem.args``). Data are drawn on the CPU in float64 from ``torch.Generator().manual_seed(seed)`` in the order
    theta, z, x, y-noise, then cast to ``dtype``/``device``; exact answers are computed in float64 from the stored
    (cast) data, so they are exact for the data the model sees.

    Exact answers: marginally ``y_i | theta ~ N(x_i theta, C_i)``, ``C_i = I_n + x_i x_i^T``. With
    ``G_i = x_i^T x_i``, ``P_i = (I + G_i)^{-1}``, ``v_i = x_i^T y_i``, Woodbury gives
    ``C_i^{-1} = I - x_i P_i x_i^T``, ``x_i^T C_i^{-1} = P_i x_i^T``, ``x_i^T C_i^{-1} x_i = I - P_i`` and Sylvester
    ``logdet C_i = logdet(I + G_i)``. Hence, with ``Λ = I + Σ_i (I - P_i)``, ``b = Σ_i P_i v_i``:

    - ``log p(y) = Σ_i [-n/2 log 2π - 1/2 logdet(I + G_i) - 1/2 (y_i^T y_i - v_i^T P_i v_i)]
      + 1/2 b^T Λ^{-1} b - 1/2 logdet Λ``;
    - ``p(theta | y) = N(m, S)``, ``m = Λ^{-1} b``, ``S = Λ^{-1}``;
    - ``p(z_i | theta, y) = N(P_i (theta + v_i), P_i)``;
    - ``p(z_i | y) = N(P_i (m + v_i), P_i + P_i S P_i)``.

    Cost ``O(N n D²)`` time and ``O(N D²)`` extra memory (groups processed ``chunk_size`` at a time).

    Returns:
        A :class:`RegressionProblem`; ``moments`` has ``"theta"`` (``(D,)``) and ``"z"`` (``(N, 1, D)``).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    f64 = torch.float64
    N, n, D = num_groups, num_obs, dim
    theta = torch.randn(D, generator=gen, dtype=f64)
    z = theta + torch.randn(N, D, generator=gen, dtype=f64)
    x = torch.randn(N, n, D, generator=gen, dtype=f64)
    y = (x @ z.unsqueeze(-1)).squeeze(-1)
    y += torch.randn(N, n, generator=gen, dtype=f64)
    x = x.to(dtype=dtype, device=device)
    y = y.to(dtype=dtype, device=device)

    ex = _exact_regression(x, y, chunk_size)
    m, S, P, Pv = ex["theta_mean"], ex["theta_cov"], ex["P"], ex["Pv"]
    # z marginals, chunked to bound memory
    z_mean = torch.empty(N, D, dtype=f64, device=P.device)
    z_sd = torch.empty(N, D, dtype=f64, device=P.device)
    for start in range(0, N, chunk_size):
        sl = slice(start, min(start + chunk_size, N))
        Pc = P[sl]
        z_mean[sl] = Pv[sl] + Pc @ m
        z_sd[sl] = (torch.diagonal(Pc, dim1=-2, dim2=-1) + ((Pc @ S) * Pc).sum(-1)).sqrt()
    moments = {
        "theta": Moments(m, torch.diagonal(S).sqrt()),
        "z": Moments(z_mean.unsqueeze(-2), z_sd.unsqueeze(-2)),
    }
    return RegressionProblem(
        name=f"synthetic_regression(N={N}, n={n}, D={D}, seed={seed})",
        model=regression_model,
        args=(x, y),
        local_features=regression_covariates,
        kwargs={},
        log_evidence=float(ex["log_evidence"]),
        moments=moments,
        reference=_REFERENCE,
        x=x,
        y=y,
        theta_mean=m,
        theta_cov=S,
        P=P,
        Pv=Pv,
        true_theta=theta.to(device=device),
        true_z=z.to(device=device),
    )

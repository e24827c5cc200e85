"""PAVI's Gaussian random effects (GRE) model (Rouillard et al., TMLR 2023, eq. 10), with exact answers."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import pyro
import pyro.distributions as dist
import torch

from .base import Moments, Problem
from .linear_gaussian import LinearGaussianSystem

__all__ = ["GREProblem", "gaussian_random_effects", "gre_model"]

_REFERENCE = (
    "Rouillard, Le Bris, Moreau & Wassermann, PAVI: Plate-Amortized Variational Inference, TMLR 2023, eq. (10) "
    "(Gaussian random effects); exact answers from per-dimension sufficient statistics."
)


def gre_model(
    x: torch.Tensor,
    subsample: torch.Tensor | None = None,
    *,
    scale_mu: float = 1.0,
    scale_theta: float = 1.0,
    scale_x: float = 1.0,
) -> None:
    """``mu ~ N(0, σ2² I_D)``; ``theta_n ~ N(mu, σ1² I_D)``; ``x_{n,j} ~ N(theta_n, σx² I_D)``.

    Args:
        x: ``(N1, N0, D)`` observations.
        subsample: optional ``LongTensor`` of group indices for the ``"groups"`` plate.
        scale_mu, scale_theta, scale_x: ``σ2``, ``σ1``, ``σx``.

    Sites: ``"mu"`` (value ``(D,)``), ``"theta"`` (value ``(N1, 1, D)``, plate ``"groups"`` ``dim=-2``),
    ``"x"`` (value ``(N1, N0, D)``, plates ``"groups"`` and ``"obs"`` (``dim=-1``), event ``D``).
    """
    N1, N0, D = x.shape
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(D), scale_mu).to_event(1))
    with pyro.plate("groups", N1, subsample=subsample, dim=-2) as idx:
        theta = pyro.sample("theta", dist.Normal(mu, scale_theta).to_event(1))
        with pyro.plate("obs", N0, dim=-1):
            pyro.sample("x", dist.Normal(theta, scale_x).to_event(1), obs=x if subsample is None else x[idx])


@dataclass
class GREProblem(Problem):
    """:class:`Problem` with the exact posterior of :func:`gaussian_random_effects`.

    All dimensions are independent a posteriori; ``p(mu | x) = N(mu_mean, mu_var I)`` per dimension and
    ``p(theta_n | mu, x) = N(alpha_n + beta mu, gamma I)`` (see :meth:`branch_conditionals`).
    """

    x: torch.Tensor | None = field(default=None, repr=False)
    scale_mu: float = 1.0
    scale_theta: float = 1.0
    scale_x: float = 1.0
    mu_mean: torch.Tensor | None = field(default=None, repr=False)
    mu_var: torch.Tensor | None = field(default=None, repr=False)
    true_mu: torch.Tensor | None = field(default=None, repr=False)
    true_theta: torch.Tensor | None = field(default=None, repr=False)

    def branch_conditionals(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(m, A, Sigma)`` with ``p(theta_n | mu, x) = N(m_n + A_n mu, Sigma_n)``; shapes ``(N1, D)``,
        ``(N1, D, D)``, ``(N1, D, D)`` (float64). ``A_n = beta I``, ``Sigma_n = gamma I`` with
        ``gamma = 1 / (1/σ1² + N0/σx²)``, ``beta = gamma / σ1²`` and ``m_n = gamma N0 xbar_n / σx²``."""
        N1, N0, D = self.x.shape
        xbar = self.x.to(torch.float64).mean(1)
        gamma = 1.0 / (1.0 / self.scale_theta**2 + N0 / self.scale_x**2)
        beta = gamma / self.scale_theta**2
        eye = torch.eye(D, dtype=torch.float64, device=xbar.device).expand(N1, D, D)
        return gamma * N0 / self.scale_x**2 * xbar, beta * eye, gamma * eye

    def linear_gaussian_system(self) -> LinearGaussianSystem:
        """The same model as a :class:`LinearGaussianSystem` over ``w = (mu, theta)`` (for checks on small sizes)."""
        return _gre_system(self.x, self.scale_mu, self.scale_theta, self.scale_x)


def _gre_system(x: torch.Tensor, s2: float, s1: float, sx: float) -> LinearGaussianSystem:
    N1, N0, D = x.shape
    L = D + N1 * D
    M = N1 * N0 * D
    f64, dev = torch.float64, x.device
    c = torch.zeros(L, dtype=f64, device=dev)
    W = torch.zeros(L, L, dtype=f64, device=dev)
    ti = torch.arange(D, L, device=dev)
    W[ti, ti % D] = 1.0
    s = torch.cat([torch.full((D,), s2, dtype=f64, device=dev), torch.full((N1 * D,), s1, dtype=f64, device=dev)])
    # observation (n, j, d) reads theta_{n, d}
    obs = torch.arange(M, device=dev)
    n_idx = obs // (N0 * D)
    d_idx = obs % D
    A = torch.sparse_coo_tensor(
        torch.stack([obs, D + n_idx * D + d_idx]), torch.ones(M, dtype=f64, device=dev), (M, L), check_invariants=True
    )
    r = torch.full((M,), sx**2, dtype=f64, device=dev)
    return LinearGaussianSystem(c, W, s, A, r, sites={"mu": (D,), "theta": (N1, 1, D)})


def _gre_exact(x: torch.Tensor, s2: float, s1: float, sx: float) -> dict[str, torch.Tensor]:
    x = x.to(torch.float64)
    N1, N0, D = x.shape
    log2pi = math.log(2 * math.pi)
    xbar = x.mean(1)  # (N1, D)
    ss_within = (x - xbar.unsqueeze(1)).pow(2).sum(1)  # (N1, D)
    tau2 = s1**2 + sx**2 / N0  # var of xbar_n given mu
    xbb = xbar.mean(0)  # (D,)
    ss_between = (xbar - xbb).pow(2).sum(0)  # (D,)
    var_xbb = s2**2 + tau2 / N1  # marginal var of xbb
    # prod_j N(x_j; t, sx²) = N(xbar; t, sx²/N0) (2π sx²)^{-(N0-1)/2} N0^{-1/2} exp(-SS/(2 sx²)),
    # used within groups, then across groups, then N(xbb; 0, σ2² + τ²/N1) at the top
    within = (-(N0 - 1) / 2 * (log2pi + math.log(sx**2)) - 0.5 * math.log(N0)) * N1 * D - ss_within.sum() / (2 * sx**2)
    between = (-(N1 - 1) / 2 * (log2pi + math.log(tau2)) - 0.5 * math.log(N1)) * D - ss_between.sum() / (2 * tau2)
    top = (-0.5 * (log2pi + math.log(var_xbb)) * D) - xbb.pow(2).sum() / (2 * var_xbb)
    log_ev = within + between + top
    prec_mu = 1.0 / s2**2 + N1 / tau2
    mu_var = torch.full((D,), 1.0 / prec_mu, dtype=torch.float64, device=x.device)
    mu_mean = (N1 / tau2) * xbb / prec_mu
    gamma = 1.0 / (1.0 / s1**2 + N0 / sx**2)
    beta = gamma / s1**2
    theta_mean = gamma * N0 / sx**2 * xbar + beta * mu_mean
    theta_var = (gamma + beta**2 * mu_var).expand(N1, D)
    return {
        "log_evidence": log_ev,
        "mu_mean": mu_mean,
        "mu_var": mu_var,
        "theta_mean": theta_mean,
        "theta_var": theta_var,
    }


def gaussian_random_effects(
    num_groups: int = 20,
    num_obs: int = 50,
    dim: int = 2,
    *,
    scale_mu: float = 1.0,
    scale_theta: float = 1.0,
    scale_x: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> GREProblem:
    """Gaussian random effects model of PAVI (Rouillard et al. 2023, eq. 10) with exact answers.

    Model (``N1 = num_groups``, ``N0 = num_obs``, ``D = dim``, ``σ2 = scale_mu``, ``σ1 = scale_theta``,
    ``σx = scale_x``)::

        mu ~ N(0_D, σ2² I)                                           site "mu",    value (D,)
        theta_n | mu ~ N(mu, σ1² I)             n = 1..N1           site "theta", value (N1, 1, D)
        x_{n,j} | theta_n ~ N(theta_n, σx² I)   j = 1..N0           site "x",     value (N1, N0, D)

    ``mu`` is PAVI's θ2 (population mean), ``theta`` its θ1 (group means), ``x`` its X. The PAVI paper does not give
    numerical values for the σ's, so all three default to 1 (PAVI's experiments use ``D`` = 2 or 8,
    ``Card(P1)`` = 2, 20, 100 or 200; the defaults here are ``D = 2``, ``N1 = 20``, ``N0 = 50``). Data are drawn from
    the model with ``torch.Generator().manual_seed(seed)`` on the CPU in float64 and cast to ``dtype``/``device``;
    exact answers are computed in float64 from the cast data. ``problem.model`` is :func:`gre_model` with the
    scales bound (``functools.partial``), called as ``problem.model(x, subsample=None)``.

    Exact answers (each dimension independently, ``xbar_n`` group means, ``xbb`` their mean,
    ``τ² = σ1² + σx²/N0``): since ``∏_j N(x_j; t, σ²) = N(xbar; t, σ²/N0) (2πσ²)^{-(N0-1)/2} N0^{-1/2}
    exp(-Σ_j (x_j - xbar)²/(2σ²))``, applied within groups (``σ = σx``) and then across groups to
    ``xbar_n | mu ~ N(mu, τ²)`` (``σ² = τ²``), and finally ``xbb ~ N(0, σ2² + τ²/N1)``:

    - ``log p(x)`` is the sum of these three factors' logs over dimensions;
    - ``p(mu | x) = N(v N1 xbb / τ², v)``, ``v = 1/(1/σ2² + N1/τ²)``;
    - ``p(theta_n | mu, x) = N(γ (mu/σ1² + N0 xbar_n/σx²), γ)``, ``γ = 1/(1/σ1² + N0/σx²)``;
    - ``p(theta_n | x)``: mean ``γ (E[mu]/σ1² + N0 xbar_n/σx²)``, variance ``γ + (γ/σ1²)² v``.

    Returns:
        A :class:`GREProblem`; ``moments`` has ``"mu"`` (``(D,)``) and ``"theta"`` (``(N1, 1, D)``).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    f64 = torch.float64
    N1, N0, D = num_groups, num_obs, dim
    mu = scale_mu * torch.randn(D, generator=gen, dtype=f64)
    theta = mu + scale_theta * torch.randn(N1, D, generator=gen, dtype=f64)
    x = theta.unsqueeze(1) + scale_x * torch.randn(N1, N0, D, generator=gen, dtype=f64)
    x = x.to(dtype=dtype, device=device)

    ex = _gre_exact(x, scale_mu, scale_theta, scale_x)
    moments = {
        "mu": Moments(ex["mu_mean"], ex["mu_var"].sqrt()),
        "theta": Moments(ex["theta_mean"].unsqueeze(-2), ex["theta_var"].sqrt().unsqueeze(-2)),
    }
    scales = {"scale_mu": scale_mu, "scale_theta": scale_theta, "scale_x": scale_x}
    return GREProblem(
        name=f"gaussian_random_effects(N1={N1}, N0={N0}, D={D}, seed={seed})",
        model=functools.partial(gre_model, **scales),
        args=(x,),
        kwargs={},
        log_evidence=float(ex["log_evidence"]),
        moments=moments,
        reference=_REFERENCE,
        x=x,
        mu_mean=ex["mu_mean"],
        mu_var=ex["mu_var"],
        true_mu=mu.to(device=device),
        true_theta=theta.to(device=device),
        **scales,
    )

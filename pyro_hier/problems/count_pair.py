"""Two latent counts with a correlated, bimodal posterior (the kind of Ranganath, Tran & Blei 2016, §4.1), exact on a
truncated grid."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pyro
import pyro.distributions as dist
import torch

from .base import Problem

__all__ = ["CountPairProblem", "count_pair", "count_pair_model"]


def count_pair_model(y: torch.Tensor, *, weights: torch.Tensor, rates: torch.Tensor, coef: float) -> None:
    """Counts from one of several regimes, seen through a noisy total.

    ``z = (z1, z2) ~ Σ_c weights[c] · Poisson(rates[c, 0]) · Poisson(rates[c, 1])`` (one site ``"z"`` of shape ``(2,)``,
    ``event_dim=1``, the regime marginalised); ``y ~ Poisson(coef · (z1 + z2) + 0.1)``.
    """
    z = pyro.sample(
        "z", dist.MixtureSameFamily(dist.Categorical(weights), dist.Poisson(rates).to_event(1))
    )  # support: pairs of non-negative integers
    pyro.sample("y", dist.Poisson(coef * z.sum(-1) + 0.1), obs=y)


@dataclass
class CountPairProblem(Problem):
    """:class:`Problem` with the exact posterior of :func:`count_pair` on the grid ``{0..M}²``.

    ``log_evidence`` sums the joint over the grid; the mass the grid leaves out is at most ``truncation_bound``
    (the prior's mass outside the grid: the likelihood is a probability ≤ 1), so the exact log evidence lies in
    ``[log_evidence, log(exp(log_evidence) + truncation_bound)]``.
    """

    grid_size: int = 0
    weights: torch.Tensor | None = field(default=None, repr=False)
    rates: torch.Tensor | None = field(default=None, repr=False)
    coef: float = 0.5
    y: torch.Tensor | None = field(default=None, repr=False)
    truncation_bound: float = 0.0

    def grid(self) -> torch.Tensor:
        """All grid points as ``((M+1)², 2)`` float64 (row-major: ``z1`` outer)."""
        g = torch.arange(self.grid_size + 1, dtype=torch.float64)
        return torch.cartesian_prod(g, g)

    def log_joint(self, z: torch.Tensor) -> torch.Tensor:
        """``log p(z, y)`` for values ``(..., 2)`` (float64, computed without Pyro)."""
        z = z.to(torch.float64)
        w, r = self.weights.double(), self.rates.double()
        lp = torch.logsumexp(w.log() + _poisson(z.unsqueeze(-2), r).sum(-1), -1)
        return lp + _poisson(self.y.double(), self.coef * z.sum(-1) + 0.1)

    def log_posterior(self) -> torch.Tensor:
        """``log p(z | y)`` at :meth:`grid` (normalised over the grid)."""
        lj = self.log_joint(self.grid())
        return lj - torch.logsumexp(lj, 0)

    def kl_from_log_q(self, log_q: torch.Tensor) -> tuple[float, float]:
        """``KL(q || p)`` over the grid for ``log q`` at :meth:`grid`, and the mass of ``q`` outside the grid (which
        this sum leaves out; it must be negligible for the value to be exact)."""
        log_p = self.log_posterior()
        q = log_q.double().exp()
        return float((q * (log_q.double() - log_p)).sum()), float(1.0 - q.sum())

    def best_mean_field_poisson(self, *, steps: int = 300, starts: int = 5) -> tuple[float, torch.Tensor]:
        """The smallest ``KL(q || p)`` over product-Poisson ``q`` (the best mean-field Poisson guide) and its rates,
        by L-BFGS on the exact grid objective from several starts."""
        z = self.grid()
        best = (math.inf, None)
        gen = torch.Generator().manual_seed(0)
        for _ in range(starts):
            log_rate = (torch.randn(2, generator=gen, dtype=torch.float64) * 0.7 + math.log(5.0)).requires_grad_()
            opt = torch.optim.LBFGS([log_rate], max_iter=steps, line_search_fn="strong_wolfe")

            def closure(opt=opt, log_rate=log_rate):
                opt.zero_grad()
                kl = self._product_poisson_kl(z, log_rate)
                kl.backward()
                return kl

            opt.step(closure)
            kl = float(self._product_poisson_kl(z, log_rate.detach()))
            if kl < best[0]:
                best = (kl, log_rate.detach().exp())
        return best

    def _product_poisson_kl(self, z: torch.Tensor, log_rate: torch.Tensor) -> torch.Tensor:
        log_q = _poisson(z, log_rate.exp()).sum(-1)
        return (log_q.exp() * (log_q - self.log_posterior())).sum()


def _poisson(k: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    return k * rate.log() - rate - torch.lgamma(k + 1)


def count_pair(
    *, y: float = 8.0, coef: float = 0.5, grid_size: int = 80, dtype: torch.dtype = torch.float64
) -> CountPairProblem:
    """Two regimes ``(3, 10)`` and ``(10, 3)`` with equal weight and a total seen as ``y ~ Poisson(½(z1 + z2) + 0.1)``
    with ``y = 8``: the posterior has two modes and correlation ≈ −0.77; the best mean-field Poisson is ≈ 0.70 nats
    from it in KL(q || p), a mixture of two product Poissons ≈ 0.07.

    Example::

        p = count_pair()
        log_post = p.log_posterior()          # (81², ) over p.grid()
        kl_mf, rates = p.best_mean_field_poisson()
    """
    weights = torch.tensor([0.5, 0.5], dtype=dtype)
    rates = torch.tensor([[3.0, 10.0], [10.0, 3.0]], dtype=dtype)
    y_t = torch.tensor(float(y), dtype=dtype)
    # prior mass outside {0..M}²: at most Σ_c w_c [P(Poisson(a_c) > M) + P(Poisson(b_c) > M)], the tails summed
    # term by term over M < k ≤ M + 1000 (the rest is far below float64's smallest number)
    k = torch.arange(grid_size + 1, grid_size + 1001, dtype=torch.float64)
    tails = torch.logsumexp(_poisson(k.reshape(-1, 1, 1), rates.double()), 0).exp()  # (C, 2)
    bound = float((weights.double().unsqueeze(-1) * tails).sum())
    problem = CountPairProblem(
        name="count pair",
        model=count_pair_model,
        args=(y_t,),
        kwargs={"weights": weights, "rates": rates, "coef": coef},
        grid_size=grid_size,
        weights=weights,
        rates=rates,
        coef=coef,
        y=y_t,
        truncation_bound=bound,
    )
    problem.log_evidence = float(torch.logsumexp(problem.log_joint(problem.grid()), 0))
    return problem

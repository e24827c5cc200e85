"""A tiny discrete-latent model whose posterior is exact by brute-force enumeration."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import pyro
import pyro.distributions as dist
import torch

from .base import Moments, Problem

__all__ = ["DiscreteProblem", "discrete_mixture", "discrete_model"]


def discrete_model(
    y: torch.Tensor,
    *,
    cat_probs: torch.Tensor,
    item_probs: torch.Tensor,
    locs: torch.Tensor,
    scale: float = 1.0,
) -> None:
    """``c ~ Categorical(cat_probs)``; ``b_i | c ~ Bernoulli(item_probs[c])``; ``y_i | b_i ~ N(locs[b_i], scale²)``.

    Args:
        y: ``(n,)`` observations.
        cat_probs: ``(K,)`` prior of the global category ``c``.
        item_probs: ``(K,)`` probability that ``b_i = 1`` given ``c``.
        locs: ``(2,)`` observation means for ``b_i = 0, 1``.

    Sites: ``"c"`` ``()``, ``"b"`` ``(n,)`` and ``"y"`` ``(n,)`` in plate ``"items"`` (``dim=-1``). The model is
    written so that both discrete sites can be enumerated in parallel (``config_enumerate`` +
    ``TraceEnum_ELBO(max_plate_nesting=1)`` or ``infer_discrete``).
    """
    c = pyro.sample("c", dist.Categorical(cat_probs))
    with pyro.plate("items", y.shape[-1], dim=-1):
        b = pyro.sample("b", dist.Bernoulli(item_probs[c]))
        pyro.sample("y", dist.Normal(locs[b.long()], scale), obs=y)


@dataclass
class DiscreteProblem(Problem):
    """:class:`Problem` with the exact posterior of :func:`discrete_mixture`, found by enumerating all
    ``K · 2^n`` configurations of ``(c, b)``."""

    y: torch.Tensor | None = field(default=None, repr=False)
    cat_probs: torch.Tensor | None = field(default=None, repr=False)
    item_probs: torch.Tensor | None = field(default=None, repr=False)
    locs: torch.Tensor | None = field(default=None, repr=False)
    scale: float = 1.0
    c_posterior: torch.Tensor | None = field(default=None, repr=False)
    b_posterior: torch.Tensor | None = field(default=None, repr=False)

    def joint_posterior(self) -> dict[str, torch.Tensor]:
        """All configurations with their exact posterior probabilities.

        Returns ``{"c": (K 2^n,) long, "b": (K 2^n, n) long, "log_joint": (K 2^n,), "prob": (K 2^n,)}`` where
        ``log_joint = log p(c, b, y)`` and ``prob = p(c, b | y)`` (float64), plus the scalar ``"log_evidence"``.
        """
        return _enumerate(self.y, self.cat_probs, self.item_probs, self.locs, self.scale)


def _enumerate(
    y: torch.Tensor, cat_probs: torch.Tensor, item_probs: torch.Tensor, locs: torch.Tensor, scale: float
) -> dict[str, torch.Tensor]:
    f64 = torch.float64
    y, cat_probs, item_probs, locs = (t.detach().to(device="cpu", dtype=f64) for t in (y, cat_probs, item_probs, locs))
    n = y.shape[-1]
    cs, bs, logps = [], [], []
    for c in range(cat_probs.shape[0]):
        for bits in itertools.product((0, 1), repeat=n):
            lp = math.log(cat_probs[c])
            for i, bi in enumerate(bits):
                p = float(item_probs[c])
                lp += math.log(p if bi else 1.0 - p)
                z = (float(y[i]) - float(locs[bi])) / scale
                lp += -0.5 * z * z - math.log(scale) - 0.5 * math.log(2 * math.pi)
            cs.append(c)
            bs.append(bits)
            logps.append(lp)
    log_joint = torch.tensor(logps, dtype=f64)
    log_ev = torch.logsumexp(log_joint, 0)
    return {
        "c": torch.tensor(cs, dtype=torch.long),
        "b": torch.tensor(bs, dtype=torch.long).reshape(len(cs), n),
        "log_joint": log_joint,
        "prob": (log_joint - log_ev).exp(),
        "log_evidence": log_ev,
    }


def discrete_mixture(
    num_items: int = 4,
    *,
    cat_probs: tuple[float, ...] = (0.5, 0.3, 0.2),
    item_probs: tuple[float, ...] = (0.1, 0.5, 0.9),
    locs: tuple[float, float] = (-1.0, 1.0),
    scale: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> DiscreteProblem:
    """Global category, per-item binary switches and Gaussian observations; exact by enumeration.

    Model (``n = num_items``, ``K = len(cat_probs)``)::

        c ~ Categorical(cat_probs)                                         site "c", value ()
        b_i | c ~ Bernoulli(item_probs[c])     plate "items" (n, dim=-1)   site "b", value (n,)
        y_i | b_i ~ N(locs[b_i], scale²)       plate "items"               site "y", value (n,)

    ``problem.model`` is :func:`discrete_model` with the parameters bound, called as ``model(y)``. The model carries
    no ``infer`` flags; apply ``pyro.infer.config_enumerate`` to enumerate ``c`` and ``b`` (``max_plate_nesting=1``).
    ``y`` is drawn from the model with ``torch.Generator().manual_seed(seed)`` (CPU, float64), then cast.

    Exact answers: loop over all ``K · 2^n`` configurations ``(c, b)`` and compute
    ``log p(c, b, y) = log cat_probs[c] + Σ_i [log Bernoulli(b_i; item_probs[c]) + log N(y_i; locs[b_i], scale²)]``;
    then ``log p(y) = logsumexp`` over configurations, ``p(c, b | y) = exp(log p(c, b, y) - log p(y))`` and the
    marginals ``p(c = k | y)``, ``p(b_i = 1 | y)`` are sums of the table (Bishop 2006, §8.4; brute force).
    ``moments``: ``"c"`` mean ``Σ_k k p(c=k|y)`` and sd; ``"b"`` mean ``p_i = p(b_i=1|y)``, sd ``sqrt(p_i (1-p_i))``.

    Returns:
        A :class:`DiscreteProblem` with ``c_posterior`` (``(K,)``), ``b_posterior`` (``(n,)``, ``p(b_i = 1 | y)``)
        and :meth:`DiscreteProblem.joint_posterior`.
    """
    if num_items > 16:
        raise ValueError("brute-force enumeration is limited to num_items <= 16")
    if len(cat_probs) != len(item_probs):
        raise ValueError("cat_probs and item_probs must have the same length")
    f64 = torch.float64
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cp = torch.tensor(cat_probs, dtype=f64)
    ip = torch.tensor(item_probs, dtype=f64)
    lc = torch.tensor(locs, dtype=f64)
    c = torch.multinomial(cp, 1, generator=gen).squeeze(-1)
    b = (torch.rand(num_items, generator=gen, dtype=f64) < ip[c]).long()
    y = lc[b] + scale * torch.randn(num_items, generator=gen, dtype=f64)

    y = y.to(dtype=dtype, device=device)
    params = {
        "cat_probs": cp.to(dtype=dtype, device=device),
        "item_probs": ip.to(dtype=dtype, device=device),
        "locs": lc.to(dtype=dtype, device=device),
    }
    table = _enumerate(y, params["cat_probs"], params["item_probs"], params["locs"], scale)
    K = len(cat_probs)
    c_post = torch.zeros(K, dtype=f64).index_add_(0, table["c"], table["prob"])
    b_post = (table["prob"].unsqueeze(-1) * table["b"].to(f64)).sum(0)
    ks = torch.arange(K, dtype=f64)
    c_mean = (ks * c_post).sum()
    c_sd = ((ks - c_mean).pow(2) * c_post).sum().sqrt()
    moments = {
        "c": Moments(c_mean.to(device=y.device), c_sd.to(device=y.device)),
        "b": Moments(b_post.to(device=y.device), (b_post * (1 - b_post)).sqrt().to(device=y.device)),
    }
    return DiscreteProblem(
        name=f"discrete_mixture(n={num_items}, K={K}, seed={seed})",
        model=functools.partial(discrete_model, scale=scale, **params),
        args=(y,),
        kwargs={},
        log_evidence=float(table["log_evidence"]),
        moments=moments,
        reference="Brute-force enumeration of all discrete configurations (Bishop 2006, §8.4).",
        y=y,
        scale=scale,
        c_posterior=c_post.to(device=y.device),
        b_posterior=b_post.to(device=y.device),
        **params,
    )

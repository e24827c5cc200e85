"""Where a PAVI guide's gap on Gaussian random effects lies: the globals' q against the exact p(mu | x), and the
groups' conditionals against the exact p(theta_n | mu, x), split by how extreme each group's data are.

Trains one guide exactly as a row of ``benchmarks/pavi.py`` (same schedule, subsampling and iterate averaging; its
``train``), then, with ``--draws`` joint draws of the guide at full plate size:

- the total gap ``log p(x) − ELBO`` (``elbo_estimate``, 400 particles);
- ``KL(q(mu) ‖ p(mu | x)) = E_q[log q(mu) − log p(mu | x)]``;
- per group, ``E_q[log q(theta_n | mu) − log p(theta_n | mu, x)]``, whose sum is the groups' share
  ``E_q KL(q(theta | mu) ‖ p(theta | mu, x))``, reported by decile of ``|xbar_n − E[mu | x]|``.

The two parts add up to the gap (the chain rule of the KL), up to Monte Carlo error.

Usage::

    python benchmarks/pavi_gap_split.py --guide PAVI-E --seed 0          # 20,000 groups, 60 s; ~4 min
    python benchmarks/pavi_gap_split.py --guide PAVI-E-affine --seed 0
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import math

import pyro
import torch
from pavi import GUIDES, train
from pyro import poutine

from pyro_hier.diagnostics import elbo_estimate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guide", default="PAVI-E", choices=[g for g in GUIDES if g != "AutoNormal"])
    parser.add_argument("--groups", type=int, default=20000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draws", type=int, default=1000, help="joint draws for the split (in chunks of 100)")
    parser.add_argument("--reduced", type=int, default=20)
    parser.add_argument("--num-obs", type=int, default=5)
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--average-last", type=float, default=0.25)
    args = parser.parse_args()
    n = args.groups
    p, guide, steps, spent = train(args.guide, n, args)
    with torch.no_grad():
        value, se = elbo_estimate(
            p.model, guide, p.args, num_particles=400, batch_size=max(1, min(100, 2_000_000 // (n * 50)))
        )
        m, A, S = p.branch_conditionals()  # p(theta_n | mu, x) = N(m_n + beta mu, gamma I)
        beta, gamma = float(A[0, 0, 0]), float(S[0, 0, 0])
        exact_mu = torch.distributions.Normal(p.mu_mean, p.mu_var.sqrt())
        kl_mu, local = [], torch.zeros(n, dtype=torch.float64)
        chunk = 100
        for _ in range(math.ceil(args.draws / chunk)):
            with pyro.plate("_draws", chunk, dim=-3):
                trace = poutine.trace(guide).get_trace(*p.args)
            mu_site, theta_site = trace.nodes["mu"], trace.nodes["theta"]
            mu = mu_site["value"].reshape(chunk, 2)
            kl_mu.append(mu_site["fn"].log_prob(mu_site["value"]).reshape(chunk) - exact_mu.log_prob(mu).sum(-1))
            theta = theta_site["value"].reshape(chunk, n, 2)
            exact = torch.distributions.Normal(m + beta * mu.unsqueeze(1), math.sqrt(gamma))
            log_q = theta_site["fn"].log_prob(theta_site["value"]).reshape(chunk, n)
            local += (log_q - exact.log_prob(theta).sum(-1)).sum(0)
        draws = chunk * len(kl_mu)
        kl_mu = torch.cat(kl_mu)
        local /= draws
    gap = p.log_evidence - value
    print(f"{args.guide}, {n} groups, seed {args.seed}: {steps} steps in {spent:.0f} s, {draws} draws")
    print(f"  gap log p(x) − ELBO           {gap:8.3f} ± {se:.3f} nats")
    print(f"  KL(q(mu) ‖ p(mu | x))         {float(kl_mu.mean()):8.3f} ± {float(kl_mu.std()) / math.sqrt(draws):.3f}")
    print(f"  groups' share (sum over n)    {float(local.sum()):8.3f}")
    distance = (p.x.to(torch.float64).mean(1) - p.mu_mean).norm(dim=-1)
    order = distance.argsort()
    print("  groups' share by decile of |xbar_n − E[mu | x]|:")
    for k in range(10):
        idx = order[k * n // 10 : (k + 1) * n // 10]
        print(f"    decile {k}: |xbar − E mu| {float(distance[idx].mean()):5.2f}   {float(local[idx].sum()):7.3f} nats")


if __name__ == "__main__":
    main()

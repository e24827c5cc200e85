import math

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoHierarchicalNormalMessenger, AutoNormal

from pyro_hier.diagnostics import elbo_estimate, moment_error
from pyro_hier.problems import Moments


def model(y, subsample=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("groups", len(y), subsample=subsample, dim=-1) as i:
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        pyro.sample("y", dist.Normal(z, 0.5), obs=y[i])


def test_elbo_estimate_agrees_with_pyro_including_subsampling():
    y = torch.randn(12, dtype=torch.float64)
    guide = AutoNormal(model, create_plates=lambda y, subsample=None: pyro.plate("groups", 12, subsample=subsample))
    guide(y)
    for kwargs in ({}, {"subsample": torch.tensor([1, 5, 7])}):
        ours, se = elbo_estimate(model, guide, (y,), kwargs, num_particles=4000)
        pyro.set_rng_seed(1)
        theirs = -Trace_ELBO(num_particles=4000, vectorize_particles=True).loss(model, guide, y, **kwargs)
        assert math.isfinite(se) and se > 0
        # two independent estimates of the same expectation (Pyro's has the same sd per particle)
        assert abs(ours - theirs) < 5 * math.sqrt(2) * se, (kwargs, ours, theirs, se)


def test_elbo_estimate_of_a_guide_that_runs_the_model_inside_itself_leaves_the_observations_out_of_q():
    # Pyro's AutoMessenger guides record the model's observed sites in their own trace; counted in log q they
    # would cancel the likelihood (the ELBO came out above the log evidence)
    pyro.set_rng_seed(0)
    y = torch.randn(12, dtype=torch.float64)
    guide = AutoHierarchicalNormalMessenger(model)
    guide(y)
    ours, se = elbo_estimate(model, guide, (y,), num_particles=4000)
    theirs = -Trace_ELBO(num_particles=4000, vectorize_particles=True).loss(model, guide, y)
    assert abs(ours - theirs) < 5 * math.sqrt(2) * se, (ours, theirs, se)
    # exact log evidence: y ~ N(0, 1·1ᵀ + (1 + 0.25) I)
    cov = torch.ones(12, 12, dtype=torch.float64) + 1.25 * torch.eye(12, dtype=torch.float64)
    log_evidence = float(dist.MultivariateNormal(torch.zeros(12, dtype=torch.float64), cov).log_prob(y))
    assert ours < log_evidence + 5 * se


def test_moment_error():
    ref = {"a": Moments(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 2.0]))}
    q = {"a": Moments(torch.tensor([0.5, 1.0]), torch.tensor([1.0, 3.0])), "b": Moments(torch.zeros(1), torch.ones(1))}
    err = moment_error(q, ref)
    assert err.max_mean_error == 0.5 and err.min_sd_ratio == 1.0 and err.max_sd_ratio == 1.5

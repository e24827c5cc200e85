"""The occupancy problem: its closed forms against brute-force enumeration of the Pyro model, its quadrature against a
second rule, a Monte Carlo estimate and larger grids."""

import itertools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_hier.problems import occupancy

f64 = torch.float64


@pytest.fixture(scope="module")
def tiny():
    return occupancy(3, 2, 2, seed=1)  # 6 site-species pairs: 2^6 presence configurations


def _trace_log_prob(p, values):
    model = pyro.poutine.condition(p.model, data=values)
    return pyro.poutine.trace(model).get_trace(*p.args, **p.kwargs).log_prob_sum()


def _random_globals(gen, num_species):
    mu, beta, gamma = (torch.randn((), generator=gen, dtype=f64) for _ in range(3))
    return {"mu": mu, "beta": beta, "gamma": gamma, "a": mu + torch.randn(num_species, generator=gen, dtype=f64)}


def test_log_joint_is_the_pyro_models(tiny):
    gen = torch.Generator().manual_seed(0)
    detected = tiny.y.sum(0) > 0
    for _ in range(4):
        values = _random_globals(gen, 2)
        values["z"] = torch.where(detected, 1.0, (torch.rand(3, 2, generator=gen) < 0.5).to(f64))
        torch.testing.assert_close(tiny.log_joint(values), _trace_log_prob(tiny, values))
    # a detection at an unoccupied pair: impossible (−∞) here; the model's clamped Bernoulli gives log(eps) per visit
    values["z"] = torch.zeros(3, 2, dtype=f64)
    assert tiny.log_joint(values) == -math.inf
    assert _trace_log_prob(tiny, values) < math.log(torch.finfo(f64).eps) + 1


def test_presences_summed_in_closed_form_match_enumeration(tiny):
    """Σ_z p(y, z, a, θ) over all 2^6 presence configurations, each scored by the Pyro model, equals the closed form
    (the integrand of the quadrature), and the enumerated p(z_sk = 1 | a, θ, y) equals z_conditional."""
    gen = torch.Generator().manual_seed(1)
    configs = torch.tensor(list(itertools.product([0.0, 1.0], repeat=6)), dtype=f64).reshape(-1, 3, 2)
    for _ in range(3):
        values = _random_globals(gen, 2)
        log_terms = torch.stack([_trace_log_prob(tiny, {**values, "z": z}) for z in configs])
        possible = torch.stack([tiny.log_joint({**values, "z": z}) for z in configs]) > -math.inf
        log_sum = torch.logsumexp(log_terms[possible], 0)  # the model's clamped impossible terms are < 1e-30 of it
        per_site, prob = tiny._site_marginal(values["a"], values["beta"], values["gamma"])
        closed = (
            tiny._log_prior_globals(values["mu"], values["beta"], values["gamma"])
            + dist.Normal(values["mu"], 1.0).log_prob(values["a"]).sum()
            + per_site.sum()
        )
        torch.testing.assert_close(log_sum, closed)
        weights = (log_terms - log_sum).exp() * possible
        enumerated = (weights.reshape(-1, 1, 1) * configs).sum(0)
        torch.testing.assert_close(enumerated, tiny.z_conditional(values["a"], values["beta"], values["gamma"]))
        assert (prob[tiny.y.sum(0) > 0] == 1).all()


def test_quadrature_matches_gauss_hermite_on_the_prior_and_monte_carlo(tiny):
    """Two quadrature rules (trapezoid around the mode; Gauss–Hermite on the prior) agree on the evidence and every
    posterior moment; a prior Monte Carlo estimate of p(y) (2·10^5 draws) agrees within its standard error."""
    log_z, moments = tiny.log_evidence, tiny.moments
    log_z_gh, moments_gh = tiny.prior_gauss_hermite(outer_nodes=40, inner_nodes=40)
    assert abs(log_z - log_z_gh) < 1e-4
    for name in moments:
        torch.testing.assert_close(moments[name].mean, moments_gh[name].mean, atol=1e-4, rtol=0)
        torch.testing.assert_close(moments[name].sd, moments_gh[name].sd, atol=1e-4, rtol=0)
    gen = torch.Generator().manual_seed(2)
    n = 200_000
    mu, beta, gamma = (s * torch.randn(n, generator=gen, dtype=f64) for s in (1.5, 1.0, 1.5))
    a = mu.unsqueeze(-1) + torch.randn(n, 2, generator=gen, dtype=f64)
    like = tiny._site_marginal(a, beta, gamma)[0].sum((-2, -1)).exp()  # p(y | a, θ), z summed out
    mean, se = like.mean(), like.std() / math.sqrt(n)
    assert abs(float(mean) - math.exp(log_z)) < 5 * float(se)


def test_quadrature_converged_on_a_larger_instance():
    p = occupancy(8, 3, 3, seed=0)
    log_z, moments = p.exact_posterior(outer_nodes=31, outer_half_width=12.0, inner_nodes=161, inner_half_width=12.0)
    assert abs(log_z - p.log_evidence) < 1e-6
    for name in moments:
        torch.testing.assert_close(moments[name].mean, p.moments[name].mean, atol=1e-5, rtol=0)
    z = p.moments["z"].mean
    detected = p.y.sum(0) > 0
    assert (z[detected] == 1).all() and ((z[~detected] > 0) & (z[~detected] < 1)).all()
    assert p.moments["z"].sd[detected].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_model_runs_in_both_dtypes_and_shapes(dtype):
    p = occupancy(5, 4, 3, dtype=dtype)
    trace = pyro.poutine.trace(p.model).get_trace(*p.args, **p.kwargs)
    assert trace.nodes["z"]["value"].shape == (5, 4) and trace.nodes["a"]["value"].shape == (4,)
    assert trace.nodes["y"]["value"].shape == (3, 5, 4) and trace.nodes["y"]["value"].dtype == dtype
    assert math.isfinite(float(trace.log_prob_sum()))
    assert set(p.moments) == {"mu", "beta", "gamma", "a", "z"} and p.moments["z"].mean.shape == (5, 4)
    with pytest.raises(ValueError, match="num_sites"):
        occupancy(0, 2, 2)

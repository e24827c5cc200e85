import itertools
import math

import pyro
import pytest
import torch
from pyro.infer import TraceEnum_ELBO, config_enumerate, infer_discrete

from pyro_hier.problems.discrete import discrete_mixture

f64 = torch.float64


def empty_guide(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def prob():
    return discrete_mixture(seed=0)


def test_table_by_conditioning_the_pyro_model(prob):
    """Independent route: condition the Pyro model on every configuration and log-sum-exp its log joint."""
    n = prob.y.shape[0]
    table = prob.joint_posterior()
    assert table["c"].shape == (3 * 2**n,) and table["b"].shape == (3 * 2**n, n)
    lps = []
    for c, bits in itertools.product(range(3), itertools.product((0.0, 1.0), repeat=n)):
        data = {"c": torch.tensor(c), "b": torch.tensor(bits, dtype=f64)}
        tr = pyro.poutine.trace(pyro.poutine.condition(prob.model, data=data)).get_trace(*prob.args)
        lp = tr.log_prob_sum()
        lps.append(lp)
        idx = int(((table["c"] == c) & (table["b"] == torch.tensor(bits).long()).all(-1)).nonzero())
        assert abs(float(table["log_joint"][idx] - lp)) < 1e-10
    log_ev = torch.logsumexp(torch.stack(lps), 0)
    assert abs(prob.log_evidence - float(log_ev)) < 1e-10
    assert abs(float(table["prob"].sum()) - 1.0) < 1e-12


def test_log_evidence_equals_trace_enum_elbo(prob):
    elbo = TraceEnum_ELBO(max_plate_nesting=1)
    loss = elbo.loss(config_enumerate(prob.model), empty_guide, *prob.args, **prob.kwargs)
    assert abs(-loss - prob.log_evidence) < 1e-8 * max(1.0, abs(prob.log_evidence))


def test_marginals_equal_compute_marginals(prob):
    elbo = TraceEnum_ELBO(max_plate_nesting=1)
    marg = elbo.compute_marginals(config_enumerate(prob.model), empty_guide, *prob.args, **prob.kwargs)
    torch.testing.assert_close(marg["c"].probs.to(f64), prob.c_posterior, rtol=0, atol=1e-8)
    torch.testing.assert_close(marg["b"].probs.to(f64), prob.b_posterior, rtol=0, atol=1e-8)
    ks = torch.arange(3, dtype=f64)
    mean = (ks * prob.c_posterior).sum()
    assert abs(float(prob.moments["c"].mean - mean)) < 1e-12
    assert abs(float(prob.moments["c"].sd ** 2 - ((ks - mean) ** 2 * prob.c_posterior).sum())) < 1e-12
    torch.testing.assert_close(prob.moments["b"].sd, (prob.b_posterior * (1 - prob.b_posterior)).sqrt())


def test_infer_discrete_frequencies(prob):
    S = 4000
    pyro.set_rng_seed(0)

    def vectorized(y):
        with pyro.plate("draws", S, dim=-2):
            prob.model(y)

    sampler = infer_discrete(config_enumerate(vectorized), first_available_dim=-3, temperature=1)
    tr = pyro.poutine.trace(sampler).get_trace(*prob.args)
    c, b = tr.nodes["c"]["value"], tr.nodes["b"]["value"]
    assert c.shape == (S, 1) and b.shape == (S, 4)
    freq_c = torch.stack([(c == k).to(f64).mean() for k in range(3)])
    freq_b = b.to(f64).mean(0)
    for freq, p in ((freq_c, prob.c_posterior), (freq_b, prob.b_posterior)):
        se = (p * (1 - p) / S).sqrt()
        assert torch.all((freq - p).abs() <= 5 * se + 1e-3), (freq, p)


def test_model_log_joint_and_shapes(prob):
    pyro.set_rng_seed(3)
    tr = pyro.poutine.trace(prob.model).get_trace(*prob.args)
    c, b = tr.nodes["c"]["value"], tr.nodes["b"]["value"]
    assert c.shape == prob.moments["c"].mean.shape == ()
    assert b.shape == prob.moments["b"].mean.shape == (4,)
    expected = math.log(prob.cat_probs[c])
    for i in range(4):
        p1 = float(prob.item_probs[c])
        expected += math.log(p1 if b[i] == 1 else 1 - p1)
        expected += -0.5 * (float(prob.y[i]) - float(prob.locs[b[i].long()])) ** 2 - 0.5 * math.log(2 * math.pi)
    assert abs(float(tr.log_prob_sum()) - expected) < 1e-10


def test_float32_and_options():
    f = discrete_mixture(seed=0, dtype=torch.float32)
    d = discrete_mixture(seed=0)
    assert f.y.dtype == torch.float32
    tr = pyro.poutine.trace(f.model).get_trace(*f.args)
    assert tr.nodes["y"]["value"].dtype == torch.float32 and torch.isfinite(tr.log_prob_sum())
    assert abs(f.log_evidence - d.log_evidence) < 1e-5
    loss = TraceEnum_ELBO(max_plate_nesting=1).loss(config_enumerate(f.model), empty_guide, *f.args)
    assert abs(-loss - f.log_evidence) < 1e-4
    g = discrete_mixture(num_items=6, cat_probs=(0.6, 0.4), item_probs=(0.2, 0.7), locs=(0.0, 2.0), scale=0.5, seed=4)
    assert g.joint_posterior()["prob"].shape == (2 * 2**6,)
    loss = TraceEnum_ELBO(max_plate_nesting=1).loss(config_enumerate(g.model), empty_guide, *g.args)
    assert abs(-loss - g.log_evidence) < 1e-8 * max(1.0, abs(g.log_evidence))
    with pytest.raises(ValueError):
        discrete_mixture(num_items=17)
    with pytest.raises(ValueError):
        discrete_mixture(cat_probs=(0.5, 0.5))

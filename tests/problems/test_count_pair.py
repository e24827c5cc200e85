import pyro
import torch

from pyro_hier.problems import count_pair

f64 = torch.float64


def test_log_joint_is_the_pyro_models():
    p = count_pair()
    for z in ([0.0, 0.0], [3.0, 10.0], [12.0, 1.0], [40.0, 2.0]):
        value = torch.tensor(z, dtype=f64)
        trace = pyro.poutine.trace(pyro.poutine.condition(p.model, data={"z": value})).get_trace(*p.args, **p.kwargs)
        torch.testing.assert_close(p.log_joint(value), trace.log_prob_sum())


def test_grid_holds_the_posterior_and_it_is_bimodal_and_correlated():
    p = count_pair()
    assert p.truncation_bound < 1e-30  # prior mass outside {0..80}², summed term by term
    log_post = p.log_posterior()
    torch.testing.assert_close(log_post.exp().sum(), torch.tensor(1.0, dtype=f64))
    bigger = count_pair(grid_size=120)  # the evidence does not move when the grid grows
    assert abs(bigger.log_evidence - p.log_evidence) < 1e-12
    prob = log_post.exp().reshape(81, 81)
    z = torch.arange(81, dtype=f64)
    m1, m2 = (prob.sum(1) * z).sum(), (prob.sum(0) * z).sum()
    cov = (prob * (z[:, None] - m1) * (z[None, :] - m2)).sum()
    var1, var2 = (prob.sum(1) * (z - m1) ** 2).sum(), (prob.sum(0) * (z - m2) ** 2).sum()
    assert cov / (var1 * var2).sqrt() < -0.7
    # two modes, mirror images: the mass above the diagonal equals the mass below it
    assert abs(float(prob.triu(1).sum() - prob.tril(-1).sum())) < 1e-12
    assert float(prob.triu(1).sum()) > 0.45


def test_best_mean_field_poisson_is_a_minimum():
    p = count_pair()
    kl, rates = p.best_mean_field_poisson()
    assert 0.6 < kl < 0.8
    z = p.grid()
    for delta in ([0.05, 0.0], [0.0, -0.05], [-0.05, 0.05]):
        log_rate = rates.log() + torch.tensor(delta, dtype=f64)
        assert float(p._product_poisson_kl(z, log_rate)) > kl

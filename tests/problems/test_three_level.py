import pyro
import pytest
import torch

from pyro_hier.problems.three_level import three_level

f64 = torch.float64
Normal = torch.distributions.Normal
SCALES = {"scale_mu": 1.5, "scale_region": 0.8, "scale_group": 0.4, "scale_obs": 1.1}
R, G, n = 3, 2, 4


def joint_cov(scale_mu, scale_region, scale_group, scale_obs):
    """By hand, from the tree: every variable is described by (region, group, is_obs); -1 means "above that level"."""
    rows = [(-1, -1, 0)]
    rows += [(r, -1, 0) for r in range(R)]
    rows += [(r, g, 0) for r in range(R) for g in range(G)]
    rows += [(r, g, 1) for r in range(R) for g in range(G) for _ in range(n)]
    t = torch.tensor(rows)
    reg, grp, obs = t[:, 0], t[:, 1], t[:, 2].bool()
    same_r = (reg[:, None] == reg[None, :]) & (reg[:, None] >= 0)
    same_g = same_r & (grp[:, None] == grp[None, :]) & (grp[:, None] >= 0)
    cov = scale_mu**2 + scale_region**2 * same_r.to(f64) + scale_group**2 * same_g.to(f64)
    cov = cov + scale_obs**2 * torch.diag(obs.to(f64))
    return cov, (~obs).sum()


@pytest.fixture(scope="module")
def small():
    return three_level(R, G, n, seed=2, **SCALES)


def test_log_evidence_and_moments_against_dense(small):
    cov, L = joint_cov(**SCALES)
    y = small.y_flat
    assert torch.equal(y, small.args[0].reshape(-1))
    dense = torch.distributions.MultivariateNormal(torch.zeros(len(y), dtype=f64), cov[L:, L:]).log_prob(y)
    tol = 1e-8 * abs(float(dense))
    assert abs(small.log_evidence - float(dense)) < tol
    assert abs(float(small.system.dense_log_evidence(y)) - float(dense)) < tol
    K = cov[:L, L:] @ torch.linalg.inv(cov[L:, L:])
    mean, pcov = K @ y, cov[:L, :L] - K @ cov[L:, :L]
    torch.testing.assert_close(small.posterior_cov(), pcov, rtol=1e-8, atol=1e-10)
    sd = pcov.diagonal().sqrt()
    torch.testing.assert_close(small.moments["mu"].mean, mean[0], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(small.moments["a"].mean, mean[1 : 1 + R].reshape(R, 1, 1), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(small.moments["b"].mean, mean[1 + R :].reshape(R, G, 1), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(small.moments["mu"].sd, sd[0], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(small.moments["a"].sd, sd[1 : 1 + R].reshape(R, 1, 1), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(small.moments["b"].sd, sd[1 + R :].reshape(R, G, 1), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(small.posterior_mean()["b"], small.moments["b"].mean)


def test_model_log_joint(small):
    pyro.set_rng_seed(4)
    tr = pyro.poutine.trace(small.model).get_trace(*small.args, **small.kwargs)
    mu, a, b = (tr.nodes[k]["value"] for k in ("mu", "a", "b"))
    s = SCALES
    expected = (
        Normal(torch.zeros((), dtype=f64), s["scale_mu"]).log_prob(mu)
        + Normal(mu, s["scale_region"]).log_prob(a).sum()
        + Normal(a, s["scale_group"]).log_prob(b).sum()
        + Normal(b, s["scale_obs"]).log_prob(small.args[0]).sum()
    )
    assert abs(float(tr.log_prob_sum() - expected)) < 1e-10 * abs(float(expected))
    lj = small.system.log_joint(small.system.flatten({"mu": mu, "a": a, "b": b}), small.y_flat)
    assert abs(float(lj - expected)) < 1e-10 * abs(float(expected))


def test_shapes_subsample_float32(small):
    tr = pyro.poutine.trace(small.model).get_trace(*small.args, **small.kwargs)
    assert tr.nodes["a"]["value"].shape == (R, 1, 1)
    assert tr.nodes["b"]["value"].shape == (R, G, 1)
    assert tr.nodes["y"]["value"].shape == (R, G, n)
    for k, mom in small.moments.items():
        assert mom.mean.shape == mom.sd.shape == tr.nodes[k]["value"].shape
    idx = torch.tensor([2, 1])
    tr = pyro.poutine.trace(small.model).get_trace(*small.args, subsample=idx, **small.kwargs)
    assert tr.nodes["a"]["value"].shape == (2, 1, 1) and tr.nodes["b"]["value"].shape == (2, G, 1)
    torch.testing.assert_close(tr.nodes["y"]["value"], small.args[0][idx])
    assert tr.nodes["y"]["scale"] == pytest.approx(R / 2)
    f = three_level(R, G, n, seed=2, dtype=torch.float32, **SCALES)
    assert f.args[0].dtype == torch.float32
    tr = pyro.poutine.trace(f.model).get_trace(*f.args, **f.kwargs)
    assert tr.nodes["b"]["value"].dtype == torch.float32 and torch.isfinite(tr.log_prob_sum())
    assert abs(f.log_evidence - small.log_evidence) < 1e-5 * abs(small.log_evidence)


def test_defaults_and_seed():
    p = three_level()
    assert p.args[0].shape == (5, 4, 10) and p.system.num_latents == 1 + 5 + 20
    q = three_level(seed=1)
    assert not torch.equal(p.args[0], q.args[0])
    assert torch.equal(p.args[0], three_level().args[0])

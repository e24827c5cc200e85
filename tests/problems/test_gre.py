import pyro
import pytest
import torch

from pyro_hier.problems.gre import gaussian_random_effects

f64 = torch.float64
Normal = torch.distributions.Normal
SCALES = {"scale_mu": 1.7, "scale_theta": 0.6, "scale_x": 1.3}


def joint(N1, N0, D, scale_mu, scale_theta, scale_x):
    """By hand: prior covariance of w = (mu, theta) and the map x = X w + eps (rows (n, j, d), cols (n, d))."""
    S = scale_mu**2 * torch.kron(torch.ones(N1 + 1, N1 + 1, dtype=f64), torch.eye(D, dtype=f64))
    S[D:, D:] += scale_theta**2 * torch.eye(N1 * D, dtype=f64)
    pick = torch.kron(torch.eye(N1, dtype=f64), torch.kron(torch.ones(N0, 1, dtype=f64), torch.eye(D, dtype=f64)))
    X = torch.cat([torch.zeros(N1 * N0 * D, D, dtype=f64), pick], 1)
    return S, X, scale_x**2


def condition(S, X, noise, y, keep, given):
    Cj = torch.cat(
        [torch.cat([S, S @ X.T], 1), torch.cat([X @ S, X @ S @ X.T + noise * torch.eye(len(y), dtype=f64)], 1)]
    )
    obs = torch.cat([torch.as_tensor(given, dtype=torch.long), S.shape[0] + torch.arange(len(y))])
    K = Cj[keep][:, obs] @ torch.linalg.inv(Cj[obs][:, obs])
    return K, Cj[keep][:, keep] - K @ Cj[obs][:, keep]


@pytest.fixture(scope="module")
def small():
    return gaussian_random_effects(num_groups=4, num_obs=6, dim=2, seed=3, **SCALES)


def test_defaults():
    p = gaussian_random_effects()
    assert p.x.shape == (20, 50, 2) and p.x.dtype == f64
    assert p.moments["theta"].mean.shape == (20, 1, 2)
    assert (p.scale_mu, p.scale_theta, p.scale_x) == (1.0, 1.0, 1.0)


def test_log_evidence_three_ways(small):
    S, X, noise = joint(4, 6, 2, **SCALES)
    y = small.x.reshape(-1)
    dense = torch.distributions.MultivariateNormal(
        torch.zeros(len(y), dtype=f64), X @ S @ X.T + noise * torch.eye(len(y), dtype=f64)
    ).log_prob(y)
    lgs = small.linear_gaussian_system()
    tol = 1e-8 * abs(float(dense))
    assert abs(small.log_evidence - float(dense)) < tol
    assert abs(float(lgs.log_evidence(y)) - float(dense)) < tol
    assert abs(float(lgs.dense_log_evidence(y)) - float(dense)) < tol


def test_moments_against_dense_conditioning(small):
    N1, N0, D = small.x.shape
    S, X, noise = joint(N1, N0, D, **SCALES)
    y = small.x.reshape(-1)
    K, cov = condition(S, X, noise, y, torch.arange(S.shape[0]), [])
    mean, sd = K @ y, cov.diagonal().sqrt()
    torch.testing.assert_close(small.moments["mu"].mean, mean[:D], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(small.moments["mu"].sd, sd[:D], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(small.moments["theta"].mean, mean[D:].reshape(N1, 1, D), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(small.moments["theta"].sd, sd[D:].reshape(N1, 1, D), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(small.mu_var, sd[:D] ** 2, rtol=1e-8, atol=1e-10)
    lgs_mom = small.linear_gaussian_system().moments(y)
    for k in ("mu", "theta"):
        torch.testing.assert_close(lgs_mom[k].mean, small.moments[k].mean, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(lgs_mom[k].sd, small.moments[k].sd, rtol=1e-8, atol=1e-10)


def test_branch_conditionals(small):
    N1, N0, D = small.x.shape
    S, X, noise = joint(N1, N0, D, **SCALES)
    y = small.x.reshape(-1)
    K, cov = condition(S, X, noise, y, torch.arange(D, S.shape[0]), torch.arange(D))
    m, A, Sig = small.branch_conditionals()
    mu = torch.tensor([0.3, -1.2], dtype=f64)
    torch.testing.assert_close(m + A @ mu, (K @ torch.cat([mu, y])).reshape(N1, D), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(torch.block_diag(*Sig), cov, rtol=1e-8, atol=1e-10)


def test_model_log_joint(small):
    pyro.set_rng_seed(1)
    tr = pyro.poutine.trace(small.model).get_trace(*small.args, **small.kwargs)
    mu, theta = tr.nodes["mu"]["value"], tr.nodes["theta"]["value"]
    s = SCALES
    expected = (
        Normal(torch.zeros((), dtype=f64), s["scale_mu"]).log_prob(mu).sum()
        + Normal(mu, s["scale_theta"]).log_prob(theta).sum()
        + Normal(theta, s["scale_x"]).log_prob(small.x).sum()
    )
    assert abs(float(tr.log_prob_sum() - expected)) < 1e-10 * abs(float(expected))
    lgs = small.linear_gaussian_system()
    lj = lgs.log_joint(lgs.flatten({"mu": mu, "theta": theta}), small.x.reshape(-1))
    assert abs(float(lj - expected)) < 1e-10 * abs(float(expected))


def test_shapes_subsample_float32(small):
    tr = pyro.poutine.trace(small.model).get_trace(*small.args, **small.kwargs)
    for k, mom in small.moments.items():
        assert mom.mean.shape == tr.nodes[k]["value"].shape == mom.sd.shape
    assert tr.nodes["x"]["value"].shape == (4, 6, 2)
    idx = torch.tensor([2])
    tr = pyro.poutine.trace(small.model).get_trace(*small.args, subsample=idx, **small.kwargs)
    assert tr.nodes["theta"]["value"].shape == (1, 1, 2)
    torch.testing.assert_close(tr.nodes["x"]["value"], small.x[idx])
    f = gaussian_random_effects(num_groups=4, num_obs=6, dim=2, seed=3, dtype=torch.float32, **SCALES)
    assert f.x.dtype == torch.float32
    torch.testing.assert_close(f.x, small.x.float())
    tr = pyro.poutine.trace(f.model).get_trace(*f.args, **f.kwargs)
    assert tr.nodes["theta"]["value"].dtype == torch.float32 and torch.isfinite(tr.log_prob_sum())
    assert abs(f.log_evidence - small.log_evidence) < 1e-5 * abs(small.log_evidence)


def test_seed():
    a = gaussian_random_effects(num_groups=3, num_obs=2, seed=0)
    b = gaussian_random_effects(num_groups=3, num_obs=2, seed=0)
    c = gaussian_random_effects(num_groups=3, num_obs=2, seed=1)
    assert torch.equal(a.x, b.x) and not torch.equal(a.x, c.x)

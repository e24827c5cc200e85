import pyro
import pytest
import torch

from pyro_hier.problems.regression import synthetic_regression

f64 = torch.float64
Normal = torch.distributions.Normal


def joint_covariance(x):
    """Prior covariance of w = (theta, z_1..z_N) and the map y = X w + eps, built by hand from the model."""
    N, n, D = x.shape
    S = torch.kron(torch.ones(N + 1, N + 1, dtype=f64), torch.eye(D, dtype=f64))
    S[D:, D:] += torch.eye(N * D, dtype=f64)
    X = torch.cat([torch.zeros(N * n, D, dtype=f64), torch.block_diag(*x)], dim=1)
    return S, X


def condition(S, X, y, keep, given):
    """Condition the zero-mean joint of (w, y) on y and the latents ``given``; return gain and cov of ``keep``."""
    Cj = torch.cat([torch.cat([S, S @ X.T], 1), torch.cat([X @ S, X @ S @ X.T + torch.eye(len(y), dtype=f64)], 1)])
    obs = torch.cat([torch.as_tensor(given), S.shape[0] + torch.arange(len(y))])
    K = Cj[keep][:, obs] @ torch.linalg.inv(Cj[obs][:, obs])
    cov = Cj[keep][:, keep] - K @ Cj[obs][:, keep]
    return K, cov


@pytest.fixture(scope="module")
def small():
    return synthetic_regression(num_groups=4, num_obs=5, dim=3, seed=1)


def test_log_evidence_three_ways(small):
    p = small
    x, y = p.x, p.y
    S, X = joint_covariance(x)
    cov_y = X @ S @ X.T + torch.eye(y.numel(), dtype=f64)
    dense = torch.distributions.MultivariateNormal(torch.zeros(y.numel(), dtype=f64), cov_y).log_prob(y.reshape(-1))
    lgs = p.linear_gaussian_system()
    tol = 1e-8 * abs(float(dense))
    assert abs(p.log_evidence - float(dense)) < tol
    assert abs(float(lgs.log_evidence(y.reshape(-1))) - float(dense)) < tol
    assert abs(float(lgs.dense_log_evidence(y.reshape(-1))) - float(dense)) < tol


def test_posterior_moments_against_dense_conditioning(small):
    p = small
    N, _, D = p.x.shape
    S, X = joint_covariance(p.x)
    keep = torch.arange(S.shape[0])
    K, cov = condition(S, X, p.y.reshape(-1), keep, torch.zeros(0, dtype=torch.long))
    mean = K @ p.y.reshape(-1)
    torch.testing.assert_close(p.theta_mean, mean[:D], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(p.theta_cov, cov[:D, :D], rtol=1e-8, atol=1e-10)
    z_mean, z_cov = p.z_posterior()
    torch.testing.assert_close(z_mean, mean[D:].reshape(N, D), rtol=1e-8, atol=1e-10)
    blocks = cov[D:, D:].reshape(N, D, N, D)
    torch.testing.assert_close(z_cov, torch.stack([blocks[i, :, i] for i in range(N)]), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(p.moments["z"].mean, mean[D:].reshape(N, 1, D), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(p.moments["z"].sd, cov[D:, D:].diagonal().sqrt().reshape(N, 1, D), rtol=1e-8, atol=0)
    torch.testing.assert_close(p.moments["theta"].sd, cov[:D, :D].diagonal().sqrt(), rtol=1e-8, atol=0)
    # the LinearGaussianSystem agrees too
    lgs_mom = p.linear_gaussian_system().moments(p.y.reshape(-1))
    for k in ("theta", "z"):
        torch.testing.assert_close(lgs_mom[k].mean, p.moments[k].mean, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(lgs_mom[k].sd, p.moments[k].sd, rtol=1e-8, atol=1e-10)
    # subset of groups
    zm2, zc2 = p.z_posterior(torch.tensor([2, 0]))
    torch.testing.assert_close(zm2, z_mean[[2, 0]])
    torch.testing.assert_close(zc2, z_cov[[2, 0]])


def test_branch_conditionals_against_dense_conditioning(small):
    p = small
    N, _, D = p.x.shape
    S, X = joint_covariance(p.x)
    keep = torch.arange(D, D + N * D)
    K, cov = condition(S, X, p.y.reshape(-1), keep, torch.arange(D))
    mu, A, Sigma = p.branch_conditionals()
    assert mu.shape == (N, D) and A.shape == (N, D, D) and Sigma.shape == (N, D, D)
    theta = torch.randn(D, generator=torch.Generator().manual_seed(3), dtype=f64)
    cond_mean = K @ torch.cat([theta, p.y.reshape(-1)])
    torch.testing.assert_close(mu + (A @ theta), cond_mean.reshape(N, D), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(A, torch.stack([K[i * D : (i + 1) * D, :D] for i in range(N)]), rtol=1e-8, atol=1e-10)
    blocks = cov.reshape(N, D, N, D)
    for i in range(N):
        for k in range(N):
            expected = Sigma[i] if i == k else torch.zeros(D, D, dtype=f64)
            torch.testing.assert_close(blocks[i, :, k], expected, rtol=1e-8, atol=1e-10)


def test_chunking_does_not_change_answers(small):
    q = synthetic_regression(num_groups=4, num_obs=5, dim=3, seed=1, chunk_size=3)
    assert abs(q.log_evidence - small.log_evidence) < 1e-10 * abs(small.log_evidence)
    torch.testing.assert_close(q.moments["z"].sd, small.moments["z"].sd)
    torch.testing.assert_close(q.theta_cov, small.theta_cov)


def test_model_log_joint_matches_independent_density(small):
    p = small
    pyro.set_rng_seed(0)
    tr = pyro.poutine.trace(p.model).get_trace(*p.args, **p.kwargs)
    theta, z = tr.nodes["theta"]["value"], tr.nodes["z"]["value"]
    x, y = p.x, p.y
    expected = (
        Normal(torch.zeros((), dtype=f64), 1.0).log_prob(theta).sum()
        + Normal(theta, 1.0).log_prob(z.squeeze(-2)).sum()
        + Normal(torch.einsum("ijd,id->ij", x, z.squeeze(-2)), 1.0).log_prob(y).sum()
    )
    assert abs(float(tr.log_prob_sum() - expected)) < 1e-10 * abs(float(expected))
    lgs = p.linear_gaussian_system()
    lj = lgs.log_joint(lgs.flatten({"theta": theta, "z": z}), y.reshape(-1))
    assert abs(float(lj - expected)) < 1e-10 * abs(float(expected))


def test_moment_shapes_match_trace(small):
    tr = pyro.poutine.trace(small.model).get_trace(*small.args, **small.kwargs)
    for name, mom in small.moments.items():
        assert mom.mean.shape == tr.nodes[name]["value"].shape, name
        assert mom.sd.shape == tr.nodes[name]["value"].shape, name
        assert torch.all(mom.sd > 0)
    assert tr.nodes["z"]["value"].shape == (4, 1, 3)
    assert tr.nodes["y"]["value"].shape == (4, 5)


def test_subsample(small):
    idx = torch.tensor([3, 0])
    tr = pyro.poutine.trace(small.model).get_trace(*small.args, subsample=idx, **small.kwargs)
    assert tr.nodes["z"]["value"].shape == (2, 1, 3)
    assert tr.nodes["y"]["value"].shape == (2, 5)
    torch.testing.assert_close(tr.nodes["y"]["value"], small.y[idx])
    assert tr.nodes["y"]["scale"] == pytest.approx(2.0)  # N / |idx| = 4 / 2


def test_seed_reproducibility_and_float32():
    a = synthetic_regression(num_groups=3, num_obs=4, dim=2, seed=7)
    b = synthetic_regression(num_groups=3, num_obs=4, dim=2, seed=7)
    c = synthetic_regression(num_groups=3, num_obs=4, dim=2, seed=8)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and a.log_evidence == b.log_evidence
    assert not torch.equal(a.y, c.y)
    f = synthetic_regression(num_groups=3, num_obs=4, dim=2, seed=7, dtype=torch.float32)
    assert f.x.dtype == torch.float32 and f.y.dtype == torch.float32
    torch.testing.assert_close(f.x, a.x.float())
    assert f.moments["theta"].mean.dtype == f64
    assert abs(f.log_evidence - a.log_evidence) < 1e-4 * abs(a.log_evidence)
    tr = pyro.poutine.trace(f.model).get_trace(*f.args, **f.kwargs)
    assert tr.nodes["z"]["value"].dtype == torch.float32
    assert torch.isfinite(tr.log_prob_sum())


def test_posterior_concentrates_on_truth():
    """With many groups the exact posterior of theta is close to the simulating value (a sanity check of the data)."""
    p = synthetic_regression(num_groups=2000, num_obs=20, dim=3, seed=2)
    err = (p.moments["theta"].mean - p.true_theta).abs() / p.moments["theta"].sd
    assert torch.all(err < 5)
    z_err = (p.moments["z"].mean.squeeze(-2) - p.true_z) / p.moments["z"].sd.squeeze(-2)
    assert abs(float(z_err.pow(2).mean()) - 1.0) < 0.1

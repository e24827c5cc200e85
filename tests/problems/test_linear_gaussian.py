import math

import pytest
import torch

from pyro_hier.problems.linear_gaussian import LinearGaussianSystem

f64 = torch.float64


def random_system(L: int = 6, M: int = 9, seed: int = 0, offset: bool = True):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(L, generator=g, dtype=f64)
    W = torch.tril(torch.randn(L, L, generator=g, dtype=f64), diagonal=-1)
    s = 0.5 + torch.rand(L, generator=g, dtype=f64)
    A = torch.randn(M, L, generator=g, dtype=f64)
    r = 0.3 + torch.rand(M, generator=g, dtype=f64)
    o = torch.randn(M, generator=g, dtype=f64) if offset else None
    y = torch.randn(M, generator=g, dtype=f64) * 3
    return c, W, s, A, r, o, y


def prior_by_recursion(c, W, s):
    """Prior mean and covariance by propagating the structural equations one latent at a time."""
    L = c.shape[0]
    m = torch.zeros(L, dtype=f64)
    S = torch.zeros(L, L, dtype=f64)
    for k in range(L):
        m[k] = c[k] + (W[k, :k] * m[:k]).sum()
        cross = S[:k, :k] @ W[k, :k]  # Cov(w_j, w_k), j < k
        S[:k, k] = cross
        S[k, :k] = cross
        S[k, k] = W[k, :k] @ cross + s[k] ** 2
    return m, S


def dense_condition(m, S, A, r, o, y):
    """Posterior of w given y by conditioning the joint Gaussian of (w, y) (covariance form)."""
    Cyy = A @ S @ A.T + torch.diag(r)
    Cwy = S @ A.T
    K = Cwy @ torch.linalg.inv(Cyy)
    mean = m + K @ (y - A @ m - o)
    cov = S - K @ Cwy.T
    return mean, cov, Cyy


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_against_dense_conditioning(seed):
    c, W, s, A, r, o, y = random_system(seed=seed)
    sys = LinearGaussianSystem(c, W, s, A, r, offset=o)
    m0, S0 = prior_by_recursion(c, W, s)
    torch.testing.assert_close(sys.prior_mean, m0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sys.prior_cov, S0, rtol=1e-10, atol=1e-10)
    mean, cov, Cyy = dense_condition(m0, S0, A, r, o, y)
    torch.testing.assert_close(sys.posterior_mean(y), mean, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(sys.posterior_cov(), cov, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(sys.posterior_sd(), cov.diagonal().sqrt(), rtol=1e-8, atol=1e-10)
    ref = torch.distributions.MultivariateNormal(A @ m0 + o, Cyy).log_prob(y)
    assert abs(float(sys.log_evidence(y)) - float(ref)) < 1e-8 * max(1.0, abs(float(ref)))
    assert abs(float(sys.dense_log_evidence(y)) - float(ref)) < 1e-8 * max(1.0, abs(float(ref)))


def test_more_observations_than_latents_and_fewer():
    for L, M in [(3, 40), (12, 2)]:
        c, W, s, A, r, o, y = random_system(L=L, M=M, seed=5)
        sys = LinearGaussianSystem(c, W, s, A, r, offset=o)
        assert abs(float(sys.log_evidence(y) - sys.dense_log_evidence(y))) < 1e-8 * abs(float(sys.log_evidence(y)))


def test_bayes_identity_and_log_joint():
    """log p(y) = log p(w, y) - log p(w | y) for any w; log_joint checked against dense Gaussians."""
    c, W, s, A, r, o, y = random_system(seed=3)
    sys = LinearGaussianSystem(c, W, s, A, r, offset=o)
    m0, S0 = prior_by_recursion(c, W, s)
    w = torch.randn(c.shape[0], generator=torch.Generator().manual_seed(9), dtype=f64)
    MVN = torch.distributions.MultivariateNormal
    lj = MVN(m0, S0).log_prob(w) + MVN(A @ w + o, torch.diag(r)).log_prob(y)
    assert abs(float(sys.log_joint(w, y) - lj)) < 1e-9 * abs(float(lj))
    post = MVN(sys.posterior_mean(y), sys.posterior_cov()).log_prob(w)
    assert abs(float(lj - post - sys.log_evidence(y))) < 1e-8 * abs(float(lj))


def test_sparse_matches_dense():
    c, W, s, A, r, o, y = random_system(L=7, M=15, seed=4)
    A = A * (torch.rand(A.shape, generator=torch.Generator().manual_seed(1), dtype=f64) < 0.4)
    dense = LinearGaussianSystem(c, W, s, A, r, offset=o)
    sparse = LinearGaussianSystem(c, W, s, A.to_sparse(), r, offset=o)
    torch.testing.assert_close(sparse.log_evidence(y), dense.log_evidence(y), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sparse.posterior_mean(y), dense.posterior_mean(y), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sparse.posterior_cov(), dense.posterior_cov(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sparse.dense_log_evidence(y), dense.log_evidence(y), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sparse.log_joint(c, y), dense.log_joint(c, y), rtol=1e-12, atol=1e-12)


def test_float32_inputs_give_float64_answers():
    c, W, s, A, r, o, y = random_system(seed=6)
    sys32 = LinearGaussianSystem(c.float(), W.float(), s.float(), A.float(), r.float(), offset=o.float())
    sys64 = LinearGaussianSystem(*(t.float().double() for t in (c, W, s, A, r)), offset=o.float().double())
    assert sys32.log_evidence(y.float()).dtype == f64
    torch.testing.assert_close(sys32.log_evidence(y.float()), sys64.log_evidence(y.float().double()))


def test_sites_flatten_unflatten_and_moments():
    c, W, s, A, r, o, y = random_system(L=7, M=5, seed=7)
    sys = LinearGaussianSystem(c, W, s, A, r, offset=o, sites={"a": (), "b": (2, 1, 3)})
    parts = sys.unflatten(torch.arange(7, dtype=f64))
    assert parts["a"].shape == () and parts["b"].shape == (2, 1, 3)
    assert float(parts["a"]) == 0.0 and parts["b"][1, 0, 0] == 4.0
    torch.testing.assert_close(sys.flatten(parts), torch.arange(7, dtype=f64))
    mom = sys.moments(y)
    torch.testing.assert_close(mom["b"].mean.reshape(-1), sys.posterior_mean(y)[1:])
    torch.testing.assert_close(mom["a"].sd, sys.posterior_cov()[0, 0].sqrt())


def test_validation():
    c, W, s, A, r, _, y = random_system(seed=8)
    with pytest.raises(ValueError, match="lower triangular"):
        LinearGaussianSystem(c, W + torch.eye(6, dtype=f64), s, A, r)
    with pytest.raises(ValueError, match="shapes"):
        LinearGaussianSystem(c, W, s, A[:, :5], r)
    with pytest.raises(ValueError, match="positive"):
        LinearGaussianSystem(c, W, -s, A, r)
    with pytest.raises(ValueError, match="add up"):
        LinearGaussianSystem(c, W, s, A, r, sites={"a": (5,)})
    sys = LinearGaussianSystem(c, W, s, A, r)
    with pytest.raises(ValueError, match="shape"):
        sys.log_evidence(y[:3])


def test_scalar_case_by_hand():
    """w ~ N(c, s²), y = a w + eps: log p(y) = log N(y; a c, a² s² + r)."""
    c, s, a, r, y = 0.7, 1.3, 2.0, 0.5, 1.1
    sys = LinearGaussianSystem(
        torch.tensor([c], dtype=f64),
        torch.zeros(1, 1, dtype=f64),
        torch.tensor([s], dtype=f64),
        torch.tensor([[a]], dtype=f64),
        torch.tensor([r], dtype=f64),
    )
    v = a * a * s * s + r
    ref = -0.5 * math.log(2 * math.pi * v) - 0.5 * (y - a * c) ** 2 / v
    assert abs(float(sys.log_evidence(torch.tensor([y], dtype=f64))) - ref) < 1e-12
    post_var = 1 / (1 / s**2 + a * a / r)
    assert abs(float(sys.posterior_cov()[0, 0]) - post_var) < 1e-12
    post_mean = post_var * (c / s**2 + a * y / r)
    assert abs(float(sys.posterior_mean(torch.tensor([y], dtype=f64))[0]) - post_mean) < 1e-12

import pyro
import pytest
import torch

from pyro_hier.problems.crossed import crossed_effects

f64 = torch.float64
Normal = torch.distributions.Normal
SCALES = {"scale_mu": 1.2, "scale_row": 0.7, "scale_col": 1.6, "scale_obs": 0.9}
R, C = 4, 3


def joint_cov(mask, scale_mu, scale_row, scale_col, scale_obs):
    """By hand: variables mu, a_r, b_c, then the observed y_rc (row-major); y = mu + a_r + b_c + eps."""
    kind = ["mu"] + ["a"] * R + ["b"] * C
    idx = [0, *range(R), *range(C)]
    cells = [(r, c) for r in range(R) for c in range(C) if mask[r, c]]
    n_lat = len(kind)
    V = n_lat + len(cells)
    cov = torch.zeros(V, V, dtype=f64)

    def loadings(v):  # which latents (kind, index) the variable is made of
        if v < n_lat:
            return {(kind[v], idx[v])}
        r, c = cells[v - n_lat]
        return {("mu", 0), ("a", r), ("b", c)}

    var = {"mu": scale_mu**2, "a": scale_row**2, "b": scale_col**2}
    for u in range(V):
        for v in range(V):
            cov[u, v] = sum(var[k] for k, _ in loadings(u) & loadings(v)) + (scale_obs**2 if u == v >= n_lat else 0)
    return cov, n_lat


@pytest.mark.parametrize("missing_prob", [0.0, 0.3])
def test_log_evidence_and_moments_against_dense(missing_prob):
    p = crossed_effects(R, C, missing_prob=missing_prob, seed=5, **SCALES)
    mask = p.kwargs.get("mask", torch.ones(R, C, dtype=torch.bool))
    if missing_prob > 0:
        assert 0 < (~mask).sum() < R * C
    cov, L = joint_cov(mask, **SCALES)
    y = p.args[0][mask]
    torch.testing.assert_close(p.y_flat, y)
    dense = torch.distributions.MultivariateNormal(torch.zeros(len(y), dtype=f64), cov[L:, L:]).log_prob(y)
    tol = 1e-8 * abs(float(dense))
    assert abs(p.log_evidence - float(dense)) < tol
    assert abs(float(p.system.dense_log_evidence(y)) - float(dense)) < tol
    K = cov[:L, L:] @ torch.linalg.inv(cov[L:, L:])
    mean, pcov = K @ y, cov[:L, :L] - K @ cov[L:, :L]
    sd = pcov.diagonal().sqrt()
    torch.testing.assert_close(p.posterior_cov(), pcov, rtol=1e-8, atol=1e-10)
    for k, sl, shape in (("mu", slice(0, 1), ()), ("a", slice(1, 1 + R), (R, 1)), ("b", slice(1 + R, L), (C,))):
        torch.testing.assert_close(p.moments[k].mean, mean[sl].reshape(shape), rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(p.moments[k].sd, sd[sl].reshape(shape), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("missing_prob", [0.0, 0.3])
def test_model_log_joint(missing_prob):
    p = crossed_effects(R, C, missing_prob=missing_prob, seed=5, **SCALES)
    pyro.set_rng_seed(2)
    tr = pyro.poutine.trace(p.model).get_trace(*p.args, **p.kwargs)
    mu, a, b = (tr.nodes[k]["value"] for k in ("mu", "a", "b"))
    y = p.args[0]
    mask = p.kwargs.get("mask", torch.ones(R, C, dtype=torch.bool))
    s = SCALES
    lik = torch.zeros((), dtype=f64)
    for r in range(R):
        for c in range(C):
            if mask[r, c]:
                lik = lik + Normal(mu + a[r, 0] + b[c], s["scale_obs"]).log_prob(y[r, c])
    expected = (
        Normal(torch.zeros((), dtype=f64), s["scale_mu"]).log_prob(mu)
        + Normal(torch.zeros((), dtype=f64), s["scale_row"]).log_prob(a).sum()
        + Normal(torch.zeros((), dtype=f64), s["scale_col"]).log_prob(b).sum()
        + lik
    )
    assert abs(float(tr.log_prob_sum() - expected)) < 1e-10 * abs(float(expected))
    lj = p.system.log_joint(p.system.flatten({"mu": mu, "a": a, "b": b}), p.y_flat)
    assert abs(float(lj - expected)) < 1e-10 * abs(float(expected))


def test_shapes_and_float32():
    p = crossed_effects(R, C, seed=5, **SCALES)
    assert p.kwargs == {}
    tr = pyro.poutine.trace(p.model).get_trace(*p.args)
    assert tr.nodes["a"]["value"].shape == (R, 1)
    assert tr.nodes["b"]["value"].shape == (C,)
    assert tr.nodes["y"]["value"].shape == (R, C)
    for k, mom in p.moments.items():
        assert mom.mean.shape == mom.sd.shape == tr.nodes[k]["value"].shape
    f = crossed_effects(R, C, missing_prob=0.3, seed=5, dtype=torch.float32, **SCALES)
    assert f.args[0].dtype == torch.float32
    tr = pyro.poutine.trace(f.model).get_trace(*f.args, **f.kwargs)
    assert tr.nodes["a"]["value"].dtype == torch.float32 and torch.isfinite(tr.log_prob_sum())
    q = crossed_effects(R, C, missing_prob=0.3, seed=5, **SCALES)
    assert abs(f.log_evidence - q.log_evidence) < 1e-5 * abs(q.log_evidence)


def test_defaults_and_seed():
    p = crossed_effects()
    assert p.args[0].shape == (8, 6) and p.system.num_latents == 15
    assert not torch.equal(p.args[0], crossed_effects(seed=1).args[0])
    assert torch.equal(p.args[0], crossed_effects().args[0])

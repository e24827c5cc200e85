"""AutoAmortizedBranchGuide: data found in the model, ragged data, constant parameter count, new groups, errors."""

import numpy
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from torch import nn

import pyro_hier.guides.amortized as amortized_module
from pyro_hier import AutoAmortizedBranchGuide, GroupedData, StructureError
from pyro_hier.diagnostics import count_parameters, elbo_estimate
from pyro_hier.problems import synthetic_regression, three_level

SMALL = {"feature_net": (32, 16), "param_net": (64,)}


def features_of(x, y, subsample=None):
    return x


# ---- ragged groups ------------------------------------------------------------------------------------------------
SIZES = [1, 7, 50, 120, 300, 500]
D = 2


def ragged_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    group = torch.cat([torch.full((n,), i) for i, n in enumerate(SIZES)])
    perm = torch.randperm(group.shape[0], generator=g)  # rows in any order
    group = group[perm]
    x = torch.randn(group.shape[0], D, generator=g, dtype=torch.float64)
    z = torch.randn(len(SIZES), D, generator=g, dtype=torch.float64)
    y = (x * z[group]).sum(-1) + torch.randn(group.shape[0], generator=g, dtype=torch.float64)
    return x, y, group


def ragged_model(x, y, group, num_groups, subsample=None):
    theta = pyro.sample("theta", dist.Normal(x.new_zeros(D), 1.0).to_event(1))
    with pyro.plate("groups", num_groups, subsample=subsample, dim=-1):
        z = pyro.sample("z", dist.Normal(theta, 1.0).to_event(1))
    if subsample is None:  # (the ragged rows of a minibatch would be selected here; not needed for this test)
        with pyro.plate("obs", x.shape[0], dim=-1):
            pyro.sample("y", dist.Normal((x * z[..., group, :]).sum(-1), 1.0), obs=y)


def padded(x, y, group):
    n_max = max(SIZES)
    xp = x.new_zeros(len(SIZES), n_max, D)
    yp = y.new_zeros(len(SIZES), n_max)
    mask = torch.zeros(len(SIZES), n_max, dtype=torch.bool)
    for i in range(len(SIZES)):
        rows = (group == i).nonzero().squeeze(-1)
        xp[i, : len(rows)], yp[i, : len(rows)], mask[i, : len(rows)] = x[rows], y[rows], True
    return xp, yp, mask


def padded_model(xp, yp, mask):
    theta = pyro.sample("theta", dist.Normal(xp.new_zeros(D), 1.0).to_event(1))
    with pyro.plate("groups", xp.shape[0], dim=-2):
        z = pyro.sample("z", dist.Normal(theta, 1.0).to_event(1))
        with pyro.plate("obs", xp.shape[1], dim=-1):
            pyro.sample("y", dist.Normal((xp @ z.mT).squeeze(-1), 1.0).mask(mask), obs=yp)


@pytest.mark.parametrize("pool", ["mean", "sum", "max"])
def test_ragged_groups_equal_the_padded_nested_formulation(pool):
    x, y, group = ragged_data()
    xp, yp, mask = padded(x, y, group)
    nested = AutoAmortizedBranchGuide(padded_model, local_features=lambda xp, yp, mask: xp, pool=pool, **SMALL)
    nested(xp, yp, mask)
    with torch.no_grad():  # move every weight away from its init so that the data matter
        for p in nested.parameters():
            p.add_(0.3 * torch.randn_like(p))
    rows = GroupedData(torch.cat([y.unsqueeze(-1), x], -1), group, num_groups=len(SIZES))
    ragged = AutoAmortizedBranchGuide(ragged_model, local_data=rows, pool=pool, **SMALL)
    ragged(x, y, group, len(SIZES))
    ragged.load_state_dict(nested.state_dict())  # same inputs (value, then covariates), same statistics
    q_nested = nested.local_posterior(xp, yp, mask)["groups"]
    q_ragged = ragged.local_posterior(x, y, group, len(SIZES))["groups"]
    for key in ("loc", "weight", "scale_tril"):
        torch.testing.assert_close(q_nested[key].squeeze(1), q_ragged[key])
    # and the groups really differ (the test can fail)
    assert (q_ragged["loc"][0] - q_ragged["loc"][-1]).abs().max() > 1e-3


def test_grouped_data_selects_rows_of_the_minibatch_only():
    x, y, group = ragged_data()
    data = GroupedData(torch.cat([y.unsqueeze(-1), x], -1), group)
    rows, segment = data.select(torch.tensor([4, 0]))
    assert rows.shape[0] == SIZES[4] + SIZES[0]
    torch.testing.assert_close(segment, torch.tensor([0] * SIZES[4] + [1] * SIZES[0]))
    expected = data.features[group == 4]
    torch.testing.assert_close(rows[: SIZES[4]], expected)
    as_float = data.to(torch.float32)  # moved/cast copy, same grouping
    assert as_float.features.dtype == torch.float32 and as_float.num_groups == data.num_groups
    torch.testing.assert_close(as_float.select(torch.tensor([4, 0]))[0], rows.float())
    with pytest.raises(StructureError, match="group index out of range"):
        data.select(torch.tensor([6]))
    with pytest.raises(ValueError, match=r"indices in \[0, 5\] but num_groups=3"):
        GroupedData(data.features, group, num_groups=3)
    with pytest.raises(ValueError, match="integer"):
        GroupedData(data.features, group.double())


# ---- cost and size ----------------------------------------------------------------------------------------------
class Recorder(nn.Module):
    """A feature network that remembers how many rows it saw."""

    def __init__(self, in_features):
        super().__init__()
        self.net = nn.Linear(in_features, 8)
        self.rows = []

    def forward(self, x):
        self.rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return self.net(x)


def test_only_the_minibatch_is_encoded_and_parameters_do_not_grow():
    p = synthetic_regression(num_groups=200, num_obs=5, dim=2, seed=0)
    recorder = Recorder(3)
    guide = AutoAmortizedBranchGuide(p.model, local_features=features_of, feature_net=recorder, param_net=(16,))
    svi = SVI(p.model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    svi.step(*p.args, subsample=torch.arange(10))
    recorder.rows.clear()
    svi.step(*p.args, subsample=torch.tensor([3, 150, 7]))
    assert recorder.rows == [3 * 5]  # three groups of five observations, once per step
    sizes = {}
    for n in (1000, 100_000):
        q = synthetic_regression(num_groups=n, num_obs=2, dim=2, seed=0)
        g = AutoAmortizedBranchGuide(q.model, local_features=features_of)
        g(*q.args, subsample=torch.arange(4))
        sizes[n] = count_parameters(g)
    assert sizes[1000] == sizes[100_000]


def test_new_groups_from_their_data_alone():
    p = synthetic_regression(num_groups=20, num_obs=10, dim=2, seed=0)
    guide = AutoAmortizedBranchGuide(p.model, local_features=features_of, **SMALL)
    guide(*p.args)
    new = synthetic_regression(num_groups=3, num_obs=4, dim=2, seed=5)  # other sizes: no per-group parameters
    q = guide.local_posterior(*new.args)["groups"]
    assert q["loc"].shape == (3, 1, 2) and q["weight"].shape == (3, 1, 2, 2) and q["scale_tril"].shape == (3, 1, 2, 2)
    # the same data give the same q whichever call they come in
    q_all = guide.local_posterior(*p.args)["groups"]
    q_two = guide.local_posterior(p.args[0][[4, 9]], p.args[1][[4, 9]])["groups"]
    torch.testing.assert_close(q_all["loc"][[4, 9]], q_two["loc"])


# ---- errors -------------------------------------------------------------------------------------------------------
def test_bad_local_data_is_a_clear_error():
    x, y, group = ragged_data()
    with pytest.raises(StructureError, match="num_groups=6 but plate 'groups' has 7"):
        rows = GroupedData(torch.cat([y.unsqueeze(-1), x], -1), group)
        AutoAmortizedBranchGuide(ragged_model, local_data=rows)(x, y, group, 7)
    with pytest.raises(StructureError, match="plate 'counties', which the model does not have"):
        AutoAmortizedBranchGuide(ragged_model, local_data={"counties": rows})(x, y, group, len(SIZES))


def test_bad_options():
    p = synthetic_regression(num_groups=3, num_obs=2, dim=2, seed=0)
    with pytest.raises(ValueError, match="pool"):
        AutoAmortizedBranchGuide(p.model, pool="median")
    with pytest.raises(ValueError, match="feature_net"):
        AutoAmortizedBranchGuide(p.model, feature_net=(0, 4))
    with pytest.raises(StructureError, match="param_net maps 9 pooled features to 3 outputs; the level needs"):
        AutoAmortizedBranchGuide(p.model, feature_net=(4,), param_net=nn.Linear(9, 3))(*p.args)
    with pytest.raises(StructureError, match="param_net must take 9 pooled features"):
        AutoAmortizedBranchGuide(p.model, feature_net=(4,), param_net=nn.Linear(8, 3))(*p.args)
    guide = AutoAmortizedBranchGuide(p.model, **SMALL)
    guide(*p.args)
    with pytest.raises(StructureError, match="amortized"):
        guide.set_conditional("groups", loc=torch.zeros(3, 1, 2), scale_tril=torch.eye(2).expand(3, 1, 2, 2))
    with pytest.raises(RuntimeError, match="amortized: its parameters depend on data"):
        guide.conditional("groups")


# ---- fit ----------------------------------------------------------------------------------------------------------
def conditional_kl(q, P, Pv, theta_mean, theta_cov):
    """E_{θ~N(m,S)} KL(N(μ + Aθ, Σ) ‖ N(Pv + Pθ, P)) per group, in closed form (the exact conditional of a group of
    the synthetic regression given θ depends on that group's data only)."""
    mu, A = q["loc"].squeeze(1), q["weight"].squeeze(1)
    L = q["scale_tril"].squeeze(1)
    Sigma = L @ L.mT
    d = mu.shape[-1]
    P_inv = torch.linalg.inv(P)
    B = A - P
    delta = mu - Pv + (B @ theta_mean.unsqueeze(-1)).squeeze(-1)
    quad = (delta.unsqueeze(-2) @ P_inv @ delta.unsqueeze(-1)).squeeze(-1).squeeze(-1)
    trace = (P_inv @ Sigma).diagonal(dim1=-2, dim2=-1).sum(-1) + (B.mT @ P_inv @ B @ theta_cov).diagonal(
        dim1=-2, dim2=-1
    ).sum(-1)
    return 0.5 * (trace + quad - d + torch.logdet(P) - 2 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1))


def test_fit_generalises_to_held_out_groups():
    """Trained on 100 groups, the default (natural-parameter) guide gives groups it never saw a q(z | θ) close to the
    exact conditional: the issue's target is a mean KL below 0.1 nats (measured 0.016 after 300 full-batch steps;
    untrained ~40)."""
    N, n, D = 100, 20, 2
    full = synthetic_regression(num_groups=N + 50, num_obs=n, dim=D, seed=0)
    train_args = (full.args[0][:N], full.args[1][:N])
    held_out = (full.args[0][N:], full.args[1][N:])
    P, Pv = full.P[N:], full.Pv[N:]
    untrained = fit_natural(full, train_args, steps=0, lr=0.05, final=0.1)
    theta = untrained.level_moments(*train_args)["globals"]
    before = conditional_kl(untrained.local_posterior(*held_out)["groups"], P, Pv, *theta).mean()
    guide = fit_natural(full, train_args, steps=300, lr=0.05, final=0.1)
    theta = guide.level_moments(*train_args)["globals"]
    kl = conditional_kl(guide.local_posterior(*held_out)["groups"], P, Pv, *theta)
    assert before > 10
    assert kl.mean() < 0.1, kl.mean()


def test_paper_form_learns():
    """The paper's form (feature pooling and a parameter network) on the same problem: slower (measured: held-out KL
    0.46 after 2,000 minibatch steps, 0.26 after 6,000), checked here only to improve on the untrained networks."""
    N, n, D = 100, 20, 2
    full = synthetic_regression(num_groups=N + 50, num_obs=n, dim=D, seed=0)
    train_args = (full.args[0][:N], full.args[1][:N])
    held_out = (full.args[0][N:], full.args[1][N:])
    pyro.set_rng_seed(0)
    guide = AutoAmortizedBranchGuide(full.model, local_features=features_of, feature_net=(32, 32), param_net=(64, 64))
    assert guide.form == "paper"
    guide(*train_args)
    kls = []
    for steps in (0, 150):
        svi = SVI(full.model, guide, pyro.optim.Adam({"lr": 3e-3}), Trace_ELBO())
        for _ in range(steps):
            svi.step(*train_args)
        theta = guide.level_moments(*train_args)["globals"]
        kls.append(conditional_kl(guide.local_posterior(*held_out)["groups"], full.P[N:], full.Pv[N:], *theta).mean())
    assert kls[0] > 10 and kls[1] < 0.5 * kls[0], kls


# ---- form="natural": per-observation Gaussian potentials, summed ---------------------------------------------------
def exact_linear_part(guide, dim):
    """Weights of the natural form's linear observation map that give L_j = x_j (rank column 0), t_j = y_j, from the
    standardised features [y, x]: the exact conditional of the synthetic regression."""
    norm, lin = guide.nets["groups"]["observations"]["0"]
    r = guide._rank(guide._levels["groups"])
    weight = torch.zeros_like(lin.linear.weight)
    bias = torch.zeros_like(lin.linear.bias)
    for k in range(dim):  # factor entry (k, column 0) sits at output k * r
        weight[k * r, 1 + k], bias[k * r] = norm.scale[1 + k], norm.mean[1 + k]
    weight[dim * r, 0], bias[dim * r] = norm.scale[0], norm.mean[0]  # t_j column 0
    return weight, bias


@pytest.mark.parametrize("conditional", ["conjugate", "linear"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_natural_form_contains_the_exact_conditional(dtype, conditional):
    """A linear observation map L_j = x_j, t_j = y_j gives p(z_i | θ, y) exactly: with the model's prior conditional
    (conjugate), or with Λ₀ = I (init_scale=1), m₀ = 0, B = I (linear)."""
    p = synthetic_regression(num_groups=6, num_obs=9, dim=3, seed=1, dtype=dtype)
    guide = AutoAmortizedBranchGuide(
        p.model,
        local_features=features_of,
        observation_net=(),
        init_scale=1.0,
        conditional=conditional,
        expansion=False,
    )
    assert guide.form == "natural"
    guide(*p.args)
    with torch.no_grad():
        weight, bias = exact_linear_part(guide, 3)
        guide.nets["groups"]["observations"]["0"][1].linear.weight.copy_(weight)
        guide.nets["groups"]["observations"]["0"][1].linear.bias.copy_(bias)
        if conditional == "linear":
            guide.natural.groups_coupling.copy_(torch.eye(3))
    q = guide.local_posterior(*p.args)["groups"]
    mu, A, Sigma = p.branch_conditionals()
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
    torch.testing.assert_close(q["loc"].squeeze(1).double(), mu, **tol)
    torch.testing.assert_close(q["weight"].squeeze(1).double(), A, **tol)
    torch.testing.assert_close((q["scale_tril"] @ q["scale_tril"].mT).squeeze(1).double(), Sigma, **tol)
    # ... and the untrained guide is far from it (the check can fail); a fresh param store, or the new guide of the
    # same class would adopt the first one's parameters, as PyroParams do
    pyro.clear_param_store()
    fresh = AutoAmortizedBranchGuide(p.model, local_features=features_of, observation_net=(), expansion=False)
    fresh(*p.args)
    assert (fresh.local_posterior(*p.args)["groups"]["loc"].squeeze(1).double() - mu).abs().max() > 0.1


def nested_and_ragged_guides(opts: dict) -> tuple:
    """The natural form on the padded nested model and on ragged rows, the same (perturbed) parameters in both:
    ``(ragged data, padded data, nested guide, ragged guide)``."""
    x, y, group = ragged_data()
    xp, yp, mask = padded(x, y, group)
    nested = AutoAmortizedBranchGuide(padded_model, local_features=lambda xp, yp, mask: xp, **opts)
    nested(xp, yp, mask)
    with torch.no_grad():
        for p in nested.parameters():
            p.add_(0.3 * torch.randn_like(p))
    rows = GroupedData(torch.cat([y.unsqueeze(-1), x], -1), group, num_groups=len(SIZES))
    ragged = AutoAmortizedBranchGuide(ragged_model, local_data=rows, **opts)
    ragged(x, y, group, len(SIZES))
    ragged.load_state_dict(nested.state_dict())
    return (x, y, group), (xp, yp, mask), nested, ragged


@pytest.mark.parametrize("covariance", ["dense", "block", "diagonal"])
def test_natural_form_ragged_groups_equal_the_padded_nested_formulation(covariance):
    opts = {"covariance": covariance, "observation_net": (8,), "rank": 2, "init_scale": 1.0}  # Λ₀ ≈ I
    (x, y, group), (xp, yp, mask), nested, ragged = nested_and_ragged_guides(opts)
    q_nested = nested.local_posterior(xp, yp, mask)["groups"]
    q_ragged = ragged.local_posterior(x, y, group, len(SIZES))["groups"]
    for key in ("loc", "weight", "scale_tril"):
        if q_ragged[key] is None:
            assert covariance != "dense" and q_nested[key] is None
            continue
        torch.testing.assert_close(q_nested[key].squeeze(1), q_ragged[key])
    assert (q_ragged["loc"][0] - q_ragged["loc"][-1]).abs().max() > 1e-3
    # the precision grows with the group's size (sum pooling): the 500-row group is far tighter than the 1-row one
    sd = q_ragged["scale_tril"].diagonal(dim1=-2, dim2=-1)
    assert (sd[-1] < 0.2 * sd[0]).all()


def test_natural_form_options():
    p = synthetic_regression(num_groups=3, num_obs=2, dim=2, seed=0)
    with pytest.raises(ValueError, match="pool belong"):
        AutoAmortizedBranchGuide(p.model, form="natural", pool="sum")
    with pytest.raises(ValueError, match="rank belong"):
        AutoAmortizedBranchGuide(p.model, form="paper", rank=2)
    with pytest.raises(ValueError, match="form must be one of"):
        AutoAmortizedBranchGuide(p.model, form="conjugate")
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        AutoAmortizedBranchGuide(p.model, rank=0)
    with pytest.raises(StructureError, match="observation_net maps 3 features to 5 outputs; the level needs 6"):
        AutoAmortizedBranchGuide(p.model, local_features=features_of, rank=2, observation_net=nn.Linear(3, 5))(*p.args)
    assert AutoAmortizedBranchGuide(p.model, feature_net=(4,)).form == "paper"  # the paper's options select it
    guide = AutoAmortizedBranchGuide(p.model, local_features=features_of, observation_net=nn.Linear(3, 6), rank=2)
    guide(*p.args)
    assert guide.median(*p.args)["z"].shape == (3, 1, 2)


def fit_natural(p, args, steps, lr, final=0.01, batch=None, seed=0, particles=1):
    """The natural form's networks (linear observation map; the model's prior conditional, without its likelihood's
    expansion) with sticking the landing, ClippedAdam decaying to lr · final."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoAmortizedBranchGuide(
        p.model, local_features=features_of, observation_net=(), stick_the_landing=True, expansion=False
    )
    guide(*args)
    optim = pyro.optim.ClippedAdam({"lr": lr, "lrd": final ** (1 / max(steps, 1)), "clip_norm": 1e9})
    svi = SVI(
        p.model,
        guide,
        optim,
        Trace_ELBO(num_particles=particles, vectorize_particles=particles > 1, max_plate_nesting=2),
    )
    generator = torch.Generator().manual_seed(seed)
    num = args[0].shape[0]
    for _ in range(steps):
        svi.step(*args, subsample=None if batch is None else torch.randperm(num, generator=generator)[:batch])
    return guide


def test_natural_form_elbo_within_one_nat_of_the_exact_evidence():
    """N = 10 groups (20 observations, D = 2), full batch: the issue's target is the ELBO within 1 nat of log p(y)
    (measured 0.32 ± 0.02 after 600 steps). At the paper's size (D = 10, 100 observations) the benchmark measures
    0.47 nats after 120 s (benchmarks/README.md, run 5)."""
    p = synthetic_regression(num_groups=10, num_obs=20, dim=2, seed=0)
    guide = fit_natural(p, p.args, steps=500, lr=0.05, final=0.1)
    elbo, se = elbo_estimate(p.model, guide, p.args, num_particles=1000, max_plate_nesting=2)
    assert se < 0.05
    assert p.log_evidence - elbo < 1.0, (p.log_evidence - elbo, se)


def test_natural_form_thousand_groups_within_five_hundredths_of_a_nat_per_group():
    """N = 1,000 groups (20 observations, D = 2), minibatches of 100 groups: the issue's target is 0.05 nats/group
    (measured 0.0055 ± 0.0003 after 1,200 steps; the paper's size D = 10, n = 100 is in benchmarks/README.md)."""
    p = synthetic_regression(num_groups=1000, num_obs=20, dim=2, seed=0)
    guide = fit_natural(p, p.args, steps=1000, lr=0.03, final=0.1, batch=100)
    elbo, se = elbo_estimate(p.model, guide, p.args, num_particles=100, max_plate_nesting=2)
    gap = (p.log_evidence - elbo) / 1000
    assert se / 1000 < 0.002
    assert gap < 0.05, (gap, se / 1000)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_default_conditional_is_exact_before_training_for_a_gaussian_likelihood(dtype):
    """The default: the model's prior conditional at the globals' draw times the model's own expansion of the group's
    likelihood, which is the likelihood itself when it is Gaussian: p(z_i | θ, y) with no training and no
    covariates given (the expansion reads them from the model)."""
    p = synthetic_regression(num_groups=6, num_obs=9, dim=3, seed=1, dtype=dtype)
    guide = AutoAmortizedBranchGuide(p.model)
    assert guide.form == "natural" and guide.conditional_form == "conjugate"
    guide(*p.args)
    assert guide.prior_levels == ("groups",) and guide.expanded_levels == ("groups",)
    assert guide.network_levels == ()  # the model's expansion alone: no parameter for the groups
    q = guide.local_posterior(*p.args)["groups"]
    mu, A, Sigma = p.branch_conditionals()
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
    torch.testing.assert_close(q["loc"].squeeze(1).double(), mu, **tol)
    torch.testing.assert_close(q["weight"].squeeze(1).double(), A, **tol)
    torch.testing.assert_close((q["scale_tril"] @ q["scale_tril"].mT).squeeze(1).double(), Sigma, **tol)
    assert guide.median(*p.args)["z"].shape == (6, 1, 3)
    with pytest.raises(ValueError, match="conjugate conditional"):
        guide.conditional("groups")
    with pytest.raises(ValueError, match="conditional='conjugate' belongs to form='natural'"):
        AutoAmortizedBranchGuide(p.model, form="paper", conditional="conjugate")
    with pytest.raises(ValueError, match="expansion must be True or False"):
        AutoAmortizedBranchGuide(p.model, expansion=None)


@pytest.mark.parametrize("gathered", [False, True], ids=["nested", "gathered"])
def test_a_level_with_levels_below_is_expanded_with_its_children_integrated_out(gathered):
    """Three levels, mu -> a_r -> b_rg -> y_rgj, Gaussian: the regions' conditional before any training is the exact
    p(a_r | mu, y), whose likelihood is the groups' marginal prod_g N(ybar_rg; a_r, s2² + σ²/n) — not the groups held
    at a value (that would count them as observed: precision G/s2² instead of G/(s2² + σ²/n))."""
    R, G, n, s1, s2, sigma = 3, 4, 5, 1.0, 0.5, 1.0
    p = three_level(num_regions=R, num_groups=G, num_obs=n, dtype=torch.float64, gathered=gathered)
    guide = AutoAmortizedBranchGuide(p.model)
    guide(*p.args, **p.kwargs)
    assert set(guide.expanded_levels) == set(guide.prior_levels) and len(guide.expanded_levels) == 2
    assert guide.network_levels == ()
    mu = torch.tensor([0.7], dtype=torch.float64)
    with torch.no_grad():
        trace = poutine.trace(
            poutine.condition(guide, {"_AutoAmortizedBranchGuide_globals_unconstrained": mu})
        ).get_trace(*p.args, **p.kwargs)
    region = next(s for k, s in trace.nodes.items() if k.endswith("_unconstrained") and s["value"].numel() == R)
    y = three_level(num_regions=R, num_groups=G, num_obs=n, dtype=torch.float64).args[0]  # (R, G, n), same draw
    message = 1.0 / (s2**2 + sigma**2 / n)
    var = 1.0 / (1.0 / s1**2 + G * message)
    mean = var * (mu / s1**2 + message * y.mean(-1).sum(-1))
    torch.testing.assert_close(region["fn"].mean.reshape(R), mean)
    torch.testing.assert_close(region["fn"].variance.reshape(R), torch.full((R,), var, dtype=torch.float64))


def two_observed_sites_model(y1, y2):
    with pyro.plate("groups", y1.shape[0], dim=-2):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        with pyro.plate("obs", y1.shape[1], dim=-1):
            pyro.sample("y1", dist.Normal(z, 1.0), obs=y1)
            pyro.sample("y2", dist.Normal(z, 1.0), obs=y2)


@pytest.mark.parametrize("option", ["observation_net", "feature_net"])
def test_a_network_module_for_several_data_sources_is_a_clear_error(option):
    """A user's module has one input size, so it cannot encode two observed sites: the error names the option."""
    y1, y2 = torch.randn(4, 3), torch.randn(4, 3)
    guide = AutoAmortizedBranchGuide(two_observed_sites_model, **{option: nn.Linear(1, 4)})
    with pytest.raises(StructureError, match=f"{option} can serve a single data source"):
        guide(y1, y2)


@pytest.mark.parametrize("covariance", ["dense", "block", "diagonal"])
def test_linear_observation_map_sums_from_second_moments_equal_the_per_row_sums(covariance, monkeypatch):
    # observation_net=() computes Σ_j L_j L_jᵀ and Σ_j L_j t_j from each group's second moments of its rows; the
    # per-row formula (the path of every other observation network) must give the same conditionals, for masked
    # nested rows and for ragged rows
    from pyro_hier.guides import amortized

    opts = {"covariance": covariance, "observation_net": (), "rank": 2}
    (x, y, group), (xp, yp, mask), nested, ragged = nested_and_ragged_guides(opts)
    fast = [nested.local_posterior(xp, yp, mask)["groups"], ragged.local_posterior(x, y, group, len(SIZES))["groups"]]
    monkeypatch.setattr(amortized, "_affine_map", lambda net: None)
    slow = [nested.local_posterior(xp, yp, mask)["groups"], ragged.local_posterior(x, y, group, len(SIZES))["groups"]]
    for q_fast, q_slow in zip(fast, slow):
        for key in ("loc", "weight", "scale_tril"):
            if q_slow[key] is not None:
                torch.testing.assert_close(q_fast[key], q_slow[key])


def random_minibatch_model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("groups", y.shape[0], subsample_size=3, dim=-2) as idx:
        z = pyro.sample("z", dist.Normal(mu, 1.0))
        with pyro.plate("obs", y.shape[1], dim=-1):
            pyro.sample("y", dist.Normal(z, 1.0), obs=y[idx])


def test_the_models_inspection_is_reused_only_for_the_same_unmodified_arguments():
    """The guide reads the model's plates (and its data) once per call; the same argument objects again reuse that
    run, but not when Pyro draws the subsample at random, nor after the data changed in place."""
    y = torch.randn(8, 4)
    guide = AutoAmortizedBranchGuide(random_minibatch_model)
    seen = set()
    for _ in range(6):
        seen.add(tuple(poutine.trace(guide).get_trace(y).nodes["groups"]["value"].tolist()))
    assert len(seen) > 1  # the random subsample is read anew on every call
    pyro.clear_param_store()
    p = synthetic_regression(num_groups=5, num_obs=6, dim=2, seed=0)
    guide = AutoAmortizedBranchGuide(p.model)
    with torch.no_grad():
        before = guide.median(*p.args)["z"]
        p.args[1].add_(3.0)  # the responses moved in place: a new model run, a new expansion
        after = guide.median(*p.args)["z"]
    assert (after - before).abs().max() > 0.5  # (a stale inspection gives the same median to the last digit)


@pytest.mark.parametrize(
    "newton_steps, smoothed_steps",
    [(0, 0), (amortized_module.EXPANSION_NEWTON_STEPS, 0), (amortized_module.EXPANSION_NEWTON_STEPS, None)],
)
def test_a_bernoulli_likelihood_is_expanded_at_the_gaussian_optimum(newton_steps, smoothed_steps, monkeypatch):
    """Users' Bernoulli ratings (the MovieLens model): the expansion starts at the mode of each user's conditional
    posterior at the globals' mean (Newton steps from the prior's mean; with none it is one step short, and the
    gradient of log p(z_i | θ̄) + log p(y_i | z_i) at q's mean does not vanish), then takes the fixed-point steps of
    smoothed_pseudo_observation (the default), after which q's conditional at θ̄ is the Gaussian optimum of the ELBO:
    the gradient *averaged over q* vanishes (checked by Monte Carlo, 2·10⁴ draws), where at the mode (Laplace) it is
    several times its Monte Carlo error."""
    from pyro_hier.problems.movielens import movielens_model

    monkeypatch.setattr(amortized_module, "EXPANSION_NEWTON_STEPS", newton_steps)
    if smoothed_steps is not None:
        monkeypatch.setattr(amortized_module, "EXPANSION_SMOOTHED_STEPS", smoothed_steps)
    g = torch.Generator().manual_seed(0)
    sizes = [40, 80, 5, 120]
    user = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    x = torch.cat([torch.ones(user.shape[0], 1), (torch.rand(user.shape[0], 2, generator=g) < 0.4).double()], -1)
    y = torch.bernoulli(
        torch.sigmoid((x * (2 * torch.randn(len(sizes), 3, generator=g, dtype=torch.float64))[user]).sum(-1)),
        generator=g,
    )
    args = (user, x, len(sizes))
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoAmortizedBranchGuide(movielens_model)
    guide(*args, rating=y)
    q = guide.local_posterior(*args, rating=y)["users"]
    glob = guide.median(*args, rating=y)
    theta = torch.cat([glob["mu"], torch.log(glob["sigma"])])
    mean = (q["loc"] + (q["weight"] @ theta)).detach()

    def gradient(z: torch.Tensor) -> torch.Tensor:  # of log p(z_i | θ̄) + log p(y_i | z_i), draws z (..., users, 3)
        z = z.detach().requires_grad_(True)
        log_p = dist.Normal(glob["mu"], glob["sigma"]).log_prob(z).sum()
        log_p = log_p + dist.Bernoulli(logits=(x * z[..., user, :]).sum(-1)).log_prob(y).sum()
        return torch.autograd.grad(log_p, z)[0]

    at_mean = gradient(mean)
    draws = mean + (q["scale_tril"] @ torch.randn(20_000, *mean.shape, 1, generator=g, dtype=mean.dtype)).squeeze(-1)
    grads = gradient(draws)
    averaged, error = grads.mean(0), grads.std(0) / 20_000**0.5
    if smoothed_steps is None:  # the Gaussian optimum: E_q[gradient] = 0 (to the Monte Carlo error)
        assert float((averaged.abs() / error).max()) < 4.0, (averaged, error)
        assert float(at_mean.abs().max()) > 1e-2  # (q's mean is not the mode)
    else:
        assert (float(at_mean.abs().max()) < 1e-3) == (newton_steps > 0), at_mean
        assert float((averaged.abs() / error).max()) > 6.0, (averaged, error)


def test_crossed_levels_are_expanded_at_each_others_modes():
    """Students and questions crossed in a flat plate of answers, ``y ~ N(a[s] − b[q], 1)``: each level's expansion
    reads the other level's centre, which must be its conditional mode, not its prior mean (IRT of
    benchmarks/unseen.py: the questions' difficulties 0.9 sd off that way). Gauss–Seidel sweeps over the two levels
    to their fixed point give q the exact posterior means given the global (0.39 off before, when each was expanded
    at the other's prior mean)."""
    S, Q = 6, 4
    g = torch.Generator().manual_seed(0)
    student, question = torch.arange(S).repeat_interleave(Q), torch.arange(Q).repeat(S)
    y = torch.randn(S * Q, generator=g, dtype=torch.float64) + 0.5 * torch.arange(S, dtype=torch.float64)[student]

    def model(student, question, y):
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
        with pyro.plate("students", S):
            a = pyro.sample("a", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
        with pyro.plate("questions", Q):
            b = pyro.sample("b", dist.Normal(mu, 1.0))
        with pyro.plate("answers", S * Q):
            pyro.sample("y", dist.Normal(a[..., student] - b[..., question], 1.0), obs=y)

    design = torch.zeros(S * Q, S + Q, dtype=torch.float64)
    design[torch.arange(S * Q), student], design[torch.arange(S * Q), S + question] = 1.0, -1.0
    exact = torch.linalg.solve(torch.eye(S + Q, dtype=torch.float64) + design.T @ design, design.T @ y)  # at mu = 0
    pyro.clear_param_store()
    guide = AutoAmortizedBranchGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.0}), Trace_ELBO())
    svi.step(student, question, y)  # (the expansions' Gauss–Seidel sweeps run to their fixed point on the first call)
    at_zero = {"_AutoAmortizedBranchGuide_globals_unconstrained": torch.zeros(1, dtype=torch.float64)}
    with torch.no_grad():
        trace = poutine.trace(poutine.condition(guide, at_zero)).get_trace(student, question, y)
    locs = [
        trace.nodes[f"_AutoAmortizedBranchGuide_{n}_unconstrained"]["fn"].mean.reshape(-1)
        for n in ("students", "questions")
    ]
    torch.testing.assert_close(torch.cat(locs), exact, atol=1e-6, rtol=0)


def test_a_redo_continues_the_fixed_point_from_the_last_pseudo_observation(monkeypatch):
    """A redo of a Bernoulli level's expansion starts from the pseudo-observation the last redo left (no Newton step,
    no Hessian-vector product: 2d gradients of the model) and continues the fixed-point iteration: redone three times
    at the same globals, q's conditional at θ̄ is the Gaussian optimum, E_q[gradient] = 0 within its Monte Carlo error
    (2·10⁴ draws; 2.19 → 2.06 of it, the first expansion being Laplace and one step)."""
    import pyro_hier.guides.branch as branch_module
    from pyro_hier.problems.movielens import movielens_model

    g = torch.Generator().manual_seed(0)
    sizes = [40, 80, 5, 120]
    user = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    x = torch.cat([torch.ones(user.shape[0], 1), (torch.rand(user.shape[0], 2, generator=g) < 0.4).double()], -1)
    z_true = 2 * torch.randn(len(sizes), 3, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid((x * z_true[user]).sum(-1)), generator=g)
    args = (user, x, len(sizes))
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoAmortizedBranchGuide(movielens_model)
    curvatures = []
    expansion = branch_module.element_expansion
    monkeypatch.setattr(
        branch_module,
        "element_expansion",
        lambda *a, **k: curvatures.append(k.get("curvature", True)) or expansion(*a, **k),
    )
    errors = []
    for redo in range(4):
        curvatures.clear()
        guide._expansion_cache = None
        guide(*args, rating=y)
        assert (True in curvatures) == (redo == 0)
        if redo in (0, 3):  # q at θ̄ from the pseudo-observation the training call made (summaries redo from the mode)
            info, natural = (t.clone() for t in guide._expansion_potentials["users"])
            glob = guide.median(*args, rating=y)
            p0 = glob["sigma"].pow(-2)
            precision = info + torch.diag_embed(p0.expand(natural.shape))
            mean = torch.linalg.solve(precision, (p0 * glob["mu"] + natural).unsqueeze(-1)).squeeze(-1)
            scale_tril = torch.linalg.cholesky(torch.linalg.inv(precision))
            noise = torch.randn(20_000, *mean.shape, 1, generator=torch.Generator().manual_seed(1), dtype=mean.dtype)
            z = (mean + (scale_tril @ noise).squeeze(-1)).requires_grad_(True)
            log_p = dist.Normal(glob["mu"], glob["sigma"]).log_prob(z).sum()
            log_p = log_p + dist.Bernoulli(logits=(x * z[..., user, :]).sum(-1)).log_prob(y).sum()
            grads = torch.autograd.grad(log_p, z)[0]
            errors.append(float((grads.mean(0).abs() / (grads.std(0) / 20_000**0.5)).max()))
    assert errors[1] < 3.0 and errors[1] < errors[0], errors


def test_a_dense_expanded_level_is_drawn_by_perturbation_with_the_same_q_and_gradients(monkeypatch):
    """MovieLens's users (a dense level whose pseudo-observation is the model's expansion alone) are drawn by
    perturbation (ConjugateNormal, scored by ConjugateScorer): the same q as gaussian_update's, and the same log
    density and gradients in the globals' parameters at a value, as the Cholesky path it replaces."""
    from pyro_hier.distributions import HeldConjugateNormal
    from pyro_hier.problems.movielens import movielens_model

    g = torch.Generator().manual_seed(1)
    sizes = [30, 60, 4]
    user = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    x = torch.cat([torch.ones(user.shape[0], 1), (torch.rand(user.shape[0], 2, generator=g) < 0.5).double()], -1)
    y = torch.bernoulli(torch.full((user.shape[0],), 0.6, dtype=torch.float64), generator=g)
    args, kwargs = (user, x, len(sizes)), {"rating": y}
    pyro.clear_param_store()
    guide = AutoAmortizedBranchGuide(movielens_model)
    guide(*args, **kwargs)
    with torch.no_grad():  # globals away from their initial values, so that the prior differs per coordinate
        for p in guide.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))

    def site(perturbed: bool):
        monkeypatch.setattr(AutoAmortizedBranchGuide, "_perturbed", lambda self, level, prior: perturbed)
        pyro.set_rng_seed(3)
        return (
            poutine.trace(guide).get_trace(*args, **kwargs).nodes["_AutoAmortizedBranchGuide_users_unconstrained"]["fn"]
        )

    new, old = site(True), site(False)
    assert isinstance(new.sampler, HeldConjugateNormal)
    assert torch.allclose(new.sampler.loc, old.mean, atol=1e-10)
    assert torch.allclose(new.sampler.covariance_matrix, old.covariance_matrix, atol=1e-10)
    value = old.mean.detach() + 0.4 * torch.randn(old.mean.shape, generator=g, dtype=torch.float64)
    params = [p for p in guide.parameters() if p.requires_grad]
    grads = []
    for fn in (new, old):
        log_q = fn.log_prob(value).sum()
        grads.append((log_q, torch.autograd.grad(log_q, params, allow_unused=True)))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-9)
    pairs = [(a, b) for a, b in zip(grads[0][1], grads[1][1], strict=True) if b is not None]
    assert pairs and all(a is not None and torch.allclose(a, b, atol=1e-8) for a, b in pairs)
    assert max(float(b.abs().max()) for _, b in pairs) > 1e-2  # (the density does depend on the globals)


def test_crossed_bernoulli_levels_give_the_same_medians_after_a_pickle_round_trip():
    """Crossed students and questions with Bernoulli answers take one Gauss–Seidel sweep a training redo, from their
    last modes (a cache of this process); summaries sweep to the fixed point, so a loaded guide, without that cache,
    gives the same medians (0.03 apart with one sweep in summaries too)."""
    import io

    g = torch.Generator().manual_seed(0)
    S, Q = 12, 5
    student = torch.arange(S).repeat_interleave(4)
    question = torch.randint(0, Q, (len(student),), generator=g)
    y = torch.bernoulli(torch.full((len(student),), 0.6, dtype=torch.float64), generator=g)

    def model(student, question, y=None):
        sa = pyro.sample("sigma_a", dist.HalfNormal(torch.ones((), dtype=torch.float64)))
        with pyro.plate("students", S):
            a = pyro.sample("ability", dist.Normal(torch.zeros((), dtype=torch.float64), sa))
        with pyro.plate("questions", Q):
            b = pyro.sample("difficulty", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
        with pyro.plate("answers", len(student)):
            pyro.sample("y", dist.Bernoulli(logits=a[..., student] - b[..., question]), obs=y)

    guide = AutoAmortizedBranchGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(25):
        svi.step(student, question, y)
    buffer = io.BytesIO()
    torch.save(guide, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded.attach_model(model)  # (a closure does not travel)
    medians = []
    for each in (guide, loaded):
        pyro.set_rng_seed(1)
        medians.append(each.median(student, question, y))
    for name in ("ability", "difficulty"):
        torch.testing.assert_close(medians[1][name], medians[0][name], atol=1e-4, rtol=0)


def test_crossed_bernoulli_levels_reach_the_optimum_of_the_factorised_gaussian_elbo():
    """Crossed students and questions with Bernoulli answers, the global held at 0: q(a)q(b) of the guide's
    expansions is the optimum of the ELBO over independent Gaussians for each element, found here by L-BFGS on that
    ELBO computed by 40-point Gauss–Hermite quadrature (each answer reads ``a_s − b_q``, Gaussian under q). Each
    level's pseudo-observation is the model's expansion averaged over q of the other level as well as its own
    (``_crossed_smoothing``), by a degree-3 rule whose own error is 0.027 sd here; at the other's modes instead q's
    means were 0.27 sd off the optimum and its sds 11% off."""
    S, Q = 10, 4
    g = torch.Generator().manual_seed(2)
    student = torch.arange(S).repeat_interleave(3)
    question = torch.stack([torch.randperm(Q, generator=g)[:3] for _ in range(S)]).reshape(-1)
    y = torch.bernoulli(torch.full((len(student),), 0.55, dtype=torch.float64), generator=g)
    prior_sd = 2.0

    def model(student, question, y):
        mu = pyro.sample("mu", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
        with pyro.plate("students", S):
            a = pyro.sample("a", dist.Normal(torch.zeros((), dtype=torch.float64), prior_sd))
        with pyro.plate("questions", Q):
            b = pyro.sample("b", dist.Normal(mu, prior_sd))
        with pyro.plate("answers", len(student)):
            pyro.sample("y", dist.Bernoulli(logits=a[..., student] - b[..., question]), obs=y)

    nodes, weights = numpy.polynomial.hermite_e.hermegauss(40)
    nodes, weights = torch.tensor(nodes), torch.tensor(weights / weights.sum())
    m = torch.zeros(S + Q, dtype=torch.float64, requires_grad=True)
    log_s = torch.zeros(S + Q, dtype=torch.float64, requires_grad=True)

    def negative_elbo() -> torch.Tensor:
        s = log_s.exp()
        mean = m[student] - m[S + question]
        sd = (s[student].pow(2) + s[S + question].pow(2)).sqrt()
        logits = mean.unsqueeze(-1) + sd.unsqueeze(-1) * nodes
        expected = (dist.Bernoulli(logits=logits).log_prob(y.unsqueeze(-1)) * weights).sum(-1).sum()
        prior = (-(m.pow(2) + s.pow(2)) / (2 * prior_sd**2)).sum()
        return -(expected + prior + log_s.sum())

    lbfgs = torch.optim.LBFGS([m, log_s], max_iter=500, tolerance_grad=1e-12, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = negative_elbo()
        loss.backward()
        return loss

    lbfgs.step(closure)
    pyro.clear_param_store()
    guide = AutoAmortizedBranchGuide(model)
    guide(student, question, y)
    at_zero = {"_AutoAmortizedBranchGuide_globals_unconstrained": torch.zeros(1, dtype=torch.float64)}
    with torch.no_grad():
        trace = poutine.trace(poutine.condition(guide, at_zero)).get_trace(student, question, y)
    fns = [trace.nodes[f"_AutoAmortizedBranchGuide_{n}_unconstrained"]["fn"] for n in ("students", "questions")]
    loc = torch.cat([fn.mean.reshape(-1) for fn in fns])
    sd = torch.cat([fn.stddev.reshape(-1) for fn in fns])
    exact_sd = log_s.detach().exp()
    errors = (float(((loc - m.detach()).abs() / exact_sd).max()), float((sd / exact_sd - 1).abs().max()))
    assert max(errors) < 0.05, errors  # (the cubature rule's own error: 0.027 here; 0.27 at the other's modes)


def test_an_expansion_moves_with_the_globals_from_where_it_was_read():
    """Between redos the globals' q moves (Adam steps); each draw moves a Poisson level's expansion along its slopes
    from the globals' mean it was *read* at, so q(u | θ) at a given draw θ does not change when q's mean moves.
    Measured from q's current mean instead, the groups did not follow a move of the intercept, and the ELBO pinned
    the globals near their last redo: epil (Poisson subjects, intercept 1.8) ended 15 sd off (0.15 now)."""
    g = torch.Generator().manual_seed(0)
    group = torch.arange(5).repeat_interleave(4)
    y = torch.poisson(torch.full((20,), 6.0, dtype=torch.float64), generator=g)

    def model(group, y):
        beta = pyro.sample("beta", dist.Normal(torch.zeros((), dtype=torch.float64), 5.0))
        with pyro.plate("groups", 5):
            u = pyro.sample("u", dist.Normal(torch.zeros((), dtype=torch.float64), 1.0))
        with pyro.plate("obs", 20):
            pyro.sample("y", dist.Poisson((beta + u[..., group]).exp()), obs=y)

    pyro.clear_param_store()
    guide = AutoAmortizedBranchGuide(model)
    guide(group, y)  # the expansion, read at the globals' initial mean
    theta = torch.tensor([0.7], dtype=torch.float64)
    name = "_AutoAmortizedBranchGuide_globals_unconstrained"

    def q_mean() -> torch.Tensor:
        trace = poutine.trace(poutine.condition(guide, {name: theta})).get_trace(group, y)
        return trace.nodes["_AutoAmortizedBranchGuide_groups_unconstrained"]["fn"].mean.reshape(-1).detach()

    before = q_mean()
    with torch.no_grad():
        guide.locs.globals_unconstrained.add_(1.5)  # q's mean moves before the next redo
    torch.testing.assert_close(q_mean(), before, atol=1e-10, rtol=0)

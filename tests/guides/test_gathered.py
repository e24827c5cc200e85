"""Models as users write them: a flat plate of observations gathering group effects by an index (radon's homes,
MovieLens' ratings, index chains, crossed item-response plates), in every guide.

The central check: the gathered and the nested (padded and masked) formulations of one model give the same guide
structure and, from the same seed, the same ELBO estimate (float64, to 1e-6)."""

import itertools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO
from pyro.poutine.subsample_messenger import _Subsample

from pyro_hier import (
    AutoAmortizedBranchGuide,
    AutoBranchGuide,
    AutoHierarchicalVM,
    AutoPlateAmortizedFlow,
    StructureError,
)
from pyro_hier.local_data import capture_observations
from pyro_hier.plates import capture_plates, gathered_rows
from pyro_hier.problems import crossed_effects, movielens, radon_mn, three_level

GUIDES = {
    "branch-dense": lambda m, **kw: AutoBranchGuide(m, covariance="dense"),
    "branch-block": lambda m, **kw: AutoBranchGuide(m, covariance="block"),
    "branch-diagonal": lambda m, **kw: AutoBranchGuide(m, covariance="diagonal"),
    "amortized-natural": lambda m, **kw: AutoAmortizedBranchGuide(m, observation_net=(8,), **kw),
    "amortized-paper": lambda m, **kw: AutoAmortizedBranchGuide(m, feature_net=(8, 4), param_net=(8,), **kw),
    "pavi-free": lambda m, **kw: AutoPlateAmortizedFlow(
        m, encoding_size=3, flow_hidden=(24,), condition_on_ancestors=True
    ),
    "pavi-deepset": lambda m, **kw: AutoPlateAmortizedFlow(
        m, encoder="deepset", encoding_size=3, flow_hidden=(24,), encoder_hidden=(8,), condition_on_ancestors=True, **kw
    ),
    "hvm": lambda m, **kw: AutoHierarchicalVM(m, num_components=2),
}
#: guides that read covariates of the observations
WITH_FEATURES = {"amortized-natural", "amortized-paper", "pavi-deepset"}


# ---- the nested twins of the gathered real-data models -----------------------------------------------------------
def pad_groups(group: torch.Tensor, num_groups: int, *columns: torch.Tensor):
    """Each group's rows in a padded ``(num_groups, n_max, …)`` layout (rows in their order), and the mask."""
    counts = torch.bincount(group, minlength=num_groups)
    order = torch.argsort(group, stable=True)
    within = torch.arange(group.shape[0]) - (torch.cumsum(counts, 0) - counts)[group[order]]
    n_max = int(counts.max())
    mask = torch.zeros(num_groups, n_max, dtype=torch.bool)
    mask[group[order], within] = True
    out = []
    for c in columns:
        padded = c.new_zeros((num_groups, n_max, *c.shape[1:]))
        padded[group[order], within] = c[order]
        out.append(padded)
    return (*out, mask)


class Twins:
    """A model in its gathered and nested formulations, with each one's arguments and covariates."""

    def __init__(self, name, gathered, nested):
        self.name, self.gathered, self.nested = name, gathered, nested


def radon_twins():
    p = radon_mn(dtype=torch.float64)
    county, log_uranium, floor, floor_by_county = p.args
    y = p.kwargs["log_radon"]
    num_counties = int(county.max()) + 1
    columns = pad_groups(county, num_counties, log_uranium, floor, floor_by_county, y)

    def nested_model(log_uranium, floor, floor_by_county, mask, log_radon=None):
        zero, one = log_uranium.new_zeros(()), log_uranium.new_ones(())
        mean = pyro.sample("county_effect_mean", dist.Normal(zero, one))
        scale = pyro.sample("county_effect_scale", dist.Uniform(zero, 100.0 * one))
        noise = pyro.sample("log_radon_scale", dist.Uniform(zero, 100.0 * one))
        weight = pyro.sample("weight", dist.Normal(zero, one).expand([3]).to_event(1))
        with pyro.plate("counties", num_counties, dim=-2):
            effect = pyro.sample("county_effect", dist.Normal(mean, scale))
            with pyro.plate("homes", log_uranium.shape[-1], dim=-1):
                loc = effect + weight[..., 0] * log_uranium + weight[..., 1] * floor + weight[..., 2] * floor_by_county
                with poutine.mask(mask=mask):
                    pyro.sample("log_radon", dist.Normal(loc, noise), obs=log_radon)

    def gathered_features(county, log_uranium, floor, floor_by_county, log_radon=None, subsample=None):
        return torch.stack([log_uranium, floor, floor_by_county], -1)

    def nested_features(log_uranium, floor, floor_by_county, mask, log_radon=None):
        return torch.stack([log_uranium, floor, floor_by_county], -1)

    return Twins(
        "radon",
        (p.model, p.args, p.kwargs, gathered_features),
        (nested_model, (*columns[:3], columns[4]), {"log_radon": columns[3]}, nested_features),
    )


def movielens_twins(num_users=12):
    p = movielens(dtype=torch.float64)
    user, features, _ = p.args
    keep = user < num_users
    user, features, y = user[keep], features[keep], p.kwargs["rating"][keep]
    x, yp, mask = pad_groups(user, num_users, features, y)

    def nested_model(x, mask, rating=None):
        dim = x.shape[-1]
        mu = pyro.sample("mu", dist.Normal(x.new_zeros(dim), 1.0).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfNormal(x.new_ones(dim)).to_event(1))
        with pyro.plate("users", x.shape[0], dim=-2):
            z = pyro.sample("z", dist.Normal(mu, sigma).to_event(1))
            with pyro.plate("ratings", x.shape[1], dim=-1), poutine.mask(mask=mask):
                pyro.sample("rating", dist.Bernoulli(logits=(x * z).sum(-1)), obs=rating)

    return Twins(
        "movielens",
        (p.model, (user, features, num_users), {"rating": y}, lambda user, x, n, rating=None, subsample=None: x),
        (nested_model, (x, mask), {"rating": yp}, lambda x, mask, rating=None: x),
    )


def linear_twins(factory, **kw):
    nested, gathered = factory(**kw), factory(gathered=True, **kw)
    return Twins(
        nested.name.split("(")[0],
        (gathered.model, gathered.args, gathered.kwargs, None),
        (nested.model, nested.args, nested.kwargs, None),
    )


TWINS = {
    "radon": radon_twins,
    "movielens": movielens_twins,
    "three_level": lambda: linear_twins(three_level, num_regions=3, num_groups=4, num_obs=5),
    "crossed": lambda: linear_twins(crossed_effects, num_rows=5, num_cols=4, missing_prob=0.3),
}


@pytest.fixture(scope="module", params=list(TWINS))
def twins(request):
    return TWINS[request.param]()


def perturbed_guide(make, model, args, kwargs, features, seed=0):
    """A guide set up from ``seed`` with every free parameter moved by the same (flattened) noise, so that the data and
    every parameter matter (the branch guide's references and averages are state, left as they are)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = make(model, **({"local_features": features} if features is not None else {}))
    guide(*args, **kwargs)
    generator = torch.Generator().manual_seed(seed + 1)
    state = {id(p) for p in getattr(guide, "state_parameters", dict)().values()}  # (references: not free)
    with torch.no_grad():
        for p in guide.parameters():
            noise = 0.05 * torch.randn(p.numel(), generator=generator, dtype=p.dtype).reshape(p.shape)
            if id(p) not in state:
                p.add_(noise)
    return guide


def elbo(model, guide, args, kwargs, seed=3):
    pyro.set_rng_seed(seed)
    with torch.no_grad():
        return -Trace_ELBO(num_particles=3, vectorize_particles=True).loss(model, guide, *args, **kwargs)


@pytest.mark.parametrize("name", list(GUIDES))
def test_gathered_and_nested_formulations_give_the_same_guide_and_elbo(twins, name):
    make = GUIDES[name]
    features = {}
    values = {}
    sizes = {}
    for label, (model, args, kwargs, feats) in (("gathered", twins.gathered), ("nested", twins.nested)):
        use = feats if name in WITH_FEATURES else None
        guide = perturbed_guide(make, model, args, kwargs, use)
        sizes[label] = [p.numel() for p in guide.parameters()]
        values[label] = elbo(model, guide, args, kwargs)
        features[label] = guide
    assert sizes["gathered"] == sizes["nested"]
    if hasattr(features["gathered"], "levels"):
        lv = [getattr(level, "ancestors", None) for level in features["gathered"].levels]
        ln = [getattr(level, "ancestors", None) for level in features["nested"].levels]
        assert len(lv) == len(ln) and [len(a or ()) for a in lv] == [len(a or ()) for a in ln]
    assert math.isfinite(values["gathered"])
    assert values["gathered"] == pytest.approx(values["nested"], abs=1e-6, rel=0)


# ---- minibatches: the average of the minibatch ELBO over all minibatches is the full-data ELBO -------------------
J, M = 4, 6
_g = torch.Generator().manual_seed(7)
COUNTY = torch.tensor([0, 1, 2, 3, 1, 2])
X = torch.randn(M, generator=_g, dtype=torch.float64)
Y = torch.randn(M, generator=_g, dtype=torch.float64) + COUNTY.double()


def tiny_model(county, x, y=None, subsample=None, rows=None):
    """Homes gathering their county's effect; ``subsample`` minibatches counties (their homes follow,
    gathered_rows), ``rows`` minibatches homes with every county present."""
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 1.0))
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())))
    w = pyro.sample("w", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("counties", J, dim=-1, subsample=subsample):
        a = pyro.sample("a", dist.Normal(mu, tau))
    if rows is None:
        sel = gathered_rows(county, J, subsample)
        rows, group, scale = sel.rows, sel.group, sel.scale
    else:
        group, scale = county[rows], 1.0

    def kept(t):
        return t if rows is None else t[rows]

    with pyro.plate("homes", county.shape[0], dim=-1, subsample=rows), poutine.scale(scale=scale):
        pyro.sample("y", dist.Normal(a[..., group] + w * kept(x), 0.7), obs=None if y is None else kept(y))


def tiny_features(county, x, y=None, subsample=None, rows=None):
    return x.unsqueeze(-1)


def sliced(trace, calls):
    """``trace`` (of the full call) with every site's value cut to the plate elements of ``calls``: the same draws
    for the elements a minibatch keeps (fixed guide noise)."""
    out = trace.copy()
    for name, node in out.nodes.items():
        if node["type"] != "sample":
            continue
        node = out.nodes[name] = dict(node)
        if isinstance(node["fn"], _Subsample):
            node["value"] = calls[name].indices
            continue
        value = node["value"]
        event_dim = node["fn"].event_dim
        for frame in node["cond_indep_stack"]:
            call = calls.get(frame.name)
            if call is not None and call.subsampled and frame.dim is not None:
                value = value.index_select(value.dim() - event_dim + frame.dim, call.indices)
        node["value"] = value
    return out


def replayed_elbo(model, guide, trace, args, kwargs):
    with torch.no_grad():
        return -Trace_ELBO().loss(model, poutine.replay(guide, trace=trace), *args, **kwargs)


def minibatch_average(model, guide, args, kwargs, minibatches):
    """The full-data ELBO estimate and the average over ``minibatches`` (kwargs) of the minibatch estimates, all
    with the guide's draws of the full call."""
    pyro.set_rng_seed(5)
    full = poutine.trace(guide).get_trace(*args, **kwargs)
    estimates = []
    for extra in minibatches:
        calls = capture_plates(model, args, {**kwargs, **extra})
        estimates.append(replayed_elbo(model, guide, sliced(full, calls), args, {**kwargs, **extra}))
    return replayed_elbo(model, guide, full, args, kwargs), sum(estimates) / len(estimates)


MINIBATCHES = {
    "counties": [{"subsample": torch.tensor(s)} for s in itertools.combinations(range(J), 2)],
    "homes": [{"rows": torch.tensor(s)} for s in itertools.combinations(range(M), 3)],
}


@pytest.mark.parametrize("kind", list(MINIBATCHES))
@pytest.mark.parametrize("name", list(GUIDES))
def test_minibatch_elbo_is_unbiased(name, kind):
    """Counties subsampled with their homes (gathered_rows), or homes subsampled with every county present: over
    all minibatches the minibatch ELBO averages to the full one, draw by draw — each element's q does not depend on
    which others are in the minibatch (amortized encodings read each group's full data)."""
    args, kwargs = (COUNTY, X), {"y": Y}
    features = tiny_features if name in WITH_FEATURES else None
    guide = perturbed_guide(GUIDES[name], tiny_model, args, kwargs, features)
    full, average = minibatch_average(tiny_model, guide, args, kwargs, MINIBATCHES[kind])
    assert math.isfinite(full)
    assert average == pytest.approx(full, abs=1e-8 * (1 + abs(full)))


MINIBATCH_PROBLEMS = {
    # regions subsampled, their groups and the groups' observations following (two gathered_rows)
    "chain": (lambda: three_level(num_regions=3, num_groups=2, num_obs=2, gathered=True), 3),
    # rows subsampled with their cells, every column present: the columns' data are incomplete in a minibatch
    "crossed": (lambda: crossed_effects(num_rows=3, num_cols=2, gathered=True), 3),
}


@pytest.mark.parametrize("problem", list(MINIBATCH_PROBLEMS))
@pytest.mark.parametrize("name", list(GUIDES))
def test_minibatch_elbo_is_unbiased_in_chains_and_crossed_plates(name, problem):
    make, size = MINIBATCH_PROBLEMS[problem]
    p = make()
    guide = perturbed_guide(GUIDES[name], p.model, p.args, p.kwargs, None)
    subsets = [{"subsample": torch.tensor(s)} for s in itertools.combinations(range(size), 2)]
    full, average = minibatch_average(p.model, guide, p.args, p.kwargs, subsets)
    assert average == pytest.approx(full, abs=1e-8 * (1 + abs(full)))


# ---- data sources: levels without data, factors, calls without the observations -----------------------------------
def test_levels_without_data_keep_free_parameters_and_say_so():
    y = torch.randn(5, 4, dtype=torch.float64)

    def model(y):
        mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), 1.0))
        with pyro.plate("extra", 3, dim=-1):  # no observation reads these
            pyro.sample("e", dist.Normal(mu, 1.0))
        with pyro.plate("groups", 5, dim=-2):
            z = pyro.sample("z", dist.Normal(mu, 1.0))
            with pyro.plate("obs", 4, dim=-1):
                pyro.sample("y", dist.Normal(z, 1.0), obs=y)
            pyro.factor("penalty", -0.1 * z.squeeze(-1).pow(2))  # a log-density term, not data

    guide = AutoAmortizedBranchGuide(model, feature_net=(8, 4), param_net=(8,))
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    assert all(math.isfinite(svi.step(y)) for _ in range(3))
    assert guide.amortized_levels == ("groups",) and guide.free_levels == ("extra",)
    assert guide.locs.extra.shape == (3, 1)  # free per-element parameters
    assert "amortized levels ['groups']" in repr(guide) and "free levels ['extra']" in repr(guide)
    assert guide.median(y)["e"].shape == (3,)


@pytest.mark.parametrize("form", ["natural", "paper"])
def test_calls_without_the_observations_encode_from_the_last_data(form):
    """Predictive(model, guide) with obs=None: the groups are encoded from the data of the last call that had them."""
    args, kwargs = (COUNTY, X), {"y": Y}
    make = GUIDES[f"amortized-{form}"]
    guide = perturbed_guide(make, tiny_model, args, kwargs, tiny_features)
    with_data = guide.median(*args, **kwargs)
    without = guide.median(*args)  # y omitted
    for site in with_data:
        torch.testing.assert_close(without[site], with_data[site])
    draws = pyro.infer.Predictive(tiny_model, guide=guide, num_samples=4)(*args)
    assert draws["y"].shape == (4, M) and draws["a"].shape == (4, J)
    # a minibatch of counties was the last call with data: the others cannot be encoded without it
    guide(*args, **kwargs, subsample=torch.tensor([0, 2]))
    with pytest.raises(StructureError, match=r"elements \[1, 3\] of plate 'counties' were not in it"):
        guide.median(*args)


def test_linear_observation_map_on_gathered_rows_equals_the_nested_formulation():
    """observation_net=() sums each group's rows' second moments: the same for gathered rows as for nested ones."""
    twins = radon_twins()
    values = []
    for model, args, kwargs, features in (twins.gathered, twins.nested):
        guide = perturbed_guide(
            lambda m, **kw: AutoAmortizedBranchGuide(m, observation_net=(), **kw), model, args, kwargs, features
        )
        values.append(elbo(model, guide, args, kwargs))
    assert values[0] == pytest.approx(values[1], abs=1e-6, rel=0)


def test_gathers_are_traced_once_per_row_while_the_data_are_the_same():
    """The table of gathers: a minibatch whose rows were all seen costs no model run; new or changed data reset it."""
    county, x, y = COUNTY.clone(), X.clone(), Y.clone()
    guide = perturbed_guide(GUIDES["amortized-natural"], tiny_model, (county, x), {"y": y}, tiny_features)
    maps = guide._gather_maps
    runs = maps.runs
    for batch in ([0, 1], [2, 3], [1, 2], [0, 3]):
        guide(county, x, y=y, subsample=torch.tensor(batch))
    assert maps.runs == runs  # the setup call saw every row
    county[[0, 4]] = county[[4, 0]]  # the data change in place: the table is rebuilt, and right
    got = guide.local_posterior(county, x, y=y)["counties"]["loc"]
    assert maps.runs == runs + 1
    expected = guide.local_posterior(county.clone(), x, y=y)["counties"]["loc"]  # new data: traced afresh
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, guide.local_posterior(COUNTY, x, y=y)["counties"]["loc"])


def test_deepset_keeps_the_last_data_as_plain_tensors_for_calls_without_observations():
    """The deep set's data for a call without observations: the last call's, kept with their gathers as plain
    tensors (they pickle), giving the same encodings as the live data."""
    import pickle

    args, kwargs = (COUNTY, X), {"y": Y}
    guide = perturbed_guide(GUIDES["pavi-deepset"], tiny_model, args, kwargs, tiny_features)
    with torch.no_grad():  # (the networks read views of PAVI's packed parameters, edited in place above: renewed)
        guide(*args, **kwargs)
    batch = {**kwargs, "subsample": torch.tensor([1, 3])}
    calls, observations = capture_observations(guide.model, args, batch)
    gathers = guide._gather_maps.call(args, batch, calls)
    live = guide._site_data(args, batch, calls, observations, {"y": X.unsqueeze(-1)}, gathers)
    kept = pickle.loads(pickle.dumps(guide._last_data))  # what the call left for calls without observations
    encoder = guide._modules["encoder"]
    for level in ("globals", "counties"):
        expected = encoder(level, lambda site, lv: live[(site, lv)], calls, torch.float64)
        again = encoder(level, lambda site, lv: kept[(site, lv)], calls, torch.float64)
        torch.testing.assert_close(again, expected)
    assert kept[("y", "globals")].calls["counties"].subsample_size == J  # the globals read every county's rows

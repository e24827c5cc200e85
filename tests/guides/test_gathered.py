"""Models as users write them: a flat plate of observations gathering group effects by an index (radon's homes,
MovieLens' ratings, index chains, crossed item-response plates), in every guide.

The central check: the gathered and the nested (padded and masked) formulations of one model give the same guide
structure and, from the same seed, the same ELBO estimate (float64, to 1e-6)."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO

from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide, AutoHierarchicalVM, AutoPlateAmortizedFlow
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
    """A guide set up from ``seed`` with every parameter moved by the same (flattened) noise, so that the data and
    every parameter matter."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = make(model, **({"local_features": features} if features is not None else {}))
    guide(*args, **kwargs)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in guide.parameters():
            p.add_(0.05 * torch.randn(p.numel(), generator=generator, dtype=p.dtype).reshape(p.shape))
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

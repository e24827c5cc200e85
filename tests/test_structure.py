import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import config_enumerate

from pyro_hier import StructureError, inspect_model
from pyro_hier.plates import capture_plates, check_plate_sizes, open_plates


def two_level(x, y, subsample=None, subsample_size=None):
    theta = pyro.sample("theta", dist.Normal(torch.zeros(3), 1).to_event(1))
    with pyro.plate("groups", y.shape[0], subsample=subsample, subsample_size=subsample_size, dim=-2) as i:
        z = pyro.sample("z", dist.Normal(theta, 1).to_event(1))
        with pyro.plate("obs", y.shape[1], dim=-1):
            pyro.sample("y", dist.Normal((x[i] * z).sum(-1), 1), obs=y[i])


def three_level(y):
    mu = pyro.sample("mu", dist.Normal(0, 1))
    with pyro.plate("regions", y.shape[0], dim=-3):
        a = pyro.sample("a", dist.Normal(mu, 1))
        with pyro.plate("groups", y.shape[1], dim=-2):
            b = pyro.sample("b", dist.Normal(a, 1))
            with pyro.plate("obs", y.shape[2], dim=-1):
                pyro.sample("y", dist.Normal(b, 1), obs=y)


def crossed(y):
    mu = pyro.sample("mu", dist.Normal(0, 1))
    rows = pyro.plate("rows", y.shape[0], dim=-2)
    cols = pyro.plate("cols", y.shape[1], dim=-1)
    with rows:
        a = pyro.sample("a", dist.Normal(0, 1))
    with cols:
        b = pyro.sample("b", dist.Normal(0, 1))
    with rows, cols:
        pyro.sample("y", dist.Normal(mu + a + b, 1), obs=y)


@pytest.fixture
def data():
    torch.manual_seed(0)
    return torch.randn(10, 5, 3), torch.randn(10, 5)


def test_two_level_sites_and_plates(data):
    s = inspect_model(two_level, data)
    assert list(s.latent) == ["theta", "z"]
    assert list(s.observed) == ["y"]
    assert s.global_sites == ("theta",) and s.local_sites == ("z",)
    z = s.latent["z"]
    assert z.shape == (10, 1, 3) and z.event_dim == 1 and z.batch_shape == (10, 1) and z.event_shape == (3,)
    assert z.plates == ("groups",) and z.plate_dims == (-2,)
    assert z.plate_ancestors == ("theta",) and s.latent["theta"].plate_ancestors == ()
    assert z.element_numel == 3 and s.latent["theta"].element_numel == 3
    assert not z.discrete and z.reparameterized and not z.enumerated
    assert s.plates["groups"].size == 10 and s.plates["groups"].dim == -2 and not s.plates["groups"].subsampled
    assert s.plates["obs"].parent == "groups" and s.plates["groups"].parent is None
    assert s.plate_children == {None: ("groups",), "groups": ("obs",), "obs": ()}
    assert s.crossed_plates == ()
    assert s.max_plate_nesting == 2
    assert torch.equal(s.observed["y"].value, data[1])
    assert s.parents["z"] == ("theta",) and s.parents["y"] == ("z",) and s.parents["theta"] == ()
    assert s.plate_dim("z", "groups") == -3


def test_subsample_with_explicit_indices(data):
    idx = torch.tensor([7, 0, 3])
    s = inspect_model(two_level, data, {"subsample": idx})
    g = s.plates["groups"]
    assert g.size == 10 and g.subsample_size == 3 and g.subsampled
    assert torch.equal(g.subsample, idx)
    assert s.subsampled_plates == ("groups",)
    # shapes are reported at the full size; values are those of the call
    assert s.latent["z"].shape == (10, 1, 3) and s.latent["z"].value.shape == (3, 1, 3)
    assert s.observed["y"].shape == (10, 5)
    assert torch.equal(s.observed["y"].value, data[1][idx])


def test_random_subsample_is_not_reported_as_the_models_own(data):
    s = inspect_model(two_level, data, {"subsample_size": 4})
    g = s.plates["groups"]
    assert g.size == 10 and g.subsample_size == 4 and g.subsample is None


def test_three_level_nested_tree_and_ancestors():
    s = inspect_model(three_level, (torch.randn(2, 3, 4),))
    assert s.plate_children == {None: ("regions",), "regions": ("groups",), "groups": ("obs",), "obs": ()}
    assert s.latent["a"].plate_ancestors == ("mu",)
    assert s.latent["b"].plate_ancestors == ("mu", "a")
    assert s.latent["b"].shape == (2, 3, 1)
    assert s.max_plate_nesting == 3
    assert s.parents["b"] == ("a",)


def test_crossed_plates():
    s = inspect_model(crossed, (torch.randn(4, 6),))
    assert s.crossed_plates == (frozenset({"rows", "cols"}),)
    assert s.plates["rows"].parent is None and s.plates["cols"].parent is None
    assert s.latent["a"].plate_ancestors == ("mu",) and s.latent["b"].plate_ancestors == ("mu",)
    assert s.latent["a"].shape == (4, 1) and s.latent["b"].shape == (6,)
    assert s.observed["y"].plates == ("rows", "cols")


def test_constrained_and_discrete_sites():
    def model():
        pyro.sample("pos", dist.LogNormal(torch.zeros(2), 1).to_event(1))
        pyro.sample("simplex", dist.Dirichlet(torch.ones(4)))
        pyro.sample("interval", dist.Uniform(0.0, 100.0))
        pyro.sample("corr", dist.LKJCholesky(3, 1.0))
        with pyro.plate("items", 5, dim=-1):
            pyro.sample("k", dist.Categorical(torch.ones(3)))
            pyro.sample("n", dist.Poisson(3.0))
            pyro.sample("pi", dist.Beta(2.0, 2.0))
            pyro.sample("pp", dist.Gamma(2.0, 1.0))

    s = inspect_model(config_enumerate(model))
    assert s.latent["pos"].unconstrained_shape == (2,) and s.latent["pos"].unconstrained_event_dim == 1
    assert s.latent["simplex"].unconstrained_shape == (3,) and s.latent["simplex"].element_numel == 3
    assert s.latent["interval"].unconstrained_shape == () and s.latent["interval"].unconstrained_event_dim == 0
    assert s.latent["corr"].shape == (3, 3) and s.latent["corr"].unconstrained_shape == (3,)
    assert s.latent["corr"].unconstrained_event_dim == 1
    assert s.latent["pi"].shape == (5,) and s.latent["pi"].element_numel == 1
    for name in ("k", "n"):
        site = s.latent[name]
        assert site.discrete and site.unconstrained_shape is None and site.enumerated == (name == "k")
        with pytest.raises(StructureError, match=name):
            _ = site.element_numel
    assert not s.latent["pp"].discrete
    assert not s.latent["n"].reparameterized and s.latent["pos"].reparameterized


def test_deterministic_and_factor_sites():
    def model():
        a = pyro.sample("a", dist.Normal(0, 1))
        pyro.deterministic("b", 2 * a)
        pyro.factor("f", -(a**2))

    s = inspect_model(model)
    assert s.deterministic == ("b",)
    assert list(s.latent) == ["a"] and "f" in s.observed and "b" not in s.observed


def test_sequential_plate_error():
    def model():
        for i in pyro.plate("loop", 3):
            pyro.sample(f"x_{i}", dist.Normal(0, 1))

    with pytest.raises(StructureError, match=r"x_0.*sequential plate 'loop'.*with pyro.plate"):
        inspect_model(model)


def test_markov_error():
    def model():
        x = 0.0
        for t in pyro.markov(range(3)):
            x = pyro.sample(f"x_{t}", dist.Normal(x, 1))

    with pytest.raises(StructureError, match=r"x_0.*pyro\.markov"):
        inspect_model(model)


def test_plates_that_change_between_calls_are_an_error():
    calls = []

    def model():
        calls.append(1)
        if len(calls) % 2:
            with pyro.plate("p", 3):
                pyro.sample("x", dist.Normal(0, 1))
        else:
            pyro.sample("x", dist.Normal(0, 1))

    with pytest.raises(StructureError, match=r"'x' is in plates \('p',\).*same plates"):
        inspect_model(model)
    inspect_model(model, num_calls=1)  # the check can be switched off


def test_site_that_comes_and_goes_is_an_error():
    calls = []

    def model():
        calls.append(1)
        pyro.sample("a", dist.Normal(0, 1))
        if len(calls) % 2:
            pyro.sample("b", dist.Normal(0, 1))

    with pytest.raises(StructureError, match="'b' appears in one call but not in another"):
        inspect_model(model)


def test_validate_trace(data):
    s = inspect_model(two_level, data)

    def other(x, y):
        pyro.sample("theta", dist.Normal(torch.zeros(3), 1).to_event(1))
        pyro.sample("z", dist.Normal(torch.zeros(10, 1, 3), 1).to_event(3))

    s.validate_trace(poutine.trace(two_level).get_trace(*data))
    with pytest.raises(StructureError, match="'z' is in plates"):
        s.validate_trace(poutine.trace(other).get_trace(*data))


def test_no_bijection_error():
    class Weird(dist.Normal):
        @property
        def support(self):
            return torch.distributions.constraints.Constraint()  # a support biject_to knows nothing about

    def model():
        pyro.sample("w", Weird(0.0, 1.0))

    with pytest.raises(StructureError, match=r"'w'.*no bijection"):
        inspect_model(model)


def test_inspection_leaves_no_trace_outside(data):
    with poutine.trace() as tr:
        inspect_model(two_level, data, {"subsample": torch.tensor([1, 2])})
    assert len(tr.trace.nodes) == 0


# ---- plates at run time -------------------------------------------------------------------------------------------
def test_capture_plates_stops_after_the_last_wanted_plate(data):
    reached = []

    def model(x, y, subsample=None):
        two_level(x, y, subsample)
        reached.append(True)

    calls = capture_plates(model, data, {"subsample": torch.tensor([4, 5])}, names=["groups", "obs"])
    assert not reached
    assert calls["groups"].user_indices and torch.equal(calls["groups"].indices, torch.tensor([4, 5]))
    assert calls["groups"].size == 10 and calls["groups"].subsampled
    assert not calls["obs"].user_indices and not calls["obs"].subsampled
    capture_plates(model, data)
    assert reached


def test_capture_plates_inside_outer_handlers_does_not_leak(data):
    with poutine.trace() as tr, pyro.plate("particles", 7, dim=-3):
        calls = capture_plates(two_level, data, {"subsample_size": 3})
    assert len(tr.trace.nodes) == 1  # only the outer plate's own subsample site
    assert calls["groups"].subsample_size == 3 and not calls["groups"].user_indices


def test_open_plates_use_the_models_indices(data):
    idx = torch.tensor([2, 8])
    calls = capture_plates(two_level, data, {"subsample": idx})
    plates = open_plates(calls, {"groups": -2})
    loc = torch.arange(10.0).reshape(10, 1, 1)
    with plates["groups"]:
        sliced = pyro.param("loc_test_open_plates", loc, event_dim=1)
    pyro.clear_param_store()
    assert sliced.squeeze().tolist() == [2.0, 8.0]
    # a full-size permutation would silently misalign per-element parameters: refused
    calls = capture_plates(two_level, data, {"subsample": torch.arange(10).flip(0)})
    with pytest.raises(StructureError, match=r"'groups'.*new order"):
        open_plates(calls, {"groups": -2})


def test_check_plate_sizes(data):
    calls = capture_plates(two_level, data)
    check_plate_sizes(calls, {"groups": 10, "obs": 5}, "the guide")
    with pytest.raises(StructureError, match="'groups' has full size 10 in this call but 12"):
        check_plate_sizes(calls, {"groups": 12}, "the guide")
    with pytest.raises(StructureError, match="'other' was opened"):
        check_plate_sizes(calls, {"other": 3}, "the guide")


def test_parents_survive_a_distribution_that_loses_pyros_provenance():
    # Pyro's OrderedLogistic writes its probabilities into a fresh tensor, so provenance tracking gives the ratings
    # no parents and every guide took the cutpoints (and the raters' effects) for unread by the likelihood
    from pyro.distributions.transforms import OrderedTransform

    from pyro_hier.structure import gradient_parents

    rater = torch.tensor([0, 0, 1, 1, 2, 2])
    x = torch.linspace(-1, 1, 6)
    y = torch.tensor([0, 1, 2, 1, 0, 2])

    def model(x, rater, y):
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        c = pyro.sample(
            "c", dist.TransformedDistribution(dist.Normal(torch.zeros(2), 3.0).to_event(1), [OrderedTransform()])
        )
        with pyro.plate("raters", 3):
            a = pyro.sample("a", dist.Normal(0.0, 1.0))
        with pyro.plate("ratings", 6):
            pyro.sample("y", dist.OrderedLogistic(a[..., rater] + b * x, c), obs=y)

    assert gradient_parents(model, (x, rater, y))["y"] == {"a", "b", "c"}
    assert set(inspect_model(model, (x, rater, y)).parents["y"]) == {"a", "b", "c"}


def test_a_model_writing_into_a_sites_value_keeps_provenance_parents_with_a_warning():
    def model():
        z = pyro.sample("z", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        z[0] = 0.0  # in place on a sample's value: autograd cannot run it on leaves
        pyro.sample("y", dist.Normal(z, 1.0).to_event(1), obs=torch.ones(3))

    with pytest.warns(UserWarning, match="provenance tracking alone"):
        parents = inspect_model(model).parents
    assert parents["y"] == ("z",)

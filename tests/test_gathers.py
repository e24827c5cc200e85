"""Which elements of other plates each site reads (ModelStructure.gathers), on the forms users write."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.ops.indexing import Vindex

from pyro_hier import StructureError, inspect_model
from pyro_hier.gathers import trace_gathers
from pyro_hier.plates import gathered_rows

J, M = 7, 40


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    county = torch.randint(0, J, (M,), generator=g)
    return county, torch.randn(M, generator=g), torch.randn(M, 3, generator=g)


def only(structure, site):
    (g,) = structure.gathers_of(site)
    return g


def flat(county, y, x, form):
    def model():
        mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), 1.0))
        with pyro.plate("counties", J, dim=-1):
            a = pyro.sample("a", dist.Normal(mu, 1.0))
        with pyro.plate("homes", M, dim=-1):
            if form == "index":
                loc = a[..., county]
            elif form == "vindex":
                loc = Vindex(a)[..., county]
            elif form == "index_select":
                loc = torch.index_select(a, -1, county)
            elif form == "gather":
                loc = torch.gather(a.expand(M, J), -1, county.unsqueeze(-1)).squeeze(-1)
            else:  # arithmetic on the gathered values
                loc = (a[..., county] * x[:, 0]).exp() + 2.0 * mu - x[:, 1]
            pyro.sample("y", dist.Normal(loc, 1.0), obs=y)

    return model


@pytest.mark.parametrize("form", ["index", "vindex", "index_select", "gather", "arithmetic"])
def test_flat_plate_gathering_group_effects(data, form):
    county, y, x = data
    s = inspect_model(flat(county, y, x, form))
    g = only(s, "y")
    assert (g.source, g.plate) == ("a", "counties")
    assert torch.equal(g.index, county)
    assert s.gathers_of("a") == () and s.gathers_of("mu") == ()


def test_vector_effects_read_with_events_and_several_observed_sites(data):
    county, y, x = data

    def model():
        with pyro.plate("users", J, dim=-1):
            z = pyro.sample("z", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        with pyro.plate("ratings", M, dim=-1):
            pyro.sample("r", dist.Bernoulli(logits=(x * z[county]).sum(-1)), obs=(y > 0).float())
            pyro.sample("n", dist.Poisson(Vindex(z)[..., county, 1].exp()), obs=y.abs().round())

    s = inspect_model(model)
    assert torch.equal(only(s, "r").index, county) and torch.equal(only(s, "n").index, county)


def test_index_chain_of_three_levels():
    """homes → counties → states, the homes also reading their state directly through the chain."""
    g = torch.Generator().manual_seed(1)
    county_state = torch.randint(0, 3, (J,), generator=g)
    county = torch.randint(0, J, (M,), generator=g)
    y = torch.randn(M, generator=g)

    def model():
        with pyro.plate("states", 3, dim=-1):
            s = pyro.sample("s", dist.Normal(0.0, 1.0))
        with pyro.plate("counties", J, dim=-1):
            c = pyro.sample("c", dist.Normal(s[..., county_state], 1.0))
        with pyro.plate("homes", M, dim=-1):
            pyro.sample("y", dist.Normal(c[..., county] + s[..., county_state][..., county], 1.0), obs=y)

    s = inspect_model(model)
    assert torch.equal(only(s, "c").index, county_state)
    by_source = {g.source: g for g in s.gathers_of("y")}
    assert torch.equal(by_source["c"].index, county)
    assert torch.equal(by_source["s"].index, county_state[county])


def test_crossed_plates_each_observation_reads_one_student_and_one_question():
    g = torch.Generator().manual_seed(2)
    student, question = torch.randint(0, 5, (M,), generator=g), torch.randint(0, 4, (M,), generator=g)
    y = torch.randint(0, 2, (M,), generator=g).double()

    def model():
        with pyro.plate("students", 5, dim=-1):
            ability = pyro.sample("ability", dist.Normal(y.new_zeros(()), 1.0))
        with pyro.plate("questions", 4, dim=-1):
            difficulty = pyro.sample("difficulty", dist.Normal(y.new_zeros(()), 1.0))
        with pyro.plate("answers", M, dim=-1):
            pyro.sample("y", dist.Bernoulli(logits=ability[..., student] - difficulty[..., question]), obs=y)

    s = inspect_model(model)
    by_plate = {g.plate: g for g in s.gathers_of("y")}
    assert torch.equal(by_plate["students"].index, student) and torch.equal(by_plate["questions"].index, question)


def test_nested_models_have_no_gathers():
    y = torch.randn(4, 3, 5)

    def model():
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("regions", 4, dim=-3):
            a = pyro.sample("a", dist.Normal(mu, 1.0))
            with pyro.plate("groups", 3, dim=-2):
                b = pyro.sample("b", dist.Normal(a, 1.0))
                with pyro.plate("obs", 5, dim=-1):
                    pyro.sample("y", dist.Normal(b, 1.0), obs=y)

    assert inspect_model(model).gathers == {}


def test_subsampled_groups_give_positions_in_the_subsample(data):
    county, y, _ = data
    idx = torch.tensor([1, 4, 5])

    def model(subsample=None):
        with pyro.plate("counties", J, dim=-1, subsample=subsample):
            a = pyro.sample("a", dist.Normal(0.0, 1.0))
        sel = gathered_rows(county, J, subsample)
        with pyro.plate("homes", M, dim=-1, subsample=sel.rows):
            pyro.sample("y", dist.Normal(a[..., sel.group], 1.0), obs=y if sel.rows is None else y[sel.rows])

    g = only(inspect_model(model, kwargs={"subsample": idx}), "y")
    rows = torch.isin(county, idx)
    assert g.index.max() < 3 and torch.equal(g.full_index(idx), county[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_many_groups_in_float32_and_float64(dtype):
    """Positions beyond the digit base of the dtype (64 in float32) are decoded exactly."""
    n_groups, n_obs = 20000, 30000
    g = torch.Generator().manual_seed(3)
    group = torch.randint(0, n_groups, (n_obs,), generator=g)
    y = torch.randn(n_obs, generator=g, dtype=dtype)

    def model():
        with pyro.plate("groups", n_groups, dim=-1):
            z = pyro.sample("z", dist.Normal(y.new_zeros(()), 1.0))
        with pyro.plate("obs", n_obs, dim=-1):
            pyro.sample("y", dist.Normal(torch.sigmoid(z[group]) * 3.0, 1.0), obs=y)

    assert torch.equal(only(inspect_model(model, num_calls=1), "y").index, group)


def test_whole_plate_reads_are_clear_errors_for_that_site_only(data):
    county, y, _ = data

    def model():
        with pyro.plate("counties", J, dim=-1):
            a = pyro.sample("a", dist.Normal(0.0, 1.0))
        pyro.sample("total", dist.Normal(a.sum(-1), 1.0), obs=y.sum())
        with pyro.plate("homes", M, dim=-1):
            pyro.sample("pair", dist.Normal(a[..., county] - a[..., (county + 1) % J], 1.0), obs=y)
            pyro.sample("y", dist.Normal(a[..., county], 1.0), obs=y)

    s = inspect_model(model)
    with pytest.raises(StructureError, match="'total' is in no plate but depends on the elements of plate"):
        s.gathers_of("total")
    with pytest.raises(StructureError, match="'pair' depends on several elements of plate"):
        s.gathers_of("pair")
    with pytest.raises(StructureError, match=r"'total'|'pair'"):
        s.gathers  # noqa: B018
    assert torch.equal(only(s, "y").index, county)


def test_index_computed_from_a_latent_is_a_clear_error(data):
    _, y, _ = data

    def model():
        with pyro.plate("components", 3, dim=-1):
            locs = pyro.sample("locs", dist.Normal(0.0, 3.0))
        with pyro.plate("data", M, dim=-1):
            k = pyro.sample("k", dist.Categorical(torch.ones(3) / 3))
            pyro.sample("y", dist.Normal(locs[..., k], 1.0), obs=y)

    with pytest.raises(StructureError, match=r"'y' reads elements of \['locs'\] selected by an index computed from"):
        inspect_model(model).gathers_of("y")


def test_trace_gathers_replays_the_call_and_leaves_no_trace(data):
    county, y, x = data
    model = flat(county, y, x, "index")
    with pyro.poutine.trace() as outer:
        found = trace_gathers(model)
    assert len(outer.trace.nodes) == 0
    assert set(found.gathers) == {"y"} and not found.problems

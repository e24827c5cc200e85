import numpy as np
import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.poutine.util import site_is_subsample

from pyro_hier.datasets import load_eight_schools, load_radon_mn, load_reference
from pyro_hier.problems.base import Problem
from pyro_hier.problems.eight_schools import eight_schools
from pyro_hier.problems.radon import RADON_SITE_SHAPES, radon_mn


def _trace(model, *args, **kwargs):
    return poutine.trace(model).get_trace(*args, **kwargs)


def _latent_shapes(tr) -> dict:
    return {
        name: tuple(site["value"].shape)
        for name, site in tr.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)
    }


def _log_joint(problem: Problem, values: dict, **extra) -> torch.Tensor:
    conditioned = poutine.condition(problem.model, data=values)
    return _trace(conditioned, *problem.args, **problem.kwargs, **extra).log_prob_sum()


def _means(problem: Problem) -> dict:
    return {k: m.mean for k, m in problem.moments.items()}


# ---------------------------------------------------------------- radon


@pytest.fixture(scope="module", params=["uniform", "halfnormal"])
def radon(request):
    return radon_mn(prior=request.param)


def test_radon_sites_and_shapes(radon):
    pyro.set_rng_seed(0)
    tr = _trace(radon.model, *radon.args, **radon.kwargs)
    latent = _latent_shapes(tr)
    assert latent == RADON_SITE_SHAPES
    obs = tr.nodes["log_radon"]
    assert obs["is_observed"] and obs["value"].shape == (919,)
    assert obs["value"].dtype == torch.float64
    assert [f.name for f in tr.nodes["county_effect"]["cond_indep_stack"]] == ["counties"]
    assert [f.name for f in obs["cond_indep_stack"]] == ["homes"]
    assert torch.isfinite(tr.log_prob_sum())
    assert radon.log_evidence is None and "Inference Gym" in radon.reference


def test_radon_data_equal_loader(radon):
    df = load_radon_mn("igym")
    county, log_uranium, which_floor, floor_by_county = radon.args
    assert county.dtype == torch.long
    np.testing.assert_array_equal(county.numpy(), df["county"].to_numpy())
    np.testing.assert_array_equal(log_uranium.numpy(), df["log_uranium"].to_numpy())
    np.testing.assert_array_equal(which_floor.numpy(), df["floor"].to_numpy())
    np.testing.assert_array_equal(floor_by_county.numpy(), df["floor_by_county"].to_numpy())
    tr = _trace(radon.model, *radon.args, **radon.kwargs)
    np.testing.assert_array_equal(tr.nodes["log_radon"]["value"].numpy(), df["log_radon"].to_numpy())


def test_radon_moments_match_reference(radon):
    prior = radon.name.removeprefix("radon_mn_")
    ref = load_reference(f"igym_radon_mn_{prior}")
    assert set(radon.moments) == set(RADON_SITE_SHAPES)
    for site, shape in RADON_SITE_SHAPES.items():
        assert radon.moments[site].mean.shape == shape and radon.moments[site].sd.shape == shape
        assert (radon.moments[site].sd > 0).all()
    assert radon.moments["county_effect"].mean[0].item() == ref["county_effect[1]"]["mean"]
    assert radon.moments["county_effect"].sd[84].item() == ref["county_effect[85]"]["sd"]
    assert radon.moments["weight"].mean[1].item() == ref["weight[2]"]["mean"]
    assert radon.moments["log_radon_scale"].mean.item() == ref["log_radon_scale"]["mean"]


def test_radon_log_density_at_reference_means(radon):
    """Finite at the reference means, and lower when one global site is moved 3 reference sds away.

    This checks that the model and data are the ones the reference was computed for (e.g. a sign error in a
    predictor would put the reference means far from the mode).
    """
    means = _means(radon)
    at_mean = _log_joint(radon, means)
    assert torch.isfinite(at_mean)
    for site in ["county_effect_mean", "log_radon_scale", "weight"]:
        for k in range(3 if site == "weight" else 1):
            for sign in (-1.0, 1.0):
                moved = dict(means)
                shift = torch.zeros_like(means[site])
                if site == "weight":
                    shift[k] = 3.0 * radon.moments[site].sd[k]
                else:
                    shift = 3.0 * radon.moments[site].sd
                moved[site] = means[site] + sign * shift
                assert _log_joint(radon, moved) < at_mean - 1.0, (site, k, sign)


def test_radon_full_permuted_subsample_equals_full(radon):
    means = _means(radon)
    full = _log_joint(radon, means)
    perm = torch.randperm(85, generator=torch.Generator().manual_seed(0))
    values = dict(means, county_effect=means["county_effect"][perm])
    assert torch.allclose(_log_joint(radon, values, subsample=perm), full, rtol=1e-12)


def test_radon_county_subsample_is_unbiased(radon):
    """Averaging the subsampled log joint over all 85 single-county subsamples gives the full log joint."""
    means = _means(radon)
    full = _log_joint(radon, means)
    county = radon.args[0]
    total = torch.zeros((), dtype=torch.float64)
    for j in range(85):
        idx = torch.tensor([j])
        values = dict(means, county_effect=means["county_effect"][idx])
        tr = _trace(poutine.condition(radon.model, data=values), *radon.args, **radon.kwargs, subsample=idx)
        homes = tr.nodes["homes"]["value"]
        assert (county[homes] == j).all() and homes.numel() == (county == j).sum()
        assert tr.nodes["log_radon"]["value"].shape == homes.shape
        total = total + tr.log_prob_sum()
    assert torch.allclose(total / 85, full, rtol=1e-10)


def test_radon_subsample_rejects_duplicates(radon):
    with pytest.raises(ValueError, match="distinct"):
        _trace(radon.model, *radon.args, **radon.kwargs, subsample=torch.tensor([3, 3]))


def test_radon_vectorized_elbo_runs(radon):
    pyro.clear_param_store()
    guide = AutoNormal(radon.model)
    elbo = Trace_ELBO(num_particles=3, vectorize_particles=True, max_plate_nesting=1)
    assert np.isfinite(elbo.loss(radon.model, guide, *radon.args, **radon.kwargs))


def test_radon_dtype_float32():
    p = radon_mn(dtype=torch.float32)
    tr = _trace(p.model, *p.args, **p.kwargs)
    assert tr.nodes["county_effect"]["value"].dtype == torch.float32
    assert p.moments["weight"].mean.dtype == torch.float32


def test_radon_bad_prior():
    with pytest.raises(ValueError, match="prior"):
        radon_mn(prior="cauchy")


# ---------------------------------------------------------------- eight schools


@pytest.mark.parametrize("centered", [True, False])
def test_eight_schools_sites_data_and_density(centered):
    p = eight_schools(centered=centered)
    df = load_eight_schools()
    (sigma,) = p.args
    np.testing.assert_array_equal(sigma.numpy(), df["sigma"].to_numpy())
    tr = _trace(p.model, *p.args, **p.kwargs)
    np.testing.assert_array_equal(tr.nodes["y"]["value"].numpy(), df["y"].to_numpy())
    assert tr.nodes["y"]["is_observed"]
    latent = _latent_shapes(tr)
    expected = {"mu": (), "tau": (), "theta": (8,)} if centered else {"mu": (), "tau": (), "theta_trans": (8,)}
    assert latent == expected
    assert tr.nodes["theta"]["value"].shape == (8,)
    assert set(p.moments) == set(expected) | {"theta"}
    assert torch.isfinite(tr.log_prob_sum())
    assert p.log_evidence is None and "posteriordb" in p.reference

    ref = load_reference("pdb_eight_schools")
    assert p.moments["mu"].mean.item() == ref["mu"]["mean"]
    assert p.moments["theta"].sd[7].item() == ref["theta[8]"]["sd"]
    values = {k: v for k, v in _means(p).items() if k != "theta" or centered}
    tr = _trace(poutine.condition(p.model, data=values), *p.args, **p.kwargs)
    assert torch.isfinite(tr.log_prob_sum())
    if not centered:
        assert p.moments["theta_trans"].mean[0].item() == ref["theta_trans[1]"]["mean"]
        expected_theta = values["mu"] + values["tau"] * values["theta_trans"]
        assert torch.allclose(tr.nodes["theta"]["value"], expected_theta)


def test_eight_schools_subsample():
    p = eight_schools(centered=True)
    means = _means(p)
    full = _log_joint(p, means)
    idx = torch.tensor([6, 1, 3, 0, 7, 2, 5, 4])
    assert torch.allclose(_log_joint(p, dict(means, theta=means["theta"][idx]), subsample=idx), full, rtol=1e-12)
    total = sum(_log_joint(p, dict(means, theta=means["theta"][[j]]), subsample=torch.tensor([j])) for j in range(8))
    assert torch.allclose(total / 8, full, rtol=1e-12)

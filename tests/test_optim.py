"""IterateAverage: the running mean is the arithmetic mean of the iterates (in unconstrained space), it is written
back into the guide, bad use is refused, and on a conjugate model the averaged guide lands within the Monte Carlo
error of the average of the exact posterior mean."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch.distributions import transform_to

from pyro_hier.optim import IterateAverage


def _conjugate(x):
    z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(z, 1.0), obs=x)


def test_the_average_is_the_mean_of_the_unconstrained_iterates_and_apply_writes_it_back():
    pyro.clear_param_store()
    x = torch.tensor([0.3, -1.2, 2.0])
    guide = AutoNormal(_conjugate)
    guide(x)
    average = IterateAverage(guide)
    locs, raw_scales = [], []
    for value in (0.5, -1.0, 2.0, 4.5):
        with torch.no_grad():
            guide.locs.z_unconstrained.fill_(value)
            guide.scales.z_unconstrained.fill_(-value)  # the positive scale's unconstrained value
        locs.append(value)
        raw_scales.append(-value)
        average.update()
    assert average.count == 4
    average.apply()
    loc, scale = float(guide.locs.z.detach()), float(guide.scales.z.detach())
    assert loc == pytest.approx(sum(locs) / 4)
    # averaged in unconstrained space: the scale is the map of the mean, not the mean of the scales
    to_scale = transform_to(guide.scale_constraint)
    assert scale == pytest.approx(float(to_scale(torch.tensor(sum(raw_scales) / 4))), rel=1e-6)
    assert scale != pytest.approx(sum(float(to_scale(torch.tensor(r))) for r in raw_scales) / 4)
    # the param store holds the same tensors
    assert float(pyro.param("AutoNormal.locs.z").detach()) == pytest.approx(sum(locs) / 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_averaged_guide_is_within_the_batch_means_error_of_the_exact_posterior_mean(dtype):
    # z ~ N(0, 1), x_i ~ N(z, 1): q(z) = N(m, s) is exact at m = sum(x) / (n + 1), s = (n + 1)^-1/2. Adam at a
    # constant rate leaves the iterates scattered around the optimum; their average must sit within a few
    # standard errors (batch means over the window) of m, where the last iterate typically does not.
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x = torch.linspace(-1.0, 3.0, 20, dtype=dtype)
    exact_mean = float(x.sum() / (len(x) + 1))
    guide = AutoNormal(_conjugate, init_scale=0.2)
    svi = SVI(_conjugate, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(300):
        svi.step(x)
    average = IterateAverage(guide)
    trace = []
    for _ in range(1000):
        svi.step(x)
        average.update()
        trace.append(float(guide.locs.z.detach()))
    last = trace[-1]
    average.apply()
    assert guide.locs.z.dtype == dtype
    batch_means = torch.tensor(trace, dtype=torch.float64).reshape(20, 50).mean(-1)
    se = float(batch_means.std() / math.sqrt(20))
    iterate_sd = float(torch.tensor(trace).std())
    assert se < 0.5 * iterate_sd, "the window is too short to average out the scatter"
    averaged = float(guide.locs.z.detach())
    assert abs(averaged - exact_mean) < 4 * se + 1e-3
    assert averaged == pytest.approx(sum(trace) / len(trace), abs=1e-5)
    assert last != pytest.approx(averaged, abs=1e-6)


def test_bad_use_is_refused_with_a_clear_error():
    pyro.clear_param_store()
    x = torch.tensor([0.3, -1.2])
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        IterateAverage(lambda: None)
    guide = AutoNormal(_conjugate)
    average = IterateAverage(guide)
    with pytest.raises(ValueError, match="no parameters yet"):
        average.update()
    with pytest.raises(ValueError, match="never called"):
        average.apply()
    guide(x)
    average.update()
    guide.extra = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"new: \['extra'\]"):
        average.update()

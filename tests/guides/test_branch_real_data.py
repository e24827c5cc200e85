"""AutoBranchGuide on real data against long-run NUTS references."""

import math

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_hier import AutoBranchGuide
from pyro_hier.diagnostics import posterior_moments
from pyro_hier.problems import eight_schools, radon_mn


def test_eight_schools_means_within_a_quarter_reference_sd():
    """Non-centred eight schools (the parameterisation one fits with VI; the centred funnel defeats every Gaussian
    family, dense branch included): posterior means of mu and theta within 0.25 posteriordb reference sd."""
    p = eight_schools(centered=False)
    guide = AutoBranchGuide(p.model)
    steps = 1500
    optim = pyro.optim.ClippedAdam({"lr": 0.02, "lrd": 0.05 ** (1 / steps)})
    svi = SVI(p.model, guide, optim, Trace_ELBO(num_particles=8, vectorize_particles=True))
    for _ in range(steps):
        svi.step(*p.args, **p.kwargs)
    q = posterior_moments(p.model, guide, ["mu", "theta"], p.args, p.kwargs, num_samples=20000)
    for name in ("mu", "theta"):
        ref = p.moments[name]
        err = (q[name].mean.reshape(ref.mean.shape) - ref.mean).abs() / ref.sd
        assert err.max() < 0.25, (name, err)


def test_radon_long_run_float32_has_no_nan():
    """5,000 steps (the drop-in loop's length; 8,000 before the eighth session, which the suite's time could not keep)
    in float32 on radon with Uniform(0, 100) scale priors (interval supports, a funnel between the county effects and
    their scale): every loss and parameter stays finite."""
    p = radon_mn(prior="uniform", dtype=torch.float32)
    guide = AutoBranchGuide(p.model)
    steps = 5000
    svi = SVI(p.model, guide, pyro.optim.ClippedAdam({"lr": 0.02, "lrd": 0.1 ** (1 / steps)}), Trace_ELBO())
    for step in range(steps):
        loss = svi.step(*p.args, **p.kwargs)
        assert math.isfinite(loss), f"loss {loss} at step {step}"
    for name, value in guide.named_parameters():
        assert value.dtype == torch.float32 and torch.isfinite(value).all(), name
    median = guide.median(*p.args, **p.kwargs)
    assert all(torch.isfinite(v).all() for v in median.values())
    # and it is near the reference for the well-determined globals
    ref = p.moments["weight"]
    assert ((median["weight"].double() - ref.mean).abs() / ref.sd).max() < 0.5

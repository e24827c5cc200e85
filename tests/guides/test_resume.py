"""Checkpoint and resume: guide parameters, optimiser state and RNG state saved mid-run reproduce the uninterrupted
run exactly (the recipe is in the README, "Checkpoint and resume")."""

import io

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide, AutoPlateAmortizedFlow
from pyro_hier.problems import synthetic_regression

MAKERS = {
    "branch": lambda p: AutoBranchGuide(p.model),
    "branch-stl": lambda p: AutoBranchGuide(p.model, stick_the_landing=True),
    "amortized": lambda p: AutoAmortizedBranchGuide(
        p.model, local_features=p.local_features, feature_net=(16, 8), param_net=(32,)
    ),
    "pavi": lambda p: AutoPlateAmortizedFlow(p.model),  # its tail average is state and resumes too
}


def run(p, guide, optim, steps, batches):
    svi = SVI(p.model, guide, optim, Trace_ELBO())
    return [svi.step(*p.args, subsample=batches.pop(0)) for _ in range(steps)]


@pytest.mark.parametrize("make", MAKERS.values(), ids=MAKERS.keys())
def test_resume_reproduces_the_uninterrupted_run(make):
    p = synthetic_regression(num_groups=30, num_obs=8, dim=3, seed=0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randperm(30, generator=g)[:10].sort().values for _ in range(20)]

    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    guide = make(p)
    optim = pyro.optim.ClippedAdam({"lr": 0.01})
    straight = run(p, guide, optim, 20, list(batches))
    final = {k: v.detach().clone() for k, v in guide.named_parameters()}

    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    guide = make(p)
    optim = pyro.optim.ClippedAdam({"lr": 0.01})
    rest = list(batches)
    first = run(p, guide, optim, 10, rest)
    buffer = io.BytesIO()
    torch.save({"guide": guide.state_dict(), "optim": optim.get_state(), "rng": pyro.util.get_rng_state()}, buffer)

    # a new process: fresh param store, fresh guide built on a call, then everything loaded
    pyro.clear_param_store()
    pyro.set_rng_seed(123)
    checkpoint = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    resumed = make(p)
    resumed(*p.args, subsample=rest[0])  # build the parameters (consumes random numbers; the RNG state is reset next)
    resumed.load_state_dict(checkpoint["guide"])
    optim = pyro.optim.ClippedAdam({"lr": 0.01})
    optim.set_state(checkpoint["optim"])
    pyro.util.set_rng_state(checkpoint["rng"])
    second = run(p, resumed, optim, 10, rest)

    assert first + second == pytest.approx(straight, rel=1e-12, abs=1e-9)
    for k, v in resumed.named_parameters():
        torch.testing.assert_close(v, final[k], rtol=0, atol=1e-12)

"""IterateAverage: the running mean is the arithmetic mean of the iterates (in unconstrained space), it is written
back into the guide, bad use is refused, and on a conjugate model the averaged guide lands within the Monte Carlo
error of the average of the exact posterior mean.

LazyAdam / LazyClippedAdam: the dense optimiser's result to rounding when every row is touched on every step; rows not
touched stay bit-identical and each row follows the dense optimiser on the steps that touched it; SVI with a branch
guide gets sparse gradients; the state round-trips."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch.distributions import transform_to

from pyro_hier.optim import IterateAverage, LazyAdam, LazyClippedAdam
from pyro_hier.sparse import select_elements


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


# ---- LazyAdam / LazyClippedAdam -------------------------------------------------------------------------------------
def _dense_twin(kind, params, lr):
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return pyro.optim.clipped_adam.ClippedAdam(params, lr=lr, clip_norm=0.5, lrd=0.99)


def _lazy(kind, params, lr):
    if kind == "adam":
        return LazyAdam(params, lr=lr)
    return LazyClippedAdam(params, lr=lr, clip_norm=0.5, lrd=0.99)


def _loss(rows, target, weight):
    return ((rows - target) ** 2 * weight).sum() + (rows**3).sum() * 0.1


@pytest.mark.parametrize("kind", ["adam", "clipped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lazy_adam_equals_the_dense_optimiser_when_every_row_is_touched(kind, dtype):
    # every step reads every row (in a new order) through select_elements, so the gradient is sparse over all rows;
    # the dense twin reads them by plain indexing and gets the dense gradient
    g = torch.Generator().manual_seed(0)
    init = torch.randn(6, 1, 2, 2, generator=g, dtype=dtype)
    lazy = torch.nn.Parameter(init.clone())
    dense = torch.nn.Parameter(init.clone())
    glob_lazy = torch.nn.Parameter(torch.ones(2, dtype=dtype))
    glob_dense = torch.nn.Parameter(torch.ones(2, dtype=dtype))
    opt_lazy, opt_dense = _lazy(kind, [lazy, glob_lazy], 0.05), _dense_twin(kind, [dense, glob_dense], 0.05)
    for _ in range(25):
        order = torch.randperm(6, generator=g)
        target = torch.randn(6, 1, 2, 2, generator=g, dtype=dtype)
        weight = torch.rand(6, 1, 2, 2, generator=g, dtype=dtype) * 4
        for glob, opt, rows in (
            (glob_lazy, opt_lazy, select_elements(lazy, {-2: order}, 2)),
            (glob_dense, opt_dense, dense[order]),
        ):
            opt.zero_grad()
            _loss(rows * glob[0], target[order], weight[order]).backward()
            opt.step()
        assert opt_lazy.state[lazy]["step"].shape == (6,)
    tol = {"rtol": 1e-12, "atol": 1e-13} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-6}
    torch.testing.assert_close(lazy.detach(), dense.detach(), **tol)
    torch.testing.assert_close(glob_lazy.detach(), glob_dense.detach(), **tol)
    assert not torch.equal(lazy.detach(), init)


@pytest.mark.parametrize("kind", ["adam", "clipped"])
def test_untouched_rows_stay_bit_identical_and_each_row_follows_adam_on_the_steps_that_touched_it(kind):
    # the documented semantics: a row not in the minibatch keeps its value, moments and step count, so row r is
    # exactly a dense optimiser on row r alone, stepped only when r is in the minibatch (with the same lr schedule)
    g = torch.Generator().manual_seed(1)
    N, steps = 8, 30
    init = torch.randn(N, 3, generator=g, dtype=torch.float64)
    lazy = torch.nn.Parameter(init.clone())
    opt = _lazy(kind, [lazy], 0.1)
    twins = [torch.nn.Parameter(init[r].clone()) for r in range(N)]
    twin_opts = [_dense_twin(kind, [t], 0.1) for t in twins]
    seen = torch.zeros(N, dtype=torch.bool)
    for _ in range(steps):
        batch = torch.randperm(N - 1, generator=g)[:3]  # row N - 1 is never touched
        target = torch.randn(N, 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        _loss(select_elements(lazy, {-1: batch}, 1), target[batch], 1.0).backward()
        opt.step()
        for r in range(N):
            if r in batch.tolist():
                twin_opts[r].zero_grad()
                _loss(twins[r], target[r], 1.0).backward()
                twin_opts[r].step()
            elif kind == "clipped":  # the learning rate decays with every step of the optimiser, touched or not
                twin_opts[r].param_groups[0]["lr"] *= 0.99
        seen[batch] = True
    assert seen[: N - 1].all()
    assert torch.equal(lazy.detach()[N - 1], init[N - 1])
    assert int(opt.state[lazy]["step"][N - 1]) == 0
    for r in range(N - 1):
        torch.testing.assert_close(lazy.detach()[r], twins[r].detach(), rtol=1e-12, atol=1e-13)


def test_svi_with_a_branch_guide_gets_sparse_gradients_and_leaves_unseen_groups_untouched():
    from pyro_hier import AutoBranchGuide
    from pyro_hier.optim import ClippedAdam
    from pyro_hier.problems import synthetic_regression

    p = synthetic_regression(num_groups=40, num_obs=5, dim=2, seed=0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randperm(30, generator=g)[:6] for _ in range(6)]  # groups 30..39 are never in a batch

    def fit(densify: bool):
        pyro.clear_param_store()
        pyro.set_rng_seed(3)
        guide = AutoBranchGuide(p.model, conditional="linear")
        guide(*p.args, subsample=batches[0])
        init = {k: v.detach().clone() for k, v in guide.named_parameters()}
        optim = ClippedAdam({"lr": 0.05})
        elbo = Trace_ELBO()
        layouts = []
        for idx in batches:
            loss = elbo.differentiable_loss(p.model, guide, *p.args, subsample=idx)
            loss.backward()
            state = {id(v) for v in guide.state_parameters().values()}  # (no gradient: not optimised)
            params = [v for _, v in guide.named_parameters() if id(v) not in state]
            layouts.append(guide.locs.groups.grad.layout if not densify else None)
            if densify:  # the optimiser's dense path: rows with a zero gradient are taken as not touched
                for v in params:
                    v.grad = v.grad.to_dense()
            optim(params)
            pyro.infer.util.zero_grads(params)
        return guide, init, layouts

    guide, init, layouts = fit(densify=False)
    # the first backward ran before the optimiser existed (dense); from then on the rows come sparse
    assert layouts[0] == torch.strided and all(layout == torch.sparse_coo for layout in layouts[1:])
    for name, value in guide.named_parameters():
        if name.endswith("groups"):
            assert torch.equal(value.detach()[30:], init[name][30:]), name
            assert not torch.equal(value.detach()[:30], init[name][:30]), name
    reference, _, _ = fit(densify=True)
    for (name, a), (_, b) in zip(guide.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=name)


def test_lazy_optimiser_state_round_trips_through_pyro_get_state():
    from pyro_hier import AutoBranchGuide
    from pyro_hier.optim import Adam
    from pyro_hier.problems import synthetic_regression

    p = synthetic_regression(num_groups=20, num_obs=4, dim=2, seed=0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randperm(20, generator=g)[:5] for _ in range(8)]

    def run(guide, optim, todo):
        svi = SVI(p.model, guide, optim, Trace_ELBO())
        for idx in todo:
            svi.step(*p.args, subsample=idx)

    pyro.set_rng_seed(0)
    guide = AutoBranchGuide(p.model, conditional="linear")
    run(guide, Adam({"lr": 0.05}), batches)
    straight = {k: v.detach().clone() for k, v in guide.named_parameters()}

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoBranchGuide(p.model, conditional="linear")
    optim = Adam({"lr": 0.05})
    run(guide, optim, batches[:4])
    state, params, rng = optim.get_state(), guide.state_dict(), pyro.util.get_rng_state()
    pyro.clear_param_store()
    resumed = AutoBranchGuide(p.model, conditional="linear")
    resumed(*p.args, subsample=batches[4])
    resumed.load_state_dict(params)
    optim = Adam({"lr": 0.05})
    optim.set_state(state)
    pyro.util.set_rng_state(rng)
    run(resumed, optim, batches[4:])
    for name, value in resumed.named_parameters():
        assert torch.equal(value.detach(), straight[name]), name


def test_lazy_adam_refuses_bad_options():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="lr"):
        LazyAdam([p], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        LazyAdam([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="clip_norm"):
        LazyClippedAdam([p], clip_norm=0.0)
    with pytest.raises(ValueError, match="lrd"):
        LazyAdam([p], lrd=1.5)

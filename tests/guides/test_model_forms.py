"""Forms of models users write that the drop-in problems do not: a flat plate of observations that Pyro subsamples
at random, a global sampled after the groups' plate, crossed plates with one subsampled, plate names that are
module attributes, and the replay of Pyro's random subsamples. Each guide does the work where a family exists, and
gives a clear error naming the level, the plate and the fix where it cannot."""

import functools
import math
import pickle
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, JitTrace_ELBO, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal

from pyro_hier import (
    AutoAmortizedBranchGuide,
    AutoBranchGuide,
    AutoHierarchicalVM,
    AutoPlateAmortizedFlow,
    StructureError,
    conjugate,
)
from pyro_hier.conjugate import levels_expansion
from pyro_hier.guides.amortized import ROW_EXPANSION_EVERY
from pyro_hier.guides.pavi import ROW_REFERENCE_MOVE
from pyro_hier.plates import ReplaySubsamples, capture_plates

USERS, ITEMS = 6, 4
GUIDES = [AutoBranchGuide, AutoAmortizedBranchGuide, AutoPlateAmortizedFlow, AutoHierarchicalVM]


def ratings() -> torch.Tensor:
    return torch.randn(ITEMS, USERS, generator=torch.Generator().manual_seed(0))


def drawn_model(y):
    """Items crossed with users; Pyro draws 3 of the 6 users at random on every call."""
    with pyro.plate("items", ITEMS, dim=-2):
        v = pyro.sample("v", dist.Normal(0.0, 1.0))
    with pyro.plate("users", USERS, subsample_size=3, dim=-1) as i:
        u = pyro.sample("u", dist.Normal(0.0, 1.0))
        with pyro.plate("rated", ITEMS, dim=-2):
            pyro.sample("y", dist.Normal(u + v, 1.0), obs=y[:, i])


def given_model(y, idx=None):
    """:func:`drawn_model` with the users' indices an argument (``None``: all of them), the fix the errors name."""
    with pyro.plate("items", ITEMS, dim=-2):
        v = pyro.sample("v", dist.Normal(0.0, 1.0))
    with pyro.plate("users", USERS, subsample=idx, dim=-1) as i:
        u = pyro.sample("u", dist.Normal(0.0, 1.0))
        with pyro.plate("rated", ITEMS, dim=-2):
            pyro.sample("y", dist.Normal(u + v, 1.0), obs=y[:, i])


def train(guide, model, *args, steps=3):
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    for _ in range(steps):
        assert torch.isfinite(torch.as_tensor(svi.step(*args)))


@pytest.mark.parametrize("Guide", GUIDES, ids=lambda g: g.__name__)
def test_a_plate_named_like_a_module_attribute_and_crossed_levels_with_given_subsamples(Guide):
    """A plate named ``"items"`` (an attribute of ``nn.ModuleDict``, which refuses it as a key) builds, trains on
    minibatches of users given as an argument, draws through ``Predictive`` and summarises every user; the amortized
    guide of this model has no parameters at all (both crossed levels are conjugate), and still knows its dtype."""
    pyro.clear_param_store()
    y = ratings()
    guide = Guide(given_model)
    train(guide, given_model, y, torch.tensor([0, 2, 4]))
    assert Predictive(given_model, guide=guide, num_samples=2)(y, torch.tensor([1, 3]))["u"].shape == (2, 1, 2)
    median = guide.median(y)
    assert median["v"].shape == (ITEMS, 1) and median["u"].shape == (USERS,)


def test_branch_summaries_of_a_level_outside_a_plate_drawn_at_random_name_it_and_the_fix():
    """The branch guide trains on the drawn users (the items' q reads the minibatch, scaled), but its median of the
    items would read one block of users' data: refused, naming the level, the plate and the fix."""
    pyro.clear_param_store()
    guide = AutoBranchGuide(drawn_model)
    train(guide, drawn_model, ratings())
    with pytest.raises(StructureError, match=r"level 'items'.*plate 'users'.*subsample=idx"):
        guide.median(ratings())


def test_amortized_expansion_of_a_level_whose_data_span_a_plate_drawn_at_random_names_it_and_the_fix():
    """The amortized guide expands each item's likelihood over all its users, which Pyro cannot open when it draws
    them at random: refused on the first call, naming the level, the plate and the fix."""
    pyro.clear_param_store()
    guide = AutoAmortizedBranchGuide(drawn_model)
    with pytest.raises(StructureError, match=r"level 'items'.*plate 'users'.*subsample=idx.*AutoBranchGuide"):
        train(guide, drawn_model, ratings(), steps=1)


def test_replay_subsamples_gives_drawn_plates_their_indices_and_leaves_the_others():
    """Plates Pyro would draw take the given indices; a plate the model gives its own indices, and a plate not
    listed, keep theirs; indices of the wrong length are Pyro's own error."""

    def model(idx):
        with pyro.plate("a", 10, subsample_size=3) as a:
            pass
        with pyro.plate("b", 8, subsample=idx) as b:
            pass
        with pyro.plate("c", 5, subsample_size=2) as c:
            pass
        return a, b, c

    want_a = torch.tensor([7, 1, 4])
    with ReplaySubsamples({"a": want_a, "b": torch.tensor([0, 1])}):
        a, b, c = model(torch.tensor([5, 6]))
    assert torch.equal(a, want_a) and torch.equal(b, torch.tensor([5, 6])) and c.shape == (2,)
    calls = capture_plates(lambda: model(None), subsamples={"a": want_a})
    assert torch.equal(calls["a"].indices, want_a) and calls["b"].indices.shape == (8,)
    with pytest.raises(ValueError, match="subsample_size does not match"), ReplaySubsamples({"a": torch.arange(4)}):
        model(None)


J, N = 8, 200


def homes():
    g = torch.Generator().manual_seed(1)
    county = torch.randint(0, J, (N,), generator=g)
    return county, torch.randn(J, generator=g)[county] + 0.5 * torch.randn(N, generator=g)


def flat_drawn_model(county, y):
    """Pyro's usual big-data form: county effects gathered in a flat plate of homes, 50 of 200 drawn at random on
    every call, the noise scale sampled after the counties."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    with pyro.plate("counties", J):
        a = pyro.sample("a", dist.Normal(mu, tau))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", N, subsample_size=50) as i:
        pyro.sample("y", dist.Normal(a[..., county[i]], sigma), obs=y[i])


def late_noise_model(county, y):
    """Counties gathered by the homes (all of them), the noise scale sampled after the counties."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    with pyro.plate("counties", J):
        a = pyro.sample("a", dist.Normal(mu, 1.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("data", N):
        pyro.sample("y", dist.Normal(a[..., county], sigma), obs=y)


def homes_model(size, homes=203, noise=None):
    """Counties gathered by ``homes`` homes, ``size`` of them drawn at random a call (``None``: all); the noise scale
    sampled after the counties, or fixed at ``noise``."""

    def model(county, y):
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = pyro.sample("tau", dist.HalfNormal(1.0))
        with pyro.plate("counties", J):
            a = pyro.sample("a", dist.Normal(mu, tau))
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0)) if noise is None else noise
        with pyro.plate("data", homes, subsample_size=size) as i:
            pyro.sample("y", dist.Normal(a[..., county[i]], sigma), obs=y[i])

    return model


def homes_203() -> tuple[torch.Tensor, torch.Tensor]:
    """Counties and responses of 203 homes (not a multiple of the 50 drawn a call: the last block wraps around)."""
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, J, (203,), generator=g), torch.randn(203, generator=g)


@pytest.mark.parametrize("Guide", GUIDES, ids=lambda g: g.__name__)
def test_a_flat_plate_of_observations_drawn_at_random_is_the_guides_draw(Guide):
    """The guides open the plate of homes the model draws at random, as Pyro's subsampling contract has it, so the
    model scores the rows the guide's own runs of the model read (the branch guide's references read another draw
    before: its loss reached NaN within 5 steps; the amortized guide refused the model)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    county, y = homes()
    guide = Guide(flat_drawn_model)
    trace = poutine.trace(guide).get_trace(county, y)
    model_trace = poutine.trace(poutine.replay(flat_drawn_model, trace=trace)).get_trace(county, y)
    assert torch.equal(model_trace.nodes["data"]["value"], trace.nodes["data"]["value"])
    train(guide, flat_drawn_model, county, y, steps=30)
    median = guide.median(county, y)
    assert median["a"].shape == (J,) and all(torch.isfinite(v).all() for v in median.values())


def test_pavi_with_a_global_sampled_after_the_groups():
    """PAVI samples in the model's order; a county's q0 moves along the globals drawn before it (``sigma``, drawn
    after, stands at the reference) instead of failing on the missing global."""
    pyro.clear_param_store()
    county, y = homes()

    model = late_noise_model
    guide = AutoPlateAmortizedFlow(model)
    train(guide, model, county, y, steps=5)
    assert guide.median(county, y)["a"].shape == (J,)


@pytest.mark.parametrize(
    "Guide", [AutoBranchGuide, AutoPlateAmortizedFlow, AutoHierarchicalVM], ids=lambda g: g.__name__
)
def test_a_flat_plate_drawn_at_random_in_compiled_steps(Guide):
    """Under ``JitTrace_ELBO`` the guides train on the rows drawn at random (PAVI's expansions, read from every row
    and kept across draws, are held by the compiled step as on other models)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    county, y = homes()
    guide = Guide(flat_drawn_model)
    svi = SVI(flat_drawn_model, guide, pyro.optim.Adam({"lr": 0.01}), JitTrace_ELBO())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # (and the tracer's warnings on the drawn indices)
        assert all(math.isfinite(svi.step(county, y)) for _ in range(5))
    said = any("rows the model draws at random" in str(w.message) for w in seen)
    assert said == (Guide is AutoBranchGuide)  # (its counties are set by references only in eager calls: said)


def test_a_part_of_a_guide_list_reads_the_sites_hidden_from_it_at_the_other_parts_medians():
    """In an ``AutoGuideList`` whose branch part has the noise scale hidden (``poutine.block``), the part's runs of
    the model (its references, the rows' expansion) take ``sigma`` at the other part's median on that call, not a
    prior draw: on homes drawn at random the loss then falls as the branch guide's alone does (before: 10⁶ on the
    first steps from prior draws of ``sigma``, then NaN)."""
    county, y = homes()
    model = flat_drawn_model
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guides = AutoGuideList(model)
    guides.append(AutoBranchGuide(poutine.block(model, hide=["sigma"])))
    guides.append(AutoNormal(poutine.block(model, expose=["sigma"])))
    svi = SVI(model, guides, pyro.optim.ClippedAdam({"lr": 0.02}), Trace_ELBO())
    losses = [svi.step(county, y) for _ in range(80)]  # (references redone at call 40: loss about 300 → 190)
    branch, normal = guides[0], guides[1]
    guides(county, y)  # (read once a call: the values of this call)
    assert branch.hidden_values((county, y), {}).keys() == {"sigma"}
    torch.testing.assert_close(branch.hidden_values((county, y), {})["sigma"], normal.median()["sigma"])
    assert all(math.isfinite(x) for x in losses)
    assert max(losses[:10]) < 1e3 and sum(losses[-30:]) / 30 < 250


@pytest.mark.parametrize("Guide", [AutoBranchGuide, AutoAmortizedBranchGuide], ids=lambda g: g.__name__)
def test_what_the_guides_read_of_the_likelihood_covers_every_row_of_a_plate_drawn_at_random(Guide):
    """The branch guide's references of the counties (prior conditional times the likelihood's expansion), and the
    amortized guide's expansions, read all 203 homes block by block (4 blocks of 50 and one that wraps around,
    masked), not the 50 of the call: the same, to rounding, as on the model that opens every home (the amortized
    guide's are kept across calls, not redone for each draw); q of a county then does not depend on the minibatch
    (benchmarks/dropin.py radon-rows, seed 0: max error 1.27 before, 1.18 after; AutoNormal 0.78). The branch guide
    also keeps the rows' expansion for its control variate (the ``__rows_`` references)."""
    county, y = homes_203()

    references = []
    for size in (None, 50):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = Guide(homes_model(size))
        guide(county, y)
        read = {n: p.detach() for n, p in guide.named_parameters() if n.startswith("references.")}
        if Guide is AutoAmortizedBranchGuide:
            made = guide._expansion_cache[3]["counties"]
            read.update({f"expansion {k}": t for k, t in enumerate(made[:2])})
            guide(county, y)  # another draw of the homes: the same expansions, not redone
            assert guide._expansion_cache[3]["counties"] is made
        references.append(read)
    rows = {n for n in references[1] if "__rows_" in n}  # (the rows' control variate: on rows drawn at random only)
    assert references[0].keys() == references[1].keys() - rows
    assert bool(rows) == (Guide is AutoBranchGuide)
    for name, value in references[0].items():
        torch.testing.assert_close(references[1][name], value, rtol=1e-4, atol=1e-4, msg=name)


def test_pavi_expansions_cover_every_row_of_a_plate_drawn_at_random():
    """PAVI's pseudo-observations of the counties read all 203 homes block by block, equal to rounding to those on
    the model that opens every home, and are kept across draws of the homes (they were redone from each call's 50
    homes before: radon-rows max error 10.3 against AutoNormal's 0.78). The noise scale is fixed: PAVI's initial
    globals depend on the random stream, which the draw of homes moves, and the expansion is exact in the counties
    whatever the globals only at a fixed noise scale."""
    county, y = homes_203()

    made = []
    for size in (None, 50):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoPlateAmortizedFlow(homes_model(size, noise=0.7))
        guide(county, y)
        made.append(guide._expansion[1]["a"])
        guide(county, y)
        assert guide._expansion[1]["a"] is made[-1]
    for full, blocks in zip(made[0][:2], made[1][:2], strict=True):
        torch.testing.assert_close(blocks, full, rtol=1e-4, atol=1e-4)


def test_branch_rows_control_variate_is_unbiased_and_takes_out_the_rows_noise(monkeypatch):
    """On rows drawn at random the branch guide's counties are set by their references (read from every row) and the
    ELBO's gradient carries the rows' control variate (:meth:`AutoBranchGuide._row_variate_term`): over many calls
    at fixed parameters and references, the gradient in the globals' location has the same mean with and without it
    (within 4 Monte Carlo standard errors), and under half its variance without it, summed over the coordinates
    (each under 0.8 of it: the noise scale's, first-order in the globals, is reduced least). Radon-rows, seed 0: max
    error 1.18 before the counties were set by their references, 0.43 after, 0.17 with this variate (AutoNormal
    0.78)."""
    county, y = homes_203()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = homes_model(20)
    guide = AutoBranchGuide(model)
    train(guide, model, county, y, steps=12)  # (the references, with the rows' expansion, are made on the first call)
    assert guide._row_levels == frozenset({"counties"})
    loc = guide.locs.globals
    monkeypatch.setattr(AutoBranchGuide, "_refresh_references", lambda self, *a: None)  # (q and the variate held)

    def gradients() -> torch.Tensor:
        out = []
        for _ in range(100):
            loss = Trace_ELBO().differentiable_loss(model, guide, county, y)
            out.append(torch.autograd.grad(loss, loc)[0])
        return torch.stack(out).double()

    with_variate = gradients()
    monkeypatch.setattr(AutoBranchGuide, "_row_variate_applies", lambda self, *a: False)
    without = gradients()
    error = (with_variate.var(0) / 100 + without.var(0) / 100).sqrt()
    assert ((with_variate.mean(0) - without.mean(0)).abs() < 4 * error).all(), (with_variate.mean(0), without.mean(0))
    ratio = with_variate.var(0) / without.var(0)  # (0.22, 0.14, 0.56 when written)
    assert ratio.max() < 0.8 and with_variate.var(0).sum() < 0.5 * without.var(0).sum(), ratio


STUDENTS, QUESTIONS, ANSWERED = 12, 5, 4


def answers() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Students crossed with questions (each student answers 4 of 5), Bernoulli answers: 48 rows."""
    g = torch.Generator().manual_seed(4)
    student = torch.arange(STUDENTS).repeat_interleave(ANSWERED)
    question = torch.stack([torch.randperm(QUESTIONS, generator=g)[:ANSWERED] for _ in range(STUDENTS)]).reshape(-1)
    logits = torch.randn(STUDENTS, generator=g)[student] - torch.randn(QUESTIONS, generator=g)[question]
    return student, question, torch.bernoulli(torch.sigmoid(logits), generator=g)


def crossed_rows_model(student, question, y, rows=12):
    """An item-response model as users write it: abilities and difficulties gathered in a flat plate of answers,
    ``rows`` of them drawn at random a call (``None``: all); a global intercept in the likelihood."""
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("students", STUDENTS):
        a = pyro.sample("a", dist.Normal(0.0, sigma))
    with pyro.plate("questions", QUESTIONS):
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("answers", len(y), subsample_size=rows) as i:
        pyro.sample("y", dist.Bernoulli(logits=mu + a[..., student[i]] - b[..., question[i]]), obs=y[i])


def test_levels_expansion_of_crossed_levels_is_the_exact_hessian():
    """``levels_expansion`` on the crossed model's rows (all 48), from one run: each level's gradient and curvature
    blocks, the globals' gradient and curvature and each level's cross curvature with them are those of autograd's
    Hessian of the log likelihood in (a, b, mu, log sigma), and each product ``Fδ`` is the Hessian's, less the blocks
    between the two crossed levels, which are not read."""
    student, question, y = answers()
    g = torch.Generator().manual_seed(5)
    a, b, v = torch.randn(STUDENTS, 1, generator=g), torch.randn(QUESTIONS, 1, generator=g), torch.randn(2, generator=g)

    def likelihood(a, b, v):  # (sigma, v[1], reads only the prior of a, which is left out: its row and column are 0)
        logits = v[0] + a[student, 0] - b[question, 0]
        return dist.Bernoulli(logits=logits).log_prob(y).sum()

    def unpack(x):
        return x[: STUDENTS * 1].reshape(STUDENTS, 1), x[STUDENTS : STUDENTS + QUESTIONS].reshape(QUESTIONS, 1), x[-2:]

    x = torch.cat([a.reshape(-1), b.reshape(-1), v])
    hessian = torch.autograd.functional.hessian(lambda x: likelihood(*unpack(x)), x)
    gradient = torch.autograd.functional.jacobian(lambda x: likelihood(*unpack(x)), x)
    sa, sb = slice(0, STUDENTS), slice(STUDENTS, STUDENTS + QUESTIONS)
    model = functools.partial(crossed_rows_model, rows=None)
    levels = [(a, lambda u: {"a": u[..., 0]}), (b, lambda u: {"b": u[..., 0]})]
    to_globals = lambda u: {"mu": u[0], "sigma": u[1].exp()}  # noqa: E731
    grads, curvatures, g_v, f_vv, crosses = levels_expansion(
        model, (student, question, y), {}, {}, levels, v, to_globals, 1.0
    )
    torch.testing.assert_close(grads[0][:, 0], gradient[sa])
    torch.testing.assert_close(grads[1][:, 0], gradient[sb])
    torch.testing.assert_close(g_v, gradient[-2:])
    torch.testing.assert_close(curvatures[0][:, 0, 0], -hessian[sa, sa].diagonal())
    torch.testing.assert_close(curvatures[1][:, 0, 0], -hessian[sb, sb].diagonal())
    torch.testing.assert_close(f_vv, -hessian[-2:, -2:])
    torch.testing.assert_close(crosses[0][:, 0], -hessian[sa, -2:])
    torch.testing.assert_close(crosses[1][:, 0], -hessian[sb, -2:])
    da, db, dv = (torch.randn(t.shape, generator=g) for t in (a, b, v))
    directions = [((da, None), dv), ((None, db), None)]
    args = (student, question, y)
    _, _, products = levels_expansion(model, args, {}, {}, levels, v, to_globals, 1.0, directions=directions)
    (pa, _), pv_a = products[0]
    (_, pb), pv_b = products[1]
    torch.testing.assert_close(pa[:, 0], -(hessian[sa, sa] @ da[:, 0] + hessian[sa, -2:] @ dv))
    torch.testing.assert_close(pb[:, 0], -(hessian[sb, sb] @ db[:, 0]))
    torch.testing.assert_close(
        pv_a + pv_b, -(hessian[-2:, sa] @ da[:, 0] + hessian[-2:, -2:] @ dv + hessian[-2:, sb] @ db[:, 0])
    )  # (the globals' part: every level's cross term, from the product of each)


def test_branch_rows_control_variate_of_crossed_levels_is_one_run_and_unbiased(monkeypatch):
    """Students crossed with questions, 12 of 48 answers drawn a call: both levels are set by their references and
    the rows' control variate of both, and of the globals, comes from *one* run of the model on the call's rows (a
    run per level before: 40% of a step of ``unseen.py``'s irt with 100 of 480 answers drawn); over many calls at fixed
    parameters and references the gradient in the globals' location has the same mean with and without it (within 4
    Monte Carlo standard errors) and under 0.6 of its variance without it in each coordinate."""
    student, question, y = answers()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoBranchGuide(crossed_rows_model)
    train(guide, crossed_rows_model, student, question, y, steps=12)
    assert guide._row_levels == frozenset({"students", "questions"})
    ready = [float(getattr(guide.references, f"{n}__rows_ready").detach()) for n in ("students", "questions")]
    assert ready == [1.0, 1.0]
    loc = guide.locs.globals
    monkeypatch.setattr(AutoBranchGuide, "_refresh_references", lambda self, *a: None)  # (q and the variate held)
    runs = []
    monkeypatch.setattr(conjugate, "rest_log_density", _counted(conjugate.rest_log_density, runs))

    def gradients() -> torch.Tensor:
        out = []
        for _ in range(100):
            loss = Trace_ELBO().differentiable_loss(crossed_rows_model, guide, student, question, y)
            out.append(torch.autograd.grad(loss, loc)[0])
        return torch.stack(out).double()

    with_variate = gradients()
    assert len(runs) == 100  # (one run of the model a call for both levels' and the globals' variate)
    monkeypatch.setattr(AutoBranchGuide, "_row_variate_applies", lambda self, *a: False)
    without = gradients()
    error = (with_variate.var(0) / 100 + without.var(0) / 100).sqrt()
    assert ((with_variate.mean(0) - without.mean(0)).abs() < 4 * error).all(), (with_variate.mean(0), without.mean(0))
    ratio = with_variate.var(0) / without.var(0)  # (0.10 and 0.24 when written)
    assert ratio.max() < 0.6, ratio


def _counted(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted


def test_branch_counts_on_rows_drawn_at_random_take_smoothed_steps():
    """Poisson counts gathered by county, 50 of 200 homes drawn a call: the counties' likelihood is not Gaussian, so
    they are set by smoothed steps on every row (not by Adam's noisy per-county steps) and carry the rows' control
    variate (benchmarks/unseen.py --rows 50, poisson, seed 0: max error 0.053 against AutoNormal's 1.12)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    county, _ = homes()
    counts = torch.poisson(torch.exp(0.3 * torch.randn(J, generator=torch.Generator().manual_seed(3)))[county])

    def model(county, y):
        mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
        tau = pyro.sample("tau", dist.HalfNormal(1.0))
        with pyro.plate("counties", J):
            a = pyro.sample("a", dist.Normal(mu, tau))
        with pyro.plate("data", N, subsample_size=50) as i:
            pyro.sample("y", dist.Poisson(a[..., county[i]].exp()), obs=y[i])

    guide = AutoBranchGuide(model)
    train(guide, model, county, counts, steps=6)
    level = guide._levels["counties"]
    assert guide._quadratic["counties"] is False and guide._set_by_steps(level)
    assert float(guide.references.counties__rows_ready.detach()) == 1.0


def test_amortized_expansions_of_rows_drawn_at_random_wait_for_the_globals_to_move(monkeypatch):
    """Each expansion of the counties reads all 203 homes (five runs of the model a pass): it is redone once the
    globals' q has moved by a quarter of its sd, not every 10 calls (unseen.py's Poisson counts with 50 rows a call:
    8.3 times AutoNormal's CPU time before). Between reads it moves with the globals' draw from the mean it was
    read at."""
    county, y = homes_203()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = homes_model(50)
    guide = AutoAmortizedBranchGuide(model)
    reads = []
    read = guide._expansions_of_call
    monkeypatch.setattr(guide, "_expansions_of_call", lambda *a: reads.append(1) or read(*a))
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.0}), Trace_ELBO())  # (q stands still)
    for _ in range(45):  # (past the 40 calls any read stands)
        svi.step(county, y)
    assert len(reads) == 1
    loc, sd = guide._expansion_cache[6]
    params = dict(guide.named_parameters())
    for name in ("locs.globals_unconstrained", "averages.loc_unconstrained"):  # (read at the tail average)
        params[name].data[2] += 0.5 * sd[2]  # the noise scale's mean by half an sd
    svi.step(county, y)
    assert len(reads) == 2
    torch.testing.assert_close(guide._expansion_cache[6][0], loc + torch.tensor([0.0, 0.0, 0.5]) * sd)


def test_pavi_expansions_of_rows_drawn_at_random_wait_for_the_globals_to_move():
    """PAVI's expansions of the counties (every home read, block by block) are kept past their interval while the
    running mean of the globals' draws stays within ``ROW_REFERENCE_MOVE`` reference sds of the reference, and read
    again at a new reference once it leaves (unseen.py's Poisson counts, 50 rows a call: 4.4 times AutoNormal's CPU
    time before)."""
    county, y = homes_203()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = AutoPlateAmortizedFlow(homes_model(50))
    guide(county, y)
    made = guide._expansion[1]
    ref, sd = guide._state("ref_mean").clone(), guide._state("ref_sd").clone()
    for shift, kept in ((0.8 * ROW_REFERENCE_MOVE, True), (1.2 * ROW_REFERENCE_MOVE, False)):
        guide._write_state("calls", torch.tensor(float(ROW_EXPANSION_EVERY)))  # (past any interval but the rows')
        guide._write_state("global_mean", ref + shift * sd)
        guide._write_state("global_var", sd.pow(2))
        guide(county, y)
        assert (guide._expansion[1] is made) == kept
    torch.testing.assert_close(guide._state("ref_mean"), ref + 1.2 * ROW_REFERENCE_MOVE * sd)


def hetero_model(group, y):
    """Groups with their own noise scale, a positive group effect beside Gaussian intercepts (``unseen.py``'s
    ``hetero``): the likelihood is not quadratic in the log noise scales."""
    mu = pyro.sample("mu", dist.Normal(y.new_zeros(()), 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(y.new_tensor(2.0)))
    m_s = pyro.sample("m_s", dist.Normal(y.new_zeros(()), 1.0))
    t_s = pyro.sample("t_s", dist.HalfNormal(y.new_ones(())))
    with pyro.plate("groups", 3):
        a = pyro.sample("a", dist.Normal(mu, tau))
        sigma = pyro.sample("sigma", dist.LogNormal(m_s, t_s))
    with pyro.plate("obs", len(group)):
        pyro.sample("y", dist.Normal(a[..., group], sigma[..., group]), obs=y)


def test_branch_groups_with_their_own_noise_scale_start_at_their_conditional_mode():
    """On full data, a level whose likelihood is not quadratic in it (log noise scales) starts each group at its
    conditional mode, where the expansion is the likelihood's Laplace approximation. From one Newton step at the
    model's initial values instead, a group with noise sd 0.05 started at sd 0.45 with a pseudo-observation 20 times
    too weak, pinned there by the level's prior: `unseen.py`'s `hetero` ended 4.6 posterior sds off (0.15 now)."""
    pyro.clear_param_store()
    gen = torch.Generator().manual_seed(0)
    group = torch.arange(3).repeat_interleave(8)
    sd = torch.tensor([0.05, 0.3, 1.0], dtype=torch.float64)
    y = 1.0 + sd[group] * torch.randn(len(group), generator=gen, dtype=torch.float64)
    guide = AutoBranchGuide(hetero_model)
    train(guide, hetero_model, group, y, steps=1)
    sample_sd = torch.stack([y[group == g].std() for g in range(3)])
    ratio = guide.median(group, y)["sigma"] / sample_sd
    assert ((ratio > 0.6) & (ratio < 1.6)).all(), ratio


def beta_binomial_model(trials, y):
    """Group probabilities with a Beta prior (not Gaussian: the amortized guide's networks give the pseudo-observation)
    and binomial counts of varying trials (``unseen.py``'s ``beta``)."""
    phi = pyro.sample("phi", dist.Beta(trials.new_ones(()), 1.0))
    kappa = pyro.sample("kappa", dist.Pareto(trials.new_ones(()), 1.5))
    with pyro.plate("groups", len(trials)):
        theta = pyro.sample("theta", dist.Beta(kappa * phi, kappa * (1 - phi)))
        pyro.sample("y", dist.Binomial(trials, probs=theta), obs=y)


def test_amortized_networks_of_binomial_counts_read_the_number_of_trials():
    """A binomial count says nothing of its group's rate without its number of trials: the observation networks read
    both (successes, trials). With the count alone, `unseen.py`'s `beta` ended 1.85 posterior sds off (0.20 now)."""
    pyro.clear_param_store()
    trials = torch.tensor([5.0, 40.0, 12.0, 30.0], dtype=torch.float64)
    y = torch.tensor([1.0, 8.0, 6.0, 3.0], dtype=torch.float64)
    guide = AutoAmortizedBranchGuide(beta_binomial_model)
    train(guide, beta_binomial_model, trials, y, steps=1)
    norm = guide.nets["groups"]["observations"]["0"][0]
    torch.testing.assert_close(norm.mean, torch.stack([y.mean(), trials.mean()]))


def test_pavi_expands_a_group_location_at_the_group_own_noise_scale():
    """The plate-amortized flow expands each site of a level at its siblings' conditional modes (Gauss-Seidel sweeps)
    where one of them is not Gaussian in the likelihood: a group's location reads the group's own noise scale (here
    sd 3: a precision of about 8 / 9 from its 8 observations), not the population's (sd 1 at the start: 8). At the
    population's, `unseen.py`'s `hetero` ended 0.58 posterior sds off (0.29 now)."""
    pyro.clear_param_store()
    gen = torch.Generator().manual_seed(0)
    group = torch.arange(3).repeat_interleave(8)
    sd = torch.tensor([0.05, 0.3, 3.0], dtype=torch.float64)
    y = 1.0 + sd[group] * torch.randn(len(group), generator=gen, dtype=torch.float64)
    guide = AutoPlateAmortizedFlow(hetero_model)
    train(guide, hetero_model, group, y, steps=1)
    with torch.no_grad():
        precision = guide._expansions_for_call((group, y), {}, {}, None)["a"][0].reshape(-1)
    assert 0.3 < float(precision[2]) < 3.0, precision


def missing_model(group, y=None, mask=None):
    """Rows with missing entries, imputed by Pyro's ``obs_mask`` (a latent ``y_unobserved`` when ``y`` is given)."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    s = pyro.sample("s", dist.HalfNormal(2.0))
    with pyro.plate("groups", 4):
        a = pyro.sample("a", dist.Normal(mu, s))
    with pyro.plate("rows", len(group)):
        return pyro.sample("y", dist.Normal(a[..., group], 1.0), obs=y, obs_mask=mask)


@pytest.mark.parametrize("Guide", GUIDES, ids=lambda g: g.__name__)
def test_missing_entries_imputed_by_obs_mask_and_predictions_without_the_observations(Guide):
    group = torch.arange(4).repeat_interleave(3)
    y = torch.randn(12, generator=torch.Generator().manual_seed(0))
    mask = torch.arange(12) % 3 != 0
    guide = Guide(missing_model)
    train(guide, missing_model, group, y, mask)
    imputed = Predictive(missing_model, guide=guide, num_samples=4)(group, y, mask)
    assert imputed["y_unobserved"].shape == (4, 12)
    assert torch.equal(imputed["y"][:, mask], y[mask].expand(4, -1))
    # Predictive with the observations left out: the model samples ``y`` whole and has no ``y_unobserved``
    predicted = Predictive(missing_model, guide=guide, num_samples=4)(group)
    assert "y_unobserved" not in predicted and predicted["y"].shape == (4, 12)
    assert torch.isfinite(predicted["y"]).all()
    assert set(guide.median(group)) >= {"mu", "s", "a"}


def param_model(group, y=None):
    """A model with a parameter of its own (``pyro.param``, learnt by the same SVI) beside its latent sites."""
    b = pyro.param("b", torch.tensor(0.0))
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    with pyro.plate("groups", 4):
        a = pyro.sample("a", dist.Normal(mu, 1.0))
    with pyro.plate("rows", len(group)):
        return pyro.sample("y", dist.Normal(a[..., group] + b, 1.0), obs=y)


@pytest.mark.parametrize("Guide", GUIDES, ids=lambda g: g.__name__)
def test_a_model_with_its_own_pyro_param_trains_and_pickles(Guide):
    """The model's ``pyro.param`` is learnt with the guide's parameters and is no site of the guide; the guide pickles
    (the parameter store's weak references stay out of it, as in Pyro's autoguides)."""
    group = torch.arange(4).repeat_interleave(3)
    y = 1.0 + torch.randn(12, generator=torch.Generator().manual_seed(0))
    guide = Guide(param_model)
    train(guide, param_model, group, y)
    assert "b" not in guide.median(group, y) and "b" in pyro.get_param_store()
    loaded = pickle.loads(pickle.dumps(guide))
    if isinstance(guide, AutoPlateAmortizedFlow):  # its held expansion was read at an earlier b; the loaded guide
        guide._expansion = None  # reads it again (at today's b), as this one now does
    for name, value in guide.median(group, y).items():
        torch.testing.assert_close(loaded.median(group, y)[name], value)

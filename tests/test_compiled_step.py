"""What a ``torch.jit`` trace of the guides' distributions replays: work done without gradients stays without them
(a trace does not record ``torch.no_grad``, so held parts must be detached explicitly)."""

import pytest
import torch

from pyro_hier.conjugate import conjugate_offset
from pyro_hier.distributions import ConjugateNormal, ConjugateScorer


def _parts(n=3, d=4):
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    b = rand(n, d, d)
    root = torch.linalg.cholesky(b @ b.mT + torch.eye(d, dtype=torch.float64))
    ref_loc, ref_precision = rand(n, d), rand(n, d).exp()
    raw, mean = (0.3 * rand(n, d, d)).requires_grad_(), rand(n, d).requires_grad_()
    m0, p0 = rand(d).requires_grad_(), (0.5 * rand(d)).exp().requires_grad_()
    return root, ref_loc, ref_precision, raw, mean, m0, p0


def test_conjugate_normal_held_parts_have_no_gradient_when_replayed():
    """The factorisation of ``P`` and its inverse factor are held: replayed from a trace they must not be recorded for
    autograd (they were, and the backward pass differentiated the Cholesky factorisation and the solves for nothing)."""
    root, ref_loc, ref_precision, raw, mean, m0, p0 = _parts()

    def held(raw, mean, m0, p0):
        q = ConjugateNormal(root, raw, mean, conjugate_offset(ref_loc, ref_precision, mean), m0, p0)
        return q.loc, q.precision_tril, q.inverse_tril, q.root

    eager = held(raw, mean, m0, p0)
    traced = torch.jit.trace(held, (raw, mean, m0, p0), check_trace=False)
    replayed = traced(raw, mean, m0, p0)
    for a, b in zip(eager, replayed, strict=True):
        torch.testing.assert_close(a, b)
        assert not a.requires_grad and not b.requires_grad


def test_held_conjugate_normal_held_parts_have_no_gradient_when_replayed():
    """The same for :class:`HeldConjugateNormal`, whose prior part is live."""
    from pyro_hier.distributions import HeldConjugateNormal

    root, ref_loc, _, _, _, m0, p0 = _parts()
    lam = root @ root.mT

    def held(m0, p0):
        q = HeldConjugateNormal(root, lam, ref_loc, m0, p0)
        return q.loc, q.precision_tril, q.inverse_tril

    traced = torch.jit.trace(held, (m0, p0), check_trace=False)
    for a, b in zip(held(m0, p0), traced(m0, p0), strict=True):
        torch.testing.assert_close(a, b)
        assert not a.requires_grad and not b.requires_grad


def test_conjugate_scorer_gradients_are_the_same_when_replayed():
    """The scorer's closed-form gradient terms are held; its gradients in the draw and the prior are the same eager and
    replayed from a trace."""
    root, ref_loc, ref_precision, raw, mean, m0, p0 = _parts()
    q = ConjugateNormal(root, raw, mean, conjugate_offset(ref_loc, ref_precision, mean), m0, p0)
    u = q.loc.detach().clone().requires_grad_()

    def score(u, m0, p0):
        return ConjugateScorer(q.loc, q.precision_tril, m0, p0, inverse_tril=q.inverse_tril).log_prob(u).sum()

    traced = torch.jit.trace(score, (u, m0, p0), check_trace=False)
    grads = [torch.autograd.grad(f(u, m0, p0), (u, m0, p0)) for f in (score, traced)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_rows_in_order_are_not_sorted_again_and_any_order_gives_the_same_step(monkeypatch):
    """``LazyAdam`` steps the rows of a sparse gradient whose rows are increasing (a minibatch's sorted indices) without
    coalescing it (which sorts), and rows in any order, or read twice, give the step of their coalesced sum."""
    from pyro_hier.optim import LazyAdam
    from pyro_hier.sparse import select_elements

    weights = torch.arange(1.0, 4.0).reshape(3, 1, 1)
    coalesced, original = [], torch.Tensor.coalesce
    monkeypatch.setattr(torch.Tensor, "coalesce", lambda t: coalesced.append(t) or original(t))
    results = []
    for index, reads in ((torch.tensor([0, 2, 5]), 1), (torch.tensor([5, 0, 2]), 1), (torch.tensor([0, 2, 5]), 2)):
        p = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 12).reshape(6, 1, 2))
        optimizer = LazyAdam([p], lr=0.1)  # (declares that it reads sparse gradients of p, while it lives)
        for _ in range(3):
            order = index.argsort().argsort()
            loss = sum((select_elements(p, {-2: index}, 1) * weights[order] / reads).pow(2).sum() for _ in range(reads))
            loss.backward()
            assert p.grad.is_sparse and not p.grad.is_coalesced()
            coalesced.clear()
            optimizer.step()
            if reads == 1:
                assert bool(coalesced) == (not bool((index[1:] > index[:-1]).all()))
            p.grad = None
        results.append(p.detach())
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-6, atol=1e-7)
    assert torch.equal(results[0][[1, 3, 4]], torch.linspace(-1.0, 1.0, 12).reshape(6, 1, 2)[[1, 3, 4]])


def test_parameters_without_a_gradient_are_not_stepped_but_their_learning_rate_decays():
    """``pyro_hier.optim.ClippedAdam`` leaves out of ``step`` the parameters without a gradient (a guide's state) and
    decays their learning rate as ``step`` would: the same updates as Pyro's ``PyroOptim`` over the same optimiser,
    for a parameter that has a gradient on some steps only."""
    from pyro.optim import PyroOptim

    from pyro_hier.optim import ClippedAdam, LazyClippedAdam

    args = {"lr": 0.1, "lrd": 0.9}
    runs = []
    for optim in (ClippedAdam(args), PyroOptim(LazyClippedAdam, args)):
        a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
        for step in range(6):
            (a.pow(2).sum() + (b.pow(3).sum() if step % 3 == 0 else 0.0)).backward()
            optim([a, b])
            a.grad = b.grad = None
        runs.append((optim, a.detach(), b.detach()))
    (lazy, *new), (_, *old) = runs
    for x, y in zip(new, old, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    calls = []
    for optimizer in lazy.optim_objs.values():
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(opt))
    c = torch.nn.Parameter(torch.ones(1))
    lazy([c])  # (its optimiser is made on this first call)
    a, b = list(lazy.optim_objs)[:2]
    a.pow(2).sum().backward()
    lazy([a, b])
    assert calls == [lazy.optim_objs[a]]


def test_control_variate_summary_is_kept_up_to_date_and_made_again_after_other_writes():
    """The sums of the control variate's table and points over all elements and the shared curvature are held between
    calls and updated by the tap's backward pass (O(B) a call): after training steps, eager and compiled, they equal
    those of the tensors; written by anything else, they are made again."""
    import pyro
    from pyro.infer import SVI, JitTrace_ELBO, Trace_ELBO

    import pyro_hier.optim
    from pyro_hier import AutoBranchGuide
    from pyro_hier.guides.branch import _held_summary, _raw_state, _table_summary, shared_curvature
    from pyro_hier.problems import synthetic_regression

    p = synthetic_regression(num_groups=30, num_obs=5, dim=2, seed=0, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for elbo in (Trace_ELBO(), JitTrace_ELBO(ignore_jit_warnings=True)):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = AutoBranchGuide(p.model)
        svi = SVI(p.model, guide, pyro_hier.optim.Adam({"lr": 0.05}), elbo)
        for _ in range(8):
            svi.step(*p.args, torch.randperm(30, generator=g)[:6])
        state = [_raw_state(guide.references, f"groups__cv_{key}") for key in ("gradient", "point", "secant")]
        assert _held_summary(*state) is not None  # (kept up to date by the backward passes, not made again)
        table, points, secant = state
        exact = (table.sum((0, 1)), points.sum((0, 1)), shared_curvature(secant))
        assert table.abs().sum() > 0
        for a, b in zip(_table_summary(*state), exact, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        with torch.no_grad():
            table[3] += 1.0
        assert _held_summary(*state) is None
        torch.testing.assert_close(_table_summary(*state)[0], exact[0] + 1.0, rtol=1e-12, atol=1e-12)


def _no_grad_escapes(graph: torch._C.Graph, num_params: int) -> list[str]:
    """The nodes of a traced graph recorded inside ``torch.no_grad`` (scopes ``no_grad``, see below) whose floating
    output depends on a parameter (the first ``num_params`` inputs) and is read outside such a region by anything but
    a detach or a shape: what the replay records for autograd and differentiates (a trace does not record no_grad)."""

    def nodes(block, inside):
        for node in block.nodes():
            if node.kind() == "prim::TracedModuleForward":  # (a scope pushed by the trace: its nodes are in a block)
                for sub in node.blocks():
                    yield from nodes(sub, inside or "no_grad" in node.scopeName())
            else:
                yield node, inside

    tainted = {v.unique() for v in list(graph.inputs())[:num_params]}
    made_inside, escapes = set(), []
    shape_only = {
        "aten::size",
        "aten::detach",
        "aten::new_zeros",
        "aten::new_ones",
        "aten::zeros_like",
        "aten::ones_like",
    }
    for node, inside in nodes(graph, False):
        if not inside and node.kind() not in shape_only:
            escapes += [f"{node.kind()} reads {v.debugName()}" for v in node.inputs() if v.unique() in made_inside]
        if node.kind() != "aten::detach" and any(v.unique() in tainted for v in node.inputs()):
            for out in node.outputs():
                kind = out.type()
                if isinstance(kind, torch._C.TensorType) and kind.scalarType() in ("Float", "Double", "Half"):
                    tainted.add(out.unique())
                    if inside:
                        made_inside.add(out.unique())
    return escapes


@pytest.mark.parametrize("name", ["AutoBranchGuide", "AutoAmortizedBranchGuide", "AutoPlateAmortizedFlow"])
def test_compiled_steps_do_not_differentiate_through_no_grad_blocks(name, monkeypatch):
    """Every ``torch.no_grad`` block a guide's compiled step runs is marked (a scope of the trace): no parameter-
    dependent value made inside one reaches the rest of the graph other than detached (before the held parts of
    ``ConjugateNormal`` were detached, 2084892, the branch guide's step differentiated its Cholesky factorisation)."""
    import pyro
    from pyro.infer import JitTrace_ELBO
    from pyro.ops import jit as pyro_jit

    import pyro_hier
    from pyro_hier.problems import synthetic_regression

    grad_mode = torch.autograd.grad_mode.no_grad
    enter, exit_ = grad_mode.__enter__, grad_mode.__exit__
    depth = [0]

    def marked_enter(self):
        state = torch._C._get_tracing_state()
        if state is not None:
            depth[0] += 1
            if depth[0] == 1:
                state.push_scope("no_grad")
        return enter(self)

    def marked_exit(self, *exc):
        state = torch._C._get_tracing_state()
        if state is not None and depth[0] > 0:
            depth[0] -= 1
            if depth[0] == 0:
                state.pop_scope()
        return exit_(self, *exc)

    found = {}
    trace = torch.jit.trace

    def checked_trace(fn, inputs, **options):
        def run(*args):
            out = fn(*args)
            found["escapes"] = _no_grad_escapes(torch._C._get_tracing_state().graph(), num_params[0])
            return out

        return trace(run, inputs, **options)

    num_params = [0]
    call = pyro_jit.CompiledFunction.__call__

    def counted_call(self, *args, **kwargs):
        with pyro.poutine.block(), pyro.poutine.trace(param_only=True) as capture:
            self.fn(*args, **kwargs)
        num_params[0] = len(capture.trace.nodes)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(grad_mode, "__enter__", marked_enter)
    monkeypatch.setattr(grad_mode, "__exit__", marked_exit)
    monkeypatch.setattr(torch.jit, "trace", checked_trace)
    monkeypatch.setattr(pyro_jit.CompiledFunction, "__call__", counted_call)
    p = synthetic_regression(num_groups=12, num_obs=5, dim=3, seed=0, dtype=torch.float64)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = getattr(pyro_hier, name)(p.model)
    index = torch.arange(0, 12, 2)
    guide(*p.args, index)
    JitTrace_ELBO(ignore_jit_warnings=True).loss_and_grads(p.model, guide, *p.args, index)
    assert "escapes" in found and found["escapes"] == []

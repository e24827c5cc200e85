"""What a ``torch.jit`` trace of the guides' distributions replays: work done without gradients stays without them
(a trace does not record ``torch.no_grad``, so held parts must be detached explicitly)."""

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

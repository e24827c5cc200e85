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

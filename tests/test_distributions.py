"""StickingTheLanding: same samples and densities as the sampler, no score term in the gradient."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_hier.conjugate import GaussianPrior, conjugate_conditional, conjugate_offset, gaussian_update
from pyro_hier.distributions import (
    CholeskyPrecisionNormal,
    ConjugateNormal,
    ConjugateScorer,
    HeldConjugateNormal,
    StickingTheLanding,
)
from pyro_hier.transforms import scale_tril_from_raw


def _normal_pair():
    loc = torch.tensor([0.3, -1.0], requires_grad=True)
    scale = torch.tensor([0.5, 2.0], requires_grad=True)
    q = StickingTheLanding(dist.Normal(loc, scale), dist.Normal(loc.detach(), scale.detach()))
    return loc, scale, q


def test_values_and_densities_are_the_samplers():
    loc, scale, q = _normal_pair()
    pyro.set_rng_seed(1)
    u = q.rsample((3,))
    pyro.set_rng_seed(1)
    torch.testing.assert_close(u, dist.Normal(loc, scale).rsample((3,)))
    torch.testing.assert_close(q.log_prob(u), dist.Normal(loc, scale).log_prob(u))
    assert q.has_rsample and q.batch_shape == (2,) and q.event_shape == ()
    torch.testing.assert_close(q.entropy(), dist.Normal(loc, scale).entropy())


def test_only_the_path_gradient_remains():
    loc, scale, q = _normal_pair()
    eps = torch.randn(2)
    # at a fixed value the density carries no gradient to the parameters
    value = torch.tensor([1.0, 2.0])
    assert not q.log_prob(value).requires_grad
    # through a sample: d/dφ log q(g_φ(ε)) with detached φ in q = ∇_u log q(u) ∂u/∂φ; for a Normal
    # ∇_u log q = −(u − loc)/scale² = −ε/scale, ∂u/∂loc = 1, ∂u/∂scale = ε
    u = loc + scale * eps
    g_loc, g_scale = torch.autograd.grad(q.log_prob(u).sum(), [loc, scale])
    torch.testing.assert_close(g_loc, -eps / scale.detach())
    torch.testing.assert_close(g_scale, -(eps**2) / scale.detach())


def test_expand_and_errors():
    _, _, q = _normal_pair()
    e = q.expand((4, 2))
    assert e.batch_shape == (4, 2) and e.rsample().shape == (4, 2)
    with pytest.raises(ValueError, match="reparameterised"):
        StickingTheLanding(dist.Poisson(torch.ones(2)), dist.Poisson(torch.ones(2)))
    with pytest.raises(ValueError, match="same shapes"):
        StickingTheLanding(dist.Normal(torch.zeros(2), 1.0), dist.Normal(torch.zeros(3), 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conjugate_scorer_equals_the_scorer_rebuilt_from_detached_parameters(dtype):
    """Value and gradients (in the prior's parameters, the variational ones and through the draw, with particles) of
    the closed-form scorer equal those of the conditional rebuilt with its variational parameters detached."""
    g = torch.Generator().manual_seed(0)
    n, d = 5, 3

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    mu, log_s = rand(d).requires_grad_(), rand(d).requires_grad_()
    a, b = rand(n, d, d), rand(n, d, d)
    eye = torch.eye(d, dtype=dtype)
    refs = (rand(n, d), a @ a.mT + eye, torch.linalg.cholesky(b @ b.mT + eye))
    mean = rand(n, d).requires_grad_()
    factor = (eye + 0.1 * rand(n, d, d).tril()).requires_grad_()
    prior = GaussianPrior(mu.expand(n, d), log_s.exp().pow(-2).expand(n, d))
    loc, tril = conjugate_conditional(prior, *refs, mean, factor, precision_tril=True)
    u = CholeskyPrecisionNormal(loc, tril).rsample((4,))
    held_loc, held_tril = conjugate_conditional(prior, *refs, mean.detach(), factor.detach())
    rebuilt = dist.MultivariateNormal(held_loc, scale_tril=held_tril)
    scorer = ConjugateScorer(loc, tril, prior.loc, prior.precision).expand((4, n))
    old, new = rebuilt.log_prob(u).sum(), scorer.log_prob(u).sum()
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(new, old, **tol)
    params = [mu, log_s, mean, factor]
    for x, y in zip(torch.autograd.grad(new, params, retain_graph=True), torch.autograd.grad(old, params), strict=True):
        torch.testing.assert_close(x, y, **tol)


def test_cholesky_precision_normal_is_the_multivariate_normal_of_that_precision():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    precision = a @ a.mT + torch.eye(4, dtype=torch.float64)
    loc = torch.randn(3, 4, generator=g, dtype=torch.float64)
    q = CholeskyPrecisionNormal(loc, torch.linalg.cholesky(precision))
    ref = dist.MultivariateNormal(loc, precision_matrix=precision)
    u = torch.randn(5, 3, 4, generator=g, dtype=torch.float64)
    torch.testing.assert_close(q.log_prob(u), ref.log_prob(u))
    torch.testing.assert_close(q.entropy(), ref.entropy())
    torch.testing.assert_close(q.covariance_matrix, ref.covariance_matrix)
    torch.testing.assert_close(q.variance, ref.variance)
    torch.testing.assert_close(q.scale_tril, ref.scale_tril)
    e = q.expand((2, 3))
    assert e.batch_shape == (2, 3) and e.rsample().shape == (2, 3, 4)
    torch.manual_seed(0)
    draws = q.rsample((20000,))
    torch.testing.assert_close(draws.mean(0), loc, atol=0.05, rtol=0)
    centred = draws - loc
    cov = torch.einsum("s...i,s...j->...ij", centred, centred) / draws.shape[0]
    torch.testing.assert_close(cov, ref.covariance_matrix, atol=0.05, rtol=0.05)


def _conjugate_parts(n=3, d=4, seed=2):
    """Random parts of a dense conjugate level: references ``(m̄0, P̄0, R)``, raw factor ``W``, mean ``M``, and a
    prior ``(m0, p0)`` shared by the elements (``(d,)``, broadcast as the guide's globals are)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    eye = torch.eye(d, dtype=torch.float64)
    b = rand(n, d, d)
    refs = (rand(n, d), torch.diag_embed(rand(n, d).exp()), torch.linalg.cholesky(b @ b.mT + eye))
    raw, mean = (0.3 * rand(n, d, d)).requires_grad_(), rand(n, d).requires_grad_()
    m0, p0 = rand(d).requires_grad_(), (0.5 * rand(d)).exp().requires_grad_()
    return refs, raw, mean, m0, p0


def test_conjugate_normal_is_the_conjugate_conditional():
    """Its mean and precision factor are those of ``conjugate_conditional`` from the same parts, and ``log_prob`` that
    of the same Gaussian."""
    refs, raw, mean, m0, p0 = _conjugate_parts()
    n, d = mean.shape
    q = ConjugateNormal(refs[2], raw, mean, conjugate_offset(refs[0], refs[1], mean), m0, p0)
    prior = GaussianPrior(m0.expand(n, d), p0.expand(n, d))
    loc, tril = conjugate_conditional(prior, *refs, mean, scale_tril_from_raw(raw), precision_tril=True)
    torch.testing.assert_close(q.loc, loc.detach())
    torch.testing.assert_close(q.precision_tril, tril.detach())
    u = torch.randn(5, n, d, dtype=torch.float64)
    torch.testing.assert_close(q.log_prob(u), CholeskyPrecisionNormal(loc, tril).log_prob(u))
    assert q.expand((2, n)).rsample().shape == (2, n, d)


def test_conjugate_normal_draws_have_its_covariance():
    """The perturbed draw ``P⁻¹(η + Aε₁ + √p0 ε₂)`` has mean ``P⁻¹η`` and covariance ``P⁻¹`` (without the prior's
    perturbation it would be ``P⁻¹AAᵀP⁻¹``)."""
    refs, raw, mean, m0, p0 = _conjugate_parts(n=2, d=3)
    q = ConjugateNormal(refs[2], raw, mean, conjugate_offset(refs[0], refs[1], mean), m0, p0)
    torch.manual_seed(0)
    draws = q.rsample((40000,)).detach()
    sd = q.variance.sqrt()
    torch.testing.assert_close((draws.mean(0) - q.loc) / sd, torch.zeros_like(sd), atol=0.03, rtol=0)
    centred = draws - q.loc
    cov = torch.einsum("s...i,s...j->...ij", centred, centred) / draws.shape[0]
    scale = sd.unsqueeze(-1) * sd.unsqueeze(-2)
    torch.testing.assert_close(cov / scale, q.covariance_matrix / scale, atol=0.03, rtol=0)


def test_conjugate_normal_gradients_are_those_of_its_draw():
    """The closed-form backward pass equals autograd through ``u = P⁻¹(η + Aε₁ + √p0 ε₂)`` written out (same
    normal variates), in every part, with a sample dimension and the prior broadcast."""
    refs, raw, mean, m0, p0 = _conjugate_parts()
    fisher_sd = refs[2].clone().requires_grad_()
    offset = conjugate_offset(refs[0], refs[1], mean)
    n, d = mean.shape
    torch.manual_seed(3)
    u = ConjugateNormal(fisher_sd, raw, mean, offset, m0, p0).rsample((2,))
    torch.manual_seed(3)
    e1, e2 = torch.randn(2, 2, n, d, dtype=torch.float64)
    root = fisher_sd @ scale_tril_from_raw(raw)
    precision = root @ root.mT + torch.diag_embed(p0.expand(n, d))
    mv = lambda a, x: (a @ x.unsqueeze(-1)).squeeze(-1)  # noqa: E731
    b = p0 * m0 + mv(root, mv(root.mT, mean)) + offset + mv(root, e1) + p0.sqrt() * e2
    explicit = torch.linalg.solve(precision, b.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(u, explicit)
    weight = torch.randn(2, n, d, dtype=torch.float64)
    params = [raw, fisher_sd, mean, m0, p0]
    for x, y in zip(
        torch.autograd.grad((u * weight).sum(), params, retain_graph=True),
        torch.autograd.grad((explicit * weight).sum(), params),
    ):
        torch.testing.assert_close(x, y)


def test_held_conjugate_normal_is_the_conjugate_normal_of_a_held_pseudo_observation():
    """Built from ``(Λ, η)`` and a root ``A`` of ``Λ``, it is ``ConjugateNormal(A, 0, 0, η, m0, p0)``: the same mean,
    precision factor and draws from the same normal variates, the same gradients in ``(m0, p0)``, and its mean is
    ``gaussian_update``'s."""
    refs, _, _, m0, p0 = _conjugate_parts()
    root = refs[2]
    n, d = root.shape[:2]
    lam = root @ root.mT
    eta = torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    held = HeldConjugateNormal(root, lam, eta, m0, p0)
    full = ConjugateNormal(root, torch.zeros(n, d, d, dtype=torch.float64), torch.zeros_like(eta), eta, m0, p0)
    loc, tril = gaussian_update(GaussianPrior(m0.expand(n, d), p0.expand(n, d)), lam, eta, precision_tril=True)
    torch.testing.assert_close(held.loc, loc.detach())
    torch.testing.assert_close(held.precision_tril, tril.detach())
    weight = torch.randn(2, n, d, dtype=torch.float64)
    grads = []
    for q in (held, full):
        torch.manual_seed(4)
        u = q.rsample((2,))
        grads.append((u.detach(), torch.autograd.grad((u * weight).sum(), [m0, p0])))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for x, y in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(x, y)
    assert held.expand((3, n)).rsample().shape == (3, n, d)


def test_unwrap_finds_the_distribution_behind_shape_wrappers():
    import pyro.distributions as pdist

    from pyro_hier.distributions import unwrap

    normal = pdist.Normal(torch.zeros(2), 1.0)
    wrapped = normal.expand([4, 2]).mask(torch.ones(4, 2, dtype=torch.bool)).to_event(1)
    assert isinstance(unwrap(wrapped), pdist.Normal) and unwrap(normal) is normal
    assert isinstance(unwrap(pdist.Bernoulli(logits=torch.zeros(3)).to_event(1)), pdist.Bernoulli)

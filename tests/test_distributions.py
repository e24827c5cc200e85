"""StickingTheLanding: same samples and densities as the sampler, no score term in the gradient."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_hier.distributions import StickingTheLanding


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

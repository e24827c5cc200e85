"""Distributions the guides emit. :class:`StickingTheLanding` samples with live parameters and scores with
detached ones, which turns Pyro's reparameterised ELBO gradient into the lower-variance "sticking the landing"
estimator without touching the ELBO classes."""

from __future__ import annotations

from typing import ClassVar

import pyro.distributions as dist
import torch
from torch.distributions import constraints

__all__ = ["StickingTheLanding"]


class StickingTheLanding(dist.TorchDistribution):
    r"""A reparameterised distribution whose ``log_prob`` does not depend on the variational parameters.

    With :math:`u = g_\phi(\varepsilon)`, the reparameterised ELBO gradient is

    .. math::

        \nabla_\phi \big[\log p(x, u) - \log q_\phi(u)\big]
        = \big(\nabla_u \log p(x, u) - \nabla_u \log q_\phi(u)\big)\,\nabla_\phi g_\phi(\varepsilon)
          \;-\; \nabla_\phi \log q_\phi(u)\big|_{u\ \mathrm{fixed}} .

    The last (score) term has expectation zero, so dropping it keeps the gradient unbiased; when
    :math:`q_\phi` equals the posterior the first term is zero for every :math:`\varepsilon`, so the estimator's
    variance vanishes at the optimum (Roeder, Wu & Duvenaud 2017). This class drops it: ``rsample`` draws from
    ``sampler`` (live parameters) and ``log_prob`` evaluates ``scorer`` — the same distribution built from detached
    parameters, but from the *live* values of anything that is not a parameter (e.g. the sampled parents of a
    conditional), so the value path stays differentiable. Values and densities are those of ``sampler``; only
    gradients change, and for any ELBO class that scores guide sites with ``log_prob`` (``Trace_ELBO``,
    ``TraceGraph_ELBO``, ``TraceEnum_ELBO``, vectorised particles included).

    Example::

        loc, scale = params()
        q = StickingTheLanding(dist.Normal(loc, scale), dist.Normal(loc.detach(), scale.detach()))
        pyro.sample("u", q)

    Reference: G. Roeder, Y. Wu, D. Duvenaud, *Sticking the Landing: Simple, Lower-Variance Gradient Estimators for
    Variational Inference*, NeurIPS 2017.
    """

    arg_constraints: ClassVar[dict] = {}
    has_rsample = True

    def __init__(self, sampler: dist.TorchDistribution, scorer: dist.TorchDistribution, validate_args=None) -> None:
        if not sampler.has_rsample:
            raise ValueError(f"sticking the landing needs a reparameterised sampler, got {type(sampler).__name__}")
        if sampler.batch_shape != scorer.batch_shape or sampler.event_shape != scorer.event_shape:
            raise ValueError(
                "sampler and scorer must have the same shapes, got "
                f"{tuple(sampler.batch_shape)}/{tuple(sampler.event_shape)} and "
                f"{tuple(scorer.batch_shape)}/{tuple(scorer.event_shape)}"
            )
        self.sampler = sampler
        self.scorer = scorer
        super().__init__(sampler.batch_shape, sampler.event_shape, validate_args=False)

    @constraints.dependent_property
    def support(self):
        return self.sampler.support

    @property
    def mean(self) -> torch.Tensor:
        return self.sampler.mean

    @property
    def variance(self) -> torch.Tensor:
        return self.sampler.variance

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        return self.sampler.rsample(sample_shape)

    def sample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        return self.sampler.sample(sample_shape)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return self.scorer.log_prob(value)

    def entropy(self) -> torch.Tensor:
        return self.sampler.entropy()

    def expand(self, batch_shape, _instance=None) -> StickingTheLanding:
        batch_shape = torch.Size(batch_shape)
        return StickingTheLanding(self.sampler.expand(batch_shape), self.scorer.expand(batch_shape))

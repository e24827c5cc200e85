r"""Iterate averaging for stochastic variational inference.

A stochastic-gradient run with a small learning rate ends wherever the last noisy gradients left it: the final
parameters :math:`\phi_T` scatter around the optimum :math:`\phi^\star` with a spread set by the gradient noise, and
in flat directions of the ELBO (a hierarchical scale in a funnel, say) that scatter is what dominates the error of
the posterior moments. Polyak–Ruppert averaging replaces :math:`\phi_T` by the mean of the last iterates,

.. math::

    \bar\phi = \frac{1}{n} \sum_{k=0}^{n-1} \phi_{T-k},

whose scatter shrinks like :math:`1/\sqrt{n}` when the iterates fluctuate around the optimum (Polyak & Juditsky,
1992). The average is taken over a module's ``torch.nn.Parameter`` values, which for Pyro's ``PyroParam`` are the
*unconstrained* values, so constrained parameters stay inside their support.
"""

from __future__ import annotations

import torch

__all__ = ["IterateAverage"]


class IterateAverage:
    r"""Running mean of a module's parameters over the steps where :meth:`update` is called; :meth:`apply` writes
    it into the module.

    .. math::

        \bar\phi_n = \bar\phi_{n-1} + (\phi_n - \bar\phi_{n-1}) / n

    over every ``torch.nn.Parameter`` of the module (unconstrained values of ``PyroParam`` s). Call :meth:`update`
    after each optimisation step of the averaging window, typically the last quarter to half of the run, once the
    loss has stopped trending; then :meth:`apply` once. The set of parameters is fixed at the first :meth:`update`
    (autoguides create theirs on their first call, so start averaging after at least one step).

    Example::

        guide = AutoPlateAmortizedFlow(model, flow="affine", condition_on_ancestors=True)
        svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": 0.03}), Trace_ELBO(num_particles=64,
                  vectorize_particles=True))
        average = IterateAverage(guide)
        for step in range(6000):
            svi.step(data)
            if step >= 4500:
                average.update()
        average.apply()  # the guide now holds the mean of the last 1,500 iterates

    Reference: B. T. Polyak, A. B. Juditsky. *Acceleration of stochastic approximation by averaging.* SIAM Journal
    on Control and Optimization 30(4), 1992.

    :param module: the guide (any ``torch.nn.Module``) whose parameters are averaged.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"IterateAverage: expected a torch.nn.Module (e.g. an autoguide), got {type(module)}")
        self.module = module
        self.count = 0
        self._mean: dict[str, torch.Tensor] = {}

    def update(self) -> None:
        """Add the module's current parameters to the running mean."""
        params = dict(self.module.named_parameters())
        if not params:
            raise ValueError(
                "IterateAverage.update: the module has no parameters yet; autoguides create them on their first "
                "call, so call update() after an optimisation step"
            )
        with torch.no_grad():
            if self.count == 0:
                self._mean = {name: p.detach().clone() for name, p in params.items()}
            else:
                if params.keys() != self._mean.keys():
                    new = sorted(params.keys() - self._mean.keys())
                    gone = sorted(self._mean.keys() - params.keys())
                    raise ValueError(
                        f"IterateAverage.update: the module's parameters changed since averaging began (new: {new}, "
                        f"gone: {gone}); start averaging once the guide has seen every site and data source"
                    )
                for name, p in params.items():
                    mean = self._mean[name]
                    if mean.shape != p.shape:
                        raise ValueError(
                            f"IterateAverage.update: parameter {name!r} changed shape from {tuple(mean.shape)} to "
                            f"{tuple(p.shape)} since averaging began"
                        )
                    mean.add_(p.detach() - mean, alpha=1.0 / (self.count + 1))
        self.count += 1

    def apply(self) -> None:
        """Write the averaged parameters into the module (in place, so optimisers and Pyro's param store, which
        hold the same tensors, see them)."""
        if self.count == 0:
            raise ValueError("IterateAverage.apply: nothing to apply, update() was never called")
        params = dict(self.module.named_parameters())
        missing = sorted(self._mean.keys() - params.keys())
        if missing:
            raise ValueError(f"IterateAverage.apply: the module no longer has the parameters {missing}")
        with torch.no_grad():
            for name, mean in self._mean.items():
                params[name].copy_(mean)

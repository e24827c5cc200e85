"""Conditional normalizing flows for the plate-amortized guide, assembled from Pyro's conditional transforms.

A conditional flow here is a :class:`~pyro.distributions.conditional.ConditionalTransformModule`: ``flow.condition(c)``
returns a bijection of vectors of size ``input_dim`` for a context ``c`` of size ``context_dim`` (broadcast over
batch dims). The default, as in PAVI (Rouillard et al. 2023, App. B), is an elementwise affine block followed by a
masked autoregressive flow (Papamakarios et al. 2017; Pyro's :class:`~pyro.distributions.transforms.
ConditionalAffineAutoregressive`). Both named flows start as the identity map.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from pyro.distributions.conditional import ConditionalComposeTransformModule, ConditionalTransformModule
from pyro.distributions.transforms import ConditionalAffineAutoregressive
from pyro.nn import ConditionalAutoRegressiveNN
from torch.distributions.transforms import AffineTransform

from pyro_hier.nn import MLP, RateLinear, readout_multiplier
from pyro_hier.transforms import log_positive, positive_inv

__all__ = ["FLOWS", "NETWORK_RATE", "ConditionalAffine", "FreeAffine", "LogScaleAffine", "make_flow"]

#: rate multiplier of :class:`ConditionalAffine`'s networks (:class:`~pyro_hier.nn.RateLinear`): Adam moves their
#: weights a tenth as fast as the free parameters. Measured on radon (Uniform priors) in the drop-in loop at Adam's
#: rate 0.05 with :class:`~pyro_hier.AutoPlateAmortizedFlow`'s conjugate default: with 1, the globals' q came out
#: too wide (the noise scale's sd 2.15× the posterior's, seed 1) and the worst posterior mean of seeds 0 and 1 was
#: 1.09 reference sds (AutoNormal 0.76); with 0.1, 0.33 and 0.19 (AutoNormal 0.76, 0.59). (First measured with an
#: earlier form of q₀: the noise scale's q swung ±5–20 posterior sds between checkpoints with 1; 0.27 with 0.1.)
NETWORK_RATE = 0.1


class LogScaleAffine(AffineTransform):
    r"""``x ↦ loc + e^{ℓ} ⊙ x`` given the log-scale ``ℓ`` (an :class:`~torch.distributions.transforms.AffineTransform`
    with ``scale = e^ℓ``): its log-determinant is ``ℓ`` summed over the event, read directly instead of
    ``log|e^ℓ|`` (two operations fewer in the forward and backward passes of every flow step).

    ``log_scale`` is used as given: pass it through :func:`~pyro_hier.transforms.log_positive` first (the positive
    map's clamp), as :class:`ConditionalAffine` and :class:`FreeAffine` do.

    Example::

        t = LogScaleAffine(torch.zeros(2), torch.log(torch.tensor([2.0, 3.0])), event_dim=1)
        t(torch.ones(2))                                        # tensor([2., 3.])
        t.log_abs_det_jacobian(torch.ones(2), t(torch.ones(2)))  # log 6
    """

    def __init__(self, loc: torch.Tensor, log_scale: torch.Tensor, event_dim: int = 0, cache_size: int = 0) -> None:
        super().__init__(loc, torch.exp(log_scale), event_dim=event_dim, cache_size=cache_size)
        self.log_scale = log_scale

    def log_abs_det_jacobian(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        result, shape = self.log_scale, x.shape
        if self._event_dim:
            result = result.reshape((*result.shape[: result.dim() - self._event_dim], -1)).sum(-1)
            shape = shape[: len(shape) - self._event_dim]
        return result.expand(shape)


class ConditionalAffine(ConditionalTransformModule):
    r"""``x ↦ a(c) + s(c) ⊙ x`` with ``[a, s̃] = MLP(c) / H + W c`` and ``s = e^{s̃}``
    (:func:`~pyro_hier.transforms.positive`, the positive map of every guide: an Adam step changes ``log s`` by
    about the learning rate, so small and large scales move alike), ``H`` the width of the MLP's last hidden layer.

    The linear path ``W c`` lets the shift be an exact affine function of the context (a linear-Gaussian model's
    posterior mean is affine in the parents' values); the MLP adds what is not linear. The MLP's last layer and ``W``
    start at zero, so the transform starts as the identity.

    The factor ``1 / H`` is the output multiplier of the maximal-update parameterisation for Adam (Yang & Hu 2021):
    an Adam step moves every weight by about the learning rate whatever its gradient's size, so an output summing
    ``H`` hidden units moved about ``H`` times the learning rate per step (times the units' size, which grows with
    the context's). With the factor it moves about as far as a free parameter would. Without it, flows conditioned
    on other sites' samples (contexts of order one and more) overshot in the first tens of steps: on radon
    (Uniform(0, 100) scale priors, ``lr`` 0.01) the noise scale's q ended hundreds of times too wide, and on
    Gaussian random effects (``lr`` 0.03) some group scales fell to 3e-7 within 20 steps.

    With ``rate`` the networks' weights (the MLP's and ``W``) move at ``rate`` times Adam's rate
    (:class:`~pyro_hier.nn.RateLinear`; :class:`~pyro_hier.AutoPlateAmortizedFlow`'s conjugate default uses
    :data:`NETWORK_RATE`): a weight on a context coordinate of order one
    moves the shift (or the log-scale) by about the learning rate per step for *every* draw of the context, so that
    noise adds spread to q that a free location does not — at Adam's rate 0.05 more than the posterior sd of a
    well-determined global (radon's noise scale, 0.035 in logit units). A tenth keeps them well below it and still
    lets them follow at 0.005.

    Example::

        t = ConditionalAffine(2, 5)
        t.condition(torch.randn(5))(torch.zeros(2))   # tensor([0., 0.]) at initialisation
    """

    def __init__(self, input_dim: int, context_dim: int, hidden: Sequence[int] = (32, 32), rate: float = 1.0) -> None:
        super().__init__()
        if input_dim < 1 or context_dim < 1:
            raise ValueError(f"input_dim and context_dim must be positive, got {input_dim} and {context_dim}")
        self.input_dim = input_dim
        self.net = MLP(context_dim, hidden, 2 * input_dim, rate=rate)
        self.output_multiplier = readout_multiplier(hidden, context_dim)
        self.linear = RateLinear(context_dim, 2 * input_dim, bias=False, rate=rate)
        with torch.no_grad():
            self.net[-1].weight.zero_()
            self.linear.weight.zero_()

    def condition(self, context: torch.Tensor) -> LogScaleAffine:
        out = self.output_multiplier * self.net(context) + self.linear(context)
        shift, raw_scale = out[..., : self.input_dim], out[..., self.input_dim :]
        # scales below e^-15 ≈ 3e-7 would make the inverse overflow (Pyro's affine flows clip too)
        return LogScaleAffine(shift, log_positive(raw_scale, floor=-15.0), event_dim=1)


class FreeAffine(torch.nn.Module):
    r"""An elementwise affine map with free parameters, ``x ↦ b + e^{β} ⊙ x`` (``e^β`` is
    :func:`~pyro_hier.transforms.positive`): Adam moves ``b`` and ``log`` of the scale by about the learning rate per
    step, as it does ``AutoNormal``'s locations and (small) scales.

    :param loc: initial ``b`` (vector).
    :param scale: initial ``e^β`` (vector, positive).

    Example::

        t = FreeAffine(torch.zeros(2), torch.full((2,), 0.1))
        t.transform()(torch.ones(2))   # tensor([0.1000, 0.1000])
    """

    def __init__(self, loc: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.loc = torch.nn.Parameter(loc.detach().clone())
        self.log_scale = torch.nn.Parameter(positive_inv(scale.detach()).clone())

    def transform(self) -> LogScaleAffine:
        return LogScaleAffine(self.loc, log_positive(self.log_scale), event_dim=1)


def _affine(input_dim: int, context_dim: int, hidden: Sequence[int], rate: float = 1.0) -> ConditionalTransformModule:
    return ConditionalAffine(input_dim, context_dim, hidden, rate)


def _affine_maf(
    input_dim: int, context_dim: int, hidden: Sequence[int], rate: float = 1.0
) -> ConditionalTransformModule:
    if input_dim == 1:  # an autoregressive flow of one coordinate is one more conditional affine map
        return ConditionalAffine(input_dim, context_dim, hidden, rate)
    # a fixed variable order (Pyro draws one at random into a buffer, which Pyro's param store does not save: a guide
    # rebuilt and given the stored parameters would then order its variables differently)
    arn = ConditionalAutoRegressiveNN(
        input_dim, context_dim, list(hidden), param_dims=[1, 1], permutation=torch.arange(input_dim)
    )
    maf = ConditionalAffineAutoregressive(arn)
    with torch.no_grad():  # start as the identity (zero shift and log-scale), as ConditionalAffine does
        maf.nn.layers[-1].weight.zero_()
        maf.nn.layers[-1].bias.zero_()
    return ConditionalComposeTransformModule(
        [ConditionalAffine(input_dim, context_dim, hidden, rate), maf], cache_size=1
    )


#: Named flows: ``name → factory(input_dim, context_dim, hidden, rate)`` (``rate``: the conditional affine block's
#: rate multiplier, :class:`ConditionalAffine`).
FLOWS: dict[str, Callable[..., ConditionalTransformModule]] = {
    "affine": _affine,
    "affine+maf": _affine_maf,
}


def make_flow(
    flow: str | Callable[[int, int], ConditionalTransformModule],
    input_dim: int,
    context_dim: int,
    hidden: Sequence[int],
    rate: float = 1.0,
) -> ConditionalTransformModule:
    """Build a conditional flow: ``flow`` is a name in :data:`FLOWS` or a callable ``(input_dim, context_dim)``
    returning a :class:`~pyro.distributions.conditional.ConditionalTransformModule` (e.g. a
    ``ConditionalComposeTransformModule`` of Pyro's conditional spline or coupling transforms). ``rate``: the rate
    multiplier of a named flow's conditional affine block (a callable's module is used as it is)."""
    if isinstance(flow, str):
        if flow not in FLOWS:
            raise ValueError(
                f"flow must be one of {sorted(FLOWS)} or a callable (input_dim, context_dim), got {flow!r}"
            )
        return FLOWS[flow](input_dim, context_dim, hidden, rate)
    module = flow(input_dim, context_dim)
    if not isinstance(module, ConditionalTransformModule):
        raise TypeError(
            f"flow(input_dim={input_dim}, context_dim={context_dim}) returned {type(module).__name__}; it must "
            "return a pyro.distributions.conditional.ConditionalTransformModule (for example "
            "pyro.distributions.transforms.conditional_spline(input_dim, context_dim))"
        )
    return module

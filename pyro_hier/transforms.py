r"""Maps between free parameters and the quantities guides need: positive scales and Cholesky factors.

**The positive map is** :math:`s = e^{r}` **(one definition, used by every guide).** Guides are trained with Adam,
which moves every free parameter by about the learning rate per step whatever its gradient's size. Under
:math:`s = e^r` a step therefore changes :math:`\log s` by about ``lr``: an sd ten times larger or smaller than
where it started is reached in about :math:`\ln 10 / \mathrm{lr}` steps (46 at ``lr = 0.05``), the same for small
and large sds. Other maps are not scale-free:

- softplus (Pyro's ``AutoNormal``) is :math:`\approx e^r` below 1 but linear above, so growing from 1 to 10 takes
  about :math:`9/\mathrm{lr}` steps;
- the proximal map :math:`\tfrac12(r + \sqrt{r^2 + 4})` of Agrawal & Domke (2021, App. A) is linear above 1 and
  :math:`\approx -1/r` below, so an Adam step changes a small sd by about :math:`\mathrm{lr}\, s^2`: from 0.1 to 1
  took ~200 steps at ``lr = 0.05`` and from 0.1 to 0.01 about 1,800.

Measured on prior-only models, Adam(0.05) with 100 vectorised particles, ``init_scale = 0.1``: steps until the sd
reaches 80% of a target of 1.0 / 125% of a target of 0.01 — AutoNormal 55 / 204, every pyro-hier guide with
:math:`e^r` no more (benchmarks/scale_steps.py, whose table is in benchmarks/README.md).

The map's inverse is :math:`\log`; :func:`positive` clamps its input at ``±MAX_LOG_SCALE`` in the forward pass only
(the gradient passes unchanged), so a runaway network output cannot overflow.
"""

from __future__ import annotations

import torch

__all__ = [
    "MAX_LOG_SCALE",
    "log_positive",
    "positive",
    "positive_inv",
    "raw_from_scale_tril",
    "scale_tril_from_raw",
]

#: ``|log s|`` beyond which :func:`positive` saturates (``e^40 ≈ 2e17``; float32 overflows at ``e^88``).
MAX_LOG_SCALE = 40.0


def positive(raw: torch.Tensor) -> torch.Tensor:
    """The positive map of every guide: ``exp(raw)`` (see the module docstring for why).

    The input is clamped to ``[-MAX_LOG_SCALE, MAX_LOG_SCALE]`` with a straight-through gradient, so values stay
    finite and positive in float32 while the optimiser still sees the true direction."""
    return torch.exp(log_positive(raw))


def log_positive(raw: torch.Tensor, floor: float = -MAX_LOG_SCALE) -> torch.Tensor:
    """``log positive(raw)`` without the round trip through ``exp``: ``raw`` clamped to ``[floor, MAX_LOG_SCALE]``
    with a straight-through gradient (a log-determinant reads it directly; ``floor`` can be raised, as a flow's
    scales are kept above ``e^-15``).

    Example::

        raw = torch.tensor([-50.0, 0.5])
        log_positive(raw)          # tensor([-40.0000, 0.5000]); its gradient is 1 everywhere
    """
    if not raw.requires_grad:  # (nothing to pass straight through: the clamp alone)
        return raw.clamp(floor, MAX_LOG_SCALE)
    held = raw.detach()
    return raw + (held.clamp(floor, MAX_LOG_SCALE) - held)


def positive_inv(s: torch.Tensor | float) -> torch.Tensor:
    """Inverse of :func:`positive`: ``log(s)`` for ``s > 0``."""
    return torch.log(torch.as_tensor(s))


def scale_tril_from_raw(raw: torch.Tensor) -> torch.Tensor:
    r"""Lower-triangular Cholesky factor from an unconstrained square matrix ``R``:

    .. math:: L = \operatorname{diag}(s)\,(I + \operatorname{tril}_{-1}(R)),
              \qquad s = \operatorname{positive}(\operatorname{diag} R) = e^{\operatorname{diag} R}.

    The diagonal of ``L`` is ``s``, and each row's off-diagonal entries are measured relative to that row's scale,
    so an optimiser step moves every entry by a similar fraction of the posterior scale however small or large that
    scale is. Batched over leading dims.
    """
    s = positive(raw.diagonal(dim1=-2, dim2=-1))
    eye = torch.eye(raw.shape[-1], dtype=raw.dtype, device=raw.device)
    return s.unsqueeze(-1) * (raw.tril(-1) + eye)


def raw_from_scale_tril(scale_tril: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`scale_tril_from_raw` (upper triangle set to zero)."""
    s = scale_tril.diagonal(dim1=-2, dim2=-1)
    return (scale_tril / s.unsqueeze(-1)).tril(-1) + torch.diag_embed(positive_inv(s))

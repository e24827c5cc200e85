"""Maps between free parameters and the quantities guides need: positive scales and Cholesky factors.

The positive map is the proximal operator of the Gaussian entropy term that Agrawal & Domke (2021, App. A) found
better than softplus or exp for the diagonal of Cholesky factors:

.. math:: \\operatorname{prox}(x) = \\tfrac12\\left(x + \\sqrt{x^2 + 4}\\right),
   \\qquad \\operatorname{prox}^{-1}(s) = s - 1/s .

It is smooth, increasing, ≈ x for large x and decays like ``-1/x`` for very negative x, so scales never reach 0.
"""

from __future__ import annotations

import torch

__all__ = ["prox_positive", "prox_positive_inv", "raw_from_scale_tril", "scale_tril_from_raw"]


def prox_positive(x: torch.Tensor) -> torch.Tensor:
    """``½ (x + sqrt(x² + 4))``: a smooth bijection from ℝ to (0, ∞).

    Computed without cancellation: the equal form ``2 / (sqrt(x² + 4) - x)`` for ``x < 0``; each branch sees its
    input clamped to its own half-line, so both stay finite everywhere and so do gradients."""
    xp, xn = x.clamp(min=0), x.clamp(max=0)
    return torch.where(x >= 0, 0.5 * (xp + torch.sqrt(xp * xp + 4.0)), 2.0 / (torch.sqrt(xn * xn + 4.0) - xn))


def prox_positive_inv(s: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`prox_positive`: ``s − 1/s`` for ``s > 0``."""
    return s - 1.0 / s


def scale_tril_from_raw(raw: torch.Tensor) -> torch.Tensor:
    r"""Lower-triangular Cholesky factor from an unconstrained square matrix ``R``:

    .. math:: L = \operatorname{diag}(s)\,(I + \operatorname{tril}_{-1}(R)),
              \qquad s = \operatorname{prox}(\operatorname{diag} R).

    The diagonal of ``L`` is ``s`` (the proximal map), and each row's off-diagonal entries are measured relative to
    that row's scale, so an optimiser step moves every entry by a similar fraction of the posterior scale however
    small that scale is. Batched over leading dims.
    """
    s = prox_positive(raw.diagonal(dim1=-2, dim2=-1))
    eye = torch.eye(raw.shape[-1], dtype=raw.dtype, device=raw.device)
    return s.unsqueeze(-1) * (raw.tril(-1) + eye)


def raw_from_scale_tril(scale_tril: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`scale_tril_from_raw` (upper triangle set to zero)."""
    s = scale_tril.diagonal(dim1=-2, dim2=-1)
    return (scale_tril / s.unsqueeze(-1)).tril(-1) + torch.diag_embed(prox_positive_inv(s))

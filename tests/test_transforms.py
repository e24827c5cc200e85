import math

import pytest
import torch
from torch.distributions.transforms import AffineTransform

from pyro_hier.flows import LogScaleAffine
from pyro_hier.transforms import (
    MAX_LOG_SCALE,
    log_positive,
    positive,
    positive_inv,
    raw_from_scale_tril,
    scale_tril_from_raw,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_positive_is_exp_and_saturates_without_losing_the_gradient(dtype):
    x = torch.tensor([-1e6, -50.0, -10.0, 0.0, 3.0, 50.0, 1e6], dtype=dtype, requires_grad=True)
    y = positive(x)
    assert torch.isfinite(y).all() and (y > 0).all()
    inside = x.detach().abs() <= MAX_LOG_SCALE
    torch.testing.assert_close(y[inside], x.detach()[inside].exp())
    assert y[0].item() == pytest.approx(math.exp(-MAX_LOG_SCALE), rel=1e-5)
    assert y[-1].item() == pytest.approx(math.exp(MAX_LOG_SCALE), rel=1e-5)
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad > 0).all()  # straight through the saturation
    s = torch.tensor([1e-9, 0.1, 1.0, 30.0], dtype=dtype)
    torch.testing.assert_close(positive(positive_inv(s)), s)


def test_positive_moves_log_scale_by_the_step():
    """What the map is for: a unit step of the free parameter multiplies the scale by e, at any scale."""
    for s in (1e-3, 1.0, 1e3):
        r = positive_inv(torch.tensor(s, dtype=torch.float64))
        assert (positive(r + 1) / positive(r)).item() == pytest.approx(math.e)


def test_scale_tril_round_trip():
    torch.manual_seed(0)
    raw = torch.randn(4, 3, 3, dtype=torch.float64)
    L = scale_tril_from_raw(raw)
    assert torch.equal(L, L.tril()) and (L.diagonal(dim1=-2, dim2=-1) > 0).all()
    torch.testing.assert_close(raw_from_scale_tril(L), raw.tril())
    torch.testing.assert_close(scale_tril_from_raw(raw_from_scale_tril(L)), L)


def test_log_positive_is_the_log_of_positive_with_its_clamp_and_a_floor():
    x = torch.tensor([-1e6, -20.0, 0.3, 1e6], dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(log_positive(x).exp(), positive(x))
    floored = log_positive(x, floor=-15.0)
    assert floored.detach().tolist() == [-15.0, -15.0, 0.3, MAX_LOG_SCALE]
    floored.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # straight through


def test_log_scale_affine_is_the_affine_map_with_its_log_determinant():
    torch.manual_seed(0)
    loc, log_scale, x = torch.randn(4, 3), torch.randn(4, 3), torch.randn(2, 4, 3)
    ours, torchs = LogScaleAffine(loc, log_scale, event_dim=1), AffineTransform(loc, log_scale.exp(), event_dim=1)
    torch.testing.assert_close(ours(x), torchs(x))
    torch.testing.assert_close(ours.log_abs_det_jacobian(x, ours(x)), torchs.log_abs_det_jacobian(x, torchs(x)))
    free = LogScaleAffine(torch.zeros(3), log_scale[0], event_dim=1)  # one scale for every batch element
    assert free.log_abs_det_jacobian(x, free(x)).shape == (2, 4)

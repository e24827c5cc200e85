import math

import pytest
import torch

from pyro_hier.transforms import MAX_LOG_SCALE, positive, positive_inv, raw_from_scale_tril, scale_tril_from_raw


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

import pytest
import torch

from pyro_hier.transforms import prox_positive, prox_positive_inv, raw_from_scale_tril, scale_tril_from_raw


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prox_positive_is_the_proximal_map_and_stable(dtype):
    x = torch.tensor([-1e12, -1e6, -10.0, -1.0, 0.0, 1.0, 10.0, 1e6], dtype=dtype, requires_grad=True)
    y = prox_positive(x)
    assert (y > 0).all()
    # the defining property: y solves y - 1/y = x
    torch.testing.assert_close(y - 1 / y, x.detach(), rtol=1e-5, atol=1e-5)
    # tail behaviour from the paper: ~ -1/x for very negative x, ~ x for large x
    assert y[0].item() == pytest.approx(1e-12, rel=1e-4)
    assert y[-1].item() == pytest.approx(1e6, rel=1e-6)
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad > 0).all()
    s = torch.tensor([1e-9, 0.1, 1.0, 30.0], dtype=dtype)
    torch.testing.assert_close(prox_positive(prox_positive_inv(s)), s, rtol=1e-5, atol=0)


def test_scale_tril_round_trip():
    torch.manual_seed(0)
    raw = torch.randn(4, 3, 3, dtype=torch.float64)
    L = scale_tril_from_raw(raw)
    assert torch.equal(L, L.tril()) and (L.diagonal(dim1=-2, dim2=-1) > 0).all()
    torch.testing.assert_close(raw_from_scale_tril(L), raw.tril())
    torch.testing.assert_close(scale_tril_from_raw(raw_from_scale_tril(L)), L)

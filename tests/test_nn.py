import pytest
import torch

from pyro_hier.nn import MLP, pool_with_square, segment_pool


def test_mlp_init_and_shapes():
    torch.manual_seed(0)
    net = MLP(50, [200, 200], 7, last_layer_std=1e-3)
    first, last = net[0], net[-1]
    assert first.weight.std().item() == pytest.approx((1 / 50) ** 0.5 * 0.88, rel=0.1)  # truncation shrinks std
    assert first.weight.abs().max() <= 2 * (1 / 50) ** 0.5 + 1e-7
    assert last.weight.abs().max() <= 2e-3 and (last.bias == 0).all()
    out = net(torch.randn(3, 4, 50))
    assert out.shape == (3, 4, 7) and out.abs().max() < 0.05
    with pytest.raises(ValueError, match="positive"):
        MLP(0, [3], 2)


@pytest.mark.parametrize("how", ["mean", "sum", "max"])
def test_segment_pool_matches_padded_pooling(how):
    torch.manual_seed(0)
    sizes = [1, 5, 3, 0, 2]
    values = torch.randn(sum(sizes), 4, dtype=torch.float64)
    segments = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    pooled = segment_pool(values, segments, len(sizes), how)
    start = 0
    for g, n in enumerate(sizes):
        rows = values[start : start + n]
        start += n
        if n == 0:
            expected = torch.zeros(4, dtype=torch.float64)
        else:
            expected = {"mean": rows.mean(0), "sum": rows.sum(0), "max": rows.amax(0)}[how]
        torch.testing.assert_close(pooled[g], expected)
    with pytest.raises(ValueError, match="how"):
        segment_pool(values, segments, 5, "median")


def test_pool_with_square():
    e = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    torch.testing.assert_close(pool_with_square(e), torch.tensor([[2.0, 3.0, 5.0, 10.0]]))

import pytest
import torch

from pyro_hier.nn import MLP, RateLinear, pool_with_square, segment_pool


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


def test_rate_linear_is_the_same_function_and_adam_moves_it_rate_times_as_fast():
    torch.manual_seed(0)
    plain, slow = torch.nn.Linear(3, 2), RateLinear(3, 2, rate=0.1)
    slow.set_weight_(plain.weight.detach())
    with torch.no_grad():
        slow.bias.copy_(plain.bias / 0.1)
    x = torch.randn(5, 3)
    assert torch.allclose(plain(x), slow(x), atol=1e-6)
    moved = []
    for layer in (plain, slow):
        before = layer(x).detach()
        optim = torch.optim.Adam(layer.parameters(), lr=0.01)
        optim.zero_grad()
        layer(x).sum().backward()
        optim.step()
        moved.append((layer(x).detach() - before).abs().mean())
    assert torch.allclose(moved[1], 0.1 * moved[0], rtol=1e-4)
    with pytest.raises(ValueError, match="rate"):
        RateLinear(3, 2, rate=0.0)

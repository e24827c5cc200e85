"""Plate helpers: minibatching a flat plate of rows that gather group effects."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine

from pyro_hier.plates import gathered_rows


def test_gathered_rows_keep_the_minibatch_groups_and_weight_them_unbiasedly():
    group = torch.tensor([0, 2, 1, 2, 0, 3, 2])
    full = gathered_rows(group, 4, None)
    assert full.rows is None and torch.equal(full.group, group) and full.scale == 1.0
    sel = gathered_rows(group, 4, torch.tensor([2, 0]))
    assert torch.equal(sel.rows, torch.tensor([0, 1, 3, 4, 6]))
    assert torch.equal(sel.group, torch.tensor([1, 0, 0, 1, 0]))  # positions in the minibatch [2, 0]
    # Pyro scales the rows' plate by 7/5; with this factor each group's rows weigh 4/2, the unbiased weight
    assert sel.scale * 7 / 5 == pytest.approx(4 / 2)
    # averaged over every minibatch of 2 groups, each row's weight is 1
    weights = torch.zeros(7)
    pairs = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    for a, b in pairs:
        s = gathered_rows(group, 4, torch.tensor([a, b]))
        weights[s.rows] += s.scale * 7 / len(s.rows)
    torch.testing.assert_close(weights / len(pairs), torch.ones(7))


def test_gathered_rows_refuses_repeated_groups():
    with pytest.raises(ValueError, match="distinct group indices"):
        gathered_rows(torch.tensor([0, 1]), 2, torch.tensor([1, 1]))


def test_row_blocks_count_every_row_once():
    """Summed over :func:`row_blocks`, a model's log density on blocks of 3 of its 7 rows drawn at random (the last
    block wrapping around, its repeats masked) is its log density on all 7 rows, with a site outside the plate counted
    once; two plates of rows give every combination of their blocks."""
    from pyro_hier.plates import row_blocks

    y = torch.arange(7.0)
    z = torch.arange(4.0)

    def model(size=3, other=None):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0), obs=torch.tensor(0.3))
        with pyro.plate("rows", 7, subsample_size=size) as i:
            pyro.sample("y", dist.Normal(mu, 2.0), obs=y[i])
        with pyro.plate("other", 4, subsample_size=other, dim=-2) as j:
            pyro.sample("z", dist.Normal(mu, 3.0), obs=z[j].unsqueeze(-1))

    full = poutine.trace(model).get_trace(7, 4).log_prob_sum()
    blocks = row_blocks({"rows": (7, 3)})
    assert len(blocks) == 3
    total = sum(poutine.trace(b(model)).get_trace(3, 4).log_prob_sum() for b in blocks)
    torch.testing.assert_close(total, full)
    blocks = row_blocks({"rows": (7, 3), "other": (4, 2)})
    assert len(blocks) == 6
    total = sum(poutine.trace(b(model)).get_trace(3, 2).log_prob_sum() for b in blocks)
    torch.testing.assert_close(total, full)

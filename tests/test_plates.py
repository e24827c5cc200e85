"""Plate helpers: minibatching a flat plate of rows that gather group effects."""

import pytest
import torch

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

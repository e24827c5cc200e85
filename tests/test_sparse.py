"""select_elements: the same rows as Pyro's plate slicing, and a gradient that is sparse over exactly the rows read
(when a sparse-aware optimiser consumes it) and equal to the dense one."""

import pyro
import pytest
import torch

from pyro_hier.optim import LazyAdam
from pyro_hier.plates import element_selection
from pyro_hier.sparse import element_dims, select_elements, sparse_grad_consumed


def _chain(value, selection, event_dim):
    """The reference: index_select plate by plate (what Pyro's SubsampleMessenger does)."""
    for dim, idx in selection.items():
        pos = value.dim() - event_dim + dim
        if idx is not None and value.shape[pos] != 1:
            value = value.index_select(pos, idx)
    return value


@pytest.mark.parametrize(
    "shape, selection, event_dim, rows",
    [
        ((6, 1, 3), {-2: torch.tensor([4, 1])}, 1, 1),  # one plate at dim -2, as the regression's groups
        ((5, 4, 2, 2), {-2: torch.tensor([3, 0]), -1: torch.tensor([1, 2, 3])}, 2, 2),  # nested plates
        ((5, 4, 2), {-2: None, -1: torch.tensor([2])}, 1, 2),  # the outer plate used in full
        ((1, 4, 2), {-2: torch.tensor([0]), -1: torch.tensor([3, 1])}, 1, 2),  # broadcast over the outer plate
    ],
)
def test_rows_and_gradient_equal_plate_slicing_and_the_gradient_is_sparse_when_consumed(
    shape, selection, event_dim, rows
):
    value = torch.nn.Parameter(torch.randn(shape, dtype=torch.float64))
    weight = torch.randn(_chain(value, selection, event_dim).shape, dtype=torch.float64)
    expected = _chain(value, selection, event_dim)
    (expected * weight).sum().backward()
    dense_grad, value.grad = value.grad, None

    out = select_elements(value, selection, event_dim)
    assert torch.equal(out, expected)
    assert element_dims(value) == rows
    (out * weight).sum().backward()
    assert not value.grad.is_sparse  # no optimiser consumes sparse gradients: the dense one, as index_select gives
    assert torch.equal(value.grad, dense_grad)

    value.grad = None
    optimizer = LazyAdam([value])
    assert sparse_grad_consumed(value)
    (select_elements(value, selection, event_dim) * weight).sum().backward()
    assert value.grad.is_sparse and value.grad.sparse_dim() == rows
    assert value.grad._nnz() == expected.shape[:rows].numel()  # only the rows read
    assert torch.equal(value.grad.to_dense(), dense_grad)
    del optimizer
    assert not sparse_grad_consumed(value)  # the optimiser is gone: dense gradients again


def test_no_grad_and_full_plates_read_without_copy_and_bad_input_is_refused():
    value = torch.nn.Parameter(torch.randn(4, 1, 2))
    assert select_elements(value, {-2: None}, 1) is value
    with torch.no_grad():
        assert torch.equal(select_elements(value, {-2: torch.tensor([2])}, 1), value[[2]])
    with pytest.raises(ValueError, match="negative"):
        select_elements(value, {1: torch.tensor([0])}, 1)


def test_element_selection_reads_pyro_plates_and_plate_calls():
    from pyro_hier.plates import PlateCall

    plates = {"a": pyro.plate("a", 5, subsample=torch.tensor([1, 3]), dim=-2), "b": pyro.plate("b", 3, dim=-1)}
    sel = element_selection(plates, ["a", "b"], [-2, -1])
    assert torch.equal(sel[-2], torch.tensor([1, 3])) and sel[-1] is None
    calls = {"a": PlateCall("a", 5, torch.arange(5), False)}
    assert element_selection(calls, ["a"], [-2]) == {-2: None}

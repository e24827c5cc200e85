r"""Per-element parameters read row by row, with gradients that touch only the rows read.

A guide with free parameters per plate element (a location, a Cholesky factor, an encoding for every group) keeps
them at the plates' **full** sizes and, on a minibatch step, uses only the rows of the groups in the minibatch.
Pyro's :class:`~pyro.poutine.subsample_messenger.SubsampleMessenger` selects those rows with ``index_select``, whose
backward writes a *dense* gradient: ``N`` rows, all zero but ``B``. The optimiser then reads and writes every row on
every step, and ``DistributedDataParallel`` all-reduces all of them, so a step costs :math:`O(N)` although only
:math:`O(B)` numbers carry information (at :math:`N = 10^5` groups and :math:`d = 10` the dense branch guide moved 84 MB
per step, 0.4% of it non-zero).

:func:`select_elements` selects the rows itself. Its backward returns a **sparse** (COO) gradient — indices of the
rows read, their values — when a sparse-aware optimiser consumes the parameter (:func:`consume_sparse_grad`, called by
:class:`pyro_hier.optim.LazyAdam`), and the same dense gradient as ``index_select`` otherwise, so Pyro's and torch's
own optimisers keep working unchanged. Rows are the parameter's leading dims up to its last plate dim (a parameter
``(N, 1, d)`` of a plate at dim ``-2`` with ``event_dim=1`` has ``N`` rows; nested plates give one row per element
of their product), recorded on the parameter (:func:`element_dims`) for the optimiser.

Example::

    loc = torch.nn.Parameter(torch.zeros(N, 1, d))           # one row per group of a plate at dim -2
    optimizer = pyro_hier.optim.LazyAdam([loc], lr=0.01)     # declares that it reads sparse gradients of loc
    rows = select_elements(loc, {-2: idx}, event_dim=1)       # (B, 1, d): the rows of the plate's subsample idx
    rows.pow(2).sum().backward()                              # loc.grad: sparse, B rows
    optimizer.step()                                          # reads and writes those B rows only

The parameter passed must be the leaf tensor itself (the unconstrained value of a ``PyroParam`` with constraint
``real``, or an ``nn.Parameter``): a gradient can be sparse only where nothing but the row selection lies between it
and the parameter. Anything else gets the dense gradient.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = [
    "all_reduce_sparse_grads",
    "consume_sparse_grad",
    "element_dims",
    "element_parameters",
    "select_elements",
    "sparse_grad_consumed",
]

#: attribute on a parameter: how many leading dims index plate elements (set by :func:`select_elements`)
_ELEMENT_DIMS = "_pyro_hier_element_dims"

#: id(parameter) -> (weak reference to the parameter, weak reference to the optimiser that consumes sparse gradients)
_CONSUMERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def element_dims(param: torch.Tensor) -> int | None:
    """How many leading dims of ``param`` index plate elements (its *rows*: their product), as recorded by
    :func:`select_elements`; ``None`` for a parameter never selected by plate (a global, a network weight)."""
    return getattr(param, _ELEMENT_DIMS, None)


def consume_sparse_grad(param: torch.Tensor, optimizer: object) -> None:
    """Declare that ``optimizer`` reads sparse gradients of ``param``: from the next backward on, the rows selected by
    :func:`select_elements` give ``param`` a sparse gradient, for as long as ``optimizer`` is alive (afterwards the
    gradient is dense again, so another optimiser can take over)."""
    key = id(param)
    _CONSUMERS[key] = (weakref.ref(param, lambda ref, key=key: _forget(key, ref)), weakref.ref(optimizer))


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _CONSUMERS.get(key)
    if entry is not None and entry[0] is ref:
        del _CONSUMERS[key]


def sparse_grad_consumed(param: torch.Tensor) -> bool:
    """Whether a live optimiser declared (:func:`consume_sparse_grad`) that it reads sparse gradients of ``param``."""
    entry = _CONSUMERS.get(id(param))
    return entry is not None and entry[0]() is param and entry[1]() is not None


def select_elements(value: torch.Tensor, selection: Mapping[int, torch.Tensor | None], event_dim: int) -> torch.Tensor:
    """The elements of a full-size per-element tensor that the plates of this call use.

    ``value`` has shape ``batch_shape + event_shape`` (``event_dim`` trailing dims) with each plate at its full size at
    its dim in the batch shape (or 1); ``selection`` maps **every** plate dim of the parameter (negative, as
    ``pyro.plate(..., dim=)``) to the indices used on this call, or ``None`` for a plate used in full. The result has
    each subsampled plate dim cut to its indices, in their order, as Pyro's plates would slice a
    ``PyroParam(..., event_dim=event_dim)``; its gradient reaches ``value`` as a sparse tensor over the rows read when
    ``value`` is a leaf whose optimiser reads sparse gradients (:func:`consume_sparse_grad`), densely otherwise.
    """
    batch_dims = value.dim() - event_dim
    positions: dict[int, torch.Tensor | None] = {}
    for dim, index in selection.items():
        if dim >= 0:
            raise ValueError(f"select_elements: plate dims are negative (as in pyro.plate), got {dim}")
        pos = batch_dims + dim
        if pos < 0 or value.shape[pos] == 1:  # a plate this parameter broadcasts over
            continue
        if index is not None and index.dim() != 1:
            raise ValueError(f"select_elements: indices must be a vector, got shape {tuple(index.shape)}")
        positions[pos] = index
    if not positions:
        return value
    rows = max(positions) + 1
    if value.requires_grad and value.grad_fn is None and getattr(value, _ELEMENT_DIMS, None) != rows:
        setattr(value, _ELEMENT_DIMS, rows)  # a leaf parameter: tell the optimiser where its rows are
    if all(index is None for index in positions.values()):
        return value
    if not (torch.is_grad_enabled() and value.requires_grad):
        for pos, index in positions.items():
            if index is not None:
                value = value.index_select(pos, index.to(value.device))
        return value
    shape = value.shape[:rows]
    indices = []
    for pos in range(rows):
        index = positions.get(pos)
        if index is None:
            index = torch.arange(shape[pos], device=value.device)
        indices.append(index.to(device=value.device, dtype=torch.long))
    return _SelectRows.apply(value, rows, *indices)


def _flat_rows(indices: tuple[torch.Tensor, ...], shape: torch.Size) -> torch.Tensor:
    """Row numbers (in ``prod(shape)`` rows, C order) of the grid ``indices[0] × indices[1] × …``."""
    flat = None
    n = len(indices)
    for k, index in enumerate(indices):
        term = (index * math.prod(shape[k + 1 :])).reshape((-1,) + (1,) * (n - 1 - k))
        flat = term if flat is None else flat + term
    assert flat is not None
    return flat


class _SelectRows(torch.autograd.Function):
    """``value[i_0, i_1, …]`` over its leading ``rows`` dims (a grid of indices); backward: sparse or dense."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, rows: int, *indices: torch.Tensor) -> torch.Tensor:
        ctx.param = weakref.ref(value)
        ctx.shape = value.shape
        ctx.rows = rows
        if rows == 1:  # (one plate of rows: its indices are the row numbers)
            ctx.save_for_backward(indices[0], indices[0])
            return value.index_select(0, indices[0])
        shape = value.shape[:rows]
        flat = _flat_rows(indices, shape)  # (n_0, …, n_{rows-1})
        rest = value.shape[rows:]
        out = value.reshape((-1, *rest)).index_select(0, flat.reshape(-1))
        ctx.save_for_backward(flat, *indices)
        return out.reshape((*flat.shape, *rest))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        flat, *indices = ctx.saved_tensors
        rows, shape = ctx.rows, ctx.shape
        rest = shape[rows:]
        values = grad.reshape((-1, *rest))
        param = ctx.param()
        none = (None,) * (1 + len(indices))
        if param is not None and sparse_grad_consumed(param):
            if rows == 1:
                grid = indices[0].unsqueeze(0)
            else:
                grid = [i.reshape((-1,) + (1,) * (rows - 1 - k)).expand(flat.shape) for k, i in enumerate(indices)]
                grid = torch.stack(grid).reshape(rows, -1)
            return (torch.sparse_coo_tensor(grid, values, shape, check_invariants=False), *none)
        dense = values.new_zeros((math.prod(shape[:rows]), *rest)).index_add_(0, flat.reshape(-1), values)
        return (dense.reshape(shape), *none)


def element_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The per-element parameters of ``module`` (those :func:`select_elements` has read, so call the guide once
    first), by their names in ``module``. Under ``DistributedDataParallel``, leave them out of DDP's dense all-reduce
    and average their sparse gradients with :func:`all_reduce_sparse_grads` (``tutorials/distributed_training.py``)."""
    return {name: p for name, p in module.named_parameters() if element_dims(p) is not None}


def all_reduce_sparse_grads(params, *, group=None) -> int:
    """Average the gradients of ``params`` over the processes of ``torch.distributed`` (``group``: the default one):
    sparse gradients by a sparse all-reduce, which sends only the rows each process touched (gloo supports it), dense
    ones by a dense all-reduce. Call it after ``backward`` and before the optimiser's step. Returns the bytes this
    process contributed (indices and values of its rows, or the dense gradients)."""
    world = dist.get_world_size(group)
    sent = 0
    for p in params:
        if p.grad is None:
            raise RuntimeError("all_reduce_sparse_grads: a parameter has no gradient; every process must use it")
        grad = p.grad
        if grad.is_sparse:
            grad = grad.coalesce()
            sent += grad.indices().numel() * grad.indices().element_size()
            sent += grad.values().numel() * grad.values().element_size()
        else:
            sent += grad.numel() * grad.element_size()
        dist.all_reduce(grad, group=group)
        p.grad = grad / world
    return sent

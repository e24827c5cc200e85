"""Plates as the model opens them: sizes and the model's *own* subsample indices, captured at run time.

Pyro's autoguides open their own plates and draw their own random subsample, which the model then silently adopts
through replay, even when the model asked for specific indices with ``pyro.plate(name, N, subsample=idx)``
(pyro-ppl/pyro#3468). The guides of this package instead ask the model which indices it uses on *this* call:
:func:`capture_plates` runs the model just far enough to see every plate open, under :func:`pyro.poutine.block` so
nothing leaks into the caller's traces, and :func:`open_plates` opens the guide's plates with exactly those indices.
Per-element parameters that are full-size ``PyroParam(..., event_dim=k)`` are then cut to the rows of those indices,
by :func:`pyro_hier.sparse.select_elements` (with :func:`element_selection`: sparse gradients, so that an optimiser
can update only the rows used) or by Pyro's own :class:`~pyro.poutine.subsample_messenger.SubsampleMessenger` when a
guide reads them inside its plates.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass

import pyro
import torch
from pyro import poutine
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample

from pyro_hier.errors import StructureError

__all__ = [
    "GatheredRows",
    "PlateCall",
    "ReplaySubsamples",
    "RowBlock",
    "call_key",
    "capture_plates",
    "check_plate_sizes",
    "draw_subsamples",
    "drawn_at_random",
    "element_selection",
    "gathered_rows",
    "open_plates",
    "plate_indices",
    "row_blocks",
]


@dataclass(frozen=True)
class PlateCall:
    """What one call of the model did with one plate.

    :ivar name: the plate's name.
    :ivar size: the plate's full size ``N``.
    :ivar indices: the indices of the elements used in this call (length ``subsample_size``).
    :ivar user_indices: ``True`` when the model chose them itself with ``pyro.plate(..., subsample=idx)``;
        ``False`` when Pyro drew them at random (``subsample_size=B``) or the plate is not subsampled.
    """

    name: str
    size: int
    indices: torch.Tensor
    user_indices: bool

    @property
    def subsample_size(self) -> int:
        return int(self.indices.shape[0])

    @property
    def subsampled(self) -> bool:
        return self.subsample_size < self.size


class ReplaySubsamples(Messenger):
    """Gives the plates that Pyro would subsample at random (``pyro.plate(name, N, subsample_size=B)``) the indices
    ``subsamples[name]`` instead (each of length ``B``: Pyro checks it); plates the model gives its own indices, and
    plates not listed, are left alone.

    Example::

        with ReplaySubsamples({"groups": torch.arange(10)}):
            model()  # pyro.plate("groups", 1000, subsample_size=10) opens groups 0..9
    """

    def __init__(self, subsamples: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.subsamples = subsamples

    def _pyro_sample(self, msg) -> None:
        if isinstance(msg["fn"], _Subsample) and msg["value"] is None and msg["name"] in self.subsamples:
            msg["value"], msg["done"] = self.subsamples[msg["name"]], True


class RowBlock(Messenger):
    r"""One block of a sum over *all* the rows of plates that Pyro subsamples at random, run as the model's call on
    ``B`` of them (Pyro cannot open such a plate in full). Made by :func:`row_blocks`, whose blocks together count
    every row once: the block's rows are replayed as the plates' subsample (``indices``); sites in these plates are
    masked where a row repeats an earlier block's (``keep``) and their scale divided by Pyro's ``N/B``, and a site
    outside one of these plates counts only in that plate's first block (``first``). Summing any quantity linear in
    the model's log density over the blocks (a log likelihood, its gradient and curvature in a group's effect) then
    gives its value on all the rows:

    .. math:: \sum_b \Big[\sum_{i \in b,\ \mathrm{keep}} \ell_i + [b = 0] \, r\Big] = \sum_{i=1}^N \ell_i + r.

    Example::

        total = sum(poutine.trace(block(model)).get_trace().log_prob_sum() for block in row_blocks({"data": (200, 50)}))
    """

    def __init__(
        self,
        indices: Mapping[str, torch.Tensor],
        keep: Mapping[str, torch.Tensor],
        factor: Mapping[str, float],
        first: Mapping[str, bool],
    ):
        super().__init__()
        self.indices, self.keep, self.factor, self.first = dict(indices), dict(keep), dict(factor), dict(first)

    def __call__(self, fn: Callable) -> Callable:
        replay = ReplaySubsamples(self.indices)

        def run(*args, **kwargs):
            with replay, self:
                return fn(*args, **kwargs)

        return run

    def _pyro_sample(self, msg) -> None:
        if isinstance(msg["fn"], _Subsample):
            return
        frames = [f for f in msg["cond_indep_stack"] if f.name in self.keep]
        inside = {f.name for f in frames}
        if not all(first for name, first in self.first.items() if name not in inside):
            msg["mask"] = False if msg["mask"] is None else msg["mask"] & False
            return
        for f in frames:
            keep = self.keep[f.name].reshape((-1,) + (1,) * (-1 - f.dim))
            msg["mask"] = keep if msg["mask"] is None else msg["mask"] & keep
            msg["scale"] = msg["scale"] * self.factor[f.name]


def row_blocks(plates: Mapping[str, tuple[int, int]], device: torch.device | str | None = None) -> list[RowBlock]:
    """Blocks of ``B`` consecutive rows covering each plate of ``N`` rows once (``plates[name] = (N, B)``; the last
    block wraps around to the first rows and masks them), one :class:`RowBlock` per combination of the plates'
    blocks."""
    per_plate = []
    for name, (size, block) in plates.items():
        parts = []
        for k, start in enumerate(range(0, size, block)):
            at = torch.arange(start, start + block, device=device)
            parts.append((name, at % size, at < size, block / size, k))
        per_plate.append(parts)
    blocks = []
    for combination in itertools.product(*per_plate):
        blocks.append(
            RowBlock(
                {n: i for n, i, _, _, _ in combination},
                {n: m for n, _, m, _, _ in combination},
                {n: f for n, _, _, f, _ in combination},
                {n: k == 0 for n, _, _, _, k in combination},
            )
        )
    return blocks


class _AllPlatesSeen(Exception):
    """Raised inside the model to stop it once every plate of interest has been opened."""


class PlateRecorder(Messenger):
    """Records every plate the model creates: its full size and the indices it uses.

    A plate announces itself with a sample site of the plate's name whose distribution is Pyro's private
    ``_Subsample``; its value is already set when the model passed ``subsample=idx`` and is drawn otherwise.

    :param stop_after: if given, raise an internal signal to stop the model as soon as all these plates are seen.
    """

    def __init__(self, stop_after: Iterable[str] | None = None) -> None:
        super().__init__()
        self.calls: dict[str, PlateCall] = {}
        self._user_given: dict[str, bool] = {}
        self._stop_after = None if stop_after is None else frozenset(stop_after)

    def _pyro_sample(self, msg) -> None:
        if isinstance(msg["fn"], _Subsample):
            self._user_given[msg["name"]] = msg["value"] is not None

    def _pyro_post_sample(self, msg) -> None:
        if not isinstance(msg["fn"], _Subsample):
            return
        name = msg["name"]
        self.calls[name] = PlateCall(
            name=name,
            size=int(msg["fn"].size),
            indices=msg["value"],
            user_indices=self._user_given.get(name, False),
        )
        if self._stop_after is not None and self._stop_after <= self.calls.keys():
            raise _AllPlatesSeen


def capture_plates(
    model: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    names: Iterable[str] | None = None,
    subsamples: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, PlateCall]:
    """Run ``model(*args, **kwargs)`` until every plate in ``names`` has been opened and return what it did.

    The model runs hidden from every outer handler (nothing enters the caller's trace, no outer plate broadcasts it)
    and stops as soon as the last plate in ``names`` is created, so the cost is that of the model's code up to its
    innermost plate. With ``names=None`` the whole model runs. ``subsamples`` gives plates that Pyro would subsample
    at random these indices (:class:`ReplaySubsamples`); they count as Pyro's draw (``user_indices=False``).

    Example::

        def model(idx):
            with pyro.plate("groups", 100, subsample=idx):
                pyro.sample("z", dist.Normal(0, 1))

        capture_plates(model, (torch.tensor([3, 5]),))["groups"].indices  # tensor([3, 5])
    """
    recorder = PlateRecorder(stop_after=names)
    with poutine.block(), ReplaySubsamples(subsamples or {}), recorder:
        try:
            model(*args, **(kwargs or {}))
        except _AllPlatesSeen:
            pass
    return recorder.calls


def call_key(args: tuple, kwargs: dict) -> tuple:
    """Which call of the model this is, for reusing what a guide read from the model on the last one: each
    argument's identity, and a tensor's storage, shape and version counter (changed by any in-place write). Equal keys
    mean the same objects, unmodified (a full-data training loop, ``Predictive``'s draws). Whoever keeps a result under
    a key must hold the arguments with it, so that their identities cannot be reused by other objects. Under
    ``torch.jit.trace`` (Pyro's ``JitTrace_ELBO``) the key equals no other: what is read there must be recorded from
    the traced arguments, not reused from an earlier call, or the compiled step would replay that call's values.

    Example::

        key = call_key(args, kwargs)
        if cached is None or cached[0] != key:
            cached = (key, args, kwargs, capture_plates(model, args, kwargs))  # (the arguments held with the key)
    """

    if torch.jit.is_tracing():  # a traced graph must not hold another call's results as constants: never equal
        return (object(),)
    return tuple(argument_key(a) for a in args) + tuple((k, argument_key(v)) for k, v in sorted(kwargs.items()))


def argument_key(x: object) -> tuple | int:
    """One argument's part of :func:`call_key`: its identity, and a tensor's storage, shape and version counter. The
    same under ``torch.jit.trace`` (for a key that a compiled step may hold on purpose); whoever keeps a result under
    it must hold the argument with it.

    Example::

        y = torch.zeros(3)
        key = argument_key(y)
        y.add_(1.0)  # an in-place write advances the version counter
        assert argument_key(y) != key
    """
    if isinstance(x, torch.Tensor):
        return (id(x), x.data_ptr(), tuple(x.shape), x._version)
    return id(x)


def drawn_at_random(calls: Mapping[str, PlateCall]) -> bool:
    """Whether Pyro drew a plate's subsample at random on this call (``subsample_size=`` without indices): another
    call with the same arguments would use other elements."""
    return any(call.subsampled and not call.user_indices for call in calls.values())


def check_plate_sizes(calls: dict[str, PlateCall], sizes: dict[str, int], who: str) -> None:
    """Raise a :class:`StructureError` if a plate is missing from ``calls`` or changed its full size since ``sizes``
    was recorded. ``who`` names the object whose parameters depend on the sizes (used in the message)."""
    for name, size in sizes.items():
        call = calls.get(name)
        if call is None:
            raise StructureError(
                f"plate '{name}' was opened by the model when {who} was built, but not in this call. "
                "The guide needs the same plates on every call: open the plate unconditionally."
            )
        if call.size != size:
            raise StructureError(
                f"plate '{name}' has full size {call.size} in this call but {size} when {who} was built; its "
                "per-element parameters cannot change size. Pass the full plate size to pyro.plate and select "
                "elements with subsample=..., or build a new guide for the new data."
            )


def open_plates(calls: dict[str, PlateCall], dims: dict[str, int]) -> dict[str, pyro.plate]:
    """Create the guide's plates (not yet entered) with exactly the indices of ``calls``.

    ``dims`` maps each plate to the dim the model uses for it. Because the guide's plate then uses the model's own
    indices, Pyro's replay of the guide's subsample into the model changes nothing.
    """
    plates = {}
    for name, dim in dims.items():
        call = calls[name]
        if call.user_indices and not call.subsampled:
            if not torch.equal(call.indices, torch.arange(call.size, device=call.indices.device)):
                raise StructureError(
                    f"plate '{name}' was given subsample indices that cover all {call.size} elements in a new order; "
                    "Pyro's plates slice parameters only for proper subsamples, so per-element parameters would be "
                    "silently misaligned. Pass the indices sorted, or subsample=None for the full plate."
                )
        subsample = call.indices if call.subsampled else None
        plates[name] = pyro.plate(name, call.size, subsample=subsample, dim=dim)
    return plates


def element_selection(
    plates: Mapping[str, pyro.plate | PlateCall], names: Iterable[str], dims: Iterable[int]
) -> dict[int, torch.Tensor | None]:
    r"""For :func:`pyro_hier.sparse.select_elements`: each plate's dim mapped to the indices it uses on this call, or
    ``None`` where it uses all its elements. ``plates`` holds the guide's plates (``pyro.plate``\ s, before or after
    they are entered) or the model's :class:`PlateCall`\ s; ``names`` and ``dims`` are a level's plates and their
    dims."""
    out: dict[int, torch.Tensor | None] = {}
    for name, dim in zip(names, dims, strict=True):
        plate = plates[name]
        if isinstance(plate, PlateCall):
            out[dim] = plate.indices if plate.subsampled else None
        else:
            out[dim] = plate.indices if plate.subsample_size < plate.size else None
    return out


def plate_indices(plates: dict[str, pyro.plate]) -> dict[str, torch.Tensor]:
    """The indices of a guide's plates on this call, by name (to replay in the model's own runs)."""
    return {name: p.indices for name, p in plates.items()}


def enter_plates(stack: ExitStack, plates: dict[str, pyro.plate], names: Iterable[str]) -> None:
    """Enter ``plates[name]`` for every name, in order, on an :class:`~contextlib.ExitStack`."""
    for name in names:
        stack.enter_context(plates[name])


def draw_subsamples(
    full_sizes: Mapping[str, int],
    sizes: Mapping[str, int],
    *,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Indices for one step of training on a *reduced model*: for every plate in ``sizes``, ``sizes[plate]``
    distinct elements of ``range(full_sizes[plate])`` drawn uniformly without replacement (sorted).

    Pass them to the model's plates (``pyro.plate(name, N, subsample=idx)``): a site is then kept when all its plates'
    indices are selected, and Pyro scales each plate's log-densities by ``N / len(idx)``, which makes the minibatch
    ELBO an unbiased estimate of the full one (PAVI's reduced model, Rouillard et al. 2023, §4.2).
    ``full_sizes`` is typically ``{name: p.size for name, p in inspect_model(model, args).plates.items()}`` or
    ``guide.structure.plates``.

    Example::

        idx = draw_subsamples({"groups": 20000, "obs": 50}, {"groups": 20})
        svi.step(x, subsample=idx["groups"])
    """
    out = {}
    for name, k in sizes.items():
        if name not in full_sizes:
            raise StructureError(f"plate '{name}' is not a plate of the model; its plates are {sorted(full_sizes)}")
        n = full_sizes[name]
        n = getattr(n, "size", n)  # a PlateInfo
        if not (isinstance(k, int) and 1 <= k <= n):
            raise ValueError(f"the reduced size of plate '{name}' must be an integer in 1..{n}, got {k!r}")
        idx = torch.randperm(n, generator=generator)[:k].sort().values
        out[name] = idx.to(device) if device is not None else idx
    return out


@dataclass(frozen=True)
class GatheredRows:
    """The rows of a flat plate that belong to a minibatch of groups (see :func:`gathered_rows`).

    :ivar rows: indices of the rows kept (``None``: all rows, no subsample).
    :ivar group: each kept row's group as a position in the minibatch (the group index itself without subsample),
        for gathering ``z[..., group]`` from group effects sampled under the subsampled group plate.
    :ivar scale: the factor to put on the rows' plate (``poutine.scale``) so that the minibatch estimate is
        unbiased: the rows' plate scales by ``num_rows / len(rows)``, the groups need ``num_groups / len(subsample)``.
    """

    rows: torch.Tensor | None
    group: torch.Tensor
    scale: float


def gathered_rows(group: torch.Tensor, num_groups: int, subsample: torch.Tensor | None) -> GatheredRows:
    """Minibatch a flat plate of rows that index group effects with ``z[group]`` (homes in counties, ratings by
    users): keep the rows of the groups in ``subsample``.

    Example::

        with pyro.plate("counties", C, subsample=idx):
            a = pyro.sample("a", dist.Normal(0, 1))
        sel = gathered_rows(county, C, idx)
        with pyro.plate("homes", len(county), subsample=sel.rows), poutine.scale(scale=sel.scale):
            pyro.sample("y", dist.Normal(a[..., sel.group], 1), obs=y if sel.rows is None else y[sel.rows])
    """
    if subsample is None:
        return GatheredRows(None, group, 1.0)
    subsample = subsample.to(device=group.device, dtype=torch.long)
    if torch.unique(subsample).numel() != subsample.numel():
        raise ValueError(f"subsample must hold distinct group indices, got {subsample.tolist()}")
    rows = torch.isin(group, subsample).nonzero().squeeze(-1)
    position = torch.full((num_groups,), -1, dtype=torch.long, device=group.device)
    position[subsample] = torch.arange(subsample.numel(), device=group.device)
    scale = (num_groups / subsample.numel()) * (rows.numel() / group.numel())
    return GatheredRows(rows, position[group[rows]], scale)

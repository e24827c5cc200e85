r"""The gathers of each call, as the guides use them: for a site and a plate it reads (directly or through a chain
of gathers), the position of the element each of its elements reads, in the plate as *this* call opened it.

:func:`pyro_hier.gathers.trace_gathers` finds the gathers of one call of the model at the cost of a few model runs.
Guides need them on every call (each SVI step's minibatch), so :class:`GatherMaps` keeps, for every reading site
and plate, a table in the plates' *full* numbering — element ``k`` of the reading site (its full indices, raveled)
reads element ``table[k]`` of the plate — filled from the calls it has traced. A call whose elements are all in
the table costs no model run: its positions are the table's entries converted to the call's subsample positions.
The tables are kept while the model's arguments are the same objects (the indices a model passes to
``pyro.plate(..., subsample=idx)`` excepted), on the assumption that the data decide which element a row reads
(``county[i]`` for home ``i``), not the minibatch.

Chains compose: homes gathering counties that gather states read, per home, the state of their county,
:math:`\mathrm{state}(i) = \mathrm{county\_state}[\mathrm{county}[i]]`, whether or not the homes read the states
directly (:meth:`CallGathers.positions`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from pyro_hier.errors import StructureError
from pyro_hier.gathers import keep_random_state, trace_gathers
from pyro_hier.plates import PlateCall, capture_plates
from pyro_hier.structure import ModelStructure, PlateLevel

__all__ = [
    "CallGathers",
    "GatherMaps",
    "arguments_key",
    "full_call_gathers",
    "full_data_call",
    "read_elements",
    "same_key",
]

#: tables larger than this many reading elements are not kept (crossed plates of 10⁵ × 10⁴): such calls are traced
MAX_TABLE = 2**26


def arguments_key(args: tuple, kwargs: Mapping, calls: Mapping[str, PlateCall] | None = None) -> tuple:
    """What identifies the data of a call: the argument objects themselves (compared with ``is``; a tensor also by
    its version counter, so that changing it in place counts as new data), except the subsample indices the model
    passes to its plates (``calls``' user indices, or ``None`` for all), which change from step to step."""
    skip = [c.indices for c in (calls or {}).values() if c.user_indices]

    def part(value):
        if value is None or any(value is s for s in skip):  # None: the call on all the data
            return ("subsample",)
        if isinstance(value, int | float | str | bool):
            return ("value", value)
        return ("object", value, value._version if isinstance(value, torch.Tensor) else None)

    keyword = ((k, part(v)) for k, v in sorted(kwargs.items()))
    return (tuple(part(a) for a in args), tuple((k, p) for k, p in keyword if p != ("subsample",)))


def same_key(a: tuple | None, b: tuple) -> bool:
    """Whether two :func:`arguments_key` s name the same data."""
    if a is None:
        return False

    def eq(x, y) -> bool:
        if x[0] != y[0]:
            return False
        return x[1] is y[1] and x[2] == y[2] if x[0] == "object" else x[1:] == y[1:]

    (a_args, a_kw), (b_args, b_kw) = a, b
    if len(a_args) != len(b_args) or [k for k, _ in a_kw] != [k for k, _ in b_kw]:
        return False
    return all(eq(x, y) for x, y in zip(a_args, b_args)) and all(eq(x, y) for (_, x), (_, y) in zip(a_kw, b_kw))


def full_data_call(
    model: Callable, args: tuple, kwargs: Mapping, calls: Mapping[str, PlateCall] | None = None
) -> tuple[tuple, dict, dict[str, torch.Tensor]]:
    """The arguments of the model's call on *all* its data: ``(args, kwargs, forced)``.

    Subsample indices the model passed to its plates (arguments that are the very objects the plates received,
    e.g. ``subsample=idx``) are replaced by ``None`` — the model then opens the full plates and selects no rows, as
    a model written with :func:`pyro_hier.plates.gathered_rows` does — and plates that Pyro subsampled at random
    (``subsample_size=``) are forced to all their elements (``forced``: indices to replay, as
    :func:`~pyro_hier.gathers.trace_gathers` and :func:`~pyro_hier.local_data.capture_observations` take them).

    :raises StructureError: if some plate is still subsampled (its indices do not come from an argument).
    """
    kwargs = dict(kwargs)
    with keep_random_state():
        return _full_data_call(model, args, kwargs, calls)


def _full_data_call(model, args, kwargs, calls):
    if calls is None:
        calls = capture_plates(model, args, kwargs)
    given = [c.indices for c in calls.values() if c.user_indices and c.subsampled]

    def clear(value):
        return None if any(value is g for g in given) else value

    args = tuple(clear(a) for a in args)
    kwargs = {k: clear(v) for k, v in kwargs.items()}
    forced = {name: torch.arange(c.size, device=c.indices.device) for name, c in calls.items() if not c.user_indices}
    full = capture_plates(model, args, kwargs) if given else None
    if full is not None:
        for name, c in full.items():
            if c.subsampled and c.user_indices:
                raise StructureError(
                    f"plate '{name}' is subsampled with indices the guide cannot trace back to an argument of the "
                    "model, so the guide cannot read all of its data. Pass the indices as an argument "
                    "(pyro.plate(name, N, subsample=idx) with idx an argument of the model, None for all), or "
                    "subsample the groups and keep their rows with pyro_hier.plates.gathered_rows."
                )
            if not c.user_indices:
                forced[name] = torch.arange(c.size, device=c.indices.device)
    return args, kwargs, forced


class GatherMaps:
    """Per-call gathers of a model with a table in full numbering (see the module docstring).

    :param structure: the model's structure (its prototype gathers tell which site reads which plate).
    :param model: the model to trace on a miss (a guide passes its model).

    ``runs`` counts the calls of :func:`~pyro_hier.gathers.trace_gathers` (each ``2 + digits`` model runs per
    source site), for measurements.
    """

    def __init__(self, structure: ModelStructure, model: Callable, *, max_table: int = MAX_TABLE) -> None:
        self.structure = structure
        self.model = model
        self.max_table = max_table
        self.readers: set[str] = set()
        self.sources: set[str] = set()
        self.runs = 0
        self._key: tuple | None = None
        self._tables: dict[tuple[str, str, str], torch.Tensor] = {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["model"] = None  # the guide gives it back (attach_model)
        state["_key"] = None  # argument objects are not pickled: the tables are rebuilt on use
        state["_tables"] = {}
        return state

    def require(self, site: str, plate: str) -> None:
        """Declare that the positions of ``site``'s elements in ``plate`` will be asked for (registers every gather
        of the chain, so that one traced call fills all the tables).

        :raises StructureError: if ``site`` does not reach ``plate`` (or reads some plate in a way no per-element
        map describes)."""
        s = self.structure
        info = s.latent.get(site) or s.observed[site]
        if plate in info.plates:
            return
        reads = s.reads(site)
        if plate in reads:
            self.readers.add(site)
            self.sources.add(reads[plate])
            return
        for q, source in reads.items():
            if plate in s.reachable_plates(source):
                self.require(site, q)
                self.require(source, plate)
                source_info = s.latent[source]
                for r in source_info.plates:
                    if r not in info.plates:
                        self.require(site, r)
                return
        raise StructureError(f"site '{site}' reads no element of plate '{plate}', directly or through gathers")

    def call(self, args: tuple, kwargs: Mapping, calls: Mapping[str, PlateCall]) -> CallGathers:
        """The gathers of one call, given the plates it opened (``calls``)."""
        key = arguments_key(args, kwargs, calls)
        if not same_key(self._key, key):
            self._key, self._tables = key, {}
        return CallGathers(self, args, dict(kwargs), dict(calls))

    # ---- tables ----------------------------------------------------------------------------------------------
    def _layout(self, site: str, calls: Mapping[str, PlateCall]) -> tuple[list[int], dict[str, int]]:
        info = self.structure.latent.get(site) or self.structure.observed[site]
        dims = {p: self.structure.plates[p].dim for p in info.plates}
        nb = max((-d for d in dims.values()), default=0)
        shape = [1] * nb
        for p, d in dims.items():
            shape[nb + d] = calls[p].subsample_size
        return shape, dims

    def _element_keys(self, site: str, calls: Mapping[str, PlateCall]) -> torch.Tensor | None:
        """The full raveled index of each of ``site``'s elements in this call (its layout), or ``None`` when its
        table would be too large."""
        shape, dims = self._layout(site, calls)
        total = math.prod(self.structure.plates[p].size for p in dims)
        if total > self.max_table:
            return None
        key = None
        for p in sorted(dims, key=lambda p: dims[p]):  # outermost first
            view = [1] * len(shape)
            view[len(shape) + dims[p]] = -1
            idx = calls[p].indices.reshape(view)
            key = idx if key is None else key * self.structure.plates[p].size + idx
        return torch.zeros(shape, dtype=torch.long) if key is None else key.expand(shape)

    def _table(self, triple: tuple[str, str, str], device) -> torch.Tensor:
        table = self._tables.get(triple)
        if table is None:
            reader = triple[0]
            info = self.structure.latent.get(reader) or self.structure.observed[reader]
            total = math.prod(self.structure.plates[p].size for p in info.plates)
            table = self._tables[triple] = torch.full((total,), -2, dtype=torch.long, device=device)
        return table


class CallGathers:
    """The gathers of one call (from :meth:`GatherMaps.call`)."""

    def __init__(self, maps: GatherMaps, args: tuple, kwargs: dict, calls: dict[str, PlateCall]) -> None:
        self.maps, self.args, self.kwargs, self.calls = maps, args, kwargs, calls
        self._memo: dict[tuple[str, str], torch.Tensor] = {}
        self._traced: dict[tuple[str, str, str], torch.Tensor] | None = None

    def layout(self, site: str) -> list[int]:
        """``site``'s batch layout in this call: the plates' call sizes at their dims, 1 elsewhere."""
        return self.maps._layout(site, self.calls)[0]

    def prepare(self, levels) -> CallGathers:
        """Find now the positions every level's links need (a miss runs the model: do it before entering any
        plate of the call)."""
        for level in levels:
            for link in level.links:
                self.positions(link.site, link.plate)
        return self

    def read_ancestor(self, x: torch.Tensor, level: PlateLevel, ancestor: PlateLevel, event_dim: int) -> torch.Tensor:
        """``x``, laid out over the plates of the gathered ``ancestor`` of ``level``, read at each element of
        ``level`` (:func:`read_elements` along the level's :class:`~pyro_hier.structure.LevelLink` s)."""
        plates = dict(zip(ancestor.plates, ancestor.dims, strict=True))
        sites = {link.plate: link.site for link in level.links_to(ancestor.name)}
        first = level.sites[0]
        positions = {p: self.positions(sites.get(p, first), p) for p in plates}
        return read_elements(x, plates, self.calls, positions, self.layout(first), event_dim)

    def positions(self, site: str, plate: str) -> torch.Tensor:
        """``LongTensor`` in ``site``'s layout (:meth:`layout`, broadcastable): the position, among the elements of
        ``plate`` this call opened, of the element each element of ``site`` belongs to or reads; ``-1`` where it
        reads none."""
        memo = self._memo.get((site, plate))
        if memo is not None:
            return memo
        s = self.maps.structure
        info = s.latent.get(site) or s.observed[site]
        if plate in info.plates:
            shape, dims = self.maps._layout(site, self.calls)
            view = [1] * len(shape)
            view[len(shape) + dims[plate]] = -1
            out = torch.arange(self.calls[plate].subsample_size, device=self.calls[plate].indices.device).reshape(view)
        else:
            reads = s.reads(site)
            if plate in reads:
                out = self._direct((site, reads[plate], plate))
            else:
                source = next((src for src in reads.values() if plate in s.reachable_plates(src)), None)
                if source is None:
                    raise StructureError(f"site '{site}' reads no element of plate '{plate}'")
                out = self._through(site, source, plate)
        self._memo[(site, plate)] = out
        return out

    def _through(self, site: str, source: str, plate: str) -> torch.Tensor:
        """Positions in ``plate`` of the element of ``source`` that each element of ``site`` reads."""
        inner = self.positions(source, plate)
        shape, dims = self.maps._layout(source, self.calls)
        inner = inner.expand(shape).reshape(-1)
        flat, bad = None, None
        stride = 1
        for p in sorted(dims, key=lambda p: -dims[p]):  # innermost first: row-major strides of the layout
            pos = self.positions(site, p)
            term = pos.clamp(min=0) * stride
            flat = term if flat is None else flat + term
            bad = pos < 0 if bad is None else bad | (pos < 0)
            stride *= shape[len(shape) + dims[p]]
        if flat is None:  # a global source: nothing to select
            raise StructureError(f"site '{site}' reads the global site '{source}', which is in no plate")
        out = inner.to(flat.device)[flat]
        return torch.where(bad | (out < 0), torch.full_like(out, -1), out)

    def _direct(self, triple: tuple[str, str, str]) -> torch.Tensor:
        reader, _, plate = triple
        maps = self.maps
        keys = maps._element_keys(reader, self.calls)
        if keys is None:  # no table: trace this call
            return self._traced_positions(triple)
        table = maps._table(triple, keys.device)
        full = table[keys]
        if bool((full == -2).any()):
            self._trace()
            full = table[keys]
        positions = torch.full((self.maps.structure.plates[plate].size,), -1, dtype=torch.long, device=full.device)
        indices = self.calls[plate].indices.to(full.device)
        positions[indices] = torch.arange(indices.shape[0], device=full.device)
        return torch.where(full >= 0, positions[full.clamp(min=0)], torch.full_like(full, -1))

    def _traced_positions(self, triple: tuple[str, str, str]) -> torch.Tensor:
        self._trace()
        assert self._traced is not None
        found = self._traced.get(triple)
        if found is None:
            raise StructureError(f"site '{triple[0]}' did not read plate '{triple[2]}' of '{triple[1]}' in this call")
        return found

    def _trace(self) -> None:
        """Trace this call's gathers (once) and enter them in the tables."""
        if self._traced is not None:
            return
        maps = self.maps
        if maps.model is None:
            raise RuntimeError("the gathers' model is missing (an unpickled guide needs attach_model)")
        maps.runs += 1
        subsamples = {name: c.indices for name, c in self.calls.items()}
        found = trace_gathers(
            maps.model,
            self.args,
            self.kwargs,
            sources=sorted(maps.sources),
            readers=sorted(maps.readers),
            subsamples=subsamples,
            verify=False,
            check_latent_indices=False,
        )
        for reader, problem in found.problems.items():
            if reader in maps.readers:
                raise StructureError(problem)
        self._traced = {}
        for reader, gathers in found.gathers.items():
            if reader not in maps.readers:
                continue
            shape, _ = maps._layout(reader, self.calls)
            for g in gathers:
                triple = (reader, g.source, g.plate)
                index = _fit_layout(g.index, shape)
                self._traced[triple] = index
                keys = maps._element_keys(reader, self.calls)
                if keys is None:
                    continue
                full = g.full_index(self.calls[g.plate].indices if self.calls[g.plate].subsampled else None)
                full = _fit_layout(full, shape).expand(shape)
                maps._table(triple, keys.device)[keys.reshape(-1)] = full.reshape(-1).to(keys.device)


def _fit_layout(index: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """A gather index shaped like a site's batch in a trace, brought to the site's plate layout (leading singleton
    dims dropped or added)."""
    while index.dim() > len(shape) and index.shape[0] == 1:
        index = index[0]
    if index.dim() < len(shape):
        index = index.reshape((1,) * (len(shape) - index.dim()) + tuple(index.shape))
    return index


def read_elements(
    x: torch.Tensor,
    plates: Mapping[str, int],
    calls: Mapping[str, PlateCall],
    positions: Mapping[str, torch.Tensor],
    layout: list[int],
    event_dim: int,
) -> torch.Tensor:
    """``x`` — a value laid out over ``plates`` (``{plate: dim}``, at the sizes ``calls`` opened them), with any dims
    on its left (particles) and ``event_dim`` event dims — read at ``positions`` (``{plate: LongTensor}`` in a
    reader's ``layout``, from :meth:`CallGathers.positions`): ``(left…, layout…, event…)``.

    This is how a level conditions on a gathered ancestor: the counties' view of the states' values is the states'
    values read at each county's state."""
    nb_s = max((-d for d in plates.values()), default=0)
    source_layout = [1] * nb_s
    for p, d in plates.items():
        source_layout[nb_s + d] = calls[p].subsample_size
    nb_r = len(layout)
    n = max(nb_s, nb_r)
    batch_ndim = x.dim() - event_dim
    if batch_ndim < n:
        x = x.reshape((1,) * (n - batch_ndim) + tuple(x.shape))
        batch_ndim = n
    left = tuple(x.shape[: batch_ndim - n])
    between = x.shape[batch_ndim - n : batch_ndim - nb_s]
    if any(size != 1 for size in between):
        raise RuntimeError(f"internal error: a value over plates {dict(plates)} varies along other dims: {x.shape}")
    event = tuple(x.shape[batch_ndim:])
    x = x.reshape(left + tuple(x.shape[batch_ndim - nb_s : batch_ndim]) + event)
    x = x.expand(left + tuple(source_layout) + event).reshape((*left, -1, *event))
    flat = None
    stride = 1
    for p in sorted(plates, key=lambda p: -plates[p]):  # innermost first: row-major strides
        term = positions[p].clamp(min=0) * stride
        flat = term if flat is None else flat + term
        stride *= source_layout[nb_s + plates[p]]
    if flat is None:
        raise RuntimeError("internal error: read_elements needs a plated value")
    flat = flat.expand(layout).reshape(-1).to(x.device)
    out = x.index_select(len(left), flat)
    return out.reshape(left + (1,) * (n - nb_r) + tuple(layout) + event)


def full_call_gathers(maps: GatherMaps, args: tuple, kwargs: Mapping) -> CallGathers:
    """The gathers of the model's call on all its data (:func:`full_data_call`): full-size maps for summaries."""
    full_args, full_kwargs, forced = full_data_call(maps.model, args, kwargs)
    with keep_random_state():
        calls = capture_plates(maps.model, full_args, full_kwargs)
    for name, index in forced.items():
        call = calls[name]
        calls[name] = PlateCall(name, call.size, index, False)
    return maps.call(full_args, full_kwargs, calls)

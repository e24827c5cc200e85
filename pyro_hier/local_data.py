"""Each group's own data, as amortized guides need it: the observations a model makes inside a group's plate
(found in the model's run, zero configuration), or ragged per-observation features with a group index.

Two layouts reach the networks:

- **nested** (:func:`nested_features`): observed sites inside the group plate, e.g. ``y`` of shape ``(N, n)`` in
  plates ``groups × obs``. The features of one observation are the observed value (its event flattened) followed
  by optional covariates; they are laid out as ``(groups…, members, F)`` with a mask for observations the model
  masked out (so padded groups behave as ragged ones);
- **ragged** (:class:`GroupedData`): rows ``(M, F)`` with a group index ``(M,)``; only the rows of the requested
  groups are gathered (O(minibatch data), no padding);
- **gathered** (:func:`keyed_rows`): observed sites in a flat plate that gather group effects by an index
  (``a[..., county]``, :mod:`pyro_hier.gathers`): every element of the site is a row, keyed by the element of each
  plate it reads (found per call by :class:`pyro_hier.gather_maps.GatherMaps`), so a group's data are the rows whose
  index points at it — the ragged layout, found in the model instead of given.

Covariates of nested and gathered observations come from ``local_features(*args, **kwargs)`` (the covariates of the
observation's elements, rows for a flat plate), as the guides document; the model's own use of its arguments is not
guessed from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.messenger import Messenger

from pyro_hier.distributions import unwrap
from pyro_hier.errors import StructureError
from pyro_hier.gather_maps import arguments_key, full_data_call, same_key
from pyro_hier.gathers import keep_random_state
from pyro_hier.plates import PlateCall, PlateRecorder, ReplaySubsamples

__all__ = [
    "GroupedData",
    "KeyedRows",
    "Observation",
    "ObservedRows",
    "RowsOfCall",
    "call_local_features",
    "capture_observations",
    "data_complete",
    "is_factor",
    "keyed_rows",
    "nested_features",
    "observation_features",
]


@dataclass
class GroupedData:
    """Per-observation features of groups of any sizes (users with 3 or 3,000 ratings).

    :param features: ``(M, F)`` one row per observation (covariates and the observed value, in any order the
        user likes — the same order for new groups).
    :param group: ``(M,)`` the group (plate element) of each row, in ``0..num_groups-1``.
    :param num_groups: the plate's full size (default ``group.max() + 1``); groups without rows pool to zeros.

    Example::

        data = GroupedData(torch.stack([genre_score, rating], -1), user_index, num_groups=num_users)
        guide = AutoAmortizedBranchGuide(model, local_data={"users": data})
    """

    features: torch.Tensor
    group: torch.Tensor
    num_groups: int | None = None
    _order: torch.Tensor = field(init=False, repr=False)
    _counts: torch.Tensor = field(init=False, repr=False)
    _starts: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.features.dim() != 2:
            raise ValueError(f"GroupedData.features must be (M, F), got shape {tuple(self.features.shape)}")
        if self.group.dim() != 1 or self.group.shape[0] != self.features.shape[0]:
            raise ValueError(
                f"GroupedData.group must be (M,) with M = {self.features.shape[0]} rows, got {tuple(self.group.shape)}"
            )
        if self.group.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"GroupedData.group must hold integer indices, got {self.group.dtype}")
        if self.num_groups is None:
            self.num_groups = int(self.group.max()) + 1 if self.group.numel() else 0
        if self.group.numel() and (int(self.group.min()) < 0 or int(self.group.max()) >= self.num_groups):
            raise ValueError(
                f"GroupedData.group has indices in [{int(self.group.min())}, {int(self.group.max())}] but "
                f"num_groups={self.num_groups}: indices must lie in 0..num_groups-1"
            )
        group = self.group.long()
        self._order = torch.argsort(group, stable=True)
        self._counts = torch.bincount(group, minlength=self.num_groups)
        self._starts = torch.cumsum(self._counts, 0) - self._counts

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])

    def select(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of groups ``indices`` (B,): ``(features (M_b, F), segment (M_b,))`` where ``segment[r] = k`` when
        row ``r`` belongs to ``indices[k]``. Costs O(M_b)."""
        indices = indices.to(self._counts.device).long()
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.num_groups):
            raise StructureError(
                f"group index out of range: the plate asks for elements up to {int(indices.max())} but the "
                f"GroupedData has num_groups={self.num_groups}; build it with the plate's full size"
            )
        counts = self._counts[indices]
        segment = torch.repeat_interleave(torch.arange(indices.shape[0], device=counts.device), counts)
        first_row = torch.cumsum(counts, 0) - counts
        within = torch.arange(segment.shape[0], device=counts.device) - first_row[segment]
        position = self._starts[indices][segment] + within
        return self.features[self._order[position]], segment

    def to(self, *args, **kwargs) -> GroupedData:
        """A copy with ``features`` moved/cast like ``Tensor.to`` (indices only moved)."""
        features = self.features.to(*args, **kwargs)
        return GroupedData(features, self.group.to(features.device), self.num_groups)


@dataclass(frozen=True)
class Observation:
    """One observed site in one run of the model: its value, mask and plates (name → dim), and ``counts``: the
    numbers of trials of a binomial observation (``Binomial``/``BetaBinomial`` ``total_count``, broadcast to the
    value's shape; ``None`` for other likelihoods), without which its value says nothing of the rate."""

    name: str
    value: torch.Tensor
    mask: torch.Tensor | None
    event_dim: int
    plates: dict[str, int]
    counts: torch.Tensor | None = None


class _ObservationRecorder(Messenger):
    def __init__(self) -> None:
        super().__init__()
        self.observations: dict[str, Observation] = {}

    def _pyro_post_sample(self, msg) -> None:
        if not msg["is_observed"] or msg["infer"].get("_do_not_trace"):
            return
        mask = _as_mask(msg["mask"])
        fn = msg["fn"]
        while isinstance(fn, dist.Independent | dist.MaskedDistribution):  # masks given with fn.mask(...)
            if isinstance(fn, dist.MaskedDistribution):
                inner = _as_mask(fn._mask)
                mask = inner if mask is None else (mask if inner is None else mask & inner)
            fn = fn.base_dist
        plates = {f.name: f.dim for f in msg["cond_indep_stack"] if f.vectorized and f.dim is not None}
        value, counts = msg["value"].detach(), None
        if isinstance(fn, dist.Binomial | dist.BetaBinomial) and msg["fn"].event_dim == 0:
            counts = torch.as_tensor(fn.total_count, dtype=value.dtype, device=value.device).detach()
            counts = counts.expand(torch.broadcast_shapes(counts.shape, value.shape))
        self.observations[msg["name"]] = Observation(msg["name"], value, mask, msg["fn"].event_dim, plates, counts)


def _as_mask(mask) -> torch.Tensor | None:
    if mask is None or mask is True:
        return None
    if mask is False:
        return torch.zeros((), dtype=torch.bool)
    return mask.to(torch.bool)


def capture_observations(
    model: Callable, args: tuple = (), kwargs: dict | None = None, *, subsamples: Mapping | None = None
) -> tuple[dict[str, PlateCall], dict[str, Observation]]:
    """Run the whole model hidden from every outer handler (as :func:`pyro_hier.plates.capture_plates` does) and
    return its plates and its observed sites' values. Latent sites take whatever the model's handlers give them
    (a guide's model is wrapped in its init strategy, so no random draws are spent). ``subsamples`` gives plates
    that Pyro would subsample at random their indices (:func:`pyro_hier.gather_maps.full_data_call`)."""
    plates, observed = PlateRecorder(), _ObservationRecorder()
    with torch.no_grad(), poutine.block(), ReplaySubsamples(subsamples or {}), plates, observed:
        model(*args, **(kwargs or {}))
    calls = plates.calls
    for name in subsamples or {}:  # a forced plate is the model's own choice here
        if name in calls:
            calls[name] = PlateCall(name, calls[name].size, calls[name].indices, False)
    return calls, observed.observations


def is_factor(fn) -> bool:
    """``True`` for the distribution of a ``pyro.factor`` statement (a log-density term, not data)."""
    return isinstance(unwrap(fn), dist.Unit)


def observation_features(
    obs: Observation,
    calls: dict[str, PlateCall],
    covariates: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-element features of the observed site ``obs``, ``(batch…, F)``, and its mask ``(batch…)`` (``None`` when
    nothing is masked).

    ``batch`` is the site's batch shape in this call, with the dims of enclosing plates that the value broadcasts
    along expanded to the plates' sizes. ``F`` is the observed value's event, flattened, followed by
    ``covariates``: a tensor whose batch dims match the site's in this call, or have a subsampled plate at its full
    size (the model's indices are then selected). A binomial observation's features are its count of successes and
    its number of trials (``obs.counts``)."""
    value = obs.value.to(dtype) if dtype is not None else obs.value
    if not value.is_floating_point():
        value = value.to(torch.get_default_dtype())
    event_dim = obs.event_dim
    if obs.counts is not None:  # (successes and trials: one event of two features)
        counts = obs.counts.to(value.dtype)
        shape = torch.broadcast_shapes(counts.shape, value.shape)
        value, event_dim = torch.stack([value.expand(shape), counts.expand(shape)], -1), event_dim + 1
    batch = value.shape[: value.dim() - event_dim]
    need = max((-d for d in obs.plates.values()), default=0)
    if len(batch) < need:  # a value broadcast along outer plates: give it their dims
        value = value.reshape((1,) * (need - len(batch)) + value.shape)
        sizes = {dim: calls[name].subsample_size for name, dim in obs.plates.items() if name in calls}
        batch = torch.Size(sizes.get(i - need, s) if s == 1 else s for i, s in enumerate(value.shape[:need]))
        value = value.expand(batch + value.shape[need:])
    nb = len(batch)
    parts = [value.reshape((*batch, -1))]
    if covariates is not None:
        cov = covariates.to(value.dtype)
        if cov.dim() - 1 > nb:
            raise StructureError(
                f"local features for site '{obs.name}' have shape {tuple(cov.shape)}: expected the site's batch "
                f"shape {tuple(batch)} (plates {list(obs.plates)}) followed by one feature dim"
            )
        for name, dim in obs.plates.items():
            pos = cov.dim() - 1 + dim
            call = calls.get(name)
            if pos >= 0 and call is not None and call.subsampled and cov.shape[pos] == call.size != batch[dim]:
                cov = cov.index_select(pos, call.indices.to(cov.device))
        try:
            cov = cov.expand(batch + cov.shape[-1:])
        except RuntimeError:
            raise StructureError(
                f"local features for site '{obs.name}' have shape {tuple(covariates.shape)}, which does not match "
                f"the site's batch shape {tuple(batch)} in plates {list(obs.plates)} (this call), nor that shape "
                "with subsampled plates at full size"
            ) from None
        parts.append(cov)
    features = torch.cat(parts, dim=-1)
    mask = None if obs.mask is None else obs.mask.to(device=features.device, dtype=torch.bool).expand(batch)
    return features, mask


def nested_features(
    obs: Observation,
    group_plates: tuple[str, ...],
    calls: dict[str, PlateCall],
    covariates: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-observation features of ``obs`` (:func:`observation_features`) laid out as ``(group plates…, members,
    F)``, and the mask ``(group plates…, members)`` (``None`` when nothing is masked).

    The group plates come first in the order of their dims (outermost dim first); every other batch dim of the
    site is flattened into ``members``."""
    features, mask = observation_features(obs, calls, covariates, dtype)
    nb = features.dim() - 1
    group_dims = sorted(obs.plates[p] for p in group_plates)
    front = [nb + d for d in group_dims]
    rest = [i for i in range(nb) if i not in front]
    features = features.permute(*front, *rest, nb)
    lead = features.shape[: len(front)]
    features = features.reshape((*lead, -1, features.shape[-1]))
    if mask is not None:
        mask = mask.permute(*front, *rest).reshape((*lead, -1))
    return features, mask


def call_local_features(
    local_features: Callable | None, args: tuple, kwargs: dict, observed: list[str]
) -> dict[str, torch.Tensor]:
    """Covariates of the observed sites, ``{site: tensor}``, from a user's ``local_features(*args, **kwargs)``,
    which returns a tensor (when the model has one observed site) or ``{site: tensor}``."""
    if local_features is None:
        return {}
    value = local_features(*args, **kwargs)
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in observed]
        if unknown:
            raise StructureError(
                f"local_features returned covariates for {unknown}, which are not observed sites of "
                f"the model (observed: {observed})"
            )
        return dict(value)
    if len(observed) != 1:
        raise StructureError(
            f"local_features returned one tensor but the model has observed sites {observed}: return "
            "{site_name: tensor}"
        )
    return {observed[0]: value}


@dataclass(frozen=True)
class KeyedRows:
    """The elements of an observed site as rows, each keyed by the plate elements it belongs to or reads: the
    data of gathered groups (:func:`keyed_rows`).

    :ivar features: ``(M, F)`` each element's observed value (its event flattened) and covariates.
    :ivar weight: ``(M,)`` 1 for observed elements, 0 for those the model masks out (``None``: all observed).
    :ivar keys: ``{plate: (M,)}`` the full index, in that plate, of the element each row reads (``-1``: none).
    """

    features: torch.Tensor
    weight: torch.Tensor | None
    keys: dict[str, torch.Tensor]

    def select(self, calls: Mapping[str, PlateCall], plates: tuple[str, ...], dims: tuple[int, ...]) -> tuple:
        """The rows of the elements of ``plates`` that ``calls`` opened: ``(features (M_b, F), weight (M_b,) or
        None, segment (M_b,))``, ``segment`` the element's position in the plates' call layout raveled (outermost
        dim first; masked rows dropped)."""
        segment = None
        keep = torch.ones(self.features.shape[0], dtype=torch.bool, device=self.features.device)
        for p, _ in sorted(zip(plates, dims, strict=True), key=lambda pd: pd[1]):
            call = calls[p]
            key = self.keys.get(p)
            if key is None:
                raise StructureError(f"the rows do not read plate '{p}'")
            inverse = torch.full((call.size,), -1, dtype=torch.long, device=key.device)
            inverse[call.indices.to(key.device)] = torch.arange(call.subsample_size, device=key.device)
            position = torch.where(key >= 0, inverse[key.clamp(min=0)], -1)
            keep &= position >= 0
            segment = position if segment is None else segment * call.subsample_size + position
        if self.weight is not None:
            keep &= self.weight > 0
        rows = keep.nonzero().squeeze(-1)
        weight = None if self.weight is None else self.weight[rows]
        return self.features[rows], weight, segment[rows]


def keyed_rows(
    obs: Observation,
    calls: Mapping[str, PlateCall],
    positions: Mapping[str, torch.Tensor],
    covariates: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> KeyedRows:
    """The elements of ``obs`` in one call (:func:`observation_features`) as :class:`KeyedRows`, keyed by
    ``positions`` (``{plate: LongTensor}`` broadcastable to the site's batch: the position, among the elements the
    call opened, of the element each of its elements reads; :meth:`pyro_hier.gather_maps.CallGathers.positions`)."""
    features, mask = observation_features(obs, calls, covariates, dtype)
    batch = features.shape[:-1]
    keys = {}
    for p, pos in positions.items():
        nb = len(batch)
        pos = pos.reshape((1,) * max(0, nb - pos.dim()) + tuple(pos.shape))
        while pos.dim() > nb and pos.shape[0] == 1:
            pos = pos[0]
        pos = pos.to(features.device).expand(batch)
        full = calls[p].indices.to(features.device)[pos.clamp(min=0)]
        keys[p] = torch.where(pos >= 0, full, -1).reshape(-1)
    weight = None if mask is None else mask.reshape(-1).to(features.dtype)
    return KeyedRows(features.reshape(-1, features.shape[-1]), weight, keys)


def data_complete(
    structure, site: str, target: tuple[str, ...] | set[str], above: set[str], calls: Mapping[str, PlateCall]
) -> bool:
    """Whether the elements of a level (plates ``target``; ``above``: its plates and its ancestors') get all their
    data from the observed ``site`` in this call.

    Between the site and the level lie the plates the site reaches that are not above the level (its own flat plate
    of rows, counties between homes and states). When none of them is subsampled the call holds everything. When
    some are, the call still holds all the data of its elements of the level if the level's plates are subsampled and
    every subsampled plate in between is *below* them (reaches their elements: the rows follow the groups, as
    :func:`pyro_hier.plates.gathered_rows` makes them, the way to subsample gathered groups). Rows subsampled with
    every group present, groups of a level above a subsampled plate (the globals), or a crossed plate subsampled
    (questions, for the students) leave the call's data incomplete: they come from the model's call on all its
    data."""
    reached = structure.reachable_plates(site)
    own = set(structure.observed[site].plates)
    between = [p for p in set(reached) - set(above) if p in calls and calls[p].subsampled]
    if not between:
        return True
    follows = any(calls[p].subsampled for p in target if p in calls)
    return follows and all(set(target) <= (reached if p in own else structure.plate_reach(p)) for p in between)


@dataclass
class RowsOfCall:
    """An observed site's rows as one call sees them (:meth:`ObservedRows.rows`): ``rows`` keyed in the plates
    of ``calls``; ``gathers`` (a :class:`~pyro_hier.gather_maps.CallGathers`) for the maps of that call; ``full``
    when they come from the model's call on all its data."""

    rows: KeyedRows
    calls: Mapping[str, PlateCall]
    gathers: object
    full: bool


class ObservedRows:
    """Where gathered levels get their rows on every call: the call itself, the model's call on all its data, or,
    when the call omits the observations (``Predictive(model, guide)`` with ``obs=None``), the last call that had
    them.

    - The call's own rows serve when they hold all the data of the elements encoded (:func:`data_complete`).
    - Otherwise (rows subsampled with every group present; groups above a subsampled plate) the model runs once on
      all its data (:func:`pyro_hier.gather_maps.full_data_call`), cached while the arguments are the same objects.
    - The last rows are kept as plain tensors (they pickle with the guide): a call without observations encodes from
      them, and refuses the groups they did not cover.

    :param maps: the guide's :class:`~pyro_hier.gather_maps.GatherMaps` (its model runs the calls).
    :param keyed: ``{observed site: plates}``: the plates each site's rows are keyed by.
    """

    def __init__(self, maps, keyed: Mapping[str, tuple[str, ...]]) -> None:
        self.maps = maps
        self.keyed = {site: tuple(plates) for site, plates in keyed.items()}
        self.last: dict[str, tuple[KeyedRows, dict[str, torch.Tensor]]] = {}
        self._full_key: tuple | None = None
        self._full: dict | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_full_key"] = state["_full"] = None  # argument objects are not pickled
        return state

    def rows(
        self,
        site: str,
        args: tuple,
        kwargs: Mapping,
        calls: Mapping[str, PlateCall],
        observations: Mapping[str, Observation],
        gathers,
        covariates: Callable[[tuple, Mapping], Mapping[str, torch.Tensor]],
        dtype: torch.dtype,
        *,
        complete: bool,
        need: Mapping[str, torch.Tensor] | None = None,
    ) -> RowsOfCall:
        """The rows of ``site`` for this call. ``need`` (``{plate: full indices}``) names the elements a call without
        observations asks for (checked against what the last rows covered)."""
        if site not in observations:
            return self._cached(site, calls, gathers, need)
        if complete:
            positions = {p: gathers.positions(site, p) for p in self.keyed[site]}
            rows = keyed_rows(observations[site], calls, positions, covariates(args, kwargs).get(site), dtype)
            covered = {p: calls[p].indices for p in self.keyed[site]}
            self.last[site] = (rows, covered)
            return RowsOfCall(rows, calls, gathers, False)
        found = self._full_rows(args, kwargs, calls, covariates, dtype)
        if site not in found:
            raise StructureError(f"observed site '{site}' is not observed in the model's call on all its data")
        rows, full_calls, full_gathers = found[site], found["_calls"], found["_gathers"]
        self.last[site] = (rows, {p: full_calls[p].indices for p in self.keyed[site]})
        return RowsOfCall(rows, full_calls, full_gathers, True)

    def _cached(self, site, calls, gathers, need) -> RowsOfCall:
        if site not in self.last:
            raise StructureError(
                f"observed site '{site}' is not observed in this call (observations omitted, as in "
                "Predictive(model, guide=guide) with obs=None) and the guide has not been called with its data yet: "
                "call the guide (or train it) on the data first"
            )
        rows, covered = self.last[site]
        for p, wanted in (need or {}).items():
            have = covered.get(p)
            missing = wanted if have is None else wanted[~torch.isin(wanted, have.to(wanted.device))]
            if missing.numel():
                raise StructureError(
                    f"observed site '{site}' is not observed in this call (observations omitted), so the guide encodes "
                    f"from the data of the last call that had them; elements {missing[:10].tolist()} of plate '{p}' "
                    "were not in it. Call the guide once on the data of every element asked for (e.g. all of them, "
                    "without subsample) before predicting."
                )
        return RowsOfCall(rows, calls, gathers, False)

    def full_call(self, args: tuple, kwargs: Mapping, calls: Mapping[str, PlateCall]) -> dict:
        """The model's call on all its data (:func:`pyro_hier.gather_maps.full_data_call`), run once while the
        arguments are the same objects: ``{"args", "kwargs", "calls", "observations", "gathers"}``.

        :raises StructureError: if a plate stays subsampled in that call (its indices are not an argument)."""
        key = arguments_key(args, kwargs, calls)
        if self._full is not None and same_key(self._full_key, key):
            return self._full
        maps = self.maps
        full_args, full_kwargs, forced = full_data_call(maps.model, args, kwargs, calls)
        with keep_random_state():
            full_calls, observations = capture_observations(maps.model, full_args, full_kwargs, subsamples=forced)
        for name, call in full_calls.items():
            if call.subsampled:
                raise StructureError(
                    f"the guide needs all the data of the groups it encodes, but plate '{name}' stays subsampled in "
                    "the model's call on all its data. Subsample the groups and keep their rows with "
                    "pyro_hier.plates.gathered_rows instead."
                )
        gathers = maps.call(full_args, full_kwargs, full_calls)
        self._full_key = key
        self._full = {
            "args": full_args,
            "kwargs": full_kwargs,
            "calls": full_calls,
            "observations": observations,
            "gathers": gathers,
            "rows": {},
        }
        return self._full

    def _full_rows(self, args, kwargs, calls, covariates, dtype) -> dict:
        full = self.full_call(args, kwargs, calls)
        if full["rows"]:
            return full["rows"]
        gathers, observations = full["gathers"], full["observations"]
        cov = covariates(full["args"], full["kwargs"])
        found: dict = {"_calls": full["calls"], "_gathers": gathers}
        for site, plates in self.keyed.items():
            if site in observations:
                positions = {p: gathers.positions(site, p) for p in plates}
                found[site] = keyed_rows(observations[site], full["calls"], positions, cov.get(site), dtype)
        full["rows"] = found
        return found

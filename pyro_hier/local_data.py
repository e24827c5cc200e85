"""Each group's own data, as amortized guides need it: the observations a model makes inside a group's plate
(found in the model's run, zero configuration), or ragged per-observation features with a group index.

Two layouts reach the networks:

- **nested** (:func:`nested_features`): observed sites inside the group plate, e.g. ``y`` of shape ``(N, n)`` in
  plates ``groups × obs``. The features of one observation are the observed value (its event flattened) followed
  by optional covariates; they are laid out as ``(groups…, members, F)`` with a mask for observations the model
  masked out (so padded groups behave as ragged ones);
- **ragged** (:class:`GroupedData`): rows ``(M, F)`` with a group index ``(M,)``; only the rows of the requested
  groups are gathered (O(minibatch data), no padding).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.messenger import Messenger

from pyro_hier.errors import StructureError
from pyro_hier.plates import PlateCall, PlateRecorder

__all__ = [
    "GroupedData",
    "Observation",
    "call_local_features",
    "capture_observations",
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
    """One observed site in one run of the model: its value, mask and plates (name → dim)."""

    name: str
    value: torch.Tensor
    mask: torch.Tensor | None
    event_dim: int
    plates: dict[str, int]


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
        self.observations[msg["name"]] = Observation(
            msg["name"], msg["value"].detach(), mask, msg["fn"].event_dim, plates
        )


def _as_mask(mask) -> torch.Tensor | None:
    if mask is None or mask is True:
        return None
    if mask is False:
        return torch.zeros((), dtype=torch.bool)
    return mask.to(torch.bool)


def capture_observations(
    model: Callable, args: tuple = (), kwargs: dict | None = None
) -> tuple[dict[str, PlateCall], dict[str, Observation]]:
    """Run the whole model hidden from every outer handler (as :func:`pyro_hier.plates.capture_plates` does) and
    return its plates and its observed sites' values. Latent sites take whatever the model's handlers give them
    (a guide's model is wrapped in its init strategy, so no random draws are spent)."""
    plates, observed = PlateRecorder(), _ObservationRecorder()
    with torch.no_grad(), poutine.block(), plates, observed:
        model(*args, **(kwargs or {}))
    return plates.calls, observed.observations


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
    size (the model's indices are then selected)."""
    value = obs.value.to(dtype) if dtype is not None else obs.value
    if not value.is_floating_point():
        value = value.to(torch.get_default_dtype())
    batch = value.shape[: value.dim() - obs.event_dim]
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

"""K samples of every latent site, and the plated factor graph of the massively parallel importance estimator.

The model is described once, by :func:`pyro_hier.structure.inspect_model` on the call being estimated: its plates
(:class:`~pyro_hier.structure.PlateInfo`: dims, full and subsample sizes), latent and observed sites, and the gathers
of flat plates that read group effects by an index. This module adds what only the estimator needs: the samples, an
einsum symbol per plate and per index variable, and the packed log factors.

Layouts (``P = max_plate_nesting``):

- *particle layout*: the guide runs once inside an extra plate of size ``K`` at dim ``-(P + 1)``, so sample ``k`` of
  every guide site is drawn given sample ``k`` of the sites it depends on, and its log density is exactly the density
  it was drawn from ("diagonal" ancestry, one vectorised guide call);
- *model layout*: every *index variable* owns one dim to the left of the plates, the ``i``-th at ``-(P + 1 + i)``.
  An index variable is either a group of latent sites that share their ``K`` samples (an autoguide's auxiliary site
  and the model sites computed from it; a plain guide or prior site on its own) or a model site enumerated exactly
  (``infer={"enumerate": "parallel"}``). The model then runs once with each site's samples on its own dim, so its
  log factors broadcast to one axis per index variable they depend on, as in Pyro's ``TraceEnum_ELBO``.

Factors are *packed* like Pyro's (``tensor._pyro_dims`` names each axis) but keep every plate axis and every index
variable's own axis even when its size is 1 (``pyro.ops.packed.pack`` drops them), and log densities are never
multiplied by the subsampling scale ``N/B``: that is applied to the product over the plate in the contraction.

A factor may depend on the samples of an index variable drawn per element of a plate it is not in, when its site
*gathers* them (``a[..., county]`` in a plate of homes): the factor then stays in its own plate, and the contraction
sums it into the plate it reads (:mod:`pyro_hier.infer.gathered`).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import opt_einsum
import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.ops.provenance import ProvenanceTensor, detach_provenance, get_provenance
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample

from pyro_hier.errors import StructureError
from pyro_hier.gathers import keep_random_state
from pyro_hier.infer.gathered import GatheredPlates, SegmentSum, find_gathered_plates
from pyro_hier.plates import ReplaySubsamples
from pyro_hier.structure import LatentSite, ModelStructure, PlateInfo, inspect_model

__all__ = ["Factor", "FactorGraph", "IndexVariable", "SiteSamples", "TensorTooLargeError", "build_factor_graph"]

_PARTICLES = "_mp_importance_particles"


@dataclass
class IndexVariable:
    """One sample index per element of ``plates`` (plate names, outermost first): which of the ``size`` samples (or
    support points) is used. ``symbol`` names it in packed factors, ``dim`` is its dim in model layout."""

    symbol: str
    dim: int
    size: int
    plates: tuple[str, ...]
    sites: list[str] = field(default_factory=list)
    enumerated: bool = False


@dataclass
class SiteSamples:
    """The samples of one latent site (``latent``, as the structure describes it) in model layout, with the symbol
    of its index variable and its batch shape in a plain run of the call (plates at their subsample sizes)."""

    name: str
    index: str
    value: torch.Tensor
    latent: LatentSite
    plates: tuple[str, ...]  # outermost first
    batch_shape: torch.Size

    @property
    def event_dim(self) -> int:
        return self.latent.event_dim


@dataclass
class Factor:
    """A packed log factor (``tensor._pyro_dims``) and the plates it lives in (``ordinal``, plate symbols)."""

    name: str
    tensor: torch.Tensor
    ordinal: frozenset[str]


@dataclass
class FactorGraph:
    """Everything the contraction needs, plus the bookkeeping to read results back at the sites' shapes.

    ``plates`` are the structure's :class:`~pyro_hier.structure.PlateInfo` of the plates that hold sample sites (the
    chunked plate at its full size in a merged graph), ``symbols`` their einsum symbols; ``gathered`` is the tree of
    gathered plates and ``segments`` the steps that sum them into their parents, deepest first."""

    num_samples: int
    max_plate_nesting: int
    structure: ModelStructure
    plates: dict[str, PlateInfo]
    symbols: dict[str, str]
    indices: dict[str, IndexVariable]  # by symbol, in sampling order of appearance
    sites: dict[str, SiteSamples]  # model latent sites, in model order
    factors: list[Factor]
    dim_to_symbol: dict[int, str]
    gathered: GatheredPlates = field(default_factory=GatheredPlates)
    segments: tuple[SegmentSum, ...] = ()
    #: the guide's sites in particle layout: ``{name: (value (K, *plates, *event), plate names, random)}``
    guide_sites: dict[str, tuple[torch.Tensor, tuple[str, ...], bool]] = field(default_factory=dict)
    #: the dtype of the model's log densities (the factors may be contracted in another, see MPImportance)
    model_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.factors[0].tensor.dtype if self.factors else torch.get_default_dtype()

    @property
    def device(self) -> torch.device | None:
        return self.factors[0].tensor.device if self.factors else None

    @property
    def sum_dims(self) -> set[str]:
        return set(self.indices)

    # ---- plates -------------------------------------------------------------------------------------------------
    def size(self, plate: str) -> int:
        """The number of elements of ``plate`` present in the call (its subsample size)."""
        return self.plates[plate].subsample_size

    def dim(self, plate: str) -> int:
        dim = self.plates[plate].dim
        assert dim is not None
        return dim

    def scale(self, plate: str) -> float:
        """``N / B``: the power to which the product over the plate's present elements is raised."""
        info = self.plates[plate]
        return info.size / info.subsample_size

    def scale_of(self, plates: Iterable[str]) -> float:
        return math.prod(self.scale(p) for p in plates)

    @property
    def plate_scales(self) -> dict[str, float]:
        """``{plate symbol: N/B}``, the powers of the contraction."""
        return {self.symbols[p]: self.scale(p) for p in self.plates}

    def ordinal(self, plates: Iterable[str]) -> frozenset[str]:
        return frozenset(self.symbols[p] for p in plates)

    def sorted_plates(self, plates: Iterable[str]) -> tuple[str, ...]:
        """Plate names ordered by dim, outermost (most negative) first."""
        return tuple(sorted(set(plates), key=self.dim))

    def level(self, plates: Iterable[str]) -> int:
        """How deep elements of ``plates`` sit: one per plate, plus the plates each is gathered into."""
        return sum(1 + self.gathered.depth(p) for p in plates)

    def effective_scale(self, plates: Iterable[str], scales: dict[str, float]) -> float:
        """The power to which the contraction with plate powers ``scales`` (by symbol) raises a factor in ``plates``:
        the plates' own ``N/B``, with the power of the root of a gathered plate's chain in place of its ``N/B``
        (chunks raise the chunked plate to 1)."""
        total = 1.0
        for p in plates:
            root = self.gathered.root(p)
            total *= self.scale(p) * scales.get(self.symbols[root], 1.0) / self.scale(root)
        return total

    def natural_shape(self, plates: Iterable[str]) -> torch.Size:
        """Batch shape of a tensor living in ``plates`` in a plain model run (ones between plate dims)."""
        plates = tuple(plates)
        if not plates:
            return torch.Size()
        length = max(-self.dim(p) for p in plates)
        shape = [1] * length
        for p in plates:
            shape[length + self.dim(p)] = self.size(p)
        return torch.Size(shape)

    # ---- packing ------------------------------------------------------------------------------------------------
    def _layout(self, tensor: torch.Tensor, plates: tuple[str, ...], own: set[int], what: str):
        """Which axes of a model-layout tensor to drop and which to keep, with their symbols; and, for each index
        variable it depends on whose plates are not all among ``plates``, those plates."""
        P = self.max_plate_nesting
        by_dim = {self.dim(p): p for p in plates}
        need = max([-d for d in own] + [-self.dim(p) for p in plates] + [0])
        if tensor.dim() < need:
            tensor = tensor.reshape((1,) * (need - tensor.dim()) + tuple(tensor.shape))
        n = tensor.dim()
        drop, symbols, sizes, foreign = [], [], [], {}
        for i, size in enumerate(tensor.shape):
            pos = i - n
            if pos >= -P:
                plate = by_dim.get(pos)
                if plate is None:
                    if size != 1:
                        raise StructureError(
                            f"{what}: batch dim {pos} has size {size} but is not one of its plates; declare it with "
                            "pyro.plate (and set max_plate_nesting) or move it to the event shape with .to_event()"
                        )
                    drop.append(i)
                    continue
                if size not in (1, self.size(plate)):
                    raise StructureError(
                        f"{what}: dim {pos} of plate {plate!r} has size {size}, expected {self.size(plate)}"
                    )
                symbols.append(self.symbols[plate])
                sizes.append(self.size(plate))
            else:
                symbol = self.dim_to_symbol.get(pos)
                if symbol is None:
                    if size != 1:
                        raise StructureError(
                            f"{what}: batch dim {pos} of size {size} is left of all plates (max_plate_nesting="
                            f"{P}) and is no sample dim; increase max_plate_nesting or declare it with pyro.plate"
                        )
                    drop.append(i)
                elif size > 1 or pos in own:
                    index = self.indices[symbol]
                    outside = tuple(q for q in index.plates if q not in plates)
                    if outside:
                        foreign[symbol] = outside
                    symbols.append(symbol)
                    sizes.append(index.size)
                else:
                    drop.append(i)
        return tensor, drop, symbols, sizes, foreign

    def foreign(self, tensor: torch.Tensor, plates: Iterable[str], own: Iterable[int] = (), *, what: str = "") -> dict:
        """``{index symbol: plates}``: the index variables ``tensor`` depends on that are drawn per element of plates
        it is not in (through a gather), with those plates."""
        return self._layout(tensor, tuple(plates), set(own), what)[4]

    def pack(
        self,
        tensor: torch.Tensor,
        plates: Iterable[str],
        own: Iterable[int] = (),
        *,
        what: str = "",
        reader: str | None = None,
    ) -> torch.Tensor:
        """Pack a model-layout batch tensor (no event dims) into a factor tensor with ``_pyro_dims``.

        Plate axes of ``plates`` are always kept (expanded to the plate size if broadcast); index-variable axes are
        kept when larger than 1 or listed in ``own``; every other axis must have size 1. An index variable drawn per
        element of other plates is accepted when the site ``reader`` gathers it from plates its own are summed into.
        """
        plates = tuple(plates)
        tensor, drop, symbols, sizes, foreign = self._layout(tensor, plates, set(own), what)
        for symbol, outside in foreign.items():
            self._check_gathered(symbol, outside, plates, what, reader)
        if drop:
            tensor = tensor.squeeze(tuple(drop))
        if tuple(tensor.shape) != tuple(sizes):
            tensor = tensor.expand(sizes)
        tensor._pyro_dims = "".join(symbols)
        return tensor

    def _check_gathered(
        self, symbol: str, outside: tuple[str, ...], plates: tuple[str, ...], what: str, reader: str | None
    ) -> None:
        index = self.indices[symbol]
        read = set()
        if reader is not None and self.gathered:
            read = {(g.source, g.plate) for g in self.structure.gathers_of(reader)}
        missing = [q for q in outside if not any((s, q) in read for s in index.sites)]
        if missing or not self.gathered.reaches(plates, outside):
            raise StructureError(
                f"{what} (plates {list(plates)}) depends on the samples of {index.sites} drawn per element of "
                f"plate(s) {list(outside)}, which it is not in, and no per-element read of them was found. "
                "MPImportance sums a flat plate into the plate it gathers from when each of its elements reads one "
                "element of it (a[..., group] for a continuous latent a); nest the site in that plate, or estimate "
                "with a guide-based method"
            )

    def zeros(self, index_symbols: Iterable[str], plates: Iterable[str], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor packed over ``index_symbols`` then ``plates`` (a source term)."""
        index_symbols = tuple(index_symbols)
        plates = tuple(plates)
        shape = [self.indices[s].size for s in index_symbols] + [self.size(p) for p in plates]
        tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        tensor._pyro_dims = "".join(index_symbols) + "".join(self.symbols[p] for p in plates)
        return tensor

    def to_natural(self, site: SiteSamples, tensor: torch.Tensor) -> torch.Tensor:
        """A model-layout value ``(size, ..., *plates, *event)`` as ``(size, *site.batch_shape, *event)``."""
        size = tensor.shape[0]
        tail = tensor.shape[tensor.dim() - self.max_plate_nesting - site.event_dim :]
        tensor = tensor.reshape((size, *tail))
        keep = len(site.batch_shape) + site.event_dim
        return tensor.reshape((size, *tensor.shape[tensor.dim() - keep :]))


class TensorTooLargeError(ValueError):
    """A tensor of the MP importance computation would exceed the memory limit."""


# ------------------------------------------------------------------------------------------------------ messengers
def _is_point_mass(fn) -> bool:
    while True:
        if isinstance(fn, dist.Delta):
            return True
        base = getattr(fn, "base_dist", None)
        if base is None:
            return False
        fn = base


class _ProvenanceTracker(Messenger):
    """Marks each random guide value with its site's name, so deterministic (``Delta``) sites reveal their sources."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[str, frozenset[str]] = {}

    def _pyro_post_sample(self, msg) -> None:
        if msg["is_observed"] or isinstance(msg["fn"], _Subsample) or msg["value"] is None:
            return
        name = msg["name"]
        if _is_point_mass(msg["fn"]):
            self.sources[name] = frozenset(s for s in get_provenance(msg["value"]) if isinstance(s, str))
        else:
            self.sources[name] = frozenset([name])
            msg["value"] = ProvenanceTensor(detach_provenance(msg["value"]), frozenset([name]))


class _Fixed(Messenger):
    """Gives the listed sites these values instead of sampling them (the global samples shared by all chunks)."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.values = values

    def _pyro_sample(self, msg) -> None:
        if msg["name"] in self.values and not msg["is_observed"]:
            msg["value"] = self.values[msg["name"]]
            msg["done"] = True


class _ModelRun(Messenger):
    """Runs the model with each latent site's samples on its index variable's dim.

    Sites found in ``values`` take those samples; sites marked ``infer={"enumerate": ...}`` get their support on a
    fresh dim; with ``from_prior`` every other latent site draws ``K`` samples from its prior conditional, sample
    ``k`` given sample ``k`` of each parent (its proposal density is then the diagonal of its log factor), unless
    ``fixed`` holds its samples already.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        first_dim: int,
        values: dict[str, tuple[torch.Tensor, int]],
        subsamples: dict[str, torch.Tensor],
        from_prior: bool,
        max_plate_nesting: int,
        fixed: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.K = num_samples
        self.next_dim = first_dim
        self.values = values
        self.subsamples = subsamples
        self.from_prior = from_prior
        self.P = max_plate_nesting
        self.fixed = fixed or {}
        self.enum_dims: dict[int, str] = {}
        self.records: dict[str, dict] = {}

    def _allocate(self) -> int:
        dim = self.next_dim
        self.next_dim -= 1
        return dim

    def _pyro_sample(self, msg) -> None:
        name, fn = msg["name"], msg["fn"]
        if isinstance(fn, _Subsample):
            if name in self.subsamples:
                proposed = self.subsamples[name]
                given = msg["value"]
                if given is not None and not torch.equal(torch.as_tensor(given).to(proposed.device), proposed):
                    raise StructureError(
                        f"plate {name!r}: the guide used subsample indices {proposed.tolist()[:8]}... but the model "
                        f"asked for {torch.as_tensor(given).tolist()[:8]}...; give the guide the model's plates "
                        f"(e.g. AutoNormal(model, create_plates=...)) or use a pyro_hier guide, which reads them"
                    )
                msg["value"] = proposed
                msg["done"] = True
            return
        if msg["is_observed"]:
            return
        if name in self.values:
            value, dim = self.values[name]
            msg["value"] = value
            msg["done"] = True
            self.records[name] = {"kind": "guide", "dim": dim}
            return
        strategy = msg["infer"].get("enumerate")
        if strategy in ("parallel", "sequential") and msg["infer"].get("num_samples") is None:
            self._enumerate(msg)
        elif self.from_prior:
            self._sample_prior(msg)
        else:
            raise StructureError(
                f"latent site {name!r} of the model is not sampled by the guide and not marked for enumeration; "
                f"add it to the guide, or mark a discrete site with infer={{'enumerate': 'parallel'}}"
            )

    def _check_batch(self, msg, dim: int) -> torch.Size:
        batch_shape = msg["fn"].batch_shape
        if len(batch_shape) >= -dim:
            raise StructureError(
                f"site {msg['name']!r}: batch shape {tuple(batch_shape)} reaches dim {dim} reserved for samples; "
                f"increase max_plate_nesting (now {self.P}) only if plates really go that deep, or use .to_event()"
            )
        return batch_shape

    def _enumerate(self, msg) -> None:
        fn, name = msg["fn"], msg["name"]
        if not getattr(fn, "has_enumerate_support", False):
            raise StructureError(
                f"site {name!r} is marked for enumeration but {type(fn).__name__} has no finite support; remove "
                "its infer={'enumerate': ...} flag so that it is sampled"
            )
        dim = self._allocate()
        self._check_batch(msg, dim)
        support = fn.enumerate_support(expand=False)
        event_shape = tuple(support.shape[support.dim() - fn.event_dim :]) if fn.event_dim else ()
        size = support.shape[0]
        msg["value"] = support.reshape((size,) + (1,) * (-dim - 1) + event_shape)
        msg["done"] = True
        self.enum_dims[dim] = name
        self.records[name] = {"kind": "enumerated", "dim": dim, "size": size}

    def _sample_prior(self, msg) -> None:
        fn, name, K = msg["fn"], msg["name"], self.K
        dim = self._allocate()
        batch_shape = self._check_batch(msg, dim)
        nb = len(batch_shape)
        parents = []
        for i, size in enumerate(batch_shape):
            pos = i - nb
            if pos < -self.P and size > 1:
                if pos in self.enum_dims:
                    raise StructureError(
                        f"site {name!r} depends on the enumerated site {self.enum_dims[pos]!r}, so its prior cannot "
                        "serve as its proposal; pass a guide that samples it, or sample (do not enumerate) "
                        f"{self.enum_dims[pos]!r}"
                    )
                parents.append(pos)
        event_dim = fn.event_dim
        if name in self.fixed:
            value = self.fixed[name]
        elif not parents:
            value = fn.sample((K,))
            value = value.reshape((K,) + (1,) * (-dim - 1 - nb) + tuple(value.shape[1:]))
        else:
            fat = fn.sample()
            fat = fat.reshape((1,) * (-dim - nb) + tuple(fat.shape))
            value = take_diagonal(fat, dim - event_dim, [p - event_dim for p in parents])
        msg["value"] = value
        msg["done"] = True
        self.records[name] = {"kind": "prior", "dim": dim, "parents": parents}


def take_diagonal(tensor: torch.Tensor, own: int, parents: list[int]) -> torch.Tensor:
    """Entries with equal indices along ``own`` (size 1 or K) and every dim in ``parents`` (size K), placed on
    ``own``; the ``parents`` dims become size 1. Dims are negative tensor dims."""
    if not parents:
        return tensor
    n = tensor.dim()
    K = tensor.shape[parents[0]]
    src = [n + own] + [n + p for p in parents]
    moved = tensor.movedim(src, list(range(len(src))))
    moved = moved.expand((K,) * len(src) + tuple(moved.shape[len(src) :]))
    arange = torch.arange(K, device=tensor.device)
    diag = moved[(arange,) * len(src)]
    diag = diag.reshape((K,) + (1,) * len(parents) + tuple(diag.shape[1:]))
    return diag.movedim(list(range(len(src))), src)


# ------------------------------------------------------------------------------------------------------ building
def _vectorized_frames(site) -> tuple:
    return tuple(f for f in site["cond_indep_stack"] if f.vectorized and f.name != _PARTICLES)


def _plates_of(site, structure: ModelStructure, P: int, what: str) -> tuple[str, ...]:
    """The names of a traced site's plates, outermost first, checked against the structure's plates."""
    names = []
    for f in _vectorized_frames(site):
        info = structure.plates.get(f.name)
        full = f.full_size if f.full_size is not None else f.size
        if info is None or info.dim is None:
            raise StructureError(
                f"{what}: plate {f.name!r} is not a plate of the model's sample sites; the guide must open the "
                "model's plates"
            )
        if -f.dim > P:
            raise StructureError(
                f"{what}: plate {f.name!r} uses dim {f.dim} but max_plate_nesting={P}; pass "
                f"max_plate_nesting={-f.dim} or more"
            )
        if (info.dim, info.subsample_size, info.size) != (f.dim, f.size, full):
            raise StructureError(
                f"{what}: plate {f.name!r} has dim {f.dim}, size {f.size} of {full} here but dim {info.dim}, size "
                f"{info.subsample_size} of {info.size} in the model; the model and guide must open it alike"
            )
        names.append(f.name)
    return tuple(sorted(names, key=lambda n: structure.plates[n].dim))


class _Symbols:
    """Einsum symbols, allocated in order."""

    def __init__(self) -> None:
        self._count = 0

    def __call__(self) -> str:
        s = opt_einsum.get_symbol(self._count)
        self._count += 1
        return s


def _site_log_prob(site) -> torch.Tensor:
    fn, value = site["fn"], site["value"]
    log_prob = detach_provenance(fn.log_prob(value))
    return scale_and_mask(log_prob, 1.0, site["mask"])


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def add(self, x: str) -> None:
        self.parent.setdefault(x, x)

    def find(self, x: str) -> str:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def _run_guide(guide: Callable, args: tuple, kwargs: dict, K: int, P: int, fixed: dict[str, torch.Tensor]) -> dict:
    """One vectorised guide call with K particles; returns the groups of sites sharing a sample index."""
    tracker = _ProvenanceTracker()
    particles = pyro.plate(_PARTICLES, K, dim=-P - 1)
    trace = poutine.trace(tracker(_Fixed(fixed)(particles(guide)))).get_trace(*args, **kwargs)
    subsamples: dict[str, torch.Tensor] = {}
    sites: OrderedDict[str, dict] = OrderedDict()
    uf = _UnionFind()
    for name, site in trace.nodes.items():
        if site["type"] != "sample":
            continue
        if isinstance(site["fn"], _Subsample):
            subsamples[name] = detach_provenance(site["value"])
            continue
        if site["is_observed"]:
            continue
        what = f"guide site {name!r}"
        value = detach_provenance(site["value"])
        fn = site["fn"]
        event_dim = fn.event_dim
        batch = value.shape[: value.dim() - event_dim]
        if len(batch) > P + 1 or (len(batch) == P + 1 and batch[0] not in (1, K)):
            raise StructureError(
                f"{what}: batch shape {tuple(batch)} does not fit max_plate_nesting={P} (its dim {-P - 1} holds "
                "the K samples); pass a larger max_plate_nesting"
            )
        point_mass = _is_point_mass(fn)
        sources = tracker.sources.get(name, frozenset())
        if point_mass and not sources:
            raise StructureError(
                f"{what} is a point mass that depends on no random guide site (e.g. AutoDelta); importance sampling "
                "needs a proposal with a density: use AutoNormal, AutoBranchGuide, or the prior (guide=None)"
            )
        for s in sources:
            uf.add(s)
        if not point_mass:
            uf.add(name)
        src = sorted(sources)
        for s in src[1:]:
            uf.union(src[0], s)
        sites[name] = {
            "value": value,
            "event_dim": event_dim,
            "log_q": _site_log_prob(site),
            "random": not point_mass,
            "sources": sources,
            "node": site,
        }
    groups: OrderedDict[str, dict] = OrderedDict()
    for name, info in sites.items():
        root = uf.find(next(iter(sorted(info["sources"]))))
        group = groups.setdefault(root, {"members": [], "random": []})
        group["members"].append(name)
        info["group"] = root
        if info["random"]:
            group["random"].append(name)
    return {"sites": sites, "groups": groups, "subsamples": subsamples}


def _subsamples(structure: ModelStructure) -> dict[str, torch.Tensor]:
    """The indices every plate used in the structure's call."""
    return {
        name: node["value"]
        for name, node in structure.trace.nodes.items()
        if node["type"] == "sample" and isinstance(node["fn"], _Subsample)
    }


def describe_call(
    model: Callable, args: tuple, kwargs: dict, subsamples: dict[str, torch.Tensor] | None = None
) -> ModelStructure:
    """:func:`~pyro_hier.structure.inspect_model` of the call ``model(*args, **kwargs)``, with the plates in
    ``subsamples`` opened with those indices (those the proposal drew) unless the model gives its own. The caller's
    random state is left as it was (the samples do not depend on the inspection)."""
    if subsamples:

        def described(*a, **k):
            with ReplaySubsamples(subsamples):
                return model(*a, **k)

    else:
        described = model
    with keep_random_state():
        return inspect_model(described, args, kwargs, num_calls=1)


def build_factor_graph(
    model: Callable,
    guide: Callable | None,
    args: tuple,
    kwargs: dict,
    *,
    num_samples: int,
    max_plate_nesting: int | None = None,
    fixed: dict[str, torch.Tensor] | None = None,
    structure: ModelStructure | None = None,
) -> FactorGraph:
    """Draw the samples, run the model on them and collect the packed log factors (under ``torch.no_grad``).

    The model's plates, sites and gathers come from ``structure`` (:func:`describe_call` of the same call when not
    given; redone with the guide's subsample indices when the guide drew others). ``max_plate_nesting`` defaults to
    the structure's. ``fixed`` gives some sites their samples instead of drawing them: random guide sites in
    particle layout (with a guide), or the model's latent sites in model layout (prior proposal)."""
    K = num_samples
    values: dict[str, tuple[torch.Tensor, int]] = {}
    guide_info = None
    with torch.no_grad():
        if structure is None:
            structure = describe_call(model, args, kwargs)
        P = structure.max_plate_nesting if max_plate_nesting is None else max_plate_nesting
        if guide is not None:
            guide_info = _run_guide(guide, args, kwargs, K, P, fixed or {})
            drawn = _subsamples(structure)
            if any(n not in drawn or not torch.equal(drawn[n], v) for n, v in guide_info["subsamples"].items()):
                structure = describe_call(model, args, kwargs, guide_info["subsamples"])
            for g, root in enumerate(guide_info["groups"]):
                dim = -(P + 1 + g)
                for name in guide_info["groups"][root]["members"]:
                    v = guide_info["sites"][name]["value"]
                    v = v.reshape((v.shape[0],) + (1,) * g + tuple(v.shape[1:]))
                    values[name] = (v, dim)
            first_dim = -(P + 1 + len(guide_info["groups"]))
        else:
            first_dim = -(P + 1)
        subsamples = _subsamples(structure)
        if guide_info is not None:
            subsamples.update(guide_info["subsamples"])
        run = _ModelRun(
            num_samples=K,
            first_dim=first_dim,
            values=values,
            subsamples=subsamples,
            from_prior=guide is None,
            max_plate_nesting=P,
            fixed=fixed if guide is None else None,
        )
        try:
            mtrace = poutine.trace(run(model)).get_trace(*args, **kwargs)
        except RuntimeError as e:
            if "memory" in str(e).lower():
                raise TensorTooLargeError(
                    f"the model ran out of memory with num_samples={K} samples per site ({e}); use a smaller "
                    "num_samples or subsample the largest plate"
                ) from e
            raise _vectorisation_error(e, K) from e
        except (ValueError, IndexError) as e:
            raise _vectorisation_error(e, K) from e
        return _collect(structure, mtrace, run, guide_info, K, P)


def _vectorisation_error(e: Exception, K: int) -> Exception:
    """The model's error on its vectorised run, with what that run does to it (the usual cause of a shape error in a
    model that runs alone), or, for an error between dtypes, that the guide's samples carry its parameters' dtype: an
    exception of the same type."""
    if re.search(r"scalar type|dtype|found (Double|Float|Half|BFloat16)", str(e)):
        return type(e)(
            f"{e}\n(MPImportance runs the model on the guide's samples, which carry the dtype of the guide's "
            "parameters: the model's data are in another dtype. Pass the data in the guide's dtype (x.float()), or "
            "convert the guide to the data's (guide.to(torch.float64)) before MPImportance(...).run.)"
        )
    return type(e)(
        f"{e}\n(MPImportance runs the model once with its {K} samples of every latent in batch dims to the left of "
        "the model's plates, as Pyro's vectorised particles do: a model that fails only then indexes or multiplies "
        "its latents from the left. Gather group effects with a[..., idx] instead of a[idx], and write X @ beta as "
        "(X * beta).sum(-1); the model must also run under Trace_ELBO(vectorize_particles=True).)"
    )


def _collect(structure: ModelStructure, mtrace, run: _ModelRun, guide_info: dict | None, K: int, P: int) -> FactorGraph:
    symbol = _Symbols()
    plates = {name: info for name, info in structure.plates.items() if info.dim is not None}
    graph = FactorGraph(
        num_samples=K,
        max_plate_nesting=P,
        structure=structure,
        plates=plates,
        symbols={name: symbol() for name in plates},
        indices=OrderedDict(),
        sites=OrderedDict(),
        factors=[],
        dim_to_symbol={},
    )
    indices, dim_to_symbol = graph.indices, graph.dim_to_symbol
    group_symbol: dict[str, str] = {}
    if guide_info is not None:
        for name, info in guide_info["sites"].items():
            info["plates"] = _plates_of(info.pop("node"), structure, P, f"guide site {name!r}")
        for g, (root, group) in enumerate(guide_info["groups"].items()):
            s = symbol()
            dim = -(P + 1 + g)
            members = {p for name in group["random"] for p in guide_info["sites"][name]["plates"]}
            indices[s] = IndexVariable(s, dim, K, graph.sorted_plates(members))
            dim_to_symbol[dim] = s
            group_symbol[root] = s
    model_sites = [
        (name, site)
        for name, site in mtrace.nodes.items()
        if site["type"] == "sample" and not isinstance(site["fn"], _Subsample)
    ]
    site_plates = {name: _plates_of(site, structure, P, f"model site {name!r}") for name, site in model_sites}
    # index variables of the model's own samples (prior proposal) and enumerated sites, in model order
    for name, _ in model_sites:
        record = run.records.get(name)
        if record is None or record["kind"] == "guide":
            continue
        s = symbol()
        indices[s] = IndexVariable(
            s, record["dim"], record.get("size", K), site_plates[name], enumerated=record["kind"] == "enumerated"
        )
        dim_to_symbol[record["dim"]] = s
        record["symbol"] = s
    if len(indices) + P > 60:
        raise StructureError(
            f"{len(indices)} sample dims plus {P} plate dims exceed what torch tensors support; vectorise sites "
            "into plates"
        )
    pending: list[tuple[str, torch.Tensor, tuple[str, ...], tuple[int, ...], str, str | None]] = []
    constants: list[Factor] = []
    used_groups = set()
    for name, site in model_sites:
        what = f"model site {name!r}"
        plates_ = site_plates[name]
        if site["is_observed"]:
            if site["infer"].get("_deterministic"):
                continue
            if name not in structure.observed:
                raise StructureError(f"{what} is observed in this run but not in the model's structure")
            log_p = _apply_user_scale(_site_log_prob(site), site, graph.scale_of(plates_))
            pending.append((name, log_p, plates_, (), what, name))
            continue
        latent = structure.latent.get(name)
        if latent is None:
            raise StructureError(f"{what} is latent in this run but not in the model's structure")
        record = run.records[name]
        if record["kind"] == "guide":
            root = guide_info["sites"][name]["group"]
            s = group_symbol[root]
            used_groups.add(root)
        else:
            s = record["symbol"]
        index = indices[s]
        index.sites.append(name)
        own = (index.dim,)
        full = _site_log_prob(site)
        pending.append((name, _apply_user_scale(full, site, graph.scale_of(plates_)), plates_, own, what, name))
        if record["kind"] == "prior":  # proposal density: the diagonal, sample k given sample k of each parent
            n = max(full.dim(), -index.dim)
            full = full.reshape((1,) * (n - full.dim()) + tuple(full.shape))
            log_q = take_diagonal(full, index.dim, record["parents"])
            pending.append((f"{name} (proposal)", -log_q - math.log(K), plates_, own, what, None))
        graph.sites[name] = SiteSamples(name, s, site["value"], latent, plates_, graph.natural_shape(plates_))
    if guide_info is not None:
        for name, info in guide_info["sites"].items():
            graph.guide_sites[name] = (info["value"], info["plates"], info["random"])
        for g, (root, group) in enumerate(guide_info["groups"].items()):
            index = indices[group_symbol[root]]
            if root not in used_groups:
                raise StructureError(
                    f"guide site(s) {group['members']} determine no latent site of the model (auxiliary variables "
                    "whose density is not the proposal's); MPImportance needs a guide whose sites are the model's "
                    "latent sites, possibly through auxiliary sites as in AutoNormal"
                )
            # one factor per guide site, in its own plates (a global auxiliary site must not be repeated over the
            # plates of the sites computed from it); -log K once per element of the index variable's plates
            log_k_done = False
            for member in group["members"]:
                info = guide_info["sites"][member]
                log_q = info["log_q"]
                log_q = log_q.reshape((1,) * (P + 1 - log_q.dim()) + tuple(log_q.shape))
                log_q = log_q.reshape((log_q.shape[0],) + (1,) * g + tuple(log_q.shape[1:]))  # K onto the group dim
                proposal = -log_q
                if not log_k_done and set(info["plates"]) == set(index.plates):
                    proposal, log_k_done = proposal - math.log(K), True
                elif not bool(proposal.any()):
                    continue  # e.g. the zero log-Jacobian of an AutoNormal site with real support
                pending.append(
                    (f"{member} (proposal)", proposal, info["plates"], (index.dim,), f"guide site {member!r}", None)
                )
            if not log_k_done:
                shape = [index.size] + [graph.size(p) for p in index.plates]
                constant = torch.full(shape, -math.log(K), dtype=log_q.dtype, device=log_q.device)
                constant._pyro_dims = index.symbol + "".join(graph.symbols[p] for p in index.plates)
                constants.append(Factor(f"{index.symbol} (1/K)", constant, graph.ordinal(index.plates)))
    readers: dict[str, tuple[str, ...]] = {}
    for _, tensor, plates_, own, what, reader in pending:
        try:
            foreign = graph.foreign(tensor, plates_, own, what=what) if reader is not None else {}
        except StructureError as e:
            _explain_layout_error(structure, reader, plates_, e)
            raise
        if foreign:
            readers[reader] = tuple(dict.fromkeys(readers.get(reader, ()) + sum(foreign.values(), ())))
    if readers:
        graph.gathered = find_gathered_plates(structure, readers, {p: graph.size(p) for p in plates})
        graph.segments = _segments(graph)
    for name, tensor, plates_, own, what, reader in pending:
        packed = graph.pack(tensor, plates_, own, what=what, reader=reader)
        graph.factors.append(Factor(name, packed, graph.ordinal(plates_)))
    graph.factors.extend(constants)
    return graph


def _explain_layout_error(structure: ModelStructure, name: str, plates: tuple[str, ...], error: StructureError) -> None:
    """When a site's log density has dims that fit no plate or sample index, the cause is often a read of another
    plate that no per-element map describes (``a.sum(-1)`` outside the plate, ``locs[..., k]`` with a latent
    ``k``): raise the structure's explanation of that instead, if it has one."""
    try:
        structure.gathers_of(name)
    except StructureError as problem:
        try:
            parents = structure.parents.get(name, ())
        except StructureError:
            parents = ()
        other = sorted({p for a in parents for p in structure.latent[a].plates if p not in plates})
        where = f" depends on samples drawn per element of plate(s) {other}, and" if other else ""
        raise StructureError(
            f"site {name!r} (plates {list(plates)}){where} MPImportance needs each of its elements to read one element "
            f"of another plate: {problem}"
        ) from error


def _segments(graph: FactorGraph) -> tuple[SegmentSum, ...]:
    """The steps that sum each gathered plate into its parent, deepest plates first."""
    order = list(graph.plates)
    steps = []
    for plate in sorted(graph.gathered.parents, key=lambda p: (-graph.gathered.depth(p), order.index(p))):
        parent = graph.gathered.parents[plate]
        local = frozenset(s for s, i in graph.indices.items() if plate in i.plates)
        steps.append(
            SegmentSum(
                plate=graph.symbols[plate],
                parent=graph.symbols[parent],
                index=graph.gathered.maps[plate],
                size=graph.size(parent),
                weight=graph.scale(plate) / graph.scale(parent),
                local=local,
            )
        )
    return tuple(steps)


def _apply_user_scale(log_p: torch.Tensor, site, plate_scale: float) -> torch.Tensor:
    """``log_p`` times the site's ``poutine.scale`` without the plates' subsampling factors (``plate_scale``)."""
    scale = site["scale"]
    if isinstance(scale, torch.Tensor):
        return log_p * (scale / plate_scale)
    ratio = float(scale) / plate_scale
    return log_p if abs(ratio - 1.0) < 1e-12 else log_p * ratio

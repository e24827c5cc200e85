"""K samples of every latent site, and the plated factor graph of the massively parallel importance estimator.

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
"""

from __future__ import annotations

import math
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

__all__ = ["Factor", "FactorGraph", "IndexVariable", "LatentSite", "Plate", "build_factor_graph"]

_PARTICLES = "_mp_importance_particles"


@dataclass(frozen=True)
class Plate:
    """A vectorised plate as seen by the model: ``size`` elements present (the subsample) out of ``full_size``."""

    name: str
    symbol: str
    dim: int
    size: int
    full_size: int

    @property
    def scale(self) -> float:
        """``N / B``: the power to which the product over the plate's present elements is raised."""
        return self.full_size / self.size


@dataclass
class IndexVariable:
    """One sample index per element of ``plates``: which of the ``size`` samples (or support points) is used."""

    symbol: str
    dim: int
    size: int
    plates: tuple[Plate, ...]  # sorted by dim, outermost (most negative) first
    sites: list[str] = field(default_factory=list)
    enumerated: bool = False

    @property
    def ordinal(self) -> frozenset[str]:
        return frozenset(p.symbol for p in self.plates)


@dataclass
class LatentSite:
    """A latent site of the model: its samples in model layout and where its plates are."""

    name: str
    index: str  # symbol of its IndexVariable
    value: torch.Tensor  # model layout
    event_dim: int
    plates: tuple[Plate, ...]
    batch_shape: torch.Size  # the site's batch shape in a plain model run (plates only)

    @property
    def ordinal(self) -> frozenset[str]:
        return frozenset(p.symbol for p in self.plates)


@dataclass
class Factor:
    """A packed log factor (``tensor._pyro_dims``) and the plates it lives in (``ordinal``, plate symbols)."""

    name: str
    tensor: torch.Tensor
    ordinal: frozenset[str]


@dataclass
class FactorGraph:
    """Everything the contraction needs, plus the bookkeeping to read results back at the sites' shapes."""

    num_samples: int
    max_plate_nesting: int
    plates: dict[str, Plate]
    indices: dict[str, IndexVariable]  # by symbol, in sampling order of appearance
    sites: dict[str, LatentSite]  # model latent sites, in model order
    factors: list[Factor]
    dim_to_symbol: dict[int, str]
    #: the guide's sites in particle layout: ``{name: (value (K, *plates, *event), plates, random)}``
    guide_sites: dict[str, tuple[torch.Tensor, tuple[Plate, ...], bool]] = field(default_factory=dict)
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

    @property
    def plate_scales(self) -> dict[str, float]:
        return {p.symbol: p.scale for p in self.plates.values()}

    def scale_of(self, plates: Iterable[Plate]) -> float:
        return math.prod(p.scale for p in plates)

    def natural_shape(self, plates: Iterable[Plate]) -> torch.Size:
        """Batch shape of a tensor living in ``plates`` in a plain model run (ones between plate dims)."""
        plates = tuple(plates)
        if not plates:
            return torch.Size()
        length = max(-p.dim for p in plates)
        shape = [1] * length
        for p in plates:
            shape[length + p.dim] = p.size
        return torch.Size(shape)

    def pack(
        self,
        tensor: torch.Tensor,
        plates: Iterable[Plate],
        own: Iterable[int] = (),
        *,
        what: str = "",
    ) -> torch.Tensor:
        """Pack a model-layout batch tensor (no event dims) into a factor tensor with ``_pyro_dims``.

        Plate axes of ``plates`` are always kept (expanded to the plate size if broadcast); index-variable axes are
        kept when larger than 1 or listed in ``own``; every other axis must have size 1.
        """
        plates = tuple(plates)
        P = self.max_plate_nesting
        by_dim = {p.dim: p for p in plates}
        own = set(own)
        need = max([-d for d in own] + [-p.dim for p in plates] + [0])
        if tensor.dim() < need:
            tensor = tensor.reshape((1,) * (need - tensor.dim()) + tuple(tensor.shape))
        n = tensor.dim()
        drop, symbols, sizes = [], [], []
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
                if size not in (1, plate.size):
                    raise StructureError(
                        f"{what}: dim {pos} of plate {plate.name!r} has size {size}, expected {plate.size}"
                    )
                symbols.append(plate.symbol)
                sizes.append(plate.size)
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
                    outside = [q.name for q in index.plates if q.symbol not in {p.symbol for p in plates}]
                    if outside:
                        raise StructureError(
                            f"{what} (plates {[p.name for p in plates]}) depends on the samples of "
                            f"{index.sites} drawn per element of plate(s) {outside}, which it is not in (e.g. "
                            "observations indexing group effects with z[group] in a separate plate). A plated "
                            "contraction can only combine a site with parents whose plates enclose it: nest the "
                            "observations inside the group plate, or estimate with a guide-based method."
                        )
                    symbols.append(symbol)
                    sizes.append(index.size)
                else:
                    drop.append(i)
        if drop:
            tensor = tensor.squeeze(tuple(drop))
        if tuple(tensor.shape) != tuple(sizes):
            tensor = tensor.expand(sizes)
        tensor._pyro_dims = "".join(symbols)
        return tensor

    def zeros(self, index_symbols: Iterable[str], plates: Iterable[Plate], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor packed over ``index_symbols`` then ``plates`` (a source term)."""
        index_symbols = tuple(index_symbols)
        plates = tuple(plates)
        shape = [self.indices[s].size for s in index_symbols] + [p.size for p in plates]
        tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        tensor._pyro_dims = "".join(index_symbols) + "".join(p.symbol for p in plates)
        return tensor

    def to_natural(self, site: LatentSite, tensor: torch.Tensor) -> torch.Tensor:
        """A model-layout value ``(size, ..., *plates, *event)`` as ``(size, *site.batch_shape, *event)``."""
        size = tensor.shape[0]
        tail = tensor.shape[tensor.dim() - self.max_plate_nesting - site.event_dim :]
        tensor = tensor.reshape((size, *tail))
        keep = len(site.batch_shape) + site.event_dim
        return tensor.reshape((size, *tensor.shape[tensor.dim() - keep :]))


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


def guess_max_plate_nesting(model: Callable, guide: Callable | None, args: tuple, kwargs: dict) -> int:
    """Deepest plate dim used by the model or the guide (one plain run of each)."""
    deepest = 0
    with torch.no_grad(), poutine.block():
        for fn in (model, guide):
            if fn is None:
                continue
            trace = poutine.trace(fn).get_trace(*args, **kwargs)
            for site in trace.nodes.values():
                if site["type"] == "sample":
                    for f in site["cond_indep_stack"]:
                        if f.vectorized:
                            if f.dim is None:
                                raise StructureError(f"plate {f.name!r} has no dim; give it dim=-k")
                            deepest = max(deepest, -f.dim)
    return deepest


class _Registry:
    """Plate and symbol bookkeeping shared by the guide and the model runs."""

    def __init__(self, max_plate_nesting: int) -> None:
        self.P = max_plate_nesting
        self.plates: dict[str, Plate] = {}
        self._count = 0

    def symbol(self) -> str:
        s = opt_einsum.get_symbol(self._count)
        self._count += 1
        return s

    def plates_of(self, site, what: str) -> tuple[Plate, ...]:
        out = []
        for f in _vectorized_frames(site):
            plate = self.plates.get(f.name)
            full = f.full_size if f.full_size is not None else f.size
            if plate is None:
                if -f.dim > self.P:
                    raise StructureError(
                        f"{what}: plate {f.name!r} uses dim {f.dim} but max_plate_nesting={self.P}; pass "
                        f"max_plate_nesting={-f.dim} or more"
                    )
                plate = Plate(f.name, self.symbol(), f.dim, f.size, full)
                self.plates[f.name] = plate
            elif (plate.dim, plate.size, plate.full_size) != (f.dim, f.size, full):
                raise StructureError(
                    f"{what}: plate {f.name!r} has dim {f.dim}, size {f.size} of {full} here but dim {plate.dim}, "
                    f"size {plate.size} of {plate.full_size} elsewhere; the model and guide must open it alike"
                )
            out.append(plate)
        return tuple(sorted(out, key=lambda p: p.dim))


def _site_log_prob(site, what: str) -> torch.Tensor:
    fn, value = site["fn"], site["value"]
    log_prob = detach_provenance(fn.log_prob(value))
    return scale_and_mask(log_prob, 1.0, site["mask"])


def _user_scale(site, plates: tuple[Plate, ...]) -> float | torch.Tensor:
    """The site's ``poutine.scale`` without the plates' subsampling factors."""
    scale = site["scale"]
    plate_scale = math.prod(p.scale for p in plates)
    if isinstance(scale, torch.Tensor):
        return scale / plate_scale
    ratio = float(scale) / plate_scale
    return 1.0 if abs(ratio - 1.0) < 1e-12 else ratio


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


def _run_guide(
    guide: Callable, args: tuple, kwargs: dict, K: int, P: int, registry: _Registry, fixed: dict[str, torch.Tensor]
) -> dict:
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
        log_q = _site_log_prob(site, what)
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
            "log_q": log_q,
            "random": not point_mass,
            "sources": sources,
            "plates": registry.plates_of(site, what),
            "auxiliary": bool(site["infer"].get("is_auxiliary")),
        }
    groups: OrderedDict[str, dict] = OrderedDict()
    for name, info in sites.items():
        root = uf.find(next(iter(sorted(info["sources"]))))
        group = groups.setdefault(root, {"members": [], "plates": set(), "random": []})
        group["members"].append(name)
        info["group"] = root
        if info["random"]:
            group["random"].append(name)
            group["plates"].update(info["plates"])
    return {"sites": sites, "groups": groups, "subsamples": subsamples}


def build_factor_graph(
    model: Callable,
    guide: Callable | None,
    args: tuple,
    kwargs: dict,
    *,
    num_samples: int,
    max_plate_nesting: int,
    fixed: dict[str, torch.Tensor] | None = None,
) -> FactorGraph:
    """Draw the samples, run the model on them and collect the packed log factors (under ``torch.no_grad``).

    ``fixed`` gives some sites their samples instead of drawing them: random guide sites in particle layout (with a
    guide), or the model's latent sites in model layout (prior proposal)."""
    K, P = num_samples, max_plate_nesting
    registry = _Registry(P)
    values: dict[str, tuple[torch.Tensor, int]] = {}
    subsamples: dict[str, torch.Tensor] = {}
    guide_info = None
    with torch.no_grad():
        if guide is not None:
            guide_info = _run_guide(guide, args, kwargs, K, P, registry, fixed or {})
            subsamples = guide_info["subsamples"]
            for g, root in enumerate(guide_info["groups"]):
                dim = -(P + 1 + g)
                for name in guide_info["groups"][root]["members"]:
                    info = guide_info["sites"][name]
                    v = info["value"]
                    v = v.reshape((v.shape[0],) + (1,) * g + tuple(v.shape[1:]))
                    values[name] = (v, dim)
            first_dim = -(P + 1 + len(guide_info["groups"]))
        else:
            first_dim = -(P + 1)
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
            raise
        return _collect(mtrace, run, guide_info, registry, K, P)


class TensorTooLargeError(ValueError):
    """A tensor of the MP importance computation would exceed the memory limit."""


def _collect(mtrace, run: _ModelRun, guide_info: dict | None, registry: _Registry, K: int, P: int) -> FactorGraph:
    indices: OrderedDict[str, IndexVariable] = OrderedDict()
    dim_to_symbol: dict[int, str] = {}
    group_symbol: dict[str, str] = {}
    if guide_info is not None:
        for g, (root, group) in enumerate(guide_info["groups"].items()):
            symbol = registry.symbol()
            dim = -(P + 1 + g)
            plates = tuple(sorted(group["plates"], key=lambda p: p.dim))
            indices[symbol] = IndexVariable(symbol, dim, K, plates)
            dim_to_symbol[dim] = symbol
            group_symbol[root] = symbol
    graph = FactorGraph(
        num_samples=K,
        max_plate_nesting=P,
        plates=registry.plates,
        indices=indices,
        sites=OrderedDict(),
        factors=[],
        dim_to_symbol=dim_to_symbol,
    )
    model_sites = [
        (name, site)
        for name, site in mtrace.nodes.items()
        if site["type"] == "sample" and not isinstance(site["fn"], _Subsample)
    ]
    # index variables of the model's own samples (prior proposal) and enumerated sites, in model order
    for name, site in model_sites:
        record = run.records.get(name)
        if record is None or record["kind"] == "guide":
            continue
        what = f"model site {name!r}"
        plates = registry.plates_of(site, what)
        symbol = registry.symbol()
        size = record.get("size", K)
        indices[symbol] = IndexVariable(symbol, record["dim"], size, plates, enumerated=record["kind"] == "enumerated")
        dim_to_symbol[record["dim"]] = symbol
        record["symbol"] = symbol
    if len(indices) + P > 60:
        raise StructureError(
            f"{len(indices)} sample dims plus {P} plate dims exceed what torch tensors support; vectorise sites "
            "into plates"
        )
    used_groups = set()
    for name, site in model_sites:
        what = f"model site {name!r}"
        plates = registry.plates_of(site, what)
        ordinal = frozenset(p.symbol for p in plates)
        if site["is_observed"]:
            if site["infer"].get("_deterministic"):
                continue
            log_p = _site_log_prob(site, what)
            log_p = _apply_user_scale(log_p, site, plates)
            graph.factors.append(Factor(name, graph.pack(log_p, plates, what=what), ordinal))
            continue
        record = run.records[name]
        if record["kind"] == "guide":
            root = guide_info["sites"][name]["group"]
            symbol = group_symbol[root]
            used_groups.add(root)
        else:
            symbol = record["symbol"]
        index = indices[symbol]
        index.sites.append(name)
        own = (index.dim,)
        full = _site_log_prob(site, what)
        log_p = _apply_user_scale(full, site, plates)
        graph.factors.append(Factor(name, graph.pack(log_p, plates, own, what=what), ordinal))
        if record["kind"] == "prior":  # proposal density: the diagonal, sample k given sample k of each parent
            n = max(full.dim(), -index.dim)
            full = full.reshape((1,) * (n - full.dim()) + tuple(full.shape))
            log_q = take_diagonal(full, index.dim, record["parents"])
            proposal = graph.pack(-log_q - math.log(K), plates, own, what=what)
            graph.factors.append(Factor(f"{name} (proposal)", proposal, ordinal))
        event_dim = site["fn"].event_dim
        batch_shape = graph.natural_shape(plates)
        graph.sites[name] = LatentSite(name, symbol, site["value"], event_dim, plates, batch_shape)
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
                if not log_k_done and info["plates"] == index.plates:
                    proposal, log_k_done = proposal - math.log(K), True
                elif not bool(proposal.any()):
                    continue  # e.g. the zero log-Jacobian of an AutoNormal site with real support
                what = f"guide site {member!r}"
                packed = graph.pack(proposal, info["plates"], (index.dim,), what=what)
                ordinal = frozenset(p.symbol for p in info["plates"])
                graph.factors.append(Factor(f"{member} (proposal)", packed, ordinal))
            if not log_k_done:
                constant = graph.zeros([index.symbol], index.plates, graph.factors[0].tensor.dtype) - math.log(K)
                constant._pyro_dims = index.symbol + "".join(p.symbol for p in index.plates)
                graph.factors.append(Factor(f"{index.symbol} (1/K)", constant, index.ordinal))
    return graph


def _apply_user_scale(log_p: torch.Tensor, site, plates: tuple[Plate, ...]) -> torch.Tensor:
    scale = _user_scale(site, plates)
    if isinstance(scale, float) and scale == 1.0:
        return log_p
    return log_p * scale

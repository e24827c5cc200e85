"""Plated log-sum-product contraction of the MP factor graph with Pyro's tensor variable elimination.

``pyro.ops.contract.contract_to_tensor`` does the message passing; the only change is the ring: the product over a
subsampled plate (``B`` of ``N`` elements present) is raised to the power ``N/B`` *after* each element's sum over its
samples, i.e. the log of the plate-contracted factor is multiplied by ``N/B``. Pyro's ``TraceTMC_ELBO`` instead
multiplies every log factor by ``N/B`` before the sum over samples, which estimates a different quantity.

Gathered plates (:mod:`pyro_hier.infer.gathered`) are eliminated first: for each, deepest first, the factors in it
are contracted per element over the index variables drawn in it, and the result is summed into the parent plate by
a segment sum (``index_add``); what remains is an ordinary plated factor graph.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import opt_einsum
import torch
from pyro.ops.contract import contract_to_tensor
from pyro.ops.rings import LogRing

from pyro_hier.errors import StructureError
from pyro_hier.infer.factor_graph import Factor, FactorGraph, TensorTooLargeError
from pyro_hier.infer.gathered import SegmentSum

__all__ = ["ContractionEstimate", "eliminate_segments", "estimate_contraction", "log_contract", "separators"]


class PlateScaledLogRing(LogRing):
    """``LogRing`` whose product over plate ``s`` is multiplied by ``scales[s]`` (``N/B`` for a subsample)."""

    def __init__(self, scales: dict[str, float], cache: dict | None = None) -> None:
        super().__init__(cache=cache)
        self._scales = {s: float(v) for s, v in scales.items() if v != 1.0}

    def product(self, term: torch.Tensor, ordinal: frozenset[str]) -> torch.Tensor:
        dims = term._pyro_dims
        for dim in sorted(ordinal, reverse=True):
            pos = dims.find(dim)
            if pos == -1:
                continue
            key = "product", self._hash_by_id(term), dim
            if key in self._cache:
                term = self._cache[key]
            else:
                result = term.sum(pos)
                scale = self._scales.get(dim)
                if scale is not None:
                    result = result * scale
                dims = dims.replace(dim, "")
                result._pyro_dims = dims
                self._cache[key] = result
                term = result
            dims = term._pyro_dims
        return term


def _tree(factors: Sequence[Factor]) -> OrderedDict:
    tree: OrderedDict = OrderedDict()
    for f in factors:
        tree.setdefault(f.ordinal, []).append(f.tensor)
    return tree


def _components(factors: Sequence[Factor], dims: set[str]) -> list[list[Factor]]:
    """Factors grouped by the ``dims`` they share (connected components)."""
    groups: list[tuple[set[str], list[Factor]]] = []
    for f in factors:
        mine = dims & set(f.tensor._pyro_dims)
        joined = [g for g in groups if g[0] & mine]
        merged = (set(mine).union(*(g[0] for g in joined)), [m for g in joined for m in g[1]] + [f])
        groups = [g for g in groups if not any(g is j for j in joined)] + [merged]
    return [g[1] for g in groups]


def _segment_sum(ring, term: torch.Tensor, step: SegmentSum) -> torch.Tensor:
    dims = term._pyro_dims
    pos = dims.index(step.plate)
    shape = list(term.shape)
    shape[pos] = step.size
    if term.device.type == "meta":
        out = torch.empty(shape, device="meta")
        ring._record(math.prod(shape), f"segment sum {dims}->{dims.replace(step.plate, step.parent)}")
    else:
        source = term if step.weight == 1.0 else term * step.weight
        out = term.new_zeros(shape).index_add(pos, step.index.to(term.device), source)
    out._pyro_dims = dims.replace(step.plate, step.parent)
    return out


def eliminate_segments(
    factors: Iterable[Factor], sum_dims: set[str], segments: Sequence[SegmentSum], ring
) -> tuple[list[Factor], set[str]]:
    """Sum every gathered plate into its parent (``segments``, deepest first): the factors in the plate are contracted
    per element over the index variables drawn in it (each connected group of them apart), and each result is summed
    into the parent plate by ``index_add``. Returns the factors and the sum dims left."""
    factors = list(factors)
    sum_dims = set(sum_dims)
    for step in segments:
        local = [f for f in factors if step.plate in f.ordinal]
        if not local:
            continue
        factors = [f for f in factors if step.plate not in f.ordinal]
        dims = set(step.local) & sum_dims
        for component in _components(local, dims):
            ordinal = frozenset.intersection(*(f.ordinal for f in component))
            present = set(dims & set("".join(f.tensor._pyro_dims for f in component)))
            if len(component) == 1 and not present:
                term = component[0].tensor
                ordinal = component[0].ordinal
            else:
                term = _contract(_tree(component), present, ring, target_ordinal=ordinal)
            if step.parent in ordinal:
                raise StructureError(
                    f"factor {component[0].name!r} lies in a plate and in the plate it is gathered into; MPImportance "
                    "cannot sum it into itself"
                )
            moved = _segment_sum(ring, term, step)
            factors.append(Factor(f"{component[0].name} (summed)", moved, ordinal - {step.plate} | {step.parent}))
        sum_dims -= dims
    return factors, sum_dims


def _contract(tree: OrderedDict, sum_dims: set[str], ring, target_ordinal: frozenset[str] | None = None):
    try:
        return contract_to_tensor(tree, sum_dims, target_ordinal=target_ordinal, ring=ring)
    except NotImplementedError as e:
        raise StructureError(
            f"the model's plates are not tree-structured for this contraction ({e}); variables outside a plate "
            "cannot depend on variables inside it, and crossed plates must not share sample dims (crossed effects: "
            "fit a guide, e.g. AutoBranchGuide or AutoNormal, or nest one plate in the other)"
        ) from e


def log_contract(
    factors: Sequence[Factor],
    sum_dims: set[str],
    scales: dict[str, float],
    target: set[str] | None = None,
    segments: Sequence[SegmentSum] = (),
) -> torch.Tensor:
    """``log P̂``: sum over the index variables ``sum_dims``, product over every plate (``scales[s]`` the power of
    plate ``s``), of all ``factors``, gathered plates first summed into their parents (``segments``). Dims in
    neither (``target``, e.g. an outer chunk's index variables) are kept."""
    ring = PlateScaledLogRing(scales)
    factors, sum_dims = eliminate_segments(factors, set(sum_dims), segments, ring)
    result = _contract(_tree(factors), sum_dims, ring)
    if target is not None and set(result._pyro_dims) != set(target):
        dims = result._pyro_dims
        missing = "".join(sorted(set(target) - set(dims)))
        if set(dims) - set(target):
            raise StructureError(f"unexpected dims {set(dims) - set(target)} left after the contraction")
        if missing:  # a message that does not depend on some outer index: broadcast it
            result = result.reshape((1,) * len(missing) + tuple(result.shape))
            result._pyro_dims = missing + dims
    return result


class _ProbeRing(LogRing):
    """Runs the contraction on ``meta`` tensors and records the largest tensor it would create."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.where = ""

    def _record(self, numel: int, where: str) -> None:
        if numel > self.largest:
            self.largest, self.where = numel, where

    def sumproduct(self, terms, dims):
        inputs = [term._pyro_dims for term in terms]
        output = "".join(sorted(set("".join(inputs)) - set(dims)))
        sizes = {}
        for term in terms:
            sizes.update(zip(term._pyro_dims, term.shape))
        shape = tuple(sizes[d] for d in output)
        if len(terms) > 1 or set(dims) & set(inputs[0]):
            equation = ",".join(inputs) + "->" + output
            try:
                _, info = opt_einsum.contract_path(equation, *[tuple(t.shape) for t in terms], shapes=True)
                self._record(int(info.largest_intermediate), equation)
            except (ValueError, TypeError):  # pragma: no cover - opt_einsum refuses odd equations; bound by output
                pass
        self._record(math.prod(shape), ",".join(inputs) + "->" + output)
        result = torch.empty(shape, device="meta")
        result._pyro_dims = output
        return result

    def product(self, term, ordinal):
        dims = term._pyro_dims
        keep = [i for i, d in enumerate(dims) if d not in ordinal]
        result = torch.empty([term.shape[i] for i in keep], device="meta")
        result._pyro_dims = "".join(dims[i] for i in keep)
        return result

    def inv(self, term):
        result = torch.empty(term.shape, device="meta")
        result._pyro_dims = term._pyro_dims
        return result


class ContractionEstimate:
    """Sizes (in elements) of the largest factor and of the largest tensor the contraction creates."""

    def __init__(self, largest_factor: int, factor_name: str, largest_intermediate: int, equation: str) -> None:
        self.largest_factor = largest_factor
        self.factor_name = factor_name
        self.largest_intermediate = largest_intermediate
        self.equation = equation

    @property
    def largest(self) -> int:
        return max(self.largest_factor, self.largest_intermediate)

    def __repr__(self) -> str:
        return (
            f"ContractionEstimate(largest_factor={self.largest_factor} ({self.factor_name}), "
            f"largest_intermediate={self.largest_intermediate} ({self.equation}))"
        )


def estimate_contraction(
    factors: Sequence[Factor], sum_dims: set[str], segments: Sequence[SegmentSum] = ()
) -> ContractionEstimate:
    """Largest tensor of :func:`log_contract` without computing anything (shape-only run on ``meta`` tensors)."""
    metas = []
    biggest, biggest_name = 0, ""
    for f in factors:
        meta = torch.empty(tuple(f.tensor.shape), device="meta")
        meta._pyro_dims = f.tensor._pyro_dims
        metas.append(Factor(f.name, meta, f.ordinal))
        if f.tensor.numel() > biggest:
            biggest, biggest_name = f.tensor.numel(), f.name
    ring = _ProbeRing()
    metas, sum_dims = eliminate_segments(metas, set(sum_dims), segments, ring)
    _contract(_tree(metas), set(sum_dims), ring)
    return ContractionEstimate(biggest, biggest_name, ring.largest, ring.where)


def check_memory(
    graph: FactorGraph, estimate: ContractionEstimate, max_tensor_bytes: float | None, chunked: str | None = None
) -> None:
    """Raise :class:`TensorTooLargeError` naming the culprit when the largest tensor exceeds the limit."""
    if max_tensor_bytes is None:
        return
    itemsize = torch.empty((), dtype=graph.dtype).element_size()
    need = estimate.largest * itemsize
    if need <= max_tensor_bytes:
        return
    what = estimate.equation if estimate.largest_intermediate >= estimate.largest_factor else estimate.factor_name
    widest = max(_outermost_plates(graph), key=graph.size, default=None)
    chunk = ""
    if widest is not None and graph.size(widest) > 1:
        ratio = max(2, math.ceil(need / max_tensor_bytes))
        size = max(1, graph.size(widest) // ratio)
        rows = (
            " (and the rows that gather it, see pyro_hier.plates.gathered_rows)"
            if graph.gathered.descendants(widest)
            else ""
        )
        chunk = (
            f", or chunk plate {widest!r} (size {graph.size(widest)}): MPImportance(..., chunk_plate={widest!r}, "
            f"chunk_size={size}) with a model that takes the chunk's indices as subsample=...{rows}"
        )
        if chunked is not None:
            chunk = f", or a smaller chunk_size for plate {chunked!r}"
    raise TensorTooLargeError(
        f"the contraction would create a tensor of {need / 2**30:.2f} GiB ({estimate.largest:,} elements: {what}), "
        f"above max_tensor_bytes={max_tensor_bytes / 2**30:.2f} GiB; use a smaller num_samples (cost grows like K^2 "
        f"for a site and its parent){chunk}, or raise max_tensor_bytes"
    )


def chunk_region(graph: FactorGraph, plate: str) -> frozenset[str]:
    """The symbols of ``plate`` and of the plates gathered into it: what a chunk of ``plate`` holds."""
    return graph.ordinal({plate, *graph.gathered.descendants(plate)})


def _outermost_plates(graph: FactorGraph) -> list[str]:
    """Plates that every plate used inside them is nested in, counting the plates gathered into them as inside
    (the ones :mod:`~pyro_hier.infer.chunking` accepts)."""
    out = []
    for plate in graph.plates:
        if plate in graph.gathered.parents:
            continue
        region = chunk_region(graph, plate)
        inner = {q for f in graph.factors if region & f.ordinal for q in f.ordinal} - region
        if all(region & f.ordinal for f in graph.factors if inner & f.ordinal):
            out.append(plate)
    return out


def separators(graph: FactorGraph) -> tuple[list[str], dict[str, list[str]]]:
    """Sampling order of the index variables and, for each, the earlier ones its conditional depends on.

    Outer plates come first (a gathered plate after the plates it is summed into), then model order; eliminating in
    the reverse order, the separator of ``v`` is the set of earlier variables adjacent to ``v`` once all later ones
    are eliminated (fill-in included), so that ``P(k) = prod_v P(k_v | k_sep(v))`` exactly, each element of ``v``'s
    plates conditioned on the elements of its separators' plates it belongs to.
    """
    names = list(graph.indices)
    order = sorted(names, key=lambda s: (graph.level(graph.indices[s].plates), names.index(s)))
    position = {v: i for i, v in enumerate(order)}
    adjacent: dict[str, set[str]] = {v: set() for v in order}
    for f in graph.factors:
        present = [d for d in f.tensor._pyro_dims if d in adjacent]
        for a in present:
            adjacent[a].update(b for b in present if b != a)
    sep: dict[str, list[str]] = {}
    for v in reversed(order):
        earlier = sorted((u for u in adjacent[v] if position[u] < position[v]), key=position.get)
        sep[v] = earlier
        for a in earlier:
            adjacent[a].update(b for b in earlier if b != a)
        plates_v = graph.indices[v].plates
        for u in earlier:
            if not graph.gathered.reaches(plates_v, graph.indices[u].plates):
                raise StructureError(
                    f"cannot sample the sites of {graph.indices[v].sites} given {graph.indices[u].sites}: their "
                    "plates are not nested (crossed plates); posterior sampling is not supported for this model"
                )
    return order, sep

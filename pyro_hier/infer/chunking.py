"""Chunking the contraction over an outer plate, to bound memory for large plates.

With ``G`` the factors outside the plate (the "globals") and ``F_c`` the factors inside it for chunk ``c`` of its
elements, the estimator factorises as

.. math::

    \\log \\hat P = \\log \\sum_{k_g} \\exp\\Big(G(k_g) + \\sum_c M_c(k_g)\\Big), \\qquad
    M_c(k_g) = \\sum_{n \\in c} \\log \\sum_{k_{\\text{local}}} \\prod F_{c}(k_g, k_{\\text{local}}),

so each chunk is sampled, run through the model and contracted on its own down to a message ``M_c`` over the
global sample indices, with the global samples shared by every chunk. Posterior quantities of a chunk's sites come
from a source-term pass over that chunk with the other chunks' messages held fixed; the chunk's factors are rebuilt
from its stored samples, so only one chunk's factors are in memory at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pyro_hier.errors import StructureError
from pyro_hier.infer.contraction import (
    ContractionEstimate,
    check_memory,
    chunk_region,
    estimate_contraction,
    log_contract,
)
from pyro_hier.infer.factor_graph import Factor, FactorGraph
from pyro_hier.structure import PlateInfo

__all__ = ["Pass", "run_chunked"]


@dataclass
class Pass:
    """One contraction that source terms can be attached to.

    ``graph`` packs the source terms (its sites and index variables); ``factors`` are contracted over ``sum_dims``
    with plate powers ``scales``, gathered plates summed into their parents by the graph's segments; results for
    ``indices`` and ``sites`` are read from this pass. ``rebuild`` (chunks) recreates ``graph`` and its local
    ``factors`` from the chunk's stored samples when they were released."""

    graph: FactorGraph | None
    factors: list[Factor] | None
    sum_dims: set[str]
    scales: dict[str, float]
    indices: list[str]
    sites: list[str]
    rebuild: Callable[[], tuple[FactorGraph, list[Factor]]] | None = None

    def materialise(self) -> tuple[FactorGraph, list[Factor]]:
        if self.graph is not None:
            return self.graph, self.factors
        return self.rebuild()


def _signature(graph: FactorGraph) -> tuple:
    return (
        tuple((s, i.dim, i.size, i.plates, tuple(i.sites)) for s, i in graph.indices.items()),
        tuple((p, graph.symbols[p], graph.dim(p)) for p in graph.plates),
        tuple(graph.gathered.parents.items()),
    )


def _fixed_samples(graph: FactorGraph, guided: bool, keep: Callable[[tuple[str, ...]], bool]) -> dict:
    """Samples of the random sites whose plates satisfy ``keep``, in the layout ``build_factor_graph`` replays."""
    if guided:
        return {n: v for n, (v, plates, random) in graph.guide_sites.items() if random and keep(plates)}
    return {n: s.value for n, s in graph.sites.items() if keep(s.plates) and not graph.indices[s.index].enumerated}


def run_chunked(
    build: Callable[[torch.Tensor, dict | None], FactorGraph],
    *,
    plate_name: str,
    full_size: int,
    chunk_size: int,
    guided: bool,
    max_tensor_bytes: float | None,
) -> tuple[FactorGraph, list[Pass], torch.Tensor, ContractionEstimate]:
    """Run every chunk, combine their messages; returns the merged graph, the passes, ``log P̂`` and the largest
    per-chunk tensor estimate. ``build(indices, fixed)`` builds one chunk's factor graph."""
    chunks = [torch.arange(s, min(s + chunk_size, full_size)) for s in range(0, full_size, chunk_size)]
    first = None
    messages, stored, pieces = [], [], {}
    global_fixed = None
    for idx in chunks:
        graph = build(idx, global_fixed)
        plate = graph.plates.get(plate_name)
        if plate is None or plate.subsample_size != len(idx) or plate.size != full_size:
            raise StructureError(
                f"chunk_plate {plate_name!r}: the model did not use the {len(idx)} indices passed as its subsample "
                f"keyword (plate seen: {plate}); open the plate as pyro.plate({plate_name!r}, N, subsample=subsample)"
            )
        if plate_name in graph.gathered.parents:
            parent = graph.gathered.parents[plate_name]
            raise StructureError(
                f"chunk_plate {plate_name!r} is gathered into plate {parent!r} (its elements read elements of "
                f"{parent!r}); chunk {graph.gathered.root(plate_name)!r} instead, with the model opening the rows "
                "of each chunk (pyro_hier.plates.gathered_rows)"
            )
        region = chunk_region(graph, plate_name)
        symbol = graph.symbols[plate_name]
        crowded = [n for n, s in graph.sites.items() if (graph.ordinal(s.plates) & region) - {symbol}]
        if crowded:
            raise StructureError(
                f"chunk_plate {plate_name!r}: the latent sites {crowded} lie in plates gathered into it; chunking "
                "supports plates gathered into the chunked plate that hold observations only. Run without chunking, "
                "or nest those sites in the chunked plate"
            )
        local = [f for f in graph.factors if region & f.ordinal]
        outer = [f for f in graph.factors if not region & f.ordinal]
        local_symbols = {s for s, i in graph.indices.items() if plate_name in i.plates}
        est = estimate_contraction(graph.factors, graph.sum_dims, graph.segments)
        check_memory(graph, est, max_tensor_bytes, chunked=plate_name)
        if first is None:
            inner_plates = {s for f in local for s in f.ordinal} - region
            if inner_plates & {s for f in outer for s in f.ordinal}:
                raise StructureError(
                    f"chunk_plate {plate_name!r} must be an outermost plate: plates used inside it also hold sites "
                    "outside it; chunk the outer plate instead"
                )
            first, estimate, chunk_plate, template = _signature(graph), est, plate, graph
            global_factors = outer
            global_fixed = _fixed_samples(graph, guided, lambda plates: plate_name not in plates)
            global_symbols = set(graph.indices) - local_symbols
            scales = dict(graph.plate_scales)
            scales[symbol] = 1.0  # the chunks together cover the plate once
            segments = graph.segments
        elif _signature(graph) != first:
            raise StructureError(
                f"the model's sites or plates differ between chunks of plate {plate_name!r}; chunking needs the "
                "same structure for every chunk"
            )
        elif est.largest > estimate.largest:
            estimate = est
        with torch.no_grad():
            messages.append(
                log_contract(
                    local, local_symbols, scales, target=global_symbols & _dims_of(local), segments=graph.segments
                )
            )
        for n, site in graph.sites.items():
            if plate_name in site.plates:
                pieces.setdefault(n, []).append(site.value)
        stored.append((idx, _fixed_samples(graph, guided, lambda plates: True)))
        del graph, local, outer

    full_plate = dataclasses.replace(chunk_plate, subsample_size=full_size)
    merged = _merge(template, pieces, full_plate, global_factors)
    total = _as_factor(_sum_messages(messages), "chunks")
    with torch.no_grad():
        log_normalizer = log_contract([*global_factors, total], global_symbols, scales, segments=segments)
    passes = [
        Pass(
            graph=dataclasses.replace(merged, factors=global_factors),
            factors=[*global_factors, total],
            sum_dims=global_symbols,
            scales=scales,
            indices=[s for s in merged.indices if s in global_symbols],
            sites=[n for n, site in merged.sites.items() if plate_name not in site.plates],
        )
    ]
    local_sites = [n for n, site in merged.sites.items() if plate_name in site.plates]
    for c, (idx, fixed) in enumerate(stored):
        rest = _sum_messages([m for j, m in enumerate(messages) if j != c])

        def rebuild(idx=idx, fixed=fixed, rest=rest):
            graph = build(idx, fixed)
            region = chunk_region(graph, plate_name)
            local = [f for f in graph.factors if region & f.ordinal]
            extra = [] if rest is None else [_as_factor(rest, "other chunks")]
            return graph, local + global_factors + extra

        passes.append(
            Pass(
                graph=None,
                factors=None,
                sum_dims=set(merged.indices),
                scales=scales,
                indices=[s for s in merged.indices if s not in global_symbols],
                sites=local_sites,
                rebuild=rebuild,
            )
        )
    return merged, passes, log_normalizer.detach(), estimate


def _dims_of(factors: list[Factor]) -> set[str]:
    return {d for f in factors for d in f.tensor._pyro_dims}


def _as_factor(tensor: torch.Tensor, name: str) -> Factor:
    return Factor(name, tensor, frozenset())


def _sum_messages(messages: list[torch.Tensor]) -> torch.Tensor | None:
    """Product of messages (sum of logs), broadcast over the union of their dims."""
    if not messages:
        return None
    dims = "".join(sorted(set("".join(m._pyro_dims for m in messages))))
    sizes = {}
    for m in messages:
        sizes.update(zip(m._pyro_dims, m.shape))
    total = None
    for m in messages:
        aligned = m.permute([m._pyro_dims.index(d) for d in dims if d in m._pyro_dims])
        aligned = aligned.reshape([sizes[d] if d in m._pyro_dims else 1 for d in dims])
        total = aligned if total is None else total + aligned
    total = total.expand([sizes[d] for d in dims]).contiguous()
    total._pyro_dims = dims
    return total


def _merge(
    template: FactorGraph, pieces: dict[str, list[torch.Tensor]], plate: PlateInfo, factors: list[Factor]
) -> FactorGraph:
    """A graph over all chunks for bookkeeping (sites with every chunk's samples, index variables, shapes)."""
    plates = dict(template.plates)
    plates[plate.name] = plate
    indices = {s: dataclasses.replace(i, sites=list(i.sites)) for s, i in template.indices.items()}
    merged = dataclasses.replace(template, plates=plates, indices=indices, factors=factors, guide_sites={})
    sites = {}
    for name, site in template.sites.items():
        if name not in pieces:
            sites[name] = site
            continue
        values = pieces[name]
        axis = values[0].dim() - site.event_dim + plate.dim
        value = torch.cat(values, axis)
        sites[name] = dataclasses.replace(site, value=value, batch_shape=merged.natural_shape(site.plates))
    merged.sites = sites
    return merged

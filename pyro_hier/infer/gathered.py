r"""Gathered plates as segment sums: how :class:`~pyro_hier.infer.MPImportance` contracts a flat plate that gathers
group effects by an index.

Most hierarchical models are written with a flat plate of observations that reads its group's effect by an index,
``y_i ~ p(y_i | a[county[i]])`` in a plate of homes beside a plate of counties. The structure inspector finds the
index (:attr:`pyro_hier.structure.ModelStructure.gathers`); this module turns it into a tree of plates and into
steps of the contraction.

**The tree.** A *gathered* plate ``p`` (homes) is summed into one *parent* plate ``q`` (counties): element ``i`` of
``p`` belongs to element ``m_p(i)`` of ``q``. Index chains (homes → counties → states) give deeper trees; a plate read
by the elements of ``p`` must be ``q`` or an ancestor of ``q``, reached through the same elements (the state a home
reads must be the state of its county). Two plates read by ``p`` that are not on one chain are *crossed* (an answer
reading one student and one question) and are refused: the sum over the sample combinations has no plated form then.

**The step.** With ``K`` samples per element of ``q`` and :math:`k_j` the sample index of element ``j``, the estimator
needs, for each ``j``, the product over the elements of ``p`` that belong to ``j`` of their factors, which depend on
``k_j`` (and on indices of plates above). In logs this is a *segment sum*,

.. math::

    \log F_j(k_j, k_{\text{outer}}) = w_p \sum_{i:\, m_p(i) = j} \log f_i(k_{m_p(i)}, k_{\text{outer}}),
    \qquad w_p = \frac{N_p / B_p}{N_q / B_q},

an ordinary factor in plate ``q``: the contraction stays plated and exact. When ``p`` holds latent sites of its own
(a chain: counties with their samples, gathered into states), their sample indices are first summed out per element
of ``p`` (log-sum-exp, the outer indices kept), and the result is segment-summed into ``q``: a plated elimination in
which the plate product is a segment sum.

**Scales.** Log factors are used without the subsampling scale; the contraction raises the product over a plate to
its ``N/B``. A factor moved from ``p`` into ``q`` then counts ``w_p \cdot N_q/B_q = N_p/B_p`` times its (user-scaled)
log density: its site's total scale. For radon with its counties subsampled by
:func:`pyro_hier.plates.gathered_rows` (``m`` of ``J`` counties, the homes of those counties, the homes' site scaled to
``J/m``) the homes' weight is 1 and the counties' power ``J/m``; with the homes subsampled alone (``B`` of ``M``, all
counties present) the homes' weight is ``M/B``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pyro_hier.errors import StructureError
from pyro_hier.structure import ModelStructure

__all__ = ["GatheredPlates", "SegmentSum", "find_gathered_plates"]

_GUIDE_ROUTE = (
    "fit a guide instead (e.g. AutoBranchGuide or AutoNormal with SVI), or use MPImportance on a model in which one "
    "plate is nested in the other"
)


@dataclass(frozen=True)
class SegmentSum:
    """One step of the contraction: eliminate the index variables ``local`` per element of plate ``plate`` and sum
    the elements into plate ``parent`` (einsum symbols): element ``i`` goes to ``index[i]`` of ``size`` elements, its
    log factor multiplied by ``weight``."""

    plate: str
    parent: str
    index: torch.Tensor
    size: int
    weight: float
    local: frozenset[str]


class GatheredPlates:
    """The tree that gathers put on the plates of one call: each gathered plate is summed into its parent plate.

    :param parents: ``{plate: parent plate}`` (plate names).
    :param maps: ``{plate: LongTensor}``, for each element of a gathered plate (in the call's positions) the position
        of the parent's element it belongs to.
    """

    def __init__(self, parents: dict[str, str] | None = None, maps: dict[str, torch.Tensor] | None = None) -> None:
        self.parents = dict(parents or {})
        self.maps = dict(maps or {})

    def __bool__(self) -> bool:
        return bool(self.parents)

    def __repr__(self) -> str:
        return f"GatheredPlates({', '.join(f'{p} -> {q}' for p, q in self.parents.items())})"

    def ancestors(self, plate: str) -> tuple[str, ...]:
        """The plates ``plate`` is summed into, nearest first."""
        out = []
        while plate in self.parents:
            plate = self.parents[plate]
            out.append(plate)
        return tuple(out)

    def depth(self, plate: str) -> int:
        return len(self.ancestors(plate))

    def root(self, plate: str) -> str:
        ancestors = self.ancestors(plate)
        return ancestors[-1] if ancestors else plate

    def descendants(self, plate: str) -> frozenset[str]:
        """The plates summed (directly or through a chain) into ``plate``."""
        return frozenset(p for p in self.parents if plate in self.ancestors(p))

    def compose(self, plate: str, ancestor: str) -> torch.Tensor:
        """For each element of ``plate``, the position of the element of ``ancestor`` it belongs to."""
        index = None
        while plate != ancestor:
            step = self.maps[plate]
            index = step if index is None else step[index]
            plate = self.parents[plate]
        assert index is not None
        return index

    def reaches(self, inner: Iterable[str], outer: Iterable[str]) -> bool:
        """Whether every plate of ``outer`` is one of ``inner`` or an ancestor of one of them (an element of the
        ``inner`` plates then determines one element of the ``outer`` plates)."""
        inner = tuple(inner)
        reachable = set(inner).union(*(self.ancestors(p) for p in inner))
        return set(outer) <= reachable

    def via(self, inner: Iterable[str], plate: str) -> str | None:
        """The plate of ``inner`` through which ``plate`` (an ancestor) is reached."""
        return next((p for p in inner if plate in self.ancestors(p)), None)

    def pull(
        self, tensor: torch.Tensor, source: Iterable[str], target: Iterable[str], dims: dict[str, int]
    ) -> torch.Tensor:
        """Re-index ``tensor``, laid out over the ``source`` plates (``dims[plate]`` its tensor dims, negative), at the
        elements of the ``target`` plates: each target element takes the value of the source element it belongs to.
        Source plates that are target plates are left alone; the others must be ancestors of target plates."""
        target = tuple(target)
        for plate in source:
            if plate in target:
                continue
            inner = self.via(target, plate)
            if inner is None:
                raise StructureError(f"plate {plate!r} is not reached from plates {list(target)} through gathers")
            index = self.compose(inner, plate).to(tensor.device)
            at, to = tensor.dim() + dims[plate], tensor.dim() + dims[inner]
            tensor = tensor.index_select(at, index)
            if at != to:
                if tensor.shape[to] != 1:
                    raise StructureError(f"plates {plate!r} and {inner!r} would share a tensor dim")
                tensor = tensor.transpose(at, to)
        return tensor


# ------------------------------------------------------------------------------------------------------ finding it
def _reading_plate(name: str, plates: tuple[str, ...], dims: tuple[int, ...], index: torch.Tensor, read: str) -> str:
    """The plate of the reading site along which the index of the element read varies."""
    varying, candidates = [], []
    for plate, dim in zip(plates, dims):
        axis = index.dim() + dim
        if axis < 0 or index.shape[axis] == 1:
            continue
        candidates.append(plate)
        if not bool((index == index.narrow(axis, 0, 1)).all()):
            varying.append(plate)
    if len(varying) > 1:
        raise StructureError(
            f"site {name!r} reads elements of plate {read!r} through an index that depends on several of its plates "
            f"{varying}; MPImportance needs each read of another plate to depend on one plate of the reader (a flat "
            f"plate gathering group effects). For crossed effects, {_GUIDE_ROUTE}."
        )
    if varying:
        return varying[0]
    if len(candidates) == 1:
        return candidates[0]
    if len(plates) == 1:
        return plates[0]
    raise StructureError(
        f"site {name!r} (plates {list(plates)}) reads the same element of plate {read!r} from all its elements; "
        "MPImportance cannot tell which of its plates is summed into it. Move the read out of the plate, or nest the "
        "site in the plate it reads."
    )


def _along(index: torch.Tensor, dim: int) -> torch.Tensor:
    """The index as a vector along the tensor dim ``dim`` (constant along the others)."""
    axis = index.dim() + dim
    if axis < 0:
        return index.reshape(1)
    for d in range(index.dim()):
        if d != axis:
            index = index.narrow(d, 0, 1)
    return index.reshape(-1)


def find_gathered_plates(
    structure: ModelStructure, readers: dict[str, tuple[str, ...]], sizes: dict[str, int]
) -> GatheredPlates:
    """The tree of gathered plates of the call described by ``structure``, from the gathers of the sites ``readers``
    (``{site: plates}``: the sites whose factors depend on samples drawn per element of those plates, which they are
    not in).

    :param sizes: each plate's size in the call (its subsample size).
    :raises StructureError: for a reader whose reads no per-element map describes (whole-plate reads, indices computed
        from latents: from :meth:`~pyro_hier.structure.ModelStructure.gathers_of`), crossed plates, elements of one
        plate reading different elements of another, chains that disagree, and cycles.
    """
    edges: dict[str, dict[str, tuple[torch.Tensor, str, str]]] = {}
    for name, foreign in readers.items():
        site = structure.latent.get(name) or structure.observed[name]
        try:
            gathers = structure.gathers_of(name)
        except StructureError as e:
            raise StructureError(
                f"site {name!r} (plates {list(site.plates)}) depends on samples drawn per element of plate(s) "
                f"{list(foreign)}, and MPImportance needs each of its elements to read one element of another plate: "
                f"{e}"
            ) from e
        for g in gathers:
            if g.plate in site.plates:
                raise StructureError(
                    f"site {name!r} reads other elements of its own plate {g.plate!r} (of site {g.source!r}), as in a "
                    "chain along the plate; MPImportance samples each element of a plate independently given the "
                    "plates above it. Unroll the dependence into sites of their own, or fit a guide."
                )
            plate = _reading_plate(name, site.plates, site.plate_dims, g.index, g.plate)
            index = _along(g.index, structure.plates[plate].dim).to(torch.long)
            if index.numel() == 1 and sizes[plate] > 1:
                index = index.expand(sizes[plate])
            if index.numel() != sizes[plate]:
                raise StructureError(
                    f"site {name!r} reads plate {g.plate!r} through an index of {index.numel()} elements along its "
                    f"plate {plate!r}, which has {sizes[plate]} in this call"
                )
            reads = edges.setdefault(plate, {})
            if g.plate in reads:
                old, who, source = reads[g.plate]
                both = (old >= 0) & (index >= 0)
                if not torch.equal(old[both], index[both]):
                    i = int((both & (old != index)).nonzero()[0])
                    raise StructureError(
                        f"element {i} of plate {plate!r} reads element {int(old[i])} of plate {g.plate!r} in site "
                        f"{who!r} (from {source!r}) but element {int(index[i])} in site {name!r} (from {g.source!r}); "
                        "MPImportance needs each element of a gathered plate to belong to one element of the plate it "
                        f"reads. Split the plate, or {_GUIDE_ROUTE}."
                    )
                reads[g.plate] = (torch.where(old >= 0, old, index), who, source)
            else:
                reads[g.plate] = (index, name, g.source)

    tree = GatheredPlates()
    parents, maps = tree.parents, tree.maps  # filled in as the plates are resolved
    visiting: set[str] = set()

    def resolve(plate: str) -> None:
        if plate in parents or plate not in edges:
            return
        if plate in visiting:
            raise StructureError(f"plate {plate!r} is gathered into itself through a cycle of reads")
        visiting.add(plate)
        reads = edges[plate]
        for other in reads:
            resolve(other)
        visiting.discard(plate)
        candidates = [q for q in reads if all(o == q or o in tree.ancestors(q) for o in reads)]
        if not candidates:
            a, b = next(
                (a, b)
                for a in reads
                for b in reads
                if a != b and a not in tree.ancestors(b) and b not in tree.ancestors(a)
            )
            raise StructureError(
                f"plate {plate!r} reads elements of plates {a!r} (site {reads[a][1]!r}, from {reads[a][2]!r}) and "
                f"{b!r} (site {reads[b][1]!r}, from {reads[b][2]!r}), and neither is gathered into the other: crossed "
                f"plates. The sum over the K^n sample combinations has no plated form for crossed plates, so "
                f"MPImportance cannot estimate this model: {_GUIDE_ROUTE}."
            )
        parent = candidates[0]
        index, who, _ = reads[parent]
        if bool((index >= sizes[parent]).any()):
            raise StructureError(
                f"site {who!r} reads positions up to {int(index.max())} of plate {parent!r}, which has "
                f"{sizes[parent]} elements in this call"
            )
        for other, (other_index, other_who, other_source) in reads.items():
            if other == parent:
                continue
            # the element of ``other`` reached through the parent must be the one read directly
            through = tree.compose(parent, other)[index.clamp(min=0)]
            bad = (index >= 0) & (other_index >= 0) & (through != other_index)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise StructureError(
                    f"element {i} of plate {plate!r} reads element {int(other_index[i])} of plate {other!r} (site "
                    f"{other_who!r}, from {other_source!r}) but belongs to element {int(index[i])} of plate "
                    f"{parent!r}, which belongs to element {int(through[i])} of {other!r}: a gathered element must "
                    f"read the {other!r} of the {parent!r} it is summed into (the state of a home must be the state "
                    "of its county)"
                )
            orphan = (index < 0) & (other_index >= 0)
            if bool(orphan.any()):
                i = int(orphan.nonzero()[0])
                raise StructureError(
                    f"element {i} of plate {plate!r} reads plate {other!r} but no element of plate {parent!r}; "
                    "MPImportance needs it to belong to an element of the plate it is summed into"
                )
        # elements that read nothing: their factors do not depend on the samples above, any element takes them
        maps[plate] = index.clamp(min=0)
        parents[plate] = parent

    for plate in list(edges):
        resolve(plate)
    return tree

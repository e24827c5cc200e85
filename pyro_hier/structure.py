"""What a model looks like: its latent and observed sites, its plates and how they nest, and who depends on whom.

Every guide and estimator of pyro-hier starts from :func:`inspect_model`, so that no class re-derives the
structure of the model. One prototype trace of the model (run twice, to catch structure that changes between calls)
is turned into a plain description, :class:`ModelStructure`:

- latent sites (:class:`LatentSite`): shape at the plates' *full* sizes, event dim, support, the shape and event dim
  of the site in unconstrained space ``u = biject_to(support)^{-1}(z)``, discrete or not, reparameterisable or not;
- observed sites (:class:`ObservedSite`) and their values;
- plates (:class:`PlateInfo`): dim, full size, subsample size and the model's *own* subsample indices when it gave
  them, the plate tree (plate ``P`` nests in ``Q`` when every site inside ``P`` is also inside ``Q``) and the crossed
  pairs (plates that share a site without either nesting in the other);
- for each latent site its plates, its parents in the model (:func:`pyro.infer.inspect.get_dependencies`) and its
  *plate ancestors*: the latent sites whose plates are a strict subset of its own. In a two-level model these are
  the globals; with nested plates they form the tree that the branch families of Agrawal & Domke (2021) follow;
- the *gathers* (:attr:`ModelStructure.gathers`, :class:`~pyro_hier.gathers.Gather`): for every site, which single
  element of which other plate each of its elements reads, when the model gathers group effects by an index in a
  flat plate (``a[..., county]`` in a plate of homes). A group's data are then the observations whose index points
  at it, and a gathered parent plays the part of an enclosing plate. Found by forward-mode differentiation of the
  prototype call (:func:`pyro_hier.gathers.trace_gathers`), computed on first use.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property

import pyro
import torch
from pyro import poutine
from pyro.distributions import constraints as pyro_constraints
from pyro.distributions.torch_distribution import TorchDistributionMixin
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample
from torch.distributions import biject_to, constraints

from pyro_hier.errors import StructureError
from pyro_hier.gathers import Gather, GatherTrace, trace_gathers
from pyro_hier.plates import PlateRecorder

__all__ = [
    "Gather",
    "LatentSite",
    "LevelLink",
    "ModelStructure",
    "ObservedSite",
    "PlateInfo",
    "PlateLevel",
    "inspect_model",
]


@dataclass(frozen=True)
class PlateInfo:
    """One vectorised plate of the model.

    :ivar name: plate name.
    :ivar dim: the (negative) batch dim the plate occupies, or ``None`` if no sample site lies in it.
    :ivar size: the full size ``N``.
    :ivar subsample_size: how many elements the prototype call used (``N`` when not subsampled).
    :ivar subsample: the model's own indices when it passed ``pyro.plate(..., subsample=idx)``, else ``None``.
    :ivar parent: the enclosing plate in the plate tree, or ``None`` at the top.
    """

    name: str
    dim: int | None
    size: int
    subsample_size: int
    subsample: torch.Tensor | None
    parent: str | None

    @property
    def subsampled(self) -> bool:
        return self.subsample_size < self.size


@dataclass(frozen=True)
class _Site:
    name: str
    fn: TorchDistributionMixin = field(repr=False)
    value: torch.Tensor = field(repr=False)
    plates: tuple[str, ...]
    plate_dims: tuple[int, ...]
    event_dim: int
    shape: torch.Size

    @property
    def batch_shape(self) -> torch.Size:
        """Batch shape at the plates' full sizes."""
        return self.shape[: len(self.shape) - self.event_dim]

    @property
    def event_shape(self) -> torch.Size:
        return self.shape[len(self.shape) - self.event_dim :]


@dataclass(frozen=True)
class ObservedSite(_Site):
    """An observed sample site: ``value`` is the observation of the prototype call (subsampled if the plate was);
    ``shape`` is its shape at the plates' full sizes."""


@dataclass(frozen=True)
class LatentSite(_Site):
    """A latent sample site.

    :ivar shape: value shape with every plate at its full size (batch shape + event shape).
    :ivar support: the distribution's support.
    :ivar discrete: ``True`` for a discrete support.
    :ivar reparameterized: ``True`` when the distribution has ``rsample``.
    :ivar enumerated: ``True`` when the model marks it ``infer={"enumerate": "parallel"}`` (or via
        ``config_enumerate``).
    :ivar unconstrained_shape: the shape of ``biject_to(support).inv(value)`` at full plate sizes (``None`` for
        discrete sites).
    :ivar unconstrained_event_dim: event dim in unconstrained space (``None`` for discrete sites).
    :ivar plate_ancestors: latent sites whose plates are a strict subset of this site's plates, in model order.
    """

    support: constraints.Constraint = field(repr=False, default=constraints.real)
    discrete: bool = False
    reparameterized: bool = True
    enumerated: bool = False
    unconstrained_shape: torch.Size | None = None
    unconstrained_event_dim: int | None = None
    plate_ancestors: tuple[str, ...] = ()

    @property
    def is_global(self) -> bool:
        return not self.plates

    @property
    def element_numel(self) -> int:
        """Size of the site's unconstrained value for *one* element of its plates: the product of the unconstrained
        shape over every dim that is not a plate (what a per-element conditional models jointly)."""
        if self.unconstrained_shape is None:
            raise StructureError(f"site '{self.name}' is discrete and has no unconstrained representation")
        n = 1
        batch_len = len(self.unconstrained_shape) - self.unconstrained_event_dim
        for pos, size in enumerate(self.unconstrained_shape):
            if pos - batch_len not in self.plate_dims:
                n *= size
        return n


@dataclass(frozen=True)
class LevelLink:
    """A level reads, along ``plate``, one element of an ancestor level through gathers (a *gathered ancestor*).

    In a flat formulation of an index chain (homes → counties → states, ``c ~ Normal(s[..., county_state], τ)``)
    the counties level reads the element ``county_state[i]`` of the states plate, as it would read its own state if
    counties were nested in states. Which element each of the level's elements reads is found per call by
    following the gathers of ``site`` (:meth:`ModelStructure.plate_route`; :class:`pyro_hier.gather_maps.GatherMaps`).

    :ivar ancestor: the ancestor level's name.
    :ivar plate: the ancestor's plate along which the element is selected (not a plate of the level).
    :ivar site: the level's site whose gathers give the element (the first in model order that reads it).
    """

    ancestor: str
    plate: str
    site: str


@dataclass(frozen=True)
class PlateLevel:
    """Latent sites that share one set of plates, seen as one vector per element of those plates.

    Guides that follow the plate structure model each level jointly: the element vector concatenates, for every
    site of the level, its unconstrained value at one plate element (``sites[k]`` occupies
    ``offsets[k]:offsets[k+1]``). A level's *ancestors* are the levels whose plates are a strict subset of its own,
    and the levels it reads through gathers (:class:`LevelLink`, with their own ancestors): the gathered and the
    nested formulations of one model have the same ancestors.

    :ivar name: ``"globals"`` for sites in no plate, else the plate names joined by ``"__"``.
    :ivar plates: the level's plates, outermost first.
    :ivar dims: the plates' dims.
    :ivar sites: the level's sites in model order.
    :ivar offsets: start of each site's block in the element vector, plus the total at the end.
    :ivar ancestors: names of the ancestor levels, in level order.
    :ivar batch_shape: full plate sizes at the plates' dims and 1 elsewhere (``()`` for globals).
    :ivar links: for every plate of a gathered ancestor that is not a plate of this level, how an element finds its
        element along it (``()`` in nested models).
    """

    name: str
    plates: tuple[str, ...]
    dims: tuple[int, ...]
    sites: tuple[str, ...]
    offsets: tuple[int, ...]
    ancestors: tuple[str, ...]
    batch_shape: torch.Size
    links: tuple[LevelLink, ...] = ()

    @property
    def numel(self) -> int:
        """Length of one element's vector."""
        return self.offsets[-1]

    @property
    def is_global(self) -> bool:
        return not self.plates

    def block(self, site: str) -> slice:
        """Where ``site`` sits in the element vector."""
        k = self.sites.index(site)
        return slice(self.offsets[k], self.offsets[k + 1])

    def links_to(self, ancestor: str) -> tuple[LevelLink, ...]:
        """The links to one ancestor level (``()`` when it is a nested ancestor, or a global one)."""
        return tuple(link for link in self.links if link.ancestor == ancestor)


class ModelStructure:
    """The plain description of a model returned by :func:`inspect_model`.

    :ivar latent: latent sites in the order the model samples them.
    :ivar observed: observed sites in model order.
    :ivar plates: the model's vectorised plates, outermost first.
    :ivar deterministic: names of ``pyro.deterministic`` sites.
    :ivar trace: the prototype :class:`~pyro.poutine.Trace` (values are those of the prototype call).
    """

    def __init__(
        self,
        model: Callable,
        args: tuple,
        kwargs: dict,
        trace: poutine.Trace,
        latent: dict[str, LatentSite],
        observed: dict[str, ObservedSite],
        plates: dict[str, PlateInfo],
        deterministic: tuple[str, ...],
    ) -> None:
        self.model = model
        self.args = args
        self.kwargs = kwargs
        self.trace = trace
        self.latent = latent
        self.observed = observed
        self.plates = plates
        self.deterministic = deterministic

    def __repr__(self) -> str:
        lines = ["ModelStructure("]
        for p in self.plates.values():
            sub = f", subsample {p.subsample_size}" if p.subsampled else ""
            lines.append(f"  plate {p.name!r}: dim {p.dim}, size {p.size}{sub}, parent {p.parent!r}")
        for s in self.latent.values():
            kind = "discrete" if s.discrete else "continuous"
            lines.append(
                f"  latent {s.name!r}: shape {tuple(s.shape)}, event_dim {s.event_dim}, {kind}, "
                f"plates {s.plates}, plate ancestors {s.plate_ancestors}"
            )
        for s in self.observed.values():
            lines.append(f"  observed {s.name!r}: shape {tuple(s.shape)}, plates {s.plates}")
        lines.append(")")
        return "\n".join(lines)

    # ---- plates -------------------------------------------------------------------------------------------------
    @property
    def max_plate_nesting(self) -> int:
        """The number of batch dims plates use (``max(-dim)``), as Pyro's ELBOs and ``Predictive`` need it."""
        dims = [-p.dim for p in self.plates.values() if p.dim is not None]
        return max(dims, default=0)

    @property
    def plate_children(self) -> dict[str | None, tuple[str, ...]]:
        """The plate tree: each plate's children, with ``None`` the root."""
        children: dict[str | None, list[str]] = {None: []}
        for name in self.plates:
            children.setdefault(name, [])
        for name, p in self.plates.items():
            children[p.parent].append(name)
        return {k: tuple(v) for k, v in children.items()}

    @cached_property
    def crossed_plates(self) -> tuple[frozenset[str], ...]:
        """Pairs of plates that share a site while neither nests in the other (e.g. students × lecturers)."""
        members = self._plate_members
        names = list(self.plates)
        pairs = []
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if members[a] & members[b] and not (members[a] <= members[b] or members[b] <= members[a]):
                    pairs.append(frozenset((a, b)))
        return tuple(pairs)

    @cached_property
    def _plate_members(self) -> dict[str, frozenset[str]]:
        sites = [*self.latent.values(), *self.observed.values()]
        return {p: frozenset(s.name for s in sites if p in s.plates) for p in self.plates}

    @property
    def subsampled_plates(self) -> tuple[str, ...]:
        return tuple(name for name, p in self.plates.items() if p.subsampled)

    # ---- sites --------------------------------------------------------------------------------------------------
    @cached_property
    def imputed(self) -> dict[str, str]:
        """Latent sites that impute the missing entries of an observation, each with the site the model samples in
        their place when it is called without the observations: ``{"y_unobserved": "y"}`` for Pyro's
        ``pyro.sample("y", fn, obs=y, obs_mask=mask)``, which splits ``y`` into an observed ``y_observed`` and a latent
        ``y_unobserved`` (masked to the missing entries) and records ``y`` as a deterministic site. Called with
        ``y=None`` (as ``Predictive`` does, the observations left out) the model samples ``y`` whole, from the same
        distribution, and ``y_unobserved`` is not there."""
        found = {}
        for name in self.latent:
            base, sep, tail = name.rpartition("_")
            if sep and tail == "unobserved" and f"{base}_observed" in self.observed and base in self.deterministic:
                found[name] = base
        return found

    @property
    def global_sites(self) -> tuple[str, ...]:
        """Latent sites in no plate."""
        return tuple(n for n, s in self.latent.items() if not s.plates)

    @property
    def local_sites(self) -> tuple[str, ...]:
        """Latent sites inside at least one plate."""
        return tuple(n for n, s in self.latent.items() if s.plates)

    def plate_dim(self, site: str, plate: str) -> int:
        """Position of ``plate`` in ``site``'s full value, counted from the right (includes the event dims)."""
        s = self.latent.get(site) or self.observed[site]
        dim = self.plates[plate].dim
        assert dim is not None
        return dim - s.event_dim

    @cached_property
    def dependencies(self) -> dict[str, dict]:
        """Pyro's :func:`~pyro.infer.inspect.get_dependencies` of the model (prior and posterior dependencies),
        computed once on first use with the prototype's arguments."""
        from pyro.infer.inspect import get_dependencies

        try:
            with poutine.block():  # hidden from the handlers of the call that inspects the model (a guide's trace)
                return get_dependencies(self.model, self.args, self.kwargs)
        except Exception as e:  # provenance tracking can fail on exotic tensor ops
            raise StructureError(
                f"could not trace the dependencies between sites of the model ({type(e).__name__}: {e}). "
                "Parents are needed only by guides that condition on them; the rest of the structure is available."
            ) from e

    @cached_property
    def parents(self) -> dict[str, tuple[str, ...]]:
        """Each latent and observed site's latent parents in the model (the sites its distribution depends on): Pyro's
        provenance tracking (:attr:`dependencies`) joined with the paths autograd finds (:func:`gradient_parents`).
        Provenance is lost where a distribution builds its parameters by writing into a fresh tensor (Pyro's
        ``OrderedLogistic`` fills its probabilities in place, so its observations had no parents and every guide
        took the cutpoints for unread); a path of gradients from a continuous site's value to another site's log
        density is a dependence whatever the ops."""
        prior = self.dependencies["prior_dependencies"]
        found = gradient_parents(self.model, self.args, self.kwargs)
        out = {}
        for name in [*self.latent, *self.observed]:
            deps = set(prior.get(name, {})) | found.get(name, set())
            out[name] = tuple(p for p in self.latent if p in deps and p != name)
        return out

    def descendants(self, sites: Iterable[str]) -> set[str]:
        """The latent and observed sites whose distributions depend on ``sites``, directly or through other sites
        (by :attr:`parents`), ``sites`` themselves excluded: the terms of the joint density a change of ``sites``
        reaches (the Markov blanket's children and everything below them).

        Example::

            structure = inspect_model(model, args, kwargs)
            structure.descendants(["county_effect"])     # {'log_radon'}: what the county effects' likelihood is"""
        start = set(sites)
        reached: set[str] = set()
        frontier = list(start)
        while frontier:
            x = frontier.pop()
            for site, parents in self.parents.items():
                if x in parents and site not in reached and site not in start:
                    reached.add(site)
                    frontier.append(site)
        return reached

    def plate_levels(self, sites: list[str] | tuple[str, ...] | None = None) -> tuple[PlateLevel, ...]:
        """Group continuous latent ``sites`` (default: all continuous, non-enumerated latents) by their plates.

        Levels come in an order where every level follows its ancestors (fewer plates first, then model order).

        :raises StructureError: for a discrete site, or a local site with a batch dim of size > 1 that is not a plate
            (a per-element vector must be an event: use ``.to_event(1)``).
        """
        if sites is None:
            sites = [n for n, s in self.latent.items() if not s.discrete and not s.enumerated]
        groups: dict[frozenset[str], list[str]] = {}
        for name in sites:
            site = self.latent[name]
            if site.discrete:
                raise StructureError(f"site '{name}' is discrete; plate levels hold continuous sites only")
            if site.plates:
                batch_len = len(site.unconstrained_shape) - site.unconstrained_event_dim
                for pos in range(batch_len):
                    dim = pos - batch_len
                    if dim not in site.plate_dims and site.unconstrained_shape[pos] != 1:
                        raise StructureError(
                            f"site '{name}' has a batch dim {dim} of size {site.unconstrained_shape[pos]} that is not "
                            "a plate. Declare per-element vectors as events (e.g. dist.Normal(loc, 1).to_event(1)) "
                            "or put that dim in a pyro.plate."
                        )
            groups.setdefault(frozenset(site.plates), []).append(name)
        order = {n: i for i, n in enumerate(self.latent)}
        plate_order = list(self.plates)
        keys = list(groups)
        names = {k: "__".join(sorted(k, key=plate_order.index)) or "globals" for k in keys}
        level_of = {n: k for k in keys for n in groups[k]}
        reads = self._level_reads(keys, groups, level_of)
        ancestors = {k: {a for a in keys if a < k} for k in keys}
        changed = True
        while changed:  # a gathered ancestor's own ancestors are ancestors too
            changed = False
            for k in keys:
                new = set(ancestors[k])
                for source, _ in reads[k].values():
                    new |= {source} | ancestors[source]
                if new != ancestors[k]:
                    ancestors[k], changed = new, True
        for k in keys:
            if k in ancestors[k]:
                raise StructureError(f"the levels of sites {groups[k]} read each other through gathers (a cycle)")
        effective = {k: set(k).union(*ancestors[k]) for k in keys}
        keys.sort(key=lambda k: (len(effective[k]), min(order[n] for n in groups[k])))
        levels = []
        for k in keys:
            plates = tuple(sorted(k, key=plate_order.index))
            dims = tuple(self.plates[p].dim for p in plates)
            members = tuple(groups[k])
            offsets = [0]
            for n in members:
                site = self.latent[n]
                numel = site.element_numel if plates else _prod(site.unconstrained_shape)
                offsets.append(offsets[-1] + numel)
            batch = [1] * max((-d for d in dims), default=0)
            for p, d in zip(plates, dims):
                batch[d] = self.plates[p].size
            links = []
            for a in sorted(ancestors[k], key=keys.index):
                for plate in sorted(a - k, key=plate_order.index):
                    site = next((n for n in members if plate in self.reachable_plates(n)), None)
                    if site is None:
                        raise StructureError(
                            f"internal error: level {names[k]!r} has ancestor {names[a]!r} but reads no element of "
                            f"its plate '{plate}'"
                        )
                    links.append(LevelLink(names[a], plate, site))
            levels.append(
                PlateLevel(
                    name=names[k],
                    plates=plates,
                    dims=dims,
                    sites=members,
                    offsets=tuple(offsets),
                    ancestors=tuple(names[a] for a in keys if a in ancestors[k]),
                    batch_shape=torch.Size(batch),
                    links=tuple(links),
                )
            )
        return tuple(levels)

    def _level_reads(self, keys, groups, level_of) -> dict[frozenset, dict[str, tuple[frozenset, str]]]:
        """For every level, ``{plate: (level read, reading site)}`` over the plates its sites read single elements of
        through gathers (from sites of the given levels only). The prototype's gathers are computed only when some
        level could read another: one of its plates is not among the later level's."""
        reads: dict[frozenset, dict[str, tuple[frozenset, str]]] = {k: {} for k in keys}
        if not any(a and not a <= k for a in keys for k in keys if a != k):
            return reads
        for k in keys:
            for name in groups[k]:
                try:
                    found = self.reads(name)
                except StructureError:  # reads several elements: no single ancestor element, no link
                    continue
                for plate, source in found.items():
                    if source in level_of and plate not in k:
                        reads[k].setdefault(plate, (level_of[source], name))
        return reads

    def reads(self, site: str) -> dict[str, str]:
        """``{plate: source}``: the plates of other latent sites whose single elements ``site`` reads through gathers
        (the first source in model order for each plate).

        :raises StructureError: if ``site`` reads a plated latent in a way no per-element map describes."""
        out: dict[str, str] = {}
        for g in self.gathers_of(site):
            out.setdefault(g.plate, g.source)
        return out

    def plate_reach(self, plate: str) -> frozenset[str]:
        """The plates the elements of ``plate`` belong to or read: the reachable plates
        (:meth:`reachable_plates`) of its latent sites together (of its observed sites when it holds no latent
        site). A plate reaching another's elements is *below* it, as a nested plate is (counties below states)."""
        latent = [n for n, site in self.latent.items() if plate in site.plates]
        names = latent or [n for n, site in self.observed.items() if plate in site.plates]
        out: set[str] = {plate}
        for name in names:
            out |= self.reachable_plates(name)
        return frozenset(out)

    def reachable_plates(self, site: str) -> frozenset[str]:
        """The plates whose elements each element of ``site`` belongs to or reads: its own plates, the plates it
        reads through gathers and, through the sites it reads, theirs (homes gathering counties that gather states
        reach both). For a nested model, the site's own plates. Sites whose reads no per-element map describes
        reach only their own plates."""
        site_info = self.latent.get(site) or self.observed[site]
        plates = set(site_info.plates)
        try:
            found = self.reads(site)
        except StructureError:
            return frozenset(plates)
        for plate, source in found.items():
            plates.add(plate)
            plates |= self.reachable_plates(source)
        return frozenset(plates)

    # ---- gathers -----------------------------------------------------------------------------------------------
    @cached_property
    def gather_trace(self) -> GatherTrace:
        """The :class:`~pyro_hier.gathers.GatherTrace` of the prototype call (latent values and plate indices
        replayed), computed once on first use."""
        values = {name: site.value for name, site in self.latent.items()}
        subsamples = {name: p.subsample for name, p in self.plates.items() if p.subsample is not None}
        for name, node in self.trace.nodes.items():
            if _is_subsample(node) and name not in subsamples:
                subsamples[name] = node["value"]
        return trace_gathers(self.model, self.args, self.kwargs, values=values, subsamples=subsamples)

    @property
    def gathers(self) -> dict[str, tuple[Gather, ...]]:
        """For every site whose elements read single elements of another plate of a latent site (a flat plate of
        observations gathering group effects, ``a[..., county]``; index chains; crossed plates), its
        :class:`~pyro_hier.gathers.Gather` s, with indices in the prototype call's positions.

        Sites nested in the plates they read (the element at their own position) have none. Example: radon written
        with a flat plate of homes gives ``{"log_radon": (Gather("log_radon", "county_effect", "counties",
        index=county),)}``.

        :raises StructureError: if some site reads a plated latent in a way no per-element map describes (several
            or all elements of a plate, as in ``a.sum()``; an index computed from a latent value); use
            :meth:`gathers_of` to ask about one site only.
        """
        found = self.gather_trace
        if found.problems:
            raise StructureError(next(iter(found.problems.values())))
        return dict(found.gathers)

    def gathers_of(self, site: str) -> tuple[Gather, ...]:
        """The :class:`~pyro_hier.gathers.Gather` s of one site (``()`` if it reads no other plate).

        :raises StructureError: if that site reads a plated latent in a way no per-element map describes."""
        if site not in self.latent and site not in self.observed:
            raise KeyError(f"'{site}' is not a sample site of the model")
        found = self.gather_trace
        if site in found.problems:
            raise StructureError(found.problems[site])
        return found.gathers.get(site, ())

    def validate_trace(self, trace: poutine.Trace) -> None:
        """Raise a :class:`StructureError` if ``trace`` (of a later call) has different latent sites or puts a site
        in different plates than the prototype. Guides call this when validation is enabled."""
        seen = {}
        for name, site in trace.nodes.items():
            if _is_latent(site):
                seen[name] = _site_plates(site)
        _compare_structures({n: s.plates for n, s in self.latent.items()}, seen, "the prototype call", "this call")


# ---- building the description -----------------------------------------------------------------------------------
def _is_subsample(site: dict) -> bool:
    return site["type"] == "sample" and isinstance(site["fn"], _Subsample)


def _is_deterministic(site: dict) -> bool:
    return site["type"] == "sample" and site["infer"].get("_deterministic", False)


def _is_latent(site: dict) -> bool:
    return site["type"] == "sample" and not site["is_observed"] and not _is_subsample(site)


def _is_observed(site: dict) -> bool:
    return site["type"] == "sample" and site["is_observed"] and not _is_deterministic(site)


def _site_plates(site: dict) -> tuple[str, ...]:
    """The names of a site's plates, outermost first, after checking they are all vectorised."""
    for frame in site["cond_indep_stack"]:
        if not frame.vectorized:
            raise StructureError(
                f"site '{site['name']}' is inside the sequential plate '{frame.name}' (a Python loop "
                f"`for i in pyro.plate(...)`). pyro-hier needs vectorised plates: write "
                f"`with pyro.plate('{frame.name}', size) as idx:` and index the data with idx."
            )
    if "_markov_scope" in site["infer"]:
        raise StructureError(
            f"site '{site['name']}' is inside pyro.markov: pyro-hier guides do not model Markov chains. Use a "
            "guide for state-space models (e.g. AutoNormal with TraceEnum_ELBO) or unroll the chain into a plate."
        )
    return tuple(f.name for f in site["cond_indep_stack"] if f.name is not None)


def _compare_structures(
    first: dict[str, tuple[str, ...]], second: dict[str, tuple[str, ...]], first_label: str, second_label: str
) -> None:
    for name in first.keys() | second.keys():
        if name not in second:
            raise StructureError(
                f"latent site '{name}' appears in {first_label} but not in {second_label}. pyro-hier guides need "
                "the same latent sites on every call: sample the site unconditionally (mask it with poutine.mask "
                "if it should not count)."
            )
        if name not in first:
            raise StructureError(
                f"latent site '{name}' appears in {second_label} but not in {first_label}. pyro-hier guides need "
                "the same latent sites on every call: sample the site unconditionally."
            )
        if set(first[name]) != set(second[name]):
            raise StructureError(
                f"latent site '{name}' is in plates {first[name]} in {first_label} but in {second[name]} in "
                f"{second_label}. pyro-hier guides need a site to stay in the same plates on every call: open "
                "its plates unconditionally."
            )


def _trace_once(model: Callable, args: tuple, kwargs: dict) -> tuple[poutine.Trace, PlateRecorder]:
    recorder = PlateRecorder()
    with poutine.block():  # (the model's own ``pyro.param``s left out of the trace, as Pyro's autoguides leave them)
        trace = poutine.trace(poutine.block(recorder(model), hide_types=["param"])).get_trace(*args, **kwargs)
    return trace, recorder


def inspect_model(
    model: Callable, args: tuple = (), kwargs: dict | None = None, *, num_calls: int = 2
) -> ModelStructure:
    """Describe a Pyro model: sites, plates, the plate tree, parents and plate ancestors.

    The model is traced ``num_calls`` times with the same arguments, hidden from outer handlers; a site that
    appears in some calls only, or in different plates between calls, raises a :class:`StructureError`.

    :param model: a Pyro model.
    :param args: positional arguments of the model.
    :param kwargs: keyword arguments of the model.
    :param num_calls: how many prototype calls to compare (1 skips the consistency check).
    :raises StructureError: for sequential plates, ``pyro.markov``, or structure that changes between calls.

    Example::

        def model(x, y, subsample=None):
            theta = pyro.sample("theta", dist.Normal(0, 1))
            with pyro.plate("groups", len(y), subsample=subsample, dim=-1) as i:
                z = pyro.sample("z", dist.Normal(theta, 1))
                pyro.sample("y", dist.Normal(z * x[i], 1), obs=y[i])

        s = inspect_model(model, (x, y), {"subsample": torch.tensor([0, 3])})
        s.plates["groups"].size            # the full size, len(y)
        s.plates["groups"].subsample       # tensor([0, 3])
        s.latent["z"].plate_ancestors      # ("theta",)
    """
    kwargs = {} if kwargs is None else kwargs
    if num_calls < 1:
        raise ValueError(f"num_calls must be at least 1, got {num_calls}")
    trace, recorder = _trace_once(model, args, kwargs)
    first = {n: _site_plates(s) for n, s in trace.nodes.items() if _is_latent(s)}
    for _ in range(num_calls - 1):
        other, _ = _trace_once(model, args, kwargs)
        _compare_structures(
            first, {n: _site_plates(s) for n, s in other.nodes.items() if _is_latent(s)}, "one call", "another call"
        )

    sites = [s for s in trace.nodes.values() if _is_latent(s) or _is_observed(s)]
    frames = {}
    stack_order: dict[str, int] = {}
    for site in sites:
        _site_plates(site)
        for pos, frame in enumerate(site["cond_indep_stack"]):
            frames.setdefault(frame.name, frame)
            stack_order[frame.name] = min(stack_order.get(frame.name, pos), pos)
            if frames[frame.name].dim != frame.dim:
                raise StructureError(f"plate '{frame.name}' is used at dims {frames[frame.name].dim} and {frame.dim}")

    plates = _describe_plates(sites, frames, stack_order, recorder)

    site_plates = {s["name"]: tuple(sorted(_site_plates(s), key=stack_order.__getitem__)) for s in sites}
    latent_plates = {s["name"]: set(site_plates[s["name"]]) for s in sites if _is_latent(s)}
    latent: dict[str, LatentSite] = {}
    observed: dict[str, ObservedSite] = {}
    for site in sites:
        name = site["name"]
        names = site_plates[name]
        common = dict(
            name=name,
            fn=site["fn"],
            value=site["value"],
            plates=names,
            plate_dims=tuple(plates[p].dim for p in names),
            event_dim=site["fn"].event_dim,
            shape=_full_shape(site["value"].shape, site["fn"].event_dim, names, plates),
        )
        if _is_latent(site):
            ancestors = tuple(a for a, ps in latent_plates.items() if ps < latent_plates[name])
            latent[name] = _describe_latent(site, common, ancestors)
        else:
            observed[name] = ObservedSite(**common)

    deterministic = tuple(n for n, s in trace.nodes.items() if _is_deterministic(s))
    return ModelStructure(model, args, kwargs, trace, latent, observed, plates, deterministic)


def _describe_plates(sites, frames, stack_order, recorder: PlateRecorder) -> dict[str, PlateInfo]:
    members = {
        name: {s["name"] for s in sites if any(f.name == name for f in s["cond_indep_stack"])} for name in frames
    }
    names = sorted(frames, key=lambda n: (stack_order[n], -frames[n].dim))
    # plates opened by the model but holding no sample site: known from the recorder only
    names += [n for n in recorder.calls if n not in frames]

    def parent_of(name: str) -> str | None:
        if name not in frames:
            return None
        candidates = [
            q
            for q in frames
            if q != name
            and members[name] <= members[q]
            and (members[name] < members[q] or stack_order[q] < stack_order[name])
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda q: (len(members[q]), -stack_order[q]))

    plates = {}
    for name in names:
        call = recorder.calls.get(name)
        frame = frames.get(name)
        if call is not None:
            size, sub_size = call.size, call.subsample_size
            subsample = call.indices if call.user_indices else None
        else:  # a plate created without a size (pyro.plate(name, dim=...)): sizes come from the frame
            size = frame.full_size if frame.full_size is not None else frame.size
            sub_size, subsample = frame.size, None
        plates[name] = PlateInfo(
            name=name,
            dim=None if frame is None else frame.dim,
            size=int(size),
            subsample_size=int(sub_size),
            subsample=subsample,
            parent=parent_of(name),
        )
    return plates


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _full_shape(shape: torch.Size, event_dim: int, plate_names, plates: dict[str, PlateInfo]) -> torch.Size:
    """Replace each plate's (possibly subsampled) size in ``shape`` by the plate's full size."""
    full = list(shape)
    for name in plate_names:
        p = plates[name]
        pos = len(shape) - event_dim + p.dim
        if 0 <= pos < len(full) and full[pos] == p.subsample_size:
            full[pos] = p.size
    return torch.Size(full)


def _describe_latent(site: dict, common: dict, plate_ancestors: tuple[str, ...]) -> LatentSite:
    fn = site["fn"]
    support = fn.support
    shape = common["shape"]
    discrete = bool(support.is_discrete)
    u_shape = u_event_dim = None
    if not discrete:
        if isinstance(support, type(pyro_constraints.sphere)):
            raise StructureError(
                f"site '{site['name']}' is sphere-valued ({type(fn).__name__}): it has no unconstrained space to "
                "approximate in. Reparameterise it, as for AutoNormal: "
                f"poutine.reparam(model, config={{'{site['name']}': pyro.infer.reparam.ProjectedNormalReparam()}}) "
                "for a ProjectedNormal."
            )
        try:
            transform = biject_to(support)
        except NotImplementedError as e:
            raise StructureError(
                f"site '{site['name']}' has support {support}, which has no bijection to unconstrained space "
                "(torch.distributions.biject_to). Reparameterise the site with a supported distribution."
            ) from e
        u_shape = transform.inv.forward_shape(shape)
        u_event_dim = fn.event_dim + len(u_shape) - len(shape)
    return LatentSite(
        **common,
        support=support,
        discrete=discrete,
        reparameterized=bool(getattr(fn, "has_rsample", False)),
        enumerated=site["infer"].get("enumerate") == "parallel",
        unconstrained_shape=u_shape,
        unconstrained_event_dim=u_event_dim,
        plate_ancestors=plate_ancestors,
    )


class _LeafValues(Messenger):
    """Replaces every continuous latent sample's value by a detached copy that requires grad, kept in ``leaves``: the
    leaves whose paths to other sites' log densities :func:`gradient_parents` looks for. (Kept here, not read from
    a trace: the trace records its copy of the site before this handler's post-processing.)"""

    def __init__(self) -> None:
        super().__init__()
        self.leaves: dict[str, torch.Tensor] = {}

    def _pyro_post_sample(self, msg: dict) -> None:
        value = msg["value"]
        if not msg["is_observed"] and isinstance(value, torch.Tensor) and value.is_floating_point():
            msg["value"] = self.leaves[msg["name"]] = value.detach().requires_grad_()


def gradient_parents(model: Callable, args: tuple = (), kwargs: dict | None = None) -> dict[str, set[str]]:
    r"""The continuous latent sites each sample site's log density depends on directly, by autograd: one run of the
    model with every continuous latent value a fresh leaf :math:`z_u` (so paths through other sites' values are cut),
    then for each site :math:`d` the sites :math:`u` with a path from :math:`z_u` to
    :math:`\log p(z_d \mid \cdot)` (:func:`torch.autograd.grad` with ``allow_unused``: a structural test, not a value
    test). Complements :func:`pyro.infer.inspect.get_dependencies`, whose provenance tracking is lost by in-place
    writes into fresh tensors; discrete parents are left to it.

    Example::

        def model(x, y):
            c = pyro.sample("c", dist.TransformedDistribution(dist.Normal(torch.zeros(2), 1.0).to_event(1),
                                                              [OrderedTransform()]))
            with pyro.plate("n", len(x)):
                pyro.sample("y", dist.OrderedLogistic(x, c), obs=y)

        gradient_parents(model, (x, y))["y"]      # {'c'} (provenance: none)

    Reference: the dependencies are those of Pyro's ``get_dependencies`` (after Webb et al. 2018, *Faithful inversion
    of generative models for effective amortized inference*), found by another route.
    """
    kwargs = {} if kwargs is None else kwargs
    leaves = _LeafValues()
    with torch.random.fork_rng(), torch.enable_grad(), poutine.block(), pyro.validation_enabled(False):
        try:
            trace = poutine.trace(leaves(model)).get_trace(*args, **kwargs)
        except RuntimeError as e:  # (a model writing into a site's value in place cannot run on leaves)
            warnings.warn(
                f"the model could not be run with its latent values as autograd leaves ({e}); the sites' parents come "
                "from Pyro's provenance tracking alone, which misses distributions that build their parameters in "
                "place (OrderedLogistic)",
                stacklevel=2,
            )
            return {}
        sites = [m for m in trace.nodes.values() if m["type"] == "sample" and not isinstance(m["fn"], _Subsample)]
        found: dict[str, set[str]] = {}
        for i, down in enumerate(sites):
            ups = [u["name"] for u in sites[:i] if u["name"] in leaves.leaves]
            if not ups:
                continue
            log_prob = down["fn"].log_prob(leaves.leaves.get(down["name"], down["value"]))
            if not log_prob.requires_grad:
                found[down["name"]] = set()
                continue
            try:
                grads = torch.autograd.grad(
                    log_prob.sum(), [leaves.leaves[u] for u in ups], retain_graph=True, allow_unused=True
                )
            except RuntimeError:  # (an op without a derivative: this site's parents are provenance's alone)
                continue
            found[down["name"]] = {u for u, g in zip(ups, grads, strict=True) if g is not None}
    return found

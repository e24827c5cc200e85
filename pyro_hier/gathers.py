r"""Which elements of other plates each site reads: the *gathers* of a model, found from the model as written.

Most hierarchical models are written with a flat plate of observations that gathers group effects by an index::

    with pyro.plate("counties", J):
        a = pyro.sample("a", dist.Normal(mu, sigma))
    with pyro.plate("homes", len(county)):
        pyro.sample("y", dist.Normal(a[..., county] + w * x, s), obs=y)

Element ``i`` of ``"homes"`` reads element ``county[i]`` of ``"counties"``. Nothing in Pyro's trace says so: the
site ``y`` only lists its own plate. :func:`trace_gathers` finds it by forward-mode differentiation of one replayed
call of the model. The values of every latent site are held fixed and one plated latent site ``z`` (the *source*)
gets a tangent; the tangent that then reaches each other site's distribution parameters,

.. math::

    \dot\theta_i \;=\; \sum_{j} \frac{\partial \theta_i}{\partial z_j}\, t_j ,

is a weighted sum over the elements ``j`` of ``z`` that element ``i`` depends on. With tangents
:math:`t_j = v_j` and :math:`t_j = v_j\,(b_k(j) + 1)` (:math:`b_k(j)` the ``k``-th base-``B`` digit of the flat
position ``j``, :math:`v_j` random), the ratio of the two is :math:`b_k(j) + 1` exactly when element ``i`` depends on
the single element ``j``, whatever the chain of operations between them (``z[idx]``, ``z[..., idx]``,
``Vindex(z)[..., idx]``, ``torch.index_select``, ``torch.gather``, arithmetic, index chains). A third run with
independent random tangents :math:`w_j` checks the answer: if :math:`\dot\theta_i` under ``w`` is not
:math:`w_{j(i)} / v_{j(i)}` times its value under ``v``, element ``i`` depends on several elements (a sum over the
plate, ``z[i] + z[k]``) and the site is reported as a problem rather than given a wrong map. Parameters of several
coordinates (events, several parameters) are combined with random weights, so that no cancellation can hide a
dependency. The digits are taken in a base small enough that the ratio is exact to rounding in the model's dtype
(64 for float32, 2²⁰ for float64), so a float32 model with a million groups needs four digit runs.

A second check, on one run with Pyro's provenance tracking, finds indices *computed from latent values*
(``locs[assignment]`` with a latent ``assignment``): the elements read then change from sample to sample and no fixed
map exists; such reads are reported as problems too.

Problems are attached to the reading site and raised only by consumers that need that site's map
(:meth:`pyro_hier.structure.ModelStructure.gathers_of`), so a model whose observations read a whole plate can still
be fitted by a guide that does not need to know.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.autograd.forward_ad as fwAD
from pyro import poutine
from pyro.ops.provenance import ProvenanceTensor, detach_provenance, get_provenance
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample
from torch.overrides import TorchFunctionMode

from pyro_hier.errors import StructureError

__all__ = ["Gather", "GatherTrace", "keep_random_state", "trace_gathers"]


@dataclass(frozen=True)
class Gather:
    """Site ``site`` reads, at each of its elements, one element of plate ``plate`` of the latent site ``source``.

    :ivar site: the reading site (latent or observed).
    :ivar source: the latent site whose elements are read.
    :ivar plate: the plate of ``source`` along which the element is selected.
    :ivar index: ``LongTensor`` shaped like ``site``'s batch shape in the traced call (dims that are not plates of
        ``site`` have size 1): the *position*, within ``plate`` as the call opened it (its subsample when
        subsampled), of the element read; ``-1`` where the element reads none.
    """

    site: str
    source: str
    plate: str
    index: torch.Tensor = field(repr=False)

    def full_index(self, subsample: torch.Tensor | None) -> torch.Tensor:
        """The index in the plate's full numbering, given the call's subsample indices of ``plate`` (``None`` when
        the plate was not subsampled). ``-1`` stays ``-1``."""
        if subsample is None:
            return self.index
        subsample = subsample.to(self.index.device)
        full = subsample[self.index.clamp(min=0)]
        return torch.where(self.index >= 0, full, self.index)


@dataclass
class GatherTrace:
    """What :func:`trace_gathers` found in one call of the model.

    :ivar gathers: ``{reading site: (Gather, ...)}`` for every site whose elements read single elements of another
        plate (or other elements of their own plate) of a latent site.
    :ivar problems: ``{reading site: message}`` for sites that read a plated latent in a way no per-element map
        describes (several or all elements of a plate; an index computed from a latent value).
    :ivar subsamples: the indices each plate used in the call (``{plate: LongTensor}``).
    :ivar sites: ``{site: (batch shape, plate names → dims)}`` of every site seen in the call.
    """

    gathers: dict[str, tuple[Gather, ...]]
    problems: dict[str, str]
    subsamples: dict[str, torch.Tensor]
    sites: dict[str, tuple[torch.Size, dict[str, int]]]


# ---- the replayed call ------------------------------------------------------------------------------------------
def _frames(msg) -> dict[str, int]:
    return {f.name: f.dim for f in msg["cond_indep_stack"] if f.vectorized and f.dim is not None}


def _is_subsample(msg) -> bool:
    return isinstance(msg["fn"], _Subsample)


def _is_latent(msg) -> bool:
    return not msg["is_observed"] and not _is_subsample(msg)


class _Replay(Messenger):
    """Records latent values and plate subsamples on the first call and replays them afterwards; gives the latent
    site ``source`` the forward-mode tangent ``tangent(value)`` and keeps every sample site's distribution."""

    def __init__(
        self,
        values: dict[str, torch.Tensor],
        subsamples: dict[str, torch.Tensor],
        source: str | None = None,
        tangent: Callable[[torch.Tensor], torch.Tensor] | None = None,
        wrap: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.values, self.subsamples = values, subsamples
        self.source, self.tangent, self.wrap = source, tangent, wrap
        self.fns: dict[str, object] = {}
        self.frames: dict[str, dict[str, int]] = {}
        self.kinds: dict[str, str] = {}

    def _pyro_sample(self, msg) -> None:
        name = msg["name"]
        if _is_subsample(msg):
            if msg["value"] is None and name in self.subsamples:
                msg["value"], msg["done"] = self.subsamples[name], True
            return
        if _is_latent(msg) and name in self.values:
            msg["value"], msg["done"] = self.values[name], True

    def _pyro_post_sample(self, msg) -> None:
        name = msg["name"]
        if _is_subsample(msg):
            self.subsamples.setdefault(name, detach_provenance(torch.as_tensor(msg["value"])))
            return
        if _is_latent(msg):
            value = detach_provenance(msg["value"]).detach()
            self.values.setdefault(name, value)
            if name == self.source:
                value = value.contiguous()
                msg["value"] = fwAD.make_dual(value, self.tangent(value))
            elif self.wrap is not None:
                msg["value"] = self.wrap(name, value)
        if msg["infer"].get("_deterministic"):
            return
        self.fns[name] = msg["fn"]
        self.frames[name] = _frames(msg)
        self.kinds[name] = "latent" if _is_latent(msg) else "observed"


@contextmanager
def _quiet_jit():
    """Torch compiles its forward-AD decompositions with ``torch.jit.script`` on first use, which warns."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=DeprecationWarning)
        yield


def _run(model: Callable, args: tuple, kwargs: dict, replay: _Replay) -> None:
    with poutine.block(), replay:
        model(*args, **kwargs)


# ---- tangents of a distribution's parameters --------------------------------------------------------------------
def _tangents(obj, out: list[torch.Tensor], depth: int = 0) -> None:
    """Collect the forward-mode tangents of every tensor held by a distribution (parameters, base distributions,
    transforms, masks)."""
    if depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            tangent = fwAD.unpack_dual(obj).tangent
            if tangent is not None:
                out.append(tangent)
        return
    if isinstance(obj, list | tuple):
        for item in obj:
            _tangents(item, out, depth + 1)
        return
    if isinstance(obj, torch.distributions.Distribution | torch.distributions.Transform):
        for value in vars(obj).values():
            _tangents(value, out, depth + 1)


def _projected_tangent(fn, seed: int) -> torch.Tensor | None:
    """The tangents of ``fn``'s parameters combined into one number per element of its batch shape (float64), with
    random positive weights (the same for a given ``seed``) on every other coordinate; ``None`` when no parameter
    carries a tangent."""
    generator = torch.Generator().manual_seed(seed)
    parts: list[torch.Tensor] = []
    _tangents(fn, parts)
    if not parts:
        return None
    batch = tuple(fn.batch_shape)
    total = torch.zeros(batch, dtype=torch.float64, device=parts[0].device)
    for t in parts:
        t = t.detach().to(torch.float64)
        if t.dim() < len(batch):
            t = t.reshape((1,) * (len(batch) - t.dim()) + tuple(t.shape))
        head = tuple(t.shape[: len(batch)])
        try:
            torch.broadcast_shapes(head, batch)
        except RuntimeError:
            return torch.full(batch, math.nan, dtype=torch.float64, device=total.device)
        extra = t.shape[len(batch) :]
        if extra:
            weight = 1.0 + torch.rand(extra, generator=generator, dtype=torch.float64).to(t.device)
            t = (t * weight).reshape((*head, -1)).sum(-1)
        scale = 1.0 + float(torch.rand((), generator=generator, dtype=torch.float64))
        total = total + scale * t
    return total


# ---- indices computed from latent values ------------------------------------------------------------------------
_INDEX_FUNCTIONS = {
    torch.Tensor.__getitem__: "indexing",
    torch.Tensor.__setitem__: "indexing",
    torch.index_select: "index_select",
    torch.Tensor.index_select: "index_select",
    torch.gather: "gather",
    torch.Tensor.gather: "gather",
    torch.take_along_dim: "take_along_dim",
    torch.Tensor.take_along_dim: "take_along_dim",
    torch.take: "take",
    torch.Tensor.take: "take",
    torch.nn.functional.embedding: "embedding",
}


def _provenance_of(obj) -> frozenset:
    if isinstance(obj, torch.Tensor):
        return frozenset(s for s in get_provenance(obj) if isinstance(s, str))
    if isinstance(obj, list | tuple):
        return frozenset().union(*(_provenance_of(o) for o in obj)) if obj else frozenset()
    return frozenset()


class _LatentIndexWatch(TorchFunctionMode):
    """Records ``(sites read, sites the index is computed from)`` for every gather whose index carries the
    provenance of a latent site."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[frozenset, frozenset, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _INDEX_FUNCTIONS.get(func)
        if kind is not None:
            if kind == "embedding":
                data, index = (
                    _provenance_of(args[1] if len(args) > 1 else kwargs.get("weight")),
                    _provenance_of(args[0]),
                )
            else:
                data = _provenance_of(args[0]) if args else frozenset()
                index = _provenance_of([*args[1:], *kwargs.values()])
            if index:
                self.found.append((data, index, kind))
        return func(*args, **kwargs)


def _latent_indices(model: Callable, args: tuple, kwargs: dict, values: dict, subsamples: dict) -> list:
    def wrap(name: str, value: torch.Tensor) -> torch.Tensor:
        return ProvenanceTensor(value, frozenset([name]))

    replay = _Replay(values, subsamples, wrap=wrap)
    watch = _LatentIndexWatch()
    try:
        with torch.no_grad(), watch:
            _run(model, args, kwargs, replay)
    except Exception:  # provenance tracking does not survive every tensor operation; nothing is known then
        return []
    return watch.found


# ---- decoding -----------------------------------------------------------------------------------------------------
def _digit_base(dtype: torch.dtype) -> int:
    return 2**20 if dtype == torch.float64 else 64


def _uniform(shape, generator: torch.Generator) -> torch.Tensor:
    return 1.0 + torch.rand(shape, generator=generator, dtype=torch.float64)


@contextmanager
def keep_random_state():
    """Run model calls that only inspect the model without moving the caller's random state (an init strategy
    such as ``init_to_feasible`` draws from the prior), so that a guide draws the same numbers whatever its data
    layout costs in inspection runs."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield


def trace_gathers(
    model: Callable,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    sources: Iterable[str] | None = None,
    readers: Iterable[str] | None = None,
    values: dict[str, torch.Tensor] | None = None,
    subsamples: dict[str, torch.Tensor] | None = None,
    verify: bool = True,
    check_latent_indices: bool = True,
    seed: int = 0,
) -> GatherTrace:
    """Find which element(s) of which other plates every site of one call of ``model`` reads.

    The model runs hidden from every outer handler, ``2 + digits`` times per plated continuous latent site (one more
    with ``verify``, one more for ``check_latent_indices``), and the caller's random state is left as it was. Latent
    values and plate subsamples are recorded on the first run (or taken from ``values`` / ``subsamples``) and replayed
    in the others, so the call is deterministic.

    :param model: a Pyro model.
    :param args: positional arguments of the call.
    :param kwargs: keyword arguments of the call.
    :param sources: the plated latent sites whose elements may be read (default: every continuous latent site in a
        plate).
    :param readers: the sites whose reads are wanted (default: every sample site).
    :param values: latent values to replay (e.g. those of a prototype trace).
    :param subsamples: plate indices to replay.
    :param verify: check with independent random tangents that each element reads one element only (sites that do
        not are reported in ``problems``); without it, maps are trusted (use it once per model, then skip).
    :param check_latent_indices: look for indices computed from latent values (one run with provenance tracking).
    :param seed: seed of the random tangents (the caller's random state is not touched).
    :returns: a :class:`GatherTrace`.

    Example::

        found = trace_gathers(model, (county, x, y))
        found.gathers["y"][0].index      # county, for y[i] ~ Normal(a[..., county[i]] + ..., s)
    """
    with keep_random_state():
        return _trace_gathers(
            model, args, kwargs, sources, readers, values, subsamples, verify, check_latent_indices, seed
        )


def _trace_gathers(model, args, kwargs, sources, readers, values, subsamples, verify, check_latent_indices, seed):
    kwargs = {} if kwargs is None else kwargs
    values = {} if values is None else dict(values)
    subsamples = {} if subsamples is None else dict(subsamples)
    generator = torch.Generator().manual_seed(seed)

    first = _Replay(values, subsamples)
    with torch.no_grad():
        _run(model, args, kwargs, first)
    frames, kinds, fns = first.frames, first.kinds, first.fns
    wanted = set(fns) if readers is None else set(readers)
    plated = [
        n
        for n, k in kinds.items()
        if k == "latent" and frames[n] and values[n].is_floating_point() and not fns[n].support.is_discrete
    ]
    sources = plated if sources is None else [s for s in sources if s in plated]

    gathers: dict[str, list[Gather]] = {}
    problems: dict[str, str] = {}
    for source in sources:
        value = values[source]
        event_dim = fns[source].event_dim
        batch = value.shape[: value.dim() - event_dim]
        numel = math.prod(batch)
        base = _digit_base(value.dtype)
        num_digits = max(1, math.ceil(math.log(max(numel, 2)) / math.log(base)))
        v = _uniform(numel, generator)
        r = _uniform(value.shape[value.dim() - event_dim :], generator)
        position = torch.arange(numel, dtype=torch.float64)
        runs = {"base": v} | {
            k: v * (torch.div(position, base**k, rounding_mode="floor") % base + 1) for k in range(num_digits)
        }
        w = _uniform(numel, generator) if verify else None
        if verify:
            runs["verify"] = w
        projected: dict[object, dict[str, torch.Tensor | None]] = {}
        for key, flat in runs.items():
            tangent_values = (flat.reshape(batch + (1,) * event_dim) * r).to(dtype=value.dtype, device=value.device)

            def tangent(_, t=tangent_values):
                return t

            replay = _Replay(values, subsamples, source=source, tangent=tangent)
            try:
                with torch.no_grad(), _quiet_jit(), fwAD.dual_level():
                    _run(model, args, kwargs, replay)
                    projected[key] = {
                        name: _projected_tangent(fn, seed + zlib.crc32(name.encode()))
                        for name, fn in replay.fns.items()
                        if name in wanted
                    }
            except RuntimeError as e:
                if "forward" in str(e).lower() or "dual" in str(e).lower():
                    raise StructureError(
                        f"could not trace which elements of site '{source}' other sites read: an operation of the "
                        f"model has no forward-mode derivative ({e}). Write the model with differentiable torch "
                        "operations between the latent site and the sites that use it."
                    ) from e
                raise
        for reader, s_base in projected["base"].items():
            if reader == source or s_base is None:
                continue
            found = _decode(reader, source, frames, s_base, projected, num_digits, base, numel, batch, v, w, value)
            if isinstance(found, str):
                problems.setdefault(reader, found)
            else:
                gathers.setdefault(reader, []).extend(found)

    if check_latent_indices and any(gathers.values()):
        for data, index, kind in _latent_indices(model, args, kwargs, values, subsamples):
            for reader, found in gathers.items():
                read = {g.source for g in found} & data
                latent = sorted(index - read)
                if read and latent and reader not in problems:
                    problems[reader] = (
                        f"site '{reader}' reads elements of {sorted(read)} selected by an index computed from the "
                        f"latent site(s) {latent} ({kind}): which elements are read changes with the value of "
                        f"{latent}, so no fixed map from '{reader}' to the elements it reads exists (as in a mixture "
                        "model, locs[assignment]). Enumerate or marginalise that latent in the model, or use a "
                        "method that does not need the map."
                    )
    sites = {n: (fns[n].batch_shape, frames[n]) for n in fns}
    return GatherTrace(
        {k: tuple(v) for k, v in gathers.items() if v and k not in problems}, problems, subsamples, sites
    )


def _decode(reader, source, frames, s_base, projected, num_digits, base, numel, batch, v, w, value):
    """The gathers of ``reader`` from ``source`` (a list, possibly empty), or a problem message."""
    reader_plates, source_plates = frames[reader], frames[source]
    if torch.isnan(s_base).any():
        return (
            f"site '{reader}' depends on '{source}' through a distribution whose parameters do not line up with its "
            "batch shape, so which elements it reads cannot be told"
        )
    nz = s_base != 0
    if not bool(nz.any()):
        return []
    several = (
        f"site '{reader}' depends on several elements of plate(s) {sorted(source_plates)} of site '{source}' at once "
        "(e.g. a sum over the plate, or z[i] + z[k]); per-element methods need each of its elements to read one "
        "element of another plate. Move the reduction into a site of its own, or use a guide that does not need "
        "the map."
    )
    if not reader_plates:
        return (
            f"site '{reader}' is in no plate but depends on the elements of plate(s) {sorted(source_plates)} of site "
            f"'{source}' (e.g. a sum over the plate): a site outside a plate cannot depend on the plate's elements "
            "in a per-element method. Move it inside the plate, or use a guide that does not need the map."
        )
    flat = torch.zeros(s_base.shape, dtype=torch.long, device=s_base.device)
    denominator = torch.where(nz, s_base, torch.ones_like(s_base))
    for k in range(num_digits):
        ratio = projected[k][reader] / denominator
        digit = ratio.round()
        bad = nz & (((ratio - digit).abs() > 0.25) | (digit < 1) | (digit > base))
        if bool(bad.any()):
            return several
        flat = flat + torch.where(nz, digit.long() - 1, 0) * base**k
    if bool((flat[nz] >= numel).any()):
        return several
    if w is not None:
        vj = v.to(s_base.device)[flat]
        wj = w.to(s_base.device)[flat]
        expected = s_base * wj / vj
        got = projected["verify"][reader]
        tol = 1e-9 if value.dtype == torch.float64 else 1e-4
        if bool((nz & ((got - expected).abs() > tol * (got.abs() + expected.abs()))).any()):
            return several
    flat = torch.where(nz, flat, -1)
    positions = _unravel(flat, batch)
    out = []
    nb = len(s_base.shape)
    for plate, dim in source_plates.items():
        pos = positions[len(batch) + dim]
        if plate in reader_plates and reader_plates[plate] == dim and -dim <= nb:
            own = torch.arange(s_base.shape[dim], device=pos.device).reshape((-1,) + (1,) * (-dim - 1))
            if bool(((pos == own) | ~nz).all()):
                continue  # nested: each element reads the element at its own position along this plate
        try:
            index = _reduce_non_plate(pos, nz, reader_plates, reader, source)
        except StructureError as e:
            return str(e)
        out.append(Gather(reader, source, plate, index))
    return out


def _unravel(flat: torch.Tensor, shape: torch.Size) -> list[torch.Tensor]:
    out = []
    rest = flat.clamp(min=0)
    for size in reversed(shape):
        out.append(rest % size)
        rest = torch.div(rest, size, rounding_mode="floor")
    out.reverse()
    return [torch.where(flat >= 0, p, -1) for p in out]


def _reduce_non_plate(pos: torch.Tensor, nz: torch.Tensor, plates: dict[str, int], reader: str, source: str):
    """``pos`` with the reader's dims that are not its plates reduced to size 1 (they must agree along them)."""
    pos = torch.where(nz, pos, -1)
    nb = pos.dim()
    plate_dims = {nb + d for d in plates.values()}
    for d in range(nb):
        if d in plate_dims or pos.shape[d] == 1:
            continue
        first = pos.narrow(d, 0, 1)
        if not bool((pos == first).all()):
            raise StructureError(
                f"site '{reader}' reads different elements of '{source}' along its batch dim {d - nb}, which is not "
                "one of its plates; declare that dim with pyro.plate, or move it into the event shape"
            )
        pos = first
    return pos

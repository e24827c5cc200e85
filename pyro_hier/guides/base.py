"""What every pyro-hier guide shares: the prototype from :mod:`pyro_hier.structure`, plates that honour the model's
own subsample indices, initial values at full plate size, and emitting constrained values the way ``AutoNormal``
does (an auxiliary unconstrained site, then a ``Delta`` with the log-Jacobian)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import InitMessenger, init_to_feasible
from pyro.ops.tensor_utils import periodic_repeat
from torch.distributions import biject_to

from pyro_hier.errors import StructureError
from pyro_hier.plates import PlateCall, capture_plates, check_plate_sizes, open_plates
from pyro_hier.structure import LatentSite, ModelStructure, PlateLevel, inspect_model

__all__ = ["HierarchicalGuide", "empirical_quantiles"]


class HierarchicalGuide(AutoGuide):
    """Base class of the pyro-hier autoguides (not used directly).

    Subclasses implement :meth:`_setup_guide` (create parameters once the model structure is known) and ``forward``.

    Plates: unless the user passes ``create_plates``, every call first runs the model just far enough to see its plates
    (:func:`pyro_hier.plates.capture_plates`, hidden from all handlers) and opens the guide's plates with *the model's*
    indices, so ``pyro.plate(name, N, subsample=idx)`` in the model is honoured (unlike pyro-ppl/pyro#3468), and a
    model that subsamples at random adopts the indices the guide drew, as in Pyro.

    :param model: a Pyro model.
    :param init_loc_fn: initialisation strategy for the locations (see :mod:`pyro.infer.autoguide.initialization`).
    :param create_plates: optional ``create_plates(*args, **kwargs)`` returning the plate(s) to use, as in
        ``AutoNormal``; plates it does not return are taken from the model.
    """

    def __init__(
        self,
        model: Callable,
        *,
        init_loc_fn: Callable = init_to_feasible,
        create_plates: Callable | None = None,
    ) -> None:
        self.init_loc_fn = init_loc_fn
        model = InitMessenger(_ContinuousInit(init_loc_fn))(model)
        super().__init__(model, create_plates=create_plates)
        self.structure: ModelStructure | None = None

    # ---- the model, pickling -------------------------------------------------------------------------------------
    @property
    def model(self) -> Callable:
        if self._model is None:
            raise RuntimeError(
                f"this {type(self).__name__} was unpickled without its model (Pyro's autoguides never pickle the "
                "model); call guide.attach_model(model) before using it with data"
            )
        return self._model[0]

    def attach_model(self, model: Callable) -> None:
        """Give an unpickled guide its model back (wrapped in the guide's init strategy, as at construction)."""
        self._model = (InitMessenger(_ContinuousInit(self.init_loc_fn))(model),)

    def __getstate__(self) -> dict:
        # Pyro's AutoGuide.__getstate__ drops the model (and master) from the *live* guide too; our guides still
        # need the model after being pickled (they read its plates every call), so put them back here.
        model, master = self._model, self.master
        state = super().__getstate__()
        self._model, self.master = model, master
        return state

    # ---- prototype ----------------------------------------------------------------------------------------------
    def _setup_prototype(self, *args, **kwargs) -> None:
        self.structure = inspect_model(self.model, args, kwargs)
        self.prototype_trace = self.structure.trace
        if self.master is not None:
            self.master()._check_prototype(self.prototype_trace)
        self._prototype_frames = {}
        for site in self.structure.latent.values():
            for frame in self.prototype_trace.nodes[site.name]["cond_indep_stack"]:
                self._prototype_frames[frame.name] = frame
        self._check_sites(self.structure)
        self._setup_guide(self.structure)

    def _check_sites(self, structure: ModelStructure) -> None:
        """Refuse latent sites the guide cannot represent: discrete sites must be enumerated (the guide then covers
        only the continuous latents, as AutoNormal on a blocked model does)."""
        if not structure.latent:
            raise StructureError(f"the model has no latent sites: {type(self).__name__} has nothing to approximate")
        for site in structure.latent.values():
            if site.discrete and not site.enumerated:
                raise StructureError(
                    f"site '{site.name}' is discrete and not enumerated. {type(self).__name__} covers continuous "
                    "latents: mark the site with infer={'enumerate': 'parallel'} (or wrap the model in "
                    "pyro.infer.config_enumerate) and train with TraceEnum_ELBO, or use AutoHierarchicalVM, which "
                    "handles discrete latents without enumeration."
                )

    def _setup_guide(self, structure: ModelStructure) -> None:
        raise NotImplementedError

    @property
    def guide_sites(self) -> tuple[str, ...]:
        """The latent sites this guide samples (continuous, not enumerated)."""
        assert self.structure is not None
        return tuple(n for n, s in self.structure.latent.items() if not s.discrete and not s.enumerated)

    # ---- plates -------------------------------------------------------------------------------------------------
    def _guide_plate_names(self) -> tuple[str, ...]:
        assert self.structure is not None
        return tuple(dict.fromkeys(p for n in self.guide_sites for p in self.structure.latent[n].plates))

    def _create_plates(self, *args, **kwargs) -> dict[str, pyro.plate]:
        assert self.structure is not None
        names = self._guide_plate_names()
        plates: dict[str, pyro.plate] = {}
        if self.create_plates is not None:
            user = self.create_plates(*args, **kwargs)
            user = [user] if isinstance(user, pyro.plate) else list(user)
            for p in user:
                if p.name in self.structure.plates and p.size != self.structure.plates[p.name].size:
                    raise StructureError(
                        f"create_plates returned plate '{p.name}' of full size {p.size}, but the model's plate has "
                        f"{self.structure.plates[p.name].size} elements: pass the full size and subsample=..."
                    )
                plates[p.name] = p
        missing = [n for n in names if n not in plates]
        if missing:
            calls = self._capture_plates(args, kwargs, missing)
            check_plate_sizes(calls, {n: self.structure.plates[n].size for n in missing}, type(self).__name__)
            plates.update(open_plates(calls, {n: self.structure.plates[n].dim for n in missing}))
        self.plates = plates
        return plates

    def _capture_plates(self, args: tuple, kwargs: dict, names: list[str]) -> dict[str, PlateCall]:
        """What the model does with the plates ``names`` on this call (a hook: guides that run the model anyway
        reuse that run)."""
        return capture_plates(self.model, args, kwargs, names=names)

    # ---- initial values -----------------------------------------------------------------------------------------
    def _init_unconstrained(self, site: LatentSite) -> torch.Tensor:
        """The init value of ``site`` in unconstrained space at its full shape (a subsampled prototype is tiled
        periodically along the plate, as AutoNormal does)."""
        value = self.prototype_trace.nodes[site.name]["value"].detach()
        u = biject_to(site.support).inv(value)
        assert self.structure is not None
        for p in site.plates:
            info = self.structure.plates[p]
            if info.subsampled:
                u = periodic_repeat(u, info.size, info.dim - site.unconstrained_event_dim).contiguous()
        return u

    def _init_level(self, level: PlateLevel) -> torch.Tensor:
        """Initial element vectors of a level: shape ``level.batch_shape + (level.numel,)``."""
        assert self.structure is not None
        parts = []
        for name in level.sites:
            u = self._init_unconstrained(self.structure.latent[name])
            parts.append(u.reshape((*level.batch_shape, -1)))
        return torch.cat(parts, dim=-1)

    # ---- emitting values ----------------------------------------------------------------------------------------
    def _site_unconstrained(
        self, level: PlateLevel, name: str, u: torch.Tensor, *, broadcast: bool = True
    ) -> torch.Tensor:
        """Cut ``name``'s value out of a level's element vectors ``u``.

        ``broadcast=True`` when ``u`` was sampled under the plates (its leading dims then end in the singleton dims
        plates broadcast a global to); ``False`` for full-size summaries, whose leading dims are kept as they are."""
        assert self.structure is not None
        site = self.structure.latent[name]
        block = u[..., level.block(name)]
        if level.plates:
            event = site.unconstrained_shape[len(site.unconstrained_shape) - site.unconstrained_event_dim :]
            return block.reshape(block.shape[:-1] + event)
        # a global site keeps its own (non-plate) batch dims: take them out of the broadcast dims of u
        lead = block.shape[:-1]
        if broadcast:
            lead = _strip_trailing_ones(lead, len(site.unconstrained_shape) - site.unconstrained_event_dim)
        return block.reshape(lead + site.unconstrained_shape)

    def _emit(self, name: str, u: torch.Tensor) -> torch.Tensor:
        """Sample the model's site ``name`` as ``Delta(T(u))`` with the log-Jacobian, inside its plates."""
        assert self.structure is not None
        site = self.structure.latent[name]
        transform = biject_to(site.support)
        value = transform(u)
        if poutine.get_mask() is False:
            log_density = 0.0
        else:
            log_density = transform.inv.log_abs_det_jacobian(value, u)
            log_density = sum_rightmost(log_density, log_density.dim() - value.dim() + site.event_dim)
        return pyro.sample(name, dist.Delta(value, log_density=log_density, event_dim=site.event_dim))

    def _constrain(self, name: str, u: torch.Tensor) -> torch.Tensor:
        assert self.structure is not None
        return biject_to(self.structure.latent[name].support)(u)

    def _require_setup(self, *args, **kwargs) -> None:
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)


class _ContinuousInit:
    """An init strategy that leaves discrete sites to their prior: the guide does not model them (they are
    enumerated), so unlike ``AutoNormal`` the user need not hide them with ``poutine.block``."""

    def __init__(self, init_loc_fn: Callable) -> None:
        self.init_loc_fn = init_loc_fn

    def __call__(self, site: dict) -> torch.Tensor:
        if site["fn"].support.is_discrete:
            return site["fn"].sample().detach()
        return self.init_loc_fn(site)


def _strip_trailing_ones(shape: Iterable[int], n: int) -> torch.Size:
    shape = list(shape)
    k = min(n, len(shape))
    if any(s != 1 for s in shape[len(shape) - k :]):
        raise RuntimeError(f"internal error: expected trailing singleton dims in {shape}")
    return torch.Size(shape[: len(shape) - k])


def empirical_quantiles(v: torch.Tensor, quantiles, *, discrete: bool = False) -> torch.Tensor:
    """Quantiles over dim 0 of draws ``v`` (the summaries of guides that are not Gaussian): linear interpolation
    between order statistics, or the lower order statistic for discrete values (which stay in the support).
    ``torch.quantile`` is not used: it refuses inputs of more than 16 million numbers."""
    n = v.shape[0]
    q = torch.as_tensor(quantiles, dtype=torch.float64).reshape(-1)
    if ((q < 0) | (q > 1)).any():
        raise ValueError(f"quantiles must lie in [0, 1], got {quantiles}")
    ordered = v.sort(0).values
    pos = q * (n - 1)
    lo = pos.floor().long()
    if discrete:
        return ordered[lo.to(v.device)]
    hi = pos.ceil().long()
    frac = (pos - lo).to(dtype=v.dtype, device=v.device).reshape((-1,) + (1,) * (v.dim() - 1))
    return ordered[lo.to(v.device)] * (1 - frac) + ordered[hi.to(v.device)] * frac

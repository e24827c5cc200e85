"""What every pyro-hier guide shares: the prototype from :mod:`pyro_hier.structure`, plates that honour the model's
own subsample indices, initial values at full plate size, and emitting constrained values the way ``AutoNormal``
does (an auxiliary unconstrained site, then a ``Delta`` with the log-Jacobian)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import pickle
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import InitMessenger, init_to_feasible
from pyro.nn import PyroModule
from pyro.ops.tensor_utils import periodic_repeat
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample
from torch.distributions import biject_to, constraints

from pyro_hier.errors import StructureError
from pyro_hier.gathers import keep_random_state
from pyro_hier.nn import module_key
from pyro_hier.plates import (
    PlateCall,
    call_key,
    capture_plates,
    check_plate_sizes,
    open_plates,
)
from pyro_hier.structure import LatentSite, ModelStructure, PlateLevel, inspect_model

__all__ = [
    "HierarchicalGuide",
    "concat_broadcast",
    "empirical_quantiles",
    "parameter_keys",
    "stored_param",
    "strip_trailing_ones",
]


class HierarchicalGuide(AutoGuide):
    """Base class of the pyro-hier autoguides (not used directly).

    Subclasses implement :meth:`_setup_guide` (create parameters once the model structure is known) and ``forward``.

    Plates: unless the user passes ``create_plates``, every call first runs the model just far enough to see its plates
    (:func:`pyro_hier.plates.capture_plates`, hidden from all handlers) and opens the guide's plates with *the model's*
    indices, so ``pyro.plate(name, N, subsample=idx)`` in the model is honoured (unlike pyro-ppl/pyro#3468), and a
    model that subsamples at random adopts the indices the guide drew, as in Pyro. In an ``AutoGuideList`` the
    list's plates are used, as Pyro's autoguides do; a guide unpickled without its model (see :meth:`__getstate__`)
    opens its plates at their full sizes.

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
        super().__init__(InitMessenger(_ContinuousInit(init_loc_fn))(model), create_plates=create_plates)
        self._user_model: tuple[Callable] | _MainReference | None = (model,)
        self._verify_model = False
        self.structure: ModelStructure | None = None
        #: in an ``AutoGuideList``: the sites the whole model has and this part's does not (hidden by
        #: ``poutine.block``), and those of them this part's runs of the model take from the other parts
        self._hidden_sites: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self._given_hidden: dict[str, torch.Tensor] | None = None  # (their values on this call)
        self._whole_model: tuple[Callable] | _MainReference | None = None  # (the list's model: it travels as ours)

    # ---- the model, pickling -------------------------------------------------------------------------------------
    #: attributes holding user callables that travel in a pickle as :func:`_portable` makes them
    _pickled_callables: tuple[str, ...] = ("init_loc_fn", "create_plates")

    @property
    def model(self) -> Callable:
        """The model, wrapped in the guide's init strategy (as Pyro's autoguides hold it)."""
        if self._model is None:
            self._model = (InitMessenger(_ContinuousInit(self.init_loc_fn))(self.reading_model),)
            if self.structure is not None:
                self.structure.model = self._model[0]
        return self._model[0]

    @property
    def reading_model(self) -> Callable:
        """The model this guide runs to read its plates, prior conditionals and likelihood: :attr:`user_model`,
        except in an ``AutoGuideList`` part whose model hides continuous latent sites of the whole model
        (``poutine.block``). There a run of the part's own model would draw those sites from their prior (noisy
        references and expansions; with rows drawn at random as well, a NaN loss), so this is the whole model with
        those sites set to the other parts' medians on this call (:meth:`hidden_values`), then hidden as the part's
        model hides them. Example (the noise scale to an ``AutoNormal`` part, the rest to the branch guide)::

            guide = AutoGuideList(model)
            guide.append(AutoBranchGuide(poutine.block(model, hide=["sigma"])))
            guide.append(AutoNormal(poutine.block(model, expose=["sigma"])))
            # the branch part's references read the likelihood at sigma = the AutoNormal part's median

        Reference: Pyro's ``AutoGuideList`` (pyro.infer.autoguide), whose parts see only their own sites."""
        model = _GivenHiddenSites(self) if getattr(self, "_hidden_sites", None) is not None else self.user_model
        if self.structure is not None and self.structure.imputed:  # (Pyro's obs_mask)
            return _ImputedSites(self.structure.imputed)(model)
        return model

    @property
    def has_model(self) -> bool:
        """Whether the guide can run its model: always, unless it was unpickled in a process where its model could
        not be found (see :meth:`__getstate__`)."""
        try:
            self.user_model  # noqa: B018
        except RuntimeError:
            return False
        return True

    @property
    def user_model(self) -> Callable:
        """The model as the user gave it."""
        ref = self._user_model
        if isinstance(ref, _MainReference):
            found = ref.resolve()
            if found is not None:
                self._user_model = ref = (found,)
                self._verify_model = self.structure is not None  # check it on the next call with data
        if ref is None or isinstance(ref, _MainReference):
            where = (
                f"the function '{ref.qualname}' of the script that saved it (__main__), which this process does not "
                "define"
                if isinstance(ref, _MainReference)
                else "a model that could not be pickled by reference (a lambda, a closure, a method or an object of "
                "the saving script)"
            )
            raise RuntimeError(
                f"this {type(self).__name__} was unpickled without its model: it was {where}. "
                f"{self._needs_model_because}. Call guide.attach_model(model) after loading, or define the model "
                "(or import it) at the top level of the loading script under the same name, or define it in an "
                "importable module (then it travels with the guide)."
            )
        return ref[0]

    #: why the guide needs its model on a call (the error message of :attr:`user_model`)
    _needs_model_because = "It runs the model on each call to read the plates' subsample indices"

    def attach_model(self, model: Callable) -> None:
        """Give an unpickled guide its model back (only needed when it could not travel with the guide: see
        :meth:`__getstate__`)."""
        self._user_model = (model,)
        self._model = None
        self._verify_model = False

    def attach_whole_model(self, model: Callable) -> None:
        """Give an unpickled part of an ``AutoGuideList`` with sites hidden from it the list's model back (only needed
        when it could not travel with the guide: see :meth:`__getstate__`)."""
        self._whole_model = (model,)
        self._model = None

    def __getstate__(self) -> dict:
        """Pickle the guide, and its model only where loading cannot fail because of it.

        Pyro's autoguides never pickle the model. These guides read the model's plates (and the amortized and
        plate-amortized ones its observations and prior conditionals) on every call, so the model travels with the
        guide when it pickles without any reference to ``__main__`` (a function or ``PyroModule`` of an importable
        module). A function defined at the top level of the saving script travels as a reference that the loaded
        guide resolves, on first use, to the loading script's function of that name (checked against the guide's
        latent sites on the next call); such a function wrapped in Pyro's handlers (``poutine.reparam``,
        ``poutine.block``) travels as its pickle, loaded on first use in the same way. Anything else (a lambda, a
        closure) is left out. Without a model the guide
        opens its plates at the full sizes it recorded, as ``AutoNormal`` opens its own; guides that must run the
        model (nested observations, PAVI's prior conditionals) say so on use and ask for :meth:`attach_model`. A part
        of an ``AutoGuideList`` with sites hidden from it keeps the list's model the same way
        (:meth:`attach_whole_model`)."""
        model, master = self._model, self.master
        state = dict(super().__getstate__())
        self._model, self.master = model, master  # Pyro's AutoGuide.__getstate__ drops them from the live guide too
        state["_model"] = None
        state["_verify_model"] = False
        state["_plates_run"] = None  # (keyed by this process's objects)
        state["_given_hidden"] = None
        if state.pop("_deep_copying", False):  # copy.deepcopy in this process: the model as it is
            pass
        else:
            for key in ("_user_model", "_whole_model"):
                held = state.get(key)
                if isinstance(held, tuple):
                    portable = _portable(held[0])
                    state[key] = (
                        portable
                        if isinstance(portable, _MainReference)
                        else ((portable,) if portable is not None else None)
                    )
        for name in self._pickled_callables:
            value = state.get(name)
            if isinstance(value, Mapping):
                state[name] = {k: _portable_callable(v) for k, v in value.items()}
            else:
                state[name] = _portable_callable(value)
        if self.structure is not None:
            structure = copy.copy(self.structure)
            structure.model = None
            state["structure"] = structure
        return state

    def __deepcopy__(self, memo: dict):
        """``copy.deepcopy(guide)`` keeps the model, whatever it is (a copy stays in this process)."""
        self.__dict__["_deep_copying"] = True
        try:
            return copy._reconstruct(self, memo, *self.__reduce_ex__(4))
        finally:
            del self.__dict__["_deep_copying"]

    def _check_reattached_model(self, args: tuple, kwargs: dict) -> None:
        """A model found by name after unpickling must be the one the guide was built for: same latent sites in the
        same plates, same shapes."""
        self._verify_model = False
        assert self.structure is not None
        other = inspect_model(self.model, args, kwargs, num_calls=1)
        mine = {n: (s.plates, tuple(s.shape)) for n, s in self.structure.latent.items()}
        theirs = {n: (s.plates, tuple(s.shape)) for n, s in other.latent.items()}
        if mine != theirs:
            self._user_model, self._model = None, None
            raise StructureError(
                f"this {type(self).__name__} was unpickled with a reference to the saving script's model, and the "
                f"loading script's function of that name has other latent sites ({theirs}; the guide has {mine}). "
                "Call guide.attach_model(model) with the model the guide was fitted to."
            )

    def _adopt_stored_parameters(self, module_name: str) -> None:
        """Make the submodule ``module_name`` (torch layers converted with ``to_pyro_module_``) use the tensors Pyro's
        param store holds under its parameters' names, where they differ (e.g. after
        ``pyro.get_param_store().load(...)`` into a freshly built guide), as ``PyroParam`` attributes and
        ``pyro.module(..., update_module_params=True)`` do; Pyro's converted layers would keep their own."""
        if pyro.settings.get("module_local_params"):
            return
        store = pyro.get_param_store()
        prefix = self._pyro_get_fullname(module_name)
        module = self._modules[module_name]
        for name, param in list(module.named_parameters()):
            full = f"{prefix}.{name}"
            if full not in store:
                continue
            stored = store[full].unconstrained()
            if stored is param:
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            if not isinstance(stored, torch.nn.Parameter):
                stored = torch.nn.Parameter(stored)
                store._params[full] = stored
                store._param_to_name[stored] = full
            owner._parameters[leaf] = stored

    # ---- prototype ----------------------------------------------------------------------------------------------
    def _setup_prototype(self, *args, **kwargs) -> None:
        self.structure = inspect_model(self.model, args, kwargs)
        if self.structure.imputed:  # the model is read through :class:`_ImputedSites` from now on
            self._model = None
            self.structure.model = self.model
        self.prototype_trace = self.structure.trace
        if self.master is not None:  # a part of an AutoGuideList: the list checks our latent sites against its own
            self.master()._check_prototype(_latent_trace(self.prototype_trace, self.structure))
        self._prototype_frames = {}
        for site in self.structure.latent.values():
            for frame in self.prototype_trace.nodes[site.name]["cond_indep_stack"]:
                self._prototype_frames[frame.name] = frame
        self._check_sites(self.structure)
        if self.master is not None:
            self._find_hidden_sites(args, kwargs)
        self._setup_guide(self.structure)

    def __call__(self, *args, **kwargs):
        self._given_hidden = None  # (the other parts' medians are read again on each call)
        return super().__call__(*args, **kwargs)

    def _find_hidden_sites(self, args: tuple, kwargs: dict) -> None:
        """In an ``AutoGuideList``: the sample sites of the whole model that this part's model hides, and the continuous
        latent ones among them that :attr:`reading_model` sets to the other parts' medians (those outside plates
        subsampled on this call; any other is said in a warning, with the fix)."""
        whole = getattr(self.master(), "_model", None)
        if whole is None:
            return
        with poutine.block(), keep_random_state():
            trace = poutine.trace(whole[0]).get_trace(*args, **kwargs)
        mine = self.structure.trace.nodes
        hide = tuple(n for n, site in trace.nodes.items() if site["type"] == "sample" and n not in mine)
        latent = [
            n
            for n in hide
            if not trace.nodes[n]["is_observed"]
            and not isinstance(trace.nodes[n]["fn"], _Subsample)
            and not trace.nodes[n]["fn"].support.is_discrete
        ]
        given = tuple(
            n for n in latent if all(f.full_size in (None, f.size) for f in trace.nodes[n]["cond_indep_stack"])
        )
        if not latent:
            return
        self._hidden_sites = (hide, given)
        self._whole_model = whole
        self._model = None
        left = [n for n in latent if n not in given]
        if left:
            warnings.warn(
                f"{type(self).__name__}: the continuous site(s) {left} are hidden from it (poutine.block, in an "
                "AutoGuideList) inside plates subsampled on this call: its runs of the model draw them from their "
                "prior, so what it reads of the model there is noisy. Give those sites to this guide.",
                stacklevel=3,
            )

    def hidden_values(self, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
        """In an ``AutoGuideList``: the values :attr:`reading_model` gives the continuous sites hidden from this part
        on this call, each the median of the part that has it (``part.median(*args, **kwargs)``, read once a call),
        or where no part has been set up yet (the first call), the guide's ``init_loc_fn`` at the site."""
        if self._given_hidden is not None:
            return self._given_hidden
        assert self._hidden_sites is not None and self.master is not None
        given = self._hidden_sites[1]
        master = self.master()
        values: dict[str, torch.Tensor] = {}
        self._given_hidden = values  # (a part whose median runs its model may ask back: it gets what is read so far)
        for part in master:
            proto = getattr(part, "prototype_trace", None)
            wanted = [n for n in given if n not in values and proto is not None and n in proto.nodes]
            if part is self or not wanted:
                continue
            with torch.no_grad(), poutine.block():
                median = part.median(*args, **kwargs)
            values.update({n: median[n].detach() for n in wanted if n in median})
        whole = master.prototype_trace
        for name in given:
            if name not in values:
                values[name] = _ContinuousInit(self.init_loc_fn)(whole.nodes[name]).detach()
        return values

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
                    "pyro.infer.config_enumerate) and train with TraceEnum_ELBO (Pyro's tutorial: "
                    "https://pyro.ai/examples/enumeration.html), or use AutoHierarchicalVM, which handles discrete "
                    "latents without enumeration."
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
        """The plates of the guide's sites, then the plates the model subsamples at random that hold none (a flat
        plate of observations, ``pyro.plate("data", N, subsample_size=B)``): the guide opens them too, as Pyro's
        subsampling contract has it, so that the model replays the guide's draw and every run of the model the guide
        makes on the call (its references, its expansions) reads the rows the ELBO scores."""
        assert self.structure is not None
        s = self.structure
        names = dict.fromkeys(p for n in self.guide_sites for p in s.latent[n].plates)
        names.update(dict.fromkeys(self.random_row_plates()))
        return tuple(names)

    def random_row_plates(self) -> tuple[str, ...]:
        """The plates the model subsamples at random (``subsample_size=``, no indices of the user's) that hold no
        latent site, as its first call showed: a flat plate of observations, ``pyro.plate("data", N,
        subsample_size=B)``, whose rows each training call draws anew (:meth:`drawn_rows` gives them per call)."""
        assert self.structure is not None
        s = self.structure
        latent = {p for site in s.latent.values() for p in site.plates}
        drawn = (n for n, p in s.plates.items() if p.subsampled and p.subsample is None and p.dim)
        return tuple(n for n in drawn if n not in latent)

    def drawn_rows(self, calls: Mapping[str, PlateCall]) -> dict[str, tuple[int, int]]:
        """The plates of this call that Pyro subsampled at random and that hold no latent site (a flat plate of
        observations, ``pyro.plate("data", N, subsample_size=B)``), ``{name: (N, B)}``: what a guide reads of the
        likelihood (references, expansions) reads all their rows (:func:`~pyro_hier.plates.row_blocks`), so that q
        of a group does not depend on the minibatch."""
        assert self.structure is not None
        latent = {p for site in self.structure.latent.values() for p in site.plates}
        return {
            n: (c.size, int(c.indices.shape[0]))
            for n, c in calls.items()
            if c.subsampled and not c.user_indices and n not in latent
        }

    def _create_plates(self, *args, **kwargs) -> dict[str, pyro.plate]:
        """The plates of this call: the user's ``create_plates``, else (in an ``AutoGuideList``) the list's plates,
        as Pyro's autoguides do, else the model's own, opened with the model's indices."""
        assert self.structure is not None
        names = self._guide_plate_names()
        plates: dict[str, pyro.plate] = {}
        if self.create_plates is None and self.master is not None:
            # the list opened its plates (a plate records its subsample site when it is created, so a part must not
            # open one of the same name again); give it create_plates to use the model's subsample indices
            plates.update({n: p for n, p in (getattr(self.master(), "plates", None) or {}).items() if n in names})
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
        if missing and not self.has_model:  # unpickled without its model: full plates, as AutoNormal opens its own
            for n in missing:
                info = self.structure.plates[n]
                plates[n] = pyro.plate(n, info.size, dim=info.dim)
            missing = []
        self.drawn_plates: tuple[str, ...] = ()  # plates whose subsample Pyro drew at random on this call
        if missing:
            calls = self._capture_plates(args, kwargs, missing)
            self.drawn_plates = tuple(n for n, c in calls.items() if c.subsampled and not c.user_indices)
            check_plate_sizes(calls, {n: self.structure.plates[n].size for n in missing}, type(self).__name__)
            plates.update(open_plates(calls, {n: self.structure.plates[n].dim for n in missing}))
        self.plates = plates
        return plates

    def _capture_plates(self, args: tuple, kwargs: dict, names: list[str]) -> dict[str, PlateCall]:
        """What the model does with the plates ``names`` on this call (a hook: guides that run the model anyway
        reuse that run). The same arguments again (the same objects, unmodified: :func:`~pyro_hier.plates.call_key`)
        reuse the last call's plates; where Pyro drew a subsample at random there, a new one is drawn here as Pyro's
        plate draws it (``torch.randperm(N)[:B]``), without running the model again (a tenth of a training step of
        the branch guide on radon with 100 of its 919 homes drawn a call)."""
        key = (id(self.model), call_key(args, kwargs), tuple(names))
        last = getattr(self, "_plates_run", None)
        if last is not None and last[0] == key:
            calls = dict(last[3])
            for name, call in calls.items():
                if call.subsampled and not call.user_indices:
                    drawn = torch.randperm(call.size, device=call.indices.device)[: call.subsample_size]
                    calls[name] = dataclasses.replace(call, indices=drawn)
            return calls
        with keep_random_state():  # (the model draws its latents from the prior up to its plates)
            calls = capture_plates(self.model, args, kwargs, names=names)
        self._plates_run = (key, args, dict(kwargs), dict(calls))
        return calls

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
            lead = strip_trailing_ones(lead, len(site.unconstrained_shape) - site.unconstrained_event_dim)
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
        # (not validated: T(u) is in the support by construction, and the check reads the tensors on every call)
        delta = dist.Delta(value, log_density=log_density, event_dim=site.event_dim, validate_args=False)
        return pyro.sample(name, delta)

    @property
    def site_init(self) -> Callable[[dict], torch.Tensor]:
        """The init strategy that :attr:`model` applies to the sites: with :attr:`user_model`, for runs of the model
        that set some sites' values first (:func:`~pyro_hier.conjugate.capture_priors`'s ``init``)."""
        return _ContinuousInit(self.init_loc_fn)

    def _constrain(self, name: str, u: torch.Tensor) -> torch.Tensor:
        assert self.structure is not None
        return biject_to(self.structure.latent[name].support)(u)

    def _require_setup(self, *args, **kwargs) -> None:
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        elif self._verify_model:
            self._check_reattached_model(args, kwargs)

    # ---- summaries from draws -----------------------------------------------------------------------------------
    #: draws behind the Monte Carlo ``median`` and ``quantiles`` (guides whose marginals have no closed form)
    num_summary_samples: int = 1000

    @torch.no_grad()
    def sample_latents(self, num_samples: int, *args, **kwargs) -> dict[str, torch.Tensor]:
        """``num_samples`` joint draws of every latent site the guide samples (constrained), stacked in a leading
        dim, for the plates as the model opens them with these arguments.

        The draws are taken at once, under a plate of ``num_samples`` left of the model's plates. A model that cannot
        run batched that way (e.g. ``locs[assignment]`` instead of ``locs[..., assignment]``, which
        ``Predictive(parallel=True)`` refuses too) is run once per draw instead, with a warning: the same draws, only
        slower."""
        self._require_setup(*args, **kwargs)
        assert self.structure is not None
        dim = -self.structure.max_plate_nesting - 1
        names = [n for n in self.guide_sites if n in self.structure.latent]
        try:
            with poutine.block(), poutine.trace() as tr, pyro.plate("_pyro_hier_draws", num_samples, dim=dim):
                self(*args, **kwargs)
            values = {name: tr.trace.nodes[name]["value"] for name in names}
        except (ValueError, RuntimeError, IndexError) as e:
            warnings.warn(
                f"{type(self).__name__}: the model could not run batched over {num_samples} draws ({type(e).__name__}: "
                f"{e}); drawing them one model run at a time (slower). Index with a leading ellipsis (x[..., i]) to "
                "make the model batch-friendly.",
                stacklevel=2,
            )
            draws = []
            for _ in range(num_samples):
                with poutine.block():
                    draws.append(self(*args, **kwargs))
            values = {name: torch.stack([d[name] for d in draws]) for name in names}
        out = {}
        for name in names:
            site = self.structure.latent[name]
            value = values[name]
            rank = len(site.shape)
            out[name] = value.reshape((num_samples, *value.shape[value.dim() - rank :]) if rank else (num_samples,))
        return out

    def _summary_draws(self, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
        """The draws behind the Monte Carlo summaries: always the same ones for the same guide (a fixed seed, without
        touching the caller's random state), so the summaries are functions of the guide."""
        self._require_setup(*args, **kwargs)
        tensor = next(iter(self.parameters()), None)
        devices = [tensor.device] if tensor is not None and tensor.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            return self.sample_latents(self.num_summary_samples, *args, **kwargs)

    #: indices of the blocks of plates Pyro subsamples at random while summaries are taken block by block
    #: (:meth:`_join_blocks`): guides that run the model themselves replay them into it
    _summary_subsamples: dict[str, torch.Tensor] | None = None

    @contextmanager
    def _replaying(self, blocks: dict[str, torch.Tensor]) -> Iterator[None]:
        """Within: the model's runs by the guide open the plates of ``blocks`` at these indices."""
        self._summary_subsamples = blocks
        try:
            yield
        finally:
            self.__dict__.pop("_summary_subsamples", None)

    def _join_blocks(
        self,
        calls: dict[str, PlateCall],
        summarise: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    ) -> dict[str, torch.Tensor]:
        """Per-element summaries ``{site: (..., *site.shape)}`` at the full sizes of plates that Pyro subsamples at
        random (``calls``: ``pyro.plate(name, N, subsample_size=B)``, which Pyro cannot open in full), from
        ``summarise(blocks)`` on consecutive blocks of ``B`` elements (``blocks``: plate → indices; the last block
        ends at ``N``, overlapping the one before), joined along the plates. Each block's draws of an element are
        draws of its marginal under q, so marginal summaries (quantiles, a median) join exactly; sites outside these
        plates are read on the first block."""
        assert self.structure is not None
        drawn = list(calls)
        device = calls[drawn[0]].indices.device
        starts = {}
        for n in drawn:
            size, block = calls[n].size, calls[n].subsample_size
            starts[n] = [min(s, size - block) for s in range(0, size, block)]
        out: dict[str, torch.Tensor] = {}
        for choice in itertools.product(*(range(len(starts[n])) for n in drawn)):
            blocks, keep = {}, {}
            for n, k in zip(drawn, choice, strict=True):
                start, block = starts[n][k], calls[n].subsample_size
                blocks[n] = torch.arange(start, start + block, device=device)
                keep[n] = (k * block - start, start, start + block)  # (first new position, the block's range)
            piece = summarise(blocks)
            for name, value in piece.items():
                site = self.structure.latent[name]
                at = {n: site.plate_dims[site.plates.index(n)] - site.event_dim for n in drawn if n in site.plates}
                if not at:
                    out.setdefault(name, value)
                    continue
                if name not in out:
                    shape = list(value.shape)
                    for n, d in at.items():
                        shape[d] = calls[n].size
                    out[name] = value.new_empty(shape)
                source: list = [slice(None)] * value.dim()
                target: list = [slice(None)] * value.dim()
                for n, d in at.items():
                    first, start, end = keep[n]
                    source[d], target[d] = slice(first, None), slice(start + first, end)
                out[name][tuple(target)] = value[tuple(source)]
        return out

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Median of ``num_summary_samples`` draws of q, coordinatewise in unconstrained space and mapped to each
        site's support (so a simplex stays a simplex), as ``AutoNormal``'s median."""
        return {k: v[0] for k, v in self.quantiles([0.5], *args, **kwargs).items()}

    @torch.no_grad()
    def quantiles(self, quantiles: list[float] | torch.Tensor, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Quantiles of ``num_summary_samples`` draws of q, coordinatewise in unconstrained space and mapped to each
        site's support (for elementwise transforms these are the constrained quantiles); the quantile dim comes
        first."""
        self._require_setup(*args, **kwargs)
        assert self.structure is not None
        out = {}
        for name, draws in self._summary_draws(args, kwargs).items():
            to_support = biject_to(self.structure.latent[name].support)
            out[name] = to_support(empirical_quantiles(to_support.inv(draws), quantiles))
        return out


class _ContinuousInit:
    """An init strategy that leaves discrete sites to their prior: the guide does not model them (they are
    enumerated), so unlike ``AutoNormal`` the user need not hide them with ``poutine.block``. A value that broadcasts
    to the site's shape (``init_to_value(values={"z": torch.tensor(0.3)})`` for a plated ``z``) is expanded to it."""

    def __init__(self, init_loc_fn: Callable) -> None:
        self.init_loc_fn = init_loc_fn

    def __call__(self, site: dict) -> torch.Tensor:
        if site["fn"].support.is_discrete:
            return site["fn"].sample().detach()
        value = self.init_loc_fn(site)
        shape = site["fn"].shape()  # inside the site's plates: a value given once (init_to_value) is every element's
        if value.shape != shape and torch.broadcast_shapes(value.shape, shape) == shape:
            value = value.expand(shape).clone()
        return value


class _ImputedSites(Messenger):
    """The guide's own runs of a model called without the observations that a latent site imputes
    (:attr:`~pyro_hier.structure.ModelStructure.imputed`, Pyro's ``obs_mask``): the site the model samples in their
    place is read as the imputing site (the same distribution, over all entries), so the guide's levels find their
    prior conditionals where they found them with the data given; the model does not read the guide's draw of it."""

    def __init__(self, imputed: Mapping[str, str]) -> None:
        super().__init__()
        self.renamed = {replaced: imputing for imputing, replaced in imputed.items()}

    def _pyro_sample(self, msg) -> None:
        if not msg["is_observed"] and msg["name"] in self.renamed:
            msg["name"] = self.renamed[msg["name"]]


class _GivenHiddenSites:
    """The whole model of an ``AutoGuideList`` as a part reads it (:attr:`HierarchicalGuide.reading_model`): the sites
    hidden from the part set to :meth:`HierarchicalGuide.hidden_values`, then hidden from the handlers outside, as
    the part's own model hides them. Holds the guide weakly (the guide holds it only on its calls)."""

    def __init__(self, guide: HierarchicalGuide) -> None:
        self.guide = weakref.ref(guide)

    def __call__(self, *args, **kwargs):
        guide = self.guide()
        assert guide is not None and guide._hidden_sites is not None
        held = guide._whole_model
        whole = held.resolve() if isinstance(held, _MainReference) else (held[0] if held is not None else None)
        if whole is None or guide.master is None:
            raise RuntimeError(
                f"this {type(guide).__name__} is a part of an AutoGuideList with sites hidden from it "
                f"({list(guide._hidden_sites[1])}), and it was unpickled without the list's model (a lambda, a "
                "closure or a function the loading script does not define) or outside its list: it reads those sites "
                "from the whole model. Call guide.attach_whole_model(model) with the list's model after loading."
            )
        hide, _ = guide._hidden_sites
        with poutine.block(hide=list(hide)), poutine.condition(data=guide.hidden_values(args, kwargs)):
            return whole(*args, **kwargs)


class _MainReference:
    """A model (or option) of the ``__main__`` script, looked up in the loading process's ``__main__`` when needed
    (pickle's own reference would make loading fail in a process that does not define it): a function defined at the
    top level, by its name; anything else that pickles with references to ``__main__`` (a model wrapped in Pyro's
    handlers, ``poutine.reparam(model, ...)``, ``poutine.block(model, hide=...)``), by its pickle, loaded on first
    use. Calling it calls what it finds."""

    def __init__(self, qualname: str, data: bytes | None = None) -> None:
        self.qualname = qualname
        self.data = data

    def resolve(self) -> Callable | None:
        if self.data is not None:
            try:
                found = pickle.loads(self.data)
            except (AttributeError, ImportError):  # (pickle's "Can't get attribute 'model' on <module '__main__'>")
                return None
            return found if callable(found) else None
        obj = sys.modules.get("__main__")
        for part in self.qualname.split("."):
            obj = getattr(obj, part, None)
        return obj if callable(obj) else None

    def __call__(self, *args, **kwargs):
        fn = self.resolve()
        if fn is None:
            raise RuntimeError(
                f"'{self.qualname}' was a function of the script that saved this guide (__main__); this process's "
                "__main__ does not define it. Define (or import) it at the top level of the loading script."
            )
        return fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"__main__.{self.qualname} (looked up when used)"


def _portable(obj: Callable) -> Callable | _MainReference | None:
    """What of ``obj`` can travel in a pickle to another process: ``obj`` itself when it pickles without referring
    to ``__main__``; a :class:`_MainReference` for a function defined at the top level of ``__main__`` or anything
    else whose pickle refers to ``__main__``; else (a lambda, a closure) ``None``."""
    try:
        data = pickle.dumps(obj)
    except Exception:  # lambdas, closures, local classes: pickle refuses them
        data = None
    if data is not None and b"__main__" not in data:
        return obj
    if isinstance(obj, types.FunctionType) and obj.__module__ == "__main__" and "<" not in obj.__qualname__:
        return _MainReference(obj.__qualname__)
    if data is not None:  # (a model of __main__ in Pyro's handlers: its pickle, loaded where the script defines it)
        return _MainReference(str(getattr(obj, "__qualname__", type(obj).__qualname__)), data)
    return None


def _portable_callable(value):
    """A user's option as it travels in a pickle: a function of ``__main__`` as a :class:`_MainReference`, anything
    else as it is (a lambda then fails to pickle, as it does in Pyro's autoguides)."""
    if not callable(value) or isinstance(value, _MainReference):
        return value
    portable = _portable(value)
    return value if portable is None else portable


def _latent_trace(trace: poutine.Trace, structure: ModelStructure) -> poutine.Trace:
    """A copy of ``trace`` with the latent sites only (no plates, observations or deterministic sites), as the
    prototype traces of Pyro's autoguides are."""
    latent = trace.copy()
    for name in list(latent.nodes):
        if name not in structure.latent:
            latent.remove_node(name)
    return latent


def strip_trailing_ones(shape: Iterable[int], n: int) -> torch.Size:
    """``shape`` without its last ``n`` dims, which must be 1 (a site's batch shape seen through its event dims)."""
    shape = list(shape)
    k = min(n, len(shape))
    if any(s != 1 for s in shape[len(shape) - k :]):
        raise RuntimeError(f"internal error: expected trailing singleton dims in {shape}")
    return torch.Size(shape[: len(shape) - k])


def parameter_keys(names: Iterable[str]) -> dict[str, str]:
    """A parameter or module name for each of ``names`` (site or level names, which Pyro lets contain ``"."``;
    ``torch`` refuses it in parameter names): dots become underscores, a name that is an attribute of modules
    (``"items"``, ``"forward"``, …) gets a trailing underscore, and a name that would then equal another's gets a
    numeric suffix, so distinct names never share parameters.

    Example::

        parameter_keys(["linear.weight", "linear_weight", "z"])  # {..: "linear_weight", ..: "linear_weight_1", ..}
    """
    keys: dict[str, str] = {}
    taken: set[str] = set()
    names = list(names)
    for name in sorted(names, key=lambda n: "." in n):  # names without dots keep their own key
        key = base = module_key(name)  # "items" -> "items_", "a.b" -> "a_b"
        k = 0
        while key in taken:
            k += 1
            key = f"{base}_{k}"
        keys[name] = key
        taken.add(key)
    return {name: keys[name] for name in names}


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


def concat_broadcast(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along the last dim after broadcasting all leading dims."""
    shapes = [t.shape[:-1] for t in tensors]
    if all(shape == shapes[0] for shape in shapes):  # (torch.broadcast_shapes costs ~0.6 ms a call)
        return torch.cat(tensors, dim=-1)
    batch = torch.broadcast_shapes(*shapes)
    return torch.cat([t.expand(batch + t.shape[-1:]) for t in tensors], dim=-1)


def stored_param(module: PyroModule, name: str) -> torch.Tensor:
    """``module.<name>`` (a real-valued ``PyroParam``) for a call of a guide without gradients, outside ``torch.jit``
    tracing (the caller checks both): the param store's tensor itself when it is the one the module holds (the value
    ``pyro.param`` would return, without the statement through every handler, which would record it for nothing:
    ``Predictive`` calls the guide once per draw); otherwise read through Pyro, which adopts the store's tensor (e.g.
    after ``pyro.get_param_store().load``).

    Example::

        with torch.no_grad():
            loc = stored_param(guide.locs, "z")  # the store's tensor, no pyro.param statement
    """
    if module._pyro_context.active:
        raw = module._parameters.get(f"{name}_unconstrained")
        constraint = module._pyro_params.get(name, (None,))[0]
        store = pyro.get_param_store()
        if (
            raw is not None
            and constraint is constraints.real
            and store._params.get(module._pyro_get_fullname(name)) is raw
        ):
            return raw
    return getattr(module, name)

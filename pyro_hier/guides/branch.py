"""Branch Gaussian guides: the posterior's factorisation over the plate tree, copied into the variational family."""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer.autoguide.initialization import init_to_feasible
from pyro.nn import PyroModule, PyroParam
from pyro.poutine.block_messenger import BlockMessenger
from pyro.poutine.runtime import _PYRO_STACK, am_i_wrapped
from pyro.poutine.trace_messenger import TraceMessenger
from torch.distributions import biject_to, constraints

from pyro_hier.conjugate import (
    GaussianPrior,
    capture_priors,
    conditional_mode,
    conjugate_conditional,
    conjugate_offset,
    element_expansion,
    gaussian_prior,
    joint_expansion,
    levels_expansion,
    line_searched_mean,
    newton_mean,
    psd_root,
    rebase,
    smoothed_expansion,
)
from pyro_hier.distributions import (
    CholeskyPrecisionNormal,
    ConjugateNormal,
    ConjugateScorer,
    StickingTheLanding,
    unwrap,
)
from pyro_hier.gather_maps import CallGathers, GatherMaps, full_call_gathers, full_data_call
from pyro_hier.gathers import keep_random_state
from pyro_hier.guides.base import HierarchicalGuide, concat_broadcast, stored_param
from pyro_hier.optim import tail_average_update
from pyro_hier.plates import PlateCall, element_selection, enter_plates, plate_indices, row_blocks
from pyro_hier.sparse import select_elements
from pyro_hier.structure import ModelStructure, PlateLevel, StructureError
from pyro_hier.transforms import positive, positive_inv, raw_from_scale_tril, scale_tril_from_raw

__all__ = ["AutoBranchGuide"]

_COVARIANCES = ("dense", "block", "diagonal")
_CONDITIONALS = ("conjugate", "linear")
#: a conjugate level's reference (prior and expansion at the variational mean) is redone after this many training calls
#: of its elements (on average over a call's elements)
REFERENCE_EVERY = 10
#: the same for the levels whose rows the model draws at random (``pyro.plate("data", N, subsample_size=B)``): each
#: redo reads every row, ``N/B`` runs of the model, where neither q (its pseudo-observation moves with the globals by
#: its slopes) nor the rows' control variate (unbiased from any reference) needs it more often (radon-rows, 5,000 steps:
#: CPU 2.24x AutoNormal's at 10 calls, 1.89x at 40; max error on seed 0 0.13 and 0.16 in two runs at 10, 0.20, 0.20,
#: 0.16 on seeds 0-2 at 40; AutoNormal 0.79-0.82)
ROW_REFERENCE_EVERY = 40
#: a conjugate level's element whose reference moved by less than this (relative change of its curvature's root and of
#: the prior conditional's precision, change of the prior's mean in its sds) when redone on a training call waits twice
#: as many calls for the next one, up to :data:`REFERENCE_BACKOFF` times :data:`REFERENCE_EVERY`; one that moved more
#: waits half as many, down to :data:`REFERENCE_EVERY` (levels whose pseudo-observation moves with the globals, whose
#: slopes are reread with the references, always wait :data:`REFERENCE_EVERY`, unless their rows are drawn at random)
REFERENCE_TOLERANCE = 0.05
#: the longest wait between references, in units of :data:`REFERENCE_EVERY`
REFERENCE_BACKOFF = 64
#: of the references redone, one in this many also rereads the pseudo-observations' slopes on the globals (2 model
#: expansions per global coordinate: the costliest part), and every first one
SLOPES_EVERY = 5
#: half-width (in the globals' sds under q) of the central differences that read a conjugate level's slopes where the
#: rest of the model is quadratic in it: the three-point Gauss–Hermite rule's nodes
SLOPE_NODES = math.sqrt(3.0)
#: the same where it is not (binomial, Poisson observations): a derivative at the globals' mean
DERIVATIVE_STEP = 1e-2
#: the reference curvature's eigenvalues are kept above this fraction of the prior conditional's precision: where the
#: likelihood is flat or not log-concave (a group without data; a location and a log scale whose joint log likelihood
#: is not concave) the pseudo-observation starts nearly uninformative, and its reference stays invertible in float32
CURVATURE_FLOOR = 1e-2
#: line-searched Newton steps (at most) that take a new element of a level whose likelihood is not Gaussian in it to
#: its conditional mode before its first smoothed step (``smoothed_expansion``), and the step (in prior sds) below
#: which they stop
REFERENCE_NEWTON_STEPS = 8
REFERENCE_NEWTON_TOLERANCE = 1e-6  # (in float32 no finer than 1e-3: the gradient's rounding)
#: the smoothed step's length (1: the pseudo-observation set to the averaged expansion; below: its natural parameters
#: moved that fraction of the way). On 20 one-dimensional logistic groups of 10 observations, 1 cycles between 0.09
#: and 0.14 of the groups' sds from the Gaussian optimum and 0.5 (with 4 first steps) converges to 0.02-0.03; on
#: crossover.py's logistic problem (10^3 groups of 100 observations, d = 5) 1 reached 0.1 sd in 4.6 CPU s and 0.5 in
#: about 14 s (the groups follow the globals' early moves at half the pace)
SMOOTHED_STEP = 1.0
#: smoothed steps taken at once when a call has elements without a reference yet (from their conditional mode)
SMOOTHED_FIRST_STEPS = 1
#: fraction of the training steps so far that the globals' tail average remembers
TAIL_FRACTION = 0.25
#: per training call, the factor by which the control variate's secant sums of the shared curvature forget
SECANT_DECAY = 0.9
#: numbers of the levels' per-draw conditional covariances that :meth:`AutoBranchGuide.level_moments` holds at once
#: (summed over the draws taken together): beyond, its draws are taken in chunks
SUMMARY_NUMBERS = 2**24


class AutoBranchGuide(HierarchicalGuide):
    r"""Branch Gaussian family of Agrawal & Domke (2021): a drop-in for ``AutoNormal`` that keeps how each group's
    latents depend on the population parameters.

    The model's continuous latent sites are grouped into *plate levels* (sites sharing one set of plates, see
    :meth:`pyro_hier.structure.ModelStructure.plate_levels`); a level's element vector :math:`u_i` concatenates its
    sites' unconstrained values at plate element :math:`i`. With :math:`u_{\mathrm{anc}(i)}` the values of the
    levels whose plates are a strict subset (the globals in a two-level model; the enclosing plates' levels too in
    nested models, so the family is a tree) the guide is

    .. math::

        q(u) = \mathcal N(u_0;\ \mu_0, L_0 L_0^\top)\ \prod_{\ell}\prod_{i} \mathcal N\big(u_{\ell,i};\
               \mu_{\ell,i} + A_{\ell,i}\, u_{\mathrm{anc}(\ell, i)},\ L_{\ell,i}L_{\ell,i}^\top\big)

    - ``covariance="dense"``: as written (the paper's *dense branch*; it contains the exact posterior of a
      linear-Gaussian hierarchical model);
    - ``"block"``: :math:`A = 0` (a full covariance per element, no dependence on the parents);
    - ``"diagonal"``: :math:`A = 0`, diagonal :math:`L` for every level, globals included (mean field).

    That is ``conditional="linear"``. The default, ``conditional="conjugate"``, replaces the linear conditional of
    every level whose prior conditional is Gaussian in unconstrained space (``Normal``, ``LogNormal``,
    ``MultivariateNormal`` given the parents: the county effects of radon, the schools of eight schools, most
    random effects) by that prior conditional, *taken from the model at the parents' sampled values*, times a learnt
    Gaussian pseudo-observation (:mod:`pyro_hier.conjugate`):

    .. math::

        q(u_{\ell,i} \mid \mathrm{pa}) \propto p(u_{\ell,i} \mid \mathrm{pa})\;
        \mathcal N\big(t_{\ell,i}(z);\ u_{\ell,i},\ \Lambda_{\ell,i}(z)^{-1}\big),

    with :math:`\theta` the globals' draw (``"dense"``: the pseudo-observation moves with the globals, at the slopes of
    the likelihood's own pseudo-observation, read from the model; ``"block"``, ``"diagonal"``: it does not). This family
    contains the exact posterior conditional of Gaussian hierarchies *whatever the globals are* — the funnel of a
    centred model included — where the linear conditional can only be right near one value of the scale parameters. Each
    group starts at one (line-searched) Newton step to its conditional posterior mean, and its pseudo-observation at the
    likelihood's own curvature (Laplace-style); the reference of both is redone every ``REFERENCE_EVERY`` of the group's
    training calls with the parameters moved so that q does not change — so minibatches of groups train as full-data
    steps do — and up to ``REFERENCE_BACKOFF`` times less often while a redo moves it by less than
    ``REFERENCE_TOLERANCE`` (where the pseudo-observation has no slopes on the globals; MovieLens's 20-dimensional
    users: a reference is 21 passes through the model). Sticking the landing (default ``None``) is used for these
    levels, whose family can match the posterior, and not for the globals. The globals' parameters are
    Polyak-averaged over the last quarter of the training calls
    (from their gradient hooks: any loop, eager or JIT); calls without gradients (``Predictive``, ``median``,
    ``quantiles``) use the average. The references, the call count and the averages are parameters without gradients, so
    the param store, ``state_dict`` and pickling carry them. ``median``/``quantiles`` of conjugate levels (and levels
    below them) are computed from ``num_summary_samples`` draws with a fixed seed; the globals' are exact. Under JIT
    ELBOs the references are made on Pyro's first, untraced call and held. Levels that are not Gaussian given their
    parents, and levels with enumerated parents, keep the linear conditional.

    In the issue-19 loop (ClippedAdam 0.01 → 0.001 over 5,000 steps, one particle, ``Predictive``, 3 seeds), the
    default reaches a max posterior-mean error of at most 0.13 sd on Minnesota radon (both priors; AutoNormal 0.68),
    0.09 on centred and non-centred eight schools (AutoNormal 1.19, 0.20), and 0.09 on radon at rate 0.05;
    on minibatches of 100 of 1,000 groups of the synthetic regression, 0.42 nats/group from the exact evidence after
    2,000 steps (``conditional="linear"``: 2.4); benchmarks/dropin.py, benchmarks/README.md.

    Models that draw their rows of observations at random (a flat plate gathering group effects by index,
    ``pyro.plate("data", N, subsample_size=B)``: Pyro's big-data examples) score :math:`B` rows a call scaled by
    :math:`N/B`, and Adam's one-particle steps on each group's pseudo-observation carried that noise: on radon with 100
    of its 919 homes drawn a call (``radon-rows`` of ``benchmarks/dropin.py``, seed 0) the county scale ended 1.2 sd
    low (max error 1.18; AutoNormal 0.78). There the conjugate levels' references read every row (block by block,
    :func:`pyro_hier.plates.row_blocks`), and the levels are set by them, not by the optimiser (:meth:`_set_by_steps`:
    where the likelihood is Gaussian in the level the reference is its exact pseudo-observation, elsewhere a smoothed
    step), redone less often while they hardly move; the ELBO's gradient carries the rows' control variate
    (:meth:`_row_variate_term`: their second-order expansion in every such level and the globals, read from every row
    at one reference point, less the same from the call's rows, read by one run of the model a call however many
    levels the rows gather: crossed students and questions alike). Radon-rows, seed 0: 0.43 with the levels so set,
    0.17 with the variate as well.

    Sds (diagonals of Cholesky factors) are :math:`e^r` of free parameters (:func:`pyro_hier.transforms.positive`):
    an Adam step changes :math:`\log s` by about the learning rate, so a posterior sd ten times larger or smaller
    than ``init_scale`` is reached in about :math:`\ln 10/\mathrm{lr}` steps, as fast as ``AutoNormal`` or faster.
    On minibatches of groups a conjugate level's mean is kept in units of its sd (``mean_units``, :meth:`_level_mean`):
    an Adam step moves it by about the learning rate times the group's sd, however narrow its posterior.
    Values are mapped to each site's support with ``biject_to`` and the log-Jacobian enters the density, as in
    ``AutoNormal``.

    Per-element parameters have the plates' **full** sizes and are ``PyroParam``\ s with an ``event_dim``, so the
    model's own subsample indices (``pyro.plate(name, N, subsample=idx)``, honoured automatically) slice them; the
    minibatch ELBO is then the unbiased estimator of the paper's eq. 10. The guide selects the minibatch's rows itself
    (:func:`pyro_hier.sparse.select_elements`): with :class:`pyro_hier.optim.LazyAdam` (``pyro_hier.optim.Adam`` /
    ``ClippedAdam`` for ``SVI``) their gradient is sparse and a step reads and writes only the minibatch's rows, so its
    cost does not grow with the number of groups; other optimisers get the usual dense gradient, zero outside the
    minibatch (Adam's momentum then still moves the groups seen in earlier steps). Memory grows with the number of
    groups — ``d²`` numbers per group for ``"dense"`` — which is what ``AutoAmortizedBranchGuide`` avoids.

    Example::

        guide = AutoBranchGuide(model)                     # instead of AutoNormal(model)
        svi = SVI(model, guide, pyro_hier.optim.Adam({"lr": 0.01}), Trace_ELBO())  # or pyro.optim.Adam
        for step in range(2000):
            svi.step(x, y, subsample=torch.randperm(N)[:100])
        guide.median(x, y); guide.quantiles([0.05, 0.95], x, y)

    :param model: a Pyro model; discrete latent sites must be enumerated (the guide covers the continuous ones).
    :param covariance: ``"dense"``, ``"block"`` or ``"diagonal"``.
    :param init_loc_fn: initial locations (as in ``AutoNormal``).
    :param init_scale: initial standard deviation of every unconstrained coordinate (of the linear levels: the
        conjugate levels start at their Laplace conditional).
    :param create_plates: optional plates to use instead of the model's (as in ``AutoNormal``).
    :param conditional: ``"conjugate"`` (default) or ``"linear"`` (the paper's family; :meth:`conditional` and
        :meth:`set_conditional` describe it).
    :param stick_the_landing: score the guide's samples with detached parameters
        (:class:`~pyro_hier.distributions.StickingTheLanding`). The ELBO gradient stays unbiased and its variance
        vanishes where q equals the posterior. ``None`` (default): on the conjugate levels, whose family can
        match the posterior, and on the globals in the training calls where the control variate is on (minibatches
        of a conjugate level's elements: the globals' gradient noise left is then their own draw's, which this
        removes where their Gaussian matches); ``True``: every level (benchmarks/README.md: dense linear at
        N = 1,000, 0.30 → 0.013 nats/group); ``False``: Pyro's standard reparameterised gradient everywhere. Far
        from a match it adds noise: on eight schools's globals (full-data steps) it slowed convergence.
    :param num_summary_samples: draws behind ``median`` and ``quantiles`` of the levels that have no closed-form
        marginal (conjugate levels and those below them).
    :param control_variate: on training calls that subsample a conjugate level whose only ancestor is the globals,
        add a zero-valued SAGA control variate to the globals' gradient (:meth:`_control_variate_term`): each
        element's last gradient in the globals is kept (``references.<level>__cv_gradient``, full size, ``d_g``
        numbers per element, with the draw it was taken at), the minibatch's sum is replaced by the table's sum
        corrected by the minibatch, and what is left of the minibatch noise is how much each element's gradient
        changed since its last visit. The ELBO's value, ``Predictive`` and calls without gradients are unchanged.
        Measured on the synthetic regression (benchmarks/crossover.py, defaults, CPU s to 0.1 sd over θ and every
        z_i): 10^3 groups 36.8 → 18.4 s; 10^4 194 → 194 s (final error 0.006 sd); 10^5 not reached in 740 s either
        way (final 0.256 → 0.151 sd). Cost: about 30% more per step on minibatches of 20 radon counties, none seen
        at 10^4 groups a step.

    :param mean_units: keep a conjugate level's mean in units of q's sd at the element's reference
        (:meth:`_level_mean`), so that an Adam step moves it by about the learning rate times the element's sd
        (with a plain mean, about the rate whatever the sd). ``None`` (default): in units for the conjugate levels
        whose plate the model subsamples (minibatches of groups, seen on the guide's first call) and whose own
        observations are Normal, plain otherwise; ``True``/``False``: every conjugate level. A subsampled group
        gets a step only when its minibatch comes, and with a plain mean that step is the rate whatever its sd: on
        the synthetic regression (groups of 100 observations, sd about 0.1, rate 0.05) the groups' means stayed 0.3
        sd off (rms over 1,000 groups; 0.09 in units), and benchmarks/crossover.py (minibatches of 100) reached 0.1 sd
        at 10^3 groups in 24.3 CPU s in units at the rate 0.05 and 9.2 s at 0.01 (plain: 42.2 and 16.0) and at 10^5
        in 588 s (plain: not within 740 s; NumPyro's NUTS is about 7,400 s there). With full-data steps every
        group moves on every step, and in units radon (Uniform priors, seed 0, drop-in loop) gave 0.094 at the rate
        0.05 and 0.075 at 0.01 but 0.76 at 0.005 (plain: 0.30): hence plain there. On a hierarchical logistic
        regression on minibatches (crossover.py's, 10^3 groups) units were worse: max error 1.1 sd after 80 CPU s at
        the rate 0.05 and 4.5 at 0.01 (plain: 0.19), so levels with non-Gaussian observations stay plain.
    :param smoothed_expansion: for the conjugate levels whose likelihood is not Gaussian in them (the rest of the
        model is not quadratic: logistic, binomial, Poisson observations; found on the first call), set the
        pseudo-observation on each reference redo to the rest's expansion *averaged over q* rather than keep q
        (:meth:`_smoothed_step`: :math:`\bar\Lambda = E_q[F]`, :math:`\bar\Lambda\bar t = E_q[g] + E_q[F]\,m`,
        the ELBO's fixed point for a Gaussian q, by a 2d-point cubature), new elements starting at their
        conditional mode (line-searched Newton steps, :func:`~pyro_hier.conjugate.conditional_mode`), and let those
        steps alone move the level's parameters (no gradient reaches them: :meth:`_set_by_steps`) — the usual
        stochastic variational inference split, local parameters at their optimum given the globals, the globals by
        stochastic gradient (Hoffman et al. 2013). ``None`` (default): on the conjugate levels whose plate the model
        subsamples (minibatches of groups, seen on the guide's first call); ``True``/``False``: every conjugate level
        or none. On crossover.py's hierarchical logistic regression (10^3 groups, minibatches of 100, eager
        ``Trace_ELBO``) the max error fell below 0.1 sd in 4.6 CPU s and stayed near 0.06 (the reference's own Monte
        Carlo error is about 0.05), where Adam's per-group steps ended at 0.16-0.18 sd after 80 s (NumPyro's NUTS:
        99 s). Not with full-data steps: there every group moves on every step, and the smoothed steps, taken at
        the globals' mean, miss how q of a group changes over the globals' spread, which matters where the globals
        are uncertain (cbpp, 15 herds, binomial, drop-in loop, seed 0: 0.53 sd with them, 0.12 without; AutoNormal
        0.23). The references are redone only in calls the guide runs in Python:
        under ``JitTrace_ELBO`` they are held from the first call and the parameters keep their gradient, so train
        such models eagerly. Levels whose likelihood is Gaussian are unchanged (their pseudo-observation is the
        likelihood itself).

    References: A. Agrawal, J. Domke, *Amortized Variational Inference for Simple Hierarchical Models*, NeurIPS 2021;
    G. Roeder, Y. Wu, D. Duvenaud, *Sticking the Landing*, NeurIPS 2017; B. Polyak, A. Juditsky, *Acceleration of
    Stochastic Approximation by Averaging*, SIAM J. Control Optim. 1992; M. D. Hoffman, D. M. Blei, C. Wang,
    J. Paisley, *Stochastic Variational Inference*, JMLR 2013; M. E. Khan, W. Lin, *Conjugate-Computation Variational
    Inference*, AISTATS 2017.
    """

    def __init__(
        self,
        model: Callable,
        *,
        covariance: str = "dense",
        conditional: str = "conjugate",
        init_loc_fn: Callable = init_to_feasible,
        init_scale: float = 0.1,
        create_plates: Callable | None = None,
        stick_the_landing: bool | None = None,
        num_summary_samples: int = 1000,
        control_variate: bool = True,
        mean_units: bool | None = None,
        smoothed_expansion: bool | None = None,
    ) -> None:
        if smoothed_expansion is not None and not isinstance(smoothed_expansion, bool):
            raise ValueError(f"smoothed_expansion must be None, True or False, got {smoothed_expansion!r}")
        if mean_units is not None and not isinstance(mean_units, bool):
            raise ValueError(f"mean_units must be None, True or False, got {mean_units!r}")
        if not isinstance(control_variate, bool):
            raise ValueError(f"control_variate must be True or False, got {control_variate!r}")
        if not (isinstance(num_summary_samples, int) and num_summary_samples > 1):
            raise ValueError(f"num_summary_samples must be an integer above 1, got {num_summary_samples!r}")
        if covariance not in _COVARIANCES:
            raise ValueError(f"covariance must be one of {_COVARIANCES}, got {covariance!r}")
        if conditional not in _CONDITIONALS:
            raise ValueError(f"conditional must be one of {_CONDITIONALS}, got {conditional!r}")
        if not (isinstance(init_scale, int | float) and init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"init_scale must be a positive number, got {init_scale!r}")
        if stick_the_landing is not None and not isinstance(stick_the_landing, bool):
            raise ValueError(f"stick_the_landing must be None, True or False, got {stick_the_landing!r}")
        self.covariance = covariance
        self.conditional_form = conditional
        self.stick_the_landing = stick_the_landing
        self.num_summary_samples = num_summary_samples
        self.control_variate = control_variate
        self.mean_units = mean_units
        self.smoothed_expansion = smoothed_expansion
        self._init_scale = float(init_scale)
        super().__init__(model, init_loc_fn=init_loc_fn, create_plates=create_plates)

    # ---- parameters ---------------------------------------------------------------------------------------------
    def _setup_guide(self, structure: ModelStructure) -> None:
        self.levels: tuple[PlateLevel, ...] = structure.plate_levels(self.guide_sites)
        self._levels = {level.name: level for level in self.levels}
        self._gather_maps: GatherMaps | None = None
        needed = [(link.site, link.plate) for level in self.levels for link in level.links]
        needed += self._gathered_data(structure)
        if needed:  # gathered ancestors (or data): which elements are read is found per call
            self._gather_maps = GatherMaps(structure, self.model)
            for site, plate in needed:
                self._gather_maps.require(site, plate)
        self._gathers: CallGathers | None = None  # during a call (or a summary): where gathered ancestors are
        self._global_level = next((level for level in self.levels if not level.plates), None)
        self.conjugate_levels: tuple[str, ...] = tuple(
            level.name for level in self.levels if self._may_be_conjugate(level, structure)
        )
        subsampled = set(structure.subsampled_plates)
        self._units_levels: frozenset[str] = frozenset(
            level.name
            for level in self.levels
            if level.name in self.conjugate_levels
            and (
                self.mean_units
                or (
                    self.mean_units is None
                    and subsampled.intersection(level.plates)
                    and self._gaussian_observations(level, structure)
                )
            )
        )
        #: conjugate levels whose likelihood's rows the model draws at random (a flat plate of observations with
        #: ``subsample_size=``): set by their references, not by the optimiser (:meth:`_set_by_steps`)
        self._row_levels: frozenset[str] = frozenset(self.conjugate_levels if self.random_row_plates() else ())
        #: conjugate levels that take smoothed steps where their likelihood is not Gaussian (smoothed_expansion)
        self._smoothed_levels: frozenset[str] = frozenset(
            name
            for name in self.conjugate_levels
            if self.smoothed_expansion
            or (
                self.smoothed_expansion is None
                and (subsampled.intersection(self._levels[name].plates) or name in self._row_levels)
            )
        )
        self.locs = PyroModule()
        self.weights = PyroModule()
        self.stretches = PyroModule()  # conjugate levels, dense: how the pseudo-observation's precision moves
        self.scale_trils = PyroModule()
        self.scales = PyroModule()
        # state that is not optimised but is part of q, kept as parameters without gradients so that the param store,
        # state_dict and pickling all carry it: the conjugate levels' references (full size) and the training-call
        # count that dates them; the tail average of the globals' parameters and its count
        self.references = PyroModule()
        self.averages = PyroModule()
        self._hooked: dict[str, weakref.ref] = {}
        self._refreshes: dict[str, int] = {}  # references redone per conjugate level (in this process)
        self._quadratic: dict[str, bool] = {}  # conjugate level -> the rest of the model is quadratic in it
        self._slopes_read: dict[str, bool] = {}  # conjugate level -> its slopes are read from the model
        self._globals_stick = False  # (this call: sticking the landing on the globals, see forward)
        self._per_element_globals: dict[str, bool] = {}  # level -> the model takes the globals per element (checked)
        for level in self.levels:
            if level.name in self.conjugate_levels:
                self._setup_conjugate_level(level, self._init_level(level))
            else:
                self._setup_level(level, self._init_level(level))
        prototype = next(iter(self.locs.parameters()), None)
        if prototype is not None:
            like = prototype.detach()
            self.references.training_calls = PyroParam(like.new_zeros(()), constraints.real)
            _ = self.references.training_calls  # (read once: a trace of this call records the parameter, not its init)
            if self._global_level is not None:
                for key, value in self._global_leaves().items():
                    setattr(self.averages, key, PyroParam(value.detach().clone(), constraints.real))
                    getattr(self.averages, key)  # (read once: a trace of this call records the parameter, not its init)
                self.averages.count = PyroParam(like.new_zeros(()), constraints.real)
                _ = self.averages.count  # (read once, as above: no call of a training step reads it since)

    def _setup_level(self, level: PlateLevel, init: torch.Tensor) -> None:
        """Create the free parameters of one level from its initial element vectors ``init``."""
        d = level.numel
        setattr(self.locs, level.name, PyroParam(init, constraints.real, event_dim=1))
        if self._is_diagonal(level):
            raw = positive_inv(torch.full_like(init, self._init_scale))
            setattr(self.scales, level.name, PyroParam(raw, constraints.real, event_dim=1))
        else:
            eye = torch.eye(d, dtype=init.dtype, device=init.device)
            raw = math.log(self._init_scale) * eye  # positive_inv(init_scale) on the diagonal
            raw = raw.expand((*level.batch_shape, d, d)).clone()
            setattr(self.scale_trils, level.name, PyroParam(raw, constraints.real, event_dim=2))
        if self._is_conditional(level):
            d_anc = self._ancestor_numel(level)
            weight = init.new_zeros((*level.batch_shape, d, d_anc))
            setattr(self.weights, level.name, PyroParam(weight, constraints.real, event_dim=2))

    @staticmethod
    def _gaussian_observations(level: PlateLevel, structure: ModelStructure) -> bool:
        """Whether the level has observations of its own (observed sites with one of its sites as a parent) and all of
        them are Normal (behind any ``to_event``, ``expand`` or mask)."""
        observed = [name for name in structure.observed if set(structure.parents[name]) & set(level.sites)]
        return bool(observed) and all(isinstance(unwrap(structure.observed[name].fn), dist.Normal) for name in observed)

    def _may_be_conjugate(self, level: PlateLevel, structure: ModelStructure) -> bool:
        """Whether a level gets the conjugate conditional: a plated level whose sites' prior conditionals are Gaussian
        in unconstrained space (:func:`~pyro_hier.conjugate.gaussian_prior`) and depend on no other site of the level
        nor on a latent the guide does not sample (an enumerated one). A hook: the amortized guide keeps its own
        forms."""
        return self.conditional_form == "conjugate" and self._gaussian_given_parents(level, structure)

    def _gaussian_given_parents(self, level: PlateLevel, structure: ModelStructure) -> bool:
        """Whether a plated level's sites' prior conditionals are Gaussian in unconstrained space
        (:func:`~pyro_hier.conjugate.gaussian_prior`) and depend on no other site of the level nor on a latent the
        guide does not sample (an enumerated one)."""
        if not level.plates:
            return False
        sampled = set(self.guide_sites)
        for name in level.sites:
            site = structure.latent[name]
            if gaussian_prior(site.fn, site.support) is None:
                return False
            parents = set(structure.parents.get(name, ()))
            if parents & set(level.sites) or parents - sampled:
                return False
        return True

    def _setup_conjugate_level(self, level: PlateLevel, init: torch.Tensor) -> None:
        """Parameters and reference buffers of a conjugate level (see :mod:`pyro_hier.conjugate`): the conditional mean
        at the reference ``locs`` and the pseudo-observation's relative factor (``scales``: log of its diagonal, or
        ``scale_trils``: its raw Cholesky factor, both 1 at the start). For ``covariance="dense"`` the references also
        hold how the pseudo-observation moves with the globals (``slope``, ``stretch_slope``), read from the model."""
        d = level.numel
        # (in units: the mean is anchor + unit * the parameter, see _level_mean)
        step = torch.zeros_like(init) if self._in_units(level) else init
        setattr(self.locs, level.name, PyroParam(step, constraints.real, event_dim=1))
        if self._conjugate_diagonal(level):
            setattr(self.scales, level.name, PyroParam(torch.zeros_like(init), constraints.real, event_dim=1))
        else:
            raw = init.new_zeros((*level.batch_shape, d, d))
            setattr(self.scale_trils, level.name, PyroParam(raw, constraints.real, event_dim=2))
        state = {
            "loc": init.new_zeros((*level.batch_shape, d)),
            "precision": init.new_ones((*level.batch_shape, d)),
            "fisher_sd": init.new_ones((*level.batch_shape, d)),
            "visits": init.new_full(tuple(level.batch_shape), -1.0),  # training visits since it was made; -1: none yet
            "backoff": init.new_ones(tuple(level.batch_shape)),  # the next one after this many times REFERENCE_EVERY
        }
        if self._in_units(level):
            state["anchor"], state["unit"] = init.clone(), torch.ones_like(init)
        if self._has_slopes(level):
            d_g = self._global_level.numel
            state["slope"] = init.new_zeros((*level.batch_shape, d, d_g))
            state["stretch_slope"] = init.new_zeros((*level.batch_shape, d, d_g))
        if self._has_control_variate(level):  # each element's last gradient of its term in the globals (SAGA table),
            d_g = self._global_level.numel  # the globals' draw then, and the secant sums of their shared curvature
            state["cv_gradient"] = init.new_zeros((*level.batch_shape, d_g))
            state["cv_point"] = init.new_zeros((*level.batch_shape, d_g))
            state["cv_secant"] = init.new_zeros((2, d_g, d_g))
        if level.name in self._row_levels:  # the rows' expansion at the last reference point (_rows_reference)
            state["rows_gradient"] = init.new_zeros((*level.batch_shape, d))
            state["rows_curvature"] = init.new_zeros((*level.batch_shape, d, d))
            state["rows_centre"] = init.new_zeros((*level.batch_shape, d))
            state["rows_ready"] = init.new_zeros(())
            if self._global_level is not None:
                d_g = self._global_level.numel
                state["rows_cross_curvature"] = init.new_zeros((*level.batch_shape, d, d_g))
            if level.name == self._first_row_level():  # (the point's other levels, and the globals' expansion)
                for other in self.levels:
                    if other.name not in self._row_levels:
                        state[f"rows_at__{other.name}"] = init.new_zeros((*other.batch_shape, other.numel))
                if self._global_level is not None:
                    state["rows_global_gradient"] = init.new_zeros((d_g,))
                    state["rows_global_curvature"] = init.new_zeros((d_g, d_g))
        if not self._conjugate_diagonal(level):
            state["precision"] = init.new_zeros((*level.batch_shape, d, d))
            state["fisher_sd"] = torch.eye(d, dtype=init.dtype, device=init.device).expand((*level.batch_shape, d, d))
            state["fisher_sd"] = state["fisher_sd"].clone()
        for key, value in state.items():
            setattr(self.references, f"{level.name}__{key}", PyroParam(value, constraints.real))
            getattr(self.references, f"{level.name}__{key}")  # (read once: a trace of this call records the parameter)

    def _has_control_variate(self, level: PlateLevel) -> bool:
        """Whether a conjugate level's term in the globals' gradient gets the SAGA control variate
        (:meth:`_control_variate_term`): with ``control_variate=True``, for a conjugate level whose only ancestor is the
        global level (and a model that takes the globals per element, checked on the first training call)."""
        glob = self._global_level
        return (
            self.control_variate
            and level.name in self.conjugate_levels
            and glob is not None
            and glob is not level
            and tuple(level.ancestors) == (glob.name,)
            and self._per_element_globals.get(level.name, True)
        )

    def _has_slopes(self, level: PlateLevel) -> bool:
        """Whether a conjugate level's pseudo-observation moves with the globals (``covariance="dense"``)."""
        return self.covariance == "dense" and self._global_level is not None and self._global_level is not level

    def _level_expander(
        self,
        args: tuple,
        kwargs: dict,
        level: PlateLevel,
        centres: dict[str, torch.Tensor],
        scale: float,
        subsamples: dict[str, torch.Tensor],
        observed: Iterable[str] = (),
        collapse: Callable | None = None,
        rows: dict[str, tuple[int, int]] | None = None,
    ) -> Callable[..., tuple[torch.Tensor, ...]]:
        """``expand(at, u=None, curvature=True, joint=None)``: :func:`~pyro_hier.conjugate.element_expansion` of the
        rest of the model at ``level``'s element vectors ``u`` (by default ``centres[level.name]``, read when called),
        the other latent sites at ``at``, on the call ``args``, ``kwargs`` with the plates' ``subsamples`` (and its
        ``collapse``); ``curvature=False``: the gradient alone; ``joint``: the keyword arguments of
        :func:`~pyro_hier.conjugate.joint_expansion` (with the globals), which it runs instead. Plates of rows Pyro drew
        at random (``rows``, by default those of this call's plates: :meth:`drawn_rows`) are read in full, block by
        block."""
        blocks, given = self._row_blocks(subsamples, rows)

        def expand(
            at: dict, u: torch.Tensor | None = None, curvature: bool = True, joint: dict | None = None
        ) -> tuple[torch.Tensor, ...]:
            total = None
            for block in blocks:  # (a plate of rows drawn at random: its rows block by block, each counted once)
                model = self.model if block is None else block(self.model)
                u_at = centres[level.name] if u is None else u
                to_values = lambda v: self._level_values(level, v)  # noqa: E731
                if joint is not None:  # (with the globals: joint_expansion)
                    part = joint_expansion(
                        model, args, kwargs, at, u_at, to_values, plate_scale=scale, subsamples=given, **joint
                    )
                    total = part if total is None else tuple(a + b for a, b in zip(total, part))
                    continue
                part = element_expansion(
                    model,
                    args,
                    kwargs,
                    at,
                    u_at,
                    to_values,
                    scale,
                    given,
                    observed=observed,
                    collapse=collapse,
                    curvature=curvature,
                )
                total = part if total is None else tuple(a if b is None else a + b for a, b in zip(total, part))
            assert total is not None
            return total

        return expand

    def _slope_nodes(
        self, level: PlateLevel, curvature: torch.Tensor, moved: Callable[[], torch.Tensor]
    ) -> float | None:
        """The central differences' half-width, in the globals' sds under q, at which the pseudo-observation's slopes
        on the globals are read for ``level`` (``None``: no slopes, unless ``covariance="dense"``). Where the rest of
        the model is quadratic in the level — its ``curvature`` at the reference equals ``moved()``, the curvature one
        unit away (Gaussian observations whose mean is linear in the level: radon, eight schools, random slopes) —
        :data:`SLOPE_NODES` (the Gauss–Hermite secant, exact for the globals that enter the mean linearly). Elsewhere
        (a binomial or Poisson mixed model) :data:`DERIVATIVE_STEP`, the derivative at the globals' mean: the secant of
        an exponential family's expansion is dominated by its convex side while q of the globals is still wide, and
        took the groups' scale with it (cbpp's herd scale 1.0 sd low with sd ratio 0.42; epil's subject scale 8 sds
        high), where the derivative gave 0.12 and 0.34 sd at most over every latent. Decided once per level."""
        if not self._reads_slopes(level):
            return None
        return SLOPE_NODES if self._rest_quadratic(level, curvature, moved) else DERIVATIVE_STEP

    def _rest_quadratic(self, level: PlateLevel, curvature: torch.Tensor, moved: Callable[[], torch.Tensor]) -> bool:
        """Whether the rest of the model is quadratic in ``level``: its ``curvature`` at the reference equals
        ``moved()``, the curvature one unit away (Gaussian observations whose mean is linear in the level). Decided
        once per level."""
        if level.name not in self._quadratic:
            tolerance = 1e-6 * float(curvature.abs().max()) + 1e-12
            self._quadratic[level.name] = bool(torch.allclose(moved(), curvature, rtol=1e-4, atol=tolerance))
        return self._quadratic[level.name]

    def _reads_slopes(self, level: PlateLevel) -> bool:
        """Whether a conjugate level's slopes are read from the model (:meth:`_slope_nodes` is not ``None``): where they
        are not, they stay zero. Decided once per level."""
        if level.name not in self._slopes_read:
            self._slopes_read[level.name] = self._has_slopes(level) and self._globals_read_elsewhere(level)
        return self._slopes_read[level.name]

    def _globals_read_elsewhere(self, level: PlateLevel) -> bool:
        """Whether a site of the model other than ``level``'s and the globals' own reads the globals (by the model's
        direct dependencies). If none does, the rest of the model, which :meth:`_pseudo_observation_slopes` expands,
        does not change with the globals: the slopes are zero and are not read (2 full-data expansions per global
        coordinate saved: on the synthetic regression's first call at 10^5 groups, most of its 128 s). Where the
        dependencies cannot be traced, they are read."""
        assert self.structure is not None and self._global_level is not None
        own = set(level.sites) | set(self._global_level.sites)
        try:
            parents = self.structure.parents
        except StructureError:
            return True
        return any(set(p) & set(self._global_level.sites) for site, p in parents.items() if site not in own)

    def _conjugate_diagonal(self, level: PlateLevel) -> bool:
        return self._is_diagonal(level) or level.numel == 1

    def _reference(self, level: PlateLevel, key: str, plates: dict | None, event_dim: int) -> torch.Tensor:
        value = self._param(self.references, f"{level.name}__{key}").detach()
        if plates is None:
            return value
        return select_elements(value, element_selection(plates, level.plates, level.dims), event_dim)

    def _write_elements(
        self, params: PyroModule, key: str, level: PlateLevel, plates: dict, value: torch.Tensor, event_dim: int
    ) -> None:
        """Write ``value`` (the call's elements) into the full-size parameter ``params.key`` at the call's elements,
        in place and without gradient (references, and conjugate levels' parameters on a new reference)."""
        buffer = _state_tensor(self._param(params, key))
        index = _element_index(buffer, element_selection(plates, level.plates, level.dims), event_dim)
        buffer[index] = value.to(buffer.dtype).expand(buffer[index].shape)

    #: during a call of the guide: its parameters as read through Pyro on this call (see :meth:`_param`)
    _call_cache: dict | None = None
    #: during a call of the guide: the call has no gradients and is not traced by ``torch.jit`` (see :meth:`_param`)
    _call_untraced: bool = False
    #: during a call of the guide: neither traced by ``torch.jit`` nor Pyro's first call of a compiled function
    _call_eager: bool = False

    def _param(self, params: PyroModule, key: str) -> torch.Tensor:
        """``params.<key>``, read through Pyro (``pyro.param``: the param store's tensor, recorded by the handlers) on
        its first read in a call of the guide, and the same tensor on later reads in that call: each read is otherwise
        another ``pyro.param`` statement through every handler (62 a training step on the three-level model before;
        the parameters are not replaced during a call, and in-place writes go to the same tensor). In a call without
        gradients (``Predictive``'s) the store's tensor is taken as it is when the module holds it already
        (:func:`~pyro_hier.guides.base.stored_param`): nothing optimises what such a call reads. (A training call
        reads every optimised parameter through Pyro, also where it first reads one without gradients, as the
        references' redo does: ``SVI`` steps what the call's trace records.) The references, state that no gradient
        reaches, are read as the store's tensor in training calls too (26 ``pyro.param`` statements a training call of
        a crossed model whose rows are drawn at random, each through every handler, and as many parameters for
        ``SVI``'s optimiser to skip), except in Pyro's first, untraced call of a compiled (JIT) function
        (:func:`_jit_param_capture`), which records the parameters its trace will take as inputs, and in the traced
        call."""
        cache = self._call_cache
        if cache is None:
            return getattr(params, key)
        entry = (id(params), key)
        value = cache.get(entry)
        if value is None:
            stored = self._call_untraced or (params is self.references and self._call_eager)
            value = cache[entry] = stored_param(params, key) if stored else getattr(params, key)
        return value

    def _training(self) -> bool:
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())

    @torch.no_grad()
    def _refresh_references(self, args: tuple, kwargs: dict, plates: dict, training: bool) -> None:
        """Redo the reference of the conjugate levels' elements of this call when one has none yet, or when they have
        been in :data:`REFERENCE_EVERY` training calls on average since theirs was made (a group of a minibatch is
        thus redone after as many of its own visits as a group of full-data steps): the prior conditionals and the
        expansion of the rest of the model at the globals' variational mean and every level's reference mean
        (:mod:`pyro_hier.conjugate`). The level's parameters are moved to the new reference without changing q."""
        stale = []
        for name in self.conjugate_levels:
            level = self._levels[name]
            every = all(ix is None for ix in element_selection(plates, level.plates, level.dims).values())
            if training and every:  # (full-data steps: every element counted in place)
                buffer = _state_tensor(self._param(self.references, f"{name}__visits"))
                visits = buffer.add_((buffer >= 0).to(buffer.dtype)).detach()
            else:
                visits = self._reference(level, "visits", plates, 0)
                if training:
                    visits = torch.where(visits >= 0, visits + 1, visits)
                    self._write_elements(self.references, f"{name}__visits", level, plates, visits, 0)
            if bool((visits < 0).any()) or (
                training
                and float((visits / self._reference(level, "backoff", plates, 0)).mean())
                >= (ROW_REFERENCE_EVERY if name in self._row_levels else REFERENCE_EVERY)
            ):
                stale.append(level)
        if not stale:
            return
        assert self.structure is not None
        values: dict[str, torch.Tensor] = {}
        centres: dict[str, torch.Tensor] = {}
        for level in self.levels:
            centre = self._level_mean(level, plates).detach()
            if level is self._global_level and self._use_average():
                centre = self._param(self.averages, "loc").detach()
            centres[level.name] = centre
            values.update(self._level_values(level, centre))
        subsamples = plate_indices(plates)
        fns, _ = capture_priors(self.model, args, kwargs, values, [s for lv in stale for s in lv.sites], subsamples)
        for level in stale:
            prior = self._level_prior(level, fns)
            diagonal = self._conjugate_diagonal(level)
            scale = math.prod(self.structure.plates[p].size for p in level.plates) / max(
                1, math.prod(_subsample_size(plates[p]) for p in level.plates)
            )
            p0 = prior.precision if prior.diagonal else prior.precision.diagonal(dim1=-2, dim2=-1)
            floor = CURVATURE_FLOOR * p0

            expand = self._level_expander(args, kwargs, level, centres, scale, subsamples)
            gradient, curvature = expand(values)
            moved_curvature = lambda at=values, u=centres[level.name], f=expand: f(at, u + 1.0)[1]  # noqa: E731
            nodes = self._slope_nodes(level, curvature, moved_curvature)
            had = self._reference(level, "visits", plates, 0) >= 0
            with keep_random_state():  # (where the slopes did not decide it: the model's extra run leaves the state)
                quadratic = self._rest_quadratic(level, curvature, moved_curvature)
            smoothed = level.name in self._smoothed_levels and not quadratic
            if not quadratic and not bool(had.all()):  # new elements start at their conditional mode (Laplace)
                mode, mode_gradient, mode_curvature = conditional_mode(
                    prior,
                    centres[level.name],
                    gradient,
                    curvature,
                    lambda u, curvature=True, at=values, f=expand: f(at, u, curvature=curvature),
                    floor,
                    diagonal,
                    REFERENCE_NEWTON_STEPS,
                    REFERENCE_NEWTON_TOLERANCE if prior.loc.dtype == torch.float64 else 1e-3,
                )
                fresh = ~had.unsqueeze(-1)
                centres[level.name] = torch.where(fresh, mode, centres[level.name])
                gradient = torch.where(fresh, mode_gradient, gradient)
                curvature = torch.where(fresh.unsqueeze(-1), mode_curvature, curvature)
            root = psd_root(curvature, floor) if not diagonal else curvature.diagonal(dim1=-2, dim2=-1).clamp(min=floor)
            root = root if not diagonal else root.sqrt()
            old = tuple(self._reference(level, key, plates, 1 if diagonal else 2) for key in ("precision", "fisher_sd"))
            old = (self._reference(level, "loc", plates, 1), *old)
            new = (prior.loc, p0 if diagonal else prior.full_precision(), root)
            self._rebase_level(
                level,
                plates,
                old,
                new,
                had,
                prior,
                centres[level.name],
                gradient,
                lambda u, at=values, f=expand: f(at, u, curvature=False)[0],
            )
            step = None
            if level.name in self._row_levels and self._set_by_steps(level) and not smoothed:
                # the rest is quadratic and read from every row: q set to the exact conditional at the reference
                target = newton_mean(prior, centres[level.name], gradient, root)
                raw = self.scales if diagonal else self.scale_trils
                unit = torch.zeros_like(self._element_param(raw, level, plates, 1 if diagonal else 2)).detach()
                self._write_level(level, plates, prior, new, target, unit)
            if smoothed:  # q's pseudo-observation set to the rest's expansion averaged over q (a CVI step)
                for _ in range(1 if bool(had.all()) else SMOOTHED_FIRST_STEPS):
                    new, step = self._smoothed_step(
                        level, plates, prior, new, floor, lambda u, at=values, f=expand: f(at, u, curvature=False)[0]
                    )
            if smoothed or not bool(had.all()):  # the next levels' expansions see this one's new q (crossed effects)
                centres[level.name] = self._level_mean(level, plates).detach()
                values.update(self._level_values(level, centres[level.name]))
            refreshes = self._refreshes.get(level.name, 0)
            self._refreshes[level.name] = refreshes + 1
            if nodes is not None and (refreshes % SLOPES_EVERY == 0 or not bool(had.all())):
                slope, stretch_slope = self._pseudo_observation_slopes(
                    level, values, centres, plates, floor, expand, nodes
                )
                self._write_elements(self.references, f"{level.name}__slope", level, plates, slope, 2)
                self._write_elements(self.references, f"{level.name}__stretch_slope", level, plates, stretch_slope, 2)
            if training:  # back off where the reference hardly moved (q is the same either way: only its coordinates)
                backoff = self._reference(level, "backoff", plates, 0)
                if nodes is None or level.name in self._row_levels:  # (row levels: q set by the redo)
                    still = _reference_change(old, new, diagonal) < REFERENCE_TOLERANCE
                    if step is not None:  # (and q moved little by the smoothed step)
                        still = still & (step < REFERENCE_TOLERANCE)
                    backoff = torch.where(still, (2 * backoff).clamp(max=REFERENCE_BACKOFF), (backoff / 2).clamp(min=1))
                backoff = torch.where(had, backoff, torch.ones_like(backoff))
                self._write_elements(self.references, f"{level.name}__backoff", level, plates, backoff, 0)
            for key, value in zip(("loc", "precision", "fisher_sd"), new, strict=True):
                event_dim = 1 if diagonal or key == "loc" else 2
                self._write_elements(self.references, f"{level.name}__{key}", level, plates, value, event_dim)
            self._write_elements(
                self.references, f"{level.name}__visits", level, plates, torch.zeros_like(had, dtype=prior.loc.dtype), 0
            )
        if any(level.name in self._row_levels for level in stale) and self._rows_read_in_full(plates):
            self._rows_reference(args, kwargs, plates, centres)  # (every row level's, at one point: _row_variate_term)

    def _full_plates(self) -> dict[str, pyro.plate]:
        """The conjugate levels' plates at full size (for the model's call on all the data)."""
        assert self.structure is not None
        names = dict.fromkeys(p for n in self.conjugate_levels for p in self._levels[n].plates)
        return {n: pyro.plate(n, self.structure.plates[n].size, dim=self.structure.plates[n].dim) for n in names}

    def _lacks_references(self, plates: dict) -> bool:
        """Whether a conjugate level has elements with no reference yet while this call subsamples it. Its first such
        call then makes every element's reference from the model's call on all the data, once: a compiled (JIT) loop
        runs Python only on its first call, and in an eager one each group then starts at its Newton step before
        the globals have moved far. Not where Pyro draws the subsample at random (``subsample_size=``): Pyro cannot
        reopen such a plate in full, so its groups get their references as minibatches reach them."""
        for name in self.conjugate_levels:
            level = self._levels[name]
            if set(level.plates) & set(getattr(self, "drawn_plates", ())):
                continue
            subsampled = any(_subsample_size(plates[p]) < self.structure.plates[p].size for p in level.plates)
            if subsampled and bool((self._param(self.references, f"{name}__visits").detach() < 0).any()):
                return True
        return False

    def _level_values(self, level: PlateLevel, u: torch.Tensor) -> dict[str, torch.Tensor]:
        """The constrained values of a level's sites at its unconstrained element vectors ``u``."""
        return {
            site: self._constrain(site, self._site_unconstrained(level, site, u, broadcast=False))
            for site in level.sites
        }

    def _mean_slope(self, level: PlateLevel, plates: dict) -> torch.Tensor:
        """How a conjugate level's conditional mean moves with the globals through its pseudo-observation's shift at
        the reference, :math:`(\bar P_0 + \bar F)^{-1} B`: ``(..., d, d_g)``."""
        diagonal = self._conjugate_diagonal(level)
        slope = self._reference(level, "slope", plates, 2)
        p0 = self._reference(level, "precision", plates, 1 if diagonal else 2)
        root = self._reference(level, "fisher_sd", plates, 1 if diagonal else 2)
        if diagonal:
            return slope / (p0 + root.pow(2)).unsqueeze(-1)
        return torch.linalg.solve(p0 + root @ root.mT, slope)

    def _pseudo_observation_slopes(
        self,
        level: PlateLevel,
        values: dict,
        centres: dict,
        plates: dict,
        floor: torch.Tensor,
        expand: Callable,
        nodes: float = math.sqrt(3.0),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""How the likelihood's own Gaussian pseudo-observation of each element moves with the globals, read from the
        model: its natural parameter :math:`(\Lambda t)(\theta) = F(\theta)\,c + g(\theta)` (the rest of the model's
        curvature and gradient at the element's reference mean ``c``) and the log of its precision's diagonal, by
        central differences over ``nodes`` (default :math:`\pm\sqrt3`) sds of each global coordinate under q — the
        three-point Gauss–Hermite rule for :math:`E_q[\partial (\Lambda t) / \partial \theta]` (Stein's lemma: the
        least-squares slope under q, steeper than the derivative at the mean where the function is convex) —
        ``(slope (..., d, d_g), stretch_slope (..., d, d_g))`` per unit of the globals' unconstrained value. For a
        Gaussian likelihood the first is exact in the globals that enter its mean linearly, and the second in its log
        noise scale (radon: the county's summed residual moves with the floor effect, its precision with the
        noise scale). The conjugate levels before this one are moved along their own slopes meanwhile (crossed
        effects: when the grand mean rises, the row effects' fall takes up the data's residual, and the column
        effects' do not fall by as much again)."""
        assert self._global_level is not None
        glob = self._global_level
        centre = centres[level.name]
        loc, _, scale = self._level_params(glob, None)
        loc, sd = loc.detach(), self._row_scale(glob, scale).detach() * nodes
        earlier = [
            (lv, self._mean_slope(lv, plates))
            for lv in self.levels[: self.levels.index(level)]
            if lv.name in self.conjugate_levels and self._has_slopes(lv)
        ]
        diagonal = self._conjugate_diagonal(level)
        targets, logs = [], []
        for k in range(glob.numel):
            pair = []
            for sign in (1.0, -1.0):
                shifted = loc.clone()
                shifted[..., k] += sign * sd[..., k]
                moved = {**values, **self._level_values(glob, shifted)}
                for lv, mean_slope in earlier:
                    moved.update(self._level_values(lv, centres[lv.name] + mean_slope[..., k] * (sign * sd[..., k])))
                gradient, curvature = expand(moved)
                natural = (curvature @ centre.unsqueeze(-1)).squeeze(-1) + gradient  # F c + g: Λt of the expansion
                if diagonal:
                    natural = curvature.diagonal(dim1=-2, dim2=-1) * centre + gradient
                info = curvature.diagonal(dim1=-2, dim2=-1).clamp(min=floor)
                pair.append((natural, info.log()))
            targets.append((pair[0][0] - pair[1][0]) / (2 * sd[..., k]))
            logs.append((pair[0][1] - pair[1][1]) / (4 * sd[..., k]))  # log √Λ moves by half the log precision
        return torch.stack(targets, -1), torch.stack(logs, -1)

    def _rebase_level(
        self,
        level: PlateLevel,
        plates: dict,
        old: tuple,
        new: tuple,
        had: torch.Tensor,
        prior: GaussianPrior,
        centre: torch.Tensor,
        gradient: torch.Tensor,
        rest_gradient: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Move a conjugate level's parameters (of this call's elements) to a new reference: elements that had one
        keep their q exactly (:func:`~pyro_hier.conjugate.rebase`); elements seen for the first time start at one
        Newton step from their initial value with the likelihood's own curvature, shortened where it overshoots
        (:func:`~pyro_hier.conjugate.line_searched_mean`)."""
        diagonal = self._conjugate_diagonal(level)
        raw = self.scales if diagonal else self.scale_trils
        mean = self._level_mean(level, plates).detach()
        factor_raw = self._element_param(raw, level, plates, 1 if diagonal else 2).detach()
        factor = positive(factor_raw) if diagonal else scale_tril_from_raw(factor_raw)
        mean_out, raw_out = mean, factor_raw
        if bool(had.any()):
            moved, refactor = rebase(old, new, mean, factor)
            keep = had.unsqueeze(-1)
            mean_out = torch.where(keep, moved, mean_out)
            refactor = positive_inv(refactor) if diagonal else raw_from_scale_tril(refactor)
            raw_out = torch.where(keep if diagonal else keep.unsqueeze(-1), refactor, raw_out)
        if not bool(had.all()):
            started = line_searched_mean(prior, centre, gradient, new[2], rest_gradient)
            fresh = (~had).unsqueeze(-1) & torch.isfinite(started)
            mean_out = torch.where(fresh, started, mean_out)
        self._write_level(level, plates, prior, new, mean_out, raw_out)

    def _write_level(
        self, level: PlateLevel, plates: dict, prior: GaussianPrior, new: tuple, mean_out: torch.Tensor, raw_out
    ) -> None:
        """Write a conjugate level's conditional mean at the reference ``new`` and its raw factor (this call's
        elements); in units (:meth:`_in_units`), with the new anchor and unit."""
        diagonal = self._conjugate_diagonal(level)
        raw = self.scales if diagonal else self.scale_trils
        self._write_elements(raw, level.name, level, plates, raw_out, 1 if diagonal else 2)
        if not self._in_units(level):
            self._write_elements(self.locs, level.name, level, plates, mean_out, 1)
            return
        # the mean's new anchor, and its unit: q's sd at the reference (a step of Adam's rate moves it by that
        # fraction of an sd, however narrow the group's posterior)
        factor_out = positive(raw_out) if diagonal else scale_tril_from_raw(raw_out)
        _, scale = conjugate_conditional(prior, *new, mean_out, factor_out)
        unit = scale if diagonal else scale.pow(2).sum(-1).sqrt()
        self._write_elements(self.references, f"{level.name}__anchor", level, plates, mean_out, 1)
        self._write_elements(self.references, f"{level.name}__unit", level, plates, unit, 1)
        self._write_elements(self.locs, level.name, level, plates, torch.zeros_like(mean_out), 1)

    def _smoothed_step(
        self,
        level: PlateLevel,
        plates: dict,
        prior: GaussianPrior,
        new: tuple,
        floor: torch.Tensor,
        rest_gradient: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[tuple, torch.Tensor]:
        r"""Set a conjugate level's pseudo-observation (this call's elements, at the reference ``new`` they were just
        rebased to) to the rest of the model's expansion *averaged over* q at the globals' mean,
        :math:`\bar\Lambda = E_q[F]` and :math:`\bar\Lambda \bar t = E_q[g] + E_q[F]\,m`
        (:func:`~pyro_hier.conjugate.smoothed_expansion`): the fixed point of these is the optimum of the ELBO over
        q's Gaussian (Opper & Archambeau 2009), and one such step from q is Khan & Lin's conjugate-computation step
        of size 1. Where the likelihood is not Gaussian in the level (a logistic or Poisson mixed model) the Newton
        start and the expansion at q's mean (Laplace) leave each group's mean off by a fraction of its sd (0.2 sd at
        the median, 0.44 at most over crossover.py's logistic groups, from the conditional mode) that Adam's noisy
        per-group steps remove slowly; from the mode one such step left 0.057 sd (the reference's own Monte Carlo
        error is about 0.05). Returns the new reference (its curvature root that of :math:`E_q[F]`, q's factor set to
        the identity) and how far each element's mean moved, in q's sds. Elements whose averaged expansion is not
        finite keep their q."""
        diagonal = self._conjugate_diagonal(level)
        raw = self.scales if diagonal else self.scale_trils
        mean = self._level_mean(level, plates).detach()
        factor_raw = self._element_param(raw, level, plates, 1 if diagonal else 2).detach()
        factor = positive(factor_raw) if diagonal else scale_tril_from_raw(factor_raw)
        loc, scale = conjugate_conditional(prior, *new, mean, factor)  # q at the globals' mean: loc is mean
        gradient, curvature = smoothed_expansion(rest_gradient, loc, scale)
        if diagonal:
            root = curvature.clamp(min=floor).sqrt()
        else:
            root = psd_root(torch.nan_to_num(curvature), floor)
        target = newton_mean(prior, loc, gradient, root)
        if SMOOTHED_STEP < 1.0:  # damped: the pseudo-observation's natural parameters moved part of the way
            p0 = new[1]
            if diagonal:
                lam_q, lam_e = (new[2] * factor).pow(2), root.pow(2)
                eta_q = (p0 + lam_q) * mean - p0 * new[0]
                eta_e = (p0 + lam_e) * target - p0 * new[0]
                lam = (1 - SMOOTHED_STEP) * lam_q + SMOOTHED_STEP * lam_e
                eta = (1 - SMOOTHED_STEP) * eta_q + SMOOTHED_STEP * eta_e
                root, target = lam.sqrt(), (p0 * new[0] + eta) / (p0 + lam)
            else:
                ref = new[2] if new[2].dim() > mean.dim() else torch.diag_embed(new[2])
                rl = ref @ factor
                lam_q, lam_e = rl @ rl.mT, root @ root.mT
                mv = lambda a, v: (a @ v.unsqueeze(-1)).squeeze(-1)  # noqa: E731
                eta_q = mv(p0 + lam_q, mean) - mv(p0, new[0])
                eta_e = mv(p0 + lam_e, target) - mv(p0, new[0])
                lam = (1 - SMOOTHED_STEP) * lam_q + SMOOTHED_STEP * lam_e
                eta = (1 - SMOOTHED_STEP) * eta_q + SMOOTHED_STEP * eta_e
                root = torch.linalg.cholesky(0.5 * (lam + lam.mT))
                target = torch.linalg.solve(p0 + lam, (mv(p0, new[0]) + eta).unsqueeze(-1)).squeeze(-1)
        ok = torch.isfinite(target).all(-1) & torch.isfinite(root).flatten(-2 if not diagonal else -1).all(-1)
        ok = ok & torch.isfinite(gradient).all(-1)
        keep = ok.unsqueeze(-1)
        mean_out = torch.where(keep, target, mean)
        root_out = torch.where(keep if diagonal else keep.unsqueeze(-1), root, new[2])
        unit = torch.zeros_like(factor_raw)
        raw_out = torch.where(keep if diagonal else keep.unsqueeze(-1), unit, factor_raw)
        self._write_level(level, plates, prior, (*new[:2], root_out), mean_out, raw_out)
        sd = scale if diagonal else scale.pow(2).sum(-1).sqrt()
        step = ((mean_out - mean).abs() / sd).amax(-1)
        return (*new[:2], root_out), step

    def _level_prior(self, level: PlateLevel, fns: dict) -> GaussianPrior:
        assert self.structure is not None
        parts = []
        for name in level.sites:
            site = self.structure.latent[name]
            prior = gaussian_prior(fns[name], site.support)
            if prior is None:
                raise RuntimeError(
                    f"site '{name}' had a Gaussian prior conditional when the guide was built but has "
                    f"{type(fns[name]).__name__} in this call; build the guide with conditional='linear'"
                )
            parts.append(prior)
        return parts[0] if len(parts) == 1 else GaussianPrior.concat(parts)

    def _conjugate_distribution(
        self,
        level: PlateLevel,
        prior: GaussianPrior,
        values: dict[str, torch.Tensor],
        plates: dict[str, pyro.plate],
    ) -> dist.TorchDistribution:
        """q of a conjugate level's elements on this call: the prior conditional at the ancestors' draws ``prior``
        updated by the pseudo-observation (:func:`~pyro_hier.conjugate.conjugate_conditional`)."""
        diagonal = self._conjugate_diagonal(level)
        refs = (
            self._reference(level, "loc", plates, 1),
            self._reference(level, "precision", plates, 1 if diagonal else 2),
            self._reference(level, "fisher_sd", plates, 1 if diagonal else 2),
        )
        mean = self._level_mean(level, plates)
        raw = self._element_param(self.scales if diagonal else self.scale_trils, level, plates, 1 if diagonal else 2)
        if self._set_by_steps(level):  # (state: moved by the smoothed steps, not by the optimiser)
            mean, raw = mean.detach(), raw.detach()
        slopes = deltas = None
        if self._reads_slopes(level):  # (else they stay zero: the shift and stretch are 0 and 1, and are left out)
            slopes = (self._reference(level, "slope", plates, 2), self._reference(level, "stretch_slope", plates, 2))
            deltas = self._global_deviation(values[self._global_level.name])
        scored = self.stick_the_landing is not False and torch.is_grad_enabled()  # (the scorer only changes gradients)
        if scored and not diagonal and prior.diagonal and slopes is None:
            # drawn by perturbation (no derivative of a factorisation), scored from q's own factor in closed form
            root = refs[2] if refs[2].dim() > mean.dim() else torch.diag_embed(refs[2])
            # (a diagonal prior's reference precision is diagonal: its diagonal, not a product with the matrix)
            ref_precision = refs[1].diagonal(dim1=-2, dim2=-1) if refs[1].dim() > mean.dim() else refs[1]
            offset = conjugate_offset(refs[0], ref_precision, mean)
            q = ConjugateNormal(root, raw, mean, offset, prior.loc, prior.precision)
            scorer = ConjugateScorer(q.loc, q.precision_tril, prior.loc, prior.precision, inverse_tril=q.inverse_tril)
            return StickingTheLanding(q, scorer)
        factor = positive(raw) if diagonal else scale_tril_from_raw(raw)

        def build(mean, factor, delta=None if deltas is None else deltas[0]):
            moves = [None, None]
            if slopes is not None:
                moves = [(slope @ delta.unsqueeze(-1)).squeeze(-1) for slope in slopes]
            loc, scale = conjugate_conditional(prior, *refs, mean, factor, *moves, precision_tril=not diagonal)
            if diagonal:  # (valid by construction: not validated, a check that reads the tensors on every call)
                return dist.Normal(loc, scale, validate_args=False).to_event(1)
            return CholeskyPrecisionNormal(loc, scale)  # (scale: the precision's factor)

        q = build(mean, factor)
        if not scored:
            return q
        return StickingTheLanding(q, build(mean.detach(), factor.detach(), None if deltas is None else deltas[1]))

    def _warn_held_smoothed_levels(self) -> None:
        """Warn (once) when a compiled step is traced for a guide whose smoothed steps or references would set some
        levels (smoothed levels, levels read by rows drawn at random): a compiled step runs no Python, so those levels'
        references and parameters stay as the first call made them, and only the optimiser moves them
        (:meth:`_set_by_steps`)."""
        self._warned_jit = True
        held = [n for n in self._smoothed_levels if self._quadratic.get(n) is False]
        if held:
            warnings.warn(
                f"AutoBranchGuide: levels {held} have a likelihood that is not Gaussian in them; their smoothed steps "
                "(smoothed_expansion=True) run only in calls the guide makes in Python, and a compiled step "
                "(JitTrace_ELBO) holds their references from the first call and leaves them to the optimiser. Train "
                "this model with Trace_ELBO (on crossover.py's logistic regression: 0.1 sd in 4.6 CPU s eager, not "
                "within 80 s compiled), or pass smoothed_expansion=False to silence this",
                RuntimeWarning,
                stacklevel=2,
            )
        rows = [n for n in self._row_levels if n not in held]
        if rows:
            warnings.warn(
                f"AutoBranchGuide: levels {rows} are read by rows the model draws at random; they are set by their "
                "references, read from every row, with a control variate of the rows, only in calls the guide makes "
                "in Python: a compiled step (JitTrace_ELBO) holds their references from the first call and leaves "
                "them to the optimiser with the minibatch's full noise (radon-rows, seed 0: max error 1.18 that way, "
                "0.2 eager; AutoNormal 0.79). Train this model with Trace_ELBO",
                RuntimeWarning,
                stacklevel=2,
            )

    def _set_by_steps(self, level: PlateLevel) -> bool:
        """Whether a conjugate level's parameters are set by its smoothed steps alone (:meth:`_smoothed_step`, on each
        reference redo) and get no gradient: with ``smoothed_expansion=True``, for the levels whose likelihood is not
        Gaussian in them (found on the first call), in calls the guide runs in Python. Adam's one-particle steps of
        each group's parameters scattered the groups about their optimum by more than the smoothed steps leave
        (crossover.py's logistic problem, 10^3 groups: max error 0.15-0.39 sd after 8-40 CPU s with them, 0.056-0.061
        without). A compiled (JIT) step runs no Python and cannot redo references: what it traces keeps the gradient
        (the references are then held, as for every conjugate level under JIT)."""
        if torch.jit.is_tracing() or level.name not in self._smoothed_levels:
            return False
        quadratic = self._quadratic.get(level.name)
        return quadratic is False or (quadratic is True and level.name in self._row_levels)

    def _global_deviation(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The globals' draw ``u (..., d_g)`` less q's mean: with the mean live (the family's: ``u - mean`` is the
        globals' scaled base noise) and detached (the scorer of sticking the landing, whose density must not depend on
        the variational parameters). The mean is read once a call."""
        assert self._global_level is not None
        cache = self._call_cache
        loc = None if cache is None else cache.get(("global_loc",))
        if loc is None:
            loc = self._level_params(self._global_level, None)[0]
            if cache is not None:
                cache[("global_loc",)] = loc
        return u - loc, u - loc.detach()

    def _gathered_data(self, structure: ModelStructure) -> list[tuple[str, str]]:
        """``(site, plate)`` pairs whose gathers the guide reads besides its levels' links (a hook: the amortized
        guide's gathered observations)."""
        return []

    def _is_diagonal(self, level: PlateLevel) -> bool:
        return self.covariance == "diagonal"  # every level, globals included

    def _ancestor_params(
        self, level: PlateLevel, plates: dict[str, pyro.plate] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated locations and row scales of the level's ancestors (each ancestor's parameters built once).
        A gathered ancestor's (:class:`~pyro_hier.structure.LevelLink`) are read at each element's ancestor
        element."""
        locs, scales = [], []
        for a in level.ancestors:
            ancestor = self._levels[a]
            loc, _, scale = self._level_params(ancestor, plates)
            row = self._row_scale(ancestor, scale)
            if level.links_to(a):
                gathers = self._ancestor_gathers()
                loc = gathers.read_ancestor(loc, level, ancestor, event_dim=1)
                row = gathers.read_ancestor(row, level, ancestor, event_dim=1)
            locs.append(loc)
            scales.append(row)
        return concat_broadcast(locs), concat_broadcast(scales)

    def _ancestor_gathers(self) -> CallGathers:
        if self._gathers is None:  # a summary at full size: the gathers of the call on all the prototype's data
            assert self.structure is not None and self._gather_maps is not None
            self._gather_maps.model = self.model
            full = full_call_gathers(self._gather_maps, self.structure.args, self.structure.kwargs)
            return full.prepare(self.levels)
        return self._gathers

    def _call_gathers(self, args: tuple, kwargs: dict, plates: dict) -> CallGathers | None:
        """The gathers of this call (``None`` without gathered ancestors), from the plates the guide opened."""
        if self._gather_maps is None:
            return None
        self._gather_maps.model = self.model
        given = [*args, *kwargs.values()]
        calls = {
            name: PlateCall(name, p.size, p.indices, any(p.indices is v for v in given)) for name, p in plates.items()
        }
        return self._gather_maps.call(args, kwargs, calls).prepare(self.levels)

    @contextmanager
    def _summary_gathers(self, args: tuple, kwargs: dict) -> Iterator[None]:
        """Full-size maps of gathered ancestors for summaries, from the model's call on all of ``args``' data (the
        prototype's when no arguments are given)."""
        if self._gather_maps is None or self._gathers is not None:
            yield
            return
        self._gather_maps.model = self.model
        if not args and not kwargs:
            assert self.structure is not None
            args, kwargs = self.structure.args, self.structure.kwargs
        self._gathers = full_call_gathers(self._gather_maps, args, kwargs).prepare(self.levels)
        try:
            yield
        finally:
            self._gathers = None

    def _is_conditional(self, level: PlateLevel) -> bool:
        return self.covariance == "dense" and bool(level.ancestors) and level.name not in self.conjugate_levels

    def _ancestor_numel(self, level: PlateLevel) -> int:
        return sum(self._levels[a].numel for a in level.ancestors)

    def _row_scale(self, level: PlateLevel, scale: torch.Tensor) -> torch.Tensor:
        """The diagonal of the level's Cholesky factor ``scale`` (which is the vector of sds for ``"diagonal"``)."""
        return scale if self._is_diagonal(level) else scale.diagonal(dim1=-2, dim2=-1)

    def _element_param(
        self, params: PyroModule, level: PlateLevel, plates: dict[str, pyro.plate] | None, event_dim: int
    ) -> torch.Tensor:
        """The level's parameter in ``params``, cut to the elements of ``plates`` (full size for ``None``). Read it
        outside the plates: inside, Pyro's plates would slice it too."""
        value = self._param(params, level.name)
        if plates is None or not level.plates:
            return value
        return select_elements(value, element_selection(plates, level.plates, level.dims), event_dim)

    def _level_params(
        self, level: PlateLevel, plates: dict[str, pyro.plate] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(loc, weight, scale)`` of a level in the guide's internal, well-conditioned form, for the elements of the
        guide's ``plates`` on this call (``None``: at full plate size).

        The guide samples ``u = loc + weight @ ((u_anc - loc_anc) / s_anc) + L ε`` with ``weight = diag(s) W``:
        ``loc`` is the level's marginal mean and the free weight ``W`` is dimensionless (own sds per ancestor
        sd), so ``loc`` and ``W`` do not trade off along flat valleys and every entry of ``W`` has a curvature of
        order one — plain SGD on the paper's ``(μ_i, A_i)`` is badly conditioned. ``scale`` is ``L`` (the vector of
        sds for ``"diagonal"``), with off-diagonals relative to the rows' scales (see
        :func:`~pyro_hier.transforms.scale_tril_from_raw`). :meth:`conditional` gives the paper's form."""
        loc = self._level_mean(level, plates)
        diagonal = self._is_diagonal(level)
        raw = self._element_param(self.scales if diagonal else self.scale_trils, level, plates, 1 if diagonal else 2)
        if level is self._global_level and self._use_average():
            loc, raw = self._param(self.averages, "loc").detach(), self._param(self.averages, "scale").detach()
        if self._is_diagonal(level):
            scale = positive(raw)
        else:
            scale = scale_tril_from_raw(raw)
        weight = None
        if self._is_conditional(level):
            weight = self._row_scale(level, scale).unsqueeze(-1) * self._element_param(self.weights, level, plates, 2)
        return loc, weight, scale

    def conditional(self, level: str) -> dict[str, torch.Tensor | None]:
        """The parameters of ``q(u_{level,i} | u_anc) = N(loc + weight @ u_anc, scale_tril scale_trilᵀ)`` at full
        plate size, in the paper's form ``N(μ_i + A_i θ, Σ_i)``: ``loc`` (batch, d), ``weight`` (batch, d, d_anc) or
        ``None``, ``scale_tril`` (batch, d, d). ``u_anc`` concatenates the ancestor levels in ``level.ancestors``
        order."""
        lvl = self._levels[level]
        self._require_linear(level)
        loc, weight, scale = self._level_params(lvl)
        if weight is not None:
            anc_loc, anc_scale = self._ancestor_params(lvl)
            weight = weight / anc_scale.unsqueeze(-2)  # A of the paper's μ + A u_anc
            loc = loc - (weight @ anc_loc.unsqueeze(-1)).squeeze(-1)
        scale_tril = torch.diag_embed(scale) if self._is_diagonal(lvl) else scale
        return {"loc": loc, "weight": weight, "scale_tril": scale_tril}

    def _require_linear(self, level: str) -> None:
        if level in self.conjugate_levels:
            raise ValueError(
                f"level '{level}' has the conjugate conditional (its prior conditional updated by a pseudo-"
                "observation), whose mean is not linear in the ancestors: conditional() and set_conditional() "
                "describe the linear form; build the guide with conditional='linear' for them, or use quantiles()"
            )

    @torch.no_grad()
    def set_conditional(
        self, level: str, *, loc: torch.Tensor, scale_tril: torch.Tensor, weight: torch.Tensor | None = None
    ) -> None:
        """Set ``q(u_{level,i} | u_anc)`` from the paper's form (the inverse of :meth:`conditional`), e.g. to start
        from a previous fit or a known posterior. Set ancestor levels first. ``scale_tril`` must be diagonal for
        ``covariance="diagonal"``; ``weight`` is required exactly when the level is conditional."""
        lvl = self._levels[level]
        self._require_linear(level)
        if (weight is not None) != self._is_conditional(lvl):
            raise ValueError(f"level '{level}' {'needs' if self._is_conditional(lvl) else 'has no'} weight")
        if self._is_diagonal(lvl):
            getattr(self.scales, level).copy_(positive_inv(scale_tril.diagonal(dim1=-2, dim2=-1)))
        else:
            getattr(self.scale_trils, level).copy_(raw_from_scale_tril(scale_tril))
        if weight is not None:
            anc_loc, anc_scale = self._ancestor_params(lvl)
            loc = loc + (weight @ anc_loc.unsqueeze(-1)).squeeze(-1)
            row_scale = self._row_scale(lvl, self._level_params(lvl)[2])
            relative = weight * anc_scale.unsqueeze(-2) / row_scale.unsqueeze(-1)
            getattr(self.weights, level).copy_(relative)
        getattr(self.locs, level).copy_(loc)

    # ---- sampling -----------------------------------------------------------------------------------------------
    def _level_distribution(
        self, level: PlateLevel, values: dict[str, torch.Tensor], plates: dict[str, pyro.plate]
    ) -> dist.TorchDistribution:
        """q of the level's elements on this call (``values``: the ancestors' draws). Built outside the plates."""
        params = self._level_params(level, plates)
        u_anc = None
        if params[1] is not None:
            u_anc = concat_broadcast([self._ancestor_value(level, a, values[a]) for a in level.ancestors])
            params += self._ancestor_params(level, plates)

        def build(loc, weight=None, scale=None, anc_loc=None, anc_scale=None):
            if weight is not None:
                loc = loc + (weight @ ((u_anc - anc_loc) / anc_scale).unsqueeze(-1)).squeeze(-1)
            if self._is_diagonal(level):  # (valid by construction: not validated, a check that reads the tensors)
                return dist.Normal(loc, scale, validate_args=False).to_event(1)
            return dist.MultivariateNormal(loc, scale_tril=scale, validate_args=False)

        q = build(*params)
        if not (self.stick_the_landing or (level is self._global_level and getattr(self, "_globals_stick", False))):
            return q
        return StickingTheLanding(q, build(*(None if t is None else t.detach() for t in params)))

    def _ancestor_value(self, level: PlateLevel, ancestor: str, u: torch.Tensor) -> torch.Tensor:
        """An ancestor level's sample as the level's elements see it (read at their elements when gathered)."""
        if not level.links_to(ancestor):
            return u
        return self._ancestor_gathers().read_ancestor(u, level, self._levels[ancestor], event_dim=1)

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Sample every continuous latent site; returns ``{site: constrained value}``."""
        self._require_setup(*args, **kwargs)
        plates = self._create_plates(*args, **kwargs)
        values: dict[str, torch.Tensor] = {}
        result: dict[str, torch.Tensor] = {}
        outer, outer_cache, outer_untraced = self._gathers, self._call_cache, self._call_untraced
        outer_eager = self._call_eager
        self._call_cache = {}
        self._call_untraced = not torch.is_grad_enabled() and not torch.jit.is_tracing()
        self._call_eager = not torch.jit.is_tracing() and not _jit_param_capture()
        try:
            if self._gathers is None:  # (the amortized guide has found this call's already)
                self._gathers = self._call_gathers(args, kwargs, plates)
            training = self._training()
            if training:
                self._attach_hooks()
            if torch.jit.is_tracing() and not getattr(self, "_warned_jit", False):
                self._warn_held_smoothed_levels()
            if self.conjugate_levels and not torch.jit.is_tracing():  # (JIT: made by Pyro's first, untraced run; held)
                if self._lacks_references(plates):  # a minibatch first: every group's reference, from all the data
                    with poutine.block(), self._summary_call(args, kwargs) as (full_args, full_kwargs):
                        self._refresh_references(full_args, full_kwargs, self._full_plates(), training=False)
                    self._call_cache = {}  # (read there hidden from the handlers: read again where they see them)
                self._refresh_references(args, kwargs, plates, training)
            return self._sample_levels(args, kwargs, plates, values, result, training)
        finally:
            self._gathers, self._call_cache, self._call_untraced = outer, outer_cache, outer_untraced
            self._call_eager = outer_eager

    def _sample_levels(
        self, args: tuple, kwargs: dict, plates: dict, values: dict, result: dict, training: bool
    ) -> dict[str, torch.Tensor]:
        """Draw the levels in order (``values``: unconstrained by level, ``result``: constrained by site, filled in)."""
        terms = []
        # with the control variate on this call, what is left of the globals' gradient noise is their own draw's:
        # sticking the landing takes it out where q of the globals matches their posterior (default None: here only)
        self._globals_stick = (
            training
            and self.stick_the_landing is None
            and any(self._control_variate_applies(lv, plates, None) for lv in self.levels)
        )
        try:
            for level in self.levels:
                q = self._call_distribution(level, args, kwargs, values, result, plates)
                with ExitStack() as stack:
                    enter_plates(stack, plates, level.plates)
                    u = pyro.sample(f"_{self._pyro_name}_{level.name}_unconstrained", q, infer={"is_auxiliary": True})
                    values[level.name] = u
                    for name in level.sites:
                        result[name] = self._emit(name, self._site_unconstrained(level, name, u))
                if training and self._control_variate_applies(level, plates, values):
                    terms.append(self._control_variate_term(level, q, args, kwargs, values, result, plates))
            if training and self._row_variate_applies(plates, values):  # (every row level's and the globals' at once)
                terms.append(self._row_variate_term(args, kwargs, values, plates))
        finally:
            self._globals_stick = False
        if terms:  # zero-valued: only the globals' gradient moves (q's log density, and so the ELBO, unchanged)
            pyro.factor(f"_{self._pyro_name}_control_variate", sum(terms), has_rsample=True)
        return result

    def _rows_read_in_full(self, plates: dict) -> bool:
        """Whether this call's expansions read every row of the likelihood, and every level in full: the model draws
        rows at random on this call (:meth:`drawn_rows`, read block by block) and subsamples no latent plate."""
        assert self.structure is not None
        drawn = set(getattr(self, "drawn_plates", ())) & set(self.random_row_plates())
        latent = {p for level in self.levels for p in level.plates}
        return bool(drawn) and all(_subsample_size(plates[p]) == self.structure.plates[p].size for p in latent)

    def _row_variate_applies(self, plates: dict, values: dict[str, torch.Tensor]) -> bool:
        """Whether this training call gets the rows' control variate (:meth:`_row_variate_term`): a model whose rows
        Pyro draws at random, their expansion read in full at the last reference (:meth:`_rows_reference`; in some level
        whose curvature is block diagonal, or with globals), in a call that draws rows and no latent plate, run in
        Python (not a compiled step), one draw (not vectorised particles), densities not masked out, inside an ELBO."""
        if (
            not self._row_levels
            or torch.jit.is_tracing()
            or poutine.get_mask() is False
            or not am_i_wrapped()
            or not self._rows_read_in_full(plates)
        ):
            return False
        glob = self._global_level
        if glob is not None and values[glob.name].dim() != 1:
            return False
        ready = [float(self._param(self.references, f"{name}__rows_ready").detach()) for name in self._row_order()]
        return any(r > 0 for r in ready) or (glob is not None and all(r != 0 for r in ready))

    def _row_variate_term(
        self, args: tuple, kwargs: dict, values: dict[str, torch.Tensor], plates: dict
    ) -> torch.Tensor:
        r"""The guide-side log factor (zero-valued) of the control variate of a likelihood whose rows the model draws
        at random, in the draws :math:`u_\ell` of the conjugate levels (every one the rows read: crossed students and
        questions alike) and the globals' :math:`\theta` (SVRG's, with the rows' expansion as the reference function:
        Johnson & Zhang 2013).

        A training call scores :math:`B` of the :math:`N` rows, :math:`(N/B)\sum_{r \in B} \ell_r(u, \theta)`, whose
        gradient reaches the parameters directly and through the draws, which depend on them. At the last reference
        (:meth:`_rows_reference`) the rows' expansion was read from every row (block by block) at one point
        :math:`c = (c_1, \dots, c_k, c_\theta)` (the other latents at theirs): per level the gradient :math:`g_\ell`
        and the curvature blocks :math:`F_{\ell\ell}` (per element), and :math:`g_\theta`, :math:`F_{\theta\theta}`,
        :math:`F_{\ell\theta}`. The same expansion from this call's rows, :math:`\hat Q_B = (N/B)\sum_{r \in B} Q_r`,
        read by *one* run of the model on the call's rows at :math:`c` with one Hessian-vector product per level
        (:func:`~pyro_hier.conjugate.levels_expansion`), has the mean :math:`Q` over the draw of the rows whatever
        :math:`u`, so with :math:`\delta_\ell = u_\ell - c_\ell`, :math:`\delta_\theta = \theta - c_\theta` the ELBO's
        gradient gets, with mean zero,

        .. math:: \big[(g_1 - \hat g_1) - (F - \hat F)_{11}\delta_1 - (F - \hat F)_{1\theta}\delta_\theta\big]
                  \ \text{in } u_1, \qquad
                  \big[(g_\ell - \hat g_\ell) - (F - \hat F)_{\ell\ell}\delta_\ell\big]\ \text{in } u_{\ell > 1},

        .. math:: (g_\theta - \hat g_\theta) - (F - \hat F)_{\theta\theta}\delta_\theta
                  - \textstyle\sum_\ell (F - \hat F)_{\theta\ell}\,\delta_\ell\ \text{in } \theta,

        entered as :math:`a^\top u - (a^\top u)_{\text{stop}}` through the draws' reparameterisation (the blocks
        between two crossed levels are left out of both :math:`Q` and :math:`\hat Q_B`). Where the likelihood is
        quadratic in a level (Gaussian observations whose mean is linear in it), what is left of the rows' noise in its
        draw is the change of the globals since the reference. On ``radon-rows`` (``benchmarks/dropin.py``, seed 0) the
        max error went from 0.43 to 0.17 sd with it (set by references alone) and 1.18 before either. A level whose
        rows' curvature is not block diagonal (a row reading two of its elements) gets no term of its own."""
        glob = self._global_level
        order = self._row_order()
        point = self._rows_point()
        ready = {name: float(self._param(self.references, f"{name}__rows_ready").detach()) for name in order}
        deltas = {name: values[name].detach() - point[name] for name in order}
        delta_g = None if glob is None else values[glob.name].detach() - point[glob.name]
        directions = [
            (tuple(deltas[name] if m == index else None for m in range(len(order))), delta_g if index == 0 else None)
            for index, name in enumerate(order)
        ]
        gradients, batch_global_gradient, products = self._read_rows(
            args, kwargs, plate_indices(plates), {}, point, directions
        )
        term = values[order[0]].new_zeros(())
        for index, name in enumerate(order):
            if ready[name] <= 0:
                continue
            gradient, curvature = (
                self._param(self.references, f"{name}__rows_{key}").detach() for key in ("gradient", "curvature")
            )
            full_product = (curvature @ deltas[name].unsqueeze(-1)).squeeze(-1)
            if index == 0 and glob is not None:
                cross = self._param(self.references, f"{name}__rows_cross_curvature").detach()
                full_product = full_product + (cross @ delta_g.unsqueeze(-1)).squeeze(-1)
            a_u = (gradient - gradients[index]) - (full_product - products[index][0][index])
            term = term - (a_u * values[name]).sum()  # (the guide's log density gets -a.u: the ELBO +a.u)
        if glob is not None:
            first = order[0]
            global_gradient, global_curvature = (
                self._param(self.references, f"{first}__rows_global_{key}").detach()
                for key in ("gradient", "curvature")
            )
            full_global_product = global_curvature @ delta_g
            for name in order:
                cross = self._param(self.references, f"{name}__rows_cross_curvature").detach()
                every = tuple(range(deltas[name].dim() - 1))
                moved = (cross.mT @ deltas[name].unsqueeze(-1)).squeeze(-1).sum(every)
                full_global_product = full_global_product + moved
            batch_global_product = sum(product[1] for product in products)
            a_g = (global_gradient - batch_global_gradient) - (full_global_product - batch_global_product)
            term = term - (a_g * values[glob.name]).sum()
        return term - term.detach()

    def _row_order(self) -> list[str]:
        """The conjugate levels whose rows the model draws at random, in level order (the first also holds the
        globals' part of the rows' expansion and the reference point of the other levels)."""
        return [level.name for level in self.levels if level.name in self._row_levels]

    def _first_row_level(self) -> str | None:
        """The first conjugate level (in level order) whose rows the model draws at random: it holds the globals' part
        of the rows' expansion (:meth:`_row_variate_term`) and the reference point of the levels that are not row
        levels."""
        return next(iter(self._row_order()), None)

    def _rows_point(self) -> dict[str, torch.Tensor]:
        """The point (every level's element vectors, unconstrained) at which the rows' expansion was last read
        (:meth:`_rows_reference`): the row levels' ``rows_centre``, the other levels' ``rows_at__<level>`` of the first
        row level."""
        first = self._first_row_level()
        point = {}
        for level in self.levels:
            key = f"{level.name}__rows_centre" if level.name in self._row_levels else f"{first}__rows_at__{level.name}"
            point[level.name] = self._param(self.references, key).detach()
        return point

    def _read_rows(
        self,
        args: tuple,
        kwargs: dict,
        subsamples: dict[str, torch.Tensor],
        rows: dict[str, tuple[int, int]] | None,
        point: dict[str, torch.Tensor],
        directions: list | None = None,
    ) -> tuple:
        """:func:`~pyro_hier.conjugate.levels_expansion` of the rest of the model in every row level and the globals at
        ``point``, on the call ``args``, ``kwargs`` with the plates' ``subsamples``: on every row, block by block
        (``rows=None``: this call's plates of rows drawn at random, :meth:`drawn_rows`), or on the call's own rows
        (``rows={}``)."""
        blocks, given = self._row_blocks(subsamples, rows)
        glob = self._global_level
        at: dict[str, torch.Tensor] = {}
        for level in self.levels:
            if level.name not in self._row_levels and level is not glob:
                at.update(self._level_values(level, point[level.name]))
        specs = [
            (point[level.name], lambda v, level=level: self._level_values(level, v))
            for level in self.levels
            if level.name in self._row_levels
        ]
        v = None if glob is None else point[glob.name]
        to_globals = None if glob is None else (lambda v: self._level_values(glob, v))
        total = None
        for block in blocks:
            model = self.model if block is None else block(self.model)
            part = levels_expansion(
                model, args, kwargs, at, specs, v, to_globals, 1.0, given, directions, validate=False
            )
            total = part if total is None else _tree_add(total, part)
        return total

    def _row_blocks(
        self, subsamples: dict[str, torch.Tensor], rows: dict[str, tuple[int, int]] | None
    ) -> tuple[list, dict[str, torch.Tensor]]:
        """The blocks in which a read of the likelihood runs the model (:func:`~pyro_hier.plates.row_blocks` of the
        plates of ``rows``, by default those this call drew at random, :meth:`drawn_rows`; ``[None]``: one run on the
        call's own rows) and the subsamples to replay in each."""
        assert self.structure is not None
        if rows is None:
            drawn = getattr(self, "drawn_plates", ())
            sizes = {n: self.structure.plates[n].size for n in subsamples if n in self.structure.plates}
            rows = self.drawn_rows({n: PlateCall(n, sizes[n], subsamples[n], n not in drawn) for n in sizes})
        blocks = row_blocks(rows, device=next(iter(subsamples.values())).device) if rows else [None]
        return blocks, {n: i for n, i in subsamples.items() if n not in rows}

    @torch.no_grad()
    def _rows_reference(self, args: tuple, kwargs: dict, plates: dict, centres: dict[str, torch.Tensor]) -> None:
        """Read the rows' expansion behind :meth:`_row_variate_term` from every row (block by block), jointly in every
        row level and the globals, at one point: the row levels' current means under q (just after their references
        were redone) and the other levels' ``centres`` (the globals' at their tail average, as the references read
        them), and keep it with the point. The first time, check per level that the rows' curvature is block diagonal
        (:meth:`_rows_block_diagonal`)."""
        glob = self._global_level
        order = self._row_order()
        first = order[0]
        point = dict(centres)
        for name in order:
            point[name] = self._level_mean(self._levels[name], plates).detach()
        for level in self.levels:
            if level.name in self._row_levels:
                self._write_elements(self.references, f"{level.name}__rows_centre", level, plates, point[level.name], 1)
            else:
                _state_tensor(self._param(self.references, f"{first}__rows_at__{level.name}")).copy_(point[level.name])
        subsamples = plate_indices(plates)
        gradients, curvatures, global_gradient, global_curvature, crosses = self._read_rows(
            args, kwargs, subsamples, None, point
        )
        for index, name in enumerate(order):
            level = self._levels[name]
            self._write_elements(self.references, f"{name}__rows_gradient", level, plates, gradients[index], 1)
            self._write_elements(self.references, f"{name}__rows_curvature", level, plates, curvatures[index], 2)
            if glob is not None:
                self._write_elements(self.references, f"{name}__rows_cross_curvature", level, plates, crosses[index], 2)
        if glob is not None:
            _state_tensor(self._param(self.references, f"{first}__rows_global_gradient")).copy_(global_gradient)
            _state_tensor(self._param(self.references, f"{first}__rows_global_curvature")).copy_(global_curvature)
        flags = [_state_tensor(self._param(self.references, f"{name}__rows_ready")) for name in order]
        if all(float(flag) == 0.0 for flag in flags):
            blocks = self._rows_block_diagonal(args, kwargs, subsamples, point, curvatures)
            for flag, ok in zip(flags, blocks, strict=True):
                flag.fill_(1.0 if ok else -1.0)

    def _rows_block_diagonal(
        self, args: tuple, kwargs: dict, subsamples: dict, point: dict[str, torch.Tensor], curvatures: tuple
    ) -> list[bool]:
        """Per row level, whether the rows' curvature in it is block diagonal across its elements (each row reads at
        most one of them, as a gathered group effect does), checked once on every row along a random direction: where
        it is not (a row reading two elements, as in a pairwise comparison), the per-element blocks ``curvatures`` and
        the per-call Hessian-vector product of :meth:`_row_variate_term` would not agree, and the rows' control
        variate in that level is off (the ELBO's gradient is unbiased either way; a warning says so)."""
        order = self._row_order()
        with keep_random_state():
            probes = [torch.randn(c.shape[:-1], dtype=c.dtype, device=c.device) for c in curvatures]
        directions = [
            (tuple(probes[m] if m == index else None for m in range(len(order))), None) for index in range(len(order))
        ]
        _, _, products = self._read_rows(args, kwargs, subsamples, None, point, directions)
        out = []
        for index, name in enumerate(order):
            blocks = (curvatures[index] @ probes[index].unsqueeze(-1)).squeeze(-1)
            scale = float(blocks.abs().max()) + 1e-12
            ok = torch.allclose(products[index][0][index], blocks, rtol=1e-4, atol=1e-6 * scale)
            if not ok:
                warnings.warn(
                    f"AutoBranchGuide: a row of the likelihood reads more than one element of level '{name}', so the "
                    "control variate of the rows the model draws at random is off for it (the gradient stays "
                    "unbiased, with the minibatch's full noise)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            out.append(ok)
        return out

    def _control_variate_applies(self, level: PlateLevel, plates: dict, values: dict[str, torch.Tensor] | None) -> bool:
        """Whether this training call's draw of ``level`` gets the control variate: a level with one
        (:meth:`_has_control_variate`) whose plates this call subsamples, one draw of the globals (not vectorised
        particles; ``values=None``: not checked), densities not masked out."""
        if not self._has_control_variate(level) or poutine.get_mask() is False or not am_i_wrapped():
            return False  # (unwrapped: a direct call, no ELBO to move)
        assert self.structure is not None and self._global_level is not None
        if values is not None and values[self._global_level.name].dim() != 1:
            return False
        return any(_subsample_size(plates[p]) < self.structure.plates[p].size for p in level.plates)

    def _control_variate_term(
        self,
        level: PlateLevel,
        q: dist.TorchDistribution,
        args: tuple,
        kwargs: dict,
        values: dict[str, torch.Tensor],
        result: dict[str, torch.Tensor],
        plates: dict,
    ) -> torch.Tensor:
        r"""The guide-side log factor (zero-valued) of the SAGA control variate of a conjugate level's elements in the
        globals' gradient (Defazio, Bach & Lacoste-Julien 2014).

        With :math:`\theta` the globals' draw, the level's element :math:`i` enters the ELBO's gradient in
        :math:`\theta` through :math:`\nabla_\theta \log \int p(u_i \mid \theta)\,
        \mathcal N(t_i; u_i, \Lambda_i^{-1})\,du_i = E_{q(u_i \mid \theta)}[\nabla_\theta \log p(u_i \mid \theta)]`
        (exactly where the pseudo-observation is the likelihood, as on Gaussian data): a minibatch of :math:`B` of the
        :math:`N` elements estimates their sum with the spread of the elements' gradients, times :math:`N/B`. The table
        ``references.<level>__cv_gradient`` keeps :math:`T_i`, element :math:`i`'s gradient at its last training call,
        and ``__cv_point`` the draw :math:`\theta_i` it was taken at; the globals' gradient gets
        :math:`c = \sum_{\text{all}} T_i(\theta) - (N/B)\sum_{i \in B} T_i(\theta)` (zero mean over the minibatches,
        whatever the table), with :math:`T_i(\theta) = T_i + \bar H (\theta - \theta_i)` carried to the current draw
        by the elements' shared curvature :math:`\bar H` (:func:`shared_curvature`). (Minibatches taken in turn from a
        reshuffled list, as a ``DataLoader`` does, visit together the elements whose entries are oldest: without
        :math:`\bar H` each step was biased by :math:`N \bar H` times how far the globals had moved since.) It enters
        as the term :math:`c^\top\theta - (c^\top\theta)_{\text{stop}}`, through the
        draw's reparameterisation (loc and scale alike). What remains of the minibatch's noise is the change of each
        element's gradient since its last visit. The call's elements' :math:`T_i` are then rewritten in the backward
        pass, from :math:`E_q[\log p(u_i \mid \theta_i)]` at per-element copies :math:`\theta_i` of the draw (the
        prior conditional read from the model with the globals given per element; q's moments held), by
        :class:`_GradientTap`, which runs under JIT ELBOs too."""
        glob = self._global_level
        assert glob is not None and self.structure is not None
        u_g = values[glob.name]
        table, points, secant = (
            _state_tensor(self._param(self.references, f"{level.name}__cv_{key}"))
            for key in ("gradient", "point", "secant")
        )
        selection = element_selection(plates, level.plates, level.dims)
        rows, at = (select_elements(t.detach(), selection, 1) for t in (table, points))
        scale = math.prod(self.structure.plates[p].size for p in level.plates) / max(
            1, math.prod(_subsample_size(plates[p]) for p in level.plates)
        )
        call = tuple(range(rows.dim() - 1))
        dims = tuple(dim for dim, ix in selection.items() if ix is not None)
        # (the table's sums over all elements and the shared curvature, state that only the tap's backward pass
        # changes, come from the tap: kept up to date there, O(B) a call rather than O(N))
        copies, probe, table_sum, points_sum, curvature = _GradientTap.apply(
            u_g, rows, table, points, secant, dims, *(selection[d] for d in dims)
        )
        c = table_sum - scale * rows.sum(call)
        shift = points_sum - scale * at.sum(call)
        c = c - (curvature @ shift.unsqueeze(-1)).squeeze(-1)
        term = -(c * u_g).sum()  # (the guide's log density gets -c.θ: the ELBO +c.θ)
        term = term - term.detach()
        fn = q.sampler if isinstance(q, StickingTheLanding) else q
        while isinstance(fn, dist.Independent):
            fn = fn.base_dist
        mean = fn.mean.detach()
        if isinstance(fn, torch.distributions.MultivariateNormal | CholeskyPrecisionNormal):
            cov = fn.covariance_matrix.detach()
        else:
            cov = fn.variance.detach()
        subsamples = plate_indices(plates)
        checked = level.name in self._per_element_globals
        # the prior conditional read once, at the copies and the other sites' values without gradient: the term
        # E - stop(E) is zero and its gradient reaches the copies alone (read twice before, at the copies and at their
        # detached values, for the difference of the two: the same value and gradients, twice the graph's work)
        given = {**{name: value.detach() for name, value in result.items()}, **self._level_values(glob, copies)}
        try:
            fns, _ = capture_priors(
                self.reading_model,
                args,
                kwargs,
                given,
                level.sites,
                subsamples,
                validate=False,
                init=self.site_init,
            )
            prior: GaussianPrior | Exception = self._level_prior(level, fns)
        except (RuntimeError, ValueError, IndexError) as error:
            if checked:
                raise
            prior = error
        if not checked and not self._check_per_element_globals(level, prior, args, kwargs, result, subsamples):
            return term.new_zeros(())
        assert isinstance(prior, GaussianPrior)
        expected = expected_log_density(prior, mean, cov).sum()
        return term + (expected - expected.detach()) + (probe - probe.detach())

    @torch.no_grad()
    def _check_per_element_globals(
        self,
        level: PlateLevel,
        prior: GaussianPrior | Exception,
        args: tuple,
        kwargs: dict,
        result: dict,
        subsamples: dict,
    ) -> bool:
        """Whether the model, given the globals as one copy per element of ``level`` (batched along its plates), reads
        the same prior conditional ``prior`` (or raised it) as from the globals themselves: the control variate's
        per-element gradients need it (a model that indexes a global's own batch dims from the left does not
        broadcast so). Checked once per level (on the first training call, which JIT ELBOs run in Python); where it
        fails the control variate is turned off for the level, with a warning."""
        assert self._global_level is not None
        with keep_random_state():  # (checked on the first training call of this process: a resumed run's differs)
            fns, _ = capture_priors(self.model, args, kwargs, dict(result), level.sites, subsamples)
        shared = self._level_prior(level, fns)
        same = isinstance(prior, GaussianPrior)
        for a, b in ((prior.loc, shared.loc), (prior.precision, shared.precision)) if same else ():
            try:
                shape = torch.broadcast_shapes(a.shape, b.shape)
            except RuntimeError:
                same = False
                break
            same = same and a.shape == shape and bool(torch.allclose(a, b.expand(shape), rtol=1e-5, atol=1e-6))
        self._per_element_globals[level.name] = same
        if not same:
            reason = f" ({prior})" if isinstance(prior, Exception) else ""
            warnings.warn(
                f"AutoBranchGuide: the model does not broadcast the globals {list(self._global_level.sites)} given "
                f"per element of plates {list(level.plates)} (its prior conditional of {list(level.sites)} "
                f"differs{reason}), "
                "so the control variate on the globals' gradient is off for this level; write the model so that "
                "globals broadcast from the right (as Pyro's vectorised particles need), or pass "
                "control_variate=False",
                RuntimeWarning,
                stacklevel=2,
            )
        return same

    def _call_distribution(
        self,
        level: PlateLevel,
        args: tuple,
        kwargs: dict,
        values: dict[str, torch.Tensor],
        result: dict[str, torch.Tensor],
        plates: dict[str, pyro.plate],
    ) -> dist.TorchDistribution:
        """q of a level's elements on this call, given the ancestors' draws (``values`` unconstrained by level,
        ``result`` constrained by site); built outside the plates. A hook: the amortized guide's conjugate levels."""
        if level.name in self.conjugate_levels:  # the prior conditional at the ancestors' draws, from the model
            fns = self._call_priors(level, args, kwargs, result, plates)
            return self._conjugate_distribution(level, self._level_prior(level, fns), values, plates)
        return self._level_distribution(level, values, plates)  # parameters read (and cut) outside the plates

    def _call_priors(self, level: PlateLevel, args: tuple, kwargs: dict, result: dict, plates: dict) -> dict:
        """The prior conditionals (``{site: distribution}``) of a conjugate level's sites at the draws of this call
        (``result``, constrained by site), read from one run of the model up to them. That run also reads the later
        conjugate levels whose parents are all drawn already (crossed levels under the globals: students and questions
        of an item-response model), kept for the rest of the call (a run of the model saved per such level)."""
        cache = self._call_cache
        held = None if cache is None else cache.get(("priors",))
        if held is not None and all(site in held for site in level.sites):
            return held
        assert self.structure is not None
        wanted = list(level.sites)
        try:
            parents = self.structure.parents
        except StructureError:  # (the dependencies cannot be traced: this level's alone)
            parents = None
        if parents is not None:
            drawn = set(result)
            for other in self.levels[self.levels.index(level) + 1 :]:
                if other.name in self.conjugate_levels and all(set(parents.get(s, ())) <= drawn for s in other.sites):
                    wanted += other.sites
        fns, _ = capture_priors(
            self.reading_model,
            args,
            kwargs,
            dict(result),
            wanted,
            plate_indices(plates),
            validate=False,
            init=self.site_init,
        )
        if cache is not None:
            cache[("priors",)] = fns
        return fns

    @property
    def _call_reading_levels(self) -> tuple[str, ...]:
        """Levels whose q reads the data of the call it is given (summaries of their groups need all the data)."""
        return self._prior_reading_levels

    @property
    def _prior_reading_levels(self) -> tuple[str, ...]:
        """Levels whose conditional reads the model's prior conditional at the ancestors' draws on each call: their
        marginals (and those of the levels below them) have no closed form, so the summaries are drawn."""
        return self.conjugate_levels

    # ---- the globals' tail average ------------------------------------------------------------------------------
    def _global_leaves(self) -> dict[str, torch.Tensor]:
        assert self._global_level is not None
        name = self._global_level.name
        raw = self.scales if self._is_diagonal(self._global_level) else self.scale_trils
        return {"loc": self._param(self.locs, name), "scale": self._param(raw, name)}

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_hooked"] = {}  # gradient hooks are not pickled: the first training call installs them again
        return state

    @property
    def _needs_model_because(self) -> str:  # (the message of an unpickled guide without its model)
        if self.conjugate_levels:
            return (
                f"It runs the model on each call to read the prior conditionals of its conjugate levels "
                f"{list(self.conjugate_levels)}"
            )
        return "It runs the model on each call to read the plates' subsample indices"

    def state_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The guide's parameters that are state, not optimised (no gradient reaches them): the conjugate levels'
        references, the training-call count, and the globals' tail average. They are parameters so that Pyro's param
        store carries them; leave them out of hand-built optimisers and out of ``DistributedDataParallel``'s
        reduction (``tutorials/distributed_training.py``)."""
        return dict(
            [(f"references.{k}", v) for k, v in self.references.named_parameters()]
            + [(f"averages.{k}", v) for k, v in self.averages.named_parameters()]
        )

    def _attach_hooks(self) -> None:
        """Hook (once per parameter tensor: again after unpickling, loading or moving) the count of training calls and
        the tail average of the global level's parameters onto the parameters' gradient accumulation: they follow any
        training loop, eager or JIT-compiled, and are never written inside a traced call."""
        leaves = {"count": next(iter(self.locs.parameters()))}
        if self._global_level is not None:
            leaves.update(self._global_leaves())
        todo: dict[int, tuple[torch.Tensor, list[str]]] = {}  # (one hook per tensor: the count shares the loc's)
        for key, leaf in leaves.items():
            leaf = _state_tensor(leaf)
            ref = self._hooked.get(key)
            if (ref is not None and ref() is leaf) or not leaf.requires_grad:
                continue
            self._hooked[key] = weakref.ref(leaf)
            todo.setdefault(id(leaf), (leaf, []))[1].append(key)
        guide = weakref.ref(self)
        for leaf, keys in todo.values():
            hook = functools.partial(_state_hook, guide, tuple(keys))
            leaf.register_post_accumulate_grad_hook(hook)

    @torch.no_grad()
    def _after_backward(self, key: str, value: torch.Tensor) -> None:
        """A gradient reached ``key``'s parameter: count the training call, or update that parameter's tail average.
        (The state is read as the raw tensors: this runs inside the step's backward pass, where reading a
        ``PyroParam`` would be recorded by ``SVI``'s parameter capture without the unconstrained value it expects.)"""
        if key == "count":
            _raw_state(self.references, "training_calls").add_(1)
            if "count" in self.averages._pyro_params:
                _raw_state(self.averages, "count").add_(1)
            return
        count = int(_raw_state(self.averages, "count"))
        tail_average_update(_raw_state(self.averages, key), value, max(count, 1), TAIL_FRACTION)

    def _use_average(self) -> bool:
        """Outside training (``Predictive``, ``median``, ``quantiles``, any call without gradients) the global level
        uses the tail average of its parameters instead of the last iterate."""
        return (
            not torch.is_grad_enabled()
            and self._global_level is not None
            and "count" in self.averages._pyro_params
            and float(self._param(self.averages, "count").detach()) > 0
        )

    # ---- conjugate levels' means in units of their sd -----------------------------------------------------------
    def _in_units(self, level: PlateLevel) -> bool:
        """Whether a level's location is parameterised in units of its sd (:meth:`_level_mean`): the conjugate levels
        chosen by ``mean_units`` (by default those the model subsamples, with Normal observations). A hook: the
        amortized guide keeps plain
        locations."""
        return level.name in self._units_levels

    def _level_mean(self, level: PlateLevel, plates: dict | None = None) -> torch.Tensor:
        r"""A level's location parameter (a linear level's mean, a conjugate level's conditional mean at its reference)
        for the elements of ``plates`` (``None``: full size): ``locs.<level>`` itself, or for the conjugate levels
        (:meth:`_in_units`) :math:`\bar M = a + s \odot v`, with the anchor :math:`a` and the unit :math:`s` kept
        as state (``references.<level>__anchor``, ``__unit``) and :math:`v` the free parameter ``locs.<level>``.
        The unit is q's sd at the element's reference, and the anchor its mean then (:math:`v = 0`), both redone with
        the reference (:meth:`_rebase_level`, q unchanged). An optimiser's step of about its learning rate in
        :math:`v` thus moves the mean by that fraction of its sd, however narrow the element's posterior: with a plain
        mean Adam's step is about its rate whatever the sd, and a group of the synthetic regression (100
        observations, sd about 0.1) stayed about 0.3 sd off its exact mean at the rate 0.05 (rms over 1,000 groups;
        0.09 in units)."""
        step = self._element_param(self.locs, level, plates, 1)
        if not self._in_units(level):
            return step
        return self._reference(level, "anchor", plates, 1) + self._reference(level, "unit", plates, 1) * step

    # ---- summaries ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def level_moments(self, *args, **kwargs) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Mean and covariance of every level's element vectors under q, at full plate size, in unconstrained
        space: ``{level: (mean (batch, d), cov (batch, d, d))}``. The model's arguments are needed only by guides
        whose parameters depend on the data (:class:`~pyro_hier.AutoAmortizedBranchGuide`).

        Each level is an affine map of independent standard-normal noises of itself and its ancestors,
        :math:`u_\\ell = m_\\ell + \\sum_k B_{\\ell k}\\,\\varepsilon_k` with :math:`B_{\\ell\\ell} = L_\\ell` and
        :math:`B_{\\ell k} = \\sum_a A_{\\ell,a} B_{a k}`; so
        :math:`\\mathrm{Cov}(u_\\ell) = \\sum_k B_{\\ell k} B_{\\ell k}^\\top`.
        """
        if self._prior_reading_levels:
            return self._drawn_level_moments(*args, **kwargs)
        with self._summary_gathers(args, kwargs):
            return self._level_moments()

    def _drawn_level_moments(self, *args, **kwargs) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        r"""Mean and covariance of the levels' element vectors (conjugate levels have no closed-form marginal), from
        ``num_summary_samples`` joint draws, Rao–Blackwellised: each level's Gaussian conditional :math:`q(u \mid
        \mathrm{pa})` at the draws of its parents gives its mean :math:`m_s` and covariance :math:`C_s` exactly, and
        :math:`E[u] = \overline{m_s}`, :math:`\mathrm{Cov}(u) = \overline{C_s} + \mathrm{Cov}_s(m_s)` (the law of
        total variance) — the Monte Carlo error is only that of the parents' draws. (A model that cannot run batched
        over the draws: from the draws themselves.)"""
        assert self.structure is not None
        n = self.num_summary_samples
        chunk = self._summary_chunk(n)
        sums: dict[str, list] = {}  # level -> [draws so far, mean of m_s, scatter of m_s, sum of C_s]
        with self._summary_call(args, kwargs) as (args, kwargs):
            self._require_setup(*args, **kwargs)
            dim = -self.structure.max_plate_nesting - 1
            tensor = next(iter(self.parameters()), None)
            devices = [tensor.device] if tensor is not None and tensor.device.type == "cuda" else []
            try:
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(0)
                    for start in range(0, n, chunk):
                        size = min(chunk, n - start)
                        with poutine.block(), poutine.trace() as tr, pyro.plate("_pyro_hier_draws", size, dim=dim):
                            self(*args, **kwargs)
                        for level in self.levels:
                            _accumulate_moments(
                                sums.setdefault(level.name, [0, None, None, None]), level, tr, self, size
                            )
            except (ValueError, RuntimeError, IndexError):
                return self._sampled_level_moments(self._summary_draws(args, kwargs))
        out = {}
        for level in self.levels:
            count, mean, scatter, cov = sums[level.name]
            out[level.name] = (mean, cov / count + scatter / (count - 1))
        return out

    def _summary_chunk(self, n: int) -> int:
        """Draws taken at once by :meth:`_drawn_level_moments`: all ``n`` while every level's per-draw conditional
        covariances, ``prod(batch) · d²`` numbers per level, fit :data:`SUMMARY_NUMBERS` together; fewer beyond, so
        that the memory of the summaries does not grow with the number of groups times the draws (10,000 groups of
        ``d = 10`` with 1,000 draws at once took more than 20 GB)."""
        per_draw = sum(math.prod(level.batch_shape) * level.numel**2 for level in self.levels)
        return max(1, min(n, SUMMARY_NUMBERS // max(1, per_draw)))

    def _sampled_level_moments(self, draws: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Mean and covariance of the levels' element vectors from joint draws of the latent sites."""
        assert self.structure is not None
        out = {}
        for level in self.levels:
            parts = []
            for name in level.sites:
                u = biject_to(self.structure.latent[name].support).inv(draws[name])
                parts.append(u.reshape((u.shape[0], *level.batch_shape, -1)))
            u = torch.cat(parts, -1)
            mean = u.mean(0)
            centred = u - mean
            cov = torch.einsum("s...i,s...j->...ij", centred, centred) / (u.shape[0] - 1)
            out[level.name] = (mean, cov)
        return out

    @contextmanager
    def _summary_call(
        self, args: tuple, kwargs: dict, blocks: dict[str, torch.Tensor] | None = None
    ) -> Iterator[tuple[tuple, dict]]:
        """The call on which draw-based summaries are taken: the model's call on all the data of ``args`` (the
        prototype's when none are given), the guide's plates opened at full size, so that summaries have the plates'
        full sizes, as AutoNormal's. Plates that Pyro subsamples at random (``subsample_size=B``) cannot be opened
        in full (Pyro insists on ``B`` elements): ``blocks`` gives such a plate the indices of one block of ``B``
        elements to open instead (:meth:`_summary_blocks`)."""
        assert self.structure is not None
        blocks = blocks or {}
        if not args and not kwargs:
            args, kwargs = self.structure.args, self.structure.kwargs
        drawn = [n for n in self._drawn_summary_plates(args, kwargs) if n not in blocks]
        args, kwargs, forced = full_data_call(self.model, args, kwargs)
        if drawn:
            raise StructureError(
                f"{type(self).__name__}'s summaries of the groups draw them from the model's prior conditional on "
                f"all the data, and Pyro cannot open plate '{drawn[0]}' in full: the model subsamples it at random "
                "(subsample_size=). median() and quantiles() take them block by block; for other summaries pass the "
                "indices as an argument instead (pyro.plate(name, N, subsample=idx), idx=None for all the groups)."
            )
        saved = self.create_plates
        if forced:  # plates the model subsamples at random: the guide opens them in full, the model replays that
            dims = {n: self.structure.plates[n].dim for n in forced if n in self.structure.plates}
            self.create_plates = lambda *a, **k: (
                [
                    pyro.plate(n, self.structure.plates[n].size, subsample=blocks.get(n), dim=d)
                    for n, d in dims.items()
                    if d is not None
                ]
                + ([] if saved is None else list(_as_list(saved(*a, **k))))
            )
        try:
            with self._replaying(blocks):  # (guides that run the model themselves replay the blocks into it)
                yield args, kwargs
        finally:
            self.create_plates = saved

    def _drawn_summary_plates(self, args: tuple, kwargs: dict) -> list[str]:
        """The plates of the levels whose q reads the call (:attr:`_call_reading_levels`) which Pyro subsamples at
        random on this call."""
        assert self.structure is not None
        reading = sorted({p for name in self._call_reading_levels for p in self._levels[name].plates})
        if not reading or not self.has_model:
            return []
        calls = self._capture_plates(args, kwargs, reading)
        return [n for n in reading if n in calls and calls[n].subsampled and not calls[n].user_indices]

    def _summary_blocks(
        self, args: tuple, kwargs: dict, summarise: Callable[[tuple, dict], dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """Per-element summaries (marginal: quantiles, a median), ``{site: (..., *site.shape)}`` at full plate
        sizes, from ``summarise(call_args, call_kwargs)`` on the model's call on all the data (:meth:`_summary_call`).

        Where the model draws a plate's subsample at random (``pyro.plate(name, N, subsample_size=B)``), Pyro cannot
        open it in full; the summaries are then taken on consecutive blocks of ``B`` elements (the last block ending at
        ``N``, overlapping the one before) and joined. Each block's draws of an element are draws of its marginal
        under q, so marginal summaries join exactly (sites outside these plates are read on the first block).
        Not where a level that reads the model's conditional lies outside these plates: it would read one block's
        data (a clear error)."""
        assert self.structure is not None
        if not args and not kwargs:
            args, kwargs = self.structure.args, self.structure.kwargs
        drawn = self._drawn_summary_plates(args, kwargs)
        if not drawn:
            with self._summary_call(args, kwargs) as (call_args, call_kwargs):
                return summarise(call_args, call_kwargs)
        for name in self._call_reading_levels:
            if not set(drawn) <= set(self._levels[name].plates):
                outside = next(p for p in drawn if p not in self._levels[name].plates)
                raise StructureError(
                    f"{type(self).__name__}: level '{name}' reads the data of the call it is given, but it is "
                    f"not in plate '{outside}', which the model subsamples at random (subsample_size=), so Pyro cannot "
                    "open it in full for median() or quantiles(). Pass the indices as an argument instead "
                    f"(pyro.plate('{outside}', N, subsample=idx), idx=None for all the groups)."
                )
        calls = self._capture_plates(args, kwargs, drawn)

        def summarise_block(blocks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            with self._summary_call(args, kwargs, blocks) as (call_args, call_kwargs):
                return summarise(call_args, call_kwargs)

        return self._join_blocks({n: calls[n] for n in drawn}, summarise_block)

    def _level_moments(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        means: dict[str, torch.Tensor] = {}
        loadings: dict[str, dict[str, torch.Tensor]] = {}
        out = {}
        for level in self.levels:
            p = self.conditional(level.name)
            mean = p["loc"]
            load = {level.name: p["scale_tril"]}
            if p["weight"] is not None:
                start = 0
                for a in level.ancestors:
                    d_a = self._levels[a].numel
                    w = p["weight"][..., start : start + d_a]
                    start += d_a
                    mean = mean + (w @ self._ancestor_value(level, a, means[a]).unsqueeze(-1)).squeeze(-1)
                    for k, b in loadings[a].items():
                        if level.links_to(a):
                            b = self._ancestor_gathers().read_ancestor(b, level, self._levels[a], event_dim=2)
                        load[k] = load[k] + w @ b if k in load else w @ b
            means[level.name], loadings[level.name] = mean, load
            cov = sum(b @ b.mT for b in load.values())
            out[level.name] = (mean.detach().clone(), cov.expand(mean.shape + mean.shape[-1:]))  # not a parameter view
        return out

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Constrained values at the mean of q in unconstrained space (the posterior median there), full size; with
        conjugate levels, the coordinatewise median of ``num_summary_samples`` draws."""
        self._require_setup(*args, **kwargs)
        if self._prior_reading_levels or self._drawn_summary_plates(args, kwargs):
            return {name: value[0] for name, value in self.quantiles([0.5], *args, **kwargs).items()}
        moments = self.level_moments(*args, **kwargs)
        return {
            name: self._constrain(
                name, self._site_unconstrained(level, name, moments[level.name][0], broadcast=False)
            ).clone()  # a plain tensor, not a view of a parameter
            for level in self.levels
            for name in level.sites
        }

    @torch.no_grad()
    def quantiles(self, quantiles: list[float] | torch.Tensor, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Marginal quantiles of every continuous latent site, full size; the quantile dim comes first.

        Example::

            guide.quantiles([0.05, 0.5, 0.95], x, y)["z"].shape  # (3, N, 1, D)
        """
        self._require_setup(*args, **kwargs)
        if self._prior_reading_levels:
            # levels below a conjugate one have no closed-form marginal: draws, on the model's call on all the data;
            # the levels above every conjugate one (the globals) keep their exact quantiles
            result = self._summary_blocks(
                args,
                kwargs,
                lambda call_args, call_kwargs: super(AutoBranchGuide, self).quantiles(
                    quantiles, *call_args, **call_kwargs
                ),
            )
            for level in self.levels:
                if not level.plates and level.name not in self._prior_reading_levels:
                    loc, _, scale = self._level_params(level, None)
                    cov = scale.pow(2) if self._is_diagonal(level) else scale @ scale.mT
                    sd = cov if self._is_diagonal(level) else cov.diagonal(dim1=-2, dim2=-1)
                    result.update(self._gaussian_quantiles(level, quantiles, loc, sd.sqrt()))
            return result
        if self._drawn_summary_plates(args, kwargs):  # q reads the call's data: the groups block by block
            return self._summary_blocks(
                args, kwargs, lambda call_args, call_kwargs: self._moment_quantiles(quantiles, call_args, call_kwargs)
            )
        return self._moment_quantiles(quantiles, args, kwargs)

    def _moment_quantiles(self, quantiles: list[float] | torch.Tensor, args: tuple, kwargs: dict) -> dict:
        """Quantiles of the Gaussian marginals of :meth:`level_moments`."""
        moments = self.level_moments(*args, **kwargs)
        result = {}
        for level in self.levels:
            mean, cov = moments[level.name]
            result.update(self._gaussian_quantiles(level, quantiles, mean, cov.diagonal(dim1=-2, dim2=-1).sqrt()))
        return result

    def _gaussian_quantiles(
        self, level: PlateLevel, quantiles: list[float] | torch.Tensor, mean: torch.Tensor, sd: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        q = torch.as_tensor(quantiles, dtype=mean.dtype, device=mean.device)
        u = dist.Normal(mean, sd).icdf(q.reshape((-1,) + (1,) * mean.dim()))
        return {
            name: self._constrain(name, self._site_unconstrained(level, name, u, broadcast=False))
            for name in level.sites
        }


class _GradientTap(torch.autograd.Function):
    """``(copies, probe, table_sum, points_sum, curvature) = _GradientTap.apply(u, rows, table, points, secant, dims,
    *indices)``: per-element copies of the globals' draw ``u (d_g,)`` shaped as ``rows (..., d_g)`` (the call's rows of
    ``table``), a scalar 1, and (without gradient) the sums of ``table`` and ``points`` over all their elements and
    :func:`shared_curvature` of ``secant``, as they are when the forward pass runs (:func:`_table_summary`). The
    backward pass gives ``u`` no gradient; it writes each copy's gradient, divided by the probe's (the loss's own
    weight on the term: 1/particles), into ``table`` and the draw into ``points``, at the call's elements (``indices``
    of the plates at ``dims``), adds the secant pairs of the elements seen before (gradient and draw moved since their
    last visit) to ``secant`` (:func:`shared_curvature`), and brings the summary up to date with what it wrote."""

    @staticmethod
    def forward(ctx, u, rows, table, points, secant, dims, *indices):
        ctx.state, ctx.dims, ctx.indices, ctx.u = (table, points, secant), dims, indices, u.detach()
        summary = tuple(t.clone() for t in _table_summary(table, points, secant))
        ctx.mark_non_differentiable(*summary)
        return (u.detach().expand(rows.shape).clone(), u.new_ones(()), *summary)

    @staticmethod
    def backward(ctx, grad, probe, *_):
        with torch.no_grad():
            weight = float(probe)
            if weight != 0.0 and grad is not None:
                table, points, secant = ctx.state
                held = _held_summary(table, points, secant)  # (before the writes below)
                selection = dict(zip(ctx.dims, ctx.indices, strict=True))
                read, write = _element_access(table, selection, 1)
                old, old_at = read(table), read(points)
                new = (grad / weight).to(table.dtype).expand(old.shape)
                at = ctx.u.to(points.dtype)
                d = new.shape[-1]
                change, moved = (new - old).reshape(-1, d), (at - old_at).reshape(-1, d)
                # the secant pairs of the elements seen before (a stored gradient): the others' rows are zeroed, which
                # adds nothing to the sums (a boolean selection of the rows cost a synchronisation and two gathers)
                seen = (old != 0).any(-1).reshape(-1, 1).to(old.dtype)
                seen_change, seen_moved = change * seen, moved * seen
                secant.mul_(SECANT_DECAY)
                secant[0].add_(seen_change.mT @ seen_moved)
                secant[1].add_(seen_moved.mT @ seen_moved)
                write(table, new)
                write(points, at.expand(new.shape))
                if held is not None and all(_distinct(ix) for ix in ctx.indices):  # (each element written once)
                    acc = held[0].dtype
                    sums = (held[0] + change.sum(0, dtype=acc), held[1] + moved.sum(0, dtype=acc))
                    _hold_summary(table, points, secant, *sums)
        return (
            torch.zeros(ctx.u.shape, dtype=ctx.u.dtype, device=ctx.u.device),
            None,
            None,
            None,
            None,
            None,
            *([None] * len(ctx.indices)),
        )


#: id(table) -> (weak references to a control variate's table, points and secant, their versions, the sums of the
#: table and the points over all elements (float64) and the secant's shared curvature): see :func:`_table_summary`
_SUMMARIES: dict[int, tuple] = {}


def _held_summary(
    table: torch.Tensor, points: torch.Tensor, secant: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The held summary of a control variate's state (``(table sum, points sum, curvature)``), if it is that of these
    tensors as they are now: the same tensors, none written since (their version counters, which every in-place write
    advances, as when it was made)."""
    entry = _SUMMARIES.get(id(table))
    if entry is None or entry[0]() is not table or entry[1]() is not points or entry[2]() is not secant:
        return None
    if entry[3] != (table._version, points._version, secant._version):
        return None
    return entry[4:]


def _hold_summary(
    table: torch.Tensor, points: torch.Tensor, secant: torch.Tensor, table_sum: torch.Tensor, points_sum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = id(table)
    summary = (table_sum, points_sum, shared_curvature(secant.detach()))
    forget = weakref.ref(table, lambda ref, key=key: _forget_summary(key, ref))
    refs = (forget, weakref.ref(points), weakref.ref(secant))
    _SUMMARIES[key] = (*refs, (table._version, points._version, secant._version), *summary)
    return summary


def _forget_summary(key: int, ref: weakref.ref) -> None:
    entry = _SUMMARIES.get(key)
    if entry is not None and entry[0] is ref:
        del _SUMMARIES[key]


def _table_summary(
    table: torch.Tensor, points: torch.Tensor, secant: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""``(\sum_i T_i, \sum_i \theta_i, \bar H)`` of a control variate's state
    (:meth:`AutoBranchGuide._control_variate_term`): the table's and the points' sums over all elements (in their
    dtype) and :func:`shared_curvature` of the secant. Held between calls and kept up to date by
    :class:`_GradientTap`'s backward pass, which adds what it writes (in float64, but on MPS): O(B) a training call
    instead of two sums over all :math:`N` elements and a solve (at :math:`N = 10^5` groups the sums were about a
    millisecond of each step); made again from the tensors when they were written by anything else, or are other
    tensors (loaded, copied, unpickled)."""
    held = _held_summary(table, points, secant)
    if held is None:
        every = tuple(range(table.dim() - 1))
        acc = table.dtype if table.device.type == "mps" else torch.float64  # (MPS has no float64)
        sums = (table.detach().sum(every, dtype=acc), points.detach().sum(every, dtype=acc))
        held = _hold_summary(table, points, secant, *sums)
    return held[0].to(table.dtype), held[1].to(points.dtype), held[2]


def _distinct(index: torch.Tensor) -> bool:
    """Whether the indices are distinct (increasing ones without a sort)."""
    if index.numel() < 2 or bool((index[1:] > index[:-1]).all()):
        return True
    return index.unique().numel() == index.numel()


def shared_curvature(secant: torch.Tensor) -> torch.Tensor:
    r"""The elements' shared curvature :math:`\bar H` (``(d_g, d_g)``, symmetric) of their terms in the globals, from
    ``secant = (Σ ΔT Δθᵀ, Σ Δθ Δθᵀ)`` over elements revisited (their stored gradient and the globals' draw moved
    since the last visit, exponentially forgotten): the least-squares :math:`\bar H = (\sum \Delta T\,\Delta
    \theta^\top)(\sum \Delta\theta\,\Delta\theta^\top)^{-1}` (exact for Gaussian levels whose prior mean is linear
    in the globals, as the regression's :math:`-(I + \Lambda_i^{-1})^{-1}` averaged; zero before any pair)."""
    cross, gram = secant[0], secant[1]
    d = gram.shape[-1]
    trace = gram.diagonal().sum()
    ridge = torch.where(trace > 0, 1e-6 * trace / d, torch.ones_like(trace))  # (no pair yet: gram = cross = 0, H̄ = 0)
    eye = torch.eye(d, dtype=gram.dtype, device=gram.device)
    h = torch.linalg.solve(gram + ridge * eye, cross.mT).mT
    return 0.5 * (h + h.mT)


def expected_log_density(prior: GaussianPrior, mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    r""":math:`E_{\mathcal N(u;\, m, \Sigma)}[\log \mathcal N(u;\, \mu, P^{-1})]` up to :math:`-\tfrac d2\log 2\pi`,
    per batch element: :math:`\tfrac12\log|P| - \tfrac12 (m-\mu)^\top P (m-\mu) - \tfrac12\operatorname{tr}(P\Sigma)`,
    with ``prior`` :math:`(\mu, P)` and ``cov`` :math:`\Sigma` full ``(..., d, d)`` or its diagonal ``(..., d)``."""
    diff = mean - prior.loc
    if prior.diagonal:
        var = cov.diagonal(dim1=-2, dim2=-1) if cov.dim() == mean.dim() + 1 else cov
        p = prior.precision
        return 0.5 * (p.log().sum(-1) - (p * (diff.pow(2) + var)).sum(-1))
    p = prior.precision
    full = cov if cov.dim() == mean.dim() + 1 else torch.diag_embed(cov)
    quad = (diff.unsqueeze(-2) @ p @ diff.unsqueeze(-1)).squeeze(-1).squeeze(-1)
    trace = (p * full.mT).sum((-2, -1))
    return 0.5 * (torch.linalg.slogdet(p)[1] - quad - trace)


def _state_tensor(value: torch.Tensor) -> torch.Tensor:
    """The param store's tensor behind a real-valued parameter (to be written in place)."""
    unconstrained = getattr(value, "unconstrained", None)
    return value if unconstrained is None else unconstrained()


def _raw_state(module: PyroModule, name: str) -> torch.Tensor:
    """The tensor behind ``module``'s real-valued ``PyroParam`` ``name``, read without Pyro seeing a parameter."""
    return module._parameters[f"{name}_unconstrained"]  # (direct: no attribute walk, in every backward pass)


def _state_hook(guide: weakref.ref, keys: tuple[str, ...], value: torch.Tensor) -> None:
    """A gradient reached a hooked parameter ``value``: :meth:`AutoBranchGuide._after_backward` for each of its
    ``keys``."""
    live = guide()
    if live is not None:
        for key in keys:  # (in the order they were hooked: the count before the loc's average)
            live._after_backward(key, value)


def _accumulate_moments(acc: list, level: PlateLevel, tr, guide: AutoBranchGuide, size: int) -> None:
    """Add one chunk of ``size`` draws' conditional moments of ``level`` (its site in the trace ``tr``) to ``acc =
    [count, mean of the conditional means, their scatter, sum of the conditional covariances]``: the chunks' means and
    scatters are pooled exactly (Chan, Golub & LeVeque's pairwise update), so chunking does not change the moments."""
    site = tr.trace.nodes[f"_{guide._pyro_name}_{level.name}_unconstrained"]
    fn = site["fn"].sampler if isinstance(site["fn"], StickingTheLanding) else site["fn"]
    while isinstance(fn, dist.Independent):
        fn = fn.base_dist
    shape = site["value"].shape
    mean = fn.mean.expand(shape)
    if isinstance(fn, torch.distributions.MultivariateNormal | CholeskyPrecisionNormal):
        cov = fn.covariance_matrix.expand((*shape, shape[-1]))
    else:
        cov = torch.diag_embed(fn.variance.expand(shape))
    batch = (size, *level.batch_shape, shape[-1])
    mean, cov = mean.reshape(batch), cov.reshape((*batch, shape[-1]))
    chunk_mean = mean.mean(0)
    centred = mean - chunk_mean
    chunk_scatter = torch.einsum("s...i,s...j->...ij", centred, centred)
    count, old_mean, old_scatter, old_cov = acc
    if count == 0:
        acc[:] = [size, chunk_mean, chunk_scatter, cov.sum(0)]
        return
    total = count + size
    delta = chunk_mean - old_mean
    acc[0] = total
    acc[1] = old_mean + delta * (size / total)
    acc[2] = old_scatter + chunk_scatter + delta.unsqueeze(-1) * delta.unsqueeze(-2) * (count * size / total)
    acc[3] = old_cov + cov.sum(0)


def _reference_change(old: tuple, new: tuple, diagonal: bool) -> torch.Tensor:
    """How far a conjugate level's reference ``(prior loc, prior precision, curvature root)`` moved, per element: the
    largest of the prior mean's change in the prior's sds and the relative changes of the precision and the root
    (each against its largest entry)."""
    loc0, prec0, root0 = old
    loc1, prec1, root1 = new
    event = 1 if diagonal else 2
    diag = prec1 if diagonal else prec1.diagonal(dim1=-2, dim2=-1)
    shift = ((loc1 - loc0).abs() * diag.clamp(min=0).sqrt()).amax(-1)

    def relative(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(-event, 0))
        return (b - a).abs().amax(dims) / a.abs().amax(dims).clamp(min=torch.finfo(a.dtype).tiny)

    shape = torch.broadcast_shapes(shift.shape, relative(prec0, prec1).shape, relative(root0, root1).shape)
    return torch.stack([t.expand(shape) for t in (shift, relative(prec0, prec1), relative(root0, root1))]).amax(0)


def _jit_param_capture() -> bool:
    """Whether this runs inside Pyro's first, untraced call of a compiled function (``pyro.ops.jit.trace``, behind
    every ``Jit*_ELBO``), which records the parameters that its ``torch.jit`` trace will take as inputs: a param-only
    trace inside a ``poutine.block`` on Pyro's handler stack. (A training loop under a block of the user's own reads
    as if compiled: the same values, through Pyro.)"""
    blocked = False
    for frame in _PYRO_STACK:  # (outermost first)
        if isinstance(frame, BlockMessenger):
            blocked = True
        elif blocked and isinstance(frame, TraceMessenger) and frame.param_only:
            return True
    return False


def _tree_add(a, b):
    """``a + b`` leaf by leaf over nested tuples of tensors (``None`` leaves stay ``None``): the sum of a read's parts
    over blocks of rows."""
    if a is None:
        return None
    if isinstance(a, tuple | list):
        return type(a)(_tree_add(x, y) for x, y in zip(a, b, strict=True))
    return a + b


def _as_list(plates) -> list:
    return [plates] if isinstance(plates, pyro.plate) else list(plates)


def _subsample_size(plate: pyro.plate | PlateCall) -> int:
    return plate.subsample_size


def _element_access(
    buffer: torch.Tensor, selection: dict, event_dim: int
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor, torch.Tensor], None]]:
    """``(read, write)`` of the elements of ``selection`` in full-size per-element buffers shaped as ``buffer``:
    ``read(t)`` is ``t[index]`` and ``write(t, v)`` is ``t[index] = v`` for :func:`_element_index`'s ``index``, by
    ``index_select`` / ``index_copy_`` where one plate is subsampled (the usual minibatch), by that index otherwise."""
    batch = buffer.dim() - event_dim
    tensors = [(batch + dim, ix) for dim, ix in selection.items() if ix is not None and buffer.shape[batch + dim] > 1]
    if len(tensors) == 1:
        pos, ix = tensors[0]
        ix = ix.to(buffer.device)

        def write_rows(t: torch.Tensor, v: torch.Tensor) -> None:
            t.index_copy_(pos, ix, v)

        return (lambda t: t.index_select(pos, ix)), write_rows
    index = _element_index(buffer, selection, event_dim)

    def write(t: torch.Tensor, v: torch.Tensor) -> None:
        t[index] = v

    return (lambda t: t[index]), write


def _element_index(buffer: torch.Tensor, selection: dict, event_dim: int) -> tuple:
    """An index into a full-size per-element ``buffer`` selecting the elements of ``selection`` (every combination
    when several plates are subsampled), for assignment."""
    batch = buffer.dim() - event_dim
    index: list = [slice(None)] * batch
    tensors = [(batch + dim, ix) for dim, ix in selection.items() if ix is not None and buffer.shape[batch + dim] > 1]
    for k, (pos, ix) in enumerate(tensors):
        shape = [1] * len(tensors)
        shape[k] = -1
        index[pos] = ix.to(buffer.device).reshape(shape) if len(tensors) > 1 else ix.to(buffer.device)
    return tuple(index)

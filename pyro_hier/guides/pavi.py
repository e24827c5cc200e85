"""Plate-amortized normalizing flows (PAVI): one conditional flow per latent site, shared by all its plate elements."""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions.conditional import ConditionalTransformModule
from pyro.infer.autoguide.initialization import init_to_feasible
from pyro.nn import PyroModule, PyroParam
from pyro.params.param_store import param_with_module_name
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample
from torch import nn
from torch.distributions import biject_to, constraints
from torch.distributions.transforms import AffineTransform, ComposeTransform, ReshapeTransform, Transform
from torch.distributions.utils import _standard_normal, _sum_rightmost

from pyro_hier.conjugate import (
    GaussianPrior,
    Unobserved,
    capture_priors,
    conditional_mode,
    element_expansion,
    gaussian_prior,
    gaussian_update,
    precision_to_scale_tril,
    pseudo_observation,
    rest_log_density,
    warm_conditional_mode,
)
from pyro_hier.distributions import StickingTheLanding
from pyro_hier.encoders import DeepSetEncoder, FreeEncoding, FrozenPositions, SiteData
from pyro_hier.errors import StructureError
from pyro_hier.flows import NETWORK_RATE, FreeAffine, make_flow
from pyro_hier.gather_maps import GatherMaps, full_data_call
from pyro_hier.gathers import keep_random_state
from pyro_hier.guides.amortized import (
    EXPANSION_NEWTON_STEPS,
    EXPANSION_NEWTON_TOLERANCE,
    ROW_EXPANSION_EVERY,
)
from pyro_hier.guides.base import HierarchicalGuide, concat_broadcast, empirical_quantiles, parameter_keys
from pyro_hier.guides.branch import CURVATURE_FLOOR, DERIVATIVE_STEP, SLOPE_NODES
from pyro_hier.local_data import (
    ObservedRows,
    call_local_features,
    capture_observations,
    data_complete,
    is_factor,
    observation_features,
)
from pyro_hier.nn import PackedParameters
from pyro_hier.optim import tail_average_update
from pyro_hier.plates import PlateRecorder, argument_key, capture_plates, row_blocks
from pyro_hier.structure import LatentSite, ModelStructure

__all__ = ["AutoPlateAmortizedFlow"]

#: the globals' largest initial spread in unconstrained space without ``init_scale``: ``AutoNormal``'s start. From
#: their prior's spread (a ``Normal(0, 5)`` location: 5) q needed 1,000-2,000 steps of Adam at rate 0.01 to reach the
#: ELBO ``AutoNormal`` reaches in 300 (each step of a log scale moves it by about the rate)
GLOBAL_INIT_SPREAD = 0.1
_ENCODERS = ("free", "deepset")
_CONDITIONALS = ("conjugate", "pushforward")
#: the model's pseudo-observations are read again after this many training calls (at once for other arguments)
EXPANSION_EVERY = 10
#: rate of the running mean and variance of the globals' draws, where the pseudo-observations are read
GLOBAL_RATE = 0.05
#: bound on the log-stretch of a pseudo-observation's sd along its slopes (far draws early in a run, float32)
STRETCH_LIMIT = 15.0
#: the exponents of the pseudo-observation's natural parameter along the globals are looked for in ±this (per unit of
#: the globals' unconstrained coordinates), on a grid of :data:`POWER_GRID` points
POWER_LIMIT = 4.0
#: the expansion's interval doubles, up to this many times :data:`EXPANSION_EVERY`, while its slopes predict each redo
EXPANSION_BACKOFF = 64
#: a redo is predicted when it moves no pseudo-observation's natural parameter by more than this fraction of its sd's
#: inverse, its precision by more than this fraction, nor its slopes by more than 5 times this fraction of their size
PREDICTION_TOLERANCE = 1e-2
POWER_GRID = 129
#: the parts of the reference state (``references.state``): the running mean and variance of the globals' draws, the
#: mean and sd where the pseudo-observations were read, the training calls since then and the interval of the redos
#: where the model draws its rows at random, a due expansion is deferred while the running mean of the globals' draws
#: is within this many of the reference's sds of it (and their running sd within a factor ``exp(±ROW_REFERENCE_MOVE)``):
#: :meth:`AutoPlateAmortizedFlow._rows_reference_holds`. The running mean (rate :data:`GLOBAL_RATE`) wanders by about
#: 0.2 sd from its own noise (sd ``sqrt(GLOBAL_RATE / 2)``), so a tighter bound redoes the expansion on noise
ROW_REFERENCE_MOVE = 1.0
#: on minibatches, the elements not read at the current reference are all read at once, by the first call that has
#: one, while they number at most this many times the call's (one read per reference where the plates are small: at
#: 85 counties, 20 a call, one read per call: 14.0 ms a step, 9.0 with this, 9.2 before), else each call its own
STALE_READ_FACTOR = 4
#: Gauss-Seidel sweeps over the expanded sites of one plate level to their joint conditional mode (:meth:`_expand`)
SIBLING_SWEEPS = 3
STATE_KEYS = ("global_mean", "global_var", "ref_mean", "ref_sd", "calls", "every")
#: the modules whose parameters are packed into one vector (``packed.flat``: :class:`~pyro_hier.nn.PackedParameters`)
PACKED = ("flows", "encoder", "site_affines")


class AutoPlateAmortizedFlow(HierarchicalGuide):
    r"""Plate-amortized variational inference (PAVI, Rouillard et al. 2023): a drop-in for ``AutoNormal`` whose
    parameters are shared across the elements of every plate.

    For every latent site template :math:`\theta_i` (one ``pyro.sample`` statement, whatever its plates) one
    conditional normalizing flow :math:`F_i` is shared by all its ground variables :math:`\theta_{i,n}` (the
    elements of its plates). It pushes forward the model's own *prior conditional* given the guide's samples of the
    parents (the cascading structure of Ambrogioni et al. 2021), in unconstrained space:

    .. math::

        u_{i,n} \sim p_i(\cdot \mid \mathrm{pa}_i),\qquad
        \theta_{i,n} = T_i\big(F_i\big(T_i^{-1}(u_{i,n});\ c_{i,n}\big)\big),\qquad
        c_{i,n} = \big[E_{\ell(i), n},\ E_{\ell(\mathrm{anc}(i)), n},\ T^{-1}(u_{\mathrm{anc}(i)})\big]

    with :math:`T_i` = ``biject_to(support)``. The context :math:`c_{i,n}` is the encoding :math:`E` of the
    element's plate level (the tuple of plates of the site) and, with ``condition_on_ancestors=True``, the sites
    sampled before it whose plates are among its own, at the same plate element: its *plate ancestors* (the globals
    of a two-level model) and the earlier sites of its own level, so the guide is autoregressive over the sites of a
    level (without them, globals with independent priors would be independent under q). Each enters through its
    *base sample* :math:`T^{-1}(u)` — the prior draw its flow pushed forward, an invertible function of its value
    given its own context — which stays of the prior's order whatever the posterior's location and scale, so the
    networks see well-scaled inputs (raw values such as a scale's logit near −5.8 ± 0.3 trained much worse on
    radon). The prior conditional carries the dependence on the parents that the model states; the context lets the
    flow learn the rest (a linear-Gaussian model's posterior mean of a group is affine in the population mean with a
    different coefficient than the prior's, which an encoding alone cannot express; PAVI's original form,
    ``condition_on_ancestors=False``, then leaves about 0.02 nats per group and dimension on GRE).

    With ``encoder="deepset"`` and ancestors in the context, the context also holds the encodings of the ancestors'
    levels :math:`E_{\ell(\mathrm{anc}(i)), n}` (the population's for a group). A base sample says where an
    ancestor's draw lies *within* its q, but that q is conditioned on its level's encoding, which is pooled from
    the data of the plate elements in the batch and so moves from minibatch to minibatch; without it a group's flow
    cannot tell where the population mean's draw is. On GRE with 20,000 groups trained 20 at a time (4,000 steps,
    iterates averaged over the last quarter), the gap to the exact evidence was 0.0051 nats per group without these
    encodings or the deep set's linear part (:class:`~pyro_hier.encoders.DeepSetEncoder`), 0.0029 with the encodings
    only, 0.010 with the linear part only, and 0.00014 with both. A free encoding can hold whatever its element's
    flow needs to know about its ancestors, so ``encoder="free"`` adds none.

    Encodings (``encoder=``):

    - ``"free"`` (PAVI-F): a free array per plate level at the plates' full sizes, sliced by the model's subsample
      indices — parameters grow by ``encoding_size`` per plate element; minibatch training is unbiased.
    - ``"deepset"`` (PAVI-E): computed from the observed data nested in the level's plates, or gathering its
      elements by an index (a flat plate of rows reading ``a[..., county]``, index chains, crossed plates), by a deep
      set pooling one plate at a time (:class:`~pyro_hier.encoders.DeepSetEncoder`) — the parameter count does not
      depend on plate sizes. Gathered rows take the route their nested formulation would (homes into counties,
      counties into states), so both formulations give the same guide (tests/guides/test_gathered.py).

    **Gathered models.** A level whose sites read single elements of another level's plates (counties reading
    their state, ``c ~ Normal(s[..., county_state], τ)``) has that level as an ancestor, as if nested in it
    (:class:`~pyro_hier.structure.LevelLink`): with ``condition_on_ancestors=True`` each county's flow sees its
    state's base sample (and, with the deep set, its state's encoding). Under minibatches the deep set's pooled
    encodings of a level must not depend on which rows a minibatch holds: where the call's rows hold all the data of
    the level's elements (the group plate subsampled with its rows following, :func:`pyro_hier.plates.gathered_rows`)
    they are used; otherwise — the globals' encoding while groups are subsampled, rows subsampled with every group
    present — the encoder reads the model's call on all its data (run once while the arguments are the same
    objects; the encoder itself then runs on all the rows every step: MovieLens, 100 users per step, 98 ms/step),
    which keeps the ELBO unbiased (tested by enumerating minibatches). Observations nested in their plates are pooled
    from the minibatch, as PAVI's reduced model does (slightly biased, as the paper notes). A call without the
    observations (``obs=None``) encodes from the data of the last call that had them.

    Each site's flow is followed by a free elementwise affine map (:class:`~pyro_hier.flows.FreeAffine`, shared by the
    site's plate elements; the named flows start as the identity), which Adam moves as it moves ``AutoNormal``'s
    locations and log-scales, and which sets the start: by default the prior conditional itself (PAVI's own start);
    with ``init_loc_fn`` the median at the init values (for a plated site, their mean over the elements) and with
    ``init_scale`` that spread in unconstrained space. A site whose prior has no ``rsample`` (``LKJCholesky``) is
    pushed forward from a standard normal in unconstrained space instead, as ``AutoNormal``'s Gaussian; it starts at
    the prior's median and spread (estimated from draws) unless told otherwise. With the conjugate conditional (the
    default) so is every global site (outside all plates): a flow pushing the prior forward keeps its tails, and a
    ``HalfCauchy`` scale's log has exponential tails that an affine map leaves as a power law in the scale — on
    non-centred eight schools q's ``tau`` had an sd 2.3–47 times the posterior's, and a mean 2.7 sds off, once
    q₀ followed ``tau`` exactly; its dependence on earlier globals is the flow's, through their base samples.

    **Conjugate sites** (``conditional="conjugate"``, the default). A plated site whose prior conditional is Gaussian
    in unconstrained space (county effects, schools, random effects) is not pushed forward from its prior: its flow
    corrects the *standardised* draw of :math:`q_0`, the model's own conditional — the prior conditional at the
    parents' draws times the likelihood's second-order expansion read from the model
    (:func:`~pyro_hier.conjugate.element_expansion`: a Gaussian pseudo-observation
    :math:`\bar\Lambda_n = F_n`, :math:`\bar\eta_n = F_n c_n + g_n` per plate element, which is the likelihood itself
    where it is Gaussian in the site; where it is not, read at each element's conditional mode :math:`c_n`
    (:func:`~pyro_hier.conjugate.conditional_mode`), so that :math:`q_0` at the reference is the Laplace approximation
    of the element's conditional — read at the prior's mean instead, a Poisson group with many large counts was put
    one overshooting Newton step away, 6 prior sds from its mode, and the networks, at a tenth of Adam's rate, had
    to learn the shift back: Poisson counts of benchmarks/unseen.py, largest posterior-mean error 0.21–0.44
    reference sds over 3 seeds, 0.05–0.10 at the mode, ``AutoNormal`` 0.14–0.19), moved with the globals' draw
    :math:`\theta` (:math:`\Delta = \theta - \bar\theta`) along slopes read from the model by central differences as
    :class:`~pyro_hier.AutoBranchGuide` reads them:

    .. math::

        \eta(\theta) = e^{D\Delta} \odot (\bar\eta + B\Delta),\qquad \Lambda(\theta) = E\bar\Lambda E,\quad
        E = \mathrm{diag}(e^{C\Delta}),

    with one exponent per global coordinate (:math:`D`, shared by the plate's elements, fitted to the three reads by
    :func:`natural_power`; 0 where the likelihood is not Gaussian in the site, where the slopes are derivatives).
    A Gaussian likelihood :math:`y \sim \mathcal N(a u + c, \sigma^2)` has :math:`\Lambda = a^2/\sigma^2` and
    :math:`\eta = a(y - c)/\sigma^2`, so this form is exact along a location (:math:`c`: :math:`D = 0`), a log scale
    of the coefficient (non-centred eight schools' :math:`\log\tau`: :math:`D = 1`, :math:`C = 1`) and a log noise
    scale (radon's :math:`\log\sigma_y`: :math:`D = -2`, :math:`C = -1`) alike. (Linear :math:`\eta`, the earlier
    form, sent q₀'s mean 24–1,500 prior sds off for draws of radon's noise scale far from the reference, which
    collapsed its county scale at Adam's rate 0.05 and made the deep set's loss NaN in float32; a linear mean
    :math:`\eta/\Lambda` is exact for radon but not along :math:`\tau`, where it cost non-centred eight schools
    0.15 → 0.53 reference sds.) Then:

    .. math::

        q_0(u_n \mid \mathrm{pa}) \propto p(u_n \mid \mathrm{pa})\,\mathcal N(\Lambda_n^{-1}\eta_n;\ u_n,
        \Lambda_n^{-1}) = \mathcal N(m_n, L_n L_n^\top),\qquad
        \varepsilon_n \sim \mathcal N(0, I),\quad u_n = m_n + L_n\, A\big(F_i(\varepsilon_n;\ c_n)\big),

    with :math:`A` the site's free affine map. The flow and :math:`A` start as the identity, so q starts at
    :math:`q_0` — the exact conditional of linear-Gaussian hierarchies, whatever the globals' draw (the funnel of a
    centred model included) — and the networks, shared by the plate's elements, learn what it misses, in units of
    the conditional sd; the base sample its descendants see is :math:`\varepsilon_n`. The expansion holds no
    parameter: it is read at the running mean :math:`\bar\theta` (and sd) of the globals' draws (rate
    :data:`GLOBAL_RATE`), redone every :data:`EXPANSION_EVERY` training calls (at doubling intervals, up to
    :data:`EXPANSION_BACKOFF` times that, while the slopes predict each redo: :func:`predicted_expansions`) and at
    once for other arguments. On minibatches of groups (``subsample=idx``) each element keeps its expansion with the
    reference it was read at, moved from there along its slopes, and is read again — from the model restricted to the
    minibatch's elements that need it — when it is next in a minibatch after the reference moved, each with its own
    exponents :math:`D` fitted to its own three reads (a step then costs O(minibatch): at N = 100,000 groups a redo
    of all of them cost about 75 s CPU every ~20 steps);
    :math:`\bar\theta` and the reference are gradient-free parameters (``references``), so ``state_dict``, the param
    store and pickles carry them. A site with latent descendants (the regions above groups of a three-level model)
    is not expanded — its rest of the model would read the descendants' values as data — and its :math:`q_0` is its
    prior conditional (the flow then corrects the prior's standardised draw: its shifts are in units of the
    population scale). In the drop-in loop of issue 19 (benchmarks/dropin.py; numbers in benchmarks/README.md)
    this form took the largest posterior-mean error on radon from 1.37 reference sd (PAVI's own form) to about 0.2.
    Calls without the observations (``Predictive`` with ``obs=None``) read each element's last pseudo-observation
    made with data (elements never seen with data: none, i.e. :math:`q_0` is their prior conditional).

    Each call runs the model once under a handler that replaces each latent site's distribution by the flow pushing
    it forward, so the guide needs no description of the model beyond its trace; it opens the model's own plates
    with the model's own indices (``pyro.plate(..., subsample=idx)`` is honoured; with ``subsample_size=`` the guide
    draws the indices and the model replays them, as in Pyro). Training on a *reduced model* — every plate subsampled,
    log-densities scaled by full/reduced size — is Pyro's plate scaling;
    :func:`pyro_hier.plates.draw_subsamples` draws indices for all plates at once.

    ``median`` and ``quantiles`` are Monte Carlo estimates from ``num_summary_samples`` draws (for the plates as the
    model opens them with the arguments given).

    **Tail average.** Funnels (a group scale whose posterior reaches towards zero) leave the ELBO nearly flat along
    the scale, so the last iterate of a noisy run scatters there. The guide therefore keeps a Polyak–Ruppert average
    of its parameters over the last ``tail_average`` fraction of the training steps so far
    (:func:`~pyro_hier.optim.tail_average_update`, updated from a gradient hook, so any training loop feeds it), and
    every call without gradients (``Predictive``, ``median``, ``quantiles``, ``Trace_ELBO().loss``) uses the average
    instead of the last iterate. The average and its count are parameters without gradients
    (:meth:`state_parameters`), so ``state_dict``, Pyro's param store and pickles carry them. In the drop-in loop of
    issue 19 (``ClippedAdam`` 0.01 decaying tenfold over 5,000 steps, one particle, 2,000 ``Predictive`` draws;
    benchmarks/dropin.py, seed 0; measured with an earlier conjugate form whose pseudo-observation came from the
    flow's network) the largest posterior-mean error on radon with Uniform priors was 0.16 reference sd for the last
    iterate and 0.14 for the average over the last quarter (the noise scale's error 0.44 and 0.03); PAVI's own form
    went from 1.37 to 0.21 with it. An average lags behind parameters that still drift: on radon with half-normal
    priors the last quarter's average was 0.89 sd off against the last iterate's 0.40, the last tenth's (the
    default) 0.27. Longer runs: on radon, 12,000 steps with ``condition_on_ancestors=True``,
    the last iterate's largest posterior-mean error was 0.12–0.14 reference sd, the average of the last 3,000
    iterates' 0.059–0.081 on five seeds (benchmarks/pavi_radon.py).

    Example::

        guide = AutoPlateAmortizedFlow(model)              # instead of AutoNormal(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 5e-3}), Trace_ELBO())
        for step in range(2000):
            svi.step(x, subsample=torch.randperm(N)[:20])
        guide.quantiles([0.05, 0.95], x)

    :param model: a Pyro model whose latent sites are all continuous and reparameterisable.
    :param encoder: ``"free"`` or ``"deepset"``.
    :param encoding_size: size ``C`` of each plate element's encoding.
    :param flow: ``"affine"`` (default: an elementwise affine map whose shift and log-scale are networks of the
        context; it does not correlate the coordinates of one element's vector, as ``AutoNormal`` does not),
        ``"affine+maf"`` (an affine block then a masked autoregressive flow, PAVI's own choice), or a callable
        ``(input_dim, context_dim)`` returning a Pyro
        :class:`~pyro.distributions.conditional.ConditionalTransformModule`. The autoregressive block buys
        non-Gaussian shapes (skew, funnels) at a price in precision where the posterior given the parents is close
        to Gaussian: on GRE with 20,000 groups (deep set, 20 groups per step, 60 s) the gap to the exact evidence
        was 2.5–4.1 nats with ``"affine+maf"`` (2 seeds) and 0.05–0.64 with ``"affine"`` (8 seeds), which, being
        cheaper, also took 50% more steps (benchmarks/pavi.py). The autoregressive block's error is in the groups'
        conditionals, spread over all groups and largest for those with extreme data
        (benchmarks/pavi_gap_split.py).
    :param flow_hidden: hidden layers of the flows' networks (default one of 32 units: with two, radon's drop-in
        loop cost 8% more CPU time per step).
    :param encoder_hidden: hidden layers of the deep-set networks (``encoder="deepset"``).
    :param condition_on_ancestors: include the earlier sites' base samples in each flow's context (see above).
        Default ``True``; ``False`` is PAVI's own form. With them the family contains the exact posterior of
        linear-Gaussian
        hierarchies (GRE, 20 groups: 0.05 nats from the exact evidence after 1,500 steps, against a floor of about
        0.02 nats per group and dimension without). They used to diverge on radon (the noise scale's q 500× too
        wide after 1,500 steps), which the networks' output multiplier fixed (see
        :class:`~pyro_hier.flows.ConditionalAffine`): benchmarks/pavi_radon.py measures both forms.
    :param conditional: how a plated site whose prior conditional is Gaussian in unconstrained space (``Normal``,
        ``LogNormal``, ``MultivariateNormal``) gets its q given the parents. ``"conjugate"`` (default): its flow
        corrects :math:`q_0`, the model's own conditional (see "Conjugate sites" above). ``"pushforward"``, PAVI's own
        form: the flow pushes the prior conditional forward, which ties the spread of every group's q to the
        population scale and leaves every group's shift to be learnt from its encoding (radon in the drop-in loop,
        seed 0: 1.37 reference sd off after 5,000 steps). Global sites and sites whose prior conditional is not
        Gaussian are pushed forward either way.
    :param local_features: covariates of the observed sites for ``encoder="deepset"``: ``(*args, **kwargs) ->`` a
        tensor (one observed site) or ``{site: tensor}``, batch dims as the site's (rows for a flat plate; subsampled
        plates at full size are sliced), then features; each element's input is its observed value followed by its
        covariates. Covariates are not guessed from the model's arguments.
    :param stick_the_landing: score the guide's samples with detached flow parameters and encodings
        (:class:`~pyro_hier.distributions.StickingTheLanding`): an unbiased gradient whose variance vanishes where
        q equals the posterior (see :class:`~pyro_hier.AutoBranchGuide`).
    :param init_loc_fn: an initialisation strategy (as in ``AutoNormal``: ``init_to_median``, ``init_to_value(...)``,
        …): q starts with its median there. ``None`` (default): q starts at the prior conditional pushed forward by
        the identity, PAVI's own start. (Conjugate sites start at :math:`q_0`.)
    :param init_scale: q's initial spread in unconstrained space (sd of a Gaussian prior; for others, the
        interquartile range / 1.349). ``None`` (default): the prior's spread, at most :data:`GLOBAL_INIT_SPREAD`
        (0.1, ``AutoNormal``'s start) for the globals. (Conjugate sites start at :math:`q_0`.)
    :param network_rate: how fast Adam moves the flows' networks relative to the free parameters (an internal rate
        multiplier, :class:`~pyro_hier.nn.RateLinear`, on the named flows' conditional affine block). ``None``
        (default): :data:`~pyro_hier.flows.NETWORK_RATE` (0.1) with the conjugate conditional, where :math:`q_0`
        carries each element's location and the networks correct it and condition on the ancestors — at the full
        rate their weights' step noise, carried to every draw through contexts of order one, widened radon's globals
        at Adam's rate 0.05 (noise scale's sd 2.15× the posterior's, county scale 0.68 sds off, against 0.30 with
        0.1) — and 1 with ``conditional="pushforward"``, where the networks must carry each element's location.
    :param num_summary_samples: draws behind ``median`` and ``quantiles``.
    :param tail_average: the fraction of the training steps so far over which the parameters are averaged for
        calls without gradients (see "Tail average" above); ``None`` uses the last iterate everywhere.

    Reference: L. Rouillard, A. Le Bris, T. Moreau, D. Wassermann, *PAVI: Plate-Amortized Variational Inference*,
    TMLR 2023.
    """

    def __init__(
        self,
        model: Callable,
        *,
        encoder: str = "free",
        encoding_size: int = 16,
        flow: str | Callable[[int, int], ConditionalTransformModule] = "affine",
        flow_hidden: Sequence[int] = (32,),
        encoder_hidden: Sequence[int] = (32,),
        condition_on_ancestors: bool = True,
        local_features: Callable | None = None,
        stick_the_landing: bool = False,
        init_loc_fn: Callable | None = None,
        init_scale: float | None = None,
        num_summary_samples: int = 1000,
        tail_average: float | None = 0.1,
        conditional: str | None = None,
        network_rate: float | None = None,
    ) -> None:
        if encoder not in _ENCODERS:
            raise ValueError(f"encoder must be one of {_ENCODERS}, got {encoder!r}")
        for label, value in (("encoding_size", encoding_size), ("num_summary_samples", num_summary_samples)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{label} must be a positive integer, got {value!r}")
        for label, value in (("flow_hidden", flow_hidden), ("encoder_hidden", encoder_hidden)):
            if not all(isinstance(h, int) and h >= 1 for h in value):
                raise ValueError(f"{label} must be a sequence of positive integers, got {value!r}")
        if not (isinstance(flow, str) or callable(flow)):
            raise ValueError(f"flow must be a name or a callable (input_dim, context_dim), got {flow!r}")
        if local_features is not None and (encoder != "deepset" or not callable(local_features)):
            raise ValueError(
                "local_features must be a callable (*args, **kwargs) -> tensor or {observed site: tensor}, and is "
                f"read by encoder='deepset' only (got encoder={encoder!r})"
            )
        if not isinstance(stick_the_landing, bool):
            raise ValueError(f"stick_the_landing must be True or False, got {stick_the_landing!r}")
        if not isinstance(condition_on_ancestors, bool):
            raise ValueError(f"condition_on_ancestors must be True or False, got {condition_on_ancestors!r}")
        if init_loc_fn is not None and not callable(init_loc_fn):
            raise ValueError(f"init_loc_fn must be None or an initialisation strategy, got {init_loc_fn!r}")
        if init_scale is not None and not (
            isinstance(init_scale, int | float) and init_scale > 0 and math.isfinite(init_scale)
        ):
            raise ValueError(f"init_scale must be None or a positive number, got {init_scale!r}")
        if tail_average is not None and not (isinstance(tail_average, int | float) and 0 < tail_average <= 1):
            raise ValueError(f"tail_average must be None or a fraction in (0, 1], got {tail_average!r}")
        self.tail_average = None if tail_average is None else float(tail_average)
        if conditional is None:
            conditional = "conjugate"
        if conditional not in _CONDITIONALS:
            raise ValueError(f"conditional must be one of {_CONDITIONALS} or None, got {conditional!r}")
        self.conditional = conditional
        if network_rate is None:
            network_rate = NETWORK_RATE if conditional == "conjugate" else 1.0
        if not (isinstance(network_rate, int | float) and 0 < network_rate and math.isfinite(network_rate)):
            raise ValueError(f"network_rate must be None or a positive number, got {network_rate!r}")
        self.network_rate = float(network_rate)
        self._hooked: weakref.ref | None = None
        self._average_pairs: tuple = ()
        # (call key, {site: the model's pseudo-observation}, the call's arguments) of the last refresh
        self._expansion: tuple | None = None
        self._data_tables: dict[str, list[torch.Tensor]] = {}  # each element's last pseudo-observation with data
        # minibatches: which elements of the tables were read at the current (data, reference) — the stamp, held with
        # the arguments (see _read_stale_rows)
        self._fresh: dict[str, torch.Tensor] = {}
        self._table_stamp: tuple | None = None
        self._unobserved_stamp: tuple | None = None  # (a stamp whose call omits the observations: not read again)
        self._backoff_due = False  # the reference moved: the next rows read again decide the interval (_back_off_rows)
        self._start_at_init_loc = init_loc_fn is not None
        self._init_scale = None if init_scale is None else float(init_scale)
        self.encoder_kind = encoder
        self.encoding_size = encoding_size
        self.flow_spec = flow
        self.flow_hidden = tuple(flow_hidden)
        self.encoder_hidden = tuple(encoder_hidden)
        self.condition_on_ancestors = condition_on_ancestors
        self.local_features = local_features
        self.stick_the_landing = stick_the_landing
        self._detached_flows: tuple[nn.Module] | None = None
        self._transform_dims: dict[tuple, list] = {}  # (site, transform types) → their event dims (_PushForward)
        self._network_params: str | None = None  # the packed vector's name in the param store (found on first use)
        self._pack_owners: list | None = None  # where each packed parameter's view goes (found on first use)
        self._quadratic: dict[str, bool] = {}  # expanded site → its likelihood is Gaussian in it (checked once)
        self._globals_read: dict[str, torch.Tensor] = {}  # expanded site → which globals its likelihood reads (once)
        # (call key, {site: its elements' conditional modes}, the call's arguments) of the last expansion
        self._modes: tuple | None = None
        self._unpacked: tuple | None = None  # the memory the networks' views show, after a call without gradients
        self._event_shapes: dict[tuple, torch.Size] = {}  # (site, support type, event shape) → unconstrained event
        self.num_summary_samples = num_summary_samples
        super().__init__(model, init_loc_fn=init_to_feasible if init_loc_fn is None else init_loc_fn)

    _pickled_callables = (*HierarchicalGuide._pickled_callables, "local_features")
    _needs_model_because = (
        "AutoPlateAmortizedFlow runs the model on every call: its flows push forward the model's own prior "
        "conditionals, which only the model can compute"
    )

    def __getstate__(self) -> dict:
        if self._pack_owners is not None:  # views without the last call's graph (they pickle)
            self._modules["packed"].unpack(self._modules["packed"].flat.detach(), self._pack_owners)
            self._unpacked = None
        state = super().__getstate__()
        state["_detached_flows"] = None  # rebuilt on use
        state["_transform_dims"] = {}
        state["_network_params"] = None
        state["_pack_owners"] = None
        state["_modes"] = None
        state["_unpacked"] = None
        state["_event_shapes"] = {}
        state["_hooked"] = None  # gradient hooks are not pickled: the first training call installs them again
        state["_average_pairs"] = ()
        state["_expansion"] = None  # redone from the references (state) on the next call
        state["_fresh"] = {}  # (every element read again when next in a minibatch; the stamp holds the data)
        state["_table_stamp"] = None
        state["_unobserved_stamp"] = None
        return state

    # ---- setup ----------------------------------------------------------------------------------------------
    def _check_sites(self, structure: ModelStructure) -> None:
        if not structure.latent:
            raise StructureError("the model has no latent sites: AutoPlateAmortizedFlow has nothing to approximate")
        for site in structure.latent.values():
            if site.discrete and site.enumerated:
                raise StructureError(
                    f"site '{site.name}' is enumerated. AutoPlateAmortizedFlow runs the model inside the guide, so "
                    "it cannot leave the site to TraceEnum_ELBO: as with AutoNormal, give it the model with the site "
                    f"hidden, poutine.block(model, hide=['{site.name}']), in an AutoGuideList beside a guide for the "
                    "site (AutoDiscreteParallel), or use AutoBranchGuide, which leaves enumerated sites alone."
                )
            if site.discrete:
                raise StructureError(
                    f"site '{site.name}' is discrete and not enumerated. AutoPlateAmortizedFlow pushes forward the "
                    "prior of continuous sites through flows; use AutoHierarchicalVM, which handles discrete latents, "
                    "or enumerate the site (infer={'enumerate': 'parallel'} with TraceEnum_ELBO; Pyro's tutorial: "
                    "https://pyro.ai/examples/enumeration.html) and use AutoBranchGuide."
                )

    def _setup_guide(self, structure: ModelStructure) -> None:
        sites = list(structure.latent)
        self._keys = parameter_keys(sites)  # site names as module names (Pyro allows "." in site names)
        self.levels = structure.plate_levels(sites)
        self._level_of = {name: level for level in self.levels for name in level.sites}
        levels = {level.name: level for level in self.levels}
        order = {name: i for i, name in enumerate(structure.latent)}
        self._conjugate_sites = frozenset(
            name
            for name in sites
            if self.conditional == "conjugate"
            and self._level_of[name].plates
            and structure.latent[name].reparameterized
            and gaussian_prior(structure.latent[name].fn, structure.latent[name].support) is not None
        )
        # the model's own pseudo-observation is read for the conjugate sites of levels without latent descendants
        # (whose rest of the model is their likelihood; a level above others would read its children's values as data)
        self._expanded_sites = frozenset(
            name
            for name in self._conjugate_sites
            if not any(self._level_of[name].name in level.ancestors for level in self.levels)
        )
        self._global_level = next((level for level in self.levels if not level.plates), None)
        self._context_sites: dict[str, tuple[str, ...]] = {}
        self._context_levels: dict[str, tuple[str, ...]] = {}
        like = next(iter(structure.latent.values())).value
        if not like.is_floating_point():
            like = like.to(torch.get_default_dtype())
        self.flows = nn.ModuleDict()
        for name in sites:
            site = structure.latent[name]
            own = self._level_of[name]
            ancestors = ()
            if self.condition_on_ancestors:  # every earlier site of its level or of an ancestor level (nested in
                # fewer of its plates, or read through gathers: a county's state)
                ancestors = tuple(
                    a
                    for a in sites
                    if order[a] < order[name]
                    and (set(structure.latent[a].plates) <= set(site.plates) or self._level_of[a].name in own.ancestors)
                )
            self._context_sites[name] = ancestors
            if self.encoder_kind == "deepset":  # a free encoding can hold its ancestors' already
                self._context_levels[name] = tuple(
                    dict.fromkeys(self._level_of[a].name for a in ancestors if self._level_of[a].name != own.name)
                )
            else:
                self._context_levels[name] = ()
            context_dim = self.encoding_size * (1 + len(self._context_levels[name]))
            context_dim += sum(structure.latent[a].element_numel for a in ancestors)
            self.flows[self._keys[name]] = make_flow(
                self.flow_spec, site.element_numel, context_dim, self.flow_hidden, self.network_rate
            )
        if self.encoder_kind == "free":
            self.encoder = FreeEncoding(self.levels, self.encoding_size, like)
        else:
            calls, observations = capture_observations(self.model, structure.args, structure.kwargs)
            covariates = self._covariates(structure.args, structure.kwargs)
            features = {
                name: observation_features(obs, calls, covariates.get(name), like.dtype)
                for name, obs in observations.items()
            }
            self.encoder = DeepSetEncoder(structure, self.levels, features, self.encoding_size, self.encoder_hidden)
        self.site_affines = nn.ModuleDict(
            {self._keys[name]: FreeAffine(*self._initial_affine(structure.latent[name], like.dtype)) for name in sites}
        )
        # gathered ancestors in the contexts, gathered observations in the deep set: which elements are read is
        # found per call
        needed = set()
        for name, ancestors in self._context_sites.items():
            level = self._level_of[name]
            for a in [*ancestors, *(s for lv in self._context_levels[name] for s in levels[lv].sites)]:
                for link in level.links_to(self._level_of[a].name):
                    needed.add((link.site, link.plate))
        if self.encoder_kind == "deepset":
            needed |= self.encoder.required_positions()
        self._gather_maps: GatherMaps | None = None
        self._observed_rows: ObservedRows | None = None
        if needed:
            self._gather_maps = GatherMaps(structure, self.model)
            for site_name, plate in sorted(needed):
                self._gather_maps.require(site_name, plate)
            self._observed_rows = ObservedRows(self._gather_maps, {})
        self._last_data: dict[tuple[str, str], SiteData] = {}  # for calls that omit the observations
        self.flows.to(dtype=like.dtype, device=like.device)
        self.encoder.to(dtype=like.dtype, device=like.device)
        self.site_affines.to(dtype=like.dtype, device=like.device)
        # one optimised tensor (Pyro steps one torch optimiser per tensor and runs a pyro.param statement per tensor)
        self.packed = PackedParameters({name: self._modules[name] for name in PACKED})
        # the tail average of the trainable parameters and its count: state, not optimised (no gradient reaches it),
        # kept as parameters so that the param store, state_dict and pickling carry it
        self.averages = PyroModule()
        if self.tail_average is not None:
            for key, param in self._trainable().items():
                setattr(self.averages, key, PyroParam(param.detach().clone(), constraints.real))
                getattr(self.averages, key)  # (read once: a trace of this call records the parameter, not its init)
            self.averages.count = PyroParam(like.new_zeros(()), constraints.real)
            _ = self.averages.count
        # where the model's pseudo-observations are read (state, not optimised): a running mean and variance of the
        # globals' draws (unconstrained), the mean and sd of the last reference, training calls since it was made and
        # the interval of the redos, in one vector (one parameter for Pyro to carry: see _sync_state)
        self.references = PyroModule()
        self._state_layout: dict[str, slice | int] = {}
        if self._expanded_sites:
            mean, sd = self._initial_global_moments(like.dtype)
            d = mean.shape[0]
            self._state_layout = {
                **{key: slice(i * d, (i + 1) * d) for i, key in enumerate(STATE_KEYS[:4])},
                "calls": 4 * d,
                "every": 4 * d + 1,
            }
            initial = torch.cat([mean, sd.pow(2), mean, sd, like.new_tensor([0.0, float(EXPANSION_EVERY)])])
            self.references.state = PyroParam(initial.detach().clone(), constraints.real)
            _ = self.references.state  # (read once: a trace of this call records the parameter, not its init)

    def _initial_global_moments(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The globals' element vector (unconstrained, sites in model order) at the start: the median and spread
        (interquartile range / 1.349) of their prior, or the init location and ``init_scale`` when given."""
        assert self.structure is not None
        glob = self._global_level
        if glob is None:
            empty = torch.zeros(0, dtype=dtype)
            return empty, empty
        means, sds = [], []
        for name in glob.sites:
            site = self.structure.latent[name]
            fn = site.fn.to_event(len(site.batch_shape)) if site.batch_shape else site.fn
            to_unconstrained = biject_to(fn.support).inv
            with torch.no_grad(), keep_random_state():
                draws = to_unconstrained(fn.sample((1024,))).to(dtype).reshape(1024, -1)
                q = empirical_quantiles(draws, [0.25, 0.5, 0.75])
                init = to_unconstrained(site.value).to(dtype).reshape(-1)
            means.append(init if self._start_at_init_loc else q[1])
            spread = ((q[2] - q[0]) / 1.349).clamp(min=1e-6, max=GLOBAL_INIT_SPREAD)
            sds.append(spread if self._init_scale is None else torch.full_like(spread, self._init_scale))
        return torch.cat(means), torch.cat(sds)

    def _initial_affine(self, site: LatentSite, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(b, e^β)`` of the site's :class:`~pyro_hier.flows.FreeAffine`, which follows its flow (the named flows
        start as the identity), so that q starts with median ``init_loc`` and spread ``init_scale`` in unconstrained
        space, or the prior's where they are not given.

        The base's and the prior's medians :math:`\hat m_i` and spreads :math:`\hat s` (interquartile range / 1.349,
        pooled over plate elements) come from draws of the prototype's prior conditional (a standard normal base for
        sites without ``rsample``); then :math:`e^\beta = \sigma / \hat s_{\mathrm{base}}` and
        :math:`b = \mathrm{mean}_i(t_i - e^\beta \hat m_{\mathrm{base}, i})` with targets :math:`t_i` (the init
        location, else the prior's median) and :math:`\sigma` (``init_scale``, else the prior's spread). The flow is
        shared by a plate's elements, so a plated site starts at its elements' mean target: exact when the init
        location and the prior's median are the same for every element (``init_to_feasible``, ``init_to_median``,
        ``init_to_mean``, one value given to ``init_to_value``), their average otherwise (``init_to_sample``).
        For a site with the conjugate conditional, ``(b, e^β)`` are the pseudo-observation's mean and sd instead: the
        target and the spread (without ``init_loc_fn`` and ``init_scale``: 0 and 1), so q starts there, pulled
        towards the prior conditional by its precision."""
        n = site.element_numel
        one = torch.ones(n, dtype=dtype, device=site.value.device)
        if site.name in self._conjugate_sites:  # the identity on the standardised draw: q starts at q0
            return one * 0.0, one
        from_prior = self._from_prior(site)
        if from_prior and not self._start_at_init_loc and self._init_scale is None:
            # the identity: PAVI's own start at the prior conditional
            return one * 0.0, one
        fn = site.fn
        if site.is_global and site.batch_shape:
            fn = fn.to_event(len(site.batch_shape))
        to_unconstrained = biject_to(fn.support).inv
        batch = fn.batch_shape
        num_draws = max(64, min(4096, 2**18 // max(1, batch.numel() * n)))  # spreads to about 2% for small sites
        with torch.no_grad():
            draws = to_unconstrained(fn.sample((num_draws,))).to(dtype).reshape((num_draws, *batch, n))
            init = to_unconstrained(site.value).to(dtype).reshape((*batch, n))
            q = empirical_quantiles(draws, [0.25, 0.5, 0.75])
            prior_median = q[1]
            prior_spread = ((q[2] - q[0]) / 1.349).reshape(-1, n).mean(0).clamp(min=1e-6)
            if from_prior:
                base_median, base_spread = prior_median, prior_spread
            else:  # a standard normal base in unconstrained space
                base_median, base_spread = torch.zeros_like(prior_median), one
            target = init if self._start_at_init_loc else prior_median
            if self._init_scale is not None:
                spread = one * self._init_scale
            elif site.is_global:  # (from the prior's spread, a global's q needed 1,000-2,000 steps at Adam's 0.01)
                spread = prior_spread.clamp(max=GLOBAL_INIT_SPREAD)
            else:
                spread = prior_spread
            scale = spread / base_spread
            loc = (target - scale * base_median).reshape(-1, n).mean(0)
        return loc, scale

    def _from_prior(self, site: LatentSite) -> bool:
        """Whether the site's flow pushes forward its prior conditional (PAVI's form) rather than a standard normal in
        unconstrained space: sites with ``rsample``, except the globals with the conjugate conditional (a prior's
        heavy tail — a scale's ``HalfCauchy`` — would otherwise stay in q)."""
        return site.reparameterized and not (self.conditional == "conjugate" and site.is_global)

    def _register_networks(self) -> None:
        """Put the packed parameters (:class:`~pyro_hier.nn.PackedParameters`: the flows', the encoder's and the free
        affine maps', one vector) in Pyro's param store (so SVI optimises them), and adopt the store's tensor when it
        already holds one under this name (e.g. after ``pyro.get_param_store().load(...)``), as ``PyroParam``\\ s do.
        (Pyro's conditional transforms are abstract base classes, which ``to_pyro_module_`` cannot convert.)"""
        pack = self._modules["packed"]
        if self._network_params is None:  # the full name, as pyro.module's
            self._network_params = param_with_module_name(self._pyro_get_fullname("packed"), "flat")
        full, param = self._network_params, pack.flat
        # a call without gradients (Predictive's) only checks that the store holds this tensor (its trace then records
        # no parameter: nothing optimises it)
        if not torch.is_grad_enabled():
            store = pyro.get_param_store()
            if full in store and store[full].unconstrained() is param:
                return
        stored = pyro.param(full, param)
        if stored is not param:
            pack._parameters["flat"] = stored

    def _unpack(self) -> None:
        """Give the networks their parameters as views of the packed vector as this call uses it (the tail average
        swapped in or not: :meth:`_parameters_in_use`), and the detached twins of the flows theirs
        (``stick_the_landing``). A training call makes new views (they carry its graph); a call without gradients
        keeps the views of the last such call when they show the same memory (``Predictive``'s draws, one after
        another, all read the tail average)."""
        pack = self._modules["packed"]
        if self._pack_owners is None:
            self._pack_owners = pack.owners({name: self._modules[name] for name in PACKED})
        flat = pack.flat
        key = None if torch.is_grad_enabled() else (flat.data_ptr(), flat.dtype, flat.device, flat.shape)
        if key is not None and key == self._unpacked:
            return
        self._unpacked = key
        if self.stick_the_landing and self._detached_flows is None:
            pack.unpack(pack.flat.detach(), self._pack_owners)  # (views without a graph: they copy)
            twin = copy.deepcopy(nn.ModuleDict({n: self._modules[n] for n in ("flows", "site_affines")}))
            self._detached_flows = (twin, pack.owners(dict(twin.items())))
        pack.unpack(flat if key is None else flat.detach(), self._pack_owners)  # (no_grad views cannot be edited)
        if self.stick_the_landing:
            assert self._detached_flows is not None
            pack.unpack(pack.flat.detach(), self._detached_flows[1])  # same storage, no autograd history

    # ---- the tail average of the iterates ---------------------------------------------------------------------
    def _trainable(self) -> dict[str, nn.Parameter]:
        """The optimised parameters (flows, encoder, free affine maps) as they are now, by their key in
        ``averages``."""
        return {"packed__flat": self._modules["packed"].flat}

    def state_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The guide's parameters that are state, not optimised (no gradient reaches them): the tail average of the
        others and its count, and where the model's pseudo-observations are read (``references``). They are
        parameters so that Pyro's param store carries them; leave them out of hand-built optimisers
        (:class:`~pyro_hier.optim.IterateAverage` leaves them out)."""
        out = {}
        for module in ("averages", "references"):
            held = self._modules.get(module)
            if held is not None:
                out.update({f"{module}.{k}": v for k, v in held.named_parameters()})
        return out

    # ---- the model's pseudo-observations ----------------------------------------------------------------------
    def _sync_state(self) -> None:
        """Read the reference state through Pyro once per call, which adopts the param store's tensor (e.g. after
        ``pyro.get_param_store().load``) and, in a training call, records it in the trace as the other parameters are
        (``JitTrace_ELBO`` takes the parameters its first call records as the compiled step's inputs). A call without
        gradients (``Predictive``'s) only checks that the store holds this tensor. :meth:`_state` and
        :meth:`_write_state` then use it directly."""
        if not self._state_layout:
            return
        references = self._modules["references"]
        if not torch.is_grad_enabled():
            store, name = pyro.get_param_store(), references._pyro_get_fullname("state")
            if name in store and store[name].unconstrained() is references._parameters["state_unconstrained"]:
                return
        _ = references.state

    def _state(self, key: str) -> torch.Tensor:
        """A part of the reference state (``STATE_KEYS``) as it is now, without gradient (a view: clone it to keep it
        across a write), as adopted by :meth:`_sync_state` (read through Pyro while ``torch.jit`` traces a step, so
        that the compiled graph takes it as an input, not a constant)."""
        if torch.jit.is_tracing():
            return self.references.state.detach()[self._state_layout[key]]
        return self._modules["references"]._parameters["state_unconstrained"].detach()[self._state_layout[key]]

    def _write_state(self, key: str, value: torch.Tensor) -> None:
        if torch.jit.is_tracing():
            _ = self.references.state
        raw = self._modules["references"]._parameters["state_unconstrained"]
        raw.data[self._state_layout[key]] = value.to(raw.dtype)

    def _global_values(self, u: torch.Tensor) -> dict[str, torch.Tensor]:
        """The globals' constrained values at their element vector ``u`` (unconstrained)."""
        glob = self._global_level
        if glob is None:
            return {}
        return {n: self._constrain(n, self._site_unconstrained(glob, n, u, broadcast=False)) for n in glob.sites}

    def _site_value(self, name: str, u: torch.Tensor) -> torch.Tensor:
        """A plated site's constrained value at its flattened unconstrained element vectors ``u (…, n)``."""
        assert self.structure is not None
        site = self.structure.latent[name]
        event = site.unconstrained_shape[len(site.unconstrained_shape) - site.unconstrained_event_dim :]
        return self._constrain(name, u.reshape(u.shape[:-1] + event))

    def _call_key(self, args: tuple, kwargs: dict, calls: dict | None) -> tuple:
        """Which call this is (:func:`~pyro_hier.plates.argument_key` of each argument, and the indices of the
        subsampled plates in ``calls``), kept through a compiled step's trace; whoever keeps a result under it holds
        the arguments with it."""
        key = tuple(argument_key(a) for a in args) + tuple((k, argument_key(v)) for k, v in sorted(kwargs.items()))
        if calls:
            key += tuple((n, tuple(c.indices.tolist())) for n, c in sorted(calls.items()))
        return key

    def _expansions_for_call(self, args: tuple, kwargs: dict, forced: dict, calls: dict | None) -> dict:
        """``{site: (precision, natural parameter, slopes or None)}``: the model's pseudo-observation of each expanded
        site's elements on this call (:meth:`_expand`). Kept while the arguments are the same objects (and the
        subsampled plates the same indices), redone at the running mean of the globals' draws every
        :data:`EXPANSION_EVERY` training calls — or at doubling intervals (up to :data:`EXPANSION_BACKOFF` times that)
        while each redo on the full data is what the last expansion's slopes predicted at the new reference
        (:func:`predicted_expansions`), at once when it is not. Minibatches: :meth:`_minibatch_expansions`."""
        if not self._expanded_sites:
            return {}
        assert self.structure is not None
        if self.structure.subsampled_plates and calls is None:  # the indices of this call are part of its key
            with keep_random_state():
                calls = capture_plates(_ForceSubsamples(forced)(self.model), args, kwargs)
        previous = None
        rows = self.drawn_rows(calls) if calls is not None else {}
        if (
            torch.is_grad_enabled()
            and float(self._state("calls")) >= float(self._state("every"))
            and not (rows and self._rows_reference_holds())
        ):
            # a new reference at the running moments of the globals' draws
            if self._global_level is not None and self._expansion is not None and self._expansion[1] is not None:
                previous = (self._expansion[0], self._state("ref_mean").clone(), self._expansion[1])
            self._write_state("ref_mean", self._state("global_mean"))
            self._write_state("ref_sd", self._state("global_var").clamp(min=1e-12).sqrt())
            self._write_state("calls", torch.zeros(()))
        reference = ()
        if self._global_level is not None:  # the reference is part of the key (a new one, or a loaded state)
            reference = tuple(self._state("ref_mean").tolist()) + tuple(self._state("ref_sd").tolist())
        keyed = calls  # (rows drawn at random are all read, whatever the draw: not part of the key)
        if calls is not None:
            rows = self.drawn_rows(calls)
            keyed = {n: c for n, c in calls.items() if n not in rows}
        key = self._call_key(args, kwargs, keyed if self.structure.subsampled_plates else None) + reference
        if self._expansion is not None and self._expansion[0] == key:
            return self._expansion[1]
        last = previous  # (a minibatch's redo compares it with its own key: the call on all the data)
        if previous is not None:  # the same call at the previous reference?
            size = len(reference)
            if previous[0][: len(previous[0]) - size] != key[: len(key) - size]:
                previous = None
        if calls is None:
            with keep_random_state():
                calls = capture_plates(_ForceSubsamples(forced)(self.model), args, kwargs)
        subsampled = [c for c in calls.values() if c.subsampled]
        blocks = self._summary_subsamples or {}  # (Pyro's random subsample, replayed block by block)
        if subsampled and all(c.user_indices and c.name not in blocks for c in subsampled):
            return self._minibatch_expansions(args, kwargs, calls, reference, last)
        if torch._C._get_tracing_state() is not None:
            latent_plates = {p for site in self.structure.latent.values() for p in site.plates}
            drawn = [c.name for c in subsampled if not c.user_indices and c.name not in latent_plates]
            if drawn:
                raise StructureError(
                    f"{type(self).__name__} cannot expand the likelihood inside a compiled step (JitTrace_ELBO) while "
                    f"Pyro draws the rows of plate '{drawn[0]}' at random (subsample_size=): pass the indices as an "
                    f"argument of the model (pyro.plate('{drawn[0]}', N, subsample=idx)), or train with Trace_ELBO."
                )
        try:
            with keep_random_state():
                made = self._expand(args, kwargs, calls)
        except Unobserved:  # the observations omitted (Predictive with obs=None): each element's last data
            made = None
        if made is None:
            made = self._from_data_tables(calls)
        else:
            self._to_data_tables(made, calls)
            self._back_off(previous, made)
        self._expansion = (key, made, (args, kwargs))  # (the arguments held: their identities are in the key)
        return made

    def _rows_reference_holds(self) -> bool:
        r"""Where the model draws its rows at random (each expansion reads every row, block by block: ``N / B`` runs of
        the model a pass), whether the reference still stands although :meth:`_expansions_for_call`'s interval has
        passed: before :data:`~pyro_hier.guides.amortized.ROW_EXPANSION_EVERY` training calls, and then while the
        running mean of the globals' draws is within :data:`ROW_REFERENCE_MOVE` of the reference's sds in every
        coordinate and their running sd within a factor :math:`e^{\pm\mathrm{MOVE}}` of the reference's, up to 64
        times that many calls. Between reads the expansion is moved to each draw of the globals along its slopes
        from the reference (:math:`e^{D\delta}(\bar\eta + B\delta)`), exact along a location and a log scale of a
        Gaussian likelihood, so a deferred read defers only the second-order change."""
        calls = float(self._state("calls"))
        if calls < ROW_EXPANSION_EVERY:
            return True
        if calls >= ROW_EXPANSION_EVERY * 2**6 or self._global_level is None or not self._global_level.numel:
            return False
        ref_mean, ref_sd = self._state("ref_mean"), self._state("ref_sd").clamp(min=1e-12)
        mean, sd = self._state("global_mean"), self._state("global_var").clamp(min=1e-24).sqrt()
        moved = float(((mean - ref_mean).abs() / ref_sd).amax())
        stretched = float((sd.log() - ref_sd.log()).abs().amax())
        return moved <= ROW_REFERENCE_MOVE and stretched <= ROW_REFERENCE_MOVE

    def _back_off(self, previous: tuple | None, made: dict) -> None:
        """After a redo at a new reference: double the interval to the next (up to :data:`EXPANSION_BACKOFF` times
        :data:`EXPANSION_EVERY`) while the last expansion's slopes predicted this one (:func:`predicted_expansions`),
        else back to :data:`EXPANSION_EVERY`. ``previous``: ``(key, reference, expansion)`` of the last redo."""
        if previous is None or previous[2] is None:
            return
        moved = self._state("ref_mean") - previous[1]
        self._next_interval(predicted_expansions(previous[2], moved, made))

    def _next_interval(self, held: bool) -> None:
        """The calls to the next new reference: twice the last (up to :data:`EXPANSION_BACKOFF` times
        :data:`EXPANSION_EVERY`) when the last expansion's slopes predicted this one, else :data:`EXPANSION_EVERY`."""
        every = float(self._state("every"))
        self._write_state(
            "every", torch.tensor(min(2 * every, EXPANSION_EVERY * EXPANSION_BACKOFF) if held else EXPANSION_EVERY)
        )

    def _minibatch_expansions(
        self, args: tuple, kwargs: dict, calls: dict, reference: tuple, previous: tuple | None = None
    ) -> dict:
        """A minibatch's pseudo-observations, each element's read from the model on its own data, so that an
        element's q does not depend on which others are in the minibatch and the minibatch ELBO stays unbiased.

        Where every subsampled plate is one of each expanded site's plates (groups subsampled, their rows following),
        each element's expansion is kept in the tables with the reference it was read at, and a call reads again only
        its own elements not read at the current reference and data (:meth:`_read_stale_rows`): the cost of a step is
        O(minibatch). Otherwise (a site whose likelihood sums over a subsampled plate that is not its own, or inside a
        compiled step) every element is read from the model's call on *all* the data, kept while those arguments and
        the reference are the same. (Plates that Pyro subsamples at random, ``subsample_size=`` without indices from
        the caller, cannot be reopened in full here: their elements are expanded from the minibatch's own data, which
        makes q depend on the minibatch; pass the indices, e.g. ``subsample=idx``, to avoid it.)"""
        restricted = self._row_plates(args, kwargs, calls)
        done = False
        if restricted is not None:  # (the arguments without the indices: no run of the model on all the data)
            given = [calls[p].indices for p in restricted]
            cleared = tuple(None if any(a is g for g in given) else a for a in args)
            cleared_kwargs = {k: None if any(v is g for g in given) else v for k, v in kwargs.items()}
            stamp = ("rows", *self._call_key(cleared, cleared_kwargs, None), *reference)
            forced = {n: torch.arange(c.size, device=c.indices.device) for n, c in calls.items() if not c.user_indices}
            tracing = torch._C._get_tracing_state()
            try:  # (inside a compiled step, whose replays only gather the tables: every element, read untraced)
                torch._C._set_tracing_state(None)
                done = self._read_stale_rows(
                    args,
                    kwargs,
                    calls,
                    restricted,
                    forced,
                    stamp,
                    (cleared, cleared_kwargs),
                    len(reference),
                    everything=tracing is not None,
                )
            finally:
                torch._C._set_tracing_state(tracing)
        if done:
            return self._from_data_tables(calls)
        full_args, full_kwargs, forced = full_data_call(self.model, args, kwargs, calls)
        key = ("all data", *self._call_key(full_args, full_kwargs, None), *reference)
        if self._expansion is None or self._expansion[0] != key:
            with keep_random_state():
                full_calls = capture_plates(_ForceSubsamples(forced)(self.model), full_args, full_kwargs)
            try:
                with keep_random_state():
                    made = self._expand(full_args, full_kwargs, full_calls)
            except Unobserved:  # the observations omitted: each element's last data (below)
                made = None
            else:
                self._to_data_tables(made, full_calls)
                # (the same back-off as on full-data calls: without it every group's data were read every
                # EXPANSION_EVERY calls, a step cost growing with N: 74 ms at N = 1,000, 820 ms at 10,000)
                if (
                    previous is not None
                    and previous[0][: len(previous[0]) - len(reference)] == key[: len(key) - len(reference)]
                ):
                    self._back_off(previous, made)
            self._expansion = (key, made, (full_args, full_kwargs))
        return self._from_data_tables(calls)

    def _row_plates(self, args: tuple, kwargs: dict, calls: dict) -> list[str] | None:
        """The subsampled plates of a minibatch call whose indices are arguments of the model (``subsample=idx``),
        when each is one of every expanded site's plates, no other plate of theirs is subsampled, and the call holds
        all the data of its elements (rows following their groups, :func:`~pyro_hier.local_data.data_complete`): an
        element's likelihood then lies in its own rows of the model restricted to some of them. Else ``None``."""
        assert self.structure is not None
        given = [*args, *kwargs.values()]
        subsampled = [n for n, c in calls.items() if c.subsampled]
        plates = [n for n in subsampled if any(calls[n].indices is a for a in given)]
        if not plates:
            return None
        observed = [n for n, site in self.structure.observed.items() if not is_factor(site.fn)]
        for name in self._expanded_sites:
            level = self._level_of[name]
            if not set(plates) <= set(level.plates) or any(p in level.plates for p in subsampled if p not in plates):
                return None
            above = set(level.plates).union(*(self._levels_by_name[a].plates for a in level.ancestors))
            if not all(data_complete(self.structure, o, level.plates, above, calls) for o in observed):
                return None
        return plates

    @torch.no_grad()
    def _read_stale_rows(
        self,
        args: tuple,
        kwargs: dict,
        calls: dict,
        plates: list[str],
        forced: dict,
        stamp: tuple,
        held: tuple,
        reference_size: int,
        everything: bool = False,
    ) -> bool:
        r"""Read again, from the model restricted to them, this minibatch's elements whose expansion in the tables was
        not read at ``stamp`` (the call on all the data and the current reference): the model is run with each
        subsampled plate's index argument (``subsample=idx``) replaced by the call's indices that hold such elements,
        each with its own exponents :math:`D` (:meth:`_expand` with ``per_element``). The others
        keep their expansion, moved to the globals' draw along their slopes from their own reference
        (:math:`e^{D\Delta}(ar\eta + B\Delta)`, as :meth:`_from_data_tables` gives it). So an element's expansion
        is a function of its own data and the guide's state, whichever elements share its minibatch, and a step costs
        O(minibatch) reads however many elements the plates hold.

        When the reference has moved since the tables' stamp, the first elements read again at the new one that had
        been read before decide the interval to the next move (:meth:`_back_off_rows`), as a redo on all the data
        did. ``everything``: read every element of the plates not read at ``stamp``, not only the call's (a step
        compiled by ``JitTrace_ELBO``, whose replays gather the tables without running Python). Returns ``False``
        where the model does not take the call's indices from an argument as they are (the caller then reads all the
        data)."""
        given = {p: calls[p].indices for p in plates}  # (the arguments the model takes its indices from)
        everywhere = {**calls, **{p: _Indices(torch.arange(calls[p].size, device=given[p].device)) for p in plates}}
        moved = self._table_stamp is not None and self._table_stamp[0] != stamp
        if stamp == self._unobserved_stamp:
            return True  # (the observations omitted in this call: the elements' last data)
        same_stamp = self._table_stamp is not None and not moved

        def stale_of(calls: dict) -> dict[str, torch.Tensor]:
            """Per plate, which of ``calls``' indices hold an element not read at ``stamp``."""
            stale_along = {p: torch.zeros(calls[p].indices.shape[0], dtype=torch.bool) for p in plates}
            for name in self._expanded_sites:
                level = self._level_of[name]
                ndim = len(level.batch_shape)
                axes = self._element_axes(name, calls, ndim)
                fresh = self._fresh.get(name) if same_stamp else None
                if fresh is None:
                    stale = torch.ones(
                        _element_shape(torch.empty(level.batch_shape, device="meta"), axes, ndim), dtype=torch.bool
                    )
                else:
                    stale = ~_gather_elements(fresh, axes)
                for p, (axis, _) in zip(level.plates, axes, strict=True):
                    if p in stale_along:
                        stale_along[p] |= stale.movedim(axis, 0).reshape(stale.shape[axis], -1).any(1).cpu()
            return stale_along

        stale_along = stale_of(everywhere if everything else calls)
        if not any(bool(v.any()) for v in stale_along.values()):
            return True
        if not everything:  # few stale elements left in all: read them at once (one read, not one per call)
            size = math.prod(int(calls[p].indices.shape[0]) for p in plates)
            total = stale_of(everywhere)
            if math.prod(int(v.sum()) for v in total.values()) <= STALE_READ_FACTOR * size:
                everything, stale_along = True, total
        if everything:
            calls = everywhere
        rows = {p: calls[p].indices[v.to(calls[p].indices.device)] for p, v in stale_along.items()}
        swap = {id(given[p]): rows[p] for p in plates}
        if len(swap) != len(plates):
            return False
        new_args = tuple(swap.get(id(a), a) for a in args)
        new_kwargs = {k: swap.get(id(v), v) for k, v in kwargs.items()}
        forced = {n: i for n, i in forced.items() if n not in plates}  # (the others in full, as on all the data)
        with keep_random_state():
            new_calls = capture_plates(_ForceSubsamples(forced)(self.model), new_args, new_kwargs)
        for p in plates:
            if p not in new_calls or not torch.equal(new_calls[p].indices, rows[p]):
                return False  # (the model does not use the argument as its indices)
        try:
            with keep_random_state():
                made = self._expand(new_args, new_kwargs, new_calls, per_element=True)
        except Unobserved:
            self._unobserved_stamp = stamp
            return True
        self._unobserved_stamp = None
        if not same_stamp:  # a new reference (or data): every element is stale
            self._fresh = {}
            self._backoff_due = self._backoff_due or (
                moved and self._table_stamp[0][: len(stamp) - reference_size] == stamp[: len(stamp) - reference_size]
            )
            self._table_stamp = (stamp, held)
        masks = {}
        for name in made:
            level = self._level_of[name]
            ndim = len(level.batch_shape)
            fresh = self._fresh.get(name)
            if fresh is None:
                fresh = self._fresh[name] = torch.zeros(level.batch_shape, dtype=torch.bool)
            axes = self._element_axes(name, new_calls, ndim)
            masks[name] = ~_gather_elements(fresh, axes)
        if self._backoff_due:
            self._back_off_rows(made, new_calls, masks)
        self._to_data_tables(made, new_calls, masks)
        for name, mask in masks.items():
            ndim = len(self._level_of[name].batch_shape)
            _scatter_elements(self._fresh[name], self._element_axes(name, new_calls, ndim), torch.ones_like(mask))
        return True

    def _back_off_rows(self, made: dict, calls: dict, masks: dict) -> None:
        """The first elements read again after the reference moved that had been read before: double the interval to
        the next move (up to :data:`EXPANSION_BACKOFF` times :data:`EXPANSION_EVERY`) while their expansions are what
        their last reads' slopes predict at the new reference (:func:`predicted_expansions`, from each element's own
        reference), else back to :data:`EXPANSION_EVERY`: the redo on all the data's rule, on the elements read."""
        ref = self._state("ref_mean") if self._global_level is not None else None
        checks = []
        for name, (info, natural, slopes) in made.items():
            table = self._data_tables.get(name)
            if table is None or slopes is None or len(table) != 7:
                continue
            level = self._level_of[name]
            axes = self._element_axes(name, calls, len(level.batch_shape))
            parts = [_gather_elements(t, axes) for t in table]
            chosen = masks[name] & (parts[6][..., 0] > 0)  # read again, and read before
            if not bool(chosen.any()):
                continue
            shape = chosen.shape
            was = [p[chosen] for p in parts]
            now = [t.expand(shape + t.shape[len(shape) :])[chosen] for t in (info, natural, *slopes[:3])]
            old = {name: (was[0], was[1], (was[2], was[3], was[4], None))}
            new = {name: (now[0], now[1], (now[2], now[3], now[4], None))}
            checks.append((old, ref - was[5], new))  # (each element moved from its own reference)
        if not checks:
            return
        self._backoff_due = False
        self._next_interval(all(predicted_expansions(old, moved, new) for old, moved, new in checks))

    def _element_axes(self, name: str, calls: dict, ndim: int) -> list[tuple[int, torch.Tensor]]:
        """``(axis, indices)`` of a site's plates in a table whose batch has ``ndim`` dims."""
        level = self._level_of[name]
        return [(ndim + dim, calls[p].indices) for p, dim in zip(level.plates, level.dims, strict=True)]

    @torch.no_grad()
    def _to_data_tables(self, made: dict, calls: dict, masks: dict | None = None) -> None:
        r"""Keep each element's last pseudo-observation made with data, at the plates' full sizes, with the reference
        :math:`\bar\theta` it was read at (for calls without the observations and for minibatches, which read it at
        the current reference through the offset :math:`\bar\theta_{\mathrm{now}} - \bar\theta`: the same
        function of the globals' draw). ``masks`` ``{site: bool (the call's elements)}``: only those are written."""
        ref = self._state("ref_mean") if self._global_level is not None else None
        for name, (info, natural, slopes) in made.items():
            level = self._level_of[name]
            ndim = len(level.batch_shape)
            parts = [info, natural]
            if slopes is not None:
                at = ref if slopes[3] is None else ref - slopes[3]
                parts = [info, natural, *slopes[:3], at.expand(natural.shape[:-1] + at.shape[-1:])]
            parts.append(torch.ones_like(natural[..., :1]))  # seen
            if name not in self._data_tables:
                self._data_tables[name] = [t.new_zeros(level.batch_shape + t.shape[ndim:]) for t in parts]
            axes = self._element_axes(name, calls, ndim)
            mask = None if masks is None else masks[name]
            for full, part in zip(self._data_tables[name], parts, strict=True):
                part = part.expand(_element_shape(full, axes, ndim) + part.shape[ndim:])
                if mask is not None:  # (the others keep what they hold)
                    keep = mask.reshape(mask.shape + (1,) * (part.dim() - ndim)).to(part.device)
                    part = torch.where(keep, part, _gather_elements(full, axes))
                _scatter_elements(full, axes, part)

    def _from_data_tables(self, calls: dict) -> dict:
        """The pseudo-observations of this call's elements from their last data (none for elements never seen with
        data: their q0 is then the prior conditional), with the offset of the current reference from theirs."""
        ref = self._state("ref_mean") if self._global_level is not None else None
        made = {}
        for name in self._expanded_sites:
            if name not in self._data_tables:
                raise StructureError(
                    f"site '{name}': the observed sites are not observed in this call (observations omitted, as in "
                    "Predictive(model, guide=guide) with obs=None) and the guide has not seen their data yet: call "
                    "the guide (or train it) on the data first"
                )
            level = self._level_of[name]
            ndim = len(level.batch_shape)
            axes = self._element_axes(name, calls, ndim)
            parts = [_gather_elements(t, axes) for t in self._data_tables[name]]
            slopes = None
            if len(parts) == 7:
                slopes = (parts[2], parts[3], parts[4], ref - parts[5])
            made[name] = (parts[0], parts[1], slopes)
        return made

    @torch.no_grad()
    def _expand(self, args: tuple, kwargs: dict, calls: dict, per_element: bool = False) -> dict:
        r"""The model's pseudo-observation of each expanded site: the second-order expansion of the rest of the model
        (its likelihood) at the reference — the globals at ``ref_mean``, the plated sites at their prior conditional's
        mean there (:func:`~pyro_hier.conjugate.element_expansion`), or where the likelihood is not Gaussian in the
        site at each element's conditional mode: line-searched Newton steps to it
        (:func:`~pyro_hier.conjugate.conditional_mode`) the first time, then plain Newton steps from the mode of the
        last read while they stay within one conditional sd (:func:`~pyro_hier.conjugate.warm_conditional_mode`; the
        line-searched steps otherwise), to the same tolerance, so that the expansion is a function of the guide's
        state, not of its path — as a Gaussian potential
        :math:`ar\Lambda_i = F_i`, :math:`ar\eta_i = F_i c_i + g_i` (the likelihood itself where it is Gaussian in
        the site), with the slopes of :math:`\eta` and of :math:`\log\sqrt{\mathrm{diag}\,\Lambda}` on the globals
        read by central differences at ``ref_sd`` (:data:`~pyro_hier.guides.branch.SLOPE_NODES` of them where the
        likelihood is quadratic in the site, else :data:`~pyro_hier.guides.branch.DERIVATIVE_STEP`), as
        :class:`~pyro_hier.AutoBranchGuide` and :class:`~pyro_hier.AutoAmortizedBranchGuide` read them.

        The exponents :math:`D` of :math:`\eta` along the globals (:func:`natural_power`) are shared by the site's
        elements read, in least squares; with ``per_element`` (a minibatch's elements read again:
        :meth:`_read_stale_rows`) each element gets its own, fitted to its own three reads, so that its expansion is
        a function of its own data and the guide's state, not of the other elements read with it. Slopes along the
        globals that the likelihood does not read (autograd, checked once per site) are 0 without reads."""
        assert self.structure is not None
        s = self.structure
        subsamples = {name: call.indices for name, call in calls.items()}
        glob = self._global_level
        ref_mean = self._state("ref_mean") if glob is not None else None
        ref_sd = self._state("ref_sd") if glob is not None else None
        values = self._global_values(ref_mean) if glob is not None else {}
        centres: dict[str, torch.Tensor] = {}
        priors: dict[str, GaussianPrior] = {}
        for level in self.levels:
            if not level.plates:
                continue
            fns, _ = capture_priors(self.model, args, kwargs, values, level.sites, subsamples)
            for name in level.sites:
                site = s.latent[name]
                prior = gaussian_prior(fns[name], site.support) if name in self._conjugate_sites else None
                if prior is not None:
                    priors[name] = prior
                    u = prior.loc
                else:  # the median of a few prior draws
                    fn = fns[name]
                    draws = biject_to(site.support).inv(fn.sample((15,)))
                    u = draws.median(0).values.reshape((*fn.batch_shape, -1))
                centres[name] = u
                values[name] = self._site_value(name, u)
        observed = [n for n, site in s.observed.items() if not is_factor(site.fn)]
        rows = self.drawn_rows(calls)  # (a plate of rows drawn at random: read in full, whatever the draw)
        blocks = row_blocks(rows, device=next(iter(subsamples.values())).device) if rows else [None]
        given = {n: i for n, i in subsamples.items() if n not in rows}
        made = {}
        # the last conditional modes of the same elements: a warm start
        call_key = self._call_key(args, kwargs, {n: c for n, c in calls.items() if n not in rows})
        modes = self._modes[1] if self._modes is not None and self._modes[0] == call_key else {}
        self._modes = (call_key, modes, (args, kwargs))

        def site_mode(name: str) -> tuple:
            """The site's expansion at its conditional mode given ``values`` (the rest of the model's)."""
            site = s.latent[name]
            level = self._level_of[name]
            scale = math.prod(s.plates[p].size for p in level.plates) / max(
                1, math.prod(int(calls[p].indices.shape[0]) for p in level.plates)
            )

            def expand(
                at: dict, u: torch.Tensor, name: str = name, scale: float = scale, curvature: bool = True
            ) -> tuple:
                total = None
                for block in blocks:  # (a plate of rows drawn at random: every row, block by block)
                    part = element_expansion(
                        # (every latent site is given: the init strategy's values would go unused)
                        self.reading_model if block is None else block(self.reading_model),
                        args,
                        kwargs,
                        at,
                        u,
                        lambda v: {name: self._site_value(name, v)},
                        scale,
                        given,
                        observed=observed,
                        curvature=curvature,
                    )
                    total = part if total is None else tuple(a if b is None else a + b for a, b in zip(total, part))
                return total

            centre = centres[name]
            gradient, curvature = expand(values, centre)
            diagonal = site.element_numel == 1
            prior = priors[name]
            p0 = prior.precision if prior.diagonal else prior.precision.diagonal(dim1=-2, dim2=-1)
            floor = CURVATURE_FLOOR * p0
            quadratic = self._quadratic.get(name)
            if quadratic is None:  # (the likelihood Gaussian in the site: the same expansion everywhere)
                moved = expand(values, centre + 1.0)[1]
                tolerance = 1e-6 * float(curvature.abs().max()) + 1e-12
                quadratic = self._quadratic[name] = bool(torch.allclose(moved, curvature, rtol=1e-4, atol=tolerance))
            if not quadratic:  # the likelihood's Laplace approximation: expanded at (about) each element's mode
                warm = modes.get(name)
                tolerance = EXPANSION_NEWTON_TOLERANCE if centre.dtype == torch.float64 else 1e-3
                cold = True
                if warm is not None and warm.shape == centre.shape:  # plain Newton steps from the last mode
                    centre = warm
                    gradient, curvature = expand(values, centre)
                    centre, gradient, curvature, done = warm_conditional_mode(
                        prior,
                        centre,
                        gradient,
                        curvature,
                        lambda u, expand=expand: expand(values, u),
                        floor,
                        diagonal,
                        EXPANSION_NEWTON_STEPS,
                        tolerance,
                    )
                    cold = not done
                if cold:  # line-searched Newton steps to the mode (a plain step from afar can overshoot far)
                    centre, gradient, curvature = conditional_mode(
                        prior,
                        centre,
                        gradient,
                        curvature,
                        lambda u, curvature=True, expand=expand: expand(values, u, curvature=curvature),
                        floor,
                        diagonal,
                        EXPANSION_NEWTON_STEPS,
                        tolerance,
                    )
                modes[name] = centre

            return site, expand, centre, gradient, curvature, quadratic, prior, p0, floor, diagonal

        # sites of one plate level that read each other (a group's location and noise scale): each is expanded at its
        # siblings' conditional modes, found by Gauss-Seidel sweeps, where one of them is not Gaussian in the
        # likelihood (at the siblings' prior means, a noisy group's location was expanded with the population's noise
        # scale: unseen.py's hetero, 0.58 posterior sds off)
        siblings = [
            n
            for n in self._expanded_sites
            if sum(self._level_of[m] is self._level_of[n] for m in self._expanded_sites) > 1
        ]
        prior_values = dict(values)
        for sweep in range(SIBLING_SWEEPS if siblings else 0):
            for name in siblings:
                site, expand, centre, gradient, curvature, quadratic, prior, p0, floor, diagonal = site_mode(name)
                if quadratic:  # (the mode of a site the likelihood is Gaussian in: one Newton step)
                    centre = conditional_mode(
                        prior,
                        centre,
                        gradient,
                        curvature,
                        lambda u, curvature=True, expand=expand, at=values: expand(at, u, curvature=curvature),
                        floor,
                        diagonal,
                        1,
                        0.0,
                    )[0]
                values[name] = self._site_value(name, centre)
            if sweep == 0 and all(self._quadratic.get(n) for n in siblings):
                values = prior_values  # (every sibling Gaussian in the likelihood: expanded as before, at prior means)
                break

        def globals_read(name: str, centre: torch.Tensor) -> torch.Tensor:
            """Which coordinates of the globals the site's expansion reads: those of the global sites that its
            gradient's graph reaches (autograd, so structural: checked once per site). The others' reads at ±w are
            the centre's, bit for bit: slopes 0 and exponent 0, not read."""
            found = self._globals_read.get(name)
            if found is not None:
                return found
            assert glob is not None
            level = self._level_of[name]
            scale = math.prod(s.plates[p].size for p in level.plates) / max(
                1, math.prod(int(calls[p].indices.shape[0]) for p in level.plates)
            )
            model = self.reading_model if blocks[0] is None else blocks[0](self.reading_model)
            read = torch.zeros(glob.numel, dtype=torch.bool)
            with torch.enable_grad():
                at, leaves = dict(values), []
                for n in glob.sites:  # (one leaf per global site: autograd tells which are read, not their slices)
                    leaf = ref_mean.detach().clone().requires_grad_(True)
                    at[n] = self._constrain(n, self._site_unconstrained(glob, n, leaf, broadcast=False))
                    leaves.append(leaf)
                u = centre.detach().clone().requires_grad_(True)
                own = {name: self._site_value(name, u)}
                total = rest_log_density(model, args, kwargs, at, own, scale, given, observed, validate=False)
                if total.requires_grad:
                    (g,) = torch.autograd.grad(total, u, create_graph=True, allow_unused=True)
                    if g is not None and g.requires_grad:
                        deps = torch.autograd.grad(g.sum(), leaves, allow_unused=True)
                        for n, dep in zip(glob.sites, deps, strict=True):
                            read[glob.block(n)] = dep is not None
            self._globals_read[name] = read
            return read

        for name in self._expanded_sites:
            site, expand, centre, gradient, curvature, quadratic, prior, p0, floor, diagonal = site_mode(name)
            level = self._level_of[name]
            info, natural = pseudo_observation(gradient, curvature, centre, diagonal)
            slopes = None
            if glob is not None and glob.numel:
                read = globals_read(name, centre)
                nodes = SLOPE_NODES if quadratic else DERIVATIVE_STEP
                width = ref_sd * nodes
                natural0 = _natural_at(gradient, curvature, centre, diagonal)
                weight = 1.0 / (info if diagonal else info.diagonal(dim1=-2, dim2=-1)).add(p0)
                targets, logs, exponents = [], [], []
                for k in range(glob.numel):
                    if not read[k]:  # (the likelihood does not read this global)
                        targets.append(torch.zeros_like(natural0))
                        logs.append(torch.zeros_like(natural0))
                        exponents.append(torch.zeros_like(natural0))
                        continue
                    pair = []
                    for sign in (1.0, -1.0):
                        shifted = ref_mean.clone()
                        shifted[..., k] += sign * width[..., k]
                        g, f = expand({**values, **self._global_values(shifted)}, centre)
                        diag = f.diagonal(dim1=-2, dim2=-1)
                        pair.append((_natural_at(g, f, centre, diagonal), diag.clamp(min=floor).log()))
                    w = width[..., k]
                    power = natural0.new_zeros(natural0.shape[-1:])
                    if quadratic and per_element:  # (each element's own, from its three reads: see the docstring)
                        shape = natural0.shape
                        power = natural_power(
                            *(t.expand(shape).reshape(1, -1) for t in (pair[0][0], natural0, pair[1][0])),
                            w,
                            weight.expand(shape).reshape(1, -1),
                            1,
                        ).reshape(shape)
                    elif quadratic:  # the exponent of η along this global (0 off the Gaussian case: a derivative)
                        power = natural_power(pair[0][0], natural0, pair[1][0], w, weight, len(level.batch_shape))
                    up, down = (power * w).exp(), (-power * w).exp()
                    targets.append((pair[0][0] * down - pair[1][0] * up) / (2 * w))
                    logs.append((pair[0][1] - pair[1][1]) / (4 * w))  # log √Λ: half the log precision
                    exponents.append(power.expand_as(natural0))
                slopes = (torch.stack(targets, -1), torch.stack(logs, -1), torch.stack(exponents, -1), None)
            made[name] = (info, natural, slopes)
        return made

    def _attach_hook(self) -> None:
        """Hook (once per tensor: again after unpickling or loading) the tail average onto the gradient accumulation of
        the packed parameters, which every training call reaches: it follows any training loop."""
        if self.tail_average is None:
            return
        leaf = self._modules["packed"].flat
        if (self._hooked is not None and self._hooked() is leaf) or not leaf.requires_grad:
            return
        self._hooked = weakref.ref(leaf)
        self._average_pairs = ()  # found again for the new tensors
        self._pairs()
        guide = weakref.ref(self)
        leaf.register_post_accumulate_grad_hook(lambda t, guide=guide: _average_hook(guide))

    @torch.no_grad()
    def _after_backward(self) -> None:
        """A training call's gradient has reached the parameters (the optimiser has not stepped yet): add their values
        to the tail average. (The state is read as the raw tensors: this runs inside the step's backward pass, where
        reading a ``PyroParam`` would be recorded by ``SVI``'s parameter capture.)"""
        averages = self._modules["averages"]
        count = averages.get_parameter("count_unconstrained")
        count.add_(1)
        tail_average_update(*self._pairs(), int(count), self.tail_average)

    def _pairs(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """``(averages, live parameters)`` as raw tensors, found once (again when the live tensors were replaced,
        e.g. by ``pyro.get_param_store().load``; the averages are then read through Pyro, which adopts the store's)."""
        leaf = self._modules["packed"].flat
        if not self._average_pairs or self._average_pairs[0] is not leaf:
            averages = self._modules["averages"]
            live = self._trainable()
            for key in live:
                getattr(averages, key)
            raw = [averages.get_parameter(f"{key}_unconstrained") for key in live]
            self._average_pairs = (leaf, tuple(raw), tuple(live.values()))
        return self._average_pairs[1:]

    def _use_average(self) -> bool:
        """Outside training (``Predictive``, ``median``, ``quantiles``, any call without gradients) the guide uses the
        tail average of its parameters instead of the last iterate, once there is one."""
        if self.tail_average is None or torch.is_grad_enabled():
            return False
        averages = self._modules.get("averages")
        if averages is None or "count" not in averages._pyro_params:
            return False
        # the store's tensor as it is when the module holds it already (no pyro.param statement: this call optimises
        # nothing), else read through Pyro, which adopts the store's (e.g. after pyro.get_param_store().load)
        count = averages._parameters["count_unconstrained"]
        store, name = pyro.get_param_store(), averages._pyro_get_fullname("count")
        if name not in store or store[name].unconstrained() is not count:
            count = averages.count
        return float(count) > 0

    @contextmanager
    def _parameters_in_use(self) -> Iterator[None]:
        """The parameters as this call uses them: the tail average outside training (see :meth:`_use_average`),
        swapped in for the call and back after it. The networks read them as views of the packed vector
        (:meth:`_unpack`) and keep the last call's views after it (after a training call a transform that runs its
        network lazily, as an autoregressive flow's inverse does, still reaches the parameters the call optimises).
        """
        averaged = self._use_average()
        saved: list[torch.Tensor] = []
        if averaged:
            averages, live = self._pairs()
            saved = [param.data for param in live]
        try:
            if averaged:
                for average, param in zip(averages, live, strict=True):
                    param.data = average.data
            self._unpack()
            yield
        finally:
            if averaged:
                for param, data in zip(live, saved, strict=True):
                    param.data = data

    @torch.no_grad()
    def quantiles(self, quantiles: list[float] | torch.Tensor, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Quantiles of ``num_summary_samples`` draws of q, for every element of the plates. Where the model draws a
        plate's subsample at random (``subsample_size=B``), which Pyro cannot open in full, they are taken on blocks
        of ``B`` elements and joined (:meth:`~pyro_hier.guides.base.HierarchicalGuide._join_blocks`)."""
        self._require_setup(*args, **kwargs)
        with keep_random_state():
            calls = capture_plates(self.model, args, kwargs)
        drawn = {n: c for n, c in calls.items() if c.subsampled and not c.user_indices}
        if not drawn or self.master is not None:  # (in an AutoGuideList the list opens the plates)
            return super().quantiles(quantiles, *args, **kwargs)

        def summarise(blocks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            with self._replaying(blocks):
                return super(AutoPlateAmortizedFlow, self).quantiles(quantiles, *args, **kwargs)

        return self._join_blocks(drawn, summarise)

    def _covariates(self, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
        assert self.structure is not None
        return call_local_features(self.local_features, args, kwargs, list(self.structure.observed))

    # ---- sampling -------------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Sample every latent site; returns ``{site: constrained value}``."""
        self._require_setup(*args, **kwargs)
        self._sync_state()
        # in an AutoGuideList the list has opened (and recorded) the plates: use their indices, record them once
        listed = {} if self.master is None else dict(getattr(self.master(), "plates", None) or {})
        forced = {name: plate.indices for name, plate in listed.items()}
        forced.update(self._summary_subsamples or {})  # (summaries block by block: plates Pyro subsamples at random)
        observations, calls, covariates, gathers, data = None, None, {}, None, {}
        if self.encoder_kind == "deepset":
            calls, observations = capture_observations(_ForceSubsamples(forced)(self.model), args, kwargs)
            covariates = self._covariates(args, kwargs)
        elif self._gather_maps is not None and not forced:  # the plates of this call, to find the gathered ancestors'
            # elements; the same arguments again: the last run's, Pyro's random subsamples drawn anew without a run
            calls = self._capture_plates(args, kwargs, list(self.structure.plates))
        elif self._gather_maps is not None:
            with keep_random_state():  # (the same draws as without gathers)
                calls = capture_plates(_ForceSubsamples(forced)(self.model), args, kwargs)
        if self._gather_maps is not None:  # found now: the model must not run again inside the cascade
            self._gather_maps.model = self.model
            gathers = self._gather_maps.call(args, kwargs, calls).prepare(self.levels)
        if self.encoder_kind == "deepset":
            data = self._site_data(args, kwargs, calls, observations, covariates, gathers)
        forced = {**{name: call.indices for name, call in (calls or {}).items()}, **forced}

        def hidden(msg: dict) -> bool:
            if isinstance(msg["fn"], _Subsample):
                return msg["name"] in listed
            return _hidden(msg) or msg["name"] in self.structure.observed  # observed at setup, left out now

        expansions = self._expansions_for_call(args, kwargs, forced, calls)
        # adopt the param store's tensors first, then swap the average into the tensors this call uses
        self._register_networks()
        with self._parameters_in_use():
            if torch.is_grad_enabled():
                self._attach_hook()
            cascade = _Cascade(self, observations, covariates, gathers, data, forced, expansions)
            # the cascade runs the model itself, without the init strategy (and without validating its distributions'
            # arguments: the model's own run checks the same ones)
            with poutine.block(hide_fn=hidden), cascade, pyro.validation_enabled(False):
                self.reading_model(*args, **kwargs)
        if torch.is_grad_enabled() and self._expanded_sites:
            self._update_global_moments(cascade)
        missing = [n for n in self.structure.latent if n not in cascade.result]
        if missing:
            raise StructureError(
                f"the model did not sample {missing} in this call, but did when the guide was built; the guide needs "
                "the same latent sites on every call"
            )
        return cascade.result

    @torch.no_grad()
    def _update_global_moments(self, cascade: _Cascade) -> None:
        """A training call: its draw of the globals (averaged over particles) updates their running mean and
        variance (rate :data:`GLOBAL_RATE`), where the next reference is made."""
        self._write_state("calls", self._state("calls") + 1)
        glob = self._global_level
        if glob is None or not glob.numel:
            return
        u = cascade.global_vector().detach().reshape(-1, glob.numel).mean(0)
        mean, var = self._state("global_mean"), self._state("global_var")
        diff = u - mean
        self._write_state("global_mean", mean + GLOBAL_RATE * diff)
        self._write_state("global_var", (1 - GLOBAL_RATE) * (var + GLOBAL_RATE * diff.pow(2)))

    def _site_data(self, args, kwargs, calls, observations, covariates, gathers) -> dict[tuple[str, str], SiteData]:
        """Each (observed site, level) pair's data for the deep set: this call's; for gathered sites whose rows in
        this call do not hold all the data of the level's elements, the model's call on all its data; without the
        observations (``obs=None``), the last call's (kept as plain tensors)."""
        assert self.structure is not None
        encoder = self._modules["encoder"]
        s = self.structure
        out: dict[tuple[str, str], SiteData] = {}
        for level in self.levels:
            above = set(level.plates).union(*(self._levels_by_name[a].plates for a in level.ancestors))
            pairs = [(n, False) for n, _ in encoder.paths[level.name]] + [
                (n, True) for n, _ in encoder.routes[level.name]
            ]
            for name, gathered in pairs:
                key = (name, level.name)
                if name not in observations:
                    if key not in self._last_data:
                        raise StructureError(
                            f"observed site '{name}' is not observed in this call (observations omitted, as in "
                            "Predictive(model, guide=guide) with obs=None) and the guide has not been called with its "
                            "data yet: call the guide (or train it) on the data first"
                        )
                    out[key] = self._last_data[key]
                    continue
                complete = not gathered or data_complete(s, name, level.plates, above, calls)
                if complete:
                    data = SiteData(observations[name], calls, covariates.get(name), gathers)
                else:
                    assert self._observed_rows is not None
                    full = self._observed_rows.full_call(args, kwargs, calls)
                    cov = self._covariates(full["args"], full["kwargs"]).get(name)
                    data = SiteData(full["observations"][name], full["calls"], cov, full["gathers"])
                out[key] = data
                self._last_data[key] = self._frozen(data)
        return out

    def _frozen(self, data: SiteData) -> SiteData:
        """The data with the positions the deep set reads kept as plain tensors (they pickle with the guide)."""
        if data.positions is None:
            return data
        needed = self._modules["encoder"].required_positions()
        table = {pair: data.positions.positions(*pair) for pair in needed}
        return SiteData(data.observation, dict(data.calls), data.covariates, FrozenPositions(table))

    @property
    def _levels_by_name(self) -> dict:
        return {level.name: level for level in self.levels}

    def _site_distribution(self, msg: dict, cascade: _Cascade) -> tuple[dist.TorchDistribution, _SiteMaps]:
        """The flow pushing forward the site's prior conditional ``msg["fn"]``."""
        assert self.structure is not None
        name = msg["name"]
        site = self.structure.latent.get(name)
        if site is None:
            raise StructureError(
                f"the model sampled a latent site '{name}' it did not sample when the guide was built; the guide "
                "needs the same latent sites on every call"
            )
        base = msg["fn"]
        if site.is_global and site.batch_shape:  # a global's own batch dims are part of what the flow models
            base = base.to_event(len(site.batch_shape))
        event_shape = base.event_shape  # the value's (the batch is the plates' and the contexts')
        support = base.support
        to_support = biject_to(support).with_cache(1)
        shapes = (name, type(support), event_shape)
        event_u = self._event_shapes.get(shapes)
        if event_u is None:
            event_u = self._event_shapes[shapes] = to_support.inv.forward_shape(event_shape)
        n = site.element_numel
        if event_u.numel() != n:
            raise StructureError(
                f"site '{name}' has an unconstrained event of shape {tuple(event_u)} in this call but {n} numbers "
                "per plate element when the guide was built"
            )
        level = self._level_of[name]
        encodings = [self._encoding(level.name, cascade)]
        encodings += [
            self._ancestor_view(level, lv, self._encoding(lv, cascade), cascade) for lv in self._context_levels[name]
        ]
        parts = encodings + [
            self._ancestor_view(level, self._level_of[a].name, cascade.base_values[a], cascade)
            for a in self._context_sites[name]
        ]
        batch = base.batch_shape
        parts = [_fit_batch(p, len(batch)) for p in parts]
        batch = _broadcast_shapes(batch, *(p.shape[:-1] for p in parts))
        context = torch.cat([p.expand(batch + p.shape[-1:]) for p in parts], dim=-1)
        flat = torch.Size((n,))
        reshape = event_u != flat
        standardise: list[Transform] = []
        if name in self._conjugate_sites:  # q0 = the prior conditional times the model's pseudo-observation
            loc0, scale0 = self._conditional_q0(name, base, cascade)
            batch = _broadcast_shapes(batch, loc0.shape[:-1])
            base = _StandardNormal(batch + flat, context)
            head = []
            if scale0.dim() == loc0.dim():
                standardise = [AffineTransform(loc0, scale0, event_dim=1)]
            else:
                standardise = [_CholeskyAffine(loc0, scale0)]
        elif self._from_prior(site):  # the prior conditional, flattened in unconstrained space
            if base.batch_shape != batch:
                base = base.expand(batch)
            head = [to_support.inv] + ([ReshapeTransform(event_u, flat)] if reshape else [])
        else:  # a standard normal in unconstrained space (as AutoNormal's base): no rsample, or a global (conjugate)
            base = _StandardNormal(batch + flat, context)
            head = []
        tail = ([ReshapeTransform(flat, event_u)] if reshape else []) + [to_support]

        def push_forward(flow: nn.Module, affine: FreeAffine, context: torch.Tensor) -> _PushForward:
            transforms = [*head, flow.condition(context), affine.transform(), *standardise, *tail]
            kinds = (name, *(type(t) for t in transforms))
            dims = self._transform_dims.get(kinds)
            if dims is None:
                dims = self._transform_dims[kinds] = [_transform_dims(t) for t in transforms]
            return _PushForward(base, transforms, batch, event_shape, dims)

        key = self._keys[name]
        if context.shape[:-1] != batch:
            context = context.expand(batch + context.shape[-1:])
        q = push_forward(self._modules["flows"][key], self._modules["site_affines"][key], context)
        maps = _SiteMaps(q, len(head), n, to_support, event_u)
        if self.stick_the_landing:
            assert self._detached_flows is not None
            for i in range(len(encodings)):  # encodings are variational parameters; the ancestors' values are not
                parts[i] = parts[i].detach()
            context = torch.cat([p.expand(batch + p.shape[-1:]) for p in parts], dim=-1)
            twin = self._detached_flows[0]
            q = StickingTheLanding(q, push_forward(twin["flows"][key], twin["site_affines"][key], context))
        return q, maps

    def _conditional_q0(
        self, name: str, fn: dist.TorchDistribution, cascade: _Cascade
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(loc, scale)`` of a conjugate site's :math:`q_0` on this call (flattened unconstrained space; ``scale``
        the sd ``(…, n)`` or a lower Cholesky factor ``(…, n, n)``): its prior conditional ``fn`` at the parents' draws
        times the model's pseudo-observation (expanded sites), moved to the globals' draw :math:`\theta` along its
        slopes: :math:`\eta(\theta) = e^{D\Delta}(\bar\eta + B\Delta)`, :math:`\Lambda(\theta) =
        E\bar\Lambda E`, :math:`E = \mathrm{diag}(e^{C\Delta})`, :math:`\Delta = \theta - \bar\theta` (plus the
        offset of an element read at another reference). The exponents are bounded (:data:`STRETCH_LIMIT`) so that a
        draw far from the reference early in a run does not overflow float32."""
        assert self.structure is not None
        prior = gaussian_prior(fn, fn.support)
        if prior is None:
            raise StructureError(
                f"site '{name}' had a Gaussian prior conditional when the guide was built and has "
                f"{type(fn).__name__} in this call; the conjugate conditional needs the same family (or build the "
                "guide with conditional='pushforward')"
            )
        expansion = cascade.expansions.get(name)
        if expansion is None:
            if prior.diagonal:
                return prior.loc, prior.precision.rsqrt()
            return prior.loc, precision_to_scale_tril(prior.precision)
        info, natural, slopes = expansion
        diagonal = info.dim() == natural.dim()
        if slopes is not None:
            delta = cascade.global_vector() - self._state("ref_mean")
            if slopes[3] is not None:  # read at another reference (the data tables): the offset to it
                delta = delta + slopes[3]
            delta = delta.unsqueeze(-1)
            # (e^{±15} ≈ 3e6: a draw that far from the reference, early in a run, must not overflow float32)
            power = (slopes[2] @ delta).squeeze(-1).clamp(-2 * STRETCH_LIMIT, 2 * STRETCH_LIMIT).exp()
            natural = power * (natural + (slopes[0] @ delta).squeeze(-1))
            stretch = (slopes[1] @ delta).squeeze(-1).clamp(-STRETCH_LIMIT, STRETCH_LIMIT).exp()
            if diagonal:
                info = stretch * info * stretch
            else:
                info = stretch.unsqueeze(-1) * info * stretch.unsqueeze(-2)
        return gaussian_update(prior, info, natural)

    def _ancestor_view(self, level, ancestor: str, x: torch.Tensor, cascade: _Cascade) -> torch.Tensor:
        """An ancestor's base sample or encoding ``(…, k)`` as the level's elements see it: read at each element's
        ancestor element when the ancestor is gathered (a county's state), as is when nested."""
        if not level.links_to(ancestor):
            return x
        return cascade.gathers.read_ancestor(x, level, self._levels_by_name[ancestor], event_dim=1)

    def _encoding(self, level: str, cascade: _Cascade) -> torch.Tensor:
        encoder = self._modules["encoder"]
        if self.encoder_kind == "free":
            return encoder(level, cascade.calls)
        if level not in cascade.encodings:
            dtype = self._modules["packed"].flat.dtype
            cascade.encodings[level] = encoder(level, lambda site, lv: cascade.data[(site, lv)], cascade.calls, dtype)
        return cascade.encodings[level]


class _PushForward(dist.TransformedDistribution):
    """``base`` pushed through ``transforms``, as Pyro's ``TransformedDistribution``, but built without its shape
    inference (the guide knows the shapes) and scoring its own draw from the draw's intermediate values: the
    log-density of a value drawn here needs no inverse (no extra operations, nor their backward pass), and transforms
    that preserve volume (reshapes, the identity) are skipped. A value given from outside is inverted as usual.

    ``dims``: each transform's ``(domain, codomain)`` event dims and whether it changes volume
    (:func:`_transform_dims`)."""

    def __init__(
        self,
        base: dist.TorchDistribution,
        transforms: list[Transform],
        batch_shape: torch.Size,
        event_shape: torch.Size,
        dims: list[tuple[int, int, bool]],
    ) -> None:
        self.base_dist, self.transforms, self._dims = base, transforms, dims
        self.draw: list[torch.Tensor] | None = None  # the base sample and its image by each transform, last draw
        torch.distributions.Distribution.__init__(self, batch_shape, event_shape, validate_args=False)

    def expand(self, batch_shape, _instance=None) -> dist.TransformedDistribution:
        batch_shape = torch.Size(batch_shape)
        shape = batch_shape + self.event_shape
        for t in reversed(self.transforms):
            shape = t.inverse_shape(shape)
        base = self.base_dist.expand(shape[: len(shape) - len(self.base_dist.event_shape)])
        return _PushForward(base, self.transforms, batch_shape, self.event_shape, self._dims)

    def rsample(self, sample_shape: Sequence[int] = ()) -> torch.Tensor:
        x = self.base_dist.rsample(torch.Size(sample_shape))
        draw = [x]
        for t in self.transforms:
            x = t(x)
            draw.append(x)
        self.draw = draw
        return x

    def sample(self, sample_shape: Sequence[int] = ()) -> torch.Tensor:
        with torch.no_grad():
            return self.rsample(sample_shape)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        draw = self.draw
        if draw is None or value is not draw[-1]:
            return super().log_prob(value)
        event_dim = len(self.event_shape)
        log_prob = None
        for i in range(len(self.transforms) - 1, -1, -1):
            domain, codomain, volume = self._dims[i]
            event_dim += domain - codomain
            if not volume:
                continue
            term = _sum_rightmost(self.transforms[i].log_abs_det_jacobian(draw[i], draw[i + 1]), event_dim - domain)
            log_prob = -term if log_prob is None else log_prob - term
        base = _sum_rightmost(self.base_dist.log_prob(draw[0]), event_dim - len(self.base_dist.event_shape))
        return base if log_prob is None else log_prob + base


class _StandardNormal(dist.TorchDistribution):
    """The standard normal on vectors of ``shape`` (the last dim the event), dtype and device of ``like``: the base
    of the guide's flows, without building a ``Normal`` and an ``Independent`` (and their checks) per site and call.
    Its draws are ``Normal(0, 1)``'s from the same random numbers."""

    arg_constraints: ClassVar[dict] = {}
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, shape: torch.Size, like: torch.Tensor) -> None:
        self._like = like
        super().__init__(shape[:-1], shape[-1:], validate_args=False)

    def expand(self, batch_shape, _instance=None) -> _StandardNormal:
        return _StandardNormal(torch.Size(batch_shape) + self.event_shape, self._like)

    def rsample(self, sample_shape: Sequence[int] = ()) -> torch.Tensor:
        shape = torch.Size(sample_shape) + self.batch_shape + self.event_shape
        return _standard_normal(shape, dtype=self._like.dtype, device=self._like.device)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return -0.5 * value.pow(2).sum(-1) - 0.5 * self.event_shape[0] * math.log(2 * math.pi)


def _broadcast_shapes(first: torch.Size, *others: torch.Size) -> torch.Size:
    """``torch.broadcast_shapes``, at once when the shapes are equal (the usual case here)."""
    if all(shape == first for shape in others):
        return first
    return torch.broadcast_shapes(first, *others)


def _transform_dims(t: Transform) -> tuple[int, int, bool]:
    """``(domain, codomain)`` event dims of a transform, and whether it changes volume (not a reshape, nor the
    identity: their log-determinant is 0)."""
    volume = not (isinstance(t, ReshapeTransform) or (isinstance(t, ComposeTransform) and not t.parts))
    return t.domain.event_dim, t.codomain.event_dim, volume


class _CholeskyAffine(Transform):
    """``x ↦ loc + L x`` on vectors, ``L`` lower triangular with a positive diagonal, both batched (Pyro's
    ``LowerCholeskyAffine`` takes one ``L``)."""

    domain = constraints.real_vector
    codomain = constraints.real_vector
    bijective = True

    def __init__(self, loc: torch.Tensor, scale_tril: torch.Tensor) -> None:
        super().__init__(cache_size=1)
        self.loc, self.scale_tril = loc, scale_tril

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        return self.loc + (self.scale_tril @ x.unsqueeze(-1)).squeeze(-1)

    def _inverse(self, y: torch.Tensor) -> torch.Tensor:
        batch = torch.broadcast_shapes(self.scale_tril.shape[:-2], y.shape[:-1], self.loc.shape[:-1])
        d = y.shape[-1]
        tril = self.scale_tril.expand((*batch, d, d))
        r = (y - self.loc).expand((*batch, d)).unsqueeze(-1)
        return torch.linalg.solve_triangular(tril, r, upper=False).squeeze(-1)

    def log_abs_det_jacobian(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logdet = self.scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return logdet.expand(torch.broadcast_shapes(logdet.shape, x.shape[:-1]))


class _SiteMaps:
    """Maps a site's sampled value back to the flow's base space: the prior sample it was pushed from, in
    unconstrained space and flattened (the input of the flow's transform at ``tap`` in the chain), which is what its
    descendants see in their contexts."""

    def __init__(self, q: _PushForward, tap: int, numel: int, to_support: Transform, event_u: torch.Size) -> None:
        self.q, self.tap, self.numel = q, tap, numel
        self.to_support, self.event_u = to_support, event_u

    def _drawn(self, value: torch.Tensor) -> list[torch.Tensor] | None:
        draw = self.q.draw
        return draw if draw is not None and draw[-1] is value else None

    def unconstrained(self, value: torch.Tensor) -> torch.Tensor:
        """The value in unconstrained space, flattened ``(…, n)`` (the draw's own tensor when it was drawn here)."""
        draw = self._drawn(value)
        z = self.to_support.inv(value) if draw is None else draw[-2]
        return z.reshape((*z.shape[: z.dim() - len(self.event_u)], self.numel))

    def base_value(self, value: torch.Tensor) -> torch.Tensor:
        draw = self._drawn(value)
        if draw is not None:  # drawn by this site's rsample: the exact base sample
            return draw[self.tap]
        x = value  # given from outside (e.g. replayed): invert the chain
        for t in reversed(self.q.transforms[self.tap :]):
            x = t.inv(x)
        return x


class _Cascade(PlateRecorder):
    """Runs inside the model: replaces each latent site's prior by the guide's flow, records plates and values."""

    def __init__(
        self, guide: AutoPlateAmortizedFlow, observations, covariates, gathers, data, forced, expansions=None
    ) -> None:
        super().__init__()
        self.guide = guide
        self.expansions = expansions or {}
        self.unconstrained: dict[str, torch.Tensor] = {}
        self.observations = observations
        self.covariates = covariates
        self.gathers = gathers
        self.data = data
        self.forced = forced  # plate name → the indices to use (those the encoder saw, or an AutoGuideList's)
        self.encodings: dict[str, torch.Tensor] = {}
        self.base_values: dict[str, torch.Tensor] = {}
        self.result: dict[str, torch.Tensor] = {}
        self._maps: dict[str, _SiteMaps] = {}

    def _pyro_sample(self, msg) -> None:
        if isinstance(msg["fn"], _Subsample):
            _force_subsample(msg, self.forced)
            super()._pyro_sample(msg)
            return
        if msg["is_observed"] or msg["name"] in self.guide.structure.observed:
            return  # an observation (Predictive leaves it out to sample it from the model): not the guide's
        msg["fn"], self._maps[msg["name"]] = self.guide._site_distribution(msg, self)

    def _pyro_post_sample(self, msg) -> None:
        if isinstance(msg["fn"], _Subsample):
            super()._pyro_post_sample(msg)
            return
        name = msg["name"]
        if msg["is_observed"] or name not in self._maps:
            return
        self.result[name] = msg["value"]
        self.base_values[name] = self._maps[name].base_value(msg["value"])
        glob = self.guide._global_level
        if glob is not None and name in glob.sites:
            self.unconstrained[name] = self._maps[name].unconstrained(msg["value"])

    def global_vector(self) -> torch.Tensor:
        r"""The globals' draw on this call as one unconstrained vector ``(…, d_g)`` (sites in model order).

        Asked for by a plated site that the model samples before some global (``sigma`` after the groups' plate), the
        globals not drawn yet stand at the reference (``ref_mean``): that site's :math:`q_0` moves along the globals
        drawn before it only (its :math:`\Delta` is 0 in the others), a family in which the guide samples in the
        model's order."""
        glob = self.guide._global_level
        assert glob is not None
        if all(n in self.unconstrained for n in glob.sites):
            return concat_broadcast([self.unconstrained[n] for n in glob.sites])
        assert self.guide.structure is not None
        reference, parts, start = self.guide._state("ref_mean"), [], 0
        for n in glob.sites:
            size = self.guide.structure.latent[n].element_numel
            parts.append(self.unconstrained[n] if n in self.unconstrained else reference[start : start + size])
            start += size
        return concat_broadcast(parts)


def natural_power(
    plus: torch.Tensor, centre: torch.Tensor, minus: torch.Tensor, width: torch.Tensor, weight: torch.Tensor, ndim: int
) -> torch.Tensor:
    r"""The exponent :math:`d` of a pseudo-observation's natural parameter along one global coordinate, from its
    reads at the reference and at :math:`\pm w`: :math:`\eta(\Delta) = e^{d\Delta}(\bar\eta + b\Delta)` fits
    the three reads exactly for any :math:`d` when :math:`b` takes the odd part, and :math:`d` is chosen to fit the
    even part, :math:`\eta_+ e^{-dw} + \eta_- e^{dw} - 2\bar\eta = 0`, in least squares over the plate elements
    (weights ``weight``, per coordinate of the element vector: one exponent per coordinate, shared by the elements
    of the ``ndim`` batch dims), on a grid over :math:`\pm` :data:`POWER_LIMIT` refined on two finer grids, ties going
    to the smallest :math:`|d|`.

    Where the likelihood is Gaussian in the site, :math:`\eta = A(y - c)/\sigma^2` with the globals entering
    through the coefficient :math:`A`, the offset :math:`c` and the noise :math:`\sigma`: a location (``c``) gives
    :math:`d = 0` (:math:`\eta` affine), a log scale of the coefficient (non-centred eight schools' :math:`\log\tau`)
    :math:`d = 1`, a log noise scale (radon's :math:`\log\sigma_y`) :math:`d = -2`, each exact, with the products of
    these also exact. Returns ``(n,)``."""
    dtype = plus.dtype
    plus, centre, minus, weight = (t.double() for t in (plus, centre, minus, weight))
    w = width.double()
    # with x = dw, the even part is r + s(cosh x - 1) - a sinh x (s = η+ + η-, a = η+ - η-, r = s - 2η̄): its
    # weighted squares summed over the elements are a quadratic form in (1, cosh x - 1, sinh x) whose six
    # coefficients are per-coordinate sums, read once (the grid then costs O(grid × n), not O(grid × elements × n));
    # each term has its own size (none cancels at d = 0), so the sums lose no more than rounding
    s, a = plus + minus, plus - minus
    r = s - 2 * centre

    def total(t: torch.Tensor) -> torch.Tensor:
        t = weight * t
        return t.flatten(0, ndim - 1).sum(0) if ndim else t

    rr, rs, ra, ss, sa, aa = (total(u * v) for u, v in ((r, r), (r, s), (r, a), (s, s), (s, a), (a, a)))
    scale = total(plus.pow(2) + minus.pow(2) + centre.pow(2))

    def loss(grid: torch.Tensor) -> torch.Tensor:  # (G, n) for exponents (G, n)
        x = grid * w
        cosh1, sinh = 2 * (x / 2).sinh().pow(2), x.sinh()
        out = rr + 2 * cosh1 * rs - 2 * sinh * ra + cosh1.pow(2) * ss - 2 * cosh1 * sinh * sa + sinh.pow(2) * aa
        return out.clamp(min=0) + (1e-9 * scale + 1e-300) * grid.pow(2)  # ties (a flat fit) go to d = 0

    n = plus.shape[-1]
    coarse = torch.linspace(-POWER_LIMIT, POWER_LIMIT, POWER_GRID, dtype=torch.float64, device=plus.device)
    step = coarse[1] - coarse[0]
    best = coarse[loss(coarse.unsqueeze(-1).expand(-1, n)).argmin(0)]  # (n,)
    for _ in range(2):  # two finer grids about the best point
        fine = best + torch.linspace(-1.0, 1.0, 33, dtype=torch.float64, device=plus.device).unsqueeze(-1) * step
        best = fine.gather(0, loss(fine).argmin(0).unsqueeze(0)).squeeze(0)
        step = step / 16
    return best.clamp(-POWER_LIMIT, POWER_LIMIT).to(dtype)


@torch.no_grad()
def predicted_expansions(old: dict, moved: torch.Tensor, new: dict, tol: float = PREDICTION_TOLERANCE) -> bool:
    r"""Whether the expansions ``new`` ``{site: (Λ̄, η̄, (B, C, D, offset) or None)}``, read at a reference that is
    ``moved`` from that of ``old``, are what ``old``'s slopes give there: with :math:`\delta` = ``moved``,
    :math:`\eta = e^{D\delta}(\bar\eta + B\delta)` within ``tol`` :math:`\sqrt{\Lambda}` of the new
    :math:`\bar\eta`, :math:`\Lambda = E\bar\Lambda E` (:math:`E = e^{C\delta}`) within a factor
    :math:`e^{\pm\mathrm{tol}}` on its diagonal, and the slopes (:math:`e^{D\delta}B`, :math:`C`, :math:`D`)
    within ``5 tol`` of their largest size. A Gaussian likelihood read along globals that enter it as locations and
    log scales is predicted exactly; others once the reference settles."""
    for name, (info, natural, slopes) in new.items():
        if name not in old:
            return False
        info0, natural0, slopes0 = old[name]
        if (slopes is None) != (slopes0 is None) or info.shape != info0.shape or natural.shape != natural0.shape:
            return False
        slopes_now: tuple = ()
        if slopes0 is not None:
            if slopes0[3] is not None or slopes[3] is not None:
                return False
            delta = moved.unsqueeze(-1)
            power = (slopes0[2] @ delta).squeeze(-1).clamp(-30.0, 30.0).exp()
            stretch = (slopes0[1] @ delta).squeeze(-1).clamp(-15.0, 15.0).exp()
            natural0 = power * (natural0 + (slopes0[0] @ delta).squeeze(-1))
            if info0.dim() == natural0.dim():
                info0 = stretch * info0 * stretch
            else:
                info0 = stretch.unsqueeze(-1) * info0 * stretch.unsqueeze(-2)
            slopes_now = (
                (power.unsqueeze(-1) * slopes0[0], slopes[0]),
                (slopes0[1], slopes[1]),
                (slopes0[2], slopes[2]),
            )
        diag0 = info0 if info0.dim() == natural0.dim() else info0.diagonal(dim1=-2, dim2=-1)
        diag = info if info.dim() == natural.dim() else info.diagonal(dim1=-2, dim2=-1)
        tiny = torch.finfo(diag.dtype).tiny
        if bool(((natural - natural0).abs() > tol * diag.clamp(min=0).sqrt() + tiny**0.5).any()):
            return False
        if bool(((diag.clamp(min=tiny).log() - diag0.clamp(min=tiny).log()).abs() > tol).any()):
            return False
        for a, b in slopes_now:
            if bool(((a - b).abs() > 5 * tol * float(b.abs().max()) + tiny).any()):
                return False
    return True


def _natural_at(gradient: torch.Tensor, curvature: torch.Tensor, centre: torch.Tensor, diagonal: bool) -> torch.Tensor:
    r""":math:`\eta = F c + g` of an expansion at ``centre``, the whole curvature (its diagonal when ``diagonal``)."""
    if diagonal:
        return curvature.diagonal(dim1=-2, dim2=-1) * centre + gradient
    return (curvature @ centre.unsqueeze(-1)).squeeze(-1) + gradient


def _element_shape(full: torch.Tensor, axes: list[tuple[int, torch.Tensor]], ndim: int) -> torch.Size:
    """The batch shape (first ``ndim`` dims) of ``full`` cut to the indices of ``axes``."""
    shape = list(full.shape[:ndim])
    for axis, idx in axes:
        shape[axis] = idx.shape[0]
    return torch.Size(shape)


def _gather_elements(full: torch.Tensor, axes: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    for axis, idx in axes:
        full = full.index_select(axis, idx.to(full.device))
    return full


def _scatter_elements(full: torch.Tensor, axes: list[tuple[int, torch.Tensor]], part: torch.Tensor) -> None:
    """``full[idx_1, …, idx_k] = part`` along the axes given (one index vector per axis), in place."""
    if not axes:
        full.copy_(part)
        return
    (axis, idx), rest = axes[0], axes[1:]
    idx = idx.to(full.device)
    inner = full.index_select(axis, idx)
    _scatter_elements(inner, rest, part)
    full.index_copy_(axis, idx, inner)


class _Indices:
    """A plate's elements for :meth:`AutoPlateAmortizedFlow._element_axes` (``indices`` only)."""

    def __init__(self, indices: torch.Tensor) -> None:
        self.indices = indices


def _average_hook(guide: weakref.ref) -> None:
    live = guide()
    if live is not None:
        live._after_backward()


def _force_subsample(msg: dict, forced: dict[str, torch.Tensor]) -> None:
    """Give a plate's subsample site the indices in ``forced`` (refusing other indices chosen by the model)."""
    indices = forced.get(msg["name"])
    if indices is None:
        return
    if msg["value"] is None:
        msg["value"] = indices
    elif not torch.equal(torch.as_tensor(msg["value"]).to(indices.device), indices):
        raise StructureError(
            f"the model gave plate '{msg['name']}' its own subsample indices, but the AutoGuideList opened it with "
            "others: give the AutoGuideList create_plates returning the model's indices (as for AutoNormal)"
        )


class _ForceSubsamples(Messenger):
    """Runs a model with the subsample indices ``forced`` (plate name → indices)."""

    def __init__(self, forced: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.forced = forced

    def _pyro_sample(self, msg) -> None:
        if isinstance(msg["fn"], _Subsample):
            _force_subsample(msg, self.forced)


def _hidden(msg: dict) -> bool:
    """The model's observed sites (and factors, deterministic sites) stay out of the guide's trace."""
    return msg["type"] == "sample" and msg["is_observed"]


def _fit_batch(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Drop leading singleton batch dims of a context part ``(batch…, k)`` beyond ``ndim`` batch dims (a pooled
    encoding keeps the pooled plates' dims as singletons; a global site's prior has none)."""
    while t.dim() - 1 > ndim and t.shape[0] == 1:
        t = t[0]
    return t

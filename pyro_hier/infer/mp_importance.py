"""Massively parallel importance sampling (Bowyer, Heap & Aitchison) on Pyro's tensor variable elimination."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pyro
import torch
from pyro import poutine

from pyro_hier.infer.chunking import Pass, run_chunked
from pyro_hier.infer.contraction import (
    ContractionEstimate,
    check_memory,
    estimate_contraction,
    log_contract,
    separators,
)
from pyro_hier.infer.factor_graph import Factor, FactorGraph, SiteSamples, build_factor_graph, describe_call

__all__ = ["MPImportance"]


class MPImportance:
    r"""Massively parallel importance sampling: ``K`` samples of every latent site, all ``K^n`` combinations
    weighted at once by a plated tensor contraction.

    **Estimator.** Each latent site :math:`z_i` (every element of its plates) gets ``K`` samples
    :math:`z_i^1..z_i^K` from the proposal, sample :math:`k` drawn given sample :math:`k` of the sites it depends on
    in the proposal (one vectorised run of the guide). With :math:`Q_i(z_i^k)` the density sample :math:`k` was
    drawn from, the estimate of :math:`p(x)` averages the importance ratio over every combination
    :math:`\mathbf k = (k_1, \dots, k_n)` of sample indices (one index per site and plate element):

    .. math::

        \hat P = \frac{1}{K^n} \sum_{\mathbf k}
            \frac{p(x, z_1^{k_1}, \dots, z_n^{k_n})}{\prod_i Q_i(z_i^{k_i})}
          = \frac{1}{K^n} \sum_{\mathbf k} \prod_f F_f(\mathbf k_f),

    a product of low-rank factors (each model factor involves a site's index and its parents' indices), computed by
    Pyro's plated tensor variable elimination (``pyro.ops.contract``), the machinery of ``TraceEnum_ELBO``. It is
    unbiased, :math:`E[\hat P] = p(x)`, also when proposals depend on parents, because each sample is weighted by
    the density it was actually drawn from. Discrete sites marked ``infer={"enumerate": "parallel"}`` (and absent
    from the guide) are summed exactly over their support instead of sampled.

    **Gathered plates.** Models are usually written with a flat plate of observations that reads its group's
    effect by an index (``a[..., county]`` in a plate of homes beside the plate of counties). The structure
    inspector (:func:`~pyro_hier.structure.inspect_model`, run on the call being estimated) finds which element of
    the group plate each observation reads, and a group's data are the observations whose index points at it: their
    log densities are summed per group (``index_add`` along the observation plate), an ordinary factor in the group
    plate, so the contraction stays plated and exact. Index chains (homes → counties → states, with latents in the
    counties) are eliminated level by level: a county's own sample indices are summed out per county, its state's
    kept, and the result is summed into the states (:mod:`pyro_hier.infer.gathered`). Crossed plates (an answer
    reading one student and one question) have no plated form of the sum over the ``K^n`` combinations and are
    refused with the guide-based route; so are reads that no per-element map describes (a site depending on a
    whole plate, an index computed from a latent).

    **Subsampling.** For a plate with ``B`` of its ``N`` elements present, the product over the plate of the
    per-element sums is raised to the power ``N/B`` (the log of the plate-contracted factor is multiplied by
    ``N/B`` after the log-sum-exp over samples). This equals the estimator on a data set in which every present
    element stands for ``N/B`` elements with the same samples; it is consistent but, like any estimator of a
    product that reads ``B < N`` of its factors, not unbiased for :math:`p(x)` (it is unbiased for
    :math:`\log \hat P` of the full data when averaged over subsets and there is no latent above the plate). A
    factor summed from a gathered plate into its group plate counts its site's total scale divided by the powers of
    the plates it then lies in: with the groups subsampled by :func:`pyro_hier.plates.gathered_rows` (``m`` of ``J``
    groups and their rows, the rows' site scaled to ``J/m``) each row counts once inside its group and the groups'
    product is raised to ``J/m``; with the rows subsampled alone (``B`` of ``M``, all groups present) each row's log
    density is weighted by ``M/B`` inside its group's sum over samples.

    **Posterior quantities by the source-term trick.** Adding a zero-valued factor :math:`J \cdot m(z_i)` to a
    site's factor and differentiating, :math:`\partial \log \hat P / \partial J |_{J=0}` is the self-normalised
    importance estimate of :math:`E[m(z_i) \mid x]` (per plate element if :math:`J` has the plate's shape); with
    :math:`J` on the site's sample index it is the marginal weight :math:`w_i^k = P(k_i = k)`; with :math:`J` on the
    site's index and the indices it is coupled to earlier in sampling order, it is their joint, whose conditionals
    give exact ancestral sampling of index combinations from :math:`P(\mathbf k) \propto \prod_f F_f(\mathbf k_f)`.
    Under subsampling these are the posterior of the scaled (``N/B``-tempered) target.

    **Limits.** Every latent site (or group of sites sharing an auxiliary guide site) gets its own tensor dim, as in
    ``TraceEnum_ELBO``, so a few dozen sites at most; ``pyro.markov`` dim recycling and subsampled sequential plates
    are not supported. Cost and memory grow like ``K^2`` times the plate size for a site and its parent. The
    per-element ESS of :meth:`get_ESS` describes the marginal weights only: for a site whose parents' weights are
    themselves products of noisy per-element sums (three or more levels with a poor proposal), the error of
    :meth:`moments` can be several times ``sd / sqrt(ESS)``.

    Example::

        mp = MPImportance(model, guide, num_samples=64).run(x, y)
        mp.get_log_normalizer()            # log P̂, an estimate (lower bound in expectation) of log p(y)
        mp.moments("z")                    # E[z | y] per plate element
        mp.moments("z", lambda z: z**2)    # E[z² | y]
        mp.moments("theta", proposal_draws=4096)  # with the guide's own mean as control variate (see moments)
        mp.marginal_weights("z")           # (K, *batch_shape), sums to 1 over the first dim
        mp.get_ESS("z")                    # effective sample size per plate element
        samples = mp.sample_posterior(1000)
        Predictive(model, posterior_samples=samples)(x, None)

        p = radon_mn()                     # a flat plate of homes reading county_effect[..., county]
        MPImportance(p.model, guide, num_samples=32).run(*p.args, **p.kwargs).moments("county_effect")  # (85,)

    :param model: a Pyro model. Plates must be vectorised with explicit ``dim``\ s; variables outside a plate may
        not depend on variables inside it (as for ``TraceEnum_ELBO``), except through per-element reads of a
        gathered plate (see above).
    :param guide: the proposal; ``None`` proposes every latent site from its prior conditional. Any guide whose
        latent sites are the model's works, directly or through auxiliary sites (``AutoNormal``,
        :class:`~pyro_hier.AutoBranchGuide` after fitting, hand-written guides whose sites depend on their parents).
        It must support a vectorising plate at dim ``-(max_plate_nesting + 1)``.
    :param num_samples: ``K``, the number of samples per latent site.
    :param max_plate_nesting: deepest plate dim (the model's, from :func:`~pyro_hier.structure.inspect_model`, if
        ``None``).
    :param max_tensor_bytes: largest tensor the contraction may create; the estimate is checked before contracting
        and a :class:`~pyro_hier.infer.TensorTooLargeError` names the factor and suggests a smaller ``K`` or
        chunking. ``None`` disables the check.
    :param chunk_plate: name of an outermost plate to process ``chunk_size`` elements at a time (memory grows with
        the chunk, not the plate). The model (and guide) must take the chunk's indices as the keyword
        ``subsample_kwarg`` and open the plate with ``pyro.plate(chunk_plate, N, subsample=...)``, like the models of
        :mod:`pyro_hier.problems`. The estimate is the same as without chunking (one pass over all ``N`` elements
        with shared global samples); each chunk's factors are rebuilt from its stored samples when posterior
        quantities are requested. A group plate that flat plates gather from can be chunked when the model opens
        each chunk's rows (:func:`pyro_hier.plates.gathered_rows`, as :func:`pyro_hier.problems.movielens_model`
        does) and those plates hold observations only; a gathered plate itself, or latent sites in a plate gathered
        into the chunked one (an index chain), are refused.
    :param chunk_size: elements per chunk (required with ``chunk_plate``).
    :param subsample_kwarg: the keyword through which the chunk's indices are passed (default ``"subsample"``).

    Reference: S. Bowyer, T. Heap, L. Aitchison, *Using Autodiff to Estimate Posterior Moments, Marginals and
    Samples* (massively parallel importance sampling with the source-term trick); T. Heap, S. Bowyer,
    L. Aitchison, *Massively parallel reweighted wake-sleep*; F. Obermeyer et al., *Tensor Variable Elimination
    for Plated Factor Graphs*, ICML 2019.
    """

    def __init__(
        self,
        model: Callable,
        guide: Callable | None = None,
        *,
        num_samples: int,
        max_plate_nesting: int | None = None,
        max_tensor_bytes: float | None = 2**31,
        chunk_plate: str | None = None,
        chunk_size: int | None = None,
        subsample_kwarg: str = "subsample",
    ) -> None:
        if not callable(model):
            raise ValueError(f"model must be callable, got {model!r}")
        if guide is not None and not callable(guide):
            raise ValueError(f"guide must be callable or None, got {guide!r}")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        if max_plate_nesting is not None and (
            isinstance(max_plate_nesting, bool) or not isinstance(max_plate_nesting, int) or max_plate_nesting < 0
        ):
            raise ValueError(f"max_plate_nesting must be a non-negative int or None, got {max_plate_nesting!r}")
        if max_tensor_bytes is not None and not (
            isinstance(max_tensor_bytes, int | float)
            and not isinstance(max_tensor_bytes, bool)
            and max_tensor_bytes > 0
        ):
            raise ValueError(f"max_tensor_bytes must be a positive number or None, got {max_tensor_bytes!r}")
        if (chunk_plate is None) != (chunk_size is None):
            raise ValueError("chunk_plate and chunk_size go together: give both or neither")
        if chunk_plate is not None and not isinstance(chunk_plate, str):
            raise ValueError(f"chunk_plate must be a plate name, got {chunk_plate!r}")
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if not isinstance(subsample_kwarg, str) or not subsample_kwarg:
            raise ValueError(f"subsample_kwarg must be a keyword name, got {subsample_kwarg!r}")
        self.chunk_plate = chunk_plate
        self.chunk_size = chunk_size
        self.subsample_kwarg = subsample_kwarg
        self.model = model
        self.guide = guide
        self.num_samples = num_samples
        self.max_plate_nesting = max_plate_nesting
        self.max_tensor_bytes = max_tensor_bytes
        self._graph: FactorGraph | None = None
        self._log_normalizer: torch.Tensor | None = None
        self._estimate: ContractionEstimate | None = None
        self._passes: list[Pass] = []
        self._structure: tuple[list[str], dict[str, list[str]]] | None = None
        self._marginals: dict[str, torch.Tensor] | None = None
        self._means: dict[str, torch.Tensor] | None = None
        self._sampler: tuple[list[str], dict[str, list[str]], dict[str, torch.Tensor]] | None = None
        self._call: tuple[tuple, dict] | None = None

    # ------------------------------------------------------------------------------------------------------ running
    def run(self, *args, **kwargs) -> MPImportance:
        """Draw ``K`` samples of every latent site, weight all combinations, and return ``self``."""
        if self.chunk_plate is None:
            graph = _in_float64(
                build_factor_graph(
                    self.model,
                    self.guide,
                    args,
                    kwargs,
                    num_samples=self.num_samples,
                    max_plate_nesting=self.max_plate_nesting,
                )
            )
            estimate = estimate_contraction(graph.factors, graph.sum_dims, graph.segments)
            check_memory(graph, estimate, self.max_tensor_bytes)
            with torch.no_grad():
                log_normalizer = log_contract(
                    graph.factors, graph.sum_dims, graph.plate_scales, segments=graph.segments
                )
            passes = [
                Pass(
                    graph,
                    graph.factors,
                    graph.sum_dims,
                    graph.plate_scales,
                    list(graph.indices),
                    list(graph.sites),
                )
            ]
            structure = separators(graph)
        else:
            graph, passes, log_normalizer, estimate, structure = self._run_chunked(args, kwargs)
        self._graph, self._estimate, self._passes, self._structure = graph, estimate, passes, structure
        self._call = (args, dict(kwargs))
        self._dtype = graph.model_dtype or graph.dtype
        self._log_normalizer = log_normalizer.detach()
        self._marginals = self._means = self._sampler = None
        return self

    def _run_chunked(self, args: tuple, kwargs: dict):
        if kwargs.get(self.subsample_kwarg) is not None:
            raise ValueError(
                f"chunking over {self.chunk_plate!r} passes {self.subsample_kwarg}=... itself; do not pass it to run()"
            )
        whole = describe_call(self.model, args, kwargs)
        if self.chunk_plate not in whole.plates:
            raise ValueError(
                f"chunk_plate {self.chunk_plate!r} is not a plate of the model; its plates: {list(whole.plates)}"
            )
        full_size = whole.plates[self.chunk_plate].size
        P = whole.max_plate_nesting if self.max_plate_nesting is None else self.max_plate_nesting
        structure = []
        described = {}  # each chunk's call is described once, also when it is rebuilt for posterior quantities

        def build(indices: torch.Tensor, fixed: dict | None) -> FactorGraph:
            kw = dict(kwargs)
            kw[self.subsample_kwarg] = indices
            key = (int(indices[0]), len(indices))
            graph = _in_float64(
                build_factor_graph(
                    self.model,
                    self.guide,
                    args,
                    kw,
                    num_samples=self.num_samples,
                    max_plate_nesting=P,
                    fixed=fixed,
                    structure=described.get(key),
                )
            )
            described[key] = graph.structure
            if not structure:
                structure.append(separators(graph))
            return graph

        graph, passes, log_normalizer, estimate = run_chunked(
            build,
            plate_name=self.chunk_plate,
            full_size=full_size,
            chunk_size=self.chunk_size,
            guided=self.guide is not None,
            max_tensor_bytes=self.max_tensor_bytes,
        )
        return graph, passes, log_normalizer, estimate, structure[0]

    @property
    def graph(self) -> FactorGraph:
        """The factor graph of the last :meth:`run` (samples, index variables, packed factors)."""
        if self._graph is None:
            raise RuntimeError("call .run(*args, **kwargs) first")
        return self._graph

    @property
    def contraction_estimate(self) -> ContractionEstimate:
        """Sizes (elements) of the largest factor and largest intermediate tensor of the last run."""
        self.graph  # noqa: B018 - raises before run
        return self._estimate

    @property
    def latent_sites(self) -> tuple[str, ...]:
        """Names of the model's latent sites (sampled or enumerated), in model order."""
        return tuple(self.graph.sites)

    @property
    def proposal_samples(self) -> dict[str, torch.Tensor]:
        """The ``K`` samples of each latent site, ``{site: (K, *site_shape)}`` (the support for enumerated sites,
        with size-1 plate dims)."""
        return {name: self.graph.to_natural(site, site.value) for name, site in self.graph.sites.items()}

    def _site(self, name: str) -> SiteSamples:
        site = self.graph.sites.get(name)
        if site is None:
            raise KeyError(f"{name!r} is not a latent site of the model; latent sites: {list(self.graph.sites)}")
        return site

    # ------------------------------------------------------------------------------------------------------ results
    def get_log_normalizer(self) -> torch.Tensor:
        r"""``log P̂``, the log of the massively parallel estimate of :math:`p(x)` (0-dim tensor).

        :math:`E[\hat P] = p(x)` without subsampling, hence :math:`E[\log \hat P] \le \log p(x)`."""
        self.graph  # noqa: B018
        return self._log_normalizer.to(self._dtype)

    def _chunk_plate(self, plates: tuple[str, ...]) -> str | None:
        return self.chunk_plate if self.chunk_plate in plates else None

    def _source_passes(self, make: Callable[[FactorGraph, Pass], list[tuple]]) -> dict:
        """Run ``make(graph, pass)`` -> ``[(key, leaf, factor, finish)]`` on every pass, differentiate ``log P̂`` at
        the zero-valued source factors, and return ``{key: finish(grad)}``, concatenating the chunks of a plate
        along ``finish``'s axis (``finish(grad) -> (tensor, axis or None)``)."""
        results: dict = {}
        for p in self._passes:
            graph, factors = p.materialise()
            items = make(graph, p)
            if not items:
                continue
            leaves = [leaf for _, leaf, _, _ in items]
            with torch.enable_grad():
                log_p = log_contract(
                    factors + [f for _, _, f, _ in items], p.sum_dims, p.scales, segments=graph.segments
                )
                grads = torch.autograd.grad(log_p, leaves, allow_unused=True)
            for (key, leaf, _, finish), grad in zip(items, grads):
                results.setdefault(key, []).append(finish(torch.zeros_like(leaf) if grad is None else grad))
        out = {}
        for key, pieces in results.items():
            axis = pieces[0][1]
            out[key] = pieces[0][0] if len(pieces) == 1 or axis is None else torch.cat([t for t, _ in pieces], axis)
        return out

    @staticmethod
    def _scale(graph: FactorGraph, p: Pass, plates: tuple[str, ...]) -> float:
        """The power to which the pass's contraction raises a factor in ``plates`` (a source term's gradient is
        that times the posterior quantity)."""
        return graph.effective_scale(plates, p.scales)

    def _moment_item(
        self, graph: FactorGraph, p: Pass, name: str, fn: Callable | None, key, centred: bool = False
    ) -> tuple:
        site = graph.sites[name]
        value = site.value
        dtype = graph.dtype
        if not value.is_floating_point():
            value = value.to(dtype)
        out = value if fn is None else fn(value)
        batch_dims = value.dim() - site.event_dim
        if not isinstance(out, torch.Tensor) or out.dim() < batch_dims:
            raise ValueError(
                f"fn must map the value of {name!r} to a tensor with the same batch dims (elementwise over samples "
                f"and plate elements); got {type(out).__name__} "
                f"{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}"
            )
        out = out.to(dtype)
        out_event = tuple(out.shape[batch_dims:])
        source = torch.zeros(tuple(site.batch_shape) + out_event, dtype=dtype, device=out.device, requires_grad=True)
        term = source * out
        if out_event:
            term = term.sum(tuple(range(-len(out_event), 0)))
        index = graph.indices[site.index]
        packed = graph.pack(term, site.plates, (index.dim,), what=f"moments of {name!r}")
        chunk = self._chunk_plate(site.plates)
        axis = None if chunk is None else len(site.batch_shape) + graph.dim(chunk)
        scale = self._scale(graph, p, site.plates)
        ordinal = graph.ordinal(site.plates)
        factor = Factor(f"moments of {name}", packed, ordinal)
        if not centred:
            return key, source, factor, lambda g: (g / scale, axis)
        # the plain average of the K samples per element: the weighted one less it is the control-variate correction
        plain = _natural(out.detach().mean(0), source.dim()).expand(source.shape)
        return key, source, factor, lambda g: (g / scale - plain, axis)

    def _marginal_item(self, graph: FactorGraph, p: Pass, symbol: str) -> tuple:
        index = graph.indices[symbol]
        leaf = graph.zeros([symbol], index.plates, graph.dtype).requires_grad_()
        natural = graph.natural_shape(index.plates)
        chunk = self._chunk_plate(index.plates)
        axis = None if chunk is None else 1 + len(natural) + graph.dim(chunk)
        scale = self._scale(graph, p, index.plates)
        return (
            ("index", symbol),
            leaf,
            Factor(f"marginal of {symbol}", leaf, graph.ordinal(index.plates)),
            lambda g: ((g / scale).reshape((index.size, *natural)), axis),
        )

    def _compute_marginals(self) -> None:
        def make(graph: FactorGraph, p: Pass) -> list[tuple]:
            items = [self._marginal_item(graph, p, symbol) for symbol in p.indices]
            items += [self._moment_item(graph, p, name, None, ("site", name)) for name in p.sites]
            return items

        results = self._source_passes(make)
        self._marginals = {key: t for (kind, key), t in results.items() if kind == "index"}
        self._means = {key: t for (kind, key), t in results.items() if kind == "site"}

    def marginal_weights(self, site: str) -> torch.Tensor:
        r"""Marginal importance weights :math:`w^k = P(k_{\text{site}} = k \mid x)` of the site's ``K`` samples, per
        plate element: shape ``(K, *batch_shape)``, summing to 1 over the first dim.

        For an enumerated site these are the exact posterior probabilities of its support points. Sites that share
        their samples (an autoguide's auxiliary site) share their weights."""
        s = self._site(site)
        if self._marginals is None:
            self._compute_marginals()
        w = self._marginals[s.index].to(self._dtype)
        batch = torch.broadcast_shapes(w.shape[1:], s.batch_shape)
        w = w.reshape((w.shape[0], *(1,) * (len(batch) - w.dim() + 1), *w.shape[1:]))
        return w.expand((w.shape[0], *batch))

    def get_ESS(self, site: str) -> torch.Tensor:
        r"""Effective sample size :math:`1 / \sum_k (w^k)^2` of the site's marginal weights, per plate element."""
        w = self.marginal_weights(site)
        return 1.0 / w.pow(2).sum(0)

    def moments(
        self,
        site: str,
        fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        *,
        proposal_draws: int = 0,
    ) -> torch.Tensor:
        r"""Posterior expectation :math:`E[fn(z) \mid x]` per plate element, ``fn`` defaulting to the identity.

        Computed as :math:`\partial \log \hat P(J) / \partial J` at :math:`J = 0` with the source factor
        :math:`J \cdot fn(z)` added to the site's log factor: the self-normalised estimate
        :math:`\sum_k w^k f(z^k)`, :math:`w^k` the marginal weights. ``fn`` must act elementwise over the leading
        (sample and plate) dims of the value; the result has shape ``(*batch_shape, *fn_event_shape)`` (e.g. the
        site's value shape for the identity).

        **Control variate** (``proposal_draws = M > 0``). The plain average :math:`\bar f = \frac1K \sum_k
        f(z^k)` of the same samples estimates the proposal's own mean :math:`E_q[f]`, which ``M`` draws of the guide
        alone (no model run) estimate far more precisely, :math:`\hat m_q`; the estimate is then

        .. math::

            \hat E[f] = \hat m_q + \sum_k w^k f(z^k) - \bar f
                      = \hat m_q + \sum_k \big(w^k - \tfrac1K\big) f(z^k),

        consistent as the self-normalised one is (the two added terms have the same expectation), and with a
        variance of order :math:`\operatorname{Var}_q\big((K w - 1) f\big)/K` in place of
        :math:`\operatorname{Var}_q(K w f)/K`: far smaller where the weights are nearly uniform, i.e. where the
        proposal is close and the posterior only tilts it. That is the case of the globals of a fitted guide over
        many groups, whose variational optimum is shifted by the summed ELBO gaps of the groups (a shift fixed in
        the globals' units, so growing as :math:`\sqrt N` in posterior sds): on a hierarchical logistic regression
        with :math:`10^4` groups (``benchmarks/crossover.py``) a fitted :class:`~pyro_hier.AutoBranchGuide`'s
        global mean is 0.19 sd off; single runs with ``K = 64`` and ``M = 4096`` put it 0.08-0.12 sd off (the
        self-normalised estimate 0.27-0.32), the mean of four runs 0.05. A run's own scatter, about 0.06-0.08 sd a
        coordinate there and at :math:`10^3` groups, is what to weigh against the bias it removes. Where the weights
        are far from uniform (a poor proposal; a group's own effect with few samples) it gains little and adds
        :math:`\hat m_q`'s error, :math:`\operatorname{sd}_q / \sqrt M`. Needs a guide (the proposal's draws are the
        guide's); not for enumerated sites.

        Example::

            mp = MPImportance(model, guide, num_samples=64).run(x, y)
            mp.moments("theta", proposal_draws=4096)   # the globals' posterior mean, corrected from the guide's

        Reference: A. B. Owen, *Monte Carlo theory, methods and examples*, 2013, ch. 8-9 (control variates and
        self-normalised importance sampling)."""
        self._site(site)
        if isinstance(proposal_draws, bool) or not isinstance(proposal_draws, int) or proposal_draws < 0:
            raise ValueError(f"proposal_draws must be a non-negative int, got {proposal_draws!r}")
        if proposal_draws:
            return self._controlled_moments(site, fn, proposal_draws)
        if fn is None:
            if self._means is None:
                self._compute_marginals()
            return self._means[site].to(self._dtype)
        results = self._source_passes(
            lambda graph, p: [self._moment_item(graph, p, site, fn, site)] if site in p.sites else []
        )
        return results[site].to(self._dtype)

    def _controlled_moments(self, site: str, fn: Callable | None, num_draws: int) -> torch.Tensor:
        """:meth:`moments` with the proposal's mean as a control variate (see there)."""
        if self.guide is None:
            raise ValueError(
                "proposal_draws needs a guide: the control variate's proposal mean comes from the guide's draws "
                "(with guide=None the proposal is the prior); pass the guide to MPImportance, or proposal_draws=0"
            )
        if self.graph.indices[self.graph.sites[site].index].enumerated:
            raise ValueError(f"{site!r} is enumerated (its moments are exact sums): use proposal_draws=0")
        correction = self._source_passes(
            lambda graph, p: [self._moment_item(graph, p, site, fn, site, centred=True)] if site in p.sites else []
        )[site]
        return (self._proposal_mean(site, fn, num_draws, correction.shape) + correction).to(self._dtype)

    def _proposal_mean(self, name: str, fn: Callable | None, num_draws: int, shape: torch.Size) -> torch.Tensor:
        """The guide's own mean of ``fn(site)`` per element, as ``shape``, from ``num_draws`` draws of the guide alone
        (vectorised, at most :data:`PROPOSAL_DRAWS_CHUNK` a call; with ``chunk_plate``, chunk by chunk of the plate
        for a site in it, the first chunk's call for the others)."""
        assert self._call is not None
        args, kwargs = self._call
        site = self.graph.sites[name]
        dim = -self.graph.max_plate_nesting - 1
        calls, axis = [kwargs], None
        if self.chunk_plate is not None:
            assert self.chunk_size is not None
            full = describe_call(self.model, args, kwargs).plates[self.chunk_plate].size
            starts = range(0, full, self.chunk_size) if self._chunk_plate(site.plates) is not None else [0]
            calls = [{**kwargs, self.subsample_kwarg: torch.arange(s, min(s + self.chunk_size, full))} for s in starts]
            axis = len(site.batch_shape) + self.graph.dim(self.chunk_plate)
        pieces = []
        for kw in calls:
            total, done = 0.0, 0
            while done < num_draws:
                size = min(PROPOSAL_DRAWS_CHUNK, num_draws - done)
                with (
                    torch.no_grad(),
                    poutine.block(),
                    poutine.trace() as tr,
                    pyro.plate("_mp_proposal_draws", size, dim=dim),
                ):
                    self.guide(*args, **kw)
                node = tr.trace.nodes.get(name)
                if node is None or node["type"] != "sample":
                    raise ValueError(f"the guide has no sample site {name!r} to draw the proposal's mean from")
                value = node["value"].to(self.graph.dtype)
                total = total + _natural((value if fn is None else fn(value)).to(self.graph.dtype).sum(0), len(shape))
                done += size
            pieces.append(total / num_draws)
        mean = pieces[0] if len(pieces) == 1 else torch.cat(pieces, axis)
        return mean.expand(shape)

    # ------------------------------------------------------------------------------------------------------ samples
    def _prepare_sampler(self) -> None:
        P = self.graph.max_plate_nesting
        order, sep = self._structure

        def make(graph: FactorGraph, p: Pass) -> list[tuple]:
            items = []
            for v in order:
                if v not in p.indices:
                    continue
                index = graph.indices[v]
                leaf = graph.zeros([v, *sep[v]], index.plates, graph.dtype).requires_grad_()
                chunk = self._chunk_plate(index.plates)
                axis = None if chunk is None else 1 + len(sep[v]) + P + graph.dim(chunk)
                items.append(
                    (
                        v,
                        leaf,
                        Factor(f"joint of {v}", leaf, graph.ordinal(index.plates)),
                        self._conditional(graph, index, len(sep[v]), axis),
                    )
                )
            return items

        self._sampler = (order, sep, self._source_passes(make))

    def _conditional(self, graph: FactorGraph, index, num_sep: int, axis: int | None) -> Callable:
        """From the gradient of a joint source term to ``P(k_v | k_sep)`` as ``(size, *sep sizes, *P plate dims)``
        (normalised over ``k_v``, so the pass's scale does not matter)."""
        P = graph.max_plate_nesting
        plate_shape = [1] * P
        for plate in index.plates:
            plate_shape[P + graph.dim(plate)] = graph.size(plate)

        def finish(grad: torch.Tensor) -> tuple[torch.Tensor, int | None]:
            joint = grad.clamp(min=0)
            total = joint.sum(0, keepdim=True)
            cond = torch.where(total > 0, joint / total.clamp(min=torch.finfo(joint.dtype).tiny), 1.0 / index.size)
            return cond.reshape(tuple(cond.shape[: 1 + num_sep]) + tuple(plate_shape)), axis

        return finish

    def _index_probs(self, v: str, draws: dict[str, torch.Tensor], num_samples: int) -> torch.Tensor:
        """``P(k_v | k_sep(v))`` at the drawn separator indices: ``(S, *plates_v, size_v)``."""
        _, sep, conditionals = self._sampler
        graph = self.graph
        P = graph.max_plate_nesting
        cond = conditionals[v].movedim(0, -1)  # (*sep sizes, *plates, size)
        plate_shape = cond.shape[len(sep[v]) : len(sep[v]) + P]
        dims = {p: graph.dim(p) for p in graph.plates}
        mine = graph.indices[v].plates
        # a separator drawn per element of a plate that v's plates are gathered into: each element of v's plates
        # takes the draw of the element it belongs to
        index = tuple(graph.gathered.pull(draws[u], graph.indices[u].plates, mine, dims) for u in sep[v])
        for j, size in enumerate(plate_shape):
            shape = [1] * (P + 1)
            shape[1 + j] = size
            index += (torch.arange(size, device=cond.device).reshape(shape),)
        probs = cond[index] if index else cond
        return probs.expand((num_samples, *plate_shape, cond.shape[-1]))

    def _draw_indices(self, num_samples: int) -> dict[str, torch.Tensor]:
        if self._sampler is None:
            self._prepare_sampler()
        order = self._sampler[0]
        draws: dict[str, torch.Tensor] = {}
        for v in order:
            probs = self._index_probs(v, draws, num_samples)
            draws[v] = torch.distributions.Categorical(probs=probs).sample()
        return draws

    def _site_indices(self, site: SiteSamples, draw: torch.Tensor) -> torch.Tensor:
        """Draws ``(S, *P plate dims)`` of the site's index variable, at the site's batch shape."""
        P = self.graph.max_plate_nesting
        S, batch = draw.shape[0], tuple(site.batch_shape)
        return draw.expand((S, *(1,) * (P - len(batch)), *batch)).reshape((S, *batch))

    def _index_layout(self, v: str, site: SiteSamples, k: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_site_indices`: a site's index draws as ``(S, *P plate dims)`` of its index variable."""
        P = self.graph.max_plate_nesting
        batch = tuple(site.batch_shape)
        k = k.reshape((k.shape[0], *(1,) * (P - len(batch)), *batch))
        own = {P + self.graph.dim(p) for p in self.graph.indices[v].plates}
        for j in range(P):
            if j not in own and k.shape[1 + j] != 1:
                k = k.narrow(1 + j, 0, 1)
        return k

    def sample_indices(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""Joint draws of sample indices :math:`\mathbf k \sim P(\mathbf k \mid x)`, by ancestral sampling from the
        source-term conditionals: ``{site: LongTensor (num_samples, *batch_shape)}`` (sites sharing samples share
        indices)."""
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        draws = self._draw_indices(num_samples)
        return {name: self._site_indices(site, draws[site.index]) for name, site in self.graph.sites.items()}

    def log_prob_indices(self, indices: Mapping[str, torch.Tensor]) -> torch.Tensor:
        r"""``log P(k | x)`` of joint index draws (as returned by :meth:`sample_indices`), shape ``(num_samples,)``:
        the log probability with which :meth:`sample_indices` draws them."""
        graph = self.graph
        if self._sampler is None:
            self._prepare_sampler()
        order = self._sampler[0]
        draws = {}
        for v in order:
            site = graph.sites[graph.indices[v].sites[0]]
            draws[v] = self._index_layout(v, site, indices[site.name])
        total = 0.0
        for v in order:
            probs = self._index_probs(v, draws, draws[v].shape[0])
            lp = probs.gather(-1, draws[v].unsqueeze(-1)).squeeze(-1).log()
            total = total + lp.reshape(lp.shape[0], -1).sum(-1)
        return total

    def sample_posterior(self, num_samples: int) -> dict[str, torch.Tensor]:
        r"""Joint posterior samples of every latent site, ``{site: (num_samples, *site_shape)}``, drawn by ancestral
        sampling of the sample indices (see :meth:`sample_indices`). The dict can be passed to
        ``pyro.infer.Predictive(model, posterior_samples=...)`` (with the same plate subsample, if any)."""
        indices = self.sample_indices(num_samples)
        out = {}
        for name, site in self.graph.sites.items():
            samples = self.graph.to_natural(site, site.value)  # (K, *batch, *event)
            samples = samples.expand((samples.shape[0], *site.batch_shape, *samples.shape[1 + len(site.batch_shape) :]))
            k = indices[name]
            k = k.reshape(tuple(k.shape) + (1,) * site.event_dim).expand((k.shape[0], *samples.shape[1:]))
            out[name] = samples.gather(0, k)
        return out


#: guide draws per vectorised call when estimating a proposal's mean (:meth:`MPImportance.moments`)
PROPOSAL_DRAWS_CHUNK = 256


def _natural(tensor: torch.Tensor, ndim: int) -> torch.Tensor:
    """A tensor in the model's layout (size-1 dims for other sites' sample indices, the plate dims, the event) with
    ``ndim`` dims (``(*batch_shape, *event)``), by its trailing dims: leading size-1 dims dropped or added."""
    while tensor.dim() > ndim:
        if tensor.shape[0] != 1:
            raise ValueError(f"cannot read a tensor of shape {tuple(tensor.shape)} with {ndim} dims")
        tensor = tensor.squeeze(0)
    return tensor.reshape((1,) * (ndim - tensor.dim()) + tuple(tensor.shape))


def _in_float64(graph: FactorGraph) -> FactorGraph:
    """Contract in float64 whatever the model's dtype. float32 log factors lose the precision the sums and their
    gradients need on large data: on MovieLens (90k ratings, log p ≈ −52,000, K = 8) the users' marginal weights
    summed to up to 1.9 in float32 and to 1 ± 1e-15 in float64. Values and samples keep the model's dtype."""
    if graph.model_dtype is None:
        graph.model_dtype = graph.dtype  # results are returned in it
    for factor in graph.factors:
        if factor.tensor.dtype != torch.float64:
            dims = factor.tensor._pyro_dims
            factor.tensor = factor.tensor.to(torch.float64)
            factor.tensor._pyro_dims = dims
    return graph

r"""A synthetic multi-species occupancy model (sites × species × visits, latent presence), exact by quadrature with
the presences summed out in closed form.

Model (``S`` sites, ``K`` species, ``V`` visits; ``x_s`` a known site covariate)::

    mu    ~ N(0, mu_scale²)                     mean occupancy logit over species        site "mu"
    beta  ~ N(0, beta_scale²)                   effect of x on occupancy                 site "beta"
    gamma ~ N(0, gamma_scale²)                  detection logit, p = σ(gamma)            site "gamma"
    a_k | mu ~ N(mu, species_scale²)            plate "species" (K, dim=-1)              site "a"
    z_sk | a, beta ~ Bernoulli(σ(a_k + beta x_s))   plates "sites" (S, dim=-2) × species  site "z" (presence)
    y_vsk | z, gamma ~ Bernoulli(z_sk p)        plates visits (V, dim=-3) × sites × species  site "y" (observed)

**What is exact.** Given ``(a_k, beta, gamma)`` the presences are independent and only the detection count
:math:`n_{sk} = \sum_v y_{vsk}` matters:

.. math::

    L_{sk} = p(y_{\cdot sk} \mid a_k, \beta, \gamma) = \psi_{sk}\, p^{n_{sk}} (1 - p)^{V - n_{sk}}
        + (1 - \psi_{sk})\, [n_{sk} = 0], \qquad
    p(z_{sk} = 1 \mid a_k, \beta, \gamma, y) = \psi_{sk}\, p^{n_{sk}} (1 - p)^{V - n_{sk}} / L_{sk}

(:meth:`OccupancyProblem.z_conditional`; a site with a detection is occupied with probability one). The species
effects are independent given the globals, so with :math:`\theta = (\mu, \beta, \gamma)`

.. math::

    p(y, \theta) = p(\theta) \prod_k \int \mathcal N(a; \mu, \sigma_a^2) \prod_s L_{sk}(a, \beta, \gamma)\, da,

a one-dimensional integral per species inside a three-dimensional one. Both are computed with the trapezoid rule,
which converges geometrically for smooth integrands that decay fast: the inner one over
:math:`a = \mu + \sigma_a t`, :math:`|t| \le 10`; the outer one on a grid in whitened coordinates around the
posterior mode (Laplace covariance from autograd), :math:`\theta = \hat\theta + L u`, :math:`|u_i| \le 10`. The
evidence, the posterior means and sds of ``mu, beta, gamma, a`` and :math:`p(z_{sk} = 1 \mid y)` all come from
these sums (float64). The tests check the closed-form sum over :math:`z` against brute-force enumeration of the Pyro
model, the quadrature against a second rule (Gauss–Hermite on the prior) and its convergence as the grids grow.

The model's ``Bernoulli(z p)`` clamps probabilities at the dtype's machine epsilon (PyTorch's ``probs_to_logits``),
so a detection at an unoccupied site costs :math:`\log \epsilon` (≈ −36 in float64) rather than −∞. The exact answers
use −∞; the difference in the evidence is below :math:`\epsilon` relative, far inside every tolerance.

Reference: D. I. MacKenzie et al., *Estimating site occupancy rates when detection probabilities are less than one*,
Ecology 83 (2002); multi-species form as in R. M. Dorazio & J. A. Royle, JASA 100 (2005).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pyro
import pyro.distributions as dist
import torch
from torch.nn.functional import logsigmoid

from .base import Moments, Problem

__all__ = ["OccupancyProblem", "occupancy", "occupancy_model"]

_REFERENCE = (
    "MacKenzie et al., Ecology 83 (2002) (occupancy with imperfect detection); multi-species random effects as in "
    "Dorazio & Royle, JASA 100 (2005). Exact answers: presences summed in closed form, species effects and globals "
    "by nested trapezoid quadrature."
)


def occupancy_model(
    y: torch.Tensor,
    *,
    x: torch.Tensor,
    mu_scale: float = 1.5,
    beta_scale: float = 1.0,
    gamma_scale: float = 1.5,
    species_scale: float = 1.0,
) -> None:
    """Multi-species occupancy with imperfect detection (see the module docstring for the maths).

    Args:
        y: ``(V, S, K)`` detections (0/1) at visit ``v``, site ``s``, species ``k``.
        x: ``(S,)`` site covariate.
        mu_scale, beta_scale, gamma_scale, species_scale: prior sds of ``mu``, ``beta``, ``gamma`` and of ``a_k``
            around ``mu``.

    Sites: ``"mu"``, ``"beta"``, ``"gamma"`` (scalars); ``"a"`` (``(K,)``, plate ``"species"``, ``dim=-1``);
    ``"z"`` (``(S, K)``, plates ``"sites"`` (``dim=-2``) and ``"species"``); ``"y"`` (observed, ``(V, S, K)``, plate
    ``"visits"`` (``dim=-3``) too). ``max_plate_nesting=3``. ``z`` can be enumerated
    (``infer={'enumerate': 'parallel'}`` via ``config_enumerate``).
    """
    num_visits, num_sites, num_species = y.shape
    zero = y.new_zeros(())
    mu = pyro.sample("mu", dist.Normal(zero, mu_scale))
    beta = pyro.sample("beta", dist.Normal(zero, beta_scale))
    gamma = pyro.sample("gamma", dist.Normal(zero, gamma_scale))
    with pyro.plate("species", num_species, dim=-1):
        a = pyro.sample("a", dist.Normal(mu, species_scale))
        with pyro.plate("sites", num_sites, dim=-2):
            z = pyro.sample("z", dist.Bernoulli(logits=a + beta * x.unsqueeze(-1)))
            with pyro.plate("visits", num_visits, dim=-3):
                pyro.sample("y", dist.Bernoulli(probs=z * torch.sigmoid(gamma)), obs=y)


@dataclass
class OccupancyProblem(Problem):
    """:class:`Problem` with the exact evidence and posterior summaries of :func:`occupancy`.

    ``moments``: ``"mu"``, ``"beta"``, ``"gamma"`` (scalars), ``"a"`` (``(K,)``) and ``"z"`` (``(S, K)``: mean
    :math:`p(z_{sk} = 1 \\mid y)`, sd :math:`\\sqrt{p(1-p)}`), all float64 on the CPU. ``truth`` holds the values the
    data were drawn with.
    """

    y: torch.Tensor | None = field(default=None, repr=False)
    x: torch.Tensor | None = field(default=None, repr=False)
    scales: dict[str, float] = field(default_factory=dict)
    truth: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    # ---- closed forms ---------------------------------------------------------------------------------------------
    def _counts(self) -> tuple[torch.Tensor, int]:
        y = self.y.detach().to(device="cpu", dtype=torch.float64)
        return y.sum(0), y.shape[0]  # n (S, K), V

    def _site_terms(
        self, a: torch.Tensor, beta: torch.Tensor, gamma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``log ψ p^n (1-p)^(V-n)`` (z = 1) and ``log p(y, z = 0) = log (1-ψ) + log [n = 0]`` for ``a (..., K)``,
        ``beta, gamma (...)``: ``(..., S, K)`` each (float64)."""
        n, v = self._counts()
        x = self.x.detach().to(device="cpu", dtype=torch.float64)
        logit = a.unsqueeze(-2) + beta[..., None, None] * x.unsqueeze(-1)
        g = gamma[..., None, None]
        present = logsigmoid(logit) + n * logsigmoid(g) + (v - n) * logsigmoid(-g)
        absent = torch.where(n == 0, logsigmoid(-logit), -math.inf)
        return present, absent

    def _site_marginal(
        self, a: torch.Tensor, beta: torch.Tensor, gamma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``log L_sk`` and ``p(z_sk = 1 | a, beta, gamma, y)``, ``(..., S, K)``; no −∞ on the way (so that autograd's
        second derivatives stay finite)."""
        n, _ = self._counts()
        present, absent = self._site_terms(a, beta, gamma)
        undetected = n == 0
        finite_absent = torch.where(undetected, absent, present)  # placeholder where the site was detected
        total = torch.where(undetected, torch.logaddexp(present, finite_absent), present)
        prob = torch.where(undetected, (present - total).exp(), 1.0)
        return total, prob

    def z_conditional(self, a: torch.Tensor, beta: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        """:math:`p(z_{sk} = 1 \\mid a_k, \\beta, \\gamma, y)` in closed form: ``a`` ``(..., K)``, ``beta`` and
        ``gamma`` ``(...)`` → ``(..., S, K)`` (float64). Equal to one wherever species ``k`` was detected at ``s``.

        Example::

            p = occupancy()
            p.z_conditional(p.truth["a"], p.truth["beta"], p.truth["gamma"])  # (S, K)
        """
        a, beta, gamma = (torch.as_tensor(t, dtype=torch.float64).cpu() for t in (a, beta, gamma))
        return self._site_marginal(a, beta, gamma)[1]

    def log_joint(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """``log p(y, mu, beta, gamma, a, z)`` without Pyro (float64), for values with one shared leading batch shape:
        ``mu, beta, gamma`` ``(...)``, ``a`` ``(..., K)``, ``z`` ``(..., S, K)``. −∞ where a detection meets
        ``z = 0``."""
        v = {k: torch.as_tensor(t, dtype=torch.float64).cpu() for k, t in values.items()}
        lp = self._log_prior_globals(v["mu"], v["beta"], v["gamma"])
        lp = lp + _normal(v["a"], v["mu"].unsqueeze(-1), self.scales["species"]).sum(-1)
        present, absent = self._site_terms(v["a"], v["beta"], v["gamma"])
        # z = 1: the occupancy term and the detections; z = 0: (1 - ψ) and no detection allowed
        per_site = torch.where(v["z"] > 0.5, present, absent)
        return lp + per_site.sum((-2, -1))

    def log_joint_globals(
        self, mu: torch.Tensor, beta: torch.Tensor, gamma: torch.Tensor, *, nodes: int = 121, half_width: float = 10.0
    ) -> torch.Tensor:
        """:math:`\\log p(y, \\mu, \\beta, \\gamma)`, with ``z`` summed out exactly and every ``a_k`` integrated by the
        trapezoid rule on ``nodes`` points over :math:`|a - \\mu| \\le` ``half_width`` ``· species_scale``;
        ``mu, beta, gamma`` ``(...)`` (float64, differentiable)."""
        t, log_w = _trapezoid(nodes, half_width)
        return self._collapse(mu, beta, gamma, t, log_w)[0]

    # ---- quadrature ---------------------------------------------------------------------------------------------
    def _log_prior_globals(self, mu, beta, gamma) -> torch.Tensor:
        s = self.scales
        return _normal(mu, 0.0, s["mu"]) + _normal(beta, 0.0, s["beta"]) + _normal(gamma, 0.0, s["gamma"])

    def _collapse(
        self,
        mu: torch.Tensor,
        beta: torch.Tensor,
        gamma: torch.Tensor,
        t: torch.Tensor,
        log_w: torch.Tensor,
        *,
        summaries: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``log p(y, θ)`` at globals ``(...)`` with ``a_k = mu + σ_a t_j`` weighted by ``exp(log_w_j)`` against the
        standard normal (``Σ_j e^{log_w_j} φ-density`` rule ``∫ φ(t) f(t) dt``); with ``summaries``, also the
        conditional moments ``E[a_k | θ, y]``, ``E[a_k² | θ, y]`` and ``p(z_sk = 1 | θ, y)``."""
        sd = self.scales["species"]
        n, v = self._counts()
        detected = (n > 0).to(torch.float64)  # (S, K)
        x = self.x.detach().to(device="cpu", dtype=torch.float64)
        a = mu.unsqueeze(-1) + sd * t  # (..., J): the effect of any species at node j
        logit = a.unsqueeze(-1) + beta[..., None, None] * x  # (..., J, S)
        g = gamma[..., None, None]
        occupied = logsigmoid(logit)
        # a detected pair contributes log ψ + n log p + (V - n) log(1 - p); an undetected one
        # log[ψ (1 - p)^V + (1 - ψ)], the same for every species at a given node: matrix products over sites
        present0 = occupied + v * logsigmoid(-g)  # (..., J, S): log ψ (1-p)^V
        undetected = torch.logaddexp(present0, logsigmoid(-logit))
        counts = (n * logsigmoid(gamma)[..., None, None] + (v - n) * logsigmoid(-gamma)[..., None, None]) * detected
        log_like = occupied @ detected + undetected @ (1 - detected) + counts.sum(-2).unsqueeze(-2)  # (..., J, K)
        log_node = log_w.unsqueeze(-1) + log_like
        log_species = torch.logsumexp(log_node, -2)  # (..., K)
        out = self._log_prior_globals(mu, beta, gamma) + log_species.sum(-1)
        if not summaries:
            return out, {}
        post = (log_node - log_species.unsqueeze(-2)).exp()  # (..., J, K): weights of a_k given θ, y
        z_undetected = (present0 - undetected).exp()  # (..., J, S)
        z = torch.einsum("...js,...jk->...sk", z_undetected, post)
        return out, {
            "a": (post * a.unsqueeze(-1)).sum(-2),
            "a2": (post * a.unsqueeze(-1).pow(2)).sum(-2),
            "z": torch.where(n > 0, 1.0, z),
        }

    def _integrate(
        self, theta: torch.Tensor, log_w: torch.Tensor, t: torch.Tensor, log_wt: torch.Tensor, chunk: int = 256
    ) -> tuple[float, dict[str, torch.Tensor]]:
        """Evidence and posterior summaries from outer nodes ``theta`` ``(M, 3)`` with log-weights ``(M,)`` and inner
        nodes ``t`` with log-weights against the standard normal."""
        logs, sums = [], []
        for start in range(0, theta.shape[0], chunk):
            th = theta[start : start + chunk]
            lj, s = self._collapse(th[:, 0], th[:, 1], th[:, 2], t, log_wt, summaries=True)
            logs.append(lj + log_w[start : start + chunk])
            sums.append({"theta": th, "theta2": th.pow(2), **s})
        log_terms = torch.cat(logs)
        log_z = torch.logsumexp(log_terms, 0)
        w = (log_terms - log_z).exp()
        out = {}
        for key in sums[0]:
            v = torch.cat([s[key] for s in sums])
            out[key] = (w.reshape((-1,) + (1,) * (v.dim() - 1)) * v).sum(0)
        return float(log_z), out

    def _mode_and_cov(self, nodes: int, half_width: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior mode of ``θ = (mu, beta, gamma)`` (z and a integrated out) and the inverse negative Hessian."""
        t, log_wt = _trapezoid(nodes, half_width)

        def neg(th: torch.Tensor) -> torch.Tensor:
            return -self._collapse(th[0], th[1], th[2], t, log_wt)[0]

        th = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([th], max_iter=200, tolerance_grad=1e-10, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = neg(th)
            loss.backward()
            return loss

        opt.step(closure)
        mode = th.detach()
        hess = torch.autograd.functional.hessian(neg, mode)
        return mode, torch.linalg.inv(hess)

    def exact_posterior(
        self,
        *,
        outer_nodes: int = 25,
        outer_half_width: float = 10.0,
        inner_nodes: int = 121,
        inner_half_width: float = 10.0,
    ) -> tuple[float, dict[str, Moments]]:
        """The log evidence and posterior :class:`Moments` (see the class docstring) by nested trapezoid quadrature:
        ``outer_nodes`` per whitened coordinate over ``|u| ≤ outer_half_width`` around the mode, ``inner_nodes`` over
        ``|t| ≤ inner_half_width`` for each species effect. The defaults give ``log_evidence``; larger grids check it.
        """
        mode, cov = self._mode_and_cov(inner_nodes, inner_half_width)
        chol = torch.linalg.cholesky(cov)
        u, log_wu = _uniform(outer_nodes, outer_half_width)
        grid = torch.cartesian_prod(u, u, u)
        log_w = torch.cartesian_prod(log_wu, log_wu, log_wu).sum(-1) + chol.diagonal().log().sum()
        theta = mode + grid @ chol.T
        t, log_wt = _trapezoid(inner_nodes, inner_half_width)
        return self._summarise(*self._integrate(theta, log_w, t, log_wt))

    def prior_gauss_hermite(self, *, outer_nodes: int = 40, inner_nodes: int = 40) -> tuple[float, dict[str, Moments]]:
        """A second route to :meth:`exact_posterior`: Gauss–Hermite rules on the *prior* of every global and every
        species effect (no mode finding, no trapezoid). Accurate only when the posterior is not much narrower than the
        prior (tiny instances); the tests compare the two there."""
        x, w = _hermite(outer_nodes)
        rules = [math.sqrt(2.0) * self.scales[k] * x for k in ("mu", "beta", "gamma")]
        theta = torch.cartesian_prod(*rules)
        log_w = torch.cartesian_prod(*[w.log() - 0.5 * math.log(math.pi)] * 3).sum(-1)
        log_w = log_w - self._log_prior_globals(theta[:, 0], theta[:, 1], theta[:, 2])  # the rule holds the prior
        xi, wi = _hermite(inner_nodes)
        t, log_wt = math.sqrt(2.0) * xi, wi.log() - 0.5 * math.log(math.pi)  # ∫ φ(t) f(t) dt
        return self._summarise(*self._integrate(theta, log_w, t, log_wt))

    def _summarise(self, log_z: float, sums: dict[str, torch.Tensor]) -> tuple[float, dict[str, Moments]]:
        mean, second = sums["theta"], sums["theta2"]
        moments = {
            name: Moments(mean[i], (second[i] - mean[i] ** 2).clamp(min=0).sqrt())
            for i, name in enumerate(("mu", "beta", "gamma"))
        }
        moments["a"] = Moments(sums["a"], (sums["a2"] - sums["a"] ** 2).clamp(min=0).sqrt())
        pz = torch.where(self._counts()[0] > 0, 1.0, sums["z"])  # exactly one where detected
        moments["z"] = Moments(pz, (pz * (1 - pz)).clamp(min=0).sqrt())
        return log_z, moments


def _normal(value, loc, scale: float) -> torch.Tensor:
    return -0.5 * ((value - loc) / scale) ** 2 - math.log(scale) - 0.5 * math.log(2 * math.pi)


def _uniform(n: int, half_width: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Trapezoid nodes and log-weights on ``[-half_width, half_width]`` (Lebesgue measure)."""
    u = torch.linspace(-half_width, half_width, n, dtype=torch.float64)
    w = torch.full((n,), 2 * half_width / (n - 1), dtype=torch.float64)
    w[0] = w[-1] = w[0] / 2
    return u, w.log()


def _trapezoid(n: int, half_width: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Trapezoid nodes for ``∫ φ(t) f(t) dt`` (``φ`` the standard normal density): log-weights include ``φ``."""
    t, log_w = _uniform(n, half_width)
    return t, log_w + _normal(t, 0.0, 1.0)


def _hermite(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss–Hermite nodes and weights of ``∫ e^{-x²} f(x) dx`` (Golub–Welsch, float64)."""
    i = torch.arange(1, n, dtype=torch.float64)
    jacobi = torch.diag(torch.sqrt(i / 2), 1) + torch.diag(torch.sqrt(i / 2), -1)
    nodes, vecs = torch.linalg.eigh(jacobi)
    return nodes, math.sqrt(math.pi) * vecs[0].pow(2)


def occupancy(
    num_sites: int = 20,
    num_species: int = 6,
    num_visits: int = 3,
    *,
    mu: float = 0.0,
    beta: float = 1.0,
    gamma: float = -0.5,
    mu_scale: float = 1.5,
    beta_scale: float = 1.0,
    gamma_scale: float = 1.5,
    species_scale: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> OccupancyProblem:
    """Data drawn from :func:`occupancy_model` at ``mu, beta, gamma`` (``a_k ~ N(mu, species_scale²)``,
    ``x_s ~ N(0, 1)``, then presences and detections; CPU float64 generator seeded with ``seed``), with the exact
    log evidence and posterior moments (see :class:`OccupancyProblem`; quadrature takes about a second at the
    default size).

    The defaults give p = σ(−0.5) ≈ 0.38 per visit, so about a quarter of the occupied site-species pairs go
    undetected in three visits and their presence is genuinely uncertain a posteriori.

    Example::

        p = occupancy(num_sites=20, num_species=6, num_visits=3)
        p.model(*p.args, **p.kwargs)                     # y: (V, S, K)
        p.log_evidence, p.moments["z"].mean.shape        # float, (20, 6)
    """
    for label, value in (("num_sites", num_sites), ("num_species", num_species), ("num_visits", num_visits)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    f64 = torch.float64
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(num_sites, generator=gen, dtype=f64)
    a = mu + species_scale * torch.randn(num_species, generator=gen, dtype=f64)
    psi = torch.sigmoid(a + beta * x.unsqueeze(-1))
    z = (torch.rand(num_sites, num_species, generator=gen, dtype=f64) < psi).to(f64)
    p_detect = torch.sigmoid(torch.tensor(gamma, dtype=f64))
    y = (torch.rand(num_visits, num_sites, num_species, generator=gen, dtype=f64) < z * p_detect).to(f64)
    scales = {"mu": mu_scale, "beta": beta_scale, "gamma": gamma_scale, "species": species_scale}
    kwargs = {
        "x": x.to(dtype=dtype, device=device),
        "mu_scale": mu_scale,
        "beta_scale": beta_scale,
        "gamma_scale": gamma_scale,
        "species_scale": species_scale,
    }
    problem = OccupancyProblem(
        name="occupancy",
        model=occupancy_model,
        args=(y.to(dtype=dtype, device=device),),
        kwargs=kwargs,
        reference=_REFERENCE,
        y=y,
        x=x,
        scales=scales,
        truth={
            "mu": torch.tensor(mu, dtype=f64),
            "beta": torch.tensor(beta, dtype=f64),
            "gamma": p_detect.logit(),
            "a": a,
            "z": z,
        },
    )
    problem.log_evidence, problem.moments = problem.exact_posterior()
    return problem

"""Exact inference in linear-Gaussian models whose prior is a linear structural equation system.

The latent vector ``w`` (length ``L``) has the prior

.. math::

    w_k = c_k + \\sum_{j<k} W_{kj} w_j + s_k \\xi_k, \\qquad \\xi_k \\sim \\mathcal N(0, 1),

so with ``B = I - W`` (unit lower triangular) the prior is ``N(m0, Σ0)`` with ``m0 = B^{-1} c``,
``Σ0 = B^{-1} diag(s²) B^{-T}`` and precision ``Q0 = B^T diag(1/s²) B`` (``det B = 1``). Observations are

.. math::

    y = A w + o + ε, \\qquad ε \\sim \\mathcal N(0, \\operatorname{diag}(r)),

with ``A`` of shape ``(M, L)`` (dense or sparse COO), offset ``o`` (default 0) and noise variances ``r``.

Everything is computed in the information form in latent space: the posterior precision is
``Q = Q0 + A^T R^{-1} A`` and, with ``e = y - o - A m0``, ``u = A^T R^{-1} e``,

- posterior mean ``m0 + Q^{-1} u`` and covariance ``Q^{-1}``;
- ``log p(y) = -M/2 log 2π - 1/2 [Σ log r + Σ log s² + logdet Q] - 1/2 [e^T R^{-1} e - u^T Q^{-1} u]``
  (matrix determinant lemma and Woodbury identity for ``A Σ0 A^T + R``).

The cost is ``O(L³ + M L²)`` for a dense ``A`` and ``O(L³ + nnz(A)·k)`` for a sparse ``A`` with at most ``k``
non-zeros per row; the ``M × M`` marginal covariance is never formed (except in :meth:`dense_log_evidence`, a
brute-force check meant for tests). See e.g. Bishop, *Pattern Recognition and Machine Learning* (2006), §2.3.3.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .base import Moments, Problem

__all__ = ["LinearGaussianProblem", "LinearGaussianSystem"]


def _matvec(A: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if A.is_sparse:
        return torch.sparse.mm(A, v.unsqueeze(-1)).squeeze(-1)
    return A @ v


class LinearGaussianSystem:
    """Prior ``w = c + W w + diag(s) ξ`` and likelihood ``y = A w + offset + N(0, diag(r))``, solved exactly.

    Args:
        c: ``(L,)`` intercepts of the structural equations.
        W: ``(L, L)`` strictly lower-triangular coefficients (latents in topological order).
        s: ``(L,)`` prior standard deviations (all positive).
        A: ``(M, L)`` observation matrix, a dense tensor or a sparse COO tensor.
        r: ``(M,)`` observation noise variances (all positive).
        offset: optional ``(M,)`` known offset added to ``A w``.
        sites: optional ordered mapping ``name -> shape`` splitting ``w`` (row-major) into Pyro sites; the sizes must
            add up to ``L``. Used by :meth:`unflatten`, :meth:`flatten` and :meth:`moments`.

    All computations are done in float64 whatever the dtype of the inputs.
    """

    def __init__(
        self,
        c: torch.Tensor,
        W: torch.Tensor,
        s: torch.Tensor,
        A: torch.Tensor,
        r: torch.Tensor,
        offset: torch.Tensor | None = None,
        sites: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        f64 = torch.float64
        self.c = c.to(f64)
        self.W = W.to(f64)
        self.s = s.to(f64)
        self.A = A.to(f64).coalesce() if A.is_sparse else A.to(f64)
        self.r = r.to(f64)
        L = self.c.shape[0]
        M = self.r.shape[0]
        if self.W.shape != (L, L) or self.s.shape != (L,) or tuple(self.A.shape) != (M, L):
            raise ValueError(
                f"inconsistent shapes: c {tuple(c.shape)}, W {tuple(W.shape)}, s {tuple(s.shape)}, "
                f"A {tuple(A.shape)}, r {tuple(r.shape)}"
            )
        if torch.any(torch.triu(self.W) != 0):
            raise ValueError("W must be strictly lower triangular (latents in topological order)")
        if torch.any(self.s <= 0) or torch.any(self.r <= 0):
            raise ValueError("s and r must be positive")
        self.offset = torch.zeros(M, dtype=f64, device=self.r.device) if offset is None else offset.to(f64)
        self.num_latents = L
        self.num_obs = M
        self.sites: dict[str, tuple[int, ...]] = {} if sites is None else {k: tuple(v) for k, v in sites.items()}
        if sites is not None and sum(math.prod(v) for v in self.sites.values()) != L:
            raise ValueError("the site sizes must add up to the number of latents")

        eye = torch.eye(L, dtype=f64, device=self.c.device)
        self.B = eye - self.W
        self.prior_mean = torch.linalg.solve_triangular(
            self.B, self.c.unsqueeze(-1), upper=False, unitriangular=True
        ).squeeze(-1)
        self.prior_precision = self.B.T @ (self.B / self.s.pow(2).unsqueeze(-1))
        self.posterior_precision = self.prior_precision + self._at_rinv_a()
        self._chol = torch.linalg.cholesky(self.posterior_precision)

    # ----------------------------------------------------------------------------------------------- linear algebra
    def _at_rinv_a(self) -> torch.Tensor:
        """``A^T R^{-1} A`` as a dense ``(L, L)`` tensor."""
        A = self.A
        if A.is_sparse:
            idx, val = A.indices(), A.values()
            scaled = torch.sparse_coo_tensor(idx, val / self.r[idx[0]], A.shape, check_invariants=False)
            with warnings.catch_warnings():  # torch warns that its sparse (CSR) kernels used here are in beta
                warnings.simplefilter("ignore", UserWarning)
                return torch.sparse.mm(A.t().coalesce(), scaled.coalesce()).to_dense()
        return A.T @ (A / self.r.unsqueeze(-1))

    def _at(self, v: torch.Tensor) -> torch.Tensor:
        """``A^T v``."""
        return _matvec(self.A.t().coalesce() if self.A.is_sparse else self.A.T, v)

    def _residual(self, y: torch.Tensor) -> torch.Tensor:
        y = y.to(torch.float64)
        if y.shape != (self.num_obs,):
            raise ValueError(f"y must have shape ({self.num_obs},), got {tuple(y.shape)}")
        return y - self.offset - _matvec(self.A, self.prior_mean)

    # -------------------------------------------------------------------------------------------------- the answers
    @property
    def prior_cov(self) -> torch.Tensor:
        """``Σ0 = B^{-1} diag(s²) B^{-T}``."""
        Binv = torch.linalg.solve_triangular(
            self.B,
            torch.eye(self.num_latents, dtype=torch.float64, device=self.B.device),
            upper=False,
            unitriangular=True,
        )
        return (Binv * self.s.pow(2)) @ Binv.T

    def log_evidence(self, y: torch.Tensor) -> torch.Tensor:
        """Exact ``log p(y)`` in the information form (0-dim float64 tensor)."""
        e = self._residual(y)
        u = self._at(e / self.r)
        Qinv_u = torch.cholesky_solve(u.unsqueeze(-1), self._chol).squeeze(-1)
        logdet_q = 2.0 * torch.log(torch.diagonal(self._chol)).sum()
        logdet = torch.log(self.r).sum() + torch.log(self.s.pow(2)).sum() + logdet_q
        quad = (e * e / self.r).sum() - (u * Qinv_u).sum()
        return -0.5 * self.num_obs * math.log(2 * math.pi) - 0.5 * logdet - 0.5 * quad

    def posterior_mean(self, y: torch.Tensor) -> torch.Tensor:
        """Exact ``E[w | y]``, shape ``(L,)``."""
        u = self._at(self._residual(y) / self.r)
        return self.prior_mean + torch.cholesky_solve(u.unsqueeze(-1), self._chol).squeeze(-1)

    def posterior_cov(self, y: torch.Tensor | None = None) -> torch.Tensor:
        """Exact ``Cov[w | y] = Q^{-1}``, shape ``(L, L)`` (it does not depend on the value of ``y``)."""
        return torch.cholesky_inverse(self._chol)

    def posterior_sd(self, y: torch.Tensor | None = None) -> torch.Tensor:
        """Exact posterior standard deviations, shape ``(L,)``."""
        return torch.diagonal(self.posterior_cov()).sqrt()

    def dense_log_evidence(self, y: torch.Tensor) -> torch.Tensor:
        """Brute-force ``log p(y)`` with the ``M × M`` covariance ``A Σ0 A^T + R`` (for tests on small problems)."""
        A = self.A.to_dense() if self.A.is_sparse else self.A
        cov = A @ self.prior_cov @ A.T + torch.diag(self.r)
        loc = A @ self.prior_mean + self.offset
        mvn = torch.distributions.MultivariateNormal(loc, covariance_matrix=cov)
        return mvn.log_prob(y.to(torch.float64))

    def log_joint(self, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``log p(w) + log p(y | w)`` from the structural equations (no matrix inversion)."""
        w = w.to(torch.float64)
        Normal = torch.distributions.Normal
        prior = Normal(self.c + self.W @ w, self.s).log_prob(w).sum()
        lik = Normal(_matvec(self.A, w) + self.offset, self.r.sqrt()).log_prob(y.to(torch.float64)).sum()
        return prior + lik

    # -------------------------------------------------------------------------------------------- site bookkeeping
    def unflatten(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a ``(L,)`` vector into ``{site: value}`` at the shapes given by ``sites``."""
        out, start = {}, 0
        for name, shape in self.sites.items():
            size = math.prod(shape)
            out[name] = w[start : start + size].reshape(shape)
            start += size
        return out

    def flatten(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`unflatten` (values are broadcast to the site shapes)."""
        return torch.cat([values[k].expand(shape).reshape(-1).to(torch.float64) for k, shape in self.sites.items()])

    def moments(self, y: torch.Tensor) -> dict[str, Moments]:
        """Exact posterior mean and sd of each site, at the site shapes."""
        mean = self.unflatten(self.posterior_mean(y))
        sd = self.unflatten(self.posterior_sd())
        return {k: Moments(mean[k], sd[k]) for k in self.sites}


@dataclass
class LinearGaussianProblem(Problem):
    """:class:`Problem` whose exact answers come from a :class:`LinearGaussianSystem` ``system`` over all latents,
    with flattened observations ``y_flat`` (``system.sites`` maps each latent site to its full shape)."""

    system: LinearGaussianSystem | None = field(default=None, repr=False)
    y_flat: torch.Tensor | None = field(default=None, repr=False)

    def posterior_mean(self) -> dict[str, torch.Tensor]:
        """Exact posterior means, ``{site: tensor at the site's shape}``."""
        return self.system.unflatten(self.system.posterior_mean(self.y_flat))

    def posterior_cov(self) -> torch.Tensor:
        """Exact joint posterior covariance of the flattened latents (order and shapes of ``system.sites``)."""
        return self.system.posterior_cov()

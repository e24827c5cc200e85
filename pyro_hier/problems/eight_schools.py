"""Eight schools (Rubin 1981) in posteriordb's centered and non-centered forms, with posteriordb's reference posterior.

posteriordb models ``eight_schools_centered`` / ``eight_schools_noncentered``::

    mu     ~ Normal(0, 5)
    tau    ~ HalfCauchy(5)
    theta_j ~ Normal(mu, tau)                                   (centered; the funnel)
    theta_trans_j ~ Normal(0, 1),  theta_j = mu + tau * theta_trans_j    (non-centered)
    y_j    ~ Normal(theta_j, sigma_j),   j = 1..8

Both define the same posterior over ``(mu, tau, theta)``; posteriordb uses one reference posterior for both
(10,000 Stan NUTS draws; BSD-3-Clause; cite Magnusson, Bürkner & Vehtari, "posteriordb").
"""

from __future__ import annotations

from collections.abc import Callable

import pyro
import pyro.distributions as dist
import torch

from pyro_hier.datasets import load_eight_schools, reference_moments
from pyro_hier.problems.base import Moments, Problem

__all__ = ["eight_schools"]


def _make_model(centered: bool, num_schools: int) -> Callable:
    def model(
        sigma: torch.Tensor, y: torch.Tensor | None = None, subsample: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Eight schools; ``subsample`` (optional LongTensor of school indices) minibatches the schools plate."""
        zero = sigma.new_zeros(())
        mu = pyro.sample("mu", dist.Normal(zero, 5.0 * sigma.new_ones(())))
        tau = pyro.sample("tau", dist.HalfCauchy(5.0 * sigma.new_ones(())))
        with pyro.plate("schools", num_schools, dim=-1, subsample=subsample) as idx:
            if centered:
                theta = pyro.sample("theta", dist.Normal(mu, tau))
            else:
                theta_trans = pyro.sample("theta_trans", dist.Normal(zero, sigma.new_ones(())))
                theta = pyro.deterministic("theta", mu + tau * theta_trans)
            return pyro.sample("y", dist.Normal(theta, sigma[idx]), obs=None if y is None else y[idx])

    return model


def eight_schools(
    *,
    centered: bool = True,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> Problem:
    """Eight schools with posteriordb's reference posterior moments.

    Args:
        centered: ``True`` for posteriordb's ``eight_schools_centered`` (latent ``theta``), ``False`` for
            ``eight_schools_noncentered`` (latent ``theta_trans``, deterministic site ``theta``).
        dtype: floating dtype of the data tensors (the model follows the data's dtype).
        device: device of the data tensors.

    Returns:
        A :class:`~pyro_hier.problems.base.Problem` whose model is ``model(sigma, y=None, subsample=None)``
        (``args=(sigma,)``, ``kwargs={"y": y}``), with sites ``"mu"`` (), ``"tau"`` (), ``"theta"`` (8,) and, when
        non-centered, ``"theta_trans"`` (8,), all in plate ``"schools"`` (8, dim -1) except ``mu`` and ``tau``;
        observed site ``"y"`` (8,). ``moments`` holds posteriordb's reference means and sds for every one of these
        latent (and deterministic) sites; ``log_evidence`` is ``None``.
    """
    df = load_eight_schools()
    sigma = torch.tensor(df["sigma"].to_numpy(copy=True), dtype=dtype, device=device)
    y = torch.tensor(df["y"].to_numpy(copy=True), dtype=dtype, device=device)
    shapes: dict[str, tuple[int, ...]] = {"mu": (), "tau": (), "theta": (len(df),)}
    if not centered:
        shapes["theta_trans"] = (len(df),)
    ref = reference_moments("pdb_eight_schools", shapes)
    moments = {
        site: Moments(
            mean=torch.as_tensor(v["mean"], dtype=dtype, device=device),
            sd=torch.as_tensor(v["sd"], dtype=dtype, device=device),
        )
        for site, v in ref.items()
    }
    form = "centered" if centered else "noncentered"
    reference = (
        "posteriordb reference posterior eight_schools-eight_schools_noncentered (Stan NUTS, 10 chains, 10,000 "
        "thinned draws, run by the posteriordb authors; BSD-3-Clause; Magnusson, Bürkner & Vehtari, 'posteriordb'), "
        "data/reference/pdb_eight_schools.json. Data: Rubin (1981)."
    )
    return Problem(
        name=f"eight_schools_{form}",
        model=_make_model(centered, len(df)),
        args=(sigma,),
        kwargs={"y": y},
        log_evidence=None,
        moments=moments,
        reference=reference,
    )

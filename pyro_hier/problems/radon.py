"""Minnesota radon with county effects and a contextual floor effect (the Inference Gym's radon model).

The model is the Inference Gym target ``radon_contextual_effects_minnesota`` (and its ``_halfnormal`` variant), so
that its posterior can be checked against the Inference Gym ground truth shipped in ``data/reference/``::

    county_effect_mean                    ~ Normal(0, 1)
    county_effect_scale, log_radon_scale  ~ Uniform(0, 100)        [prior="halfnormal": HalfNormal(1)]
    weight (3,)                           ~ Normal(0, 1)
    county_effect[j]                      ~ Normal(county_effect_mean, county_effect_scale),   j = 1..85
    log_radon[i]                          ~ Normal(county_effect[county[i]] + weight[0] * log_uranium[i]
                                                   + weight[1] * which_floor[i] + weight[2] * floor_by_county[i],
                                                   log_radon_scale),                           i = 1..919

Data: ``data/radon_mn_igym/`` (US EPA survey, public domain; Gelman & Hill 2007; Inference Gym preparation,
Apache-2.0, © 2020 The TensorFlow Probability Authors).

Subsampling counties
--------------------
``model(..., subsample=idx)`` keeps only the counties ``idx`` in the ``"counties"`` plate and, in the ``"homes"``
plate, only the homes of those counties. The log likelihood is a sum over counties of per-county sums over their
homes, ``sum_j L_j``, so the unbiased estimate from a uniform random subset of ``m`` of the ``J`` counties is
``(J / m) * sum_{j in idx} L_j``: the homes must be scaled by ``J / m`` like their counties, *not* by
``num_homes / len(homes in idx)`` (which is what a ``"homes"`` plate subsampled by itself would apply, and which
is biased because counties have 1 to 116 homes). The model applies the correction factor with
:func:`pyro.poutine.scale`. The estimate is unbiased but its variance is large when few counties are drawn,
because the per-county sums differ a lot in size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine

from pyro_hier.datasets import load_radon_mn, reference_moments
from pyro_hier.local_data import GroupedData
from pyro_hier.plates import gathered_rows
from pyro_hier.problems.base import Moments, Problem

__all__ = ["RADON_SITE_SHAPES", "radon_mn"]

_NUM_COUNTIES = 85
_NUM_HOMES = 919

RADON_SITE_SHAPES: dict[str, tuple[int, ...]] = {
    "county_effect_mean": (),
    "county_effect_scale": (),
    "log_radon_scale": (),
    "weight": (3,),
    "county_effect": (_NUM_COUNTIES,),
}
"""Full shapes of the latent sites of :func:`radon_mn`'s model (without particle dimensions)."""

_ATTRIBUTION = {
    "uniform": "radon_contextual_effects_minnesota",
    "halfnormal": "radon_contextual_effects_minnesota_halfnormal",
}


def _make_model(prior: str, num_counties: int) -> Callable:
    def model(
        county: torch.Tensor,
        log_uranium: torch.Tensor,
        which_floor: torch.Tensor,
        floor_by_county: torch.Tensor,
        log_radon: torch.Tensor | None = None,
        subsample: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Radon model; ``subsample`` (optional LongTensor of distinct county indices) minibatches counties."""
        num_homes = county.shape[-1]
        zero = log_uranium.new_zeros(())
        one = log_uranium.new_ones(())

        def scale_prior() -> dist.TorchDistribution:
            if prior == "uniform":
                return dist.Uniform(zero, 100.0 * one)
            return dist.HalfNormal(one)

        county_effect_mean = pyro.sample("county_effect_mean", dist.Normal(zero, one))
        county_effect_scale = pyro.sample("county_effect_scale", scale_prior())
        log_radon_scale = pyro.sample("log_radon_scale", scale_prior())
        weight = pyro.sample("weight", dist.Normal(zero, one).expand([3]).to_event(1))

        with pyro.plate("counties", num_counties, dim=-1, subsample=subsample):
            county_effect = pyro.sample("county_effect", dist.Normal(county_effect_mean, county_effect_scale))

        sel = gathered_rows(county, num_counties, subsample)
        homes, local_county, correction = sel.rows, sel.group, sel.scale

        def select(x: torch.Tensor) -> torch.Tensor:
            return x if homes is None else x[..., homes]

        loc = (
            county_effect[..., local_county]
            + weight[..., 0] * select(log_uranium)
            + weight[..., 1] * select(which_floor)
            + weight[..., 2] * select(floor_by_county)
        )
        with pyro.plate("homes", num_homes, dim=-1, subsample=homes), poutine.scale(scale=correction):
            return pyro.sample(
                "log_radon",
                dist.Normal(loc, log_radon_scale),
                obs=None if log_radon is None else select(log_radon),
            )

    return model


def _home_covariates(county, log_uranium, which_floor, floor_by_county, log_radon=None, subsample=None):
    """Each home's covariates ``(homes, 3)``: floor, log uranium, floor by county (full size; the guides select the
    homes of a call)."""
    return torch.stack([which_floor, log_uranium, floor_by_county], -1)


def radon_mn(
    *,
    prior: Literal["uniform", "halfnormal"] = "uniform",
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> Problem:
    """Minnesota radon, 919 homes in 85 counties, with the Inference Gym's ground-truth posterior moments.

    Args:
        prior: prior of ``county_effect_scale`` and ``log_radon_scale``: ``"uniform"`` = Uniform(0, 100)
            (Inference Gym ``radon_contextual_effects_minnesota``) or ``"halfnormal"`` = HalfNormal(1)
            (``radon_contextual_effects_minnesota_halfnormal``).
        dtype: floating dtype of the data tensors (the model follows the data's dtype).
        device: device of the data tensors.

    Returns:
        A :class:`~pyro_hier.problems.base.Problem` whose model is
        ``model(county, log_uranium, which_floor, floor_by_county, log_radon=None, subsample=None)`` (``args`` holds
        the first four, ``kwargs`` holds ``log_radon``). Latent sites and shapes: see :data:`RADON_SITE_SHAPES`;
        observed site ``"log_radon"`` (919,). Plates: ``"counties"`` (85, dim -1; may be subsampled) and
        ``"homes"`` (919, dim -1; follows the county subsample), so ``max_plate_nesting=1``. ``moments`` holds the
        Inference Gym reference means and sds (CmdStan NUTS, 10 chains × 20,000 draws, run by the Inference Gym
        authors; Monte Carlo error of the means about 4e-4 for the global sites); ``log_evidence`` is ``None``.

    Example::

        p = radon_mn(prior="halfnormal")
        trace = pyro.poutine.trace(p.model).get_trace(*p.args, **p.kwargs)
        p.moments["weight"].mean  # tensor([ 0.71, -0.71,  0.40], dtype=torch.float64) approximately
    """
    if prior not in _ATTRIBUTION:
        raise ValueError(f"prior must be 'uniform' or 'halfnormal', got {prior!r}")
    df = load_radon_mn("igym")
    num_counties = int(df["county"].max()) + 1

    def as_float(column: str) -> torch.Tensor:
        return torch.as_tensor(df[column].to_numpy(copy=True), dtype=dtype, device=device)

    county = torch.as_tensor(df["county"].to_numpy(copy=True), dtype=torch.long, device=device)
    args = (county, as_float("log_uranium"), as_float("floor"), as_float("floor_by_county"))

    name = f"igym_radon_mn_{prior}"
    ref = reference_moments(name, RADON_SITE_SHAPES)
    moments = {
        site: Moments(
            mean=torch.as_tensor(v["mean"], dtype=dtype, device=device),
            sd=torch.as_tensor(v["sd"], dtype=dtype, device=device),
        )
        for site, v in ref.items()
    }
    reference = (
        f"Inference Gym ground truth for {_ATTRIBUTION[prior]} (CmdStan NUTS, 10 chains x 20,000 draws, run by "
        "the Inference Gym authors; Apache-2.0, (c) 2020 The TensorFlow Probability Authors), "
        f"data/reference/{name}.json. Data: US EPA radon survey via Gelman & Hill (2007), Inference Gym preparation."
    )
    return Problem(
        name=f"radon_mn_{prior}",
        model=_make_model(prior, num_counties),
        args=args,
        kwargs={"log_radon": as_float("log_radon")},
        log_evidence=None,
        # each home's covariates, for guides that encode a county from its homes (the observation is log radon)
        local_features=_home_covariates,
        # each county's homes as ragged rows (floor, log radon; log uranium is a county-level covariate)
        local_data={
            "counties": GroupedData(
                torch.stack([as_float("floor"), as_float("log_radon"), as_float("log_uranium")], -1),
                county,
                num_groups=num_counties,
            )
        },
        moments=moments,
        reference=reference,
    )

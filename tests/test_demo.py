import subprocess
import sys

from pyro_hier.demo import DEMO_GUIDES


def test_demo_command_prints_the_table_and_writes_the_plot(tmp_path):
    out = tmp_path / "demo.png"
    result = subprocess.run(
        [sys.executable, "-m", "pyro_hier", "demo", "--quick", "--steps", "20", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("problem"))
    for column in ("guide", "ELBO", "gap", "seconds", "params"):
        assert column in lines[header]
    rows = [
        line
        for line in lines[header + 2 :]
        if line.startswith(("regression", "radon")) and "MPImportance" not in line and "not applicable" not in line
    ]
    # a guide that needs what a model lacks says so instead of a row: the deep-set encoder needs observations
    # nested in the group plate, which radon's homes are not
    skipped = [line for line in lines if "not applicable" in line and "MPImportance" not in line]
    assert len(skipped) == 1 and skipped[0].startswith("radon (Minnesota) · PAVI deepset: not applicable")
    assert "encoder='free'" in skipped[0]
    assert len(rows) == 2 * len(DEMO_GUIDES) - 1
    for name in DEMO_GUIDES:
        assert sum(name in row for row in rows) >= (1 if name == "PAVI deepset" else 2)
    # columns from the right: params, seconds, sd ratio, mean err, gap; regression has an exact gap, radon a dash
    assert all(row.split()[-5] != "—" for row in rows if row.startswith("regression"))
    assert out.exists() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(row.split()[-5] == "—" for row in rows if row.startswith("radon"))
    # MPImportance's log-evidence with the best guide as proposal, beside that guide's ELBO
    mp_lines = [line for line in lines if "MPImportance" in line]
    assert len(mp_lines) == 2 and "log p̂" in mp_lines[0] and "exact log p(y)" in mp_lines[0]
    # radon's homes index county effects from another plate: a clear refusal, not a wrong number
    assert "not applicable" in mp_lines[1] and "'counties'" in mp_lines[1]

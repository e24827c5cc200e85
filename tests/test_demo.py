import dataclasses
import itertools
import math
import subprocess
import sys
import time

import pyro
import pytest
import torch

from pyro_hier import AutoBranchGuide
from pyro_hier.demo import DEMO_GUIDES, fit_guide
from pyro_hier.problems import synthetic_regression


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
    # every guide runs on radon as written (homes gathering their county's effect): no "not applicable" row
    assert not [line for line in lines if "not applicable" in line and "MPImportance" not in line]
    assert len(rows) == 2 * len(DEMO_GUIDES)
    for name in DEMO_GUIDES:
        assert sum(name in row for row in rows) >= 2
    # columns from the right: params, seconds, sd ratio, mean err, gap; regression has an exact gap, radon a dash
    assert all(row.split()[-5] != "—" for row in rows if row.startswith("regression"))
    assert out.exists() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(row.split()[-5] == "—" for row in rows if row.startswith("radon"))
    # MPImportance's log-evidence with the best guide as proposal, beside that guide's ELBO
    mp_lines = [line for line in lines if "MPImportance" in line]
    assert len(mp_lines) == 2 and "log p̂" in mp_lines[0] and "exact log p(y)" in mp_lines[0]
    # radon's homes read county effects from another plate by index: summed into the counties, an estimate too
    assert mp_lines[1].startswith("radon") and "log p̂" in mp_lines[1] and "exact" not in mp_lines[1]


def _tiny_regression():
    return synthetic_regression(num_groups=12, dtype=torch.float64)


def test_fit_guide_with_a_time_budget_runs_until_the_budget_is_spent_on_the_drawn_minibatches():
    p = _tiny_regression()
    generator = torch.Generator().manual_seed(0)
    drawn, model_calls = [], []

    def draw() -> torch.Tensor:
        drawn.append(torch.randperm(12, generator=generator)[:4])
        return drawn[-1]

    def model(*args, subsample=None, **kwargs):
        model_calls.append((len(drawn), subsample))
        return p.model(*args, subsample=subsample, **kwargs)

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # a process's first optimiser imports parts of torch
    guide, losses, spent = fit_guide(
        dataclasses.replace(p, model=model),
        lambda q: AutoBranchGuide(q.model, conditional="linear"),  # no references to make: quick on a loaded machine
        seconds=1.0,
        num_particles=1,
        subsample=draw,
    )
    assert isinstance(guide, AutoBranchGuide)
    assert spent >= 1.0 and len(losses) == len(drawn) >= 2 and all(math.isfinite(v) for v in losses)
    # the guide is built on all groups; then every model call of step k (replayed by the guide or run by the ELBO)
    # gets the indices drawn for that step
    assert all(s is None for k, s in model_calls if k == 0) and model_calls[0][0] == 0
    stepped = [(k, s) for k, s in model_calls if k > 0]
    assert {k for k, _ in stepped} == set(range(1, len(drawn) + 1))
    assert all(s is drawn[k - 1] for k, s in stepped)


def test_fit_guide_decays_the_rate_with_the_fraction_of_the_budget_spent(monkeypatch):
    p = _tiny_regression()
    created = []
    original = pyro.optim.ClippedAdam

    def clipped_adam(*args, **kwargs):
        created.append(original(*args, **kwargs))
        return created[-1]

    monkeypatch.setattr(pyro.optim, "ClippedAdam", clipped_adam)
    factors, clock = [], []

    def progress(step: int, loss: float) -> None:
        clock.append(time.perf_counter())
        (optim,) = created
        f = [
            g["lr"] / g.get("initial_lr", g["lr"])
            for o in optim.optim_objs.values()
            for g in o.param_groups
            if g["params"][0].grad is not None  # (the guide's state parameters get no gradient and no step)
        ]
        assert max(f) - min(f) < 1e-12, "every parameter follows the same schedule"
        factors.append(f[0])

    # the linear conditional: its first step makes no references, so a loaded machine still fits several steps
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # a process's first optimiser imports parts of torch
    budget, ratio = 1.0, 0.1
    _, losses, spent = fit_guide(
        p,
        lambda q: AutoBranchGuide(q.model, conditional="linear"),
        seconds=budget,
        lr=0.05,
        final_lr_ratio=ratio,
        progress=progress,
    )
    assert len(factors) == len(losses) >= 3 and factors[0] == 1.0
    assert all(a > b for a, b in itertools.pairwise(factors)), "the rate decays with the time spent"
    # the last step started with s = budget · log(f) / log(ratio) seconds spent: before the budget ran out, and
    # at most the wall time of that step (which includes it) before the end
    started = budget * math.log(factors[-1]) / math.log(ratio)
    assert started < budget <= spent
    assert started >= spent - (clock[-1] - clock[-2]) - 1e-9


def test_fit_guide_needs_exactly_one_of_steps_and_seconds():
    p = _tiny_regression()

    def make(q):
        return AutoBranchGuide(q.model)

    for kwargs in (
        {},
        {"steps": 5, "seconds": 1.0},
        {"steps": 0},
        {"seconds": -1.0},
        {"steps": 2, "subsample": 3},
        {"steps": 2, "average_last": 1.0},
        {"steps": 2, "average_last": -0.1},
    ):
        with pytest.raises(ValueError, match="fit_guide"):
            fit_guide(p, make, **kwargs)


def test_fit_guide_returns_the_average_of_the_last_iterates():
    p = _tiny_regression()
    seen = []

    def progress(step: int, loss: float) -> None:
        seen.append({k: v.detach().clone() for k, v in pyro.get_param_store().named_parameters()})

    _, losses, _ = fit_guide(
        p, lambda q: AutoBranchGuide(q.model), steps=10, average_last=0.3, num_particles=1, progress=progress
    )
    assert len(seen) == len(losses) == 10
    # the iterates after steps 8, 9 and 10 (the last 30%) are averaged, in unconstrained space
    final = dict(pyro.get_param_store().named_parameters())
    assert final.keys() == seen[0].keys() and len(final) > 0
    for name in seen[0]:
        if ".references." in name or ".averages." in name:  # the guide's state: not an iterate, not averaged
            continue
        expected = sum(s[name] for s in seen[7:]) / 3
        assert torch.allclose(final[name], expected, atol=1e-12), name
        assert not torch.allclose(expected, seen[-1][name]), name

"""Multi-process data-parallel training: the documented example (``tutorials/distributed_training.py``) launched
with 2 CPU processes (gloo, 127.0.0.1 only), checked against a single-process run of the same steps.

DDP applies, on every step, the average of the ranks' gradients, i.e. the gradient of ``(1/R) Σ_r L_r`` where
``L_r`` is the negative ELBO estimate of rank ``r``'s minibatch (plate scale ``N / B``) with rank ``r``'s seed. The
single-process reference evaluates exactly those ``R`` losses in turn — the union of the ranks' minibatches, each
half with the seed its rank used — averages them, and takes one ``pyro_hier.optim.LazyAdam`` step. In float64 the
two runs then agree to rounding: per-step losses, final parameters and buffers. The test also checks that both
replicas end bitwise identical, that the ranks' minibatches are disjoint, that a step sends the dense gradients of the
globals and networks (DDP, counted by its communication hook) and only the rank's own rows of the per-group parameters
(a sparse all-reduce), and — for the per-group parameters of ``AutoBranchGuide`` — that exactly the groups of the ranks'
minibatches moved (the guide honours each rank's own subsample indices). A last test runs the example the other
documented way, under torchrun (``python -m torch.distributed.run``), also on 127.0.0.1, with ``torch.optim.Adam``
(every gradient dense through DDP, the old way).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pyro
import pytest
import torch
from pyro.infer import Trace_ELBO

from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide
from pyro_hier.optim import LazyAdam
from pyro_hier.problems import synthetic_regression
from pyro_hier.sparse import element_dims

SCRIPT = Path(__file__).resolve().parents[1] / "tutorials" / "distributed_training.py"
N, OBS, DIM, BATCH, STEPS, SEED = 48, 5, 2, 6, 3, 0  # 3 steps × 2 ranks × 6 groups: 36 of 48 groups visited
LR, NETWORK_LR = 0.02, 1e-3
FEATURE_NET, PARAM_NET = (8, 4), (16,)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """Run the example as documented, with 2 processes and both guides in one launch (one start-up cost)."""
    out = tmp_path_factory.mktemp("ddp")
    command = [sys.executable, str(SCRIPT), "--nproc", "2", "--guide", "branch", "amortized"]
    command += ["--groups", str(N), "--obs", str(OBS), "--dim", str(DIM), "--batch-size", str(BATCH)]
    command += ["--steps", str(STEPS), "--dtype", "float64", "--seed", str(SEED), "--save", str(out)]
    command += ["--lr", str(LR), "--network-lr", str(NETWORK_LR)]
    command += ["--feature-net", ",".join(map(str, FEATURE_NET)), "--param-net", ",".join(map(str, PARAM_NET))]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.count("  True") == 2, done.stdout  # the summary's "replicas identical" column
    return out


def make_guide(kind: str, problem) -> AutoBranchGuide:
    if kind == "branch":
        return AutoBranchGuide(problem.model, conditional="linear")  # (the conjugate form keeps per-process state)
    return AutoAmortizedBranchGuide(
        problem.model, local_features=problem.local_features, feature_net=FEATURE_NET, param_net=PARAM_NET
    )


def single_process(kind: str, problem, ranks: dict[int, dict]) -> dict:
    """The reference: one process, one guide, each step the mean of the ranks' losses (their batches and seeds)."""
    with pyro.settings.context(module_local_params=True):
        pyro.set_rng_seed(SEED)
        guide = make_guide(kind, problem)
        loss_fn = Trace_ELBO()(problem.model, guide)
        loss_fn(*problem.args, subsample=ranks[0]["setup_batch"])  # rank 0's first batch, as DDP broadcasts rank 0
        initial = {k: v.detach().clone() for k, v in loss_fn.state_dict().items()}
        nets = {id(p) for p in guide.nets.parameters()} if kind == "amortized" else set()
        state = {id(p) for p in guide.state_parameters().values()}  # no gradient: not optimised
        groups = [{"params": [p for p in guide.parameters() if id(p) not in nets | state], "lr": LR}]
        if nets:
            groups.append({"params": [p for p in guide.parameters() if id(p) in nets], "lr": NETWORK_LR})
        optim = LazyAdam(groups)
        losses, first_grads = [], {}
        for step in range(STEPS):
            per_rank = []
            for r in sorted(ranks):
                pyro.set_rng_seed(ranks[r]["seeds"][step])
                per_rank.append(loss_fn(*problem.args, subsample=ranks[r]["batches"][step]))
            optim.zero_grad()
            torch.stack(per_rank).mean().backward()
            if step == 0:  # every parameter got a gradient, so DDP's find_unused_parameters=False is right
                assert all(p.grad is not None for p in loss_fn.parameters() if id(p) not in state)
                first_grads = {
                    k: p.grad.detach().to_dense().clone() for k, p in loss_fn.named_parameters() if id(p) not in state
                }
            optim.step()
            losses.append([loss.item() for loss in per_rank])
        # what a rank sends per step: every dense gradient (DDP), and the indices and values of its own rows of the
        # per-group parameters (the sparse all-reduce)
        nbytes = 0
        for p in guide.parameters():
            if id(p) in state:
                continue
            rows = element_dims(p)
            if rows is None:
                nbytes += p.numel() * p.element_size()
            else:
                row_numel = p[(0,) * rows].numel()
                nbytes += BATCH * (row_numel * p.element_size() + rows * 8)
        final = {k: v.detach().clone() for k, v in loss_fn.state_dict().items()}
    return {"initial": initial, "final": final, "losses": losses, "first_grads": first_grads, "bytes": nbytes}


@pytest.mark.parametrize("kind", ["branch", "amortized"])
def test_two_processes_match_single_process_training(kind, launched):
    ranks = {r: torch.load(launched / kind / f"rank{r}.pt", weights_only=False) for r in (0, 1)}

    # replicas: bitwise identical at the start (DDP broadcast rank 0's parameters and buffers) and at the end
    for key in ("initial", "state"):
        assert ranks[0][key].keys() == ranks[1][key].keys()
        for name, value in ranks[0][key].items():
            assert torch.equal(value, ranks[1][key][name]), f"{key} '{name}' differs between the replicas"

    # each rank drew its own minibatch: disjoint, full size, within the groups
    for step in range(STEPS):
        a, b = ranks[0]["batches"][step], ranks[1]["batches"][step]
        assert len(a) == len(b) == BATCH and not set(a.tolist()) & set(b.tolist())
        assert ranks[0]["seeds"][step] != ranks[1]["seeds"][step]

    problem = synthetic_regression(num_groups=N, num_obs=OBS, dim=DIM, seed=SEED, dtype=torch.float64)
    ref = single_process(kind, problem, ranks)
    initial, final, losses = ref["initial"], ref["final"], ref["losses"]

    # the documented seeding reproduces rank 0's initial state (parameters and the amortized input statistics)
    assert initial.keys() == ranks[0]["initial"].keys()
    for name, value in initial.items():
        assert torch.equal(value, ranks[0]["initial"][name]), f"initial '{name}' differs from the reference"
    # the gradient DDP applied on the first step is the gradient of the mean of the ranks' losses (Adam alone would
    # hardly tell a mean from a sum, so this is checked directly), every step's losses and the result agree with the
    # single-process run to float64 rounding
    assert ranks[0]["first_grads"].keys() == ref["first_grads"].keys()
    for name, grad in ref["first_grads"].items():
        torch.testing.assert_close(ranks[0]["first_grads"][name], grad, rtol=1e-12, atol=1e-14, msg=name)
        assert torch.equal(ranks[0]["first_grads"][name], ranks[1]["first_grads"][name])
    for r in (0, 1):
        got = torch.tensor(ranks[r]["losses"], dtype=torch.float64)
        want = torch.tensor([step[r] for step in losses], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    moved = False
    for name, value in final.items():
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=1e-10, atol=1e-12, msg=name)
        moved |= not torch.equal(value, initial[name])
    assert moved, "training did not change any parameter"

    # a step sends every dense gradient and the rank's own rows of the per-group parameters, not all N rows
    assert ranks[0]["bytes_per_step"] == ranks[1]["bytes_per_step"] == ref["bytes"]
    if kind == "branch":
        names = [f"guide.{kind}.groups_unconstrained" for kind in ("locs", "scale_trils", "weights")]
        assert ranks[0]["element_parameters"] == names
        assert ref["bytes"] < 0.3 * sum(v.numel() * v.element_size() for v in final.values())
    else:
        assert ranks[0]["element_parameters"] == []

    if kind == "branch":  # the per-group rows that moved are exactly the groups of the ranks' minibatches
        seen = torch.zeros(N, dtype=torch.bool)
        for r in (0, 1):
            for idx in ranks[r]["batches"]:
                seen[idx] = True
        assert 0 < int(seen.sum()) < N
        for name, value in final.items():
            if value.dim() and value.shape[0] == N:  # per-group parameters: (N, 1, ...) rows
                changed = (value != initial[name]).reshape(N, -1).any(-1)
                assert torch.equal(changed, seen), f"'{name}': rows that moved are not the minibatches' groups"


def test_the_example_runs_under_torchrun():
    """The documented ``torchrun --nproc_per_node 2`` route (``python -m torch.distributed.run`` is the same program),
    on 127.0.0.1 with a free port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(port), str(SCRIPT)]
    command += ["--groups", "24", "--obs", "3", "--dim", "2", "--batch-size", "4", "--steps", "2"]
    command += ["--optimizer", "adam"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    assert "2 processes × 4 groups" in done.stdout and done.stdout.rstrip().endswith("True"), done.stdout

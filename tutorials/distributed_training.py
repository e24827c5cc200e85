"""Data-parallel training of a pyro-hier guide over several processes: ``torch.distributed`` with
``DistributedDataParallel`` (DDP), each process on its own minibatch of groups.

Run (CPU, gloo backend, loopback only)::

    python tutorials/distributed_training.py --nproc 2                        # starts 2 processes itself
    torchrun --standalone --nproc_per_node 2 tutorials/distributed_training.py
    python tutorials/distributed_training.py --nproc 2 --guide branch amortized   # both guides, one after the other

``--help`` lists the options (problem size, batch size, steps, dtype, and ``--save DIR``, which writes every rank's
initial and final state, first averaged gradient, minibatches, seeds and losses). Under ``torchrun`` the process
group comes from its environment variables and ``--nproc`` is ignored; otherwise the script picks a free port on
127.0.0.1 and starts ``--nproc`` workers with ``torch.multiprocessing`` (forked where the OS allows it, so they do
not import torch again; spawned otherwise). At the end rank 0 prints, per guide, the distance of the fitted posterior
means from the exact ones, the parameter count, the bytes all-reduced per step and whether the replicas agree.

The pattern (Pyro's ``ELBOModule`` route, as in Pyro's ``examples/svi_lightning.py``, plus local latents):

1. ``pyro.settings.set(module_local_params=True)`` in every process: the guide's ``PyroParam``\\ s are then
   ordinary ``nn.Parameter``\\ s of the guide module, not entries of Pyro's global param store, so DDP and a
   ``torch.optim`` optimiser see them.
2. A ``DataLoader`` over the *group indices* ``0..N-1`` with a ``DistributedSampler``: each rank draws its own
   disjoint minibatch of groups on every step (``sampler.set_epoch`` reshuffles per epoch).
3. The model subsamples its group plate with those indices, ``pyro.plate("groups", N, subsample=idx)``; pyro-hier's
   guides read the model's own indices on every call (no ``create_plates`` needed), so each rank's per-group
   parameters are sliced to its minibatch and the amortized guide encodes exactly the groups the model observes.
4. ``loss_fn = Trace_ELBO()(model, guide)``; **one call** materialises the guide's lazily created parameters (and
   the amortized guide's input statistics, which are buffers).
5. The per-group parameters (``pyro_hier.sparse.element_parameters(loss_fn)``: ``AutoBranchGuide``'s locations,
   Cholesky factors and weights) are left out of DDP and broadcast from rank 0 by hand; then
   ``DistributedDataParallel(loss_fn)`` broadcasts rank 0's other parameters and buffers to every rank, and on every
   ``backward`` all-reduces (averages) their dense gradients.
6. ``pyro_hier.optim.LazyAdam`` reads the per-group parameters' gradients as sparse tensors holding only the rows of
   the rank's minibatch; ``pyro_hier.sparse.all_reduce_sparse_grads`` averages them over the ranks after ``backward``
   (a sparse all-reduce: each rank sends its own rows), and the optimiser updates only those rows.

What one step communicates: the dense gradient of the globals and networks (DDP), and each rank's own rows of the
per-group parameters (``B × (d + d² + d·d_anc)`` numbers for ``"dense"``, with their indices), so the traffic grows
with the minibatch, not with the number of groups. ``--optimizer adam`` shows the old way instead: ``torch.optim.Adam``
takes dense gradients only, so every parameter goes through DDP and a step all-reduces ``N × (d + d² + d·d_anc)``
numbers, all zero but the minibatches' rows. The script prints the bytes each rank sends per step (DDP's buckets,
counted by a communication hook, plus the sparse rows). Every parameter of these guides receives a gradient on every
step, so ``find_unused_parameters=False`` (the default) is correct and cheaper; a custom guide with parameters that
some steps do not use needs ``find_unused_parameters=True``. A row not in any rank's minibatch stays as it is (LazyAdam
leaves rows not seen untouched; with ``--optimizer adam`` Adam's momentum keeps moving rows seen in earlier steps).

Equivalence: with ``L_r`` the loss of rank ``r`` (its plate scale ``N / B_r``), DDP applies the gradient of
``(1/R) Σ_r L_r``: the local terms of the union of the minibatches at scale ``N / (R B)`` — the ordinary minibatch
weight of a batch of ``R B`` groups — and the global terms averaged over the ranks' ``R`` independent draws.
``tests/test_distributed.py`` runs this script with 2 processes and checks, in float64, that the replicas stay
bitwise identical and equal a single-process run that evaluates the same ``R`` halves with the same seeds.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import pyro
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from pyro.infer import Trace_ELBO
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from pyro_hier import AutoAmortizedBranchGuide, AutoBranchGuide
from pyro_hier.optim import LazyAdam
from pyro_hier.problems import synthetic_regression
from pyro_hier.sparse import all_reduce_sparse_grads, element_parameters

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes to start when not under torchrun (default 2)")
    parser.add_argument(
        "--guide", nargs="+", choices=["branch", "amortized"], default=["branch"], help="one or both (in turn)"
    )
    parser.add_argument("--covariance", choices=["dense", "block", "diagonal"], default="dense")
    parser.add_argument("--groups", type=int, default=1000, help="number of groups N (default 1000)")
    parser.add_argument("--obs", type=int, default=20, help="observations per group (default 20)")
    parser.add_argument("--dim", type=int, default=5, help="regression dimension D (default 5)")
    parser.add_argument("--batch-size", type=int, default=100, help="groups per rank per step (default 100)")
    parser.add_argument("--epochs", type=int, default=100, help="passes over the groups (default 100)")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: all epochs)")
    parser.add_argument("--lr", type=float, default=0.05, help="Adam step of the free parameters (default 0.05)")
    parser.add_argument("--network-lr", type=float, default=1e-3, help="Adam step of the networks (amortized)")
    parser.add_argument("--feature-net", default="64,64,64,128", help="feature network sizes (amortized)")
    parser.add_argument("--param-net", default="256,256,256", help="parameter network sizes (amortized)")
    parser.add_argument(
        "--optimizer",
        choices=["lazy", "adam"],
        default="lazy",
        help="lazy: pyro_hier.optim.LazyAdam, per-group rows sparse and out of DDP (default);\n"
        "adam: torch.optim.Adam, every gradient dense through DDP",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--save", type=Path, default=None, help="write DIR/<guide>/rank<r>.pt (states, batches, seeds)")
    args = parser.parse_args(argv)
    for name in ("nproc", "groups", "obs", "dim", "batch_size", "epochs", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def sizes(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(","))


def make_guide(kind: str, args: argparse.Namespace, problem) -> AutoBranchGuide:
    """The guide ``kind`` with the command line's options (the test builds its reference with the same ones)."""
    if kind == "branch":
        # the linear conditional: the conjugate one (the default) keeps per-process state (its references, refreshed
        # on each rank's own minibatches), which data-parallel replicas would not share
        return AutoBranchGuide(problem.model, covariance=args.covariance, conditional="linear")
    return AutoAmortizedBranchGuide(
        problem.model,
        covariance=args.covariance,
        local_features=problem.local_features,
        feature_net=sizes(args.feature_net),
        param_net=sizes(args.param_net),
    )


def make_optimizer(args: argparse.Namespace, guide: AutoBranchGuide) -> torch.optim.Optimizer:
    """``pyro_hier.optim.LazyAdam`` (or ``torch.optim.Adam`` with ``--optimizer adam``); the amortized guide's networks
    get ``--network-lr`` (a parameter group of their own)."""
    nets = list(guide.nets.parameters()) if isinstance(guide, AutoAmortizedBranchGuide) else []
    ids = {id(p) for p in nets} | {id(p) for p in guide.state_parameters().values()}  # (state: no gradient)
    groups = [{"params": [p for p in guide.parameters() if id(p) not in ids], "lr": args.lr}]
    if nets:
        groups.append({"params": nets, "lr": args.network_lr})
    return LazyAdam(groups) if args.optimizer == "lazy" else torch.optim.Adam(groups)


def step_seed(seed: int, step: int, rank: int, world_size: int) -> int:
    """The RNG seed of ``rank`` at ``step``: distinct per rank and step, so ranks draw independent guide samples."""
    return seed * 1_000_003 + 1 + step * world_size + rank


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """One rank (the process group is initialised): fit every guide of ``--guide`` in turn."""
    torch.set_num_threads(args.threads)
    pyro.settings.set(module_local_params=True)  # parameters live in the module, where DDP sees them
    # every rank builds the same data (a real job would load its shard of the data or memory-map it)
    problem = synthetic_regression(
        num_groups=args.groups, num_obs=args.obs, dim=args.dim, seed=args.seed, dtype=DTYPES[args.dtype]
    )
    summary = [fit(kind, rank, world_size, args, problem) for kind in args.guide]
    if rank == 0:
        print(f"\nN = {args.groups} groups, D = {args.dim}, {world_size} processes × {args.batch_size} groups a step")
        print(f"{'guide':<24}{'parameters':>12}{'sent/step (rank 0)':>20}{'ms/step':>10}  replicas identical")
        for kind, num_params, nbytes, ms, identical in summary:
            name = f"{kind} ({args.covariance})"
            print(f"{name:<24}{num_params:>12,}{nbytes:>14,} bytes{ms:>10.1f}  {identical}")
    if not all(row[-1] for row in summary):
        raise RuntimeError("the replicas' parameters differ after training")


def fit(kind: str, rank: int, world_size: int, args: argparse.Namespace, problem) -> tuple:
    """Train one guide with DDP; returns ``(kind, parameters, bytes all-reduced per step, ms/step, identical)``."""
    N = args.groups
    sampler = DistributedSampler(range(N), num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(range(N), batch_size=args.batch_size, sampler=sampler, drop_last=True)
    if len(loader) == 0:
        raise ValueError(f"--batch-size {args.batch_size} exceeds the {len(sampler)} groups each rank gets per epoch")

    setup_batch = next(iter(loader))
    pyro.set_rng_seed(args.seed)  # the same initialisation everywhere (DDP copies rank 0's state anyway)
    guide = make_guide(kind, args, problem)
    loss_fn = Trace_ELBO()(problem.model, guide)
    loss_fn(*problem.args, subsample=setup_batch)  # one call creates the guide's parameters before DDP wraps it
    # per-group parameters: out of DDP (their gradients are sparse), rank 0's values broadcast by hand
    rows = element_parameters(loss_fn) if args.optimizer == "lazy" else {}
    # the guide's state (references, call count, averages: no gradient) is not DDP's to reduce either; it stays equal
    # on every rank, which take the same steps on the same parameters
    state_ids = {id(p) for p in guide.state_parameters().values()}
    state = [name for name, p in loss_fn.named_parameters() if id(p) in state_ids and name not in rows]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(loss_fn, list(rows) + state)
    for p in rows.values():
        tdist.broadcast(p.data, src=0)
    ddp = DistributedDataParallel(loss_fn, find_unused_parameters=False)  # broadcasts rank 0's parameters, buffers
    initial = {k: v.detach().clone() for k, v in loss_fn.state_dict().items()}
    optim = make_optimizer(args, guide)  # before the first backward: LazyAdam then gets sparse gradients from step 1
    communicated = [0]

    def counting_allreduce(state, bucket):  # DDP's own averaging all-reduce, with the payload counted
        communicated[0] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_allreduce)

    total = args.epochs * len(loader) if args.steps is None else args.steps
    batches, seeds, losses, first_grads = [], [], [], {}
    if rank == 0:
        print(f"{kind} guide: {total} steps; exact -log p(y) = {-problem.log_evidence:.2f}", flush=True)
    start = time.perf_counter()
    for step in range(total):
        if step % len(loader) == 0:
            sampler.set_epoch(step // len(loader))  # a new shuffle, the same on every rank
            batch_iter = iter(loader)
        idx = next(batch_iter)
        seed = step_seed(args.seed, step, rank, world_size)
        pyro.set_rng_seed(seed)
        loss = ddp(*problem.args, subsample=idx)  # this rank's minibatch; plate scale N / len(idx)
        optim.zero_grad()
        loss.backward()  # DDP averages the dense gradients over the ranks here
        communicated[0] += all_reduce_sparse_grads(rows.values())  # and this the per-group rows
        if step == 0:
            first_grads = {
                k: p.grad.detach().to_dense().clone() for k, p in loss_fn.named_parameters() if p.grad is not None
            }
        optim.step()
        batches.append(idx)
        seeds.append(seed)
        losses.append(loss.item())
        if rank == 0 and (step % max(1, total // 10) == 0 or step == total - 1):
            print(f"  step {step:6d}  loss (rank 0) {loss.item():14.2f}", flush=True)
    ms = 1e3 * (time.perf_counter() - start) / total

    # the replicas must agree bitwise: gather every rank's flattened state and compare with rank 0's
    state = {k: v.detach().clone() for k, v in loss_fn.state_dict().items()}
    flat = torch.cat([v.reshape(-1).to(torch.float64) for v in state.values()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    tdist.all_gather(gathered, flat)
    identical = all(torch.equal(g, gathered[0]) for g in gathered)
    nbytes = communicated[0] // total
    if rank == 0:
        report_fit(guide, problem)
    if args.save is not None:
        (args.save / kind).mkdir(parents=True, exist_ok=True)
        record = {"state": state, "initial": initial, "first_grads": first_grads, "setup_batch": setup_batch}
        record.update(batches=batches, seeds=seeds, losses=losses, bytes_per_step=nbytes, world_size=world_size)
        record.update(element_parameters=sorted(rows))
        torch.save(record, args.save / kind / f"rank{rank}.pt")
    return kind, sum(p.numel() for p in ddp.parameters()), nbytes, ms, identical


@torch.no_grad()
def report_fit(guide: AutoBranchGuide, problem) -> None:
    """Distance of the fitted posterior means from the exact ones, in exact posterior sds."""
    median = guide.median(*problem.args)
    for site in ("theta", "z"):
        exact = problem.moments[site]
        err = ((median[site].to(torch.float64) - exact.mean) / exact.sd).abs()
        print(f"  {site}: |E_q - E_exact| / sd_exact median {err.median().item():.2f}, max {err.max().item():.2f}")


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Entry point of a started process: join the process group over loopback, train, leave."""
    tdist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        train(rank, world_size, args)
        tdist.barrier()  # leave together: a rank tearing down gloo while another still talks can abort the other
    finally:
        tdist.destroy_process_group()
    leave()


def leave() -> None:
    """End a rank's process without the interpreter's teardown.

    Gloo's worker threads can outlive ``destroy_process_group`` and, when the interpreter finalizes under them,
    abort the process ("terminate called without an active exception", SIGABRT) after all work is done; it
    happened on a loaded 2-core CI machine. Everything is finished and flushed here, so the rank exits with 0.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:  # under torchrun: one process per rank
        tdist.init_process_group("gloo")
        try:
            train(tdist.get_rank(), tdist.get_world_size(), args)
            tdist.barrier()  # leave together (see worker)
        finally:
            tdist.destroy_process_group()
        leave()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    # fork where the OS has it (the workers inherit the imported modules instead of importing torch again), else spawn
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(worker, args=(args.nproc, args), nprocs=args.nproc, join=True, start_method=method)


if __name__ == "__main__":
    main()

"""DDP training with gtopk_ext's sparse gradient hook, launched by torchrun, resumable after a failure.

On one machine, 4 ranks:

    torchrun --nproc-per-node 4 examples/train_ddp.py --collective gtopk

On 2 nodes of 2 ranks each (run on each node; dense inside a node, gTop-k between nodes), restarting the workers
from the latest checkpoint if one fails:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id job1 \\
        --max-restarts 1 examples/train_ddp.py --collective hierarchical --checkpoint-dir ckpt

Every ``--checkpoint-every`` steps each rank saves the model, the optimizer and the hook's state (its residuals)
to ``--checkpoint-dir``/world<P>/ (P: the world size); a (re)started run resumes from the latest step that every
rank saved there and then continues bitwise as the uninterrupted run would. A run at another world size never
deletes or overwrites the checkpoints of the others: it starts afresh in its own folder, or with
``--on-world-size-change fold`` (or ``zero``) resumes from the latest of them (the hook's residuals are per rank:
see ``SparseGradState.load_state_dict``), and it says which. The data here are synthetic: each (step, rank) has its
own batch, so a resumed run sees the same batches. Copy this file and replace make_model() and batch() with your
own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gtopk_ext as gx

KEPT_CHECKPOINTS = 2  # per rank: a rank can be one checkpoint ahead of the others when one fails


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default after its help."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in all (a resumed run goes on "
                        "from its checkpoint's step to this one)")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per rank per step")
    parser.add_argument("--width", type=int, default=256, help="hidden width of the MLP")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD's learning rate")
    parser.add_argument("--density", type=float, default=0.01, help="fraction of each bucket a rank sends")
    parser.add_argument("--collective", default="gtopk", choices=("gtopk", "allgather", "oktopk", "hierarchical",
                                                                  "dense", "ddp"),
                        help="the hook's collective; hierarchical: dense inside a node, --inner-collective "
                             "between nodes; ddp: DDP's own allreduce, no hook")
    parser.add_argument("--path", default="auto", choices=gx.paths.MODES,
                        help="each bucket's path (gx.PathPolicy): auto takes the cheapest as measured; sparse "
                             "always compresses (after the dense start), so a rerun takes the same paths")
    parser.add_argument("--inner-collective", default="gtopk", help="between nodes, with --collective hierarchical")
    parser.add_argument("--local-size", type=int, default=None,
                        help="ranks per node for --collective hierarchical (None: torchrun's LOCAL_WORLD_SIZE)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size in MiB")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="where to save and resume from; each world size has its own subfolder "
                             "(world<P>/), so a run never touches another world size's checkpoints "
                             "(None: no checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--on-world-size-change", default="restart", choices=("restart", "fold", "zero"),
                        help="when this world size has no checkpoint but another has: restart (from step 0), or "
                             "resume from the other's latest complete step with the hook's residuals folded into "
                             "the first step or dropped (SparseGradState.load_state_dict's on_world_size_change; "
                             "reads every saved rank's file: the folder must be shared)")
    parser.add_argument("--log-every", type=int, default=50, help="steps between loss lines (0: none)")
    return parser.parse_args(argv)


def make_state(args: argparse.Namespace) -> Optional[gx.SparseGradState]:
    """The hook's state for the command line's --collective (None: DDP's own allreduce)."""
    if args.collective == "ddp":
        return None
    hierarchical = args.collective == "hierarchical"
    state = gx.SparseGradState(density=args.density, path=args.path,
                               collective=args.inner_collective if hierarchical else args.collective,
                               hierarchical=gx.Hierarchical(args.local_size) if hierarchical else None)
    state.stats_logging_frequency = 0
    return state


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def batch(step: int, rank: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic classification batch, a pure function of (step, rank)."""
    generator = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, 64, generator=generator)
    return x.to(device), (x[:, :10].argmax(dim=1)).to(device)


def world_dir(directory: Path, world_size: int) -> Path:
    """This world size's checkpoints: the hook's residuals are per rank, so a run at another world size neither
    resumes from them nor deletes them."""
    return directory / f"world{world_size}"


def checkpoint_path(directory: Path, step: int, rank: int) -> Path:
    return directory / f"step{step:08d}-rank{rank}.pt"


def save_checkpoint(directory: Path, step: int, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: Optional[gx.SparseGradState]) -> None:
    """Atomically (a rank killed while writing leaves no half file), keeping this rank's latest few in
    ``directory`` (this world size's folder only)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, step, rank)
    temporary = path.with_suffix(".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "hook": None if state is None else state.state_dict()}, temporary)
    os.replace(temporary, path)
    for old in sorted(directory.glob(f"step*-rank{rank}.pt"))[:-KEPT_CHECKPOINTS]:
        old.unlink()


def resume_step(directory: Optional[Path], rank: int, device: torch.device) -> int:
    """The latest step that every rank has a checkpoint of in ``directory`` (0: start afresh)."""
    mine = 0
    if directory is not None:
        steps = [int(p.name[4:12]) for p in directory.glob(f"step*-rank{rank}.pt")]
        mine = max(steps, default=0)
    agreed = torch.tensor([mine], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return int(agreed)


def other_world_sizes(directory: Path, world_size: int) -> list[int]:
    """The other world sizes that have checkpoints under ``directory``."""
    return sorted(int(p.name[5:]) for p in directory.glob("world*") if p.name[5:].isdigit()
                  and int(p.name[5:]) != world_size and any(p.glob("step*-rank*.pt")))


def latest_complete(directory: Path, sizes: list[int], device: torch.device) -> tuple[int, int]:
    """(step, world size): the latest step that every rank of one of ``sizes`` saved under ``directory``, the
    same on every rank of this run ((0, 0): none)."""
    found = [(0, 0)]
    for size in sizes:
        per_rank = [{int(p.name[4:12]) for p in world_dir(directory, size).glob(f"step*-rank{q}.pt")}
                    for q in range(size)]
        found.append((max(set.intersection(*per_rank), default=0), size))
    step, size = max(found)
    seen = torch.tensor([step, size, -step, -size], device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    if seen[:2].tolist() != (-seen[2:]).tolist():
        raise RuntimeError(f"the ranks see different checkpoints under {directory}: resuming at another world size "
                           f"reads every saved rank's files, so the folder must be shared by every rank")
    return step, size


def resume(args: argparse.Namespace, directory: Optional[Path], model: nn.Module, optimizer: torch.optim.Optimizer,
           state: Optional[gx.SparseGradState], device: torch.device) -> int:
    """Loads the latest checkpoint of this world size (else, by --on-world-size-change, of another) before DDP is
    built (the hook's state must be loaded before the first backward); returns its step (0: none, start afresh).
    Says on rank 0 what it did."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    start = resume_step(directory, rank, device)
    if start:
        checkpoint = torch.load(checkpoint_path(directory, start, rank), map_location=device)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if state is not None:
            state.load_state_dict(checkpoint["hook"])
        if rank == 0:
            print(f"resumed from step {start} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)})",
                  flush=True)
        return start
    if directory is None:
        return 0
    others = other_world_sizes(args.checkpoint_dir, world_size)
    if args.on_world_size_change == "restart":
        if others and rank == 0:
            print(f"not resuming from the checkpoints of world size(s) {others} in {args.checkpoint_dir} (kept as "
                  f"they are; see --on-world-size-change): starting at step 0 in {directory}", flush=True)
        return 0
    start, size = latest_complete(args.checkpoint_dir, others, device)
    if start:  # the model and the optimizer are the same on every rank: saved rank 0's
        saved = [torch.load(checkpoint_path(world_dir(args.checkpoint_dir, size), start, q), map_location=device)
                 for q in range(size)]
        model.load_state_dict(saved[0]["model"])
        optimizer.load_state_dict(saved[0]["optimizer"])
        if state is not None:
            state.load_state_dict([s["hook"] for s in saved], on_world_size_change=args.on_world_size_change)
        if rank == 0:
            residuals = "sent in the first step" if args.on_world_size_change == "fold" else "dropped"
            print(f"resumed from step {start} of world size {size} ({args.on_world_size_change}: the hook's "
                  f"residuals {residuals}); its checkpoints are kept as they are, this run's go to {directory}",
                  flush=True)
    return start


def train(args: argparse.Namespace, comm_hook: Callable = gx.sparse_grad_hook,
          wrap_state: Callable = lambda state: state,
          after_step: Optional[Callable[[int, nn.Module], None]] = None) -> nn.Module:
    """Trains ``args.steps`` steps (from the latest checkpoint, if any) and returns the model. ``comm_hook`` and
    ``wrap_state`` let a caller put its own hook around the sparse one; ``after_step(step, ddp_model)`` runs after
    every optimizer step."""
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    model = make_model(args.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = make_state(args)
    directory = None if args.checkpoint_dir is None else world_dir(args.checkpoint_dir, dist.get_world_size())
    start = resume(args, directory, model, optimizer, state, device)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    if state is not None:
        ddp.register_comm_hook(wrap_state(state), comm_hook)
    seconds = []
    for step in range(start, args.steps):
        began = time.perf_counter()
        x, y = batch(step, rank, args.batch_size, device)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - began)
        done = step + 1
        if after_step is not None:
            after_step(done, ddp)
        if directory is not None and done % args.checkpoint_every == 0:
            save_checkpoint(directory, done, rank, model, optimizer, state)
        if rank == 0 and args.log_every and done % args.log_every == 0:
            print(f"step {done}: loss {loss.item():.4f}", flush=True)
    if rank == 0 and seconds:
        print(f"{len(seconds)} steps, median step {1e3 * statistics.median(seconds[len(seconds) // 2:]):.2f} ms "
              f"(last half)", flush=True)
    if rank == 0 and state is not None:
        print(state.summary(), flush=True)
    return model


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        train(args)
    finally:
        gx.destroy_process_group()


if __name__ == "__main__":
    main()

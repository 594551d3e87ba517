"""DDP training with gtopk_ext's sparse gradient hook, launched by torchrun, resumable after a failure.

On one machine, 4 ranks:

    torchrun --nproc-per-node 4 examples/train_ddp.py --collective gtopk

On 2 nodes of 2 ranks each (run on each node; dense inside a node, gTop-k between nodes), restarting the workers
from the latest checkpoint if one fails:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id job1 \\
        --max-restarts 1 examples/train_ddp.py --collective hierarchical --checkpoint-dir ckpt

Every ``--checkpoint-every`` steps each rank saves the model, the optimizer and the hook's state (its residuals)
to ``--checkpoint-dir``; a (re)started run resumes from the latest step that every rank saved and then continues
bitwise as the uninterrupted run would. The data here are synthetic: each (step, rank) has its own batch, so a
resumed run sees the same batches. Copy this file and replace make_model() and batch() with your own.
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


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--width", type=int, default=256, help="hidden width of the MLP")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--collective", default="gtopk", choices=("gtopk", "allgather", "oktopk", "hierarchical",
                                                                  "dense", "ddp"),
                        help="ddp: DDP's own allreduce, no hook")
    parser.add_argument("--path", default="auto", choices=("auto", "sparse", "dense16", "dense"),
                        help="each bucket's path (gx.PathPolicy): auto takes the cheapest as measured; sparse "
                             "always compresses (after the dense start), so a rerun takes the same paths")
    parser.add_argument("--inner-collective", default="gtopk", help="between nodes, with --collective hierarchical")
    parser.add_argument("--local-size", type=int, default=None,
                        help="ranks per node for --collective hierarchical (default: torchrun's LOCAL_WORLD_SIZE)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=50)
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


def checkpoint_path(directory: Path, step: int, rank: int) -> Path:
    return directory / f"step{step:08d}-rank{rank}.pt"


def save_checkpoint(directory: Path, step: int, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: Optional[gx.SparseGradState]) -> None:
    """Atomically (a rank killed while writing leaves no half file), keeping this rank's latest few."""
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, step, rank)
    temporary = path.with_suffix(".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "hook": None if state is None else state.state_dict()}, temporary)
    os.replace(temporary, path)
    for old in sorted(directory.glob(f"step*-rank{rank}.pt"))[:-KEPT_CHECKPOINTS]:
        old.unlink()


def resume_step(directory: Optional[Path], rank: int, device: torch.device) -> int:
    """The latest step that every rank has a checkpoint of (0: start afresh)."""
    mine = 0
    if directory is not None:
        steps = [int(p.name[4:12]) for p in directory.glob(f"step*-rank{rank}.pt")]
        mine = max(steps, default=0)
    agreed = torch.tensor([mine], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return int(agreed)


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
    start = resume_step(args.checkpoint_dir, rank, device)
    if start:  # before DDP is built: the hook state must be loaded before the first backward
        checkpoint = torch.load(checkpoint_path(args.checkpoint_dir, start, rank), map_location=device)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if state is not None:
            state.load_state_dict(checkpoint["hook"])
        if rank == 0:
            print(f"resumed from step {start} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)})",
                  flush=True)
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
        if args.checkpoint_dir is not None and done % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint_dir, done, rank, model, optimizer, state)
        if rank == 0 and args.log_every and done % args.log_every == 0:
            print(f"step {done}: loss {loss.item():.4f}", flush=True)
    if rank == 0 and seconds:
        print(f"{len(seconds)} steps, median step {1e3 * statistics.median(seconds[len(seconds) // 2:]):.2f} ms "
              f"(last half)", flush=True)
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

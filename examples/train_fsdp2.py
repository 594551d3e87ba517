"""FSDP2 inside each node, gtopk_ext's sparse gradient exchange (with error feedback) between nodes, under torchrun.

Two nodes of two ranks each, here as two torchrun agents on one machine (on real nodes, run the same command on
each with HOST0 for localhost): each agent is a node; FSDP2 shards the model over a node's ranks, and the ranks with
the same local rank on both nodes exchange their shard's gradient sparsely (gTop-k, Gaussian-k, density 0.01):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:29400 --rdzv-id fsdp \\
        examples/train_fsdp2.py &
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:29400 --rdzv-id fsdp \\
        examples/train_fsdp2.py

One agent of 4 ranks emulating 2 nodes: ``torchrun --nproc-per-node 4 examples/train_fsdp2.py --node-size 2``.
``--mode recipe`` uses ``gx.SparseFSDPState.recipe`` (a density warm-up and the momentum in the hook: the optimizer then
has none), what low densities need. ``--mode hsdp`` trains the same with FSDP2's own HSDP (a 2-D mesh: FSDP all-reduces
the shards' gradients densely between nodes), for comparison. The task is scikit-learn's bundled handwritten digits
(nothing is downloaded); each (step, rank) has its own batch. Rank 0 prints the loss, the test accuracy, and the bytes
this rank sent to the other nodes (the sparse hook counts them; for HSDP, a ring all-reduce of its padded shards), last
as one JSON line. Copy this file and replace make_model() and the data with your own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gtopk_ext as gx
from gtopk_ext.costs import ring_allreduce_bytes


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="sparse", choices=("sparse", "recipe", "hsdp"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--width", type=int, default=256, help="hidden width of the MLP")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--collective", default="gtopk", help="between nodes: gtopk, allgather or oktopk")
    parser.add_argument("--wire", default="plain", choices=tuple(gx.wire.WIRES))
    parser.add_argument("--path", default="auto", choices=gx.paths.MODES,
                        help="each call's path (gx.PathPolicy): auto takes the cheapest as measured")
    parser.add_argument("--min-compress-numel", type=int, default=1024,
                        help="shards of fewer real elements always go dense")
    parser.add_argument("--start-iter", type=int, default=10, help="dense steps before the sparse ones")
    parser.add_argument("--warmup-steps", type=int, default=44, help="recipe: steps of the density's warm-up")
    parser.add_argument("--node-size", type=int, default=None, help="ranks per node (default: $LOCAL_WORLD_SIZE)")
    parser.add_argument("--log-every", type=int, default=100)
    return parser.parse_args(argv)


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_x, train_y, test_x, test_y) of scikit-learn's 8x8 digits, a fixed split, pixels in [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).reshape(-1, 64) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def shard(model: nn.Module, mesh) -> None:
    """Each Linear its own FSDP module (its own reduce-scatter and hook call), then the root."""
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def hsdp_bytes_per_step(model: nn.Module, node_size: int, nodes: int) -> int:
    """What HSDP's dense all-reduce sends from this rank to the other nodes in a step: a ring all-reduce over the
    nodes of this rank's float32 shard of every parameter (dim 0 padded to a multiple of the node size)."""
    numel = sum(math.ceil(p.shape[0] / node_size) * math.prod(p.shape[1:]) for p in model.parameters())
    return ring_allreduce_bytes(4 * numel, nodes)


def train(args: argparse.Namespace) -> dict:
    """Trains ``args.steps`` steps; returns rank 0's summary (every rank returns its own)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    node_size = args.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    model = make_model(args.width)
    state = None
    if args.mode != "hsdp":
        options = dict(collective=args.collective, wire=args.wire, start_iter=args.start_iter,
                       path=gx.PathPolicy(args.path, min_compress_numel=args.min_compress_numel))
        mesh = gx.fsdp.node_mesh(node_size)
        if args.mode == "recipe":
            state = gx.SparseFSDPState.recipe(mesh, args.density, args.warmup_steps, **options)
        else:
            state = gx.SparseFSDPState(mesh, density=args.density, **options)
        shard(model, state.shard_mesh)
        gx.register_sparse_all_reduce(model, state)
    else:
        mesh = init_device_mesh("cpu", (world // node_size, node_size), mesh_dim_names=("replicate", "shard"))
        shard(model, mesh)  # a 2-D mesh: FSDP2's HSDP
    nodes = world // node_size
    # With the recipe the hook applies the momentum: the optimizer must have none (checked before its first step).
    in_hook = state is not None and state.config.momentum is not None
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0 if in_hook else 0.9)
    train_x, train_y, test_x, test_y = digits()
    began, loss = time.perf_counter(), torch.zeros(())
    for step in range(args.steps):
        picked = torch.randint(len(train_y), (args.batch_size,), generator=torch.Generator().manual_seed(
            1_000_003 * step + rank))
        loss = nn.functional.cross_entropy(model(train_x[picked]), train_y[picked])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
    seconds = time.perf_counter() - began
    with torch.no_grad():
        accuracy = (model(test_x).argmax(dim=1) == test_y).float().mean().item()
    if state is not None:
        total = state.stats()["total"]
        step_bytes, run_bytes = total["bytes_sent"], total["run_bytes_sent"]
    else:
        step_bytes = hsdp_bytes_per_step(model, node_size, nodes) if nodes > 1 else 0
        run_bytes = step_bytes * args.steps
    summary = {"mode": args.mode, "nodes": nodes, "node_size": node_size, "steps": args.steps,
               "density": args.density if state else 1.0, "loss": loss.item(), "test_accuracy": accuracy,
               "cross_node_bytes_last_step": step_bytes, "cross_node_bytes_run": run_bytes, "seconds": seconds}
    if rank == 0:
        print(f"{args.mode}: test accuracy {accuracy:.3f}, this rank sent {run_bytes} bytes to other nodes "
              f"({step_bytes} in the last step) in {seconds:.1f} s", flush=True)
        print(json.dumps(summary), flush=True)
    return summary


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    try:
        train(args)
    finally:
        gx.destroy_process_group()


if __name__ == "__main__":
    main()

# Quick start: DDP with gtopk_ext's sparse gradient hook, on GPUs (NCCL) or else on the CPU (Gloo).
#   torchrun --nproc-per-node 2 examples/quickstart.py [--steps 200] [--checkpoint-dir quickstart_ckpt]
# Run it again with more --steps and it resumes from its checkpoints (same --warmup-steps).
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gtopk_ext as gx


def batch(step, rank, world, device, size=64):
    """Synthetic data: the labels a fixed random linear teacher gives random inputs. Each (step, rank) has its
    own batch, so a resumed run sees the batches the uninterrupted one would have seen."""
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(size, 32, generator=torch.Generator().manual_seed(step * world + rank))
    return x.to(device), (x @ teacher).argmax(dim=1).to(device)


def train(args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    model.to(device)
    # No momentum and no weight decay in the optimizer: the recipe's hook applies the momentum (an optimizer that
    # has it too raises before its first step).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Two dense steps, the density falling from 0.25 to 0.01 over the warm-up, Nesterov momentum in the hook.
    state = gx.SparseGradState.recipe(density=0.01, warmup_steps=args.warmup_steps)

    # One checkpoint per rank (the hook's residuals are the rank's own) in a folder per world size.
    path = os.path.join(args.checkpoint_dir, f"world{world}", f"rank{rank}.pt")
    start = 0
    if os.path.exists(path):  # the hook's state loads before the first backward (it recognises DDP's buckets)
        saved = torch.load(path, map_location=device)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["hook"])
        start = saved["step"]
        if rank == 0:
            print(f"resumed from step {start}")

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    ddp.register_comm_hook(state, gx.sparse_grad_hook)
    losses = []  # since the last print: one batch's loss is noisy
    for step in range(start, args.steps):
        x, y = batch(step, rank, world, device)
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()  # the hook exchanges the gradient's buckets while the backward pass goes on
        optimizer.step()
        losses.append(loss.detach())
        if rank == 0 and ((step + 1) % 50 == 0 or step + 1 == args.steps):
            print(f"step {step + 1}: loss {torch.stack(losses).mean().item():.3f} (mean of {len(losses)} steps)")
        if (step + 1) % 50 == 0:
            losses.clear()

    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"step": max(start, args.steps), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "hook": state.state_dict()}, path)
    if rank == 0:
        print(state.summary())  # the configuration, the bytes this rank sent, the latest step's buckets
        # DDP's allreduce (a ring) sends 2 (P - 1) / P of the float32 gradient per rank and step.
        run, numel = state.stats()["run"], sum(p.numel() for p in model.parameters())
        dense = run["steps"] * 2 * (world - 1) / world * 4 * numel
        print(f"bytes sent by this rank in {run['steps']} steps: {run['bytes_sent'] / 1e6:.2f} MB with the hook, "
              f"{dense / 1e6:.2f} MB with DDP's allreduce" + (f" ({run['bytes_sent'] / dense:.1%})" if dense else ""))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200, help="steps in all; a resumed run goes on to this one")
    parser.add_argument("--warmup-steps", type=int, default=40, help="steps of the density's warm-up")
    parser.add_argument("--checkpoint-dir", default="quickstart_ckpt",  # in .gitignore
                        help="world<P>/rank<r>.pt go here")
    args = parser.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        train(args, device)
    finally:
        gx.destroy_process_group()  # closes the hook's threads, then the process group


if __name__ == "__main__":
    main()

"""Bytes per training step of the DDP hook's collectives: dense allreduce, TopK-SGD allgather and gTop-k.

A DDP model of about 1M parameters (MLP 784-1024-256-10, DDP's default buckets) trains on P Gloo processes
with ``sparse_grad_hook``; after the dense warm-up, the hook's own counters (``state.stats()``) give the bytes
each rank sent and received in one step: exact for gTop-k's point-to-point messages, and for the backend's
allreduce and allgather what a ring algorithm moves (2(P-1)/P and (P-1) times the buffer). Header agreement
bytes (a few dozen per bucket) are included.

    python -m bench.bytes_per_step --world-sizes 4 8 --density 0.01 --json bytes_per_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from gtopk_ext.utils import destroy_process_group

COLLECTIVES = ("dense", "allgather", "gtopk")
WARMUP = 2  # the hook's dense iterations (start_iter)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))


def measure(rank: int, world_size: int, density: float, steps: int) -> dict:
    import gtopk_ext as gx
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for collective in COLLECTIVES:
        model = make_model()
        ddp = DDP(model)
        state = gx.SparseGradState(density=density, collective=collective, start_iter=WARMUP,
                                   stats_logging_frequency=0)
        ddp.register_comm_hook(state, gx.sparse_grad_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(rank)
        sent, received, seconds = [], [], []
        for step in range(WARMUP + steps):
            x, y = torch.randn(32, 784, generator=generator), torch.randint(0, 10, (32,), generator=generator)
            start = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            if step >= WARMUP:
                total = state.stats()["total"]
                sent.append(total["bytes_sent"])
                received.append(total["bytes_received"])
                seconds.append(time.perf_counter() - start)
        results[collective] = {"parameters": sum(p.numel() for p in model.parameters()),
                               "buckets": len(state.stats()["buckets"]), "k": state.stats()["total"]["k"],
                               "bytes_sent": statistics.median(sent), "bytes_received": statistics.median(received),
                               "seconds": statistics.median(seconds)}
    return results


def _worker(rank: int, world_size: int, init_file: str, measure_fn, args: tuple, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        results.put((rank, measure_fn(rank, world_size, *args)))
    finally:
        destroy_process_group()


def run_on_gloo(measure_fn, world_size: int, *args, timeout: float = 900.0) -> list:
    """``[measure_fn(rank, world_size, *args) for each rank]`` on P spawned Gloo processes; raises if one dies."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, measure_fn, args, results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        per_rank, deadline = {}, time.monotonic() + timeout
        try:
            while len(per_rank) < world_size:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a rank failed or {timeout}s passed (see its traceback above)")
                try:
                    rank, value = results.get(timeout=1.0)
                    per_rank[rank] = value
                except queue.Empty:
                    pass
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return [per_rank[r] for r in range(world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=3, help="compressed steps measured (median)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    for world_size in args.world_sizes:
        per_rank = run_on_gloo(measure, world_size, args.density, args.steps)
        for collective in COLLECTIVES:
            ranks = [r[collective] for r in per_rank]
            rows.append({"world_size": world_size, "collective": collective, "density": args.density,
                         "parameters": ranks[0]["parameters"], "buckets": ranks[0]["buckets"], "k": ranks[0]["k"],
                         "sent_mean": statistics.mean(r["bytes_sent"] for r in ranks),
                         "sent_max": max(r["bytes_sent"] for r in ranks),
                         "received_max": max(r["bytes_received"] for r in ranks),
                         "seconds_median": statistics.median(r["seconds"] for r in ranks)})
    print(f"{'P':>3} {'collective':>10} {'params':>9} {'k':>6} {'sent/rank mean':>15} {'sent max':>10} "
          f"{'recv max':>10} {'vs dense':>8} {'s/step':>7}")
    for row in rows:
        dense = next(r for r in rows if r["world_size"] == row["world_size"] and r["collective"] == "dense")
        print(f"{row['world_size']:>3} {row['collective']:>10} {row['parameters']:>9} {row['k']:>6} "
              f"{row['sent_mean']:>15.0f} {row['sent_max']:>10.0f} {row['received_max']:>10.0f} "
              f"{row['sent_mean'] / dense['sent_mean']:>8.4f} {row['seconds_median']:>7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Bytes per training step of the collectives: dense allreduce, TopK-SGD allgather, gTop-k and Ok-Topk.

A DDP model (an MLP 784-h1-h2-10, by default 1M parameters; DDP's default buckets) trains on P Gloo processes
with ``sparse_grad_hook``; after the dense warm-up, the hook's own counters (``state.stats()``) give the bytes
each rank sent and received in one step: exact for the point-to-point messages, and for the backend's
allreduce and allgather what a ring algorithm moves (2(P-1)/P and (P-1) times the buffer). Header agreement
bytes (a few dozen per bucket) are included. Every collective the hook offers is measured.

``--exchange`` measures the collectives themselves instead of the hook: the model trains on the dense average
of the ranks' gradients, and each sparse collective reduces the same flattened gradient of every step (one
message, Gaussian-k, with its own error-feedback residual; Ok-Topk with one OkTopkState), counted by its
``Traffic``: the median step, and the mean, which includes Ok-Topk's re-estimations (every 32 steps).

    python -m bench.bytes_per_step --world-sizes 4 8 --density 0.01 --json bytes_per_step.json
    python -m bench.bytes_per_step --exchange --hidden 2048 768 --world-sizes 2 4 8 --steps 40
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

from gtopk_ext.hooks import COLLECTIVES as HOOK_COLLECTIVES
from gtopk_ext.utils import destroy_process_group

COLLECTIVES = ("dense", "allgather", "gtopk", "oktopk")
WARMUP = 2  # the hook's dense iterations (start_iter)


def make_model(hidden: tuple[int, int] = (1024, 256)) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, hidden[0]), nn.ReLU(), nn.Linear(hidden[0], hidden[1]), nn.ReLU(),
                         nn.Linear(hidden[1], 10))


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(32, 784, generator=generator), torch.randint(0, 10, (32,), generator=generator)


def measure(rank: int, world_size: int, density: float, steps: int, hidden: tuple[int, int],
            collectives: tuple[str, ...]) -> dict:
    import gtopk_ext as gx
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for collective in collectives:
        model = make_model(hidden)
        ddp = DDP(model)
        state = gx.SparseGradState(density=density, collective=collective, start_iter=WARMUP,
                                   stats_logging_frequency=0)
        ddp.register_comm_hook(state, gx.sparse_grad_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(rank)
        sent, received, seconds = [], [], []
        for step in range(WARMUP + steps):
            x, y = batch(generator)
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


def measure_exchanges(rank: int, world_size: int, density: float, steps: int, hidden: tuple[int, int],
                      collectives: tuple[str, ...]) -> dict:
    """Bytes of each collective on the model's whole flattened gradient, step by step (see the module doc)."""
    import gtopk_ext as gx
    from gtopk_ext.collectives import OkTopkState, Traffic, ring_allreduce_bytes

    model = make_model(hidden)
    parameters = list(model.parameters())
    numel = sum(p.numel() for p in parameters)
    optimizer = torch.optim.SGD(parameters, lr=0.01)
    compressor = gx.make_compressor("gaussiank", density)
    residuals = {c: torch.zeros(numel) for c in collectives if c != "dense"}
    oktopk_state = OkTopkState()
    generator = torch.Generator().manual_seed(rank)
    sent: dict[str, list[int]] = {c: [] for c in collectives}
    for _ in range(steps):
        x, y = batch(generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in parameters])
        for collective in collectives:
            if collective == "dense":
                sent[collective].append(ring_allreduce_bytes(4 * numel, world_size))
                continue
            traffic, residual = Traffic(), residuals[collective]
            msg = compressor.compress(grad, residual)
            if collective == "allgather":
                gx.collectives.sparse_allgather(msg, check=False, traffic=traffic)
            else:
                reduce = gx.collectives.gtopk_allreduce if collective == "gtopk" else gx.collectives.oktopk_allreduce
                kwargs = {"state": oktopk_state} if collective == "oktopk" else {}
                _, applied = reduce(msg, check=False, traffic=traffic, **kwargs)
                gx.ops.scatter_add_(residual, msg.indices, msg.values * ~applied)  # not applied: kept
            sent[collective].append(traffic.sent)
        dist.all_reduce(grad)  # the model follows the dense average, the same for every collective
        offset = 0
        for p in parameters:
            p.grad.copy_(grad[offset:offset + p.numel()].view_as(p).div_(world_size))
            offset += p.numel()
        optimizer.step()
    return {c: {"parameters": numel, "buckets": 1, "k": numel if c == "dense" else compressor.k_for(numel),
                "bytes_sent": statistics.median(sent[c]), "bytes_sent_mean": statistics.mean(sent[c]),
                "bytes_received": None, "seconds": None} for c in collectives}


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
    parser.add_argument("--hidden", type=int, nargs=2, default=[1024, 256], metavar=("H1", "H2"),
                        help="the MLP's hidden widths (2048 768: 3.2M parameters)")
    parser.add_argument("--exchange", action="store_true",
                        help="measure the collectives on the whole gradient instead of through the hook")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.exchange:
        measure_fn, collectives = measure_exchanges, COLLECTIVES
    else:  # the collectives the hook offers
        measure_fn, collectives = measure, tuple(c for c in COLLECTIVES if c in HOOK_COLLECTIVES)
    rows = []
    for world_size in args.world_sizes:
        per_rank = run_on_gloo(measure_fn, world_size, args.density, args.steps, tuple(args.hidden), collectives)
        for collective in collectives:
            ranks = [r[collective] for r in per_rank]
            rows.append({"world_size": world_size, "collective": collective, "density": args.density,
                         "level": "exchange" if args.exchange else "hook",
                         "parameters": ranks[0]["parameters"], "buckets": ranks[0]["buckets"], "k": ranks[0]["k"],
                         "sent_mean": statistics.mean(r["bytes_sent"] for r in ranks),
                         "sent_max": max(r["bytes_sent"] for r in ranks),
                         "sent_mean_all_steps": statistics.mean(r.get("bytes_sent_mean", r["bytes_sent"])
                                                                for r in ranks),
                         "received_max": None if args.exchange else max(r["bytes_received"] for r in ranks),
                         "seconds_median": None if args.exchange else statistics.median(r["seconds"] for r in ranks)})
    print(f"{'P':>3} {'collective':>10} {'params':>9} {'k':>6} {'sent/rank mean':>15} {'sent max':>10} "
          f"{'recv max':>10} {'all steps':>10} {'vs dense':>8} {'vs gtopk':>8} {'s/step':>7}")

    def optional(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    for row in rows:
        dense, gtopk = (next(r for r in rows if r["world_size"] == row["world_size"] and r["collective"] == name)
                        for name in ("dense", "gtopk"))
        print(f"{row['world_size']:>3} {row['collective']:>10} {row['parameters']:>9} {row['k']:>6} "
              f"{row['sent_mean']:>15.0f} {row['sent_max']:>10.0f} {optional(row['received_max'], '.0f'):>10} "
              f"{row['sent_mean_all_steps']:>10.0f} {row['sent_mean'] / dense['sent_mean']:>8.4f} "
              f"{row['sent_mean'] / gtopk['sent_mean']:>8.4f} {optional(row['seconds_median'], '.3f'):>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

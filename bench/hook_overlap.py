"""Can the hook's compression and communication of one bucket overlap the backward of the next, with Gloo?

``sparse_grad_hook`` compresses and runs the sparse collective inside the hook call, on the autograd thread, so
the backward of the next bucket waits for it (dense buckets are async Gloo allreduces, as in DDP). This compares
that with a worker thread that takes the buckets in order (one per state, so every rank issues its collectives in
the same order) and hands DDP a future it completes: the backward goes on while the worker selects and talks.

Each step is timed (forward + backward + DDP's wait for the buckets + optimizer step); medians over steps,
slowest rank. Both variants run side by side in the same processes, alternating, so machine load hits both.

    python -m bench.hook_overlap --world-sizes 2 4 --steps 20
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against dist.GradBucket.
import argparse
import queue
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import gtopk_ext as gx
from bench.bytes_per_step import run_on_gloo

LAYERS, WIDTH = 8, 512  # 2.1M parameters in 8 equal layers: several buckets of similar size


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


class WorkerThreadHook:
    """State of ``worker_thread_hook``: a SparseGradState served by one thread, buckets in arrival order."""

    def __init__(self, state: gx.SparseGradState):
        self.state = state
        self.buckets: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            future, buffer, index, is_last, parameters = self.buckets.get()
            try:
                future.set_result(self.state.reduce(buffer, index, is_last=is_last, parameters=parameters).wait())
            except Exception as error:  # noqa: BLE001 - handed to DDP, which raises it in backward
                future.set_exception(error)


def worker_thread_hook(hook: WorkerThreadHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    future = torch.futures.Future()
    hook.buckets.put((future, bucket.buffer(), bucket.index(), bucket.is_last(), bucket.parameters()))
    return future


def measure(rank: int, world_size: int, steps: int, bucket_cap_mb: float, density: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    variants = {}
    for name in ("inline", "worker thread"):
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
        state = gx.SparseGradState(density=density, stats_logging_frequency=0)
        if name == "inline":
            ddp.register_comm_hook(state, gx.sparse_grad_hook)
        else:
            ddp.register_comm_hook(WorkerThreadHook(state), worker_thread_hook)
        variants[name] = (ddp, torch.optim.SGD(model.parameters(), lr=0.01), state)
    generator = torch.Generator().manual_seed(rank)
    seconds = {name: [] for name in variants}
    for step in range(3 + steps):
        x, y = torch.randn(64, WIDTH, generator=generator), torch.randint(0, WIDTH, (64,), generator=generator)
        for name, (ddp, optimizer, state) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            if step >= 3:
                seconds[name].append(time.perf_counter() - start)
    buckets = len(variants["inline"][2].stats()["buckets"])
    return {"buckets": buckets, **{name: statistics.median(s) for name, s in seconds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.5)
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()
    print(f"{'P':>3} {'buckets':>7} {'inline s/step':>14} {'worker s/step':>14} {'worker/inline':>13}")
    for world_size in args.world_sizes:
        per_rank = run_on_gloo(measure, world_size, args.steps, args.bucket_cap_mb, args.density)
        inline = max(r["inline"] for r in per_rank)
        worker = max(r["worker thread"] for r in per_rank)
        print(f"{world_size:>3} {per_rank[0]['buckets']:>7} {inline:>14.4f} {worker:>14.4f} {worker / inline:>13.3f}")


if __name__ == "__main__":
    main()

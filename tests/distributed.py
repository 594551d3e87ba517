"""Runs a function on P real processes joined in a Gloo process group, with a timeout so that no test hangs.

The processes are forked from a server that has already imported torch and gtopk_ext (multiprocessing's
forkserver, one per test process): a spawned process imports them again, 3 s of CPU a rank (4 ranks of a no-op:
6.9 s spawned, 0.3 s forked). Each process is still new to the test (no group, no state of a test before it).
Each check that needs a group should still run many cases inside one call.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from gtopk_ext.utils import destroy_process_group


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        finally:
            destroy_process_group()
    except BaseException:  # the parent re-raises it with the rank's traceback
        results.put((rank, False, traceback.format_exc()))


_PRELOAD = ["torch", "torch.distributed", "gtopk_ext", "tests.distributed"]


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each in its own process; ``fn`` must be picklable
    (defined at module level) and so must its result. Raises if any rank fails or the timeout passes."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: at this test process's first call
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        failures: list[str] = []
        wait = timeout
        try:
            for _ in range(world_size):
                rank, ok, value = results.get(timeout=wait)
                if ok:
                    outputs[rank] = value
                else:
                    failures.append(f"rank {rank} failed:\n{value}")
                    wait = 5.0  # the others fail soon too, or wait forever on the failed rank
        except Exception:  # queue.Empty
            if not failures:
                failures.append(f"timed out after {timeout}s waiting for ranks "
                                f"{sorted(set(range(world_size)) - set(outputs))}")
        finally:
            for p in procs:
                p.join(timeout=5 if not failures else 0.1)
                if p.is_alive():
                    p.kill()
    if failures:
        raise AssertionError("\n".join(failures))
    return [outputs[r] for r in range(world_size)]

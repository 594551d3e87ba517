"""The hook's communication thread on real DDP models over real Gloo groups: bitwise the same as the synchronous
path on every rank (P = 2, 3, 4; every collective; float32, bfloat16, float16) with many buckets, and a failure
on one rank reaching every rank quickly instead of a hang.

No `from __future__ import annotations` here: DDP checks a hook's annotations against dist.GradBucket.
"""

import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gtopk_ext as gx
from gtopk_ext.collectives import gtopk as gtopk_module
from tests.distributed import run_distributed

WORLD = 4
LAYERS, WIDTH = 10, 24  # ten 600-element layers: about ten buckets at a cap of 600 elements
STEPS = 5


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
    return nn.Sequential(*layers).to(dtype)


def bucket_cap_mb(dtype: torch.dtype) -> float:
    return 600 * torch.empty((), dtype=dtype).element_size() / 2**20


def train(group, collective: str, dtype: torch.dtype, synchronous: bool, rank: int,
          find_unused_parameters: bool = False) -> tuple[list[torch.Tensor], dict]:
    """The parameters after STEPS steps, and per step the hook's (bytes sent, compressed buckets)."""
    model = make_model(dtype)
    ddp = DDP(model, process_group=group, bucket_cap_mb=bucket_cap_mb(dtype),
              find_unused_parameters=find_unused_parameters)
    state = gx.SparseGradState(group, density=0.05, collective=collective, start_iter=2,
                               path=gx.PathPolicy("sparse", min_compress_numel=256),
                               stats_logging_frequency=0)
    state.synchronous = synchronous
    ddp.register_comm_hook(state, gx.sparse_grad_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    traffic = {}
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, WIDTH, generator=generator).to(dtype)
        optimizer.zero_grad()
        ddp(x).float().square().mean().backward()
        optimizer.step()
        stats = state.stats()
        traffic[step] = (stats["total"]["bytes_sent"], sum(b["path"] == "sparse" for b in stats["buckets"].values()),
                         len(stats["buckets"]))
    return [p.detach().clone() for p in model.parameters()], traffic


def same_on_every_rank(group, tensors: list[torch.Tensor]) -> bool:
    mine = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return all(torch.equal(g, mine) for g in gathered)


def check_async_equals_sync(group, rank: int, size: int) -> list[str]:
    failures = []
    for collective in ("gtopk", "allgather", "oktopk", "dense"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            where = f"P={size} {collective} {dtype}"
            threaded, traffic = train(group, collective, dtype, False, rank)
            inline, _ = train(group, collective, dtype, True, rank)
            if traffic[STEPS - 1][2] < 8:
                failures.append(f"{where}: only {traffic[STEPS - 1][2]} buckets")
            if collective in ("gtopk", "allgather"):  # fixed sizes: a header per bucket only at step 2, 21 int64:
                # valid, iter, bucket index, numel, dtype, sparse, k, wire, round, the configuration's 7 more
                # (density, collective, start_iter, path, compressor, schedule, momentum), 5 measured costs
                header = gx.collectives.ring_allgather_bytes(21 * 8, size)
                first, compressed = traffic[2][0] - traffic[3][0], traffic[2][1]
                if traffic[3][0] != traffic[4][0] or first != compressed * header or compressed < 8:
                    failures.append(f"{where}: bytes per step {traffic}: expected {compressed} headers of "
                                    f"{header} B at step 2 only")
            if not all(torch.equal(a, b) for a, b in zip(threaded, inline)):
                failures.append(f"{where}: the threaded hook differs from the synchronous one")
            if not same_on_every_rank(group, threaded):
                failures.append(f"{where}: the replicas differ")
    # DDP's own allreduce of the used-parameter map follows the last bucket's hook call.
    threaded, _ = train(group, "gtopk", torch.float32, False, rank, find_unused_parameters=True)
    inline, _ = train(group, "gtopk", torch.float32, True, rank, find_unused_parameters=True)
    if not all(torch.equal(a, b) for a, b in zip(threaded, inline)) or not same_on_every_rank(group, threaded):
        failures.append(f"P={size} find_unused_parameters: threaded != synchronous or replicas differ")
    return failures


def check_failure_reaches_every_rank(rank: int) -> list[str]:
    """Rank 1's exchange fails in the fourth step: every rank's backward raises the same type within 30 s, although
    the group's timeout is 300 s (the other ranks are waiting for rank 1 inside the exchange)."""
    group = dist.new_group(list(range(WORLD)), timeout=timedelta(seconds=300))
    if rank == 1:
        real, calls = gtopk_module.gtopk_allreduce, []

        def failing_exchange(*args, **kwargs):
            calls.append(None)
            if len(calls) == 3:  # the third compressed bucket of step 3
                raise ConnectionError("injected: the link to the peer went down")
            return real(*args, **kwargs)

        gtopk_module.gtopk_allreduce = failing_exchange
    model = make_model(torch.float32)
    ddp = DDP(model, process_group=group, bucket_cap_mb=bucket_cap_mb(torch.float32))
    state = gx.SparseGradState(group, density=0.05, start_iter=3,
                               path=gx.PathPolicy("sparse", min_compress_numel=256), stats_logging_frequency=0)
    ddp.register_comm_hook(state, gx.sparse_grad_hook)
    for step in range(4):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
        start = time.monotonic()
        try:
            ddp(x).square().mean().backward()
        except Exception as error:  # noqa: BLE001 - the failure under test
            seconds = time.monotonic() - start
            # The error's type and message reach backward() (not "Unable to cast <message> to Tensor").
            if step != 3 or seconds > 30 or not re.search(r"ConnectionError: .*injected", str(error)):
                return [f"rank {rank}: step {step} raised after {seconds:.1f} s: {error!r}"]
            return [("raised", type(error).__name__)]
    return [f"rank {rank}: no exception reached the training loop"]


def async_worker(rank: int, world_size: int) -> list:
    failures = []
    for size in (2, 3, 4):
        group = dist.new_group(list(range(size)))
        if rank < size:
            failures += check_async_equals_sync(group, rank, size)
    return failures + check_failure_reaches_every_rank(rank)


def test_threaded_hook_is_bitwise_synchronous_and_fails_together():
    results = run_distributed(async_worker, WORLD, timeout=600)
    raised = [r[-1] for r in results]
    failures = [f for rank_results in results for f in rank_results[:-1]]
    failures += [f for f in raised if not isinstance(f, tuple)]
    assert not failures, "\n".join(failures[:20])
    assert len({kind for _, kind in raised}) == 1, f"different exception types across ranks: {raised}"

"""collectives.hierarchical_allreduce on a real Gloo group of 4 ranks, as 4, 2 and 1 nodes: the same average on
every rank, residuals zero outside each rank's shard, nothing lost (on the plain and the compact wire), the exact
top-k of each node's shard sum when the nodes' selections cannot interact, and a non-finite shard turning every
rank back with nothing changed; gx.destroy_process_group lets go of every group and thread. tests/test_torchrun.py
trains through the hook with it under torchrun.

Every rank builds every rank's input (deterministic data), so each computes the expected results itself.
"""

from __future__ import annotations

import math
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

import gtopk_ext as gx
from gtopk_ext.ddp import reduce_buffer
from gtopk_ext.collectives import Traffic
from gtopk_ext.hierarchical import hierarchical_allreduce, node_groups, resolve_local_size, shard_bounds
from tests.distributed import run_distributed

WORLD_SIZE = 4
NUMEL = 1001  # shards of unequal sizes
DENSITY = 0.05


def rank_input(case: int, rank: int, local_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient, residual: nonzero only in the rank's shard) of one rank in one case."""
    generator = torch.Generator().manual_seed(100 * case + rank)
    grad = torch.randn(NUMEL, generator=generator).to(dtype)
    residual = torch.zeros(NUMEL, dtype=dtype)
    bounds = shard_bounds(NUMEL, local_size)
    start, end = bounds[rank % local_size], bounds[rank % local_size + 1]
    residual[start:end] = 0.1 * torch.randn(end - start, generator=generator).to(dtype)
    return grad, residual


def exact_node_topk(case: int, local_size: int, density: float) -> torch.Tensor:
    """With one node, or with density 1: per shard, the exact top-share of the node's sum, divided by P."""
    bounds = shard_bounds(NUMEL, local_size)
    widths = [end - start for start, end in zip(bounds, bounds[1:])]
    shares = gx.compressors.tensor_shares(max(gx.compressors.k_for_density(density, NUMEL), local_size), widths)
    expected = torch.zeros(NUMEL)
    for node in range(WORLD_SIZE // local_size):
        node_sum = sum(sum(rank_input(case, r, local_size, torch.float32))
                       for r in range(node * local_size, (node + 1) * local_size))
        for start, end, share in zip(bounds, bounds[1:], shares):
            top = node_sum[start:end].abs().topk(share).indices + start
            expected[top] += node_sum[top]
    return expected / WORLD_SIZE


def same_on_every_rank(tensor: torch.Tensor) -> bool:
    mine = tensor.reshape(-1).view(torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return all(torch.equal(g, mine) for g in gathered)


def check_case(rank: int, case: int, local_size: int, inner: str, dtype: torch.dtype, density: float,
               wire: str = "plain") -> list[str]:
    name = f"local_size={local_size} inner={inner} {dtype} density={density} wire={wire}"
    grad, residual = rank_input(case, rank, local_size, dtype)
    old_residual = residual.clone()
    traffic = Traffic()
    compressor = gx.make_compressor("topk", density)
    k = compressor.k_for(NUMEL)
    rounding = gx.wire.Rounding()
    result = hierarchical_allreduce(grad, residual, compressor, k, local_size, inner=inner, traffic=traffic,
                                    wire=wire, rounding=rounding)
    failures = []
    if result.average is None or not same_on_every_rank(result.average):
        return [f"{name}: the average differs across ranks"]
    if residual[:result.shard.start].any() or residual[result.shard.stop:].any():
        failures.append(f"{name}: the residual is nonzero outside the rank's shard")
    # Conservation: what went in on every rank = P * the average + what every rank keeps (the compact wire's
    # rounding errors included: they are in the residual, and in ``rounding``, inside the rank's shard).
    error_indices, errors = rounding.pairs(torch.float32, grad.device)
    if wire == "plain" and error_indices.numel():
        failures.append(f"{name}: the plain wire reported rounding errors")
    if ((error_indices < result.shard.start) | (error_indices >= result.shard.stop)).any():
        failures.append(f"{name}: a rounding error outside the rank's shard")
    balance = torch.stack([grad.double() + old_residual.double() - residual.double(),
                           grad.double().abs() + old_residual.double().abs()])
    dist.all_reduce(balance)
    scale = 1e-5 if dtype == torch.float32 else 1e-2
    if not torch.allclose(balance[0], WORLD_SIZE * result.average.double(), atol=scale * float(balance[1].max())):
        failures.append(f"{name}: conservation broken by "
                        f"{float((balance[0] - WORLD_SIZE * result.average.double()).abs().max()):.3g}")
    # With one node, or density 1, the nodes' selections do not interact: the exact top-k per node (float32 only:
    # a bfloat16 node sum may rank near-ties otherwise).
    if (local_size == WORLD_SIZE or density == 1.0) and dtype == torch.float32:
        expected = exact_node_topk(case, local_size, density)
        tolerance = scale if wire == "plain" else 1e-3  # float16 on the wire: 11 significant bits
        if not torch.allclose(result.average.float(), expected, rtol=tolerance, atol=tolerance):
            failures.append(f"{name}: the average is not the per-shard top-k of the node's sum")
    if density == 1.0 and residual.any():
        failures.append(f"{name}: density 1 left a residual")
    most = max(k, local_size) * (WORLD_SIZE // local_size if inner == "allgather" else 1)
    if int((result.average != 0).sum()) > most:
        failures.append(f"{name}: more than {most} elements applied")
    if traffic.sent <= 0 or traffic.received <= 0:
        failures.append(f"{name}: traffic counted {traffic}")
    return failures


def check_nonfinite(rank: int, local_size: int) -> list[str]:
    """Rank 1's gradient holds an inf: every rank learns it, nothing is applied, nothing changes."""
    grad, residual = rank_input(7, rank, local_size, torch.float32)
    if rank == 1:
        grad[5] = math.inf
    before = (grad.clone(), residual.clone())
    flags = torch.zeros(1, dtype=torch.int32)
    result = hierarchical_allreduce(grad, residual, gx.make_compressor("gaussiank", DENSITY), 51, local_size,
                                    flags=flags, nonfinite_flag=4)
    if result.average is not None or int(flags) != 4:
        return [f"local_size={local_size}: an inf on rank 1 gave average {result.average} and flags {int(flags)}"]
    if not (torch.equal(grad, before[0]) and torch.equal(residual, before[1])):
        return [f"local_size={local_size}: the inputs changed although a flag was raised"]
    return []


def check_destroy_lets_go() -> list[str]:
    """gx.destroy_process_group closes the hook's threads and lets go of every group (the world, the cached node
    groups): none outlives it into the interpreter's finalization, where its threads could abort the process. A
    state used after a new init_process_group starts a new thread on the new world."""
    state = gx.SparseGradState(density=DENSITY, path="sparse")
    reduce_buffer(state, torch.ones(NUMEL), 0).wait()
    groups = [weakref.ref(group) for group in (dist.group.WORLD, *node_groups(dist.group.WORLD, 2))]
    gx.destroy_process_group()
    failures = []
    if any(group() is not None for group in groups):
        failures.append("a process group outlived gx.destroy_process_group")
    threads = [thread.name for thread in threading.enumerate() if thread.name.startswith("gtopk_ext")]
    if threads:
        failures.append(f"threads outlived gx.destroy_process_group: {threads}")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the harness destroys it
    reduce_buffer(state, torch.ones(NUMEL), 0).wait()
    if state.worker.group is not dist.group.WORLD:
        failures.append("the state did not start a new thread on the new world")
    return failures


def hierarchical_worker(rank: int, size: int) -> list[str]:
    failures, case = [], 0
    for local_size in (2, WORLD_SIZE, 1):
        for inner in ("gtopk", "allgather", "oktopk"):
            case += 1
            failures += check_case(rank, case, local_size, inner, torch.float32, DENSITY)
            failures += check_case(rank, case, local_size, inner, torch.float32, DENSITY, wire="compact")
        failures += check_case(rank, case, local_size, "gtopk", torch.bfloat16, DENSITY)
        failures += check_case(rank, case, local_size, "gtopk", torch.bfloat16, DENSITY, wire="compact")
        failures += check_case(rank, case, local_size, "gtopk", torch.float32, 1.0)
        failures += check_nonfinite(rank, local_size)
    try:
        hierarchical_allreduce(torch.zeros(8), None, gx.make_compressor("topk", 0.5), 4, 3)
        failures.append("local_size 3 with 4 ranks was accepted")
    except ValueError as error:
        if "must divide the group's size" not in str(error):
            failures.append(f"unclear error for local_size 3: {error}")
    return failures + check_destroy_lets_go()


def test_hierarchical_allreduce_on_4_ranks():
    failures = [f for rank_failures in run_distributed(hierarchical_worker, WORLD_SIZE, timeout=300)
                for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


def test_local_size_comes_from_torchrun_or_is_asked_for(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_local_size(None) == 4
    assert resolve_local_size(2) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="needs local_size .*LOCAL_WORLD_SIZE is not set"):
        gx.SparseGradState(hierarchical=gx.Hierarchical(), path="sparse")
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="local_size must be an int >= 1"):
            gx.SparseGradState(hierarchical=gx.Hierarchical(bad), path="sparse")
    with pytest.raises(ValueError, match="hierarchical reduces with a sparse collective between nodes"):
        gx.SparseGradState(collective="dense", hierarchical=gx.Hierarchical(2), path="sparse")
    with pytest.raises(TypeError, match="hierarchical must be a gx.Hierarchical"):
        gx.SparseGradState(hierarchical=2, path="sparse")
    with pytest.raises(ValueError, match="supports neither momentum"):
        gx.SparseGradState(hierarchical=gx.Hierarchical(2), momentum=0.9, path="sparse")

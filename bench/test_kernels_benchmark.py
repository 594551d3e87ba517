"""The kernel microbenchmarks as a pytest-benchmark suite: selection (gaussian_select, and gaussian_threshold +
compact) against torch.topk (sorted=False and True) and the residual.add_(grad) floor, merge_topk, scatter_add.

    pytest bench --benchmark-only [--kernel-sizes 1048576,16777216] [--kernel-densities 0.001,0.01,0.05]

Each selection method does the whole error-feedback step on acc = residual + grad, from the same residual every
round (reset outside the timed call). Groups are per size and density, so --benchmark-compare and the table put
the methods of one case side by side. Not part of `pytest tests` (which CI runs): tests/test_bench_smoke.py runs
this file once at a tiny size with --benchmark-disable.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness.selection import topk_step
from gtopk_ext import ops
from gtopk_ext.compressors import k_for_density


def gaussian_select(grad, residual, k, z):
    values, indices, _, _ = ops.gaussian_select(grad, residual, z=z, k=k, capacity=k)
    ops.residual_update_(residual, indices, values, check=False)


def threshold_and_compact(grad, residual, k, z):
    stats = ops.gaussian_threshold(grad, residual, z=z, k=k)
    values, indices, _ = ops.compact(residual, stats[ops.STAT_THRESHOLD:ops.STAT_THRESHOLD + 1], k)
    ops.residual_update_(residual, indices, values, check=False)


def resetting(tensor: torch.Tensor, value) -> callable:
    """A pytest-benchmark setup (it must return None) that refills tensor with value before each round."""
    def setup() -> None:
        tensor.copy_(value) if isinstance(value, torch.Tensor) else tensor.fill_(value)

    return setup


SELECTION_METHODS = {
    "floor": lambda grad, residual, k, z: residual.add_(grad),
    "gaussian_select": gaussian_select,
    "threshold+compact": threshold_and_compact,
    "topk": lambda grad, residual, k, z: topk_step(grad, residual, k, False),
    "topk_sorted": lambda grad, residual, k, z: topk_step(grad, residual, k, True),
}


@pytest.mark.parametrize("method", list(SELECTION_METHODS))
def test_selection(benchmark, request, method, n, density):
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=generator)
    initial_residual = 0.1 * torch.randn(n, generator=generator)
    residual = torch.empty_like(initial_residual)
    k, z = k_for_density(density, n), ops.z_for_density(density)
    benchmark.group = f"selection n={n} density={density}"
    benchmark.extra_info.update(n=n, density=density, k=k)
    benchmark.pedantic(SELECTION_METHODS[method], args=(grad, residual, k, z),
                       setup=resetting(residual, initial_residual),
                       rounds=request.config.getoption("--kernel-rounds"), warmup_rounds=1)


def sparse_set(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct ascending indices of [0, n) with Gaussian values: a message as compact writes it."""
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(n, generator=generator)[:k].sort().values.int()
    return indices, torch.randn(k, generator=generator)


@pytest.mark.parametrize("implementation", ["cpp", "torch"])
def test_merge_topk(benchmark, request, implementation, n, density):
    k = k_for_density(density, n)
    (ia, va), (ib, vb) = sparse_set(n, k, 1), sparse_set(n, k, 2)
    merge = ops.merge_topk if implementation == "cpp" else ops.merge_topk_with_torch
    benchmark.group = f"merge_topk n={n} k={k}"
    benchmark.pedantic(merge, args=(ia, va, ib, vb, k), rounds=request.config.getoption("--kernel-rounds"),
                       warmup_rounds=1)


@pytest.mark.parametrize("messages", [1, 8])
def test_scatter_add(benchmark, request, messages, n, density):
    """The decompression of `messages` ranks' messages into one dense tensor."""
    k = k_for_density(density, n)
    pairs = [sparse_set(n, k, seed) for seed in range(messages)]
    indices, values = torch.cat([i for i, _ in pairs]), torch.cat([v for _, v in pairs])
    dense = torch.zeros(n)
    benchmark.group = f"scatter_add n={n} density={density}"
    benchmark.pedantic(ops.scatter_add_, args=(dense, indices, values), setup=resetting(dense, 0.0),
                       rounds=request.config.getoption("--kernel-rounds"), warmup_rounds=1)

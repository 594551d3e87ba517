"""The kernel microbenchmarks as a pytest-benchmark suite: selection (gaussian_select, and gaussian_threshold +
compact) against torch.topk and the residual.add_(grad) floor, each the whole error-feedback step from the same
residual every round; merge_topk; scatter_add. Grouped per size and density, so --benchmark-compare puts the methods
of one case side by side; tests/test_bench_smoke.py runs it once at a tiny size. Options: bench/conftest.py.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness.gradients import topk_step
from gtopk_ext import ops
from gtopk_ext.compressors import k_for_density


def gaussian_select(grad, residual, k, z):
    values, indices, _, _ = ops.gaussian_select(grad, residual, z=z, k=k, capacity=k)
    ops.residual_update_(residual, indices, values, check=False)


def threshold_and_compact(grad, residual, k, z):
    stats = ops.gaussian_threshold(grad, residual, z=z, k=k)
    values, indices, _ = ops.compact(residual, stats[ops.STAT_THRESHOLD:ops.STAT_THRESHOLD + 1], k)
    ops.residual_update_(residual, indices, values, check=False)


SELECTION_METHODS = {
    "floor": lambda grad, residual, k, z: residual.add_(grad),
    "gaussian_select": gaussian_select,
    "threshold+compact": threshold_and_compact,
    "topk": lambda grad, residual, k, z: topk_step(grad, residual, k, False),
    "topk_sorted": lambda grad, residual, k, z: topk_step(grad, residual, k, True),
}


def timed(benchmark, request, group: str, function, args: tuple, setup=None) -> None:
    """``function(*args)`` timed in ``group``, after ``setup()`` (outside the timed call) every round."""
    benchmark.group = group
    benchmark.pedantic(function, args=args, setup=setup, rounds=request.config.getoption("--kernel-rounds"),
                       warmup_rounds=1)


def refilled(tensor: torch.Tensor, value) -> callable:
    """A setup (pytest-benchmark's returns None) that refills ``tensor`` with ``value`` before each round."""
    def setup() -> None:
        tensor.copy_(value) if isinstance(value, torch.Tensor) else tensor.fill_(value)
    return setup


def sparse_set(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct ascending indices of [0, n) with Gaussian values: a message as compact writes it."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=generator)[:k].sort().values.int(), torch.randn(k, generator=generator)


@pytest.mark.parametrize("method", list(SELECTION_METHODS))
def test_selection(benchmark, request, method, n, density):
    generator = torch.Generator().manual_seed(0)
    grad, initial_residual = torch.randn(n, generator=generator), 0.1 * torch.randn(n, generator=generator)
    residual, k = torch.empty_like(initial_residual), k_for_density(density, n)
    benchmark.extra_info.update(n=n, density=density, k=k)
    timed(benchmark, request, f"selection n={n} density={density}", SELECTION_METHODS[method],
          (grad, residual, k, ops.z_for_density(density)), refilled(residual, initial_residual))


@pytest.mark.parametrize("implementation", ["cpp", "torch"])
def test_merge_topk(benchmark, request, implementation, n, density):
    k = k_for_density(density, n)
    timed(benchmark, request, f"merge_topk n={n} k={k}",
          ops.merge_topk if implementation == "cpp" else ops.merge_topk_with_torch,
          (*sparse_set(n, k, 1), *sparse_set(n, k, 2), k))


@pytest.mark.parametrize("messages", [1, 8])
def test_scatter_add(benchmark, request, messages, n, density):
    """The decompression of `messages` ranks' messages into one dense tensor."""
    pairs, dense = [sparse_set(n, k_for_density(density, n), seed) for seed in range(messages)], torch.zeros(n)
    timed(benchmark, request, f"scatter_add n={n} density={density}", ops.scatter_add_,
          (dense, torch.cat([i for i, _ in pairs]), torch.cat([v for _, v in pairs])), refilled(dense, 0.0))

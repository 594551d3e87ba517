"""The kernel microbenchmarks for pytest-benchmark (options: bench/conftest.py): the whole error-feedback step of
gaussian_select, of gaussian_threshold + compact, of torch.topk and of the residual.add_(grad) floor, from the same
residual every round; merge_topk; scatter_add. Grouped per size and density for --benchmark-compare."""

import pytest
import torch

from bench.harness.gradients import topk_step
from bench.selection import inputs
from gtopk_ext import ops, torch_kernels
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


def timed(benchmark, request, group: str, function, arguments) -> None:
    """``function(*arguments())`` timed in ``group``, ``arguments()`` untimed (it refills what the last round used)."""
    benchmark.group = group
    benchmark.pedantic(function, setup=lambda: (arguments(), {}), rounds=request.config.getoption("--kernel-rounds"),
                       warmup_rounds=1)


def sparse_set(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct ascending indices of [0, n) with Gaussian values: a message as compact writes it."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=generator)[:k].sort().values.int(), torch.randn(k, generator=generator)


@pytest.mark.parametrize("method", list(SELECTION_METHODS))
def test_selection(benchmark, request, method, n, density):
    grad, initial_residual = inputs(n)
    residual, k, z = torch.empty_like(initial_residual), k_for_density(density, n), ops.z_for_density(density)
    benchmark.extra_info.update(n=n, density=density, k=k)
    timed(benchmark, request, f"selection n={n} density={density}", SELECTION_METHODS[method],
          lambda: (grad, residual.copy_(initial_residual), k, z))


@pytest.mark.parametrize("merge", [ops.merge_topk, torch_kernels.merge_topk], ids=["cpp", "torch"])
def test_merge_topk(benchmark, request, merge, n, density):
    k = k_for_density(density, n)
    arguments = (*sparse_set(n, k, 1), *sparse_set(n, k, 2), k)
    timed(benchmark, request, f"merge_topk n={n} k={k}", merge, lambda: arguments)


@pytest.mark.parametrize("messages", [1, 8])
def test_scatter_add(benchmark, request, messages, n, density):
    """The decompression of `messages` ranks' messages into one dense tensor."""
    pairs, dense = [sparse_set(n, k_for_density(density, n), seed) for seed in range(messages)], torch.zeros(n)
    indices, values = torch.cat([i for i, _ in pairs]), torch.cat([v for _, v in pairs])
    timed(benchmark, request, f"scatter_add n={n} density={density}", ops.scatter_add_,
          lambda: (dense.zero_(), indices, values))

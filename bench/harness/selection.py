"""The error-feedback selection step of each method, timed alike: what bench/selection.py,
bench/threshold_accuracy.py and the pytest-benchmark suite compare."""

from __future__ import annotations

import time
from typing import Callable

import torch

from gtopk_ext.compressors import make_compressor


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of fn takes (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def topk_step(grad: torch.Tensor, residual: torch.Tensor, k: int, sorted_: bool):
    """The plain-torch baseline: accumulate, exact top-k of |acc|, gather, zero what was sent."""
    acc = residual.add_(grad)
    indices = torch.topk(acc.abs(), k, sorted=sorted_).indices
    values = acc[indices]
    acc[indices] = 0
    return values, indices


def methods(density: float, n: int, backend: str | None) -> tuple[int, dict[str, Callable]]:
    """k for n elements, and each method as fn(grad, residual)."""
    accurate = make_compressor("gaussiank", density, mode="accurate", backend=backend)
    paper = make_compressor("gaussiank", density, mode="paper", backend=backend)
    k = accurate.k_for(n)
    return k, {
        "floor": lambda g, r: r.add_(g),
        "gaussiank": lambda g, r: accurate.compress(g, r),
        "gaussiank_paper": lambda g, r: paper.compress(g, r),
        "topk": lambda g, r: topk_step(g, r, k, False),
        "topk_sorted": lambda g, r: topk_step(g, r, k, True),
    }


def time_methods(grad: torch.Tensor, initial_residual: torch.Tensor, density: float, backend: str | None,
                 repeats: int) -> tuple[int, dict[str, list[float]]]:
    """k, and the seconds of each repetition of each method on (grad, a fresh copy of initial_residual)."""
    device = grad.device
    residual = torch.empty_like(initial_residual)
    k, runs = methods(density, grad.numel(), backend)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, fn in runs.items():  # warm-up: allocator, first-call costs
        residual.copy_(initial_residual)
        fn(grad, residual)
    for _ in range(repeats):
        for name, fn in runs.items():
            residual.copy_(initial_residual)  # same input every time; also evicts the caches
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(timed(lambda: fn(grad, residual), device))
    return k, times

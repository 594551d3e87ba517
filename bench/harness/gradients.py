"""Gradients to select from (seeded synthetic ones, real ones from training on the digits) and the methods, timed."""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from bench.digits import load_digits_split, make_model, mlp
from gtopk_ext.compressors import make_compressor

SYNTHETIC = ("gaussian", "laplace", "student_t3", "spiky", "offset")


def synthetic_gradient(kind: str, n: int, generator: torch.Generator) -> torch.Tensor:
    """n float32 samples: "gaussian"; "laplace"; "student_t3" (heavy tails); "spiky" (Gaussian, 1% of the
    elements 50x larger, which inflates the deviation the paper's threshold relies on); "offset" (N(30, 1): a
    spread small next to the magnitude, so the top k share a few log-scale histogram bins)."""
    if kind == "laplace":
        u = torch.rand(n, generator=generator, dtype=torch.float64) - 0.5
        return (-torch.sign(u) * torch.log1p(-2 * u.abs())).float()
    if kind == "student_t3":
        z = torch.randn(n, generator=generator, dtype=torch.float64)
        return (z / torch.sqrt(torch.randn(3, n, generator=generator, dtype=torch.float64).square().sum(0) / 3)).float()
    if kind == "spiky":
        x = torch.randn(n, generator=generator)
        return torch.where(torch.rand(n, generator=generator) < 0.01, 50 * x, x)
    if kind in ("gaussian", "offset"):
        return torch.randn(n, generator=generator) + (30 if kind == "offset" else 0)
    raise ValueError(f"kind must be one of {SYNTHETIC}, got {kind!r}")


def wide_mlp(numel: int, seed: int = 0) -> nn.Module:
    """An MLP for the digits, 64 -> h -> h -> 10, with h chosen so that it has about ``numel`` parameters."""
    h = max(16, round(math.sqrt(numel + 38**2) - 38))  # h^2 + 76h + 10 parameters, about numel
    return mlp([h, h], seed)


def captured_gradients(model: str | nn.Module = "cnn", steps: tuple[int, ...] = (0, 20, 100), batch_size: int = 64,
                       lr: float = 0.05, seed: int = 0) -> dict[int, torch.Tensor]:
    """The flat gradient at ``steps`` of SGD with momentum on the digits, of ``model`` (or bench.digits' by name)."""
    train_x, train_y, _, _ = load_digits_split(seed)
    model = make_model(model, seed) if isinstance(model, str) else model
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    generator, captured = torch.Generator().manual_seed(seed), {}
    for step in range(max(steps) + 1):
        batch = torch.randint(0, len(train_y), (batch_size,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(train_x[batch]), train_y[batch]).backward()
        if step in steps:
            captured[step] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        optimizer.step()
    return captured


def topk_step(grad: torch.Tensor, residual: torch.Tensor, k: int, sorted_: bool):
    """The plain-torch baseline: accumulate, exact top-k of |acc|, gather, zero what was sent."""
    acc = residual.add_(grad)
    indices = torch.topk(acc.abs(), k, sorted=sorted_).indices
    values = acc[indices]
    acc[indices] = 0
    return values, indices


def time_methods(grad: torch.Tensor, initial_residual: torch.Tensor, density: float, backend: str | None,
                 repeats: int) -> tuple[int, dict[str, list[float]]]:
    """k, and the seconds of each repetition of each method (the floor ``residual.add_(grad)``, Gaussian-k's
    accurate and paper modes, torch.topk unsorted and sorted) on (grad, a fresh copy of initial_residual), the
    methods interleaved; CUDA events on a GPU."""
    accurate = make_compressor("gaussiank", density, mode="accurate", backend=backend)
    paper = make_compressor("gaussiank", density, mode="paper", backend=backend)
    k, residual, on_gpu = accurate.k_for(grad.numel()), torch.empty_like(initial_residual), grad.device.type == "cuda"
    methods = {"floor": lambda: residual.add_(grad), "gaussiank": lambda: accurate.compress(grad, residual),
               "gaussiank_paper": lambda: paper.compress(grad, residual),
               "topk": lambda: topk_step(grad, residual, k, False),
               "topk_sorted": lambda: topk_step(grad, residual, k, True)}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for repeat in range(repeats + 1):  # the first round warms up: allocator, first-call costs
        for name, method in methods.items():
            residual.copy_(initial_residual)  # the same input every time; also evicts the caches
            if on_gpu:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                method()
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                begin = time.perf_counter()
                method()
                seconds = time.perf_counter() - begin
            if repeat:
                times[name].append(seconds)
    return k, times

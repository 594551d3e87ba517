"""Gradients to select from: seeded synthetic distributions, and real ones captured from training on the digits."""

from __future__ import annotations

import math

import torch
from torch import nn

from bench.digits import load_digits_split, make_model, mlp

SYNTHETIC = ("gaussian", "laplace", "student_t3", "spiky", "offset")


def synthetic_gradient(kind: str, n: int, generator: torch.Generator) -> torch.Tensor:
    """n float32 samples: "gaussian"; "laplace"; "student_t3" (heavy tails); "spiky" (Gaussian, 1% of the
    elements 50x larger, which inflates the deviation the paper's threshold relies on); "offset" (N(30, 1): a
    spread small next to the magnitude, so the top k share a few log-scale histogram bins)."""
    if kind == "gaussian":
        return torch.randn(n, generator=generator)
    if kind == "laplace":
        u = torch.rand(n, generator=generator, dtype=torch.float64) - 0.5
        return (-torch.sign(u) * torch.log1p(-2 * u.abs())).float()
    if kind == "student_t3":
        z = torch.randn(n, generator=generator, dtype=torch.float64)
        chi2 = torch.randn(3, n, generator=generator, dtype=torch.float64).square().sum(0)
        return (z / torch.sqrt(chi2 / 3)).float()
    if kind == "spiky":
        x = torch.randn(n, generator=generator)
        return torch.where(torch.rand(n, generator=generator) < 0.01, 50 * x, x)
    if kind == "offset":
        return torch.randn(n, generator=generator) + 30
    raise ValueError(f"kind must be one of {SYNTHETIC}, got {kind!r}")


def wide_mlp(numel: int, seed: int = 0) -> nn.Module:
    """An MLP for the digits, 64 -> h -> h -> 10, with h chosen so that it has about ``numel`` parameters: real
    gradients of any size from the same task."""
    h = max(16, round(math.sqrt(numel + 38**2) - 38))  # h^2 + 76h + 10 parameters, about numel
    return mlp([h, h], seed)


def captured_gradients(model: str | nn.Module = "cnn", steps: tuple[int, ...] = (0, 20, 100), batch_size: int = 64,
                       lr: float = 0.05, seed: int = 0) -> dict[int, torch.Tensor]:
    """The flattened gradient of a real training run (SGD with momentum on the digits) at the given steps, for a
    model of bench.digits by name or a given one."""
    train_x, train_y, _, _ = load_digits_split(seed)
    model = make_model(model, seed) if isinstance(model, str) else model
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    captured = {}
    for step in range(max(steps) + 1):
        batch = torch.randint(0, len(train_y), (batch_size,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(train_x[batch]), train_y[batch]).backward()
        if step in steps:
            captured[step] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        optimizer.step()
    return captured

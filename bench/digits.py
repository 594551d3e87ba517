"""The demo's task, shared by the demo and the benchmarks: scikit-learn's bundled handwritten digits (1797 8x8
images in 10 classes, shipped inside the package: nothing is downloaded) and small models for them."""

from __future__ import annotations

import torch
from torch import nn

MODELS = ("mlp", "cnn")


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """(train_x, train_y, test_x, test_y): images as float32 [N, 1, 8, 8] scaled to [0, 1], a fixed split."""
    from sklearn.datasets import load_digits  # bundled data set

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(test_fraction * len(labels))
    test, train = order[:n_test], order[n_test:]
    return images[train], labels[train], images[test], labels[test]


def make_model(name: str = "cnn", seed: int = 0) -> nn.Module:
    """A small model for 8x8 digits, with the same initial weights for the same seed: "cnn" (about 0.6M
    parameters, two conv layers and two linear ones) or "mlp" (about 0.3M, three linear layers)."""
    torch.manual_seed(seed)
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 4 * 4, 512), nn.ReLU(), nn.Linear(512, 10),
        )
    if name == "mlp":
        return mlp([512, 512], seed)
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def mlp(widths: list[int], seed: int = 0, inputs: int = 64) -> nn.Module:
    """Linear layers ``inputs`` -> each of ``widths`` -> 10 classes with ReLUs between, the input flattened first;
    the same initial weights for the same seed."""
    torch.manual_seed(seed)
    layers, width = [nn.Flatten()], inputs
    for hidden in widths:
        layers, width = [*layers, nn.Linear(width, hidden), nn.ReLU()], hidden
    return nn.Sequential(*layers, nn.Linear(width, 10))

"""The demo's task, shared by the demo and the benchmarks: scikit-learn's bundled 8x8 handwritten digits (1797
images, 10 classes; nothing is downloaded) and small models for them."""

import torch
from torch import nn

MODELS = ("mlp", "cnn")


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """(train_x, train_y, test_x, test_y): images as float32 [N, 1, 8, 8] scaled to [0, 1], a fixed split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    test, train = order.tensor_split([int(test_fraction * len(labels))])
    return images[train], labels[train], images[test], labels[test]


def make_model(name: str = "cnn", seed: int = 0) -> nn.Module:
    """A small model for the digits, the same initial weights for the same seed: "cnn" (about 0.6M parameters, two
    conv layers and two linear ones) or "mlp" (about 0.3M, three linear layers)."""
    if name == "mlp":
        return mlp([512, 512], seed)
    if name != "cnn":
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 4 * 4, 512), nn.ReLU(), nn.Linear(512, 10))


def mlp(widths: list[int], seed: int = 0, inputs: int = 64) -> nn.Module:
    """The flattened input -> Linear + ReLU to each of ``widths`` -> 10 classes; the same weights for the same seed."""
    torch.manual_seed(seed)
    sizes = [inputs, *widths]
    hidden = [layer for a, b in zip(sizes, sizes[1:]) for layer in (nn.Linear(a, b), nn.ReLU())]
    return nn.Sequential(nn.Flatten(), *hidden, nn.Linear(sizes[-1], 10))

"""The orthonormal DCT-II of consecutive chunks of a flat tensor, DeMo's transform (Peng, Quesnelle & Kingma 2024):
a top-k of a chunk's coefficients moves every element of the chunk, where a top-k of the elements moves k of them.
Orthonormal, so the transform keeps sums and norms: error feedback in the coefficients is error feedback in the
elements."""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch


@functools.lru_cache(maxsize=64)
def _matrix(size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """D (size x size), the orthonormal DCT-II: the coefficients of a row x are ``x @ D.T``, and ``D @ D.T = I``."""
    position = torch.arange(size, dtype=torch.float64)
    matrix = torch.cos(math.pi / size * (position[None, :] + 0.5) * position[:, None]) * math.sqrt(2 / size)
    matrix[0] /= math.sqrt(2)
    return matrix.to(device=device, dtype=dtype)


def _apply(tensor: torch.Tensor, chunk: int, parts: Optional[list[int]], inverse: bool) -> None:
    for part in tensor.split(parts) if parts else [tensor]:
        whole = part.numel() - part.numel() % chunk
        for piece, size in ((part[:whole], chunk), (part[whole:], part.numel() - whole)):
            if piece.numel() == 0:
                continue
            rows = piece.view(-1, size)
            matrix = _matrix(size, piece.device, piece.dtype)
            rows.copy_(rows @ matrix if inverse else rows @ matrix.T)


def forward_(tensor: torch.Tensor, chunk: int, parts: Optional[list[int]] = None) -> None:
    """``tensor`` (flat) becomes the DCT coefficients of each ``chunk`` consecutive elements of each part (``parts``:
    their sizes, default the whole tensor; a part's last, shorter chunk by a DCT of its own size)."""
    _apply(tensor, chunk, parts, inverse=False)


def inverse_(tensor: torch.Tensor, chunk: int, parts: Optional[list[int]] = None) -> None:
    """The inverse of :func:`forward_` with the same ``chunk`` and ``parts``."""
    _apply(tensor, chunk, parts, inverse=True)

"""SparseMessage: the data every compressor makes and every collective moves."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gtopk_ext import ops
from gtopk_ext.backends import BackendLike


@dataclass
class SparseMessage:
    """k (index, value) slots of a flattened tensor of ``numel`` elements.

    ``values`` has the gradient's dtype, ``indices`` is int32; the slots in use come first with ascending indices,
    the rest are padding (index 0, value 0). ``count`` (int32[1]) is how many elements the compressor selected
    before truncation to k (it may exceed k); ``stats``: the threshold statistics (``ops.STAT_*``), if computed.
    """

    values: torch.Tensor
    indices: torch.Tensor
    count: torch.Tensor
    numel: int
    stats: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.values.numel()

    def to_dense(self, dtype: torch.dtype | None = None, *, backend: BackendLike = None) -> torch.Tensor:
        """The flat dense tensor of ``numel`` elements that this message stands for (``dtype``: default the
        values' dtype; sums of duplicate indices are taken in that dtype)."""
        dense = torch.zeros(self.numel, dtype=dtype or self.values.dtype, device=self.values.device)
        return ops.scatter_add_(dense, self.indices, self.values.to(dense.dtype), backend=backend)


def padding_message(like: torch.Tensor, k: int) -> SparseMessage:
    """k padding slots (index 0, value 0) of a message about ``like``: what a rank that selects nothing sends."""
    device = like.device
    return SparseMessage(like.new_zeros(k), torch.zeros(k, dtype=torch.int32, device=device),
                         torch.zeros(1, dtype=torch.int32, device=device), max(like.numel(), 1))


def padded(msg: SparseMessage, k: int) -> SparseMessage:
    """``msg`` with padding slots added up to ``k`` (its count clamped to its own slots, which the padding follows)."""
    extra = k - msg.k
    if extra <= 0:
        return msg
    return SparseMessage(torch.cat([msg.values, msg.values.new_zeros(extra)]),
                         torch.cat([msg.indices, msg.indices.new_zeros(extra)]), msg.count.clamp(max=msg.k), msg.numel,
                         msg.stats)

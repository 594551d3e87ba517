"""Kernels written with plain torch operations, on any device: what the backends without a kernel of their own for
an op run (gtopk_ext/backends.py). Each takes its op's schema arguments and runs the op's checks first."""

from __future__ import annotations

import torch

from gtopk_ext._contract import check_args


def merge_topk(indices_a: torch.Tensor, values_a: torch.Tensor, indices_b: torch.Tensor, values_b: torch.Tensor,
               k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """merge_topk (csrc/ops.cpp) with torch's unique and sort, which are fast on GPUs."""
    check_args("merge_topk", indices_a, values_a, indices_b, values_b, k)
    union, inverse = torch.unique(torch.cat([indices_a, indices_b]), sorted=True, return_inverse=True)
    sums = torch.zeros(union.numel(), dtype=torch.float32, device=union.device)
    sums.index_add_(0, inverse, torch.cat([values_a, values_b]).float())
    union_size = union.numel()
    if union_size > k:
        # A stable sort keeps equal magnitudes in index order, so the lower index wins a tie.
        keep = torch.sort(sums.abs(), descending=True, stable=True).indices[:k].sort().values
        union, sums = union[keep], sums[keep]
    indices = torch.zeros(k, dtype=torch.int32, device=union.device)
    values = torch.zeros(k, dtype=values_a.dtype, device=union.device)
    indices[:union.numel()] = union
    values[:union.numel()] = sums.to(values_a.dtype)
    return indices, values, torch.tensor([union_size], dtype=torch.int32, device=union.device)

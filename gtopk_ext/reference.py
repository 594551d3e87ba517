"""Plain-PyTorch versions of every gtopk_ext op, with the semantics of the op of the same name in csrc/ops.cpp
(in-place updates included): slow, obvious, and the oracle of the tests."""

from __future__ import annotations

import numpy as np
import torch

from gtopk_ext import _contract
from gtopk_ext._contract import (FINE_SHIFT, HIST_BINS, HIST_INF_KEY, HIST_SHIFT, NUM_STATS,  # noqa: F401
                                 STAT_GAUSSIAN_THRESHOLD, STAT_MAX_ABS, STAT_MEAN, STAT_STD, STAT_THRESHOLD)


def _bits_to_float(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def histogram(acc: torch.Tensor) -> torch.Tensor:
    """int64[HIST_BINS] counts of |acc| (as float32) by bit-pattern bin; NaNs are not counted."""
    magnitude = acc.detach().float().abs().flatten()
    magnitude = magnitude[~torch.isnan(magnitude)]
    keys = (magnitude.view(torch.int32) >> HIST_SHIFT).long()
    return torch.bincount(keys, minlength=HIST_BINS)


def threshold_from_histogram(counts: torch.Tensor, k: int, max_abs: float) -> float:
    """The bin where the count from the top reaches k, interpolated linearly; see csrc/histogram.h."""
    from_top = counts.flip(0).cumsum(0).flip(0)  # from_top[b] = elements in bins >= b
    reaching = torch.nonzero(from_top >= k).flatten()
    if reaching.numel() == 0:
        return 0.0
    b = int(reaching[-1])
    if b == HIST_INF_KEY:
        return float("inf")
    in_bin = int(counts[b])
    above = int(from_top[b]) - in_bin
    lo = _bits_to_float(b << HIST_SHIFT)
    hi = _bits_to_float((b + 1) << HIST_SHIFT)
    threshold = np.float32(hi - (hi - lo) * (k - above) / in_bin)
    max_abs32 = np.float32(max_abs)
    if b == (int(np.array([max_abs32]).view(np.uint32)[0]) >> HIST_SHIFT) and threshold > max_abs32:
        threshold = max_abs32
    return float(threshold)


def gaussian_threshold(grad: torch.Tensor, residual: torch.Tensor | None, z: float, k: int) -> torch.Tensor:
    acc = residual.add_(grad) if residual is not None else grad
    values = acc.detach().double().flatten()
    n = values.numel()
    mean = values.mean().item() if n else 0.0
    std = values.std(correction=0).item() if n else 0.0
    magnitude = acc.detach().float().abs().flatten()
    finite_or_inf = magnitude[~torch.isnan(magnitude)]
    max_abs = float(finite_or_inf.max()) if finite_or_inf.numel() else 0.0
    gaussian = float(np.float32(abs(mean) + z * std))
    threshold = threshold_from_histogram(histogram(acc), k, max_abs) if k > 0 else gaussian
    # In the order of the STAT_* indices.
    return torch.tensor([mean, std, max_abs, gaussian, threshold], dtype=torch.float32).to(grad.device)


def sure_threshold(threshold: float) -> float:
    """The upper edge of the threshold's histogram bin (itself for NaN, negative or infinite thresholds)."""
    if not threshold >= 0.0:
        return threshold
    key = int(np.array([threshold], dtype=np.float32).view(np.uint32)[0]) >> HIST_SHIFT
    return threshold if key >= HIST_INF_KEY else _bits_to_float((key + 1) << HIST_SHIFT)


def compact(acc: torch.Tensor, threshold: torch.Tensor, capacity: int):
    flat = acc.detach().flatten()
    magnitude = flat.float().abs()
    thr = float(threshold.float().flatten()[0])
    selected = torch.nonzero(magnitude >= thr).flatten()
    sure = torch.nonzero(magnitude >= sure_threshold(thr)).flatten()
    if selected.numel() <= capacity:
        kept = selected
    elif sure.numel() >= capacity:
        kept = sure[:capacity]
    else:
        boundary = selected[~torch.isin(selected, sure)]
        kept = torch.cat([sure, boundary[: capacity - sure.numel()]]).sort().values
    values = torch.zeros(capacity, dtype=acc.dtype, device=acc.device)
    indices = torch.zeros(capacity, dtype=torch.int32, device=acc.device)
    values[: kept.numel()] = flat[kept]
    indices[: kept.numel()] = kept.int()
    count = torch.tensor([selected.numel()], dtype=torch.int32, device=acc.device)
    return values, indices, count


def refined_threshold(acc: torch.Tensor, threshold: float, k: int) -> float:
    """Within the threshold's histogram bin, the lower edge of the sub-bin (32 float patterns) holding the k-th
    largest |acc| (csrc/histogram.h fine_threshold): by sorting that bin's magnitudes rather than counting."""
    if not 0.0 < threshold < float("inf"):
        return threshold
    bits = acc.detach().float().abs().flatten()
    bits = bits[~torch.isnan(bits)].view(torch.int32).long()
    b = int(np.array([threshold], dtype=np.float32).view(np.int32)[0]) >> HIST_SHIFT
    above = int(((bits >> HIST_SHIFT) > b).sum())
    if above >= k:
        return _bits_to_float((b + 1) << HIST_SHIFT)
    in_bin = bits[(bits >> HIST_SHIFT) == b].sort(descending=True).values
    if in_bin.numel() < k - above:
        return _bits_to_float(b << HIST_SHIFT)
    return _bits_to_float(int(in_bin[k - above - 1]) >> FINE_SHIFT << FINE_SHIFT)


def gaussian_select(grad: torch.Tensor, residual: torch.Tensor | None, z: float, k: int, capacity: int,
                    update_residual: bool = False):
    """With ``update_residual`` (and a residual), what was selected leaves the residual as residual_update makes
    it leave: each stored element becomes acc - value (+0.0; NaN for an infinity), the padding changes nothing."""
    stats = gaussian_threshold(grad, residual, z, k)
    acc = residual if residual is not None else grad
    stats[STAT_THRESHOLD] = refined_threshold(acc, float(stats[STAT_THRESHOLD]), k)
    values, indices, count = compact(acc, stats[STAT_THRESHOLD:STAT_THRESHOLD + 1], capacity)
    if update_residual and residual is not None:
        residual_update(residual, indices, values)
    return values, indices, count, stats


def merge_topk(indices_a: torch.Tensor, values_a: torch.Tensor, indices_b: torch.Tensor, values_b: torch.Tensor,
               k: int):
    """Every slot's value added to its index's float32 sum in slot order; the k best by (NaN first, larger |sum|,
    lower index), by index, rounded to values_a's dtype, padded with (0, 0); and the number of distinct indices."""
    sums: dict[int, np.float32] = {}
    slots = zip(torch.cat([indices_a, indices_b]).tolist(), torch.cat([values_a, values_b]).float().tolist())
    for index, value in slots:
        sums[index] = np.float32(sums.get(index, np.float32(0.0)) + np.float32(value))

    def rank(index: int) -> tuple:
        nan = bool(np.isnan(sums[index]))
        return (not nan, 0.0 if nan else -abs(float(sums[index])), index)

    kept = sorted(sorted(sums, key=rank)[:k])
    indices = torch.zeros(k, dtype=torch.int32)
    values = torch.zeros(k, dtype=values_a.dtype)
    indices[:len(kept)] = torch.tensor(kept, dtype=torch.int32)
    values[:len(kept)] = torch.tensor([float(sums[i]) for i in kept], dtype=torch.float32).to(values_a.dtype)
    device = indices_a.device
    return indices.to(device), values.to(device), torch.tensor([len(sums)], dtype=torch.int32, device=device)


def _signed_scatter(dense: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, sign: float) -> torch.Tensor:
    """Duplicates in slot order (a stable sort by index), summed in float32 from dense's value, one rounding per
    index; a run of equal indices over several tiles of ``_contract.SCATTER_TILE`` sorted slots sums each tile's
    piece from -0.0 and adds the pieces in order, as the GPU kernels do."""
    flat = dense.view(-1)
    n = flat.numel()
    order = sorted(range(indices.numel()), key=indices.tolist().__getitem__)
    sorted_indices = [int(indices[j]) for j in order]
    sorted_values = [np.float32(sign) * np.float32(v) for v in values.float()[order].tolist()] if order else []
    accumulated = flat.float().tolist()
    invalid = 0
    run_total = piece = np.float32(0.0)
    for slot, index in enumerate(sorted_indices):
        if not 0 <= index < n:
            invalid += 1
            continue
        if slot == 0 or sorted_indices[slot - 1] != index:  # a run starts: its first piece from dense's value
            run_total, piece = np.float32(-0.0), np.float32(accumulated[index])
        elif slot % _contract.SCATTER_TILE == 0:  # the run enters a new tile: a new piece
            run_total, piece = np.float32(run_total + piece), np.float32(-0.0)
        piece = np.float32(piece + sorted_values[slot])
        if slot + 1 == len(sorted_indices) or sorted_indices[slot + 1] != index:
            accumulated[index] = float(np.float32(run_total + piece))
    flat.copy_(torch.tensor(accumulated, dtype=torch.float32).to(dense.dtype))
    return torch.tensor([invalid], dtype=torch.int32, device=dense.device)


def scatter_add(dense: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return _signed_scatter(dense, indices, values, 1.0)


def residual_update(residual: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return _signed_scatter(residual, indices, values, -1.0)


def _wire_pow2(e: int) -> np.float32:
    return np.float32(_bits_to_float((e + 127) << 23))


def _wire_value(half_bits: int, shift: int) -> np.float32:
    half = np.float32(np.array([half_bits], dtype=np.uint16).view(np.float16)[0])
    if np.isnan(half):
        return np.array([_contract.WIRE_FLOAT_NAN], dtype=np.uint32).view(np.float32)[0]
    return half * _wire_pow2(-shift)


def wire_encode(indices: torch.Tensor, values: torch.Tensor, count: torch.Tensor, numel: int):
    """The compact wire's encoding of the used slots (csrc/wire_format.h), slot by slot."""
    k = values.numel()
    used = min(max(int(count.flatten()[0]), 0), k)
    vals = [np.float32(v) for v in values.float().tolist()[:used]]
    idx = indices.tolist()[:used]
    finite = [abs(v) for v in vals if np.isfinite(v)]
    max_abs = np.float32(max(finite) if finite else 0.0)
    shift = min(_contract.WIRE_SHIFT_MAX,
                _contract.WIRE_SHIFT_BASE - (int(np.array([max_abs]).view(np.uint32)[0]) >> 23))
    halves = np.zeros(k, dtype=np.uint16)
    low = np.zeros(k, dtype=np.uint16)
    for j, (index, value) in enumerate(zip(idx, vals)):
        if np.isnan(value):
            halves[j] = _contract.WIRE_HALF_NAN
        else:
            with np.errstate(over="ignore"):
                bits = int(np.array([value * _wire_pow2(shift)], dtype=np.float32).astype(np.float16)
                           .view(np.uint16)[0])
                if np.isinf(_wire_value(bits, shift)) and not np.isinf(value):  # round toward zero instead
                    bits -= 1
            halves[j] = bits
        low[j] = index & 0xFFFF
    pages = [sum(1 for index in idx if index < (p << _contract.WIRE_PAGE_SHIFT))
             for p in range(_contract.wire_num_pages(numel) + 1)]
    device = values.device
    return (torch.from_numpy(halves.view(np.float16)).to(device), torch.from_numpy(low.view(np.int16)).to(device),
            torch.tensor(pages, dtype=torch.int32, device=device),
            torch.tensor([shift], dtype=torch.int32, device=device))


def wire_decode(halves: torch.Tensor, low: torch.Tensor, pages: torch.Tensor, shift: torch.Tensor, count: torch.Tensor,
                numel: int):
    """The compact wire's decoding and its checks (csrc/ops.cpp), slot by slot."""
    k = halves.numel()
    used = min(max(int(count.flatten()[0]), 0), k)
    table = pages.tolist()
    num_pages = len(table) - 1
    s = int(shift.flatten()[0])
    invalid = 0
    if abs(s) > _contract.WIRE_SHIFT_MAX:
        invalid, s = 1, 0
    for p, entry in enumerate(table):
        invalid += int(entry < 0 or entry > used or (p == 0 and entry != 0) or (p == num_pages and entry != used)
                       or (p > 0 and entry < table[p - 1]))

    def page_of(slot: int) -> int:  # the last page p < num_pages with table[p] <= slot (a binary search, as C++)
        lo, hi = 0, num_pages - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if table[mid] <= slot else (lo, mid - 1)
        return lo

    half_bits = halves.cpu().view(torch.int16).numpy().view(np.uint16)
    low_bits = low.cpu().numpy().view(np.uint16)
    indices = torch.zeros(k, dtype=torch.int32)
    values = torch.zeros(k, dtype=torch.float32)
    for j in range(used):
        page = page_of(j)
        index = (page << _contract.WIRE_PAGE_SHIFT) | int(low_bits[j])
        unsorted = j > 0 and page_of(j - 1) == page and low_bits[j - 1] > low_bits[j]
        if index >= numel or unsorted:
            invalid += 1
            continue
        indices[j] = index
        values[j] = float(_wire_value(int(half_bits[j]), s))
    device = halves.device
    return indices.to(device), values.to(device), torch.tensor([invalid], dtype=torch.int32, device=device)

"""The Triton kernels behind gtopk_ext.triton_kernels.ops (semantics: csrc/ops.cpp; shared rules: csrc/*.h).

Tuning (one config per kernel: a multi-config autotune cannot run without a GPU). The passes over the data are
memory-bound, so a block of 4096 elements with 4 warps gives each thread 32 elements (eight 16-byte loads of
fp32) and leaves enough blocks in flight on an A100/H100 from about 1M elements up. The finishing kernel runs
one program over the 8192 histogram bins, so it uses 8 warps (32 bins a thread). Under TRITON_INTERPRET=1 a
program instance costs milliseconds, which these large blocks also keep low.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gtopk_ext import _contract

# Slots of the statistics tensor (gtopk_ext/_contract.py, csrc/layout.h), as constants of the kernels.
STAT_MEAN = tl.constexpr(_contract.STAT_MEAN)
STAT_STD = tl.constexpr(_contract.STAT_STD)
STAT_MAX_ABS = tl.constexpr(_contract.STAT_MAX_ABS)
STAT_GAUSSIAN_THRESHOLD = tl.constexpr(_contract.STAT_GAUSSIAN_THRESHOLD)
STAT_THRESHOLD = tl.constexpr(_contract.STAT_THRESHOLD)

# Elements per program of the passes over the data, and their warps (see the module docstring).
BLOCK = 4096
NUM_WARPS = 4
# The finishing kernel reduces the per-block partials this many at a time.
PARTIAL_BLOCK = 1024
FINISH_NUM_WARPS = 8

# Programs add into one of this many copies of the histogram (program id modulo), so that the hot bins of a
# bell-shaped gradient see a few times less contention on the same address; the finishing kernel sums them.
# Every atomic is relaxed: only sums are needed, and the kernel boundary orders them before any read.
HIST_COPIES = 8
# Each program first counts its block in a histogram of its own (tl.histogram: registers and shared memory) over
# this many bins, the window that ends at the block's largest key (8 octaves of magnitude: nearly every element of a
# gradient-like block), and adds it to the global one with one atomic per bin that holds any; only the elements
# below the window (the smallest magnitudes; every finite one in a block that holds an infinity) take one global
# atomic each. fine_count_kernel keeps one atomic per element of the threshold's bin, a few per program.
LOCAL_BINS = 256


@triton.jit
def to_float32(x):
    """x widened to fp32 (exact). bf16 by hand, its bits being the top half of fp32's, because the interpreter's
    bf16 -> fp32 cast loses subnormals; on a GPU this is the same shift the hardware does."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def round_to_dtype(x, dtype: tl.constexpr):
    """fp32 x rounded to nearest even in dtype. bf16 is rounded by hand (as c10::BFloat16 does) because the
    interpreter's fp32 -> bf16 cast truncates; on a GPU this costs a few integer operations."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)  # NaN stays a (quiet) NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def moments_histogram_kernel(grad_ptr, residual_ptr, shift_ptr, partial_sum_ptr, partial_sum_sq_ptr,
                             partial_max_ptr, histogram_ptr, n, HAS_RESIDUAL: tl.constexpr,
                             USE_HISTOGRAM: tl.constexpr, HIST_COPIES: tl.constexpr, HIST_BINS: tl.constexpr,
                             HIST_SHIFT: tl.constexpr, LOCAL_BINS: tl.constexpr, BLOCK: tl.constexpr):
    """One block of acc = grad (+ residual, stored back rounded to the dtype): fp64 sums of acc - shift and of
    its square, max |acc| ignoring NaN, and the histogram counts of |acc| (NaN not counted), through the
    program's own histogram of LOCAL_BINS bins (see LOCAL_BINS).

    shift = grad[0] (0 when empty or not finite; program 0 stores it for the finishing kernel): moments about
    a sample keep the variance of values whose |mean| dwarfs their spread (equal values give exactly 0). grad,
    not acc, because the residual is being overwritten while the programs read it."""
    pid = tl.program_id(0)
    first = tl.load(grad_ptr, mask=n > 0, other=0.0).to(tl.float32)
    shift = tl.where(tl.abs(first) < float("inf"), first, 0.0).to(tl.float64)
    if pid == 0:
        tl.store(shift_ptr, shift)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < n
    grad = tl.load(grad_ptr + offsets, mask=in_range, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + offsets, mask=in_range, other=0.0)
        # Sum in fp32, round once to the dtype: what the C++ kernels and torch's add_ do.
        acc_stored = round_to_dtype(to_float32(residual) + to_float32(grad), grad.dtype)
        tl.store(residual_ptr + offsets, acc_stored, mask=in_range)
    else:
        acc_stored = grad
    acc = to_float32(acc_stored)
    centred = tl.where(in_range, acc.to(tl.float64) - shift, 0.0)
    tl.store(partial_sum_ptr + pid, tl.sum(centred, axis=0))
    tl.store(partial_sum_sq_ptr + pid, tl.sum(centred * centred, axis=0))
    magnitude = tl.abs(acc)
    not_nan = magnitude == magnitude
    tl.store(partial_max_ptr + pid, tl.max(tl.where(not_nan, magnitude, 0.0), axis=0))
    if USE_HISTOGRAM:
        key = magnitude.to(tl.int32, bitcast=True) >> HIST_SHIFT  # at most HIST_INF_KEY where not NaN
        counted = in_range & not_nan
        low = tl.maximum(tl.max(tl.where(counted, key, 0), axis=0) - (LOCAL_BINS - 1), 0)
        local = counted & (key >= low)
        # tl.histogram counts every lane: those outside the window go to bin 0 and are taken off it again (its
        # mask argument is not in every Triton this must run with).
        bins = tl.arange(0, LOCAL_BINS)
        counts = tl.histogram(tl.where(local, key - low, 0), LOCAL_BINS)
        counts -= tl.where(bins == 0, tl.sum((~local).to(tl.int32), axis=0), 0)
        histogram_ptr += (pid % HIST_COPIES) * HIST_BINS
        tl.atomic_add(histogram_ptr + low + bins, counts, mask=counts > 0, sem="relaxed")
        tl.atomic_add(histogram_ptr + key, 1, mask=counted & ~local, sem="relaxed")


@triton.jit
def finish_stats_kernel(shift_ptr, partial_sum_ptr, partial_sum_sq_ptr, partial_max_ptr, num_partials,
                        histogram_ptr, stats_ptr, n, z: tl.float64, k, USE_HISTOGRAM: tl.constexpr,
                        HIST_COPIES: tl.constexpr, HIST_BINS: tl.constexpr, HIST_SHIFT: tl.constexpr,
                        HIST_INF_KEY: tl.constexpr, PARTIAL_BLOCK: tl.constexpr):
    """One program: merges the partials into the float32 stats (mean, std, max|acc|, Gaussian threshold,
    threshold) with the arithmetic of csrc/cpu/threshold.cpp and csrc/histogram.h threshold_from_histogram."""
    lanes = tl.arange(0, PARTIAL_BLOCK)
    sum_lanes = tl.zeros([PARTIAL_BLOCK], dtype=tl.float64)
    sum_sq_lanes = tl.zeros([PARTIAL_BLOCK], dtype=tl.float64)
    max_lanes = tl.zeros([PARTIAL_BLOCK], dtype=tl.float32)
    for start in range(0, num_partials, PARTIAL_BLOCK):
        mask = start + lanes < num_partials
        sum_lanes += tl.load(partial_sum_ptr + start + lanes, mask=mask, other=0.0)
        sum_sq_lanes += tl.load(partial_sum_sq_ptr + start + lanes, mask=mask, other=0.0)
        max_lanes = tl.maximum(max_lanes, tl.load(partial_max_ptr + start + lanes, mask=mask, other=0.0))
    total = tl.sum(sum_lanes, axis=0)
    total_sq = tl.sum(sum_sq_lanes, axis=0)
    max_abs = tl.max(max_lanes, axis=0)  # the partials are never NaN

    # n = 0: the sums are 0 and so are the moments. (zeros + n: n may be the constant 1 Triton specializes.)
    count = tl.maximum(tl.zeros([], dtype=tl.float64) + n, 1.0)
    centred_mean = total / count
    mean = tl.load(shift_ptr) + centred_mean
    variance = total_sq / count - centred_mean * centred_mean
    variance = tl.where(variance < 0.0, 0.0, variance)  # rounding; NaN (from inf/NaN input) stays NaN
    std = tl.sqrt(variance)
    gaussian = (tl.abs(mean) + z * std).to(tl.float32)
    tl.store(stats_ptr + STAT_MEAN, mean.to(tl.float32))
    tl.store(stats_ptr + STAT_STD, std.to(tl.float32))
    tl.store(stats_ptr + STAT_MAX_ABS, max_abs)
    tl.store(stats_ptr + STAT_GAUSSIAN_THRESHOLD, gaussian)

    if USE_HISTOGRAM:
        bins = tl.arange(0, HIST_BINS)
        counts = tl.load(histogram_ptr + bins)
        for copy in tl.static_range(1, HIST_COPIES):
            counts += tl.load(histogram_ptr + copy * HIST_BINS + bins)
        counts = counts.to(tl.int64)
        from_top = tl.cumsum(counts, axis=0, reverse=True)  # elements in bins >= b
        # The highest bin where the count from the top reaches k (-1: fewer than k non-NaN elements).
        crossing = tl.max(tl.where((from_top >= k) & (bins <= HIST_INF_KEY), bins, -1), axis=0)
        in_bin = tl.sum(tl.where(bins == crossing, counts, 0), axis=0)
        above = tl.sum(tl.where(bins == crossing, from_top, 0), axis=0) - in_bin
        lo = (crossing << HIST_SHIFT).to(tl.float32, bitcast=True).to(tl.float64)
        hi = ((crossing + 1) << HIST_SHIFT).to(tl.float32, bitcast=True).to(tl.float64)
        needed = (k - above).to(tl.float64)
        safe_in_bin = tl.where(in_bin > 0, in_bin, 1).to(tl.float64)
        # Same operations in the same order as csrc/histogram.h, all in fp64, one rounding to fp32 at the end.
        threshold = (hi - (hi - lo) * needed / safe_in_bin).to(tl.float32)
        max_key = max_abs.to(tl.int32, bitcast=True) >> HIST_SHIFT
        threshold = tl.where((crossing == max_key) & (threshold > max_abs), max_abs, threshold)
        threshold = tl.where(crossing == HIST_INF_KEY, float("inf"), threshold)
        threshold = tl.where(crossing < 0, 0.0, threshold)
        tl.store(stats_ptr + STAT_THRESHOLD, threshold)
    else:
        tl.store(stats_ptr + STAT_THRESHOLD, gaussian)


@triton.jit
def refinable_bin(threshold, HIST_SHIFT: tl.constexpr, HIST_INF_KEY: tl.constexpr):
    """The histogram bin of a threshold that gaussian_select refines (csrc/histogram.h refinable: positive and
    finite), else 1 << 30, a bin above every key."""
    bin = threshold.to(tl.int32, bitcast=True) >> HIST_SHIFT
    return tl.where((threshold > 0.0) & (bin < HIST_INF_KEY), bin, 1 << 30)


@triton.jit
def fine_count_kernel(acc_ptr, stats_ptr, fine_ptr, n, HIST_SHIFT: tl.constexpr, HIST_INF_KEY: tl.constexpr,
                      FINE_SHIFT: tl.constexpr, FINE_BINS: tl.constexpr, BLOCK: tl.constexpr):
    """gaussian_select's second level (csrc/histogram.h fine_threshold) for one block: adds the count of |acc| above
    the threshold's histogram bin into fine_ptr[FINE_BINS] and those in it by sub-bin into fine_ptr[sub-bin]."""
    bin = refinable_bin(tl.load(stats_ptr + STAT_THRESHOLD), HIST_SHIFT, HIST_INF_KEY)  # not refinable: nothing counted
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < n
    magnitude = tl.abs(to_float32(tl.load(acc_ptr + offsets, mask=in_range, other=0.0)))
    bits = magnitude.to(tl.int32, bitcast=True)
    counted = in_range & (magnitude == magnitude)
    key = bits >> HIST_SHIFT
    tl.atomic_add(fine_ptr + FINE_BINS, tl.sum((counted & (key > bin)).to(tl.int32), axis=0), sem="relaxed")
    sub_bin = (bits >> FINE_SHIFT) & (FINE_BINS - 1)
    tl.atomic_add(fine_ptr + sub_bin, 1, mask=counted & (key == bin), sem="relaxed")


@triton.jit
def fine_finish_kernel(stats_ptr, fine_ptr, k, HIST_SHIFT: tl.constexpr, HIST_INF_KEY: tl.constexpr,
                       FINE_SHIFT: tl.constexpr, FINE_BINS: tl.constexpr):
    """One program: stats[STAT_THRESHOLD] becomes the refined threshold, the lower edge of the highest sub-bin at
    which the count from the top reaches k (csrc/histogram.h sub_bin_reaching)."""
    threshold = tl.load(stats_ptr + STAT_THRESHOLD)
    bin = refinable_bin(threshold, HIST_SHIFT, HIST_INF_KEY)
    sub_bins = tl.arange(0, FINE_BINS)
    above = tl.load(fine_ptr + FINE_BINS).to(tl.int64)
    from_top = tl.cumsum(tl.load(fine_ptr + sub_bins).to(tl.int64), axis=0, reverse=True) + above
    sub_bin = tl.max(tl.where(from_top >= k, sub_bins, 0), axis=0)  # from_top falls with the sub-bin
    sub_bin = tl.where(above >= k, FINE_BINS, sub_bin)
    refined = ((bin << HIST_SHIFT) + (sub_bin << FINE_SHIFT)).to(tl.float32, bitcast=True)
    tl.store(stats_ptr + STAT_THRESHOLD, tl.where(bin < HIST_INF_KEY, refined, threshold))


@triton.jit
def candidates(acc_ptr, threshold_ptr, offsets, n, HIST_SHIFT: tl.constexpr, HIST_INF_KEY: tl.constexpr):
    """(acc, sure, boundary) of a block: boundary elements have threshold <= |acc| < the upper edge of the
    threshold's histogram bin, sure ones |acc| >= that edge (csrc/histogram.h sure_threshold). NaN is neither."""
    threshold = tl.load(threshold_ptr)
    key = threshold.to(tl.uint32, bitcast=True) >> HIST_SHIFT  # as unsigned as in C++: -0.0 gets a high key
    upper_edge = ((key + 1) << HIST_SHIFT).to(tl.float32, bitcast=True)
    sure_threshold = tl.where((threshold >= 0.0) & (key < HIST_INF_KEY), upper_edge, threshold)
    in_range = offsets < n
    acc = tl.load(acc_ptr + offsets, mask=in_range, other=0.0)
    magnitude = tl.abs(to_float32(acc))
    sure = in_range & (magnitude >= sure_threshold)
    boundary = in_range & (magnitude >= threshold) & ~sure
    return acc, sure, boundary


@triton.jit
def count_candidates_kernel(acc_ptr, threshold_ptr, block_counts_ptr, n, HIST_SHIFT: tl.constexpr,
                            HIST_INF_KEY: tl.constexpr, BLOCK: tl.constexpr):
    """block_counts[0, b] / [1, b] = how many sure / boundary elements block b holds."""
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _, sure, boundary = candidates(acc_ptr, threshold_ptr, offsets, n, HIST_SHIFT, HIST_INF_KEY)
    tl.store(block_counts_ptr + pid, tl.sum(sure.to(tl.int32), axis=0))
    tl.store(block_counts_ptr + tl.num_programs(0) + pid, tl.sum(boundary.to(tl.int32), axis=0))


@triton.jit
def write_selected_kernel(acc_ptr, threshold_ptr, block_counts_ptr, block_ends_ptr, values_ptr, indices_ptr,
                          count_ptr, n, capacity, HIST_SHIFT: tl.constexpr, HIST_INF_KEY: tl.constexpr,
                          UPDATE_ACC: tl.constexpr, BLOCK: tl.constexpr):
    """Writes block b's kept candidates in index order. block_ends = inclusive scans of block_counts' rows,
    so the scans' last entries are the totals. The first min(sure total, capacity) sure elements are kept
    and the first (capacity - that) boundary ones; an element's slot is the number of kept elements before it.
    The last block writes the count of all candidates. UPDATE_ACC (acc is the residual): each kept element
    becomes acc - value in fp32, rounded once, as residual_update computes it (+0.0; NaN for an infinity)."""
    pid = tl.program_id(0)
    num_blocks = tl.num_programs(0)
    sure_end = tl.load(block_ends_ptr + pid)
    boundary_end = tl.load(block_ends_ptr + num_blocks + pid)
    sure_start = sure_end - tl.load(block_counts_ptr + pid)
    boundary_start = boundary_end - tl.load(block_counts_ptr + num_blocks + pid)
    sure_total = tl.load(block_ends_ptr + num_blocks - 1)
    boundary_total = tl.load(block_ends_ptr + 2 * num_blocks - 1)
    sure_slots = tl.minimum(sure_total, capacity)
    boundary_slots = capacity - sure_slots
    if pid == num_blocks - 1:
        tl.store(count_ptr, sure_total + boundary_total)
    # Most blocks of a sparse selection hold nothing to keep and skip the second read.
    if ((sure_start < sure_end) & (sure_start < sure_slots)) | (
            (boundary_start < boundary_end) & (boundary_start < boundary_slots)):
        offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc, sure, boundary = candidates(acc_ptr, threshold_ptr, offsets, n, HIST_SHIFT, HIST_INF_KEY)
        sure_before = sure_start + tl.cumsum(sure.to(tl.int32), axis=0) - sure.to(tl.int32)
        boundary_before = boundary_start + tl.cumsum(boundary.to(tl.int32), axis=0) - boundary.to(tl.int32)
        kept = (sure & (sure_before < sure_slots)) | (boundary & (boundary_before < boundary_slots))
        slots = tl.minimum(sure_before, sure_slots) + tl.minimum(boundary_before, boundary_slots)
        tl.store(values_ptr + slots, acc, mask=kept)
        tl.store(indices_ptr + slots, offsets.to(tl.int32), mask=kept)
        if UPDATE_ACC:
            acc32 = to_float32(acc)
            tl.store(acc_ptr + offsets, round_to_dtype(acc32 - acc32, acc.dtype), mask=kept)


@triton.jit
def count_invalid(indices, in_range, n_dense, invalid_ptr):
    """Adds to invalid_ptr[0] how many in-range indices fall outside [0, n_dense); returns the valid mask."""
    valid = in_range & (indices >= 0) & (indices < n_dense)
    invalid = tl.sum((in_range & ~valid).to(tl.int32), axis=0)
    tl.atomic_add(invalid_ptr, invalid, mask=invalid > 0, sem="relaxed")
    return valid


@triton.jit
def piece_sums_kernel(dense_ptr, sorted_indices_ptr, order_ptr, values_ptr, piece_sums_ptr, n_dense, m,
                      SIGN: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """Deterministic scatter, first level: a piece is the slots of one index inside one tile of TILE sorted slots;
    the lane at a piece's first slot sums the piece in slot order in fp32 into piece_sums at that slot. The first
    piece of a run of equal indices starts from dense's value, the others from -0.0 (x + -0.0 is x). The loop runs
    as often as the block's longest piece: the duplicates of one index, a few per rank."""
    slots = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = slots < m
    index = tl.load(sorted_indices_ptr + slots, mask=live, other=0)
    previous = tl.load(sorted_indices_ptr + slots - 1, mask=live & (slots > 0), other=0)
    run_start = live & ((slots == 0) | (index != previous))
    piece_first = run_start | (live & (slots % TILE == 0))
    reads_dense = run_start & (index >= 0) & (index < n_dense)
    acc = tl.where(reads_dense, to_float32(tl.load(dense_ptr + index, mask=reads_dense, other=0.0)), -0.0)
    value = to_float32(tl.load(values_ptr + tl.load(order_ptr + slots, mask=piece_first, other=0),
                               mask=piece_first, other=0.0))
    acc = acc + SIGN * value
    slot = slots + 1
    going = piece_first & (slot < m) & (slot % TILE != 0)
    going = going & (tl.load(sorted_indices_ptr + slot, mask=going, other=-1) == index)
    while tl.max(going.to(tl.int32), axis=0) > 0:
        value = to_float32(tl.load(values_ptr + tl.load(order_ptr + slot, mask=going, other=0), mask=going,
                                   other=0.0))
        acc = tl.where(going, acc + SIGN * value, acc)
        slot += 1
        going = going & (slot < m) & (slot % TILE != 0)
        going = going & (tl.load(sorted_indices_ptr + slot, mask=going, other=-1) == index)
    tl.store(piece_sums_ptr + slots, acc, mask=piece_first)


@triton.jit
def apply_run_sums_kernel(dense_ptr, sorted_indices_ptr, piece_sums_ptr, invalid_ptr, n_dense, m,
                          TILE: tl.constexpr, BLOCK: tl.constexpr):
    """Deterministic scatter, second level: at the first slot of each run of equal sorted indices, the run's
    pieces (its first one, then one per later tile it reaches, in order) are added in fp32 and written to dense
    with one rounding; no two lanes write the same element and no atomics touch floats."""
    slots = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = slots < m
    index = tl.load(sorted_indices_ptr + slots, mask=live, other=0)
    previous = tl.load(sorted_indices_ptr + slots - 1, mask=live & (slots > 0), other=0)
    valid = count_invalid(index, live, n_dense, invalid_ptr)
    run_start = valid & ((slots == 0) | (index != previous))
    total = tl.load(piece_sums_ptr + slots, mask=run_start, other=0.0)
    next_tile = (slots // TILE + 1) * TILE
    going = run_start & (next_tile < m)
    going = going & (tl.load(sorted_indices_ptr + next_tile, mask=going, other=-1) == index)
    while tl.max(going.to(tl.int32), axis=0) > 0:
        total += tl.load(piece_sums_ptr + next_tile, mask=going, other=0.0)
        next_tile += TILE
        going = going & (next_tile < m)
        going = going & (tl.load(sorted_indices_ptr + next_tile, mask=going, other=-1) == index)
    dense = tl.load(dense_ptr + index, mask=run_start, other=0.0)
    tl.store(dense_ptr + index, round_to_dtype(total, dense.dtype), mask=run_start)

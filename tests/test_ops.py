"""Every op against gtopk_ext/reference.py, on every backend this machine can run.

Backends: "cpu" (the C++ kernels) always; "triton" under TRITON_INTERPRET=1 (CPU tensors) or on a GPU; "cuda"
where torch.cuda.is_available().
"""

from __future__ import annotations

import os

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gtopk_ext as gx
from gtopk_ext import backends, ops, reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def available_backends() -> list[str]:
    backends = ["cpu"]
    if torch.cuda.is_available():
        backends.append("cuda")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        backends.append("triton")
    return backends


BACKENDS = available_backends()


def backend_device(backend: str) -> torch.device:
    if backend == "cuda" or (backend == "triton" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


# The Triton interpreter (Triton on CPU tensors) runs a kernel at numpy's pace, block by block: there the sweeps of
# many small cases stop at this size, and the many-block inputs are the *_large tests' (millions of elements).
INTERPRETED_MAX_NUMEL = 5000


def interpreted(backend: str) -> bool:
    """Whether ``backend`` runs under the Triton interpreter (slow: the cases are thinned)."""
    return backend == "triton" and backend_device(backend).type == "cpu"


def case_sizes(backend: str, sizes) -> list[int]:
    """``sizes``, less those over INTERPRETED_MAX_NUMEL under the Triton interpreter."""
    return [n for n in sizes if not interpreted(backend) or n <= INTERPRETED_MAX_NUMEL]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


# Shapes a selection threshold must cope with: light and heavy tails, a few spikes that inflate the deviation the
# Gaussian threshold relies on, and magnitudes whose spread is small next to their size.
SYNTHETIC = ("gaussian", "laplace", "student_t3", "spiky", "offset")


def make_values(kind: str, n: int, generator: torch.Generator) -> torch.Tensor:
    """Gradient-like distributions (SYNTHETIC) and the edge cases of the kernels."""
    if kind == "gaussian":
        return torch.randn(n, generator=generator)
    if kind == "laplace":  # the difference of two standard exponentials
        return torch.empty(n).exponential_(generator=generator) - torch.empty(n).exponential_(generator=generator)
    if kind == "student_t3":  # N(0, 1) over the root of an independent chi-squared(3) / 3
        return torch.randn(n, generator=generator) / torch.randn(n, 3, generator=generator).square().mean(1).sqrt()
    if kind == "spiky":  # 1% of the elements 50x larger
        return torch.randn(n, generator=generator) * torch.where(torch.rand(n, generator=generator) < 0.01, 50.0, 1.0)
    if kind == "offset":
        return torch.randn(n, generator=generator) + 30
    if kind == "all_equal":
        return torch.full((n,), -0.75)
    if kind == "all_zero":
        return torch.zeros(n)
    if kind == "ties":  # few distinct magnitudes: many ties at any threshold
        return torch.randint(-3, 4, (n,), generator=generator).float() * 0.5
    if kind == "nonfinite":
        x = torch.randn(n, generator=generator)
        x[:: max(1, n // 5)] = float("nan")
        x[1 :: max(2, n // 3)] = float("inf")
        x[2 :: max(3, n // 4)] = float("-inf")
        # NaNs of payload 1 (+ and -): their bit patterns lie just past +inf's, inside its histogram key.
        nan_slots = x.view(torch.int32)[3 :: max(4, n // 6)]
        nan_slots.copy_(torch.tensor([0x7F800001, -0x7FFFFF], dtype=torch.int32).repeat(n)[: nan_slots.numel()])
        return x
    raise ValueError(kind)


KINDS = [*SYNTHETIC, "all_equal", "all_zero", "ties", "nonfinite"]
SIZES = [1, 7, 1000, 4096, 4097, 65537]


def sample_inputs(device: torch.device, sizes=SIZES, kinds=KINDS, dtypes=DTYPES, thin: bool = False):
    """(description, grad, residual) triples: every size, distribution and dtype, with and without residual;
    ``thin`` (the Triton interpreter): one dtype per size and distribution, in turn, so every dtype still meets
    every size and several distributions (the compiled backends take every pair)."""
    generator = torch.Generator().manual_seed(0)
    for i, n in enumerate(sizes):
        for j, kind in enumerate(kinds):
            for dtype in [dtypes[(i + j) % len(dtypes)]] if thin else dtypes:
                grad = make_values(kind, n, generator).to(dtype)
                residual = (0.1 * make_values("gaussian", n, generator)).to(dtype)
                yield f"{kind}-n{n}-{dtype}", grad.to(device), residual.to(device)


def assert_identical(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Bit-for-bit equal values (NaN equals NaN), dtype and shape."""
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True, msg=msg or None)


def assert_same_stats(actual: torch.Tensor, expected: torch.Tensor, exact_threshold: bool):
    actual, expected = actual.cpu(), expected.cpu()
    for slot in (ops.STAT_MEAN, ops.STAT_STD, ops.STAT_GAUSSIAN_THRESHOLD):
        if torch.isfinite(expected[slot]):
            torch.testing.assert_close(actual[slot], expected[slot], rtol=1e-5, atol=1e-6)
        else:  # any non-finite value (inf or NaN) says the input was not finite
            assert not torch.isfinite(actual[slot]), (slot, actual, expected)
    assert torch.equal(actual[ops.STAT_MAX_ABS], expected[ops.STAT_MAX_ABS])
    # The histogram threshold comes from integer counts and is bit-exact; the Gaussian one only to rounding.
    if exact_threshold:
        assert_identical(actual[ops.STAT_THRESHOLD], expected[ops.STAT_THRESHOLD])


@pytest.mark.parametrize("density", [0.001, 0.05, 0.5, 1.0])
def test_gaussian_threshold_matches_reference(backend, density):
    device = backend_device(backend)
    z = ops.z_for_density(density)
    for name, grad, residual in sample_inputs(device, sizes=case_sizes(backend, SIZES), thin=interpreted(backend)):
        k = max(1, int(np.ceil(density * grad.numel())))
        for use_residual in (False, True):
            for k_arg in (0, k):
                res_kernel = residual.clone() if use_residual else None
                res_ref = residual.clone() if use_residual else None
                stats = ops.gaussian_threshold(grad, res_kernel, z=z, k=k_arg, backend=backend)
                expected = reference.gaussian_threshold(grad, res_ref, z, k_arg)
                assert stats.device == grad.device and stats.dtype == torch.float32, name
                try:
                    assert_same_stats(stats, expected, exact_threshold=k_arg > 0)
                    if use_residual:  # acc = residual + grad, rounded to the dtype exactly as the reference
                        assert_identical(res_kernel, res_ref)
                except AssertionError as error:
                    raise AssertionError(f"{name} residual={use_residual} k={k_arg}: {error}") from error


def test_gaussian_threshold_large(backend):
    """A few million elements: the parallel reduction over many chunks agrees with the fp64 reference."""
    device = backend_device(backend)
    generator = torch.Generator().manual_seed(1)
    n = 3_000_017
    grad = make_values("laplace", n, generator).to(device)
    residual = (0.3 * make_values("gaussian", n, generator)).to(device)
    k = 3000
    stats = ops.gaussian_threshold(grad, residual.clone(), z=ops.z_for_density(0.001), k=k, backend=backend)
    expected = reference.gaussian_threshold(grad, residual.clone(), ops.z_for_density(0.001), k)
    assert_same_stats(stats, expected, exact_threshold=True)


@pytest.mark.parametrize("kind", SYNTHETIC)
@pytest.mark.parametrize("density", [0.001, 0.01, 0.05])
def test_histogram_threshold_selects_about_k(kind, density):
    """gaussian_select keeps k within 1% (10% asked) on heavy tails, spikes and offset values, where the Gaussian
    threshold is far off; its count is the number of elements at or above its threshold."""
    generator = torch.Generator().manual_seed(2)
    n = 1_000_000
    grad = make_values(kind, n, generator)
    k = int(np.ceil(density * n))
    _, _, count, stats = ops.gaussian_select(grad, None, z=ops.z_for_density(density), k=k, capacity=k)
    selected = int((grad.abs() >= stats[ops.STAT_THRESHOLD]).sum())
    assert selected == int(count) and k <= selected <= 1.01 * k, (kind, density, selected, k)


COMPACT_SIZES = [1, 7, 1000, 4097, 65537]


def compact_cases(device, sizes, thin: bool = False):
    for name, grad, _ in sample_inputs(device, sizes=sizes, thin=thin):
        magnitude = grad.float().abs()
        finite = magnitude[torch.isfinite(magnitude)]
        top = float(finite.max()) if finite.numel() else 0.0
        thresholds = [0.0, -0.0, -1.0, top, top * 2 + 1, float("inf"), float("nan")]
        if finite.numel():
            thresholds.append(float(finite.median()))  # an element's own magnitude: ties at the threshold
        for threshold in thresholds:
            for capacity in (1, max(1, grad.numel() // 100), grad.numel() + 3):
                yield f"{name}-thr{threshold}-cap{capacity}", grad, torch.tensor([threshold], device=device), capacity


def test_compact_matches_reference(backend):
    device = backend_device(backend)
    cases = compact_cases(device, case_sizes(backend, COMPACT_SIZES), interpreted(backend))
    for name, acc, threshold, capacity in cases:
        values, indices, count = ops.compact(acc, threshold, capacity, backend=backend)
        exp_values, exp_indices, exp_count = reference.compact(acc, threshold, capacity)
        assert values.dtype == acc.dtype and indices.dtype == torch.int32 and count.dtype == torch.int32, name
        assert torch.equal(count.cpu(), exp_count.cpu()), name
        assert torch.equal(indices.cpu(), exp_indices.cpu()), name
        assert torch.equal(values.cpu(), exp_values.cpu()), name


def test_compact_overflow_keeps_large_elements_first(backend):
    """More candidates than slots: elements above the threshold's bin are kept before those at the threshold,
    wherever their index, so truncation never drops a large gradient at a high index."""
    device = backend_device(backend)
    acc = torch.cat([torch.full((100,), -1.0), torch.tensor([50.0, -70.0, 90.0, 1.01, 1.03])]).to(device)
    values, indices, count = ops.compact(acc, torch.tensor([1.0], device=device), 6, backend=backend)
    assert int(count) == 105
    assert indices.tolist() == [0, 1, 2, 100, 101, 102]  # 1.01 and 1.03 lie in 1.0's bin: boundary elements
    assert values.tolist() == [-1.0, -1.0, -1.0, 50.0, -70.0, 90.0]


def test_compact_large(backend):
    device = backend_device(backend)
    acc = make_values("student_t3", 2_500_001, torch.Generator().manual_seed(3)).to(device)
    threshold = torch.tensor([6.0], device=device)
    for capacity in (10_000,) if interpreted(backend) else (100, 10_000, 100_000):
        got = ops.compact(acc, threshold, capacity, backend=backend)
        for actual, expected in zip(got, reference.compact(acc, threshold, capacity)):
            assert torch.equal(actual.cpu(), expected.cpu())


SELECT_SIZES = (1, 7, 4097, 65537)


LARGE_KINDS = ("laplace", "spiky", "offset", "ties", "nonfinite", "all_equal")
SPLIT_KINDS = ("laplace", "ties", "nonfinite")  # whose candidates differ most between a kernel's parallel ranges


def select_cases(device, sizes=SELECT_SIZES, large=LARGE_KINDS, thin: bool = False):
    """(description, grad, residual, k, capacity): small inputs of ``sizes`` (every range re-reads acc) and, of each
    kind in ``large``, a few million elements at low density (the CPU kernel selects from the candidates of its
    statistics pass), with ties at the threshold and fewer slots than candidates (float32: also all of them, and
    ten times as many; 16-bit: the fewer slots); ``thin``: as :func:`sample_inputs`."""
    for name, grad, residual in sample_inputs(device, sizes=sizes, thin=thin):
        for density in (0.001, 0.05, 1.0):
            k = max(1, int(np.ceil(density * grad.numel())))
            for capacity in (k, max(1, k // 3)):
                yield f"{name}-d{density}-cap{capacity}", grad, residual, k, capacity
    generator = torch.Generator().manual_seed(7)
    n = 2_600_011
    for kind in large:
        for dtype in DTYPES:
            grad = make_values(kind, n, generator).to(dtype)
            residual = (0.1 * make_values("gaussian", n, generator)).to(dtype)
            pairs = ((2600, 2600), (2600, 1000), (26_000, 26_000)) if dtype == torch.float32 else ((2600, 1000),)
            for k, capacity in pairs:
                yield f"{kind}-n{n}-{dtype}-k{k}-cap{capacity}", grad.to(device), residual.to(device), k, capacity


def check_gaussian_select(backend: str, cases, thin: bool = False) -> None:
    """gaussian_select equals gaussian_threshold then compact at its threshold (the reference), bit for bit, with
    and without a residual (``thin``, the interpreter: each case one of them in turn, so every input meets both)."""
    for i, (name, grad, residual, k, capacity) in enumerate(cases):
        for use_residual in [bool(i % 2)] if thin else (False, True):
            res_kernel = residual.clone() if use_residual else None
            res_ref = residual.clone() if use_residual else None
            z = ops.z_for_density(k / grad.numel())
            got = ops.gaussian_select(grad, res_kernel, z=z, k=k, capacity=capacity, backend=backend)
            want = reference.gaussian_select(grad, res_ref, z, k, capacity)
            where = f"{name} residual={use_residual}"
            assert_same_stats(got[3], want[3], exact_threshold=True)
            for actual, expected, field in zip(got[:3], want[:3], ("values", "indices", "count")):
                assert torch.equal(actual.cpu(), expected.cpu()), f"{where}: {field} differ"
            if use_residual:
                assert_identical(res_kernel, res_ref, where)


def test_gaussian_select_matches_reference(backend):
    device = backend_device(backend)
    thin = interpreted(backend)  # the interpreter: small inputs only
    check_gaussian_select(backend, select_cases(device, case_sizes(backend, SELECT_SIZES), () if thin else LARGE_KINDS,
                                                thin), thin)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Equal bit for bit, signed zeros included (assert_identical takes -0.0 for +0.0); any NaN equals any NaN
    (the NaN of inf - inf differs by device)."""
    actual, expected = actual.cpu().flatten(), expected.cpu().flatten()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, msg
    nan = torch.isnan(actual)
    assert torch.equal(nan, torch.isnan(expected)), f"{msg}: NaN at other places"
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[actual.dtype]
    differ = actual[~nan].view(bits) != expected[~nan].view(bits)
    assert not bool(differ.any()), (f"{msg}: {int(differ.sum())} elements differ, e.g. "
                                    f"{actual[~nan][differ][:3].tolist()} vs {expected[~nan][differ][:3].tolist()}")


def update_residual_cases(device, thin: bool = False):
    """(description, grad, residual, k, capacity) for update_residual: signed zeros that a k of every element
    selects (acc - value must be +0.0 whatever the sign), infinities (acc - value is NaN), NaNs (never selected),
    ties and truncation (capacity < count)."""
    zeros = torch.tensor([0.0, -0.0] * 8 + [1e-30, -1e-30, 2.0, -3.0, float("-inf"), float("nan")])
    for dtype in DTYPES:
        # acc = grad + (-0.0) is grad bit for bit, -0.0 included
        grad = zeros.to(dtype)
        residual = torch.full_like(grad, -0.0)
        for k, capacity in ((grad.numel(), grad.numel()), (grad.numel(), 5), (3, 3)):
            yield f"signed-zeros-{dtype}-k{k}-cap{capacity}", grad.to(device), residual.to(device), k, capacity
    kinds = ["gaussian", "ties", "nonfinite", "all_equal", "all_zero"]
    for name, grad, residual in sample_inputs(device, sizes=[7, 4097], kinds=kinds, thin=thin):
        for density in (0.001, 0.05, 1.0):
            k = max(1, int(np.ceil(density * grad.numel())))
            for capacity in (k, max(1, k // 3)):
                yield f"{name}-d{density}-cap{capacity}", grad, residual, k, capacity


def test_gaussian_select_update_residual_is_residual_update(backend):
    """update_residual leaves the residual exactly as residual_update with the selected message does (the
    reference, and this backend's residual_update after its gaussian_select): the stored elements become +0.0
    (NaN for an infinity), the rest stays acc, bit for bit."""
    for name, grad, residual, k, capacity in update_residual_cases(backend_device(backend), interpreted(backend)):
        z = ops.z_for_density(min(1.0, k / grad.numel()))
        fused, oracle, unfused = residual.clone(), residual.clone(), residual.clone()
        got = ops.gaussian_select(grad, fused, z=z, k=k, capacity=capacity, update_residual=True, backend=backend)
        want = reference.gaussian_select(grad, oracle, z, k, capacity, update_residual=True)
        apart = ops.gaussian_select(grad, unfused, z=z, k=k, capacity=capacity, backend=backend)
        ops.residual_update_(unfused, apart[1], apart[0], backend=backend)
        for field, actual, expected in zip(("values", "indices", "count"), got, want):
            assert torch.equal(actual.cpu(), expected.cpu()), f"{name}: {field} differ"
        assert_same_bits(fused, oracle, f"{name}: residual vs the reference")
        assert_same_bits(fused, unfused, f"{name}: residual vs gaussian_select then residual_update")
        stored = got[1][:min(int(got[2]), capacity)].long()
        finite = torch.isfinite(got[0][:stored.numel()])
        assert_same_bits(fused[stored[finite]], torch.zeros(int(finite.sum()), dtype=grad.dtype), f"{name}: +0.0")


@pytest.mark.parametrize("threads", [1, 3])
def test_gaussian_select_with_any_number_of_threads(threads):
    """The CPU kernel's candidate lists are per parallel range: other splits of the data give the same result (on
    the large inputs of SPLIT_KINDS)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_gaussian_select("cpu", select_cases(torch.device("cpu"), sizes=(), large=SPLIT_KINDS))
    finally:
        torch.set_num_threads(previous)


SCATTER_SIZES = (1, 13, 4097, 100_000)


def scatter_cases(device, sizes):
    generator = torch.Generator().manual_seed(4)
    for n in sizes:
        for m in (1, 8, 5000):
            for dtype in DTYPES:
                dense = torch.randn(n, generator=generator).to(dtype)
                indices = torch.randint(0, n, (m,), generator=generator, dtype=torch.int32)  # duplicates
                values = torch.randn(m, generator=generator).to(dtype)
                yield f"n{n}-m{m}-{dtype}", dense.to(device), indices.to(device), values.to(device)


@pytest.mark.parametrize("op_name", ["scatter_add", "residual_update"])
def test_scatter_matches_reference(backend, op_name):
    device = backend_device(backend)
    kernel = getattr(backends.choose(device, backend).kernels, op_name)
    oracle = getattr(reference, op_name)
    for name, dense, indices, values in scatter_cases(device, case_sizes(backend, SCATTER_SIZES)):
        actual, expected = dense.clone(), dense.clone()
        invalid = kernel(actual, indices, values)
        oracle(expected, indices, values)
        assert int(invalid) == 0, name
        # Duplicates are summed in another order, rounding after each add: each add may be off by one rounding
        # of the magnitudes involved.
        eps = torch.finfo(dense.dtype).eps
        adds = torch.zeros(dense.numel()).index_add_(0, indices.cpu().long(), torch.ones(indices.numel()))
        magnitude = dense.cpu().float().abs().index_add(0, indices.cpu().long(), values.cpu().float().abs())
        bound = eps * (adds + 1) * magnitude + 1e-6
        error = (actual.cpu().float() - expected.cpu().float()).abs()
        assert bool((error <= bound).all()), f"{name}: error {float((error - bound).max())} over the bound"


@pytest.mark.parametrize("op_name", ["scatter_add", "residual_update"])
def test_scatter_skips_and_counts_corrupted_indices(backend, op_name):
    device = backend_device(backend)
    n = 1000
    dense = torch.zeros(n, device=device)
    indices = torch.tensor([0, -1, n, n - 1, 2**31 - 1, -(2**31), 5], dtype=torch.int32, device=device)
    values = torch.ones(7, device=device)
    invalid = getattr(backends.choose(device, backend).kernels, op_name)(dense, indices, values)
    assert int(invalid) == 4
    sign = 1.0 if op_name == "scatter_add" else -1.0
    expected = torch.zeros(n)
    expected[[0, n - 1, 5]] = sign
    assert torch.equal(dense.cpu(), expected)
    wrapper = ops.scatter_add_ if op_name == "scatter_add" else ops.residual_update_
    with pytest.raises(ValueError, match=r"4 indices outside \[0, 1000\)"):
        wrapper(dense, indices, values, backend=backend)


def test_residual_update_zeroes_what_compact_sent(backend):
    """Error feedback loses nothing: residual == grad + old residual - sent, with sent entries exactly 0."""
    device = backend_device(backend)
    for name, grad, residual in sample_inputs(device, sizes=[7, 4097, 65537], kinds=["gaussian", "ties", "spiky"]):
        k = max(1, grad.numel() // 50)
        old = residual.clone()
        stats = ops.gaussian_threshold(grad, residual, z=ops.z_for_density(0.02), k=k, backend=backend)
        acc = residual.clone()
        values, indices, count = ops.compact(residual, stats[ops.STAT_THRESHOLD:], k, backend=backend)
        ops.residual_update_(residual, indices, values, backend=backend)
        sent = torch.zeros_like(acc)
        stored = min(int(count), k)
        sent[indices[:stored].long()] = values[:stored]
        assert torch.equal(residual, acc - sent), name
        assert torch.equal(residual[indices[:stored].long()], torch.zeros_like(values[:stored])), name
        torch.testing.assert_close((acc - old).float(), grad.float(), rtol=1e-2, atol=1e-2, msg=name)


def duplicate_heavy_scatter_cases(device: torch.device):
    """What decompression meets: 8 messages of ascending unique indices with padding (index 0, value 0), in rank
    order; and runs of one index over several tiles of sorted slots, with out-of-range indices among them."""
    generator = torch.Generator().manual_seed(8)
    for dtype in DTYPES:
        n, k, ranks = 1000, 150, 8
        messages = [torch.randperm(n, generator=generator)[:k].sort().values for _ in range(ranks)]
        values = torch.randn(ranks, k, generator=generator)
        for message, message_values in zip(messages, values):
            message[-20:], message_values[-20:] = 0, 0.0
        yield (f"messages-{dtype}", torch.randn(n, generator=generator).to(dtype).to(device),
               torch.cat(messages).int().to(device), values.flatten().to(dtype).to(device))
        indices = torch.randint(-1, 6, (600,), generator=generator, dtype=torch.int32)
        yield (f"long-runs-{dtype}", torch.randn(5, generator=generator).to(dtype).to(device), indices.to(device),
               torch.randn(600, generator=generator).to(dtype).to(device))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "cpu"])
def test_gpu_scatter_bits_are_the_references_whatever_the_launch(backend, monkeypatch):
    """Replicas stay bitwise equal only if decompressing the same messages gives the same bits on every rank and
    run: the GPU kernels sum duplicates without float atomics, in the reference's order (slot order within tiles
    of sorted slots), so their bits equal the reference's whatever the number of programs or blocks."""
    from gtopk_ext import _contract
    from gtopk_ext.triton_kernels import kernels

    blocks = [None, None]  # CUDA: repeated runs on the grid the kernels choose
    if backend == "triton":
        blocks = [kernels.BLOCK, 64]
        if not torch.cuda.is_available():  # the interpreter walks a long piece slowly: small tiles, many of them
            monkeypatch.setattr(_contract, "SCATTER_TILE", 8)
    device = backend_device(backend)
    for name, dense, indices, values in duplicate_heavy_scatter_cases(device):
        for op_name in ("scatter_add", "residual_update"):
            expected = dense.cpu().clone()
            expected_invalid = getattr(reference, op_name)(expected, indices.cpu(), values.cpu())
            for block in blocks:
                if block is not None:
                    monkeypatch.setattr(kernels, "BLOCK", block)
                actual = dense.clone()
                invalid = getattr(backends.choose(device, backend).kernels, op_name)(actual, indices, values)
                assert int(invalid) == int(expected_invalid), (name, op_name, block)
                assert_identical(actual.cpu(), expected, f"{name} {op_name} block={block}")


# --- bad input: every op names the argument and what it expected ---------------------------------------------

def bad_calls(device):
    f32 = torch.randn(64, device=device)
    idx = torch.zeros(4, dtype=torch.int32, device=device)
    val = torch.zeros(4, device=device)
    thr = torch.tensor([1.0], device=device)
    huge = torch.empty(1, dtype=torch.float16, device=device).expand(2**31)  # 2^31 elements, no memory
    return [
        ("gaussian_threshold", (f32.long(), None, 1.0, 0), "grad must be float32, float16 or bfloat16"),
        ("gaussian_threshold", (f32.double(), None, 1.0, 0), "grad must be float32, float16 or bfloat16"),
        ("gaussian_threshold", (f32, f32[:32].clone(), 1.0, 0), "residual must have grad's shape"),
        ("gaussian_threshold", (f32, f32.half(), 1.0, 0), "residual must have grad's dtype"),
        ("gaussian_threshold", (f32, torch.randn(128, device=device)[::2], 1.0, 0), "residual is updated in place"),
        ("gaussian_threshold", (f32, None, 1.0, -1), "k must be >= 0"),
        ("gaussian_threshold", (f32, None, float("nan"), 0), "z must be finite"),
        ("gaussian_select", (f32, None, -0.5, 4, 4), "gaussian_select: z must be >= 0"),
        ("gaussian_threshold", (huge, None, 1.0, 0), "at most 2^31 - 1 elements"),
        ("compact", (f32, thr, 0), "capacity must be >= 1"),
        ("compact", (f32.int(), thr, 4), "acc must be float32, float16 or bfloat16"),
        ("compact", (f32, thr.double(), 4), "threshold must be a float32 tensor of one element"),
        ("compact", (f32, torch.ones(2, device=device), 4), "threshold must be a float32 tensor of one element"),
        ("compact", (huge, thr, 4), "at most 2^31 - 1 elements"),
        ("gaussian_select", (f32, None, 1.0, 0, 4), "k must be >= 1"),
        ("gaussian_select", (f32, None, 1.0, 4, 0), "capacity must be >= 1"),
        ("gaussian_select", (f32, f32.half(), 1.0, 4, 4), "gaussian_select: residual must have grad's dtype"),
        ("gaussian_select", (huge, None, 1.0, 4, 4), "at most 2^31 - 1 elements"),
        ("scatter_add", (f32, idx.long(), val), "indices must be int32"),
        ("scatter_add", (f32, idx, val.half()), "values must have dense's dtype"),
        ("scatter_add", (f32, idx, val[:3]), "values must have indices' shape"),
        ("scatter_add", (torch.randn(128, device=device)[::2], idx, val), "dense is updated in place"),
        ("residual_update", (f32.int(), idx, val), "residual must be float32, float16 or bfloat16"),
        ("residual_update", (f32, idx.view(2, 2), val.view(2, 2)), "indices must be 1-D"),
    ]


# One case per test, named after its op and message: a crash (seen once on a GPU machine) names its call.
BAD_CALL_IDS = [f"{op_name}-{message}" for op_name, _, message in bad_calls("meta")]


@pytest.mark.parametrize("case", range(len(BAD_CALL_IDS)), ids=BAD_CALL_IDS)
def test_bad_input_is_rejected_clearly(backend, case):
    device = backend_device(backend)
    op_name, args, message = bad_calls(device)[case]
    with pytest.raises((RuntimeError, ValueError), match=message.replace("(", r"\(").replace("^", r"\^")):
        getattr(backends.choose(device, backend).kernels, op_name)(*args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_mixed_devices_are_rejected():
    grad = torch.randn(64, device="cuda")
    with pytest.raises(RuntimeError, match="residual must be on grad's device"):
        torch.ops.gtopk_ext.gaussian_threshold(grad, torch.zeros(64), 1.0, 0)
    with pytest.raises(RuntimeError, match="threshold must be on acc's device"):
        torch.ops.gtopk_ext.compact(grad, torch.ones(1), 4)


def test_backend_choice():
    cpu = torch.device("cpu")
    assert backends.choose(cpu, "auto") is backends.CPU
    with pytest.raises(ValueError, match="backend must be one of"):
        backends.choose(cpu, "tpu")
    with pytest.raises(ValueError, match="backend 'cuda' cannot run on tensors on cpu"):
        backends.choose(cpu, "cuda")
    assert ops.z_for_density(1.0) == 0.0
    assert abs(ops.z_for_density(0.01) - 2.5758) < 1e-4
    for density in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="density must be in"):
            ops.z_for_density(density)


# --- the ops as torch ops: opcheck and torch.compile --------------------------------------------------------

def test_opcheck():
    generator = torch.Generator().manual_seed(5)
    for dtype in DTYPES:
        grad = torch.randn(5000, generator=generator).to(dtype)
        residual = torch.randn(5000, generator=generator).to(dtype)
        torch.library.opcheck(torch.ops.gtopk_ext.gaussian_threshold, (grad, residual, 2.0, 50))
        torch.library.opcheck(torch.ops.gtopk_ext.gaussian_threshold, (grad, None, 2.0, 0))
        threshold = torch.tensor([1.5])
        torch.library.opcheck(torch.ops.gtopk_ext.compact, (grad, threshold, 64))
        torch.library.opcheck(torch.ops.gtopk_ext.gaussian_select, (grad, residual, 2.0, 50, 50))
        torch.library.opcheck(torch.ops.gtopk_ext.gaussian_select, (grad, None, 2.0, 50, 20))
        torch.library.opcheck(torch.ops.gtopk_ext.gaussian_select, (grad, residual, 2.0, 50, 20, True))
        indices = torch.randint(0, 5000, (64,), generator=generator, dtype=torch.int32)
        values = torch.randn(64, generator=generator).to(dtype)
        torch.library.opcheck(torch.ops.gtopk_ext.scatter_add, (residual.clone(), indices, values))
        torch.library.opcheck(torch.ops.gtopk_ext.merge_topk,
                              (indices.sort().values, values, indices[:40], values[:40], 50))
        torch.library.opcheck(torch.ops.gtopk_ext.residual_update, (residual.clone(), indices, values))


def test_torch_compile_fullgraph():
    def compress(grad, residual):
        stats = torch.ops.gtopk_ext.gaussian_threshold(grad, residual, 2.5, 40)
        values, indices, count = torch.ops.gtopk_ext.compact(residual, stats[ops.STAT_THRESHOLD:], 40)
        torch.ops.gtopk_ext.residual_update(residual, indices, values)
        fused = torch.ops.gtopk_ext.gaussian_select(grad, residual, 2.5, 40, 40)
        torch.ops.gtopk_ext.residual_update(residual, fused[1], fused[0])
        feedback = torch.ops.gtopk_ext.gaussian_select(grad, residual, 2.5, 40, 40, update_residual=True)
        return values, indices, count, *fused, *feedback

    grad = torch.randn(4000, generator=torch.Generator().manual_seed(6))
    residual_eager, residual_compiled = torch.zeros(4000), torch.zeros(4000)
    compiled = torch.compile(compress, fullgraph=True, backend="aot_eager")
    for _ in range(3):  # residual carries over: error feedback through the compiled graph
        expected = compress(grad, residual_eager)
        actual = compiled(grad, residual_compiled)
        for a, e in zip(actual, expected):
            assert torch.equal(a, e)
        assert torch.equal(residual_compiled, residual_eager)


# --- properties over arbitrary arrays -------------------------------------------------------------------

float_arrays = hnp.arrays(np.float32, st.integers(1, 3000),
                          elements=st.one_of(st.floats(-1e6, 1e6, width=32),
                                             st.sampled_from([0.0, float("nan"), float("inf"), float("-inf")])))


@settings(max_examples=60, deadline=None)
@given(data=float_arrays, density=st.floats(1e-3, 1.0), use_residual=st.booleans())
def test_property_threshold_and_compact(data, density, use_residual):
    grad = torch.from_numpy(data.copy())
    k = max(1, int(np.ceil(density * grad.numel())))
    residual = torch.zeros_like(grad) if use_residual else None
    stats = gx.ops.gaussian_threshold(grad, residual, z=ops.z_for_density(density), k=k, backend="cpu")
    expected = reference.gaussian_threshold(grad, None, ops.z_for_density(density), k)
    assert_same_stats(stats, expected, exact_threshold=True)
    got = ops.compact(grad, stats[ops.STAT_THRESHOLD:], k, backend="cpu")
    want = reference.compact(grad, stats[ops.STAT_THRESHOLD:], k)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
    not_nan = int((~torch.isnan(grad)).sum())
    if k >= not_nan:  # asking for at least everything selects every non-NaN element
        assert int(got[2]) == not_nan


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 500), pairs=st.lists(st.tuples(st.integers(-600, 600), st.floats(-100, 100, width=32)),
                                              min_size=1, max_size=200))
def test_property_scatter_add(n, pairs):
    indices = torch.tensor([p[0] for p in pairs], dtype=torch.int32)
    values = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    actual, expected = torch.zeros(n), torch.zeros(n)
    invalid = torch.ops.gtopk_ext.scatter_add(actual, indices, values)
    expected_invalid = reference.scatter_add(expected, indices, values)
    assert int(invalid) == int(expected_invalid)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)

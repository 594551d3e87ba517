"""The Triton path (gtopk_ext.triton_kernels) against the C++ CPU kernels and reference.py.

The backend-parametrised cases of tests/test_ops.py also run on the Triton kernels; this file holds what is
Triton-specific: bit-for-bit agreement with the C++ kernels, the interpreter's rounding, the registration that
torch.compile traces (on a GPU and under the interpreter), and the backend choice. On this CPU-only machine the
kernels run under TRITON_INTERPRET=1 (tests/conftest.py); the cases marked "needs a GPU" run where there is one.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

import gtopk_ext  # noqa: F401  (registers torch.ops.gtopk_ext)
from gtopk_ext import _contract, backends, compressors, ops, reference, triton_kernels
from gtopk_ext.triton_kernels import kernels
from tests.test_wire import bad_wire_calls

CPP = torch.ops.gtopk_ext
TRITON = torch.ops.gtopk_ext_triton
HAS_GPU = torch.cuda.is_available()
TRITON_DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OP_NAMES = ["gaussian_threshold", "compact", "scatter_add", "residual_update"]

pytestmark = [
    pytest.mark.skipif(not HAS_GPU and os.environ.get("TRITON_INTERPRET") != "1",
                       reason="needs a GPU or TRITON_INTERPRET=1"),
    # The interpreter computes with numpy, which warns on the NaN/inf inputs these tests feed on purpose.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


def values_of(kind: str, n: int, generator: torch.Generator) -> torch.Tensor:
    """float32 values of a distribution, including the extremes of the float32 range the histogram bins."""
    if kind == "normal":
        return torch.randn(n, generator=generator)
    if kind == "laplace":  # heavy tails
        u = torch.rand(n, generator=generator, dtype=torch.float64) - 0.5
        return (-torch.sign(u) * torch.log1p(-2 * u.abs())).float()
    if kind == "spiky":
        x = torch.randn(n, generator=generator)
        return torch.where(torch.rand(n, generator=generator) < 0.01, 100 * x, x)
    if kind == "ties":  # few magnitudes: every threshold lands on many equal elements
        return torch.randint(-2, 3, (n,), generator=generator).float() * 0.25
    if kind == "equal":
        return torch.full((n,), -1.5)
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "log_uniform":  # magnitudes from 1e-38 (subnormal) to 1e37: every bin of the range
        exponents = torch.rand(n, generator=generator, dtype=torch.float64) * 75 - 38
        signs = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
        return (signs * 10.0**exponents).float()
    if kind == "subnormal":
        return torch.randn(n, generator=generator) * 1e-40
    if kind == "nonfinite":
        x = torch.randn(n, generator=generator)
        x[torch.rand(n, generator=generator) < 0.05] = float("nan")
        x[torch.rand(n, generator=generator) < 0.02] = float("inf")
        x[torch.rand(n, generator=generator) < 0.02] = float("-inf")
        return x
    raise ValueError(kind)


KINDS = ["normal", "laplace", "spiky", "ties", "equal", "zeros", "log_uniform", "subnormal", "nonfinite"]
SIZES = [1, 2, 31, 4095, 4096, 4097, 3 * 4096 + 17, 50_001]


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit for bit (any NaN equals any NaN: the payload of a NaN computed in fp64 differs by device)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    actual, expected = actual.cpu().reshape(-1), expected.cpu().reshape(-1)
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    same = actual.view(torch.uint8).view(actual.numel(), -1) == expected.view(torch.uint8).view(actual.numel(), -1)
    mismatch = ~(same.all(dim=1) | both_nan)
    assert not bool(mismatch.any()), (f"{what}: {int(mismatch.sum())} of {actual.numel()} differ, first at "
                                      f"{int(mismatch.nonzero()[0])}: {actual.flatten()[mismatch][:3].tolist()} vs "
                                      f"{expected.flatten()[mismatch][:3].tolist()}")


def compare_with_cpp(grad: torch.Tensor, residual: torch.Tensor | None, k: int, z: float = 2.5) -> None:
    """gaussian_threshold then compact at its threshold, on both paths: the residual update, max |acc| and
    the histogram threshold (k > 0) and every compact output agree bit for bit."""
    cpp_residual = residual.clone() if residual is not None else None
    tri_residual = residual.to(TRITON_DEVICE) if residual is not None else None
    cpp_stats = CPP.gaussian_threshold(grad, cpp_residual, z, k)
    tri_stats = TRITON.gaussian_threshold(grad.to(TRITON_DEVICE), tri_residual, z, k)
    if residual is not None:
        assert_same_bits(tri_residual, cpp_residual, "acc = residual + grad")
    assert_same_bits(tri_stats[ops.STAT_MAX_ABS], cpp_stats[ops.STAT_MAX_ABS], "max |acc|")
    if k > 0:
        assert_same_bits(tri_stats[ops.STAT_THRESHOLD], cpp_stats[ops.STAT_THRESHOLD], "histogram threshold")
    acc = cpp_residual if residual is not None else grad
    threshold = cpp_stats[ops.STAT_THRESHOLD:]
    for capacity in {max(1, k), max(1, k // 3)}:  # the second one truncates
        cpp_out = CPP.compact(acc, threshold, capacity)
        tri_out = TRITON.compact(acc.to(TRITON_DEVICE), threshold.to(TRITON_DEVICE), capacity)
        for name, t, c in zip(("values", "indices", "count"), tri_out, cpp_out):
            assert_same_bits(t, c, f"compact {name} (capacity {capacity})")


# --- bit-for-bit agreement with the C++ kernels --------------------------------------------------------------

@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.sampled_from(SIZES), kind=st.sampled_from(KINDS),
       density=st.sampled_from([0.0005, 0.01, 0.2, 1.0]), use_residual=st.booleans(),
       shape=st.sampled_from(["flat", "2d", "transposed"]))
def test_threshold_and_compact_identical_to_cpp_fp32(seed, n, kind, density, use_residual, shape):
    generator = torch.Generator().manual_seed(seed)
    grad = values_of(kind, n, generator)
    residual = 0.1 * values_of("normal", n, generator) if use_residual else None
    rows = next((d for d in (3, 5, 31) if n % d == 0), None)
    if shape != "flat" and rows is not None:  # a 2-D bucket; transposed: grad not contiguous (read via a copy)
        grad = grad.view(rows, -1)
        residual = residual.view(rows, -1) if residual is not None else None
        if shape == "transposed":
            grad = grad.t()
            residual = residual.t().contiguous() if residual is not None else None
    compare_with_cpp(grad, residual, k=int(np.ceil(density * n)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_and_compact_identical_to_cpp_all_dtypes(dtype):
    """fp16/bf16 too: the residual is rounded like the C++ kernels round it, so the histograms are the same."""
    generator = torch.Generator().manual_seed(7)
    for n, kind in [(4097, "laplace"), (20_000, "spiky"), (777, "ties"), (5000, "nonfinite"), (3000, "log_uniform")]:
        grad = values_of(kind, n, generator).to(dtype)
        residual = values_of("normal", n, generator).to(dtype)
        for k in (1, n // 100 + 1, n, n + 5):
            compare_with_cpp(grad, residual.clone(), k)


def test_identical_to_cpp_on_a_million_elements():
    generator = torch.Generator().manual_seed(8)
    n = 1_000_003
    grad = values_of("laplace", n, generator)
    residual = 0.3 * values_of("normal", n, generator)
    compare_with_cpp(grad, residual, k=1000, z=3.29)


def test_edge_arguments_identical_to_cpp():
    """Empty tensors, k beyond the element count, all-NaN and infinite input, signed zeros, z = 0."""
    cases = [(torch.zeros(0), 0), (torch.zeros(0), 5), (torch.randn(100), 2**40), (torch.full((50,), float("nan")), 3),
             (torch.tensor([float("inf"), -float("inf"), 1.0]), 2), (torch.tensor([-0.0, 0.0]), 1)]
    for grad, k in cases:
        for z in (0.0, 3.0):
            what = f"{grad.tolist()[:3]} k={k} z={z}"
            stats = TRITON.gaussian_threshold(grad.to(TRITON_DEVICE), None, z, k).cpu()
            torch.testing.assert_close(stats, reference.gaussian_threshold(grad, None, z, k), rtol=1e-6, atol=0,
                                       equal_nan=True, msg=what)
            cpp = CPP.gaussian_threshold(grad, None, z, k)
            assert_same_bits(stats[ops.STAT_MAX_ABS], cpp[ops.STAT_MAX_ABS], what)
            if k > 0:
                assert_same_bits(stats[ops.STAT_THRESHOLD], cpp[ops.STAT_THRESHOLD], what)
        compare_with_cpp(grad, None, k=min(k, 10))


@pytest.mark.parametrize("kind", ["normal", "laplace", "log_uniform", "subnormal", "nonfinite", "zeros"])
def test_per_program_histograms_sum_to_the_reference_histogram(kind):
    """The statistics pass counts each block in a histogram of its own (the LOCAL_BINS bins below the block's
    largest key) and adds only the elements below that window one by one: over all programs and copies the
    counts are reference.histogram's, bin for bin, also where a block spans every exponent (log_uniform) or holds
    only zeros, infinities and NaNs (which are not counted)."""
    n = 3 * kernels.BLOCK + 17
    acc = values_of(kind, n, torch.Generator().manual_seed(14)).to(TRITON_DEVICE)
    num_blocks = triton.cdiv(n, kernels.BLOCK)
    histogram = torch.zeros(kernels.HIST_COPIES * _contract.HIST_BINS, dtype=torch.int32, device=TRITON_DEVICE)
    partials = [torch.empty(num_blocks, dtype=dtype, device=TRITON_DEVICE)
                for dtype in (torch.float64, torch.float64, torch.float32)]
    kernels.moments_histogram_kernel[(num_blocks,)](
        acc, acc, torch.empty(1, dtype=torch.float64, device=TRITON_DEVICE), *partials, histogram, n,
        HAS_RESIDUAL=False, USE_HISTOGRAM=True, HIST_COPIES=kernels.HIST_COPIES, HIST_BINS=_contract.HIST_BINS,
        HIST_SHIFT=_contract.HIST_SHIFT, LOCAL_BINS=kernels.LOCAL_BINS, BLOCK=kernels.BLOCK,
        num_warps=kernels.NUM_WARPS)
    counts = histogram.view(kernels.HIST_COPIES, -1).sum(0).cpu()
    expected = reference.histogram(acc.cpu())
    assert torch.equal(counts.long(), expected), (counts - expected).nonzero().flatten()[:5].tolist()


# --- the interpreter's arithmetic where it differs from a GPU's -------------------------------------------

def test_bfloat16_residual_is_rounded_to_nearest_even():
    """The interpreter's fp32 -> bf16 cast truncates; the kernels round by hand like torch (ties to even,
    overflow to inf, NaN kept)."""
    bf16 = torch.bfloat16
    one_ulp = 2.0**-7  # bf16 spacing in [1, 2)
    residual = torch.tensor([1.0, 1.0, 1.0 + one_ulp, 1.0, -1.0, 3.3895e38, float("nan"), -0.0, 1e-40], dtype=bf16)
    grad = torch.tensor([one_ulp / 2, one_ulp * 0.75, one_ulp / 2, one_ulp / 4, -one_ulp * 1.5, 3.3895e38, 1.0,
                         -0.0, 1e-40], dtype=bf16)
    expected = (residual.float() + grad.float()).to(bf16)
    actual = residual.clone().to(TRITON_DEVICE)
    TRITON.gaussian_threshold(grad.to(TRITON_DEVICE), actual, 1.0, 1)
    assert_same_bits(actual, expected, "bf16 residual + grad")
    # The same rounding where scatter_add writes 16-bit values back.
    dense = residual.clone().to(TRITON_DEVICE)
    TRITON.scatter_add(dense, torch.arange(9, dtype=torch.int32, device=TRITON_DEVICE), grad.to(TRITON_DEVICE))
    assert_same_bits(dense, expected, "bf16 scatter_add")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_duplicates_are_summed_in_fp32_and_rounded_once(dtype):
    """2048 + 1 + 1 + 1 + 1 in fp16 (256 + ... in bf16, where the spacing is also 2) stays 2048 when each add
    is rounded (the odd sum ties to even, four times) and is 2052 with one rounding, as reference.py computes it.
    Unique indices: bit for bit the reference."""
    base = 2048.0 if dtype == torch.float16 else 256.0
    dense = torch.full((3,), base, dtype=dtype, device=TRITON_DEVICE)
    indices = torch.tensor([1, 1, 1, 1], dtype=torch.int32, device=TRITON_DEVICE)
    TRITON.scatter_add(dense, indices, torch.ones(4, dtype=dtype, device=TRITON_DEVICE))
    assert dense.cpu().tolist() == [base, base + 4, base]

    generator = torch.Generator().manual_seed(9)
    for op_name in ("scatter_add", "residual_update"):
        dense = torch.randn(10_000, generator=generator).to(dtype)
        indices = torch.randperm(10_000, generator=generator)[:3000].int()
        values = torch.randn(3000, generator=generator).to(dtype)
        expected = dense.clone()
        getattr(reference, op_name)(expected, indices, values)
        actual = dense.to(TRITON_DEVICE)
        getattr(TRITON, op_name)(actual, indices.to(TRITON_DEVICE), values.to(TRITON_DEVICE))
        assert_same_bits(actual, expected, f"{op_name} {dtype}")


# --- argument checks: the C++ messages, word for word --------------------------------------------------------

def bad_calls(device: torch.device):
    x = torch.randn(64, device=device)
    idx = torch.zeros(4, dtype=torch.int32, device=device)
    val = torch.zeros(4, device=device)
    thr = torch.tensor([1.0], device=device)
    huge = torch.empty(1, device=device).expand(2**31)  # 2^31 elements, no memory
    return [
        ("gaussian_threshold", (x.double(), None, 1.0, 0)),
        ("gaussian_threshold", (x.long(), None, 1.0, 0)),
        ("gaussian_threshold", (huge, None, 1.0, 0)),
        ("gaussian_threshold", (x, None, float("inf"), 0)),
        ("gaussian_threshold", (x, None, 1.0, -3)),
        ("gaussian_threshold", (x, None, -1.0, 0)),
        ("gaussian_select", (x, None, 1.0, 0, 4)),
        ("gaussian_select", (x, None, 1.0, 4, 0)),
        ("gaussian_threshold", (x, x.half(), 1.0, 0)),
        ("gaussian_threshold", (x, x.view(8, 8).clone(), 1.0, 0)),
        ("gaussian_threshold", (x, torch.randn(128, device=device)[::2], 1.0, 0)),
        ("compact", (x.bool(), thr, 4)),
        ("compact", (x, thr.half(), 4)),
        ("compact", (x, torch.ones(3, device=device), 4)),
        ("compact", (x, thr, 0)),
        ("compact", (x, thr, 2**31)),
        ("scatter_add", (x.int(), idx, val)),
        ("scatter_add", (torch.randn(128, device=device)[::2], idx, val)),
        ("scatter_add", (x, idx.long(), val)),
        ("scatter_add", (x, idx.view(2, 2), val.view(2, 2))),
        ("scatter_add", (x, idx, val.bfloat16())),
        ("scatter_add", (x, idx, val[:3])),
        ("residual_update", (x.half(), idx, val)),
        ("residual_update", (torch.randn(8, 8, device=device).t(), idx, val)),
    ]


def merge_bad_calls():
    idx = torch.tensor([0, 3, 5], dtype=torch.int32)
    val = torch.ones(3)
    return [
        ("merge_topk", (idx.long(), val, idx, val, 2)),
        ("merge_topk", (idx, val, idx.view(3, 1), val.view(3, 1), 2)),
        ("merge_topk", (idx, val.double(), idx, val, 2)),
        ("merge_topk", (idx, val, idx, val[:2], 2)),
        ("merge_topk", (idx, val, idx, val.half(), 2)),
        ("merge_topk", (idx, val, idx, val, 0)),
    ]


def test_fake_kernels_check_with_the_cpp_message():
    """Every C++ op on fake tensors (what torch.compile traces: its Meta kernel) rejects what its CPU kernel
    rejects, with the same message; so do the checks that the Triton ops and the torch merge run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = bad_calls(torch.device("cpu")) + merge_bad_calls() + [(name, args) for name, args, _ in bad_wire_calls()]
    assert {name for name, _ in calls} == set(_contract.op_names())
    for op_name, args in calls:
        with pytest.raises(RuntimeError) as cpp_error:
            getattr(CPP, op_name)(*args)
        with pytest.raises(RuntimeError) as checks_error:
            _contract.check_args(op_name, *args)
        with FakeTensorMode() as mode, pytest.raises(RuntimeError) as fake_error:
            getattr(CPP, op_name)(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        assert str(fake_error.value) == str(cpp_error.value) == str(checks_error.value), op_name


def test_bad_input_gets_the_cpp_message():
    for (op_name, cpp_args), (_, triton_args) in zip(bad_calls(torch.device("cpu")), bad_calls(TRITON_DEVICE)):
        with pytest.raises(RuntimeError) as cpp_error:
            getattr(CPP, op_name)(*cpp_args)
        with pytest.raises(RuntimeError) as triton_error:
            getattr(TRITON, op_name)(*triton_args)
        assert str(triton_error.value) == str(cpp_error.value), op_name


# --- backend choice ------------------------------------------------------------------------------------------

def test_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.choose(cpu, "triton").kernels.compact is triton_kernels.ops.compact
    monkeypatch.setenv("GTOPK_EXT_BACKEND", "triton")  # the environment variable picks it when no argument does
    assert backends.choose(cpu, None) is backends.TRITON
    assert backends.choose(cpu, "cpu").kernels.compact is CPP.compact
    monkeypatch.setenv("GTOPK_EXT_BACKEND", "gpu")
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'cpu', 'cuda', 'triton'\), got 'gpu'"):
        ops.gaussian_threshold(torch.randn(8), z=1.0)
    monkeypatch.delenv("GTOPK_EXT_BACKEND")
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.compact(torch.randn(8), torch.ones(1), 2, backend="Triton")
    with pytest.raises(ValueError, match="backend 'cuda' cannot run on tensors on cpu"):
        ops.scatter_add_(torch.zeros(8), torch.zeros(1, dtype=torch.int32), torch.ones(1), backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"backend 'triton' needs CUDA tensors \(or TRITON_INTERPRET=1\)"):
        ops.residual_update_(torch.zeros(8), torch.zeros(1, dtype=torch.int32), torch.ones(1), backend="triton")


def test_wrappers_route_to_the_triton_kernels():
    """Through gtopk_ext.ops with backend="triton" the results are the Triton kernels' (reference-checked)."""
    generator = torch.Generator().manual_seed(10)
    grad = torch.randn(9000, generator=generator).to(TRITON_DEVICE)
    residual = torch.randn(9000, generator=generator).to(TRITON_DEVICE)
    expected_residual = residual.cpu().clone()
    stats = ops.gaussian_threshold(grad, residual, z=2.0, k=90, backend="triton")
    expected = reference.gaussian_threshold(grad.cpu(), expected_residual, 2.0, 90)
    assert_same_bits(stats[ops.STAT_THRESHOLD], expected[ops.STAT_THRESHOLD], "threshold")
    values, indices, count = ops.compact(residual, stats[ops.STAT_THRESHOLD:], 90, backend="triton")
    for actual, want in zip((values, indices, count), reference.compact(expected_residual, expected[4:], 90)):
        assert_same_bits(actual, want, "compact")
    ops.residual_update_(residual, indices, values, backend="triton")
    assert bool((residual[indices[: min(90, int(count))].long()] == 0).all())
    with pytest.raises(ValueError, match=r"1 indices outside \[0, 9000\) were skipped"):
        ops.scatter_add_(residual, torch.tensor([9000], dtype=torch.int32, device=grad.device),
                         torch.ones(1, device=grad.device), backend="triton")


# --- the compressors on both paths ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind, options", [("gaussiank", {}), ("topk", {}), ("randomk", {"seed": 3})])
def test_compressors_give_identical_messages_on_cpu_and_triton(kind, options):
    """Several error-feedback steps (the residual carries over): the messages and residuals of the C++ and the
    Triton path are identical bit for bit on fp32 input."""
    cpp = compressors.make_compressor(kind, 0.01, backend="cpu", **options)
    tri = compressors.make_compressor(kind, 0.01, backend="triton", **options)
    generator = torch.Generator().manual_seed(11)
    shape = (97, 211)  # 20467 elements: k = 205, five Triton blocks
    cpp_residual = torch.zeros(shape)
    tri_residual = torch.zeros(shape, device=TRITON_DEVICE)
    for step in range(3):
        grad = values_of(["laplace", "spiky", "ties"][step], cpp_residual.numel(), generator).view(shape)
        cpp_msg = cpp.compress(grad, cpp_residual, step=step)
        tri_msg = tri.compress(grad.to(TRITON_DEVICE), tri_residual, step=step)
        for name in ("values", "indices", "count"):
            assert_same_bits(getattr(tri_msg, name), getattr(cpp_msg, name), f"{kind} step {step} {name}")
        assert_same_bits(tri_residual, cpp_residual, f"{kind} step {step} residual")
        if cpp_msg.stats is not None:
            assert_same_bits(tri_msg.stats[ops.STAT_THRESHOLD], cpp_msg.stats[ops.STAT_THRESHOLD], "threshold")


# --- registration: opcheck and torch.compile -----------------------------------------------------------------

def op_samples(device: torch.device):
    generator = torch.Generator().manual_seed(12)
    for dtype in DTYPES:
        grad = torch.randn(5000, generator=generator).to(dtype).to(device)
        residual = torch.randn(5000, generator=generator).to(dtype).to(device)
        indices = torch.randint(0, 5000, (64,), generator=generator, dtype=torch.int32).to(device)
        values = torch.randn(64, generator=generator).to(dtype).to(device)
        yield "gaussian_threshold", (grad, residual, 2.0, 50)
        yield "gaussian_threshold", (grad, None, 2.0, 0)
        yield "compact", (grad, torch.tensor([1.5], device=device), 64)
        yield "gaussian_select", (grad, residual, 2.0, 50, 50)
        yield "gaussian_select", (grad, None, 2.0, 50, 20)
        yield "gaussian_select", (grad, residual, 2.0, 50, 20, True)
        yield "scatter_add", (residual.clone(), indices, values)
        yield "residual_update", (residual.clone(), indices, values)


def test_opcheck():
    for op_name, args in op_samples(TRITON_DEVICE):
        torch.library.opcheck(getattr(TRITON, op_name), args)


def compress_step(grad, residual):
    stats = TRITON.gaussian_threshold(grad, residual, 2.5, 40)
    values, indices, count = TRITON.compact(residual, stats[ops.STAT_THRESHOLD:], 40)
    TRITON.residual_update(residual, indices, values)
    fused = TRITON.gaussian_select(grad, residual, 2.5, 40, 40)
    TRITON.residual_update(residual, fused[1], fused[0])
    feedback = TRITON.gaussian_select(grad, residual, 2.5, 40, 40, update_residual=True)
    return values, indices, count, *fused, *feedback


@pytest.mark.parametrize("compile_backend", ["aot_eager"] + (["inductor"] if HAS_GPU else []))
def test_torch_compile_fullgraph(compile_backend):
    generator = torch.Generator().manual_seed(13)
    grad = torch.randn(6000, generator=generator).to(TRITON_DEVICE)
    eager_residual = torch.zeros(6000, device=TRITON_DEVICE)
    compiled_residual = eager_residual.clone()
    compiled = torch.compile(compress_step, fullgraph=True, backend=compile_backend)
    for _ in range(3):  # the residual carries over: error feedback through the compiled graph
        expected = compress_step(grad, eager_residual)
        actual = compiled(grad, compiled_residual)
        for a, e in zip(actual, expected):
            assert_same_bits(a, e, "compiled step")
        assert_same_bits(compiled_residual, eager_residual, "residual")


GPU_BUILD_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from gtopk_ext.triton_kernels import gpu_build

    for dtype in (torch.float32, torch.bfloat16):
        with FakeTensorMode():
            grad, residual = (torch.empty(10000, device="cuda", dtype=dtype) for _ in range(2))
            launches = gpu_build.traced_launches(lambda g, r: gpu_build.compress_step(g, r, 40), grad, residual)
        print(dtype, " ".join(launch.kernel.fn.__name__ for launch in launches))
    try:
        torch.ops.gtopk_ext_triton.compact(torch.randn(8), torch.ones(1), 2)
    except RuntimeError as error:
        print(error)
    sys.exit(gpu_build.main())
""")


def test_gpu_registration_traces_and_builds_for_sm80_and_sm90():
    """Without the interpreter (as on a GPU) the ops are triton_ops: AOT tracing with fake CUDA tensors records
    every kernel launch (what Inductor compiles), each of which Triton's compiler builds for sm_80 and sm_90
    (the one check of the GPU code that runs here); CPU tensors are refused clearly."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", GPU_BUILD_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=900)
    lines = result.stdout.splitlines()
    assert result.returncode == 0, "\n".join([*lines, result.stderr[-3000:]])
    statistics_and_compact = ("moments_histogram_kernel finish_stats_kernel count_candidates_kernel "
                              "write_selected_kernel")
    scatter = "piece_sums_kernel apply_run_sums_kernel " * 2
    assert lines[0] == f"torch.float32 {statistics_and_compact} {scatter}".rstrip()
    assert lines[1] == f"torch.bfloat16 {statistics_and_compact} {scatter}".rstrip()
    assert lines[2] == ("compact: acc must be a CUDA tensor for the Triton kernels (CPU tensors need "
                        "TRITON_INTERPRET=1 set before triton is imported), got cpu")
    builds = lines[3:]
    assert len(builds) >= 80 and all(line.startswith("ok sm_") for line in builds), builds
    launched = set(re.findall(r"wrap_triton\(kernels\.(\w+)\)", inspect.getsource(triton_kernels.ops)))
    defined = {name for name, value in vars(kernels).items()
               if isinstance(value, triton.runtime.jit.KernelInterface) and name.endswith("_kernel")}
    assert launched == defined and {"fine_count_kernel", "fine_finish_kernel"} <= launched, (launched, defined)
    for kernel in sorted(launched):
        for arch in (80, 90):
            assert any(line.startswith(f"ok sm_{arch} {kernel}(") for line in builds), (kernel, arch)


def test_layout_constants_are_the_cpp_ones():
    """The layout of csrc/common.h (exported by gtopk_ext._C) is the one that the Python contract, the Triton
    kernels and ops, and the reference use."""
    from gtopk_ext import _C

    cpp = {name: getattr(_C, name) for name in _contract.LAYOUT}
    assert cpp == _contract.LAYOUT
    for name in ("HIST_SHIFT", "HIST_BINS", "HIST_INF_KEY", "FINE_SHIFT", "FINE_BINS", "NUM_STATS", "STAT_THRESHOLD"):
        assert getattr(triton_kernels.ops, name) == cpp[name], name
    for name in ("HIST_SHIFT", "HIST_BINS", "HIST_INF_KEY", "FINE_SHIFT", "NUM_STATS", "STAT_MEAN", "STAT_STD",
                 "STAT_MAX_ABS", "STAT_GAUSSIAN_THRESHOLD", "STAT_THRESHOLD"):
        assert getattr(reference, name) == cpp[name], name
    for name in ("STAT_MEAN", "STAT_STD", "STAT_MAX_ABS", "STAT_GAUSSIAN_THRESHOLD", "STAT_THRESHOLD"):
        assert getattr(kernels, name).value == cpp[name], name


def test_triton_schemas_are_the_cpp_ones():
    """Every op of gtopk_ext_triton has the schema of the C++ op of the same name (types, alias annotations,
    names, defaults), and every C++ op with a Triton kernel has its Triton op."""
    assert sorted(triton_kernels.ops.REGISTERED) == sorted(set(_contract.op_names()) - {"merge_topk"})
    for name in triton_kernels.ops.REGISTERED:
        cpp = str(getattr(torch.ops.gtopk_ext, name).default._schema)
        tri = str(getattr(torch.ops.gtopk_ext_triton, name).default._schema)
        assert tri == cpp.replace("gtopk_ext::", "gtopk_ext_triton::", 1), (tri, cpp)

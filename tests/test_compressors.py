"""Compressors against plain-torch oracles built on gtopk_ext/reference.py: message shape and order, the exact
error-feedback identity, the selection of each kind, and clear errors on bad input."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

import gtopk_ext as gx
from gtopk_ext import ops, reference
from gtopk_ext.compressors import k_for_density

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KINDS = ["gaussiank", "topk", "randomk", "chunktopk"]
SHAPES = [(1,), (7,), (1000,), (33, 65)]  # 33 * 65 = 2145: not a multiple of any vector width
TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def gradient(shape, dtype, seed, heavy_tailed=False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 1e-2
    if heavy_tailed:  # Student-t with 3 degrees of freedom: a normal over sqrt(chi-squared(3) / 3)
        chi2 = torch.randn((3, *shape), generator=generator).square().sum(0)
        x = x / (chi2 / 3).sqrt()
    return x.to(dtype)


def check_message_layout(msg: gx.SparseMessage, numel: int, k: int) -> None:
    assert msg.k == k and msg.numel == numel
    assert msg.values.shape == (k,) and msg.indices.shape == (k,) and msg.indices.dtype == torch.int32
    used = min(int(msg.count), k)
    idx = msg.indices[:used]
    assert bool((idx[1:] > idx[:-1]).all()), "used slots must have strictly ascending indices"
    assert bool(((idx >= 0) & (idx < numel)).all())
    assert not msg.indices[used:].any() and not msg.values[used:].float().any(), "padding must be (0, 0)"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_error_feedback_identity(kind, dtype, shape):
    """residual == grad + old residual - msg.to_dense(), exactly, and the sent values are acc's."""
    compressor = gx.make_compressor(kind, density=0.05)
    grad = gradient(shape, dtype, seed=1)
    old_residual = gradient(shape, dtype, seed=2)
    residual = old_residual.clone()
    msg = compressor.compress(grad, residual, step=3)
    numel = grad.numel()
    check_message_layout(msg, numel, k_for_density(0.05, numel))
    acc = (old_residual + grad).reshape(-1)  # the same rounding as the fused op: one add in grad's dtype
    expected = acc.clone()
    expected[msg.indices.long()] = 0
    assert torch.equal(residual.reshape(-1), expected)
    used = min(int(msg.count), msg.k)
    assert torch.equal(msg.values[:used], acc[msg.indices[:used].long()])
    assert torch.equal((residual.reshape(-1) + msg.to_dense()), acc)


@pytest.mark.parametrize("kind", KINDS)
def test_without_residual_grad_is_untouched(kind):
    grad = gradient((1000,), torch.float32, seed=4)
    before = grad.clone()
    msg = gx.make_compressor(kind, density=0.01).compress(grad, None, step=0)
    assert torch.equal(grad, before)
    assert torch.equal(msg.values, grad[msg.indices.long()])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heavy_tailed", [False, True])
def test_gaussiank_accurate_matches_reference(dtype, heavy_tailed):
    """The accurate mode is reference.gaussian_select: the histogram threshold, refined, then compact."""
    n, density = 20000, 0.01
    k = k_for_density(density, n)
    grad = gradient((n,), dtype, seed=5, heavy_tailed=heavy_tailed)
    residual = gradient((n,), dtype, seed=6)
    oracle_residual = residual.clone()
    msg = gx.make_compressor("gaussiank", density).compress(grad, residual)
    values, indices, count, stats = reference.gaussian_select(grad, oracle_residual, ops.z_for_density(density), k, k,
                                                              update_residual=True)
    assert torch.equal(msg.indices, indices) and torch.equal(msg.values, values) and torch.equal(msg.count, count)
    assert torch.equal(residual, oracle_residual)
    assert msg.stats[ops.STAT_THRESHOLD] == stats[ops.STAT_THRESHOLD]
    torch.testing.assert_close(msg.stats, stats)  # mean and std: double sums, in another order
    assert 0.9 * k <= int(msg.count) <= 1.1 * k


def paper_threshold(acc: torch.Tensor, gaussian: float, k: int) -> float:
    """The published loop, on the host: up to 3 corrections, stop when the count is in [2k/3, 4k/3]."""
    magnitude = acc.float().abs()
    threshold = np.float32(gaussian)
    for _ in range(3):
        count = int((magnitude >= float(threshold)).sum())
        if count < 2 * k / 3:
            threshold = np.float32(threshold * np.float32(0.5))
        elif count > 4 * k / 3:
            threshold = np.float32(threshold * np.float32(1.5))
        else:
            break
    return float(threshold)


@pytest.mark.parametrize("density", [0.001, 0.01, 0.05])
@pytest.mark.parametrize("heavy_tailed", [False, True])
def test_gaussiank_paper_mode_matches_the_published_loop(density, heavy_tailed):
    n = 50000
    k = k_for_density(density, n)
    grad = gradient((n,), torch.float32, seed=7, heavy_tailed=heavy_tailed)
    msg = gx.make_compressor("gaussiank", density, mode="paper").compress(grad, None)
    threshold = paper_threshold(grad, float(msg.stats[ops.STAT_GAUSSIAN_THRESHOLD]), k)
    values, indices, count = reference.compact(grad, torch.tensor([threshold]), k)
    assert torch.equal(msg.indices, indices) and torch.equal(msg.values, values) and torch.equal(msg.count, count)


@pytest.mark.skipif(not TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
def test_gaussiank_triton_backend_matches_cpu():
    # The Triton kernels take CUDA tensors on a GPU (where TRITON_INTERPRET is unset), CPU ones under the interpreter.
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    grad = gradient((3000,), torch.float32, seed=8)
    residuals = [gradient((3000,), torch.float32, seed=9), gradient((3000,), torch.float32, seed=9).to(device)]
    messages = [gx.make_compressor("gaussiank", 0.02, backend=backend).compress(grad.to(residual.device), residual)
                for backend, residual in zip(("cpu", "triton"), residuals)]
    assert torch.equal(messages[0].indices, messages[1].indices.cpu())
    assert torch.equal(messages[0].values, messages[1].values.cpu())
    assert torch.equal(residuals[0], residuals[1].cpu())


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_selects_the_largest_magnitudes(dtype):
    n, density = 5000, 0.01
    grad = gradient((n,), dtype, seed=10)
    msg = gx.make_compressor("topk", density).compress(grad, None)
    k = k_for_density(density, n)
    magnitudes = grad.float().abs()
    kth_largest = magnitudes.sort(descending=True).values[k - 1]
    assert int(msg.count) == k and len(set(msg.indices.tolist())) == k
    assert bool((magnitudes[msg.indices.long()] >= kth_largest).all())
    assert int((magnitudes > kth_largest).sum()) <= k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel, chunk, density", [(5000, 256, 0.05), (4096 * 3, 4096, 0.03125), (700, 1000, 0.01),
                                                   (1030, 64, 0.02)])
def test_chunktopk_takes_each_chunks_largest(dtype, numel, chunk, density):
    """Each chunk's k // chunks largest |acc| (the last, shorter chunk as many as it holds, at most), found here by
    a plain loop over the chunks with numpy's stable sort; the rest of the k slots are padding."""
    grad = gradient((numel,), dtype, seed=13)
    residual = gradient((numel,), dtype, seed=14)
    acc = (grad + residual).float().numpy()
    msg = gx.make_compressor("chunktopk", density, chunk=chunk).compress(grad, residual)
    k = k_for_density(density, numel)
    per_chunk = k // math.ceil(numel / chunk)
    expected = []
    for start in range(0, numel, chunk):
        part = np.abs(acc[start:start + chunk])
        order = np.argsort(-part, kind="stable")[:per_chunk]
        cut = part[order[-1]]
        chosen = set(msg.indices[:int(msg.count)].tolist()) & set(range(start, start + part.size))
        assert len(chosen) == min(per_chunk, part.size), (start, len(chosen))
        assert all(part[i - start] >= cut for i in chosen), start  # ties may pick another index of equal |acc|
        expected.append(min(per_chunk, part.size))
    assert int(msg.count) == sum(expected)
    check_message_layout(msg, numel, k)
    assert torch.equal((residual + msg.to_dense()).float(), torch.from_numpy(acc).to(dtype).float())


def test_chunktopk_refuses_chunks_it_cannot_cover():
    with pytest.raises(ValueError, match=r"density x chunk must be >= 1, got 0.001 x 512"):
        gx.make_compressor("chunktopk", 0.001, chunk=512)
    for chunk in (0, 2.5, True):
        with pytest.raises(ValueError, match="chunk must be a positive int"):
            gx.make_compressor("chunktopk", 0.1, chunk=chunk)
    with pytest.raises(ValueError, match=r"k = 2 slots cannot cover 3 chunks of 10 elements"):
        gx.make_compressor("chunktopk", 0.1, chunk=10).compress(torch.ones(30), k=2)


def test_randomk_draws_the_same_indices_for_the_same_step():
    grad = gradient((4000,), torch.float32, seed=11)
    first, second = (gx.make_compressor("randomk", 0.01, seed=5) for _ in range(2))
    same = [c.compress(grad, None, step=17).indices for c in (first, second)]
    assert torch.equal(same[0], same[1])
    assert not torch.equal(first.compress(grad, None, step=18).indices, same[0])
    assert len(set(same[0].tolist())) == 40
    # Without a step, the call count is the step: two fresh compressors stay in step.
    fresh = [compressor.__class__(0.01, seed=5) for compressor in (first, second)]
    assert torch.equal(fresh[0].compress(grad).indices, fresh[1].compress(grad).indices)


def test_density_one_sends_everything():
    grad = gradient((999,), torch.float32, seed=12)
    for kind in KINDS:
        residual = torch.zeros_like(grad)
        msg = gx.make_compressor(kind, 1.0).compress(grad, residual, step=0)
        assert msg.k == 999 and torch.equal(msg.to_dense(), grad) and not residual.any()


def test_k_for_density():
    assert k_for_density(0.07, 100) == 7  # 0.07 * 100 = 7.000000000000001 in floats
    assert k_for_density(0.01, 101) == 2
    assert k_for_density(1e-9, 10) == 1
    assert k_for_density(1.0, 10) == 10
    assert k_for_density(0.001, 2**20) == math.ceil(0.001 * 2**20)


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan"), "0.1", True, None])
def test_bad_density_is_rejected(density):
    with pytest.raises(ValueError, match="density must be a number in"):
        gx.make_compressor("topk", density)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="compressor must be one of"):
        gx.make_compressor("powersgd", 0.1)
    with pytest.raises(TypeError, match="make_compressor\\('topk'\\).*mode"):
        gx.make_compressor("topk", 0.1, mode="paper")
    with pytest.raises(ValueError, match="mode must be one of"):
        gx.make_compressor("gaussiank", 0.1, mode="exact")
    with pytest.raises(TypeError, match="seed must be an int"):
        gx.make_compressor("randomk", 0.1, seed=1.5)
    compressor = gx.make_compressor("gaussiank", 0.1)
    with pytest.raises(TypeError, match="grad must be a float32, float16 or bfloat16 tensor"):
        compressor.compress(torch.arange(10))
    with pytest.raises(ValueError, match="grad must have at least one element"):
        compressor.compress(torch.zeros(0))
    with pytest.raises(ValueError, match="residual must be a contiguous tensor of grad's shape"):
        compressor.compress(torch.zeros(10), torch.zeros(11))
    with pytest.raises(ValueError, match="dtype torch.float32"):
        compressor.compress(torch.zeros(10), torch.zeros(10, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous=False"):
        compressor.compress(torch.zeros(10, 2), torch.zeros(2, 10).t())


# --- on a GPU: the selection step as CUDA graphs and the launch budget need it --------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_compress_with_error_feedback_replays_in_a_cuda_graph(backend):
    """compress (Gaussian-k, error feedback) synchronises nothing with the host, so it can be captured in a CUDA
    graph: replayed on new gradients, it gives the eager messages and residuals bit for bit."""
    n, density = 1_000_003, 0.001
    compressor = gx.make_compressor("gaussiank", density, backend=backend)
    grads = [gradient((n,), torch.float32, seed=20 + step, heavy_tailed=step == 1).cuda() for step in range(3)]
    eager_residual = gradient((n,), torch.float32, seed=23).cuda()
    graph_residual, static_grad = eager_residual.clone(), torch.empty_like(grads[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs asks: compiles, allocates
        compressor.compress(grads[0], torch.zeros_like(graph_residual))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        msg = compressor.compress(static_grad, graph_residual)
    for step, grad in enumerate(grads):
        expected = compressor.compress(grad, eager_residual)
        static_grad.copy_(grad)
        graph.replay()
        for name in ("values", "indices", "count", "stats"):
            assert torch.equal(getattr(msg, name), getattr(expected, name)), (step, name)
        assert torch.equal(graph_residual, eager_residual), step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_compress_stays_within_its_launch_and_allocation_budget(dtype):
    """A Gaussian-k step with error feedback on the CUDA kernels, once its workspace exists: at most 6 kernel
    launches (csrc/cuda/select.cu counts 5) and no allocation but the message's four tensors."""
    from torch.profiler import ProfilerActivity, profile

    compressor = gx.make_compressor("gaussiank", 0.001, backend="cuda")
    grad, residual = gradient((2_000_003,), dtype, seed=24).cuda(), gradient((2_000_003,), dtype, seed=25).cuda()
    compressor.compress(grad, residual)
    torch.cuda.synchronize()
    calls = 5
    allocated = torch.cuda.memory_stats()["allocation.all.allocated"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            compressor.compress(grad, residual)
        torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"] - allocated
    device_ops = [event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    assert len(device_ops) <= 6 * calls, sorted(device_ops)
    assert allocations == 4 * calls


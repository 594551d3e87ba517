"""Backends as objects: what each declares, the one error that lists every backend's reasons, and the choice made
once that reaches every op call of a compressor, the collectives and the DDP hook's state."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gtopk_ext as gx
from gtopk_ext.ddp import reduce_buffer
from gtopk_ext import backends, ops
from tests.distributed import run_distributed

CPU = torch.device("cpu")


def test_backends_declare_what_they_support_and_why_not():
    assert backends.CPU.not_supported_reasons(CPU) == []
    assert backends.CPU.not_supported_reasons(CPU, torch.float64) == [
        "supports float32, float16, bfloat16, got torch.float64"]
    cuda_reasons = backends.CUDA.not_supported_reasons(CPU)
    assert cuda_reasons[0] == "needs CUDA tensors, got cpu"
    assert ("the CUDA kernels were not built" in " ".join(cuda_reasons)) == (not backends.cuda_kernels_built())
    assert backends.TORCH.not_supported_reasons(CPU, op="merge_topk") == []
    assert backends.TORCH.not_supported_reasons(CPU, op="compact") == [
        "implements merge_topk only, not compact"]


def test_a_backend_that_cannot_run_gets_every_backends_reasons(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError) as error:
        ops.compact(torch.randn(8), torch.ones(1), 2, backend="triton")
    message = str(error.value)
    assert message.startswith("backend 'triton' cannot run on tensors on cpu (compact). Every backend: "), message
    for part in ("backend 'cpu' can run", "backend 'cuda' needs CUDA tensors, got cpu",
                 "backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got cpu",
                 "backend 'torch' implements merge_topk only, not compact"):
        assert part in message, (part, message)
    with pytest.raises(ValueError, match="backend 'torch' cannot run on tensors on cpu \\(gaussian_threshold\\)"):
        ops.gaussian_threshold(torch.randn(8), z=1.0, backend=backends.TORCH)
    # merge_topk runs on the torch backend anywhere, and equals the C++ kernel.
    indices = torch.tensor([1, 4, 0], dtype=torch.int32)
    values = torch.tensor([1.0, -3.0, 0.0])
    for a, b in zip(ops.merge_topk(indices, values, indices, values, 2, backend=backends.TORCH),
                    ops.merge_topk(indices, values, indices, values, 2, backend="cpu")):
        assert torch.equal(a, b)


def test_the_environment_variable_only_sets_the_default(monkeypatch):
    monkeypatch.setenv("GTOPK_EXT_BACKEND", "triton")
    assert backends.choose(CPU) is backends.TRITON
    assert backends.choose(CPU, "cpu") is backends.CPU
    assert backends.choose(CPU, backends.CPU) is backends.CPU


def test_the_choice_is_made_once_per_device_and_survives_pickling(monkeypatch):
    choice = backends.BackendChoice(None)
    monkeypatch.setenv("GTOPK_EXT_BACKEND", "triton")
    assert choice[CPU] is backends.TRITON
    monkeypatch.setenv("GTOPK_EXT_BACKEND", "cpu")  # later changes do not move a device already seen
    assert choice[CPU] is backends.TRITON
    assert pickle.loads(pickle.dumps(choice))[CPU] is backends.TRITON
    with pytest.raises(ValueError, match="backend must be one of"):
        backends.BackendChoice("gpu")


class OpNames(TorchDispatchMode):
    """Counts the ops dispatched while it is active, by name."""

    def __init__(self):
        super().__init__()
        self.names = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[str(func.name())] += 1
        return func(*args, **(kwargs or {}))


def every_op_through_one_backend(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    """A compressor (both Gaussian-k modes) and SparseGradStates (gTop-k and allgather collectives) built with the
    Triton backend, each step's selection, residual update, merges, scatters and compact wire; returns the op
    ops that ran meanwhile, by name (seen by a dispatch mode, which sees this thread only: the hook runs each bucket
    in its call, ``synchronous``)."""
    recorder = OpNames()
    recorder.__enter__()
    generator = torch.Generator().manual_seed(rank)
    residual = torch.zeros(4000)
    for mode in ("accurate", "paper"):
        msg = gx.make_compressor("gaussiank", 0.01, mode=mode, backend="triton").compress(
            torch.randn(4000, generator=generator), residual)
        gx.collectives.gtopk_allreduce(msg, backend="triton")[0].to_dense(backend="triton")
        gx.collectives.sparse_allgather(msg, backend="triton")
        gx.collectives.sparse_allgather(msg, wire="compact", backend="triton")
        for collective in ("gtopk", "allgather"):
            state = gx.SparseGradState(density=0.01, collective=collective,
                                       path=gx.PathPolicy("sparse", min_compress_numel=0),
                                       compressor=gx.make_compressor("gaussiank", 0.01, mode=mode,
                                                                     backend=backends.TRITON))
            state.synchronous = True
            for _ in range(3):  # two dense warm-up iterations, then a compressed one
                reduce_buffer(state, torch.randn(4000, generator=generator), 0).wait()
    recorder.__exit__(None, None, None)
    return recorder.names


def test_the_chosen_backend_runs_every_op_of_compressors_collectives_and_the_hook():
    for calls in run_distributed(every_op_through_one_backend, 2):
        triton = {name.removeprefix("gtopk_ext_triton::") for name in calls if name.startswith("gtopk_ext_triton::")}
        assert triton == set(backends.Backend.ops) - {"merge_topk"}, calls  # the Triton backend merges with torch
        assert any("unique" in name for name in calls), calls  # its merge
        assert not [name for name in calls if name.startswith("gtopk_ext::")], calls

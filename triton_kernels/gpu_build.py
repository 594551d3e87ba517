"""Builds every Triton kernel launch of the ops for GPUs, on a machine without one.

``TRITON_INTERPRET=0 python -m gtopk_ext.triton_kernels.gpu_build`` traces every registered op (ops.REGISTERED) on
example calls with fake CUDA tensors, the way torch.compile traces them, takes each recorded launch (kernel,
argument types, constants, num_warps) and runs Triton's whole compiler on it for sm_80 (A100) and sm_90 (H100),
ptxas included. It prints one line per build and exits non-zero when one fails. The ops must be registered as
triton_ops, so TRITON_INTERPRET must be unset or 0.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import triton
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

from gtopk_ext import _C  # noqa: F401  (the C++ ops, whose Meta kernels check the arguments)
from gtopk_ext._contract import STAT_THRESHOLD, wire_num_pages

from . import ops

TARGETS = (GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32))
POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float64: "*fp64",
                 torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8"}


@dataclass(frozen=True)
class Launch:
    """One kernel launch as Triton's compiler sees it."""

    kernel: triton.JITFunction
    signature: tuple[tuple[str, str], ...]  # (parameter, Triton type or "constexpr")
    constexprs: tuple[tuple[str, object], ...]
    divisible_by_16: tuple[int, ...]  # parameters Triton would specialize as 16-divisible (aligned pointers)
    num_warps: int

    def describe(self) -> str:
        types = ", ".join(t for _, t in self.signature if t != "constexpr")
        constants = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.kernel.fn.__name__}({types}; {constants}; num_warps={self.num_warps})"


def _launch_of(node: torch.fx.Node) -> Launch:
    wrapped = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    # wrap_triton turns launch options (num_warps) into a one-config autotuner around the kernel.
    kernel, num_warps = (wrapped, 4) if isinstance(wrapped, triton.JITFunction) else (
        wrapped.fn, wrapped.configs[0].num_warps)
    args = {name: value.meta["val"] if isinstance(value, torch.fx.Node) else value
            for name, value in node.kwargs["kwargs"].items()}
    args.update(kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]))
    signature, constexprs, divisible = [], [], []
    for index, param in enumerate(kernel.params):
        value = args[param.name]
        if param.is_constexpr:
            kind = "constexpr"
        elif isinstance(value, torch.Tensor):
            kind = POINTER_TYPES[value.dtype]
            divisible.append(index)  # torch's allocations are 16-byte aligned
        elif param.annotation_type:  # e.g. z: tl.float64
            kind = param.annotation_type
        else:  # what Triton does at launch: ints of value 1 become constants, 16-divisible ones are marked
            kind, hint = native_specialize_impl(BaseBackend, value, False, True, True)
            if hint == "D":
                divisible.append(index)
        signature.append((param.name, kind))
        if kind == "constexpr":
            constexprs.append((param.name, value))
    return Launch(kernel, tuple(signature), tuple(constexprs), tuple(divisible), num_warps)


def traced_launches(fn, *inputs: torch.Tensor) -> list[Launch]:
    """The kernel launches of ``fn(*inputs)`` as AOT tracing records them (``inputs`` may be fake)."""
    from functorch.compile import aot_function

    graphs = []
    aot_function(fn, fw_compiler=lambda gm, _: graphs.append(gm) or gm)(*inputs)
    return [_launch_of(node) for node in graphs[0].graph.nodes
            if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional]


def compile_launch(launch: Launch, target: GPUTarget):
    """Triton's compiler, down to a cubin, for one launch and one GPU target."""
    source = ASTSource(fn=launch.kernel, signature=dict(launch.signature), constexprs=dict(launch.constexprs),
                       attrs={(i,): [["tt.divisibility", 16]] for i in launch.divisible_by_16})
    return triton.compile(source, target=target, options={"num_warps": launch.num_warps})


def compress_step(grad: torch.Tensor, residual: torch.Tensor | None, k: int) -> tuple[torch.Tensor, ...]:
    """A compression step in four ops: statistics, compaction, the residual update and a scatter-add of the
    message."""
    acc = residual if residual is not None else grad
    stats = ops.gaussian_threshold(grad, residual, 2.5, k)
    values, indices, count = ops.compact(acc, stats[STAT_THRESHOLD:], max(1, k))
    ops.residual_update(acc, indices, values)
    ops.scatter_add(acc, indices, values)
    return values, indices, count


def op_calls(dtype: torch.dtype, numel: int) -> dict[str, list[dict]]:
    """Example arguments of every Triton op by the schema's names, on CUDA tensors of ``dtype`` (under a
    FakeTensorMode): with and without residual and histogram, ``numel`` elements (1: a size Triton turns into a
    constant)."""
    def tensor(n=numel, dtype=dtype):
        return torch.empty(n, device="cuda", dtype=dtype)

    indices = torch.zeros(max(1, numel // 100), device="cuda", dtype=torch.int32)
    values = tensor(indices.numel())
    threshold = tensor(1, torch.float32)
    count = torch.ones(1, device="cuda", dtype=torch.int32)
    halves, low = tensor(indices.numel(), torch.float16), torch.zeros_like(indices, dtype=torch.int16)
    pages = torch.zeros(wire_num_pages(numel) + 1, device="cuda", dtype=torch.int32)
    shift = torch.zeros(1, device="cuda", dtype=torch.int32)
    k = max(1, numel // 250)
    return {
        "gaussian_threshold": [dict(grad=tensor(), residual=tensor(), z=2.5, k=k),
                               dict(grad=tensor(), residual=None, z=2.5, k=0)],
        "compact": [dict(acc=tensor(), threshold=threshold, capacity=k)],
        "gaussian_select": [dict(grad=tensor(), residual=tensor(), z=2.5, k=k, capacity=k),
                            dict(grad=tensor(), residual=tensor(), z=2.5, k=k, capacity=k, update_residual=True),
                            dict(grad=tensor(), residual=None, z=2.5, k=1, capacity=1)],
        "scatter_add": [dict(dense=tensor(), indices=indices, values=values)],
        "residual_update": [dict(residual=tensor(), indices=indices, values=values)],
        "wire_encode": [dict(indices=indices, values=values, count=count, numel=numel)],
        "wire_decode": [dict(halves=halves, low=low, pages=pages, shift=shift, count=count, numel=numel)],
    }


def all_launches() -> list[Launch]:
    """The distinct launches of every registered Triton op (ops.REGISTERED) over the dtypes and the examples of
    op_calls: an op without examples is an error, so no op's kernels can be left out of the build."""
    launches: dict[Launch, None] = {}
    with FakeTensorMode():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for numel in (10_000, 1):
                calls = op_calls(dtype, numel)
                missing = set(ops.REGISTERED) - set(calls)
                if missing:
                    raise RuntimeError(f"gpu_build: no example call of the Triton ops {sorted(missing)}")
                for name in ops.REGISTERED:
                    op = getattr(torch.ops.gtopk_ext_triton, name)
                    for arguments in calls[name]:
                        tensor_names = [key for key, value in arguments.items() if isinstance(value, torch.Tensor)]

                        def call(*tensors, arguments=arguments, tensor_names=tensor_names, op=op):
                            return op(**{**arguments, **dict(zip(tensor_names, tensors))})

                        launches.update(dict.fromkeys(traced_launches(call, *(arguments[n] for n in tensor_names))))
    return list(launches)


def main() -> int:
    if triton.knobs.runtime.interpret:
        print("gpu_build: unset TRITON_INTERPRET (the interpreter registers the ops without Triton tracing)")
        return 2
    failures = 0
    for launch in all_launches():
        for target in TARGETS:
            try:
                compiled = compile_launch(launch, target)
                print(f"ok sm_{target.arch} {launch.describe()} shared={compiled.metadata.shared}")
            except Exception as error:  # report every failing build, not only the first
                failures += 1
                print(f"FAILED sm_{target.arch} {launch.describe()}: {type(error).__name__}: {error}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

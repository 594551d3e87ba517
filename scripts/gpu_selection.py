"""The selection step on a GPU, for scripts/gpu_check.sh: Gaussian-k compress with error feedback, per backend, at
each size: its kernels, launches and allocations per call (torch.profiler, the caching allocator's
counters), whether it synchronises with the host (torch.cuda's sync debug mode), and its time eager and captured
in a CUDA graph, against ``x.add_(y)`` on two float32 tensors of the same size (CUDA events, median of --repeats).

    python scripts/gpu_selection.py --json selection.json --markdown selection.md   # 25M and 100M, d = 0.001
    python scripts/gpu_selection.py --device cpu --sizes 20000 --repeats 3 ...      # the dry run: no GPU needed

Each backend (the CUDA kernels, the Triton kernels) runs in a process of its own, so that a crash or a timeout
names it. On the CPU (--device cpu) the backends are the C++ kernels and the Triton interpreter, timed with
perf_counter, without graphs or device counters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_BACKENDS = ["cuda", "triton"]
CPU_BACKENDS = ["cpu", "triton"]


def timed_ms(fn, device, repeats: int, before=None) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of fn (CUDA events around the call alone on a GPU); ``before``
    runs ahead of each call, outside the timing."""
    import torch

    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - begin))
    return times


def counts_per_call(compress, device, calls: int = 5) -> dict:
    """Device operations (kernels, memsets, copies), launch API calls and allocations per call of compress."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as prof:
        for _ in range(calls):
            compress()
        if on_gpu:
            torch.cuda.synchronize()
    if not on_gpu:
        return {"device_ops_per_call": None, "launch_calls_per_call": None, "allocations_per_call": None,
                "cuda_mallocs_per_call": None, "device_ops": []}
    after = torch.cuda.memory_stats()
    device_ops = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU
                and ("LaunchKernel" in e.name or "MemsetAsync" in e.name or "MemcpyAsync" in e.name)]
    return {
        "device_ops_per_call": len(device_ops) / calls,
        "launch_calls_per_call": len(launches) / calls,
        "allocations_per_call": (after["allocation.all.allocated"] - stats["allocation.all.allocated"]) / calls,
        "cuda_mallocs_per_call": (after["segment.all.allocated"] - stats["segment.all.allocated"]) / calls,
        "device_ops": sorted(set(device_ops)),
    }


def synchronises(compress, device) -> bool | None:
    """Whether compress makes a synchronising CUDA call that torch knows of (.item(), a copy to the host, ...)."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.set_sync_debug_mode("error")
    try:
        compress()
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")


def measure(backend: str, n: int, density: float, repeats: int, device_name: str) -> dict:
    import torch

    import gtopk_ext as gx

    device = torch.device(device_name)
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=generator).to(device)
    initial = (0.1 * torch.randn(n, generator=generator)).to(device)
    residual = initial.clone()
    compressor = gx.make_compressor("gaussiank", density, backend=backend)
    row = {"backend": backend, "n": n, "density": density, "k": compressor.k_for(n), "repeats": repeats}

    def restore():
        residual.copy_(initial)

    def compress():
        return compressor.compress(grad, residual)

    side = torch.cuda.Stream() if device.type == "cuda" else None
    if side is not None:  # warm-up off the capture stream, as torch.cuda.graphs asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            compress()
        torch.cuda.current_stream().wait_stream(side)
    compress()  # and on this stream: compilation, the workspace of this stream
    row.update(counts_per_call(compress, device))
    row["synchronises"] = synchronises(compress, device)
    restore()
    eager = compress()
    eager_message = [t.clone() for t in (eager.values, eager.indices, eager.count)]
    eager_residual = residual.clone()
    row["selected"] = int(eager.count)

    x, y = torch.empty_like(grad), torch.ones_like(grad)
    floor = timed_ms(lambda: x.add_(y), device, repeats)
    eager_times = timed_ms(compress, device, repeats, before=restore)
    row["floor_ms"] = statistics.median(floor)
    row["eager_ms"] = statistics.median(eager_times)
    row["eager_over_floor"] = row["eager_ms"] / row["floor_ms"]
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        restore()
        with torch.cuda.graph(graph):
            captured = compress()
        restore()
        graph.replay()
        row["graph_matches_eager"] = (
            all(torch.equal(a, b) for a, b in zip((captured.values, captured.indices, captured.count), eager_message))
            and torch.equal(residual, eager_residual))
        row["graph_ms"] = statistics.median(timed_ms(graph.replay, device, repeats, before=restore))
        row["graph_over_floor"] = row["graph_ms"] / row["floor_ms"]
    return row


def worker(args) -> None:
    for n in args.sizes:
        print(json.dumps(measure(args.backend, n, args.density, args.repeats, args.device)), flush=True)


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| backend | n | k | selected | device ops/call | launch calls/call | allocations/call "
             "| cudaMalloc/call | syncs | floor ms | eager ms | eager/floor | graph ms | graph/floor | graph = eager |",
             "|" + "---|" * 15]

    def cell(value, spec=""):
        return "-" if value is None else format(value, spec)

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | error: {r['error']} |" + " |" * 13)
            continue
        lines.append(" | ".join([
            f"| {r['backend']}", f"{r['n']:,}", f"{r['k']:,}", f"{r['selected']:,}",
            cell(r["device_ops_per_call"], ".1f"), cell(r["launch_calls_per_call"], ".1f"),
            cell(r["allocations_per_call"], ".1f"), cell(r["cuda_mallocs_per_call"], ".1f"), cell(r["synchronises"]),
            f"{r['floor_ms']:.3f}", f"{r['eager_ms']:.3f}", f"{r['eager_over_floor']:.2f}",
            cell(r.get("graph_ms"), ".3f"), cell(r.get("graph_over_floor"), ".2f"),
            cell(r.get("graph_matches_eager"))]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", type=int, nargs="+", default=[25_000_000, 100_000_000])
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=150, help="seconds per configuration")
    parser.add_argument("--json", help="where to write the rows and the environment")
    parser.add_argument("--markdown", help="where to write the table")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    rows, failed = [], False
    for backend in GPU_BACKENDS if args.device == "cuda" else CPU_BACKENDS:
        env = dict(os.environ)
        if args.device == "cpu" and backend == "triton":
            env["TRITON_INTERPRET"] = "1"
        command = [sys.executable, __file__, "--worker", "--backend", backend, "--device", args.device,
                   "--density", str(args.density), "--repeats", str(args.repeats), "--sizes", *map(str, args.sizes)]
        try:
            result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
            found = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
            error = None if result.returncode == 0 else f"exit {result.returncode}: {result.stderr[-600:]}"
        except subprocess.TimeoutExpired as timeout:
            found = [json.loads(line) for line in (timeout.stdout or b"").decode().splitlines() if line.startswith("{")]
            error = f"timed out after {args.timeout} s"
        rows += found
        if error is not None:
            failed = True
            rows.append({"backend": backend, "error": error})
        print(f"{backend}: {len(found)} rows" + (f", {error}" if error else ""), flush=True)

    import torch

    environment = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                   "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    try:
        import triton

        environment["triton"] = triton.__version__
    except ImportError:
        environment["triton"] = None
    header = (f"Gaussian-k compress with error feedback, float32, density {args.density}, median of {args.repeats}: "
              + ", ".join(f"{k} {v}" for k, v in environment.items()))
    table = markdown(rows, header)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment, "rows": rows}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

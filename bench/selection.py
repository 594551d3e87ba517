"""Selection: Gaussian-k's whole error-feedback step (threshold, compaction, residual update) against torch.topk's
and the floor residual.add_(grad), the methods interleaved repetition by repetition. docs/selection.md.

    python -m bench.selection --device cuda --backend triton # a GPU: CUDA events, the Triton kernels
    python -m bench.selection --device cuda --profile --sizes 25000000 --densities 0.001   # where the time goes
"""

import argparse
import os
import statistics

import torch

from bench.harness import cli, report
from bench.harness.gradients import time_methods
from gtopk_ext.compressors import make_compressor

COLUMNS = [("n", "11d", "n"), ("density", "7g", "density"), ("k", "9d", "k"),
           *((title, "8.2f", lambda r, name=name: r["median_ms"][name]) for title, name in (
               ("floor", "floor"), ("gaussk", "gaussiank"), ("paper", "gaussiank_paper"), ("topk", "topk"),
               ("topk(s)", "topk_sorted"))),
           ("topk/gk", "7.1f", "topk_over_gaussiank"), ("gk/floor", "8.2f", "gaussiank_over_floor"),
           ("pap/flr", "7.2f", "paper_over_floor")]
LEGEND = ("(times: median ms; topk/gk: speed-up of Gaussian-k over the torch.topk path; gk/floor, pap/flr: multiples "
          "of residual.add_(grad))")


def inputs(n: int, device: str = "cpu", dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded gradient and residual of n elements (the pytest-benchmark suite's too)."""
    generator = torch.Generator().manual_seed(0)
    grad, residual = torch.randn(n, generator=generator), 0.1 * torch.randn(n, generator=generator)
    return grad.to(device, getattr(torch, dtype)), residual.to(device, getattr(torch, dtype))


def measure(n: int, density: float, args: argparse.Namespace) -> dict:
    k, times = time_methods(*inputs(n, args.device, args.dtype), density, args.backend, args.repeats)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {"n": n, "density": density, "k": k, "dtype": args.dtype, "device": torch.device(args.device).type,
            "backend": args.backend or os.environ.get("GTOPK_EXT_BACKEND", "auto"), "repeats": args.repeats,
            "median_ms": ms, "all_ms": {name: [1e3 * x for x in t] for name, t in times.items()},
            "topk_over_gaussiank": ms["topk"] / ms["gaussiank"], "gaussiank_over_floor": ms["gaussiank"] / ms["floor"],
            "paper_over_floor": ms["gaussiank_paper"] / ms["floor"]}


def profile_step(n: int, density: float, args: argparse.Namespace, calls: int = 10) -> str:
    """torch.profiler's view of ``calls`` Gaussian-k steps: each operator's and kernel's time and the kernels
    launched per step, which set the fixed cost that dominates below ~10M elements."""
    from torch.profiler import ProfilerActivity, profile

    grad, initial_residual = inputs(n, args.device, args.dtype)
    residual, on_gpu = initial_residual.clone(), grad.device.type == "cuda"
    compressor = make_compressor("gaussiank", density, backend=args.backend)
    compressor.compress(grad, residual)  # warm-up: compilation, allocator
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as prof:
        for _ in range(calls):
            residual.copy_(initial_residual)
            compressor.compress(grad, residual)
        if on_gpu:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="device_time_total" if on_gpu else "cpu_time_total", row_limit=25)
    kernels = sum(event.device_type == torch.autograd.DeviceType.CUDA for event in prof.events())
    return (f"Gaussian-k step, n={n}, density={density}, {grad.dtype}, {grad.device.type}, backend "
            f"{compressor.backend[grad.device].name}, {calls} steps (each after residual.copy_)\n{table}"
            + (f"device kernels per step, the copy included: {kernels / calls:.1f}\n" if on_gpu else ""))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__, densities=[0.001, 0.01, 0.05], json="bench/results/selection.json")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**20, 2**24, 25_000_000, 100_000_000])
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--backend", default=None, help="auto | cpu | cuda | triton (default: $GTOPK_EXT_BACKEND)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions (median)")
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing, profile the Gaussian-k step at the first size and density")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.profile:
        print(profile_step(args.sizes[0], args.densities[0], args))
        return []
    rows = report.streamed((measure(n, density, args) for n in args.sizes for density in args.densities), COLUMNS)
    print(LEGEND)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report.write_json(args.json, args, threads=torch.get_num_threads(),
                      gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else None, rows=rows)
    return rows


if __name__ == "__main__":
    main()

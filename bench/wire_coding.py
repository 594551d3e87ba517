"""Index and value codings on the exact top-k of real and synthetic gradients: bytes per index of the compact wire
(16-bit lows and a page table) and of gap codings, and the values' relative RMS error in the wire's shifted float16
and other 16-bit formats. docs/collectives.md.

    python -m bench.wire_coding --json wire_coding.json
"""

import argparse
import json
from pathlib import Path

import torch

from bench.harness import cli, report
from bench.harness.gradients import captured_gradients, synthetic_gradient, wide_mlp
from gtopk_ext import ops, wire
from gtopk_ext.compressors import k_for_density


def codings(grad: torch.Tensor, density: float) -> dict:
    """The row of one gradient at one density."""
    numel, k = grad.numel(), k_for_density(density, grad.numel())
    indices = torch.topk(grad.abs(), k, sorted=False).indices.sort().values
    values, count = grad[indices], torch.tensor([k], dtype=torch.int32)
    gaps = torch.diff(indices, prepend=torch.tensor([-1])).clamp(min=1)  # the first gap from -1: >= 1
    bits, counts = torch.floor(torch.log2(gaps.double())) + 1, torch.unique(gaps, return_counts=True)[1].double()
    shifted = ops.wire_decode(*ops.wire_encode(torch.arange(k, dtype=torch.int32), values, count, k), count, k)[1]
    half = values.half()

    def rms(approx: torch.Tensor) -> float:
        return float((approx.double() - values.double()).norm() / values.double().norm())

    return {"k": k, "wire (lows + pages)": (wire.payload_size("compact", k, numel, torch.float32, 0) - 4 - 2 * k) / k,
            "gap16 + escape": (2 * k + 4 * int((gaps >= 0xFFFF).sum())) / k,
            "varint gaps": float(torch.ceil(bits / 7).sum()) / k,
            "elias-gamma gaps": float((2 * bits - 1).sum()) / 8 / k,
            "gap entropy": float(-(counts / k * torch.log2(counts / k)).sum()) / 8,
            "fp16 shifted (wire)": rms(shifted), "bf16": rms(values.bfloat16().float()),
            "fp16 plain": rms(half.float().nan_to_num(posinf=0.0, neginf=0.0)),
            "fp16 plain lost": int(((half == 0) & (values != 0)).sum() + half.isinf().sum())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return cli.parser(__doc__, densities=[0.001, 0.01, 0.05], json=None).parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    gradients = {f"cnn step {step}": g for step, g in captured_gradients("cnn", steps=(0, 100)).items()}
    gradients["mlp 3M step 20"] = captured_gradients(wide_mlp(3_000_000), steps=(20,))[20]
    generator = torch.Generator().manual_seed(0)
    for kind in ("gaussian", "student_t3"):
        gradients[f"{kind} 1M"] = synthetic_gradient(kind, 1 << 20, generator) * 1e-3
    rows = [{"gradient": name, "numel": grad.numel(), "density": density, **codings(grad, density)}
            for name, grad in gradients.items() for density in args.densities]
    print(report.table(rows, [("gradient", "", "gradient"), ("numel", "d", "numel"), ("d", "g", "density"),
                              *((c, ".4g", c) for c in rows[0] if c not in ("gradient", "numel", "density", "k"))]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

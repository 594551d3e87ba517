"""Index and value codings for the compact wire, measured on real and synthetic gradients.

For each gradient and density, the exact top-k (by |value|) is taken, and the bytes per index of each coding
of its ascending indices are counted: the compact wire's (16-bit lows and a page table, fixed size), 16-bit gaps
with an escape (a 0xFFFF word and the int32 index) for a gap of 65535 or more (variable size: the receiver
needs the size first), LEB128 varint gaps, Elias-gamma gaps and the gaps' empirical entropy (a lower bound for
any code of independent gaps). The values' rounding error of float16 after the wire's shift is set beside
bfloat16's and plain float16's (relative RMS over the selected values; plain float16 also counts the values it
turns into 0 or infinity).

    python -m bench.wire_coding --json wire_coding.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from bench.harness import report
from bench.harness.gradients import captured_gradients, synthetic_gradient, wide_mlp
from gtopk_ext import ops, wire


def index_bytes(indices: torch.Tensor, numel: int) -> dict[str, float]:
    k = indices.numel()
    gaps = torch.diff(indices.long(), prepend=torch.tensor([-1])).clamp(min=1)  # first gap from -1: >= 1
    bits = torch.floor(torch.log2(gaps.double())) + 1
    counts = torch.unique(gaps, return_counts=True)[1].double()
    entropy = float(-(counts / k * torch.log2(counts / k)).sum())
    return {"wire (lows + pages)": (wire.payload_size("compact", k, numel, torch.float32, 0) - 4 - 2 * k) / k,
            "gap16 + escape": (2 * k + 4 * int((gaps >= 0xFFFF).sum())) / k,
            "varint gaps": float(torch.ceil(bits / 7).sum()) / k,
            "elias-gamma gaps": float((2 * bits - 1).sum()) / 8 / k,
            "gap entropy": entropy / 8}


def value_errors(values: torch.Tensor) -> dict[str, float]:
    """Relative RMS rounding error of each 16-bit format on float32 values; plain float16's lost values."""
    count = torch.tensor([values.numel()], dtype=torch.int32)
    indices = torch.arange(values.numel(), dtype=torch.int32)
    encoded = ops.wire_encode(indices, values, count, values.numel())
    shifted = ops.wire_decode(*encoded, count, values.numel())[1]
    norm = float(values.double().norm())

    def rms(approx: torch.Tensor) -> float:
        return float((approx.double() - values.double()).norm()) / norm

    half = values.half()
    lost = int(((half == 0) & (values != 0)).sum() + half.isinf().sum())
    return {"fp16 shifted (wire)": rms(shifted), "bf16": rms(values.bfloat16().float()),
            "fp16 plain": rms(half.float().nan_to_num(posinf=0.0, neginf=0.0)), "fp16 plain lost": lost}


def gradients() -> dict[str, torch.Tensor]:
    found = {f"cnn step {step}": g for step, g in captured_gradients("cnn", steps=(0, 100)).items()}
    found["mlp 3M step 20"] = captured_gradients(wide_mlp(3_000_000), steps=(20,))[20]
    generator = torch.Generator().manual_seed(0)
    for kind in ("gaussian", "student_t3"):
        found[f"{kind} 1M"] = synthetic_gradient(kind, 1 << 20, generator) * 1e-3
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01, 0.05])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    for name, grad in gradients().items():
        for density in args.densities:
            k = max(1, math.ceil(density * grad.numel()))
            top = torch.topk(grad.abs(), k, sorted=False).indices.sort().values.int()
            rows.append({"gradient": name, "numel": grad.numel(), "density": density, "k": k,
                         **index_bytes(top, grad.numel()), **value_errors(grad[top.long()])})
    print(report.table(rows, [("gradient", "", "gradient"), ("numel", "d", "numel"), ("d", "g", "density"),
                              *((c, ".4g", c) for c in rows[0] if c not in ("gradient", "numel", "density", "k"))]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

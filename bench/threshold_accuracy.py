"""Threshold accuracy: how close each selection lands to k, and how much of the exact top-k it captures.

For Gaussian, Laplace, Student-t(3) and spiky gradients (n = 1M and 25M) and real gradients captured while training
on the digits (the demo's CNN, 0.55M parameters, and MLPs of about 1M and 25M), at densities 0.001, 0.01 and 0.05,
for Gaussian-k's paper mode (the 3-step correction loop), its accurate mode (the histogram threshold) and exact
top-k:
- count / k: elements selected before truncation to k slots;
- recall: |sent indices ∩ exact top-k| / k;
- norm: ||sent values||^2 / ||top-k values||^2;
and, in the same run, the time of the accurate mode relative to the torch.topk path and to residual.add_(grad).

    python -m bench.threshold_accuracy                  # the full table (a few minutes on 2 cores)
    python -m bench.threshold_accuracy --sizes 1000000 --skip-real
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from bench.harness import report
from bench.harness.gradients import SYNTHETIC, captured_gradients, synthetic_gradient, wide_mlp
from bench.harness.selection import time_methods
from gtopk_ext.compressors import make_compressor

MODES = {"paper": ("gaussiank", {"mode": "paper"}), "accurate": ("gaussiank", {"mode": "accurate"}),
         "topk": ("topk", {})}
COUNT_BOUNDS = (0.9, 1.1)
MIN_RECALL = 0.9


def selection_quality(grad: torch.Tensor, density: float, backend: str | None) -> dict[str, dict[str, float]]:
    """count/k, recall and norm share of each mode on grad (no residual: the selection itself)."""
    exact = None
    quality = {}
    for mode, (kind, kwargs) in MODES.items():
        compressor = make_compressor(kind, density, backend=backend, **kwargs)
        k = compressor.k_for(grad.numel())
        if exact is None:  # ascending, as messages hold them: the same set then sums in the same order
            exact = torch.topk(grad.abs(), k).indices.sort().values
        message = compressor.compress(grad)
        count = int(message.count)
        sent = message.indices[: min(count, k)].long()
        quality[mode] = {
            "count_over_k": count / k,
            "recall": float(torch.isin(sent, exact).sum()) / k,
            "norm": float(grad[sent].double().square().sum() / grad[exact].double().square().sum()),
        }
    return quality


def evaluate(name: str, grad: torch.Tensor, density: float, backend: str | None, repeats: int) -> dict:
    quality = selection_quality(grad, density, backend)
    k, times = time_methods(grad, torch.zeros_like(grad), density, backend, repeats)
    ms = {method: 1e3 * statistics.median(t) for method, t in times.items()}
    accurate = quality["accurate"]
    return {
        "gradient": name, "n": grad.numel(), "density": density, "k": k, "quality": quality, "median_ms": ms,
        "accurate_over_topk_time": ms["gaussiank"] / ms["topk"],
        "accurate_over_floor_time": ms["gaussiank"] / ms["floor"],
        "accurate_meets_goal": COUNT_BOUNDS[0] <= accurate["count_over_k"] <= COUNT_BOUNDS[1]
        and accurate["recall"] >= MIN_RECALL,
    }


def quality(mode: str, key: str, spec: str, title: str) -> tuple:
    return title, spec, lambda r: r["quality"][mode][key]


COLUMNS = [("gradient", "<14", "gradient"), ("n", "9d", "n"), ("dens", "5g", "density"),
           *(quality(mode, key, spec, title) for mode in ("paper", "accurate") for key, spec, title in (
               ("count_over_k", "9.2f", f"{mode[:5]} c/k"), ("recall", "5.2f", "rec"), ("norm", "5.2f", "norm"))),
           quality("topk", "recall", "8.2f", "topk rec"), ("t/topk", "6.3f", "accurate_over_topk_time"),
           ("t/floor", "7.2f", "accurate_over_floor_time"),
           ("ok", "", lambda r: "yes" if r["accurate_meets_goal"] else "NO")]
LEGEND = ("(c/k: count before truncation / k; rec: recall of the exact top-k; norm: captured squared norm / top-k's; "
          "t/topk, t/floor: accurate mode's time relative to the torch.topk path and to residual.add_(grad); ok: "
          "0.9 <= c/k <= 1.1 and rec >= 0.9)")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01, 0.05])
    parser.add_argument("--distributions", nargs="+", default=list(SYNTHETIC), choices=SYNTHETIC)
    parser.add_argument("--real-steps", type=int, nargs="+", default=[0, 20, 100],
                        help="training steps at which real gradients are captured")
    parser.add_argument("--real-sizes", type=int, nargs="*", default=[1_000_000, 25_000_000],
                        help="also capture real gradients of wide MLPs of about these many parameters")
    parser.add_argument("--skip-real", action="store_true", help="no real gradients (they take a minute or two)")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench/results/threshold_accuracy.json")
    args = parser.parse_args(argv)

    gradients = []
    for n in args.sizes:
        for kind in args.distributions:
            gradients.append((kind, synthetic_gradient(kind, n, torch.Generator().manual_seed(n))))
    if not args.skip_real:
        models = [("cnn", "cnn")] + [(f"mlp{size / 1e6:g}M", wide_mlp(size)) for size in args.real_sizes]
        for name, model in models:
            for step, grad in captured_gradients(model, tuple(args.real_steps)).items():
                gradients.append((f"{name}-step{step}", grad))
    rows = report.streamed((evaluate(name, grad, density, args.backend, args.repeats) for name, grad in gradients
                            for density in args.densities), COLUMNS)
    print(LEGEND)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()

"""Threshold accuracy: how close Gaussian-k's paper and accurate modes (and exact top-k) land to k and how much of
the exact top-k they capture, on synthetic and real gradients; and the accurate mode's time. docs/selection.md.

    python -m bench.threshold_accuracy --sizes 1000000 --skip-real      # a smaller run, synthetic gradients only
"""

import argparse
import json
import statistics

import torch

from bench.harness import cli, report
from bench.harness.gradients import SYNTHETIC, captured_gradients, synthetic_gradient, time_methods, wide_mlp
from gtopk_ext.compressors import k_for_density, make_compressor

MODES = {"paper": ("gaussiank", {"mode": "paper"}), "accurate": ("gaussiank", {"mode": "accurate"}),
         "topk": ("topk", {})}


def evaluate(name: str, grad: torch.Tensor, density: float, backend: str | None, repeats: int) -> dict:
    """Per mode (no residual: the selection itself): count / k before truncation to k slots, recall (|sent indices
    ∩ exact top-k| / k) and norm (||sent values||^2 / ||top-k values||^2); and the timed step of every method."""
    quality, k = {}, k_for_density(density, grad.numel())
    exact = torch.topk(grad.abs(), k).indices.sort().values  # ascending, as messages hold them: the same sum order
    for mode, (kind, options) in MODES.items():
        message = make_compressor(kind, density, backend=backend, **options).compress(grad)
        sent = message.indices[: min(int(message.count), k)].long()
        quality[mode] = {"count_over_k": int(message.count) / k, "recall": float(torch.isin(sent, exact).sum()) / k,
                         "norm": float(grad[sent].double().square().sum() / grad[exact].double().square().sum())}
    k, times = time_methods(grad, torch.zeros_like(grad), density, backend, repeats)
    ms = {method: 1e3 * statistics.median(t) for method, t in times.items()}
    return {"gradient": name, "n": grad.numel(), "density": density, "k": k, "quality": quality, "median_ms": ms,
            "accurate_over_topk_time": ms["gaussiank"] / ms["topk"],
            "accurate_over_floor_time": ms["gaussiank"] / ms["floor"],
            "accurate_meets_goal": 0.9 <= quality["accurate"]["count_over_k"] <= 1.1
            and quality["accurate"]["recall"] >= 0.9}


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__, densities=[0.001, 0.01, 0.05], json="bench/results/threshold_accuracy.json")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000], help="synthetic gradients'")
    parser.add_argument("--distributions", nargs="+", default=list(SYNTHETIC), choices=SYNTHETIC)
    parser.add_argument("--real-steps", type=int, nargs="+", default=[0, 20, 100],
                        help="training steps at which real gradients are captured")
    parser.add_argument("--real-sizes", type=int, nargs="*", default=[1_000_000, 25_000_000],
                        help="also capture real gradients of wide MLPs of about these many parameters")
    parser.add_argument("--skip-real", action="store_true", help="no real gradients (they take a minute or two)")
    parser.add_argument("--backend", default=None, help="auto | cpu | cuda | triton (default: $GTOPK_EXT_BACKEND)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (median)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    gradients = [(kind, synthetic_gradient(kind, n, torch.Generator().manual_seed(n)))
                 for n in args.sizes for kind in args.distributions]
    for name, model in ([] if args.skip_real else [("cnn", "cnn")] + [(f"mlp{size / 1e6:g}M", wide_mlp(size))
                                                                      for size in args.real_sizes]):
        gradients += [(f"{name}-step{step}", grad)
                      for step, grad in captured_gradients(model, tuple(args.real_steps)).items()]
    rows = report.streamed((evaluate(name, grad, density, args.backend, args.repeats) for name, grad in gradients
                            for density in args.densities), COLUMNS)
    print(LEGEND)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()

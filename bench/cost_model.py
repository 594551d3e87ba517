"""Alpha-beta cost model of dense allreduce, TopK-SGD's allgather, gTop-k and Ok-Topk, fitted to the measurements
of bench/netem_scaling.py, and its prediction of scaling efficiency up to P = 1024 ranks.

Times of one exchange on P ranks, n gradient elements, k = ceil(density * n) selected, payload 4 + 8k bytes:

    dense      2(P-1) alpha + 2(P-1)/P * 4n beta                                  (ring allreduce)
    allgather  (P-1) alpha + (P-1)(4 + 8k) beta + scatter * Pk + zero * n         (ring allgather, decompress)
    gtopk      log2(P) * (alpha + (4 + 8k) beta + merge * 2k)                     (butterfly, merge per round)
    oktopk     4(P-1) alpha + (2(P-1)/P * 8k + 24(P-1)) beta + merge * 2k         (counts, reduce-scatter, counts,
                                                                                   allgatherv; sums and cut)

and the sparse methods also select: select * n (Gaussian-k, measured one rank at a time). Ok-Topk's term is its
steady step: the regions and the threshold it re-estimates every 32 steps (a few KB) are left out, and its kept
sums are taken as k, spread evenly over the regions. beta is fitted per link
rate; on the 2-core machine that measured, P ranks share the cores, so the compute terms of measured rows are
scaled by max(1, P / cores). The fit is non-negative least squares on relative errors (times span 4 decades).

Scaling efficiency = t_compute / (t_compute + t_comm) with no overlap of computation and communication, as the
gTop-k paper (Shi et al., ICDCS 2019) defines it; its published figures (32 machines, 1 Gbit/s Ethernet):
gTop-k's scaling efficiency is 2.7-12x dense S-SGD's and 1.1-1.7x allgather Top-k S-SGD's.

    python -m bench.cost_model --json bench_netem.json --plot scaling_model.png --out bench_cost_model.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

METHODS = ("dense", "allgather", "gtopk", "oktopk")
COMPUTE_TERMS = ("merge", "scatter", "zero")  # per-element costs fitted from the exchanges
PAPER = {"world_size": 32, "rate_bps": 10**9, "over_dense": (2.7, 12.0), "over_allgather": (1.1, 1.7)}
PREDICT_WORLD_SIZES = tuple(2**i for i in range(1, 11))
PREDICT_RATES = (10**9, 10**10, 10**11)


def packed_bytes(k: int) -> int:
    """The collectives' payload: count, k int32 indices, k fp32 values."""
    return 4 + 8 * k


def oktopk_bytes(k: int, world_size: int) -> float:
    """Ok-Topk's steady step: (P-1)/P of the k pairs to the regions' owners, (P-1)/P of the k kept sums from them,
    and 24 bytes of counts per other rank."""
    return 2 * (world_size - 1) / world_size * 8 * k + 24 * (world_size - 1)


@dataclass
class CostModel:
    """Fitted costs in seconds: per message (alpha), per byte for each measured rate (beta), per element."""

    alpha: float
    beta: dict[str, float]
    merge: float  # per element entering a gTop-k merge (2k per round)
    scatter: float  # per pair scatter-added by the allgather (Pk)
    zero: float  # per element of the allgather's dense output (n)
    select: float  # per gradient element, Gaussian-k selection
    rate_bps: dict[str, float | None] = field(default_factory=dict)

    def wire_overhead(self) -> float:
        """Fitted beta over the nominal 8 / rate, median over the shaped rates (headers, ACKs, retransmissions,
        TCP's ramp-up); 1 when only loopback was measured."""
        ratios = [self.beta[name] * bps / 8 for name, bps in self.rate_bps.items() if bps]
        return float(np.median(ratios)) if ratios else 1.0

    def beta_at(self, rate_bps: float) -> float:
        return self.wire_overhead() * 8 / rate_bps


def features(method: str, numel: int, k: int, world_size: int, share: float) -> dict[str, float]:
    """The coefficients of alpha, beta and the per-element costs in one exchange's time (see the module doc).
    ``share``: how many ranks share one core (compute terms take that much longer)."""
    if method == "dense":
        return {"alpha": 2 * (world_size - 1), "beta": 2 * (world_size - 1) / world_size * 4 * numel}
    if method == "allgather":
        return {"alpha": world_size - 1, "beta": (world_size - 1) * packed_bytes(k),
                "scatter": world_size * k * share, "zero": numel * share}
    if method == "gtopk":
        rounds = math.log2(world_size)
        return {"alpha": rounds, "beta": rounds * packed_bytes(k), "merge": rounds * 2 * k * share}
    if method == "oktopk":
        return {"alpha": 4 * (world_size - 1), "beta": oktopk_bytes(k, world_size), "merge": 2 * k * share}
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def cpu_share(row: dict) -> float:
    return max(1.0, row["world_size"] / row["cores"])


@dataclass
class Fit:
    model: CostModel
    quality: dict
    residuals: list[dict]


def fit(rows: list[dict]) -> Fit:
    """Fits a CostModel to measured rows (bench/netem_scaling.py's format; skipped rows are ignored)."""
    rows = [row for row in rows if not row.get("skipped")]
    if not rows:
        raise ValueError("rows: no measured exchange to fit")
    rates = sorted({row["rate"] for row in rows})
    columns = ["alpha", *(f"beta:{rate}" for rate in rates), *COMPUTE_TERMS]
    design = np.zeros((len(rows), len(columns)))
    for i, row in enumerate(rows):
        for name, value in features(row["method"], row["numel"], row["k"], row["world_size"], cpu_share(row)).items():
            design[i, columns.index(f"beta:{row['rate']}" if name == "beta" else name)] = value
    measured = np.array([row["time_s"] for row in rows])
    used = design.any(axis=0)  # a cost no row exercises (e.g. no allgather measured) stays 0
    solution = np.zeros(len(columns))
    solution[used], _ = nnls(design[:, used] / measured[:, None], np.ones(len(rows)))
    predicted = design @ solution
    params = dict(zip(columns, solution.tolist()))

    select_rows = [(row["numel"], row["select_s"]) for row in rows if row.get("select_s")]
    select = 0.0
    if select_rows:  # t = select * n: the mean of the rows' time per element
        select = float(np.mean([t / n for n, t in select_rows]))
    model = CostModel(alpha=params["alpha"], beta={rate: params[f"beta:{rate}"] for rate in rates},
                      merge=params["merge"], scatter=params["scatter"], zero=params["zero"], select=select,
                      rate_bps={row["rate"]: row["rate_bps"] for row in rows})
    relative = predicted / measured - 1
    quality = {"rows": len(rows), "r2": float(1 - np.sum((measured - predicted) ** 2)
                                              / np.sum((measured - measured.mean()) ** 2)),
               "median_abs_rel_error": float(np.median(np.abs(relative))),
               "max_abs_rel_error": float(np.max(np.abs(relative))),
               "per_method_median_abs_rel_error": {
                   method: float(np.median(np.abs(relative[[r["method"] == method for r in rows]])))
                   for method in METHODS if any(r["method"] == method for r in rows)}}
    residuals = [{"method": r["method"], "numel": r["numel"], "density": r["density"], "world_size": r["world_size"],
                  "rate": r["rate"], "measured_s": float(m), "predicted_s": float(p)}
                 for r, m, p in zip(rows, measured, predicted)]
    return Fit(model, quality, residuals)


def comm_time(model: CostModel, method: str, numel: int, density: float | None, world_size: int, rate_bps: float,
              compute_scale: float = 1.0) -> float:
    """Predicted seconds per iteration spent outside the backward pass: selection and exchange, on P machines
    each with its own processor (per-element costs times ``compute_scale``)."""
    k = numel if method == "dense" else max(1, math.ceil(density * numel))
    terms = features(method, numel, k, world_size, share=1.0)
    costs = {"alpha": model.alpha, "beta": model.beta_at(rate_bps),
             **{name: getattr(model, name) * compute_scale for name in COMPUTE_TERMS}}
    total = sum(costs[name] * value for name, value in terms.items())
    if method != "dense":
        total += model.select * compute_scale * numel
    return total


def efficiency(model: CostModel, method: str, numel: int, density: float | None, world_size: int,
               rate_bps: float, compute_s: float, compute_scale: float = 1.0) -> float:
    """t_compute / (t_compute + t_comm): the fraction of P times one machine's throughput that P machines reach."""
    return compute_s / (compute_s + comm_time(model, method, numel, density, world_size, rate_bps, compute_scale))


def series(densities: list[float]) -> list[tuple[str, float | None]]:
    return [("dense", None)] + [(method, d) for d in densities for method in ("allgather", "gtopk", "oktopk")]


def label(method: str, density: float | None) -> str:
    return method if density is None else f"{method}@{density:g}"


def predict(model: CostModel, args: argparse.Namespace) -> dict:
    """Efficiency for every rate, world size and series; and the paper's comparison at its operating point."""
    table = {}
    for rate in PREDICT_RATES:
        for p in PREDICT_WORLD_SIZES:
            for method, density in series(args.densities):
                table[(rate, p, label(method, density))] = efficiency(
                    model, method, args.numel, density, p, rate, args.compute_s, args.compute_scale)
    paper = {}
    for density in args.densities:
        key = (PAPER["rate_bps"], PAPER["world_size"])
        gtopk = table[(*key, label("gtopk", density))]
        paper[density] = {"over_dense": gtopk / table[(*key, "dense")],
                          "over_allgather": gtopk / table[(*key, label("allgather", density))]}
    return {"table": table, "paper": paper}


def print_report(fit_result: Fit, prediction: dict, args: argparse.Namespace) -> None:
    model, quality = fit_result.model, fit_result.quality
    print(f"fit over {quality['rows']} measured exchanges: R^2 {quality['r2']:.4f}, |relative error| median "
          f"{quality['median_abs_rel_error']:.1%}, max {quality['max_abs_rel_error']:.1%}; per method "
          + ", ".join(f"{m} {e:.1%}" for m, e in quality["per_method_median_abs_rel_error"].items()))
    print(f"  alpha  {model.alpha * 1e6:9.1f} us per message")
    for rate, beta in model.beta.items():
        bps = model.rate_bps[rate]
        nominal = f" (nominal {8 / bps * 1e9:.3f}: x{beta * bps / 8:.3f})" if bps else ""
        print(f"  beta   {beta * 1e9:9.3f} ns per byte at {rate}{nominal}")
    for name, text in (("select", "Gaussian-k selection, per gradient element"),
                       ("merge", "gTop-k merge, per element merged"),
                       ("scatter", "allgather scatter-add, per pair"),
                       ("zero", "allgather dense output, per element")):
        print(f"  {name:7}{getattr(model, name) * 1e9:9.3f} ns  {text}")
    print(f"\npredicted scaling efficiency: n = {args.numel / 1e6:g}M, compute {args.compute_s * 1e3:g} ms per "
          f"iteration, no overlap, wire overhead x{model.wire_overhead():.3f}, "
          f"per-element costs x{args.compute_scale:g}")
    names = [label(m, d) for m, d in series(args.densities)]
    print(f"{'link':>8} {'P':>5} " + " ".join(f"{n:>15}" for n in names))
    for rate in PREDICT_RATES:
        for p in (2, 8, 32, 128, 1024):
            print(f"{rate / 1e9:>5g}Gb/s {p:>5} "
                  + " ".join(f"{prediction['table'][(rate, p, n)]:>15.3f}" for n in names))
    print(f"\nat the paper's point (P = {PAPER['world_size']}, 1 Gbit/s): gTop-k's efficiency over")
    for density, ratio in prediction["paper"].items():
        print(f"  density {density:g}: dense x{ratio['over_dense']:.2f} (paper 2.7-12x), allgather "
              f"x{ratio['over_allgather']:.2f} (paper 1.1-1.7x)")


def plot(fit_result: Fit, prediction: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(12, 9))
    colours = {"dense": "black", "allgather": "tab:blue", "gtopk": "tab:red", "oktopk": "tab:green"}
    styles = dict(zip(args.densities, ("-", "--", ":", "-.")))
    for axis, rate in zip(axes.flat, PREDICT_RATES):
        for method, density in series(args.densities):
            name = label(method, density)
            axis.plot(PREDICT_WORLD_SIZES, [prediction["table"][(rate, p, name)] for p in PREDICT_WORLD_SIZES],
                      color=colours[method], linestyle=styles.get(density, "-"), marker="o", markersize=3, label=name)
        if rate == PAPER["rate_bps"]:
            axis.axvline(PAPER["world_size"], color="grey", linewidth=0.8)
            axis.annotate("paper: P=32, 1 Gbit/s\ngTop-k 2.7-12x dense,\n1.1-1.7x allgather",
                          (PAPER["world_size"], 0.55), xytext=(40, 0.6), fontsize=8)
        axis.set_xscale("log", base=2)
        axis.set_ylim(0, 1.02)
        axis.set_title(f"{rate / 1e9:g} Gbit/s: n = {args.numel / 1e6:g}M, compute {args.compute_s * 1e3:g} ms, "
                       f"per-element costs x{args.compute_scale:g}", fontsize=10)
        axis.set_xlabel("ranks P")
        axis.set_ylabel("scaling efficiency")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    fit_axis = axes.flat[3]
    for method in METHODS:
        points = [r for r in fit_result.residuals if r["method"] == method]
        fit_axis.scatter([r["measured_s"] for r in points], [r["predicted_s"] for r in points], s=12,
                         color=colours[method], label=method)
    times = [r["measured_s"] for r in fit_result.residuals] + [r["predicted_s"] for r in fit_result.residuals]
    bounds = [min(times) / 2, max(times) * 2]
    fit_axis.plot(bounds, bounds, color="grey", linewidth=0.8)
    fit_axis.set_xscale("log")
    fit_axis.set_yscale("log")
    fit_axis.set_xlabel("measured s per exchange (emulated network)")
    fit_axis.set_ylabel("model s per exchange")
    fit_axis.set_title(f"fit: R^2 {fit_result.quality['r2']:.3f}, median |error| "
                       f"{fit_result.quality['median_abs_rel_error']:.0%}")
    fit_axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="bench/netem_scaling.py's JSON")
    parser.add_argument("--numel", type=float, default=25.6e6, help="gradient elements (ResNet-50: 25.6M)")
    parser.add_argument("--compute-s", type=float, default=0.25,
                        help="forward+backward seconds per iteration on one accelerator")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="multiplies the fitted per-element selection/merge/scatter costs (1: this machine's "
                             "CPU core; below 1 for an accelerator)")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    parser.add_argument("--out", type=Path, help="write the fit and predictions as JSON here")
    args = parser.parse_args(argv)
    if args.numel < 1 or args.compute_s <= 0 or args.compute_scale < 0:
        parser.error("--numel must be >= 1, --compute-s > 0 and --compute-scale >= 0")
    if not all(0 < d <= 1 for d in args.densities):
        parser.error(f"--densities must be in (0, 1], got {args.densities}")
    args.numel = int(args.numel)
    fit_result = fit(json.loads(args.json.read_text())["rows"])
    prediction = predict(fit_result.model, args)
    print_report(fit_result, prediction, args)
    if args.plot:
        plot(fit_result, prediction, args, args.plot)
        print(f"wrote {args.plot}")
    if args.out:
        args.out.write_text(json.dumps({
            "model": asdict(fit_result.model), "wire_overhead": fit_result.model.wire_overhead(),
            "quality": fit_result.quality, "residuals": fit_result.residuals,
            "assumptions": {"numel": args.numel, "compute_s": args.compute_s, "compute_scale": args.compute_scale},
            "efficiency": [{"rate_bps": rate, "world_size": p, "series": name, "efficiency": value}
                           for (rate, p, name), value in prediction["table"].items()],
            "paper_point": {str(d): v for d, v in prediction["paper"].items()}}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

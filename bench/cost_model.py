"""Alpha-beta cost model of dense allreduce, TopK-SGD's allgather, gTop-k, Ok-Topk (plain and compact wire) and the
hierarchical collective, on one level of network or two, fitted to bench/netem_scaling.py's measurements; it predicts
time per step and scaling efficiency up to P = 1024 ranks. The formulas and the results: docs/scaling.md.

    python -m bench.cost_model --json bench_netem.json bench_two_level.json --plot scaling_model.png \
        --plot-two-level scaling_two_level.png --out bench_cost_model.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from bench.harness import cli, report
from gtopk_ext.collectives import collective_named
from gtopk_ext.costs import exchange_terms, hierarchical_terms
from gtopk_ext.wire import WIRES, wire_named

METHODS = ("dense", "allgather", "gtopk", "oktopk", "hierarchical")
SPARSE_METHODS = ("allgather", "gtopk", "oktopk")

COMPUTE_TERMS = ("merge", "scatter", "zero", "encode", "decode", "copy")  # per-element costs fitted
PAPER_P, PAPER_RATE = 32, 10**9  # the gTop-k paper's point: 32 machines, 1 Gbit/s Ethernet
PREDICT_WORLD_SIZES, RATES = tuple(2**i for i in range(1, 11)), (10**9, 10**10, 10**11)
# Two levels: nodes of 8 ranks, one link per node to the switch; inside a node (alpha s, bytes per second) NVLink
# (NCCL's bus bandwidth in an 8-GPU A100 node, about 230 GB/s) or PCIe 4.0 x16 (24 GB/s, shared by two GPUs).
NODE_SIZE, TWO_LEVEL_WORLD_SIZES = 8, tuple(2**i for i in range(4, 11))
INTRA_LINKS = {"NVLink": (5e-6, 200e9), "PCIe": (10e-6, 12e9)}


def features(method: str, numel: int, k: int, world_size: int, share: float, wire: str = "plain",
             local: int = 1) -> dict[str, float]:
    """The coefficients of one exchange's time, selection excluded (hierarchical: gTop-k between the nodes)."""
    if method == "hierarchical":
        return hierarchical_terms(collective_named("gtopk"), numel, k, world_size, share, wire_named(wire), local)
    return exchange_terms(collective_named(method), numel, k, world_size, share, wire_named(wire), local)


def bytes_per_rank(method: str, numel: int, k: int, world_size: int, wire: str = "plain") -> float:
    """Bytes a rank sends in one exchange on one level of network, the mean over the ranks."""
    return collective_named(method).mean_bytes(numel, k, world_size, wire_named(wire))


def selected_elements(method: str, numel: int, local: int = 1) -> int:
    """Elements a rank's Gaussian-k selection reads: none for dense, its shard for hierarchical."""
    return 0 if method == "dense" else math.ceil(numel / local) if method == "hierarchical" else numel


@dataclass
class CostModel:
    """Fitted costs in seconds: per message (alpha, and alpha_intra inside a node), per byte for each measured rate
    (beta) and inside a node (beta_intra), per element."""

    alpha: float
    beta: dict[str, float]
    merge: float  # per element entering a gTop-k merge (2k per round)
    scatter: float  # per pair scatter-added by the allgather (Pk)
    zero: float  # per element of the allgather's dense output (n)
    select: float  # per gradient element, Gaussian-k selection
    encode: float = 0.0  # per pair the compact wire encodes
    decode: float = 0.0  # per pair the compact wire decodes
    copy: float = 0.0  # per gradient element, the hierarchical collective's passes over the whole gradient
    alpha_intra: float = 0.0
    beta_intra: float = 0.0
    rate_bps: dict[str, float | None] = field(default_factory=dict)

    def wire_overhead(self) -> float:
        """Fitted beta over the nominal 8 / rate, median over the shaped rates (headers, ACKs, retransmissions,
        TCP's ramp-up); 1 when only loopback was measured."""
        ratios = [self.beta[name] * bps / 8 for name, bps in self.rate_bps.items() if bps]
        return float(np.median(ratios)) if ratios else 1.0


def row_label(row: dict) -> str:
    """The method, its wire when compact, and the layout when two levels."""
    name, local = row["method"] + ("/compact" if row["wire"] == "compact" else ""), row["local_size"]
    return name if local == 1 else f"{name} {row['world_size'] // local}x{local}"


@dataclass
class Fit:
    model: CostModel
    quality: dict
    residuals: list[dict]


def fit(rows: list[dict]) -> Fit:
    """Fits a CostModel to measured rows (bench/netem_scaling.py's format; skipped rows are ignored)."""
    rows = [{"local_size": 1, **row, "wire": row.get("wire") or "plain",
             "share": max(1.0, row["world_size"] / row["cores"])} for row in rows if not row.get("skipped")]
    if not rows:
        raise ValueError("rows: no measured exchange to fit")
    select_rows = [(row["numel"], row["select_s"]) for row in rows if row.get("select_s")]
    # t = select * n: the mean of the rows' time per element; the hierarchical exchanges select inside their
    # timed call, so their selection is subtracted from what the other costs must explain.
    select = float(np.mean([t / n for n, t in select_rows])) if select_rows else 0.0
    rates = sorted({row["rate"] for row in rows})
    columns = ["alpha", *(f"beta:{rate}" for rate in rates), "alpha_intra", "beta_intra", *COMPUTE_TERMS]
    design, offset = np.zeros((len(rows), len(columns))), np.zeros(len(rows))
    for i, row in enumerate(rows):
        for name, value in features(row["method"], row["numel"], row["k"], row["world_size"], row["share"],
                                    row["wire"], row["local_size"]).items():
            design[i, columns.index(f"beta:{row['rate']}" if name == "beta" else name)] = value
        if row["method"] == "hierarchical":
            offset[i] = select * selected_elements("hierarchical", row["numel"], row["local_size"]) * row["share"]
    measured = np.array([row["time_s"] for row in rows])
    used = design.any(axis=0)  # a cost no row exercises (e.g. no allgather measured) stays 0
    solution = np.zeros(len(columns))
    solution[used], _ = nnls(design[:, used] / measured[:, None], 1 - offset / measured)
    predicted = design @ solution + offset
    params = dict(zip(columns, solution.tolist()))
    model = CostModel(alpha=params["alpha"], beta={rate: params[f"beta:{rate}"] for rate in rates},
                      select=select, rate_bps={row["rate"]: row["rate_bps"] for row in rows},
                      **{name: params[name] for name in (*COMPUTE_TERMS, "alpha_intra", "beta_intra")})
    relative, labels = predicted / measured - 1, [row_label(row) for row in rows]
    quality = {"rows": len(rows), "r2": float(1 - np.sum((measured - predicted) ** 2)
                                              / np.sum((measured - measured.mean()) ** 2)),
               "median_abs_rel_error": float(np.median(np.abs(relative))),
               "max_abs_rel_error": float(np.max(np.abs(relative))),
               "per_method_median_abs_rel_error": {
                   name: float(np.median(np.abs(relative[[label == name for label in labels]])))
                   for name in dict.fromkeys(labels)}}
    residuals = [{key: row[key] for key in ("method", "wire", "local_size", "numel", "density", "world_size", "rate",
                                            "rate_bps", "share")} | {"measured_s": float(m), "predicted_s": float(p)}
                 for row, m, p in zip(rows, measured, predicted)]
    return Fit(model, quality, residuals)


def comm_time(model: CostModel, method: str, numel: int, density: float | None, world_size: int, rate_bps: float,
              compute_scale: float = 1.0, wire: str = "plain", local: int = 1,
              intra: tuple[float, float] | None = None) -> float:
    """Predicted seconds of selection and exchange per iteration, each rank on its own processor, in nodes of
    ``local`` ranks linked inside by ``intra`` = (alpha s, bytes per second) (None: as fitted)."""
    k = numel if method == "dense" else max(1, math.ceil(density * numel))
    alpha_intra, beta_intra = (model.alpha_intra, model.beta_intra) if intra is None else (intra[0], 1 / intra[1])
    costs = {"alpha": model.alpha, "beta": model.wire_overhead() * 8 / rate_bps, "alpha_intra": alpha_intra,
             "beta_intra": beta_intra, **{name: getattr(model, name) * compute_scale for name in COMPUTE_TERMS}}
    terms = features(method, numel, k, world_size, 1.0, wire, local)
    return (sum(costs[name] * value for name, value in terms.items())
            + model.select * compute_scale * selected_elements(method, numel, local))


def break_even_intra(model: CostModel, numel: int, density: float, world_size: int, local: int, beta: float,
                     share: float, compute_scale: float = 1.0, alpha_intra: float | None = None) -> float | None:
    """The intra-node bandwidth (bytes per second) above which hierarchical is faster than flat gTop-k on this
    layout (both linear in beta_intra), ``share`` ranks per core; None when it is never faster."""
    k = max(1, math.ceil(density * numel))
    costs = {"alpha": model.alpha, "beta": beta,
             "alpha_intra": model.alpha_intra if alpha_intra is None else alpha_intra,
             **{name: getattr(model, name) * compute_scale for name in COMPUTE_TERMS}}
    fixed, intra_bytes = {}, {}  # each method's seconds without beta_intra, and its bytes inside the node
    for method in ("hierarchical", "gtopk"):
        terms = features(method, numel, k, world_size, share, "plain", local)
        intra_bytes[method] = terms.pop("beta_intra", 0.0)
        fixed[method] = (sum(costs[name] * value for name, value in terms.items())
                         + model.select * compute_scale * share * selected_elements(method, numel, local))
    if fixed["hierarchical"] >= fixed["gtopk"]:
        return None
    return (intra_bytes["hierarchical"] - intra_bytes["gtopk"]) / (fixed["gtopk"] - fixed["hierarchical"])


LAYOUT = ("numel", "density", "world_size", "local_size", "rate")


def hierarchical_against_flat(fit_result: Fit) -> list[dict]:
    """Every measured hierarchical exchange beside flat gTop-k's (plain wire) on the same layout and link, and the
    break-even intra-node bandwidth: every cost as fitted, and the links alone (per-element costs 0, NVLink's
    alpha inside)."""
    model, out = fit_result.model, []
    flats = {tuple(r[key] for key in LAYOUT): r for r in reversed(fit_result.residuals)  # the first one measured
             if r["method"] == "gtopk" and r["wire"] == "plain"}
    for hier in (r for r in fit_result.residuals if r["method"] == "hierarchical"):
        flat = flats.get(tuple(hier[key] for key in LAYOUT))
        if flat is None:
            continue
        layout = (model, hier["numel"], hier["density"], hier["world_size"], hier["local_size"],
                  model.beta[hier["rate"]])
        out.append({key: hier[key] for key in LAYOUT}
                   | {"hierarchical_s": hier["measured_s"], "flat_gtopk_s": flat["measured_s"],
                      "hierarchical_model_s": hier["predicted_s"], "flat_gtopk_model_s": flat["predicted_s"],
                      "break_even_Bps_as_measured": break_even_intra(*layout, share=hier["share"]),
                      "break_even_Bps_links_only": break_even_intra(*layout, share=1.0, compute_scale=0.0,
                                                                    alpha_intra=INTRA_LINKS["NVLink"][0])})
    return out


def series(densities: list[float]) -> list[tuple[str, float | None, str]]:
    """(method, density, wire) of every predicted curve: dense, then each sparse method on each wire."""
    return [("dense", None, "plain")] + [(method, d, wire) for d in densities for method in SPARSE_METHODS
                                         for wire in WIRES]


def label(method: str, density: float | None, wire: str = "plain") -> str:
    name = method if density is None else f"{method}@{density:g}"
    return name if wire == "plain" else f"{name}/compact"


def two_level_series(densities: list[float]) -> list[tuple[str, float | None, str]]:
    return ([("dense", None, "plain")]
            + [(method, d, "plain") for d in densities for method in (*SPARSE_METHODS, "hierarchical")]
            + [(method, d, "compact") for d in densities for method in ("gtopk", "oktopk")])


def predict(model: CostModel, args: argparse.Namespace) -> dict:
    """Scaling efficiency, t_compute / (t_compute + t_comm), for every rate, world size and series, one level and
    two (and there the time per step); the paper's comparison at its operating point."""
    def step(method: str, density: float | None, wire: str, p: int, rate: int, intra=None) -> float:
        return args.compute_s + comm_time(model, method, args.numel, density, p, rate, args.compute_scale, wire=wire,
                                          local=NODE_SIZE if intra else 1, intra=intra)

    table = {(rate, p, label(*s)): args.compute_s / step(*s, p, rate)
             for rate in RATES for p in PREDICT_WORLD_SIZES for s in series(args.densities)}
    at_paper = {name: value for (rate, p, name), value in table.items() if (rate, p) == (PAPER_RATE, PAPER_P)}
    paper = {d: {wire: {"over_dense": at_paper[label("gtopk", d, wire)] / at_paper["dense"],
                        "over_allgather": at_paper[label("gtopk", d, wire)] / at_paper[label("allgather", d, wire)]}
                 for wire in WIRES} for d in args.densities}
    two_level = {}
    for (intra_name, intra), rate, p, s in itertools.product(INTRA_LINKS.items(), RATES, TWO_LEVEL_WORLD_SIZES,
                                                             two_level_series(args.densities)):
        seconds = step(*s, p, rate, intra)
        two_level[(intra_name, rate, p, label(*s))] = {"step_s": seconds, "efficiency": args.compute_s / seconds}
    return {"table": table, "paper": paper, "two_level": two_level, "alpha": model.alpha}


# The fitted costs the report prints: (name, unit scale, what it is).
COSTS = [("alpha", 1e6, "us per message (between nodes)"), ("alpha_intra", 1e6, "us per message inside a node"),
         ("beta_intra", 1e9, "ns per byte inside a node (an emulated node: its loopback)"),
         ("select", 1e9, "ns: Gaussian-k selection, per gradient element"),
         ("merge", 1e9, "ns: gTop-k merge, per element merged"),
         ("scatter", 1e9, "ns: allgather scatter-add, per pair"),
         ("zero", 1e9, "ns: allgather dense output, per element"),
         ("encode", 1e9, "ns: compact wire, per pair encoded"), ("decode", 1e9, "ns: compact wire, per pair decoded"),
         ("copy", 1e9, "ns: hierarchical, per gradient element (its dense passes)")]


def print_report(fit_result: Fit, prediction: dict, args: argparse.Namespace) -> None:
    model, quality = fit_result.model, fit_result.quality
    print(f"fit over {quality['rows']} measured exchanges: R^2 {quality['r2']:.4f}, |relative error| median "
          f"{quality['median_abs_rel_error']:.1%}, max {quality['max_abs_rel_error']:.1%}; per method:")
    for name, error in quality["per_method_median_abs_rel_error"].items():
        print(f"  {name:28} {error:6.1%}")
    for rate, beta in model.beta.items():
        bps = model.rate_bps[rate]
        print(f"  beta   {beta * 1e9:9.3f} ns per byte at {rate}" + (
            f" (nominal {8 / bps * 1e9:.3f}: x{beta * bps / 8:.3f})" if bps else ""))
    for name, scale, text in COSTS:
        print(f"  {name:11} {getattr(model, name) * scale:9.3f} {text}")

    def bandwidth(value: float | None) -> str:
        return "never" if value is None else f"{value / 1e9:.3g} GB/s"

    comparisons = hierarchical_against_flat(fit_result)
    if comparisons:
        print("\nhierarchical against flat gTop-k, ms per exchange measured (model), and the intra-node bandwidth "
              "above which the model makes hierarchical faster: every cost as fitted; the links alone (per-element "
              "costs 0, NVLink's alpha inside)")
        print(report.table(comparisons, [
            ("layout", "", lambda c: f"{c['world_size'] // c['local_size']}x{c['local_size']}"), ("link", "", "rate"),
            ("n", "d", "numel"), ("d", "g", "density"),
            ("hierarchical", "", lambda c: f"{c['hierarchical_s'] * 1e3:.1f} ({c['hierarchical_model_s'] * 1e3:.1f})"),
            ("flat", "", lambda c: f"{c['flat_gtopk_s'] * 1e3:.1f} ({c['flat_gtopk_model_s'] * 1e3:.1f})"),
            ("break-even", "", lambda c: bandwidth(c["break_even_Bps_as_measured"])),
            ("links alone", "", lambda c: bandwidth(c["break_even_Bps_links_only"]))]))
    print(f"\npredicted scaling efficiency: n = {args.numel / 1e6:g}M, compute {args.compute_s * 1e3:g} ms per "
          f"iteration, no overlap, alpha {prediction['alpha'] * 1e6:.0f} us, wire overhead "
          f"x{model.wire_overhead():.3f}, per-element costs x{args.compute_scale:g}; one rank per machine, one link "
          f"each")
    for density in args.densities:
        print(report.table([(rate, p) for rate in RATES for p in (2, 8, 32, 128, 1024)], [
            ("link", "", lambda row: f"{row[0] / 1e9:g}Gb/s"), ("P", "d", lambda row: row[1]),
            *((name, ".3f", lambda row, name=name: prediction["table"][(*row, name)])
              for name in (label(*s) for s in series([density])))]))
    print(f"\nat the paper's point (P = {PAPER_P}, 1 Gbit/s): gTop-k's efficiency over")
    for density, by_wire in prediction["paper"].items():
        for wire, ratio in by_wire.items():
            print(f"  density {density:g}, {wire:7} wire: dense x{ratio['over_dense']:.2f} (paper 2.7-12x), "
                  f"allgather x{ratio['over_allgather']:.2f} (paper 1.1-1.7x)")
    print(f"\ntwo levels: nodes of {NODE_SIZE} ranks, one link per node to the switch; step seconds (efficiency)")
    for intra_name in INTRA_LINKS:
        for rate in RATES:
            print(f"\n{intra_name} inside, {rate / 1e9:g} Gbit/s between nodes")
            print(report.table([label(*s) for s in two_level_series(args.densities)], [("series", "", lambda n: n)] + [
                (f"P = {p}", "", lambda n, p=p: "{step_s:.3f} s ({efficiency:.3f})".format(
                    **prediction["two_level"][(intra_name, rate, p, n)])) for p in (32, 256, 1024)]))


COLOURS = {"dense": "black", "allgather": "tab:blue", "gtopk": "tab:red", "oktopk": "tab:green",
           "hierarchical": "tab:purple"}


def plot(panels: list[tuple], path: Path, title: str = "", fit_result: Fit | None = None) -> None:
    """2 x 2 panels of scaling efficiency against P, each (world sizes, curves, efficiency_of(P, label), title, whether
    to mark the paper's point), compact wire dashed; the last panel the fit when given."""
    figure, axes = report.figure(2, 2, (12, 9))
    for axis, (world_sizes, curves, efficiency_of, panel_title, paper) in zip(axes.flat, panels):
        for method, density, wire in curves:
            name = label(method, density, wire)
            axis.plot(world_sizes, [efficiency_of(p, name) for p in world_sizes], color=COLOURS[method],
                      linestyle="-" if wire == "plain" else "--", marker="o", markersize=3, label=name)
        axis.set_xscale("log", base=2)
        axis.set(ylim=(0, 1.02), xlabel="ranks P", ylabel="scaling efficiency")
        axis.set_title(panel_title, fontsize=9)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
        if paper:
            axis.axvline(PAPER_P, color="grey", linewidth=0.8)
            axis.annotate("paper: P=32, 1 Gbit/s\ngTop-k 2.7-12x dense,\n1.1-1.7x allgather",
                          (PAPER_P, 0.55), xytext=(40, 0.6), fontsize=8)
    if fit_result is not None:  # measured against modelled time per exchange
        axis, residuals = axes.flat[3], fit_result.residuals
        for method, (wire, marker) in itertools.product(METHODS, (("plain", "o"), ("compact", "^"))):
            points = [r for r in residuals if r["method"] == method and r["wire"] == wire]
            if points:
                axis.scatter([r["measured_s"] for r in points], [r["predicted_s"] for r in points], s=12,
                             marker=marker, color=COLOURS[method], label=f"{method} {wire}")
        times = [r[key] for r in residuals for key in ("measured_s", "predicted_s")]
        axis.plot([min(times) / 2, max(times) * 2], [min(times) / 2, max(times) * 2], color="grey", linewidth=0.8)
        axis.set(xscale="log", yscale="log", xlabel="measured s per exchange (emulated network)",
                 ylabel="model s per exchange")
        axis.set_title(f"fit: {fit_result.quality['rows']} exchanges, R^2 {fit_result.quality['r2']:.3f}, median "
                       f"|error| {fit_result.quality['median_abs_rel_error']:.0%}", fontsize=10)
        axis.legend(fontsize=6)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    report.save(figure, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__, densities=[0.001, 0.01])
    parser.add_argument("--json", type=Path, nargs="+", required=True,
                        help="bench/netem_scaling.py's JSON files (their rows are fitted together)")
    parser.add_argument("--numel", type=float, default=25.6e6, help="gradient elements (ResNet-50: 25.6M)")
    parser.add_argument("--compute-s", type=float, default=0.25,
                        help="forward+backward seconds per iteration on one accelerator")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="multiplies the fitted per-element selection/merge/scatter/coding costs (1: this "
                             "machine's CPU core; below 1 for an accelerator)")
    parser.add_argument("--alpha-s", type=float, default=None,
                        help="seconds per message between machines for the predictions (default: the fitted alpha, "
                             "this machine's: namespaces, tbf and shared cores)")
    parser.add_argument("--plot", type=Path, help="write the one-level PNG here")
    parser.add_argument("--plot-two-level", type=Path, help="write the two-level PNG here")
    parser.add_argument("--out", type=Path, help="write the fit and predictions as JSON here")
    args = parser.parse_args(argv)
    if args.numel < 1 or args.compute_s <= 0 or args.compute_scale < 0 or (args.alpha_s or 0) < 0:
        parser.error("--numel must be >= 1, --compute-s > 0, --compute-scale >= 0 and --alpha-s >= 0")
    cli.check(parser, args, unit=("densities",))
    args.numel = int(args.numel)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fit_result = fit([row for path in args.json for row in json.loads(path.read_text())["rows"]])
    model = fit_result.model if args.alpha_s is None else replace(fit_result.model, alpha=args.alpha_s)
    prediction = predict(model, args)
    print_report(fit_result, prediction, args)
    setting = (f"n = {args.numel / 1e6:g}M, compute {args.compute_s * 1e3:g} ms per iteration, no overlap, alpha "
               f"{prediction['alpha'] * 1e6:.0f} us, per-element costs x{args.compute_scale:g}")
    if args.plot:  # one rank per machine: 1 and 10 Gbit/s at the first two densities, and the fit
        plot([(PREDICT_WORLD_SIZES, series([density]), lambda p, name, rate=rate: prediction["table"][(rate, p, name)],
               f"{rate / 1e9:g} Gbit/s, density {density:g}", rate == PAPER_RATE)
              for rate in RATES[:2] for density in args.densities[:2]][:3], args.plot, setting, fit_result)
    if args.plot_two_level:  # nodes of NODE_SIZE ranks, per intra-node link and node link rate, the first density
        plot([(TWO_LEVEL_WORLD_SIZES, two_level_series(args.densities[:1]),
               lambda p, name, i=intra, r=rate: prediction["two_level"][(i, r, p, name)]["efficiency"],
               f"{intra} inside nodes of {NODE_SIZE}, {rate / 1e9:g} Gbit/s per node; density {args.densities[0]:g}",
               False)
              for intra in INTRA_LINKS for rate in RATES[:2]], args.plot_two_level, setting)
    if args.out:
        report.write_json(
            args.out, args, model=asdict(fit_result.model), wire_overhead=fit_result.model.wire_overhead(),
            quality=fit_result.quality, residuals=fit_result.residuals,
            assumptions={"alpha_s": model.alpha, "node_size": NODE_SIZE, "intra_links": INTRA_LINKS},
            efficiency=[{"rate_bps": rate, "world_size": p, "series": name, "efficiency": value}
                        for (rate, p, name), value in prediction["table"].items()],
            two_level=[{"intra": intra, "rate_bps": rate, "world_size": p, "series": name, **value}
                       for (intra, rate, p, name), value in prediction["two_level"].items()],
            paper_point={str(d): v for d, v in prediction["paper"].items()},
            hierarchical_against_flat=hierarchical_against_flat(fit_result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo: the digits trained with real DDP on Gloo processes, once per method, density and seed, from the same
weights on the same batches: test accuracy, bytes sent, time per step and the steps and seconds to --target. With
--rate each rank sits behind an emulated link (as root). First it measures the regime R, the link's time over the
compute's, which decides which method is first (:func:`regime`). docs/convergence.md.

    python -m bench.demo --rate 1gbit     # DDP, fp16_compress_hook, PowerSGD, gtopk_ext's recipe at 0.01 and 0.001
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from pathlib import Path

import torch

import gtopk_ext as gx
from bench.digits import load_digits_split, make_model
from bench.emulated_network import TxCounter, network_name
from bench.harness import cli, report
from bench.harness.launch import run_group
from bench.harness.methods import hook_recipe, hook_state, recipe_state
from bench.harness.train import Trainer, batch_loss, epoch_batches, evaluation, reduced, slowest, train_curve

REGIME_STEPS, REGIME_ROUNDS = 10, 3  # timed steps of DDP and of the compute floor per round; interleaved rounds
# R of data-parallel training on H100s at 16k tokens per GPU and step, by the link between them
GPU_REGIMES = {"100 Gbit/s Ethernet": 3, "10 Gbit/s": 30, "1 Gbit/s": 300}

RECIPE_METHOD = "gaussiank-gtopk-recipe"  # gx.SparseGradState.recipe(density, --warmup-steps, --momentum)
# method -> the hook built from the flags: (compressor, collective, momentum correction: the hook applies --momentum
# and --weight-decay, the optimizer neither), or the name of a DDP method of bench/harness/methods.py.
METHODS: dict[str, tuple[str, str, bool] | str] = {
    "dense": "ddp", "fp16": "fp16", "powersgd-1": "powersgd-1", "powersgd-2": "powersgd-2", "powersgd-4": "powersgd-4",
    "hook-dense": ("gaussiank", "dense", False),  # the hook's overhead over DDP, nothing sparsified
    "topk-allgather": ("topk", "allgather", False),  # TopK-SGD
    "gaussiank-allgather": ("gaussiank", "allgather", False),
    "gaussiank-gtopk": ("gaussiank", "gtopk", False),
    "gaussiank-gtopk-mc": ("gaussiank", "gtopk", True),
    "gaussiank-allgather-mc": ("gaussiank", "allgather", True),
    RECIPE_METHOD: ("gaussiank", "gtopk", True),
}
DEFAULT_METHODS = ("dense", "fp16", "powersgd-2", RECIPE_METHOD)
# --recipe: measured presets of the hand-built hooks' flags: DGC's momentum correction with its warm-up over 4 epochs
# of 22 steps, momentum factor masking from the end of it on.
_DGC = {"methods": ["dense", "gaussiank-gtopk-mc", "gaussiank-allgather-mc"], "warmup_steps": 88,
        "masking": "after-warmup"}
RECIPES: dict[str, dict] = {
    "dgc-0.001": {**_DGC, "densities": [0.001]},
    "dgc-0.01": {**_DGC, "densities": [0.01], "per_tensor": True},
    # the convolutions' bucket (18,816 elements, 3.4% of the parameters) dense, a 2-epoch warm-up
    "dgc-0.001-dense-conv": {**_DGC, "densities": [0.001], "per_tensor": True, "min_compress_numel": 20_000,
                             "warmup_steps": 44},
}


def is_sparse(method: str) -> bool:
    return isinstance(METHODS[method], tuple) and METHODS[method][1] != "dense"


def momentum_in_hook(method: str) -> bool:
    return isinstance(METHODS[method], tuple) and METHODS[method][2]


def make_hook_state(method: str, density: float, args: argparse.Namespace) -> gx.SparseGradState | None:
    """gtopk_ext's hook state of one run (None for the other methods): the package's recipe, or built from the flags."""
    if not isinstance(METHODS[method], tuple):
        return None
    if method == RECIPE_METHOD:
        return recipe_state(density, args.warmup_steps, args.momentum, path=args.path)
    compressor, collective, correction = METHODS[method]
    moved = {"momentum": args.momentum, "weight_decay": args.weight_decay} if correction else {}
    if correction and args.masking == "after-warmup":  # momentum keeps its velocity through the warm-up
        moved["masking_start_iter"] = args.start_iter + args.warmup_steps
    return hook_state(density, compressor=compressor, collective=collective, start_iter=args.start_iter,
                      warmup_steps=args.warmup_steps, warmup_density=args.warmup_density, warmup_from=args.start_iter,
                      min_compress_numel=args.min_compress_numel, per_tensor=args.per_tensor,
                      clip_norm=args.clip_norm, path=args.path, **moved)


def demo_trainer(method: str, density: float, seed: int, args: argparse.Namespace, world_size: int) -> Trainer:
    """One run's method on this rank; the same initial weights on every rank and for every method."""
    recipe = METHODS[method] if isinstance(METHODS[method], str) else hook_recipe(
        method, lambda args: make_hook_state(method, density, args), momentum_in_hook(method))
    return Trainer(recipe, make_model(args.model, seed), args, world_size)


def train_run(rank: int, world_size: int, args: argparse.Namespace, data: tuple, method: str, density: float,
              seed: int, tx: TxCounter, progress) -> dict:
    """One training run; every rank returns the same record (losses averaged over ranks, step times the slowest
    rank's, the model evaluated every ``--eval-every`` steps, by default every epoch)."""
    train_x, train_y, test_x, test_y = data
    trainer = demo_trainer(method, density, seed, args, world_size)
    batches = [index for epoch in range(args.epochs)
               for index in epoch_batches(epoch, seed, len(train_y), rank, world_size, args.batch_size)]
    per_epoch, warmed_up, selected_over_k = len(batches) // args.epochs, args.start_iter + args.warmup_steps, []

    def count_selected(step: int) -> None:
        if is_sparse(method) and trainer.accounting.state.iter > args.start_iter:
            total = trainer.accounting.state.stats()["total"]
            selected_over_k.append(total["selected"] / total["k"])

    curve, measured = train_curve(trainer, len(batches), lambda step: batch_loss(train_x, train_y, batches[step - 1]),
                                  evaluation(test_x, test_y, "test_accuracy", "test_loss"),
                                  args.eval_every or per_epoch, tx, progress, count_selected)
    losses = reduced([m["loss"] for m in measured]) / world_size
    step_ms, bytes_sent = 1e3 * slowest([m["seconds"] for m in measured]), [m["bytes"] for m in measured]
    # Time and bytes per step at the target density: after both warm-ups, when the run is long enough.
    timed = step_ms[warmed_up:] if len(step_ms) > 2 * warmed_up else step_ms[1:]
    return {
        "method": method, "density": density if is_sparse(method) else 1.0, "seed": seed, "recipe": args.recipe,
        "train_loss": losses.tolist(), "bytes_sent": bytes_sent, "step_ms": step_ms.tolist(), "eval": curve,
        "final_test_accuracy": curve[-1]["test_accuracy"], "final_train_loss": float(losses[-per_epoch:].mean()),
        "bytes_per_step": statistics.median(bytes_sent[warmed_up:] or bytes_sent), "total_bytes": sum(bytes_sent),
        "ms_per_step": float(timed.median()),
        "selected_over_k": statistics.median(selected_over_k) if selected_over_k else None,
        **report.to_target([curve], lambda point: point["test_accuracy"] >= args.target, "seconds"),
    }


def planned_runs(args: argparse.Namespace) -> list[tuple[str, float, int]]:
    """(method, density, seed) of every run; methods that do not sparsify run once per seed."""
    return [(method, density, seed) for seed in args.seeds for method in args.methods
            for density in (args.densities if is_sparse(method) else [1.0])]


def run_worker(args: argparse.Namespace, rank: int, world_size: int, config: dict) -> dict | list[dict]:
    """One rank: the regime and every run (or, with --overhead, the time per step only)."""
    if args.overhead:
        return overhead(rank, world_size, args)
    data = load_digits_split(seed=0)  # one fixed split for every run
    measured = regime(rank, world_size, args, data[:2])
    runs = planned_runs(args)
    steps = args.epochs * (len(data[1]) // (world_size * args.batch_size))
    progress = report.progress(steps * len(runs), rank, args, config)
    tx, records = TxCounter(config["ifname"]), []
    for method, density, seed in runs:
        progress.set_description(f"seed {seed} {method}" + (f" {density:g}" if is_sparse(method) else ""))
        records.append(train_run(rank, world_size, args, data, method, density, seed, tx, progress))
    progress.close()
    return {"regime": measured, "runs": records}


def timed_rounds(rank: int, trainers: dict, train: tuple, args: argparse.Namespace, warmup: int, steps: int,
                 repeats: int) -> dict[object, list[float]]:
    """Each trainer's milliseconds per step in ``repeats`` interleaved rounds of ``steps`` steps on random batches,
    after ``warmup`` steps: the slowest rank's median per round."""
    (train_x, train_y), keys = train, list(trainers)
    batches, rounds = torch.Generator().manual_seed(rank), {key: [] for key in keys}

    def step_seconds(key) -> float:
        index = torch.randint(0, len(train_y), (args.batch_size,), generator=batches)
        return trainers[key].measured_step(batch_loss(train_x, train_y, index), TxCounter(None))["seconds"]

    for key in keys:
        for _ in range(warmup):
            step_seconds(key)
    for repeat in range(repeats):
        shift = repeat % len(keys)
        for key in keys[shift:] + keys[:shift]:  # interleaved, so drifts of a busy machine spread
            seconds = [step_seconds(key) for _ in range(steps)]
            rounds[key].append(1e3 * float(slowest(seconds).median()))
    return rounds


def overhead(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    """Time per step only: ``--overhead-repeats`` interleaved rounds of ``--overhead-steps`` steps of each method
    after a warm-up; the slowest rank's median per round."""
    configs = [(m, d) for m in args.methods for d in (args.densities if is_sparse(m) else [1.0])]
    trainers = {config: demo_trainer(*config, 0, args, world_size) for config in configs}
    rounds = timed_rounds(rank, trainers, load_digits_split(seed=0)[:2], args, args.start_iter + args.warmup_steps + 3,
                          args.overhead_steps, args.overhead_repeats)
    return [{"method": m, "density": d, "ms_per_step_rounds": ms, "ms_per_step": statistics.median(ms)}
            for (m, d), ms in rounds.items()]


def regime(rank: int, world_size: int, args: argparse.Namespace, train: tuple) -> dict:
    """R, the time DDP's float32 gradient exchange takes on the link over the time the step's compute takes: DDP's
    step less the compute floor's (DDP with a hook that sends nothing), over the floor's; medians of
    ``REGIME_ROUNDS`` interleaved rounds of ``REGIME_STEPS`` steps."""
    trainers = {name: Trainer(name, make_model(args.model, 0), args, world_size) for name in ("ddp", "floor")}
    ms = {name: statistics.median(rounds)
          for name, rounds in timed_rounds(rank, trainers, train, args, 3, REGIME_STEPS, REGIME_ROUNDS).items()}
    return {"R": (ms["ddp"] - ms["floor"]) / ms["floor"], "ddp_ms_per_step": ms["ddp"],
            "floor_ms_per_step": ms["floor"]}


def regime_lines(measured: dict, rows: list[dict], target: float, png: Path) -> list[str]:
    """What the run's picture shows, at which regime, and why the methods come in the order they do."""
    first = min((r for r in rows if r["seconds_to_target"] is not None), key=lambda r: r["seconds_to_target"],
                default=None)
    reached = (f"first to {100 * target:g}% test accuracy: {first['method']}"
               + (f" d={first['density']:g}" if first["density"] < 1 else "") + f" ({first['seconds_to_target']:.1f} s)"
               if first else f"no method reached {100 * target:g}%")
    if measured["R"] > 0:  # the nearest on a log scale
        nearest = min(GPU_REGIMES, key=lambda link: abs(math.log(GPU_REGIMES[link] / measured["R"])))
        where = f"this run's R is nearest that of {nearest}"
    else:
        where = "this run's R is below all of those"
    return [
        f"{png}: test accuracy against steps, training seconds (the slowest rank's) and MB sent per rank, a line per "
        f"method, at R = {measured['R']:.1f}; {reached}.",
        "Why that order: gtopk_ext sends a few percent of DDP's bytes, but spends CPU time selecting and merging them "
        "and needs more steps to an accuracy, while fp16_compress_hook halves the bytes at almost no cost; the larger "
        "R, the more the bytes gtopk_ext saves are worth. With H100s at 16k tokens per GPU and step, R is about "
        + ", ".join(f"{r:g} on {link}" for link, r in GPU_REGIMES.items()) + f": {where}."]


def summarize(records: list[dict], target: float) -> list[dict]:
    """One row per (method, density): means over seeds (and the seeds' spread of the accuracy); the medians over
    seeds of the steps and training seconds to ``target`` test accuracy (None unless every seed got there)."""
    rows = []
    for key in dict.fromkeys((r["method"], r["density"]) for r in records):
        group = [r for r in records if (r["method"], r["density"]) == key]
        accuracies = [r["final_test_accuracy"] for r in group]
        selected = [r["selected_over_k"] for r in group if r["selected_over_k"] is not None]
        rows.append({
            "method": key[0], "density": key[1], "recipe": group[0]["recipe"], "seeds": [r["seed"] for r in group],
            "test_accuracy": statistics.fmean(accuracies), "test_accuracy_min": min(accuracies),
            "test_accuracy_max": max(accuracies), "train_loss": statistics.fmean(r["final_train_loss"] for r in group),
            "bytes_per_step": statistics.fmean(r["bytes_per_step"] for r in group),
            "total_bytes": statistics.fmean(r["total_bytes"] for r in group),
            "ms_per_step": statistics.median(r["ms_per_step"] for r in group),
            "selected_over_k": statistics.fmean(selected) if selected else None,
            "eval": [{key: statistics.fmean(p[key] for p in points) for key in points[0]}  # mean curve over seeds
                     for points in zip(*(r["eval"] for r in group))],
            **report.to_target([r["eval"] for r in group], lambda point: point["test_accuracy"] >= target,
                               "seconds"),
        })
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__, world_size=4, seeds=[0], model="cnn", batch_size=16, lr=0.05, momentum=0.9,
                        densities=[0.01, 0.001], no_progress=False)
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS),
                        metavar="METHOD", help=f"dense (DDP's allreduce), fp16 (fp16_compress_hook), powersgd-<rank> "
                        f"(one bucket), hook-dense (nothing sparsified), or the hook as <compressor>-<collective>[-mc: "
                        f"momentum correction][-recipe: gx.SparseGradState.recipe]; one of {', '.join(METHODS)}")
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training digits")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default: an epoch)")
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy to report the steps and seconds to")
    parser.add_argument("--weight-decay", type=float, default=0.0,
                        help=f"SGD's weight decay (in the hook instead, for the -mc methods; not {RECIPE_METHOD}'s)")
    parser.add_argument("--start-iter", type=int, default=2, help="dense iterations before the residuals start")
    parser.add_argument("--warmup-steps", type=int, default=44,
                        help="iterations of density decaying from --warmup-density to the target (0: none)")
    parser.add_argument("--warmup-density", type=float, default=0.25, help="the density warm-up's first density")
    parser.add_argument("--min-compress-numel", type=int, default=1024, help="smaller buckets go dense")
    parser.add_argument("--per-tensor", action=argparse.BooleanOptionalAction, default=False,
                        help="the hook selects per parameter (its share of k)")
    parser.add_argument("--clip-norm", type=float, default=None, help="the hook's local clipping (DGC)")
    parser.add_argument("--masking", choices=("always", "after-warmup"), default="always",
                        help="momentum factor masking from the first compressed step, or after the density warm-up")
    parser.add_argument("--recipe", choices=list(RECIPES), help="a preset of the flags (RECIPES); explicit flags win")
    parser.add_argument("--path", default="sparse", choices=gx.paths.MODES,
                        help="the gtopk_ext methods' path (gx.PathPolicy): sparse (default: the same accuracies and "
                             "bytes every run), auto (the recipe's own default: chosen from timings, so they vary from "
                             "run to run), or dense16, dense8, dense every step")
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="folder of demo.json and demo.png")
    parser.add_argument("--overhead", action="store_true", help="time per step only: the hooks against DDP's allreduce")
    parser.add_argument("--overhead-steps", type=int, default=30, help="timed steps per method and round (--overhead)")
    parser.add_argument("--overhead-repeats", type=int, default=5, help="rounds of steps (--overhead; the median)")
    cli.add_network_args(parser, prefix="gxdemo", rate=None, timeout=300,
                         timeout_help="seconds a collective may wait before failing")
    args = parser.parse_args(argv)
    if args.recipe is not None:  # the preset's values as defaults: flags given explicitly win
        parser.set_defaults(**RECIPES[args.recipe])
        args = parser.parse_args(argv)
    cli.check(parser, args, positive=("world_size", "epochs", "batch_size", "eval_every", "overhead_steps",
                                      "overhead_repeats"), unit=("target", "densities", "warmup_density"))
    if args.start_iter < 2 or args.warmup_steps < 0:  # the hook's residuals need DDP's rebuilt buckets
        parser.error(f"--start-iter must be >= 2 and --warmup-steps >= 0, got {args.start_iter}, {args.warmup_steps}")
    args.methods, args.seeds = list(dict.fromkeys(args.methods)), list(dict.fromkeys(args.seeds))
    args.densities = sorted(set(args.densities), reverse=True)
    if args.weight_decay and RECIPE_METHOD in args.methods:  # the optimizer leaves it to the hook, the recipe has none
        parser.error(f"--weight-decay is not part of {RECIPE_METHOD} (gx.SparseGradState.recipe): drop one, or use "
                     f"gaussiank-gtopk-mc, which applies it in the hook")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if cli.ran_as_worker(args, run_worker, "timeout"):
        return
    args.out.mkdir(parents=True, exist_ok=True)
    args.rate = cli.link_rate("bench.demo", args)
    setting = (f"{args.world_size} Gloo processes on {os.cpu_count()} CPU cores, {network_name(args.rate)}, digits, "
               f"{args.model}, batch {args.batch_size}/rank, lr {args.lr:g}, momentum {args.momentum:g}")
    # The ranks run for as long as it takes (--timeout bounds each collective).
    result = run_group("bench.demo", args.world_size, args, float("inf"), rate_bps=args.rate, prefix=args.prefix)
    if args.overhead:
        records = rows = result
    else:
        measured, records = result["regime"], result["runs"]
        rows = summarize(records, args.target)
    dense = next((r for r in rows if r["method"] == "dense"), None)
    if args.overhead:
        print(f"time per step, {setting}; median of {args.overhead_repeats} interleaved rounds of "
              f"{args.overhead_steps} steps (each round: the slowest rank's median)")
        print(report.table(rows, [
            ("method", "", "method"), ("density", "g", "density"), ("ms/step", ".2f", "ms_per_step"),
            ("(min-max)", "", lambda r: f"({min(r['ms_per_step_rounds']):.2f}-{max(r['ms_per_step_rounds']):.2f})"),
            ("vs dense", ".2f", lambda r: dense and r["ms_per_step"] / dense["ms_per_step"])]))
        report.write_json(args.out / "overhead.json", args, rows=rows)
        return
    seeds = " ".join(map(str, args.seeds))
    print(f"{setting}; {args.epochs} epochs ({len(records[0]['train_loss'])} steps), seeds {seeds} (mean), "
          f"dense warm-up {args.start_iter} iterations, density warm-up {args.warmup_steps} iterations; the gtopk_ext "
          f"methods' path: {args.path}")
    print(f"regime R = {measured['R']:.1f}: DDP's float32 gradient exchange takes {measured['R']:.1f}x the step's "
          f"compute here (DDP {measured['ddp_ms_per_step']:.1f} ms/step, less the compute floor's "
          f"{measured['floor_ms_per_step']:.1f} (DDP with a hook that sends nothing), over the floor's; medians of "
          f"{REGIME_ROUNDS} rounds of {REGIME_STEPS} steps)")
    if RECIPE_METHOD in args.methods:
        print(f"{RECIPE_METHOD}: gx.SparseGradState.recipe(density, warmup_steps={args.warmup_steps}, "
              f"momentum={args.momentum:g}, path={args.path!r})")
    target = f"{100 * args.target:g}%"
    print(report.table(rows, [
        ("method", "", "method"), ("density", "g", "density"), ("test acc", ".2%", "test_accuracy"),
        ("(min-max)", "", lambda r: f"({100 * r['test_accuracy_min']:.1f}-{100 * r['test_accuracy_max']:.1f})"),
        ("vs dense", "+.2f", lambda r: dense and 100 * (r["test_accuracy"] - dense["test_accuracy"])),
        ("train loss", ".4f", "train_loss"), ("B/step", ".0f", "bytes_per_step"),
        ("total MB", ".2f", lambda r: r["total_bytes"] / 1e6),
        ("vs dense", ".2%", lambda r: dense and r["total_bytes"] / dense["total_bytes"]),
        ("ms/step", ".2f", "ms_per_step"), ("sel/k", ".2f", "selected_over_k"),
        (f"steps to {target}", "g", "steps_to_target"), (f"s to {target}", ".1f", "seconds_to_target")]))
    if args.rate is None:
        print("on loopback: the bytes tell what a slow link would cost; as root, --rate 1gbit times it")
    report.write_json(args.out / "demo.json", args, regime=measured, table=rows, runs=records)
    print("\n".join(regime_lines(measured, rows, args.target, args.out / "demo.png")))
    curves = [{"label": r["method"] + (f" d={r['density']:g}" if r["density"] < 1 else ""), "curve": r["eval"]}
              for r in rows]
    report.plot_curves(curves, args.out / "demo.png", f"{setting}; R = {measured['R']:.1f} (DDP's exchange over "
                       f"the compute); {args.epochs} epochs, mean of seeds {seeds}",
                       "test accuracy (%)", lambda p: 100 * p["test_accuracy"], [
                           ("step", lambda p: p["step"], "linear"),
                           ("training seconds (slowest rank)", lambda p: p["seconds"], "linear"),
                           ("MB sent per rank", lambda p: p["bytes_sent"] / 1e6, "log")])


if __name__ == "__main__":
    main()

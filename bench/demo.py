"""The demo: does a model still train with sparsified gradients, and what does each method send?

Trains the digits task (bench/digits.py: scikit-learn's bundled 8x8 handwritten digits, nothing downloaded) with
real DDP on ``--world-size`` Gloo processes on this machine's CPU, once per method, density and seed, all with
the same initial weights, data order and epochs:

    dense                 DDP's default allreduce (no hook)
    hook-dense            gtopk_ext's hook with collective="dense" (its overhead over DDP, nothing sparsified)
    topk-allgather        exact top-k (torch.topk) + allgather of every rank's k pairs   (TopK-SGD)
    gaussiank-allgather   Gaussian-k threshold + allgather
    gaussiank-gtopk       Gaussian-k threshold + gTop-k butterfly merge, O(k log P)
    gaussiank-gtopk-mc    the same with momentum correction (the hook applies the momentum, the optimizer none)
    gaussiank-allgather-mc  Gaussian-k + allgather with momentum correction
    gaussiank-gtopk-recipe  gaussiank-gtopk-mc with the recipe of its density (``RECIPES["dgc-<density>"]``)

The default run is what a user should compare: DDP, gtopk_ext's recommended settings at densities 0.01 and 0.001
(``gaussiank-gtopk-recipe``: ``dgc-0.01`` and ``dgc-0.001``) and, for contrast, Gaussian-k + gTop-k with the
momentum in the optimizer (``gaussiank-gtopk``), what the recipe fixes.

Every sparse run uses the hook's error feedback, its residual warm-up (``--start-iter`` dense iterations) and a
density warm-up: ``--warmup-steps`` iterations of density decaying geometrically from ``--warmup-density`` to the
target (Deep Gradient Compression's schedule, through the hook's ``density_schedule``). It prints a table (final
test accuracy, final training loss, bytes sent per rank per step as ``state.stats()`` counts them - for
``dense``, a ring allreduce's -, time per step) and writes ``demo.json`` and ``demo.png`` (accuracy and loss
against steps and against bytes sent) under ``--out``.

    python -m bench.demo                        # the defaults: 4 processes, CNN, densities 0.01 and 0.001
    python -m bench.demo --seeds 0 1 2          # the convergence comparison (docs/convergence.md)
    python -m bench.demo --recipe dgc-0.001 --seeds 0 1 2   # density 0.001, the settings that converge (docs/)
    python -m bench.demo --overhead             # time per step only: the hook against DDP's allreduce
"""

from __future__ import annotations

import argparse
import math
from itertools import accumulate
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gtopk_ext as gx
from bench.digits import MODELS, load_digits_split, make_model
from bench.harness import cli, report
from bench.harness.launch import run_group
from bench.harness.methods import hook_state
from bench.harness.train import epoch_batches, evaluate, reduced, slowest
from gtopk_ext.collectives import ring_allreduce_bytes

# method -> (compressor, collective, momentum correction) of the hook; None: DDP's own allreduce. With momentum
# correction the hook applies --momentum and --weight-decay and the optimizer neither.
METHODS: dict[str, tuple[str, str, bool] | None] = {
    "dense": None,
    "hook-dense": ("gaussiank", "dense", False),
    "topk-allgather": ("topk", "allgather", False),
    "gaussiank-allgather": ("gaussiank", "allgather", False),
    "gaussiank-gtopk": ("gaussiank", "gtopk", False),
    "gaussiank-gtopk-mc": ("gaussiank", "gtopk", True),
    "gaussiank-allgather-mc": ("gaussiank", "allgather", True),
    "gaussiank-gtopk-recipe": ("gaussiank", "gtopk", True),  # with its density's recipe: run_args
}
DEFAULT_METHODS = ("dense", "gaussiank-gtopk", "gaussiank-gtopk-recipe")
# --recipe: measured settings of the hook (and the methods they are for), as defaults of the flags below: DGC's
# momentum correction with its warm-up over 4 epochs of 22 steps, momentum factor masking from the end of it on.
# Without --recipe, RECIPE_METHOD runs at each density d with the recipe f"dgc-{d:g}" (flags given still win).
_DGC = {"methods": ["dense", "gaussiank-gtopk-mc", "gaussiank-allgather-mc"], "warmup_steps": 88,
        "masking": "after-warmup"}
RECIPES: dict[str, dict] = {
    "dgc-0.001": {**_DGC, "densities": [0.001]},
    "dgc-0.01": {**_DGC, "densities": [0.01], "per_tensor": True},
    # the convolutions' bucket (18,816 elements, 3.4% of the parameters) dense, a 2-epoch warm-up
    "dgc-0.001-dense-conv": {**_DGC, "densities": [0.001], "per_tensor": True, "min_compress_numel": 20_000,
                             "warmup_steps": 44},
}
RECIPE_METHOD = "gaussiank-gtopk-recipe"


def is_sparse(method: str) -> bool:
    return METHODS[method] is not None and METHODS[method][1] != "dense"


def momentum_in_hook(method: str) -> bool:
    return METHODS[method] is not None and METHODS[method][2]


def run_args(args: argparse.Namespace, method: str, density: float) -> argparse.Namespace:
    """The settings one run trains with: ``args``, with its density's recipe for RECIPE_METHOD (parse_args put
    the recipe's values that no explicit flag overrides in ``args.recipe_settings``)."""
    if method != RECIPE_METHOD or args.recipe is not None:
        return args
    return argparse.Namespace(**{**vars(args), **args.recipe_settings[recipe_for(density)]})


def recipe_for(density: float) -> str:
    return f"dgc-{density:g}"


def make_optimizer(model: nn.Module, method: str, args: argparse.Namespace) -> torch.optim.SGD:
    """SGD with ``args``' momentum and weight decay, or neither where the hook applies them."""
    in_hook = momentum_in_hook(method)
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0 if in_hook else args.momentum,
                           weight_decay=0.0 if in_hook else args.weight_decay)


def make_hook_state(method: str, density: float, args: argparse.Namespace) -> gx.SparseGradState | None:
    """The hook's state of one run; ``args``: run_args' for that run."""
    if METHODS[method] is None:
        return None
    compressor, collective, correction = METHODS[method]
    moved = {"momentum": args.momentum, "weight_decay": args.weight_decay} if correction else {}
    if correction and args.masking == "after-warmup":  # momentum keeps its velocity through the warm-up
        moved["masking_start_iter"] = args.start_iter + args.warmup_steps
    return hook_state(density, compressor=compressor, collective=collective, start_iter=args.start_iter,
                      warmup_steps=args.warmup_steps, warmup_density=args.warmup_density, warmup_from=args.start_iter,
                      min_compress_numel=args.min_compress_numel, per_tensor=args.per_tensor,
                      clip_norm=args.clip_norm, **moved)


def train_run(rank: int, world_size: int, args: argparse.Namespace, data: tuple, method: str, density: float,
              seed: int, progress) -> dict:
    """One DDP training run; every rank returns the same record (rank 0's evaluations, losses averaged over
    ranks, step times as the slowest rank saw them)."""
    train_x, train_y, test_x, test_y = data
    args = run_args(args, method, density)
    model = make_model(args.model, seed)  # the same initial weights on every rank and for every method
    ddp = DistributedDataParallel(model)
    state = make_hook_state(method, density, args)
    if state is not None:
        ddp.register_comm_hook(state, gx.sparse_grad_hook)
    dense_bytes = ring_allreduce_bytes(sum(p.numel() * p.element_size() for p in model.parameters()), world_size)
    optimizer = make_optimizer(model, method, args)
    losses, step_seconds, bytes_sent, selected_over_k = [], [], [], []
    evals = [(0, *evaluate(model, test_x, test_y))]
    dist.barrier()
    for epoch in range(args.epochs):
        for index in epoch_batches(epoch, seed, len(train_y), rank, world_size, args.batch_size):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(ddp(train_x[index]), train_y[index])
            loss.backward()
            optimizer.step()
            step_seconds.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
            if state is None:
                bytes_sent.append(dense_bytes)
            else:
                total = state.stats()["total"]
                bytes_sent.append(total["bytes_sent"])
                if is_sparse(method) and state.iter > args.start_iter:
                    selected_over_k.append(total["selected"] / total["k"])
            if progress is not None:
                progress.update(1)
        if rank == 0:  # DDP keeps the replicas identical: rank 0's model is everyone's
            evals.append((len(losses), *evaluate(model, test_x, test_y)))
            if progress is not None:
                progress.set_postfix(loss=f"{statistics.fmean(losses[-10:]):.3f}", acc=f"{evals[-1][1]:.3f}")
        dist.barrier()  # the evaluation stays out of the next step's time

    mean_losses = reduced(losses) / world_size
    slowest_seconds = slowest(step_seconds)
    evals_tensor = torch.tensor(evals if rank == 0 else [(0, 0.0, 0.0)] * (args.epochs + 1), dtype=torch.float64)
    dist.broadcast(evals_tensor, src=0)
    steps_per_epoch = len(losses) // args.epochs
    # Time and bytes per step at the target density: after both warm-ups, when the run is long enough.
    warmed_up = args.start_iter + args.warmup_steps
    timed = slowest_seconds[warmed_up:] if len(slowest_seconds) > 2 * warmed_up else slowest_seconds[1:]
    steady_bytes = bytes_sent[warmed_up:] or bytes_sent
    return {
        "method": method, "density": density if is_sparse(method) else 1.0, "seed": seed, "recipe": args.recipe,
        "compressor": METHODS[method][0] if METHODS[method] else None,
        "collective": METHODS[method][1] if METHODS[method] else "ddp-allreduce",
        "train_loss": mean_losses.tolist(),
        "bytes_sent": bytes_sent,
        "step_ms": (1e3 * slowest_seconds).tolist(),
        "eval": [{"step": int(s), "test_accuracy": a, "test_loss": loss} for s, a, loss in evals_tensor.tolist()],
        "final_test_accuracy": float(evals_tensor[-1, 1]),
        "final_train_loss": float(mean_losses[-steps_per_epoch:].mean()),
        "bytes_per_step": statistics.median(steady_bytes),
        "total_bytes": sum(bytes_sent),
        "ms_per_step": 1e3 * float(timed.median()),
        "selected_over_k": statistics.median(selected_over_k) if selected_over_k else None,
    }


def planned_runs(args: argparse.Namespace) -> list[tuple[str, float, int]]:
    """(method, density, seed) of every run; methods that do not sparsify run once per seed."""
    return [(method, density, seed) for seed in args.seeds for method in args.methods
            for density in (args.densities if is_sparse(method) else [1.0])]


def run_worker(args: argparse.Namespace, rank: int, world_size: int, config: dict) -> list[dict]:
    """One rank: every run (or, with --overhead, the time per step only)."""
    if args.overhead:
        return overhead(rank, args)
    data = load_digits_split(seed=0)  # one fixed split for every run
    runs = planned_runs(args)
    steps = args.epochs * (len(data[1]) // (world_size * args.batch_size))
    progress = report.progress(steps * len(runs), rank, args, config)
    records = []
    for method, density, seed in runs:
        if progress is not None:
            progress.set_description(f"seed {seed} {method}" + (f" {density:g}" if is_sparse(method) else ""))
        records.append(train_run(rank, world_size, args, data, method, density, seed, progress))
    if progress is not None:
        progress.close()
    return records


def overhead(rank: int, args: argparse.Namespace) -> list[dict]:
    """Time per step only (no evaluation): each method in turn, ``--overhead-repeats`` interleaved rounds of
    ``--overhead-steps`` steps after a warm-up; the slowest rank's median per round."""
    train_x, train_y, _, _ = load_digits_split(seed=0)
    configs = [(m, d) for m in args.methods for d in (args.densities if is_sparse(m) else [1.0])]
    models = {}
    for method, density in configs:
        settings = run_args(args, method, density)
        ddp = DistributedDataParallel(make_model(args.model, 0))
        state = make_hook_state(method, density, settings)
        if state is not None:
            ddp.register_comm_hook(state, gx.sparse_grad_hook)
        warmup = settings.start_iter + settings.warmup_steps + 3
        models[(method, density)] = (ddp, make_optimizer(ddp, method, settings), warmup)
    batches = torch.Generator().manual_seed(rank)

    def timed_steps(config, steps: int) -> list[float]:
        ddp, optimizer, _ = models[config]
        seconds = []
        for _ in range(steps):
            index = torch.randint(0, len(train_y), (args.batch_size,), generator=batches)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(ddp(train_x[index]), train_y[index]).backward()
            optimizer.step()
            seconds.append(time.perf_counter() - start)
        return seconds

    for config in configs:
        timed_steps(config, models[config][2])
    medians = {config: [] for config in configs}
    for repeat in range(args.overhead_repeats):
        shift = repeat % len(configs)
        for config in configs[shift:] + configs[:shift]:  # interleaved, so drifts of a busy machine spread
            dist.barrier()
            medians[config].append(1e3 * float(slowest(timed_steps(config, args.overhead_steps)).median()))
    return [{"method": m, "density": d, "ms_per_step_rounds": ms} for (m, d), ms in medians.items()]


def summarize(records: list[dict]) -> list[dict]:
    """One row per (method, density): means over seeds (and the seeds' spread of the accuracy)."""
    rows = []
    for key in dict.fromkeys((r["method"], r["density"]) for r in records):
        group = [r for r in records if (r["method"], r["density"]) == key]
        accuracies = [r["final_test_accuracy"] for r in group]
        selected = [r["selected_over_k"] for r in group if r["selected_over_k"] is not None]
        rows.append({
            "method": key[0], "density": key[1], "recipe": group[0]["recipe"], "seeds": [r["seed"] for r in group],
            "test_accuracy": statistics.fmean(accuracies),
            "test_accuracy_min": min(accuracies), "test_accuracy_max": max(accuracies),
            "train_loss": statistics.fmean(r["final_train_loss"] for r in group),
            "bytes_per_step": statistics.fmean(r["bytes_per_step"] for r in group),
            "total_bytes": statistics.fmean(r["total_bytes"] for r in group),
            "ms_per_step": statistics.median(r["ms_per_step"] for r in group),
            "selected_over_k": statistics.fmean(selected) if selected else None,
        })
    return rows


def print_table(rows: list[dict]) -> None:
    dense = next((r for r in rows if r["method"] == "dense"), None)
    print(f"{'method':<23}{'density':>8}{'test acc':>10}{'(min-max)':>14}{'vs dense':>9}{'train loss':>11}"
          f"{'B/step':>11}{'total MB':>10}{'vs dense':>9}{'ms/step':>9}{'sel/k':>7}")
    for r in rows:
        spread = f"({100 * r['test_accuracy_min']:.1f}-{100 * r['test_accuracy_max']:.1f})"
        gap = f"{100 * (r['test_accuracy'] - dense['test_accuracy']):+.2f}pp" if dense else "-"
        share = f"{100 * r['total_bytes'] / dense['total_bytes']:.2f}%" if dense else "-"
        selected = f"{r['selected_over_k']:.2f}" if r["selected_over_k"] is not None else "-"
        print(f"{r['method']:<23}{r['density']:>8g}{100 * r['test_accuracy']:>9.2f}%{spread:>14}{gap:>9}"
              f"{r['train_loss']:>11.4f}{r['bytes_per_step']:>11.0f}{r['total_bytes'] / 1e6:>10.2f}{share:>9}"
              f"{r['ms_per_step']:>9.2f}{selected:>7}")


def mean_curve(records: list[dict], key) -> list[float]:
    """The mean over seeds of ``key(record)`` (equal-length lists)."""
    return [statistics.fmean(values) for values in zip(*(key(r) for r in records))]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average: the per-step loss of a small batch is too noisy to read."""
    out, running = [], 0.0
    for i, v in enumerate(values):
        running += v - (values[i - window] if i >= window else 0.0)
        out.append(running / min(i + 1, window))
    return out


def plot(records: list[dict], path: Path, title: str) -> None:
    fig, axes = report.pyplot().subplots(2, 2, figsize=(13, 8.5))
    import matplotlib.ticker

    colors = dict(zip(METHODS, ("black", "tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
                                "tab:brown")))
    densities = sorted({r["density"] for r in records if r["density"] < 1.0}, reverse=True)
    styles = dict(zip(densities, ("-", "--", ":", "-.")))
    steps = len(records[0]["train_loss"])
    window = max(1, steps // 40)
    for key in dict.fromkeys((r["method"], r["density"]) for r in records):
        group = [r for r in records if (r["method"], r["density"]) == key]
        method, density = key
        label = method if density == 1.0 else f"{method} d={density:g}"
        style = dict(color=colors[method], linestyle=styles.get(density, "-"), linewidth=1.6 if density == 1.0 else 1.3)
        cumulative_mb = [b / 1e6 for b in accumulate(mean_curve(group, lambda r: r["bytes_sent"]))]
        loss = smooth(mean_curve(group, lambda r: r["train_loss"]), window)
        eval_steps = [e["step"] for e in group[0]["eval"]]
        accuracy = [100 * a for a in mean_curve(group, lambda r: [e["test_accuracy"] for e in r["eval"]])]
        eval_mb = [cumulative_mb[s - 1] for s in eval_steps[1:]]  # the untrained model (step 0) sent nothing
        axes[0, 0].plot(eval_steps, accuracy, marker=".", label=label, **style)
        axes[0, 1].plot(eval_mb, accuracy[1:], marker=".", **style)
        axes[1, 0].plot(range(1, steps + 1), loss, **style)
        axes[1, 1].plot(cumulative_mb, loss, **style)
    for ax in axes[:, 1]:
        ax.set_xscale("log")
        ax.set_xlabel("MB sent per rank (cumulative, log scale)")
    for ax in axes[:, 0]:
        ax.set_xlabel("step")
    lowest_final = min(100 * r["final_test_accuracy"] for r in records)
    for ax in axes[0]:  # the final accuracies are what differ: the axis starts a little below the lowest
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(min(max(0, lowest_final - 15), 80), 100)
    for ax in axes[1]:
        ax.set_ylabel(f"training loss (moving average of {window} steps)")
        ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")  # 0.1, not 10^-1, on log axes
    for ax in axes.flat:
        ax.grid(True, which="both", alpha=0.3)
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":
                axis.set_major_formatter(plain)
                axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.suptitle(title)
    fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.965), ncol=4, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    report.save(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4, help="Gloo processes (DDP ranks)")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS),
                        metavar="METHOD", help=f"what to train with: dense (DDP's allreduce), hook-dense (the "
                        f"hook's dense collective), or the hook as <compressor>-<collective>[-mc: momentum "
                        f"correction][-recipe: its density's recipe]; one of {', '.join(METHODS)}")
    parser.add_argument("--densities", nargs="+", type=float, default=[0.01, 0.001],
                        help="the sparse methods' densities: each runs at every one")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="one run per seed and method")
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training digits")
    parser.add_argument("--model", choices=MODELS, default="cnn", help="the network trained on the digits")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per rank per step")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD's learning rate")
    parser.add_argument("--momentum", type=float, default=0.9,
                        help="SGD's momentum (in the hook instead, for the -mc and -recipe methods)")
    parser.add_argument("--weight-decay", type=float, default=0.0,
                        help="SGD's weight decay (in the hook instead, for the -mc and -recipe methods)")
    parser.add_argument("--start-iter", type=int, default=2, help="dense iterations before the residuals start")
    parser.add_argument("--warmup-steps", type=int, default=44,
                        help="iterations of density decaying from --warmup-density to the target (0: none)")
    parser.add_argument("--warmup-density", type=float, default=0.25, help="the density warm-up's first density")
    parser.add_argument("--min-compress-numel", type=int, default=1024, help="smaller buckets go dense")
    parser.add_argument("--per-tensor", action=argparse.BooleanOptionalAction, default=False,
                        help="the hook selects per parameter (its share of k)")
    parser.add_argument("--clip-norm", type=float, default=None, help="the hook's local clipping (DGC)")
    parser.add_argument("--masking", choices=("always", "after-warmup"), default="always",
                        help="momentum correction's factor masking: from the first compressed step, or from the end "
                             "of the density warm-up on (the hook's masking_start_iter)")
    parser.add_argument("--recipe", choices=list(RECIPES),
                        help="hook settings that converge at that density (see RECIPES), for every run; flags given "
                             f"explicitly win. Without it, {RECIPE_METHOD} takes its density's recipe")
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="folder of demo.json and demo.png")
    parser.add_argument("--overhead", action="store_true",
                        help="measure time per step only (no training curves): the hook against DDP's allreduce")
    parser.add_argument("--overhead-steps", type=int, default=30, help="timed steps per method with --overhead")
    parser.add_argument("--overhead-repeats", type=int, default=5,
                        help="repeats of the timed steps with --overhead (the median is reported)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait before failing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    cli.add_worker_arg(parser)
    args = parser.parse_args(argv)
    if args.recipe is not None:
        args = parse_with_preset(parser, argv, RECIPES[args.recipe])
    cli.check_positive(parser, args, "world_size", "epochs", "batch_size", "overhead_steps", "overhead_repeats")
    if args.start_iter < 2:
        parser.error(f"--start-iter must be >= 2 (the hook's residuals need DDP's rebuilt buckets), got "
                     f"{args.start_iter}")
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    for density in args.densities + [args.warmup_density]:
        if not 0 < density <= 1:
            parser.error(f"densities must be in (0, 1], got {density}")
    args.methods = list(dict.fromkeys(args.methods))
    args.densities = sorted(set(args.densities), reverse=True)
    args.seeds = list(dict.fromkeys(args.seeds))
    # RECIPE_METHOD's settings at each density (run_args): the recipe's values that no explicit flag overrides
    args.recipe_settings = {}
    if args.recipe is None and RECIPE_METHOD in args.methods:
        for density in args.densities:
            name = recipe_for(density)
            if name not in RECIPES:
                parser.error(f"--methods {RECIPE_METHOD} runs each density with the recipe dgc-<density>, and there "
                             f"is none for density {density:g} (recipes: {', '.join(RECIPES)}); or give --recipe")
            preset = {key: value for key, value in RECIPES[name].items() if key not in ("methods", "densities")}
            recipe_args = parse_with_preset(parser, argv, preset)
            args.recipe_settings[name] = {"recipe": name, **{key: getattr(recipe_args, key) for key in preset}}
    return args


def parse_with_preset(parser: argparse.ArgumentParser, argv: list[str] | None, preset: dict) -> argparse.Namespace:
    """``argv`` parsed with ``preset``'s values as the defaults: flags given explicitly still win."""
    saved = {name: parser.get_default(name) for name in preset}
    parser.set_defaults(**preset)
    try:
        return parser.parse_args(argv)
    finally:
        parser.set_defaults(**saved)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if cli.ran_as_worker(args, run_worker, "timeout"):
        return
    args.out.mkdir(parents=True, exist_ok=True)
    setting = (f"{args.world_size} Gloo processes on {os.cpu_count()} CPU cores, digits, {args.model}, batch "
               f"{args.batch_size}/rank, lr {args.lr:g}, momentum {args.momentum:g}")
    # The ranks run on loopback for as long as it takes (--timeout bounds each collective).
    measured = run_group("bench.demo", args.world_size, args, math.inf)
    if args.overhead:
        rows = measured
        baseline = next((statistics.median(r["ms_per_step_rounds"]) for r in rows if r["method"] == "dense"), None)
        print(f"time per step, {setting}; median of {args.overhead_repeats} interleaved rounds of "
              f"{args.overhead_steps} steps (each round: the slowest rank's median)")
        print(f"{'method':<23}{'density':>8}{'ms/step':>9}{'(min-max)':>16}{'vs dense':>9}")
        for r in rows:
            ms = r["ms_per_step_rounds"]
            r["ms_per_step"] = statistics.median(ms)
            ratio = f"{r['ms_per_step'] / baseline:.2f}x" if baseline else "-"
            print(f"{r['method']:<23}{r['density']:>8g}{r['ms_per_step']:>9.2f}"
                  f"{f'({min(ms):.2f}-{max(ms):.2f})':>16}{ratio:>9}")
        path = args.out / "overhead.json"
        report.write_json(path, args, rows=rows)
        print(f"wrote {path}")
        return

    records = measured
    rows = summarize(records)
    seeds = " ".join(map(str, args.seeds))
    print(f"{setting}; {args.epochs} epochs ({len(records[0]['train_loss'])} steps), seeds {seeds} (mean), "
          f"dense warm-up {args.start_iter} iterations, density warm-up {args.warmup_steps} iterations")
    for name, values in args.recipe_settings.items():
        print(f"{RECIPE_METHOD} at density {RECIPES[name]['densities'][0]:g}: " +
              ", ".join(f"{key}={value}" for key, value in values.items()))
    print_table(rows)
    report.write_json(args.out / "demo.json", args, table=rows, runs=records)
    plot(records, args.out / "demo.png", f"{setting}; {args.epochs} epochs, mean of seeds {seeds}")
    print(f"wrote {args.out / 'demo.json'} and {args.out / 'demo.png'}")


if __name__ == "__main__":
    main()

"""Against the hooks users already have: gtopk_ext's hook beside DDP's allreduce, fp16/bf16_compress_hook, PowerSGD
and a no-communication floor, one model each from the same weights on the same batches, steps interleaved, each rank
behind an emulated link (as root) or on loopback: step time, bytes, CPU time, accuracy. docs/performance.md.

    python -m bench.peers --loopback --world-size 2 --steps 10            # no root: no namespaces, no shaping
"""

import argparse
import gc
import hashlib
import math
import os
import resource
import statistics
import time
from itertools import accumulate
from pathlib import Path

import torch
from torch import nn

import gtopk_ext as gx
from bench.digits import load_digits_split, make_model, mlp
from bench.emulated_network import TxCounter, network_name
from bench.harness import cli, report
from bench.harness.gradients import wide_mlp
from bench.harness.launch import run_group
from bench.harness.methods import (START_ITER, LocalMethod, add_dgc_arguments, add_outer_arguments, method,
                                   method_name, numel_of)
from bench.harness.regime import (CALIBRATION_STEPS, add_regime_args, check_regime_args, floor_seconds, link_rate,
                                  measured_ratio)
from bench.harness.train import Trainer, batch_loss, epoch_batches, evaluate, gathered

WARMUP_STEPS = START_ITER + 1  # steps left out of the timing and byte statistics
MODELS = ("cnn", "mlp", "deep")
DEEP_LAYERS = 8  # --model deep: this many equal hidden layers, so that many buckets overlap the backward
# The methods (bench/harness/methods.py); a new recipe (the best gtopk_ext settings of the day) is one more name.
METHODS = ("ddp", "fp16", "bf16", "powersgd-1", "powersgd-2", "powersgd-4",
           *(f"{collective}-{d:g}" for collective in ("gtopk", "allgather", "oktopk") for d in (0.01, 0.001)),
           "dgc-0.01", "dgc-0.001", "recipe-0.01", "gtopk-0.01-sync", "gtopk-0.001-sync", "floor")


def build_model(args: argparse.Namespace, seed: int) -> nn.Module:
    if args.model == "deep":
        return mlp([max(16, round(math.sqrt(args.mlp_params / DEEP_LAYERS)))] * DEEP_LAYERS, seed)
    return make_model("cnn", seed) if args.model == "cnn" else wide_mlp(args.mlp_params, seed)


def digest(model: nn.Module) -> str:
    """The parameters' bits: equal digests, bitwise equal models."""
    return hashlib.sha256(b"".join(p.detach().contiguous().view(torch.uint8).numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def run_worker(args: argparse.Namespace, rank: int, world_size: int, config: dict) -> dict:
    """One rank: per seed, every method for ``args.steps`` interleaved steps (a rotating order: no method always
    runs first); rank 0 gets every rank's measurements."""
    train_x, train_y, test_x, test_y = load_digits_split()
    counter, runs = TxCounter(config["ifname"]), []
    progress = report.progress(len(args.seeds) * args.steps * len(args.methods), rank, args, config)
    per_epoch = len(train_y) // (world_size * args.batch_size)
    for seed in args.seeds:  # the same initial weights for every method
        trainers = {name: Trainer(name, build_model(args, seed), args, world_size) for name in args.methods}
        measured, evals = {name: [] for name in args.methods}, {name: [] for name in args.methods}
        batches = [index for epoch in range(-(-args.steps // per_epoch))
                   for index in epoch_batches(epoch, seed, len(train_y), rank, world_size, args.batch_size)]
        for step in range(args.steps + 1):
            shift, loss_of = step % len(args.methods), batch_loss(train_x, train_y, batches[step - 1])
            for name in args.methods[shift:] + args.methods[:shift] if step else []:
                progress.set_description(f"seed {seed} step {step} {name}", refresh=False)
                progress.update()
                measured[name].append(trainers[name].measured_step(loss_of, counter, last=step == args.steps))
            if step % args.eval_every == 0 or step == args.steps:
                for name in args.methods:
                    shared = trainers[name].shared_model()  # a local method's replicas' mean: every rank
                    if rank == 0:
                        evals[name].append((step, evaluate(shared, test_x, test_y)[0]))
        runs.append({})
        for name, steps in measured.items():  # each [rank][step]
            seconds, cpu, tx, own = zip(*gathered([[m[key] for m in steps]
                                                   for key in ("seconds", "cpu_seconds", "tx_bytes", "bytes")]))
            runs[-1][name] = {"seconds": seconds, "cpu_seconds": cpu, "tx_bytes": tx if counter.path else None,
                              "own_bytes": own,
                              "buckets": trainers[name].accounting.buckets() if trainers[name].local is None else None,
                              "paths": [m["paths"] for m in steps], "evals": evals[name],
                              "digest": digest(trainers[name].model)}
        del trainers
        gc.collect()  # DDP models sit in reference cycles: free one seed's models before the next seed's
    progress.close()
    return {"parameters": numel_of(build_model(args, 0)), "runs": runs}


def summarize(name: str, runs: list[dict], args: argparse.Namespace) -> dict:
    """One method's row from every seed's measurements (per step: the slowest rank's time, the mean over ranks of
    CPU time and bytes; pooled over the steps after the warm-up of every seed). A local method's steps are those of
    the rank whose steps took longest in all: its ranks do not wait for each other at every step."""
    timed, local = slice(WARMUP_STEPS, None), isinstance(method(name), LocalMethod)
    slowest, cpu, tx, own, curves = [], [], [], [], []
    for run in runs:
        step_seconds = (list(max(run["seconds"], key=sum)) if local
                        else [max(per_rank) for per_rank in zip(*run["seconds"])])
        slowest += step_seconds[timed]
        cpu += [statistics.fmean(per_rank) for per_rank in zip(*run["cpu_seconds"])][timed]
        own += [statistics.fmean(per_rank) for per_rank in zip(*run["own_bytes"])][timed]
        if run["tx_bytes"] is not None:
            tx += [statistics.fmean(per_rank) for per_rank in zip(*run["tx_bytes"])][timed]
        elapsed = list(accumulate(step_seconds, initial=0.0))
        curves.append([{"step": step, "accuracy": accuracy, "train_seconds": elapsed[step]}
                       for step, accuracy in run["evals"]])
    low, median, high = statistics.quantiles(slowest, n=4, method="inclusive") if len(slowest) > 1 else slowest * 3
    return {
        "method": name, "label": method(name).label, "ms_per_step": 1e3 * median, "ms_per_step_p25": 1e3 * low,
        "ms_per_step_p75": 1e3 * high, "cpu_ms_per_step": 1e3 * statistics.median(cpu),
        "tx_mb_per_step": statistics.fmean(tx) / 1e6 if tx else None,
        "own_mb_per_step": statistics.fmean(own) / 1e6, "buckets": runs[0]["buckets"],
        "final_accuracy": statistics.fmean(curve[-1]["accuracy"] for curve in curves),
        **report.to_target(curves, lambda point: point["accuracy"] >= args.target, "train_seconds"),
        "curves": curves,
    }


def stage_table(runs: list[dict], args: argparse.Namespace) -> str:
    """Per stage of the dgc methods' density warm-up (after the dense steps): each method's step time, the median
    over seeds of the median over the stage's steps, and its ratio to DDP's where DDP ran."""
    starts = sorted({args.dgc_dense_steps, *(start for start, _ in gx.exponential_warmup(
        0.01, args.dgc_warmup, args.dgc_warmup_start) if start > args.dgc_dense_steps)})
    edges = [start for start in starts if start < args.steps] + [args.steps]
    rows = [{"iterations": f"{begin}-{end - 1}", **{name: statistics.median(statistics.median(
        max(per_rank) for per_rank in list(zip(*run[name]["seconds"]))[begin:end]) for run in runs)
        for name in args.methods}} for begin, end in zip(edges, edges[1:])]
    def cell(name: str):
        return lambda r: f"{1e3 * r[name]:.0f}" + (f" ({r[name] / r['ddp']:.2f}x)" if "ddp" in r else "")
    return report.table(rows, [("iterations", "", "iterations")] + [(name, "", cell(name)) for name in args.methods],
                        markdown=True)


def others_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat: all but idle, iowait and guest time, which user
    time counts already) less those of this driver and its finished children (the ranks)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = (sum(fields) - fields[3] - sum(fields[4:5]) - sum(fields[8:10])) / os.sysconf("SC_CLK_TCK")
    return busy - sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                      for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def parse_args(argv: list | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__, world_size=4, steps=100, eval_every=10, seeds=[0], batch_size=32, lr=0.05,
                        momentum=0.9, nesterov=False, json=None, plot=Path("peers.png"), no_progress=False)
    parser.add_argument("--methods", nargs="+", type=method_name, default=METHODS,
                        help=f"methods (bench/harness/methods.py), e.g. {' '.join(METHODS)}, dgc-0.01-sparse, "
                             f"recipe-0.01, recipe-0.01-44 (its own warm-up length), and the local ones: "
                             f"sparseloco-0.015625-8 (SparseLocalSGD's defaults), diloco-32 (their inner optimizer: "
                             f"the DDP methods' SGD)")
    parser.add_argument("--model", choices=MODELS, default="cnn",
                        help="cnn: the demo's CNN (0.6M parameters); mlp: 64-h-h-10 with about --mlp-params; "
                             f"deep: {DEEP_LAYERS} equal hidden layers with about --mlp-params")
    parser.add_argument("--mlp-params", type=lambda s: int(float(s)), default=17_100_000,
                        help="parameters of --model mlp or deep (17.1M: mlp's h = 4097)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket cap of every method but PowerSGD (default: DDP's own, 25)")
    parser.add_argument("--target", type=float, default=0.9, help="test accuracy whose steps and seconds to report")
    add_dgc_arguments(parser)
    add_outer_arguments(parser)
    cli.add_network_args(parser, prefix="gxpeers")
    add_regime_args(parser)
    args = parser.parse_args(argv)
    check_regime_args(parser, args)
    cli.check(parser, args, positive=("world_size", "steps", "eval_every", "batch_size", "mlp_params"),
              unit=("target",))
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps the statistics leave out, got {args.steps}")
    args.methods, args.seeds = list(dict.fromkeys(args.methods)), list(dict.fromkeys(args.seeds))
    return args


def measure_floor(args: argparse.Namespace) -> float:
    """The compute floor's step here (seconds, the slowest rank's): the floor method alone on loopback."""
    settings = {**vars(args), "methods": ["floor"], "steps": CALIBRATION_STEPS, "seeds": args.seeds[:1],
                "eval_every": CALIBRATION_STEPS, "no_progress": True, "json": None, "plot": None}
    seconds = run_group("bench.peers", args.world_size, settings, args.timeout, prefix=args.prefix)["runs"][0]["floor"]
    return floor_seconds([max(per_rank) for per_rank in zip(*seconds["seconds"])])


def main(argv: list | None = None) -> None:
    args = parse_args(argv)
    if cli.ran_as_worker(args, run_worker, "timeout"):
        return
    rate, _ = link_rate(args, "peers", numel_of(build_model(args, 0)), lambda: measure_floor(args))
    network = network_name(rate) + (f", regime R = {args.regime:g}" if args.regime else "")
    others, started, load_before = others_cpu_seconds(), time.perf_counter(), os.getloadavg()
    measured = run_group("bench.peers", args.world_size, args, args.timeout, rate_bps=rate, prefix=args.prefix)
    wall, others = time.perf_counter() - started, max(0.0, others_cpu_seconds() - others)
    load = {"wall_seconds": wall, "cpus": os.cpu_count(), "other_processes_cores": others / wall,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    runs = measured["runs"]
    rows = [summarize(name, [run[name] for run in runs], args) for name in args.methods]
    model = f"{args.model.upper()} ({measured['parameters'] / 1e6:.3g}M parameters)"
    setting = (f"{args.world_size} ranks on {network}, digits, {model}, batch {args.batch_size}/rank, "
               f"{args.steps} steps, seeds {' '.join(map(str, args.seeds))}")
    print(f"\n{setting}; steps after the first {WARMUP_STEPS}; other processes kept "
          f"{load['other_processes_cores']:.2f} of {load['cpus']} cores busy\n")
    ddp, target = next((row for row in rows if row["method"] == "ddp"), None), f"{100 * args.target:g}%"
    print(report.table(rows, [
        ("method", "", "label"), ("ms/step (p25-p75)", "", lambda r: "{ms_per_step:.1f} ({ms_per_step_p25:.1f}-"
                                                                     "{ms_per_step_p75:.1f})".format(**r)),
        ("vs DDP", "", lambda r: ddp and f"{r['ms_per_step'] / ddp['ms_per_step']:.2f}x"),
        ("MB/rank/step wire", ".3f", "tx_mb_per_step"), ("MB/rank/step own", ".3f", "own_mb_per_step"),
        ("CPU ms/step/rank", ".1f", "cpu_ms_per_step"), ("test acc", ".1%", "final_accuracy"),
        (f"steps to {target}", "g", "steps_to_target"), (f"s to {target}", ".1f", "seconds_to_target")], markdown=True))
    floor = next((row for row in rows if row["method"] == "floor"), None)
    if args.regime and ddp and floor:
        print("\n" + measured_ratio(ddp["ms_per_step"] / 1e3, floor["ms_per_step"] / 1e3))
    print(f"\nms per step in each stage of the dgc methods' warm-up (--dgc-warmup {args.dgc_warmup}):\n")
    print(stage_table(runs, args))
    for name in args.methods:  # the hook forced to finish each bucket in the call must not change a bit
        base = name.removesuffix("-sync")
        if base != name and base in args.methods:
            equal = all(run[name]["digest"] == run[base]["digest"] for run in runs)
            print(f"\n{base} and {name}: parameters bitwise equal after every seed: {equal}")
    curves = [{"method": row["method"], "label": row["label"],  # the mean over seeds of each evaluation
               "curve": [{key: statistics.fmean(p[key] for p in seeds) for key in ("train_seconds", "accuracy")}
                         for seeds in zip(*row["curves"])]} for row in rows]
    report.plot_curves(curves, args.plot, setting, "test accuracy (%)", lambda c: 100 * c["accuracy"], [(
        "training seconds (slowest rank's steps, evaluation excluded)", lambda c: c["train_seconds"], "linear")],
        style=lambda i, r: {"color": "black", "linestyle": "--"} if r["method"] == "floor" else {"color": f"C{i % 10}"})
    if args.json:
        report.write_json(args.json, args, network=network, load=load, warmup_steps=WARMUP_STEPS,
                          parameters=measured["parameters"], table=rows, runs=runs)


if __name__ == "__main__":
    main()

"""WAGMA: throughput, test accuracy and replica spread of DDP's gradient allreduce, synchronous and wait-avoiding
group model averaging, and global averages alone (no-group), with injected irregular step times (random delays, a
straggler), on the digits, each rank behind an emulated link (as root) or on loopback. docs/wagma.md.

    python -m bench.wagma --loopback --json wagma.json --plot wagma.png
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gtopk_ext as gx
from bench.digits import load_digits_split, make_model
from bench.emulated_network import network_name
from bench.harness import cli, report
from bench.harness.launch import run_group
from bench.harness.train import evaluate, load_consensus, slowest

METHODS = ("ddp", "group-sync", "group-wait-avoiding", "no-group")
SCENARIOS = ("random", "straggler")


def run_method(method: str, scenario: str, rank: int, world_size: int, args: argparse.Namespace, data: tuple,
               repeat: int) -> dict:
    """Trains one model with ``method``: the job's throughput, the test accuracy of the averaged model and the
    replica spread before the global averages. The delays: the same draws for every method of a repeat."""
    train_x, train_y, test_x, test_y = data
    shard = torch.arange(rank, len(train_y), world_size)
    batches, draws = torch.Generator().manual_seed(1000 * repeat + rank), torch.Generator().manual_seed(
        7919 * repeat + 104_729 * rank + 1)
    if scenario == "straggler":  # the last rank
        delays = [args.sleep_ms / 1000 if rank == world_size - 1 else 0.0] * args.steps
    else:
        slow, low, high = torch.rand(args.steps, generator=draws) < args.delay_probability, *args.delay_ms
        delays = [float(s) * (low + (high - low) * float(u)) / 1000
                  for s, u in zip(slow, torch.rand(args.steps, generator=draws))]
    model = make_model(args.model)  # the same initial weights on every rank and for every method
    trained, averager = (DistributedDataParallel(model), None) if method == "ddp" else (model, gx.GroupModelAverager(
        1 if method == "no-group" else args.group_size, args.global_period, wait_avoiding=method != "group-sync"))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    before_global = []  # this rank's weights just before each global average
    dist.barrier()
    start = time.perf_counter()
    for step in range(args.steps):
        time.sleep(delays[step])
        index = shard[torch.randint(0, len(shard), (args.batch_size,), generator=batches)]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(trained(train_x[index]), train_y[index]).backward()
        optimizer.step()
        if averager is not None:
            if averager.is_global_step(step):
                before_global.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            averager.average_parameters(model.parameters())
    if averager is not None:
        averager.finish(model.parameters())
    elapsed, spread = slowest(time.perf_counter() - start), None
    if before_global:
        mine = torch.stack(before_global)
        every = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(every, mine)
        weights = torch.stack(every)  # [rank, global step, element]
        spread = float((weights - weights.mean(0)).square().mean((0, 2)).sqrt().mean())
    # the consensus (global average) model; DDP's replicas are equal already
    accuracy = evaluate(load_consensus(model, model), test_x, test_y)[0]
    return {"steps_per_s": args.steps / float(elapsed), "accuracy": accuracy, "spread": spread}


def run_worker(args: argparse.Namespace, rank: int, world_size: int, config: dict) -> dict:
    """One rank: every method, interleaved, starting elsewhere each repeat."""
    data = load_digits_split()
    runs = {scenario: {method: [] for method in args.methods} for scenario in args.scenarios}
    for repeat in range(args.repeats):
        for scenario in args.scenarios:
            shift = repeat % len(args.methods)
            for method in args.methods[shift:] + args.methods[:shift]:
                runs[scenario][method].append(run_method(method, scenario, rank, world_size, args, data, repeat))
    return runs


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """One scenario's runs -> a row per method: medians, throughput relative to DDP and to synchronous group
    averaging, spread relative to no-group."""
    def median(results: list[dict], key: str) -> float | None:
        values = [r[key] for r in results if r[key] is not None]
        return statistics.median(values) if values else None

    rates = {method: median(results, "steps_per_s") for method, results in runs.items()}
    reference = median(runs["no-group"], "spread") if "no-group" in runs else None
    return [{"method": method, "steps_per_s": rates[method],
             "steps_per_s_min": min(r["steps_per_s"] for r in results),
             "steps_per_s_max": max(r["steps_per_s"] for r in results),
             "speedup_vs_ddp": rates[method] / rates["ddp"] if "ddp" in rates else None,
             "time_vs_group_sync": rates["group-sync"] / rates[method] if "group-sync" in rates else None,
             "accuracy": median(results, "accuracy"), "spread": median(results, "spread"),
             "spread_vs_no_group": median(results, "spread") / reference
             if median(results, "spread") and reference else None} for method, results in runs.items()]


def plot(tables: dict[str, list[dict]], path: str, title: str) -> None:
    """Throughput and accuracy per method, one group of bars per scenario."""
    fig, (axes,) = report.figure(1, 2, (10, 3.8))
    scenarios, methods = list(tables), [row["method"] for row in next(iter(tables.values()))]
    width = 0.8 / len(methods)
    for index, method in enumerate(methods):
        rows = [tables[s][index] for s in scenarios]  # every scenario's rows in the order of the methods
        positions = [i + (index - (len(methods) - 1) / 2) * width for i in range(len(scenarios))]
        axes[0].bar(positions, [r["steps_per_s"] for r in rows], width, label=method, capsize=2,
                    yerr=[[r["steps_per_s"] - r["steps_per_s_min"] for r in rows],
                          [r["steps_per_s_max"] - r["steps_per_s"] for r in rows]])
        axes[1].bar(positions, [r["accuracy"] for r in rows], width, label=method)
    for axis, label in zip(axes, ("steps/s (median, min-max)", "test accuracy of the averaged model")):
        axis.set(xticks=range(len(scenarios)), xticklabels=[f"{s} delays" for s in scenarios], ylabel=label)
    axes[1].set_ylim(0.8, 1.0)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    report.save(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__, world_size=4, steps=200, batch_size=32, model="mlp", lr=0.05, momentum=0.9,
                        json=None, plot=None)
    parser.add_argument("--group-size", type=int, default=2, help="ranks per group average")
    parser.add_argument("--global-period", type=int, default=20, help="steps between two global averages")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS), help="delays")
    parser.add_argument("--delay-probability", type=float, default=0.2,
                        help="random: the chance that a rank's step is slow")
    parser.add_argument("--delay-ms", type=float, nargs=2, default=(100.0, 300.0), metavar=("LOW", "HIGH"),
                        help="random: a slow step's extra time, uniform in [LOW, HIGH]")
    parser.add_argument("--sleep-ms", type=float, default=40.0, help="straggler: the last rank's extra time per step")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of every method (medians)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    cli.add_network_args(parser, prefix="gxwagma")
    args = parser.parse_args(argv)
    cli.check(parser, args, positive=("world_size", "steps", "batch_size", "group_size", "global_period", "repeats"))
    if args.world_size % args.group_size:
        parser.error(f"--group-size {args.group_size} must divide --world-size {args.world_size}")
    if not 0 <= args.delay_probability <= 1 or not 0 <= args.delay_ms[0] <= args.delay_ms[1]:
        parser.error("--delay-probability must be in [0, 1] and --delay-ms LOW HIGH with 0 <= LOW <= HIGH")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if cli.ran_as_worker(args, run_worker):
        return
    rate = cli.link_rate("wagma", args)
    runs = run_group("bench.wagma", args.world_size, args, args.timeout, rate_bps=rate, prefix=args.prefix)
    tables = {scenario: summarize(scenario_runs) for scenario, scenario_runs in runs.items()}
    title = (f"{args.world_size} Gloo processes on {network_name(rate)}, digits, {args.model}, batch "
             f"{args.batch_size}/rank, {args.steps} steps, group size {args.group_size}, global period "
             f"{args.global_period}, median of {args.repeats}")
    print(title)
    for scenario, rows in tables.items():
        print(f"\nrandom delays: each rank's step +{args.delay_ms[0]:g}-{args.delay_ms[1]:g} ms with probability "
              f"{args.delay_probability:g}" if scenario == "random" else
              f"\nstraggler: rank {args.world_size - 1} +{args.sleep_ms:g} ms every step")
        print(report.table(rows, [
            ("method", "", "method"), ("steps/s", ".2f", "steps_per_s"),
            ("(min-max)", "", lambda r: f"({r['steps_per_s_min']:.1f}-{r['steps_per_s_max']:.1f})"),
            ("vs DDP", ".2f", "speedup_vs_ddp"), ("time vs sync", ".2f", "time_vs_group_sync"),
            ("test acc", ".3f", "accuracy"), ("spread vs no-group", ".2f", "spread_vs_no_group")]))
    if args.json:
        report.write_json(args.json, args, runs=runs, tables=tables)
    if args.plot:
        plot(tables, args.plot, title)


if __name__ == "__main__":
    main()

"""Bytes per training step of the collectives (dense allreduce, TopK-SGD's allgather, gTop-k, Ok-Topk) on an MLP
trained with DDP on Gloo processes: through the hook (its ``stats()``), or with --exchange each collective on the
whole gradient (its ``Traffic``); --counters (as root) checks ``stats()`` against each rank's interface counter in a
network namespace. docs/collectives.md and docs/scaling.md.

    python -m bench.bytes_per_step --world-sizes 4 8 --density 0.01 --json bytes_per_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn

import gtopk_ext as gx
from bench.digits import mlp
from bench.emulated_network import TxCounter
from bench.harness import cli, report
from bench.harness.launch import run_group
from bench.harness.methods import hook_recipe, hook_state, numel_of
from bench.harness.train import Trainer
from gtopk_ext.collectives import OkTopkState, Traffic, ring_allreduce_bytes

COLLECTIVES = ("dense", "allgather", "gtopk", "oktopk")
WARMUP = 2  # the hook's dense iterations (start_iter)


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(32, 784, generator=generator), torch.randint(0, 10, (32,), generator=generator)


def runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(collective, wire) of every measurement: each sparse collective with each wire, dense once (plain)."""
    return [(c, w) for c in COLLECTIVES for w in (("plain",) if c == "dense" else args.wire)]


def measure(args: argparse.Namespace, rank: int, world_size: int, counter: TxCounter) -> dict:
    """Per (collective, wire), through the hook: ``stats()``'s bytes per compressed step (median) and over all of
    them, and what ``counter``'s interface sent over those steps (0 where it counts none)."""
    results = {}
    for collective, wire in runs(args):
        recipe = hook_recipe(collective, lambda _: hook_state(args.density, collective=collective, wire=wire,
                                                              start_iter=WARMUP))
        trainer = Trainer(recipe, mlp(args.hidden, inputs=784), argparse.Namespace(lr=0.01, momentum=0.0), world_size)
        generator, measured, received = torch.Generator().manual_seed(rank), [], []
        for _ in range(WARMUP + args.steps):
            x, y = batch(generator)
            measured.append(trainer.measured_step(lambda model: nn.functional.cross_entropy(model(x), y), counter))
            received.append(trainer.accounting.state.stats()["total"]["bytes_received"])
        measured, stats = measured[WARMUP:], trainer.accounting.state.stats()
        results[collective, wire] = {
            "parameters": numel_of(trainer.model), "buckets": len(stats["buckets"]), "k": stats["total"]["k"],
            "bytes_sent": statistics.median(m["bytes"] for m in measured),
            "bytes_received": statistics.median(received[WARMUP:]),
            "seconds": statistics.median(m["seconds"] for m in measured),
            "stats_bytes_steps": sum(m["bytes"] for m in measured),
            "interface_bytes_steps": sum(m["tx_bytes"] for m in measured)}
    return results


def measure_exchanges(args: argparse.Namespace, rank: int, world_size: int) -> dict:
    """Per (collective, wire): its ``Traffic`` on the whole flattened gradient of every step (Gaussian-k, its own
    residual; Ok-Topk with one OkTopkState), the median and the mean (Ok-Topk's re-estimations, every 32 steps); the
    model follows the dense average."""
    model = mlp(args.hidden, inputs=784)
    numel, optimizer = numel_of(model), torch.optim.SGD(model.parameters(), lr=0.01)
    compressor, measured = gx.make_compressor("gaussiank", args.density), runs(args)
    residuals, states = {run: torch.zeros(numel) for run in measured}, {run: OkTopkState() for run in measured}
    generator, sent = torch.Generator().manual_seed(rank), {run: [] for run in measured}
    for _ in range(args.steps):
        x, y = batch(generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        for (collective, wire), residual in residuals.items():
            if collective == "dense":
                sent[collective, wire].append(ring_allreduce_bytes(4 * numel, world_size))
                continue
            traffic = Traffic()
            gx.reduction.reduce(grad, residual, compressor.compress(grad, residual),
                                gx.collectives.collective_named(collective), dist.group.WORLD,
                                k=compressor.k_for(numel), wire=gx.wire.wire_named(wire), backend=None,
                                traffic=traffic, state=states[collective, wire], out=torch.empty_like(grad))
            sent[collective, wire].append(traffic.sent)
        dist.all_reduce(grad)
        torch.nn.utils.vector_to_parameters(grad.div_(world_size), [p.grad for p in model.parameters()])
        optimizer.step()
    return {run: {"parameters": numel, "buckets": 1, "k": numel if run[0] == "dense" else compressor.k_for(numel),
                  "bytes_sent": statistics.median(sent[run]), "bytes_sent_mean": statistics.mean(sent[run]),
                  "bytes_received": None, "seconds": None} for run in measured}


def run_worker(args: argparse.Namespace, rank: int, world_size: int, config: dict) -> list:
    """One rank: every rank's measurements, as [collective, wire, [each rank's result]] lists."""
    results = (measure_exchanges(args, rank, world_size) if args.exchange
               else measure(args, rank, world_size, TxCounter(config["ifname"])))
    every = [None] * world_size
    dist.all_gather_object(every, results)
    return [[*run, [ranks[run] for ranks in every]] for run in results]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__, json=None)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8], help="one group of each")
    parser.add_argument("--density", type=float, default=0.01, help="the sparse collectives'")
    parser.add_argument("--steps", type=int, default=3, help="compressed steps measured (median)")
    parser.add_argument("--hidden", type=int, nargs=2, default=[1024, 256], metavar=("H1", "H2"),
                        help="the MLP's hidden widths (2048 768: 3.2M parameters)")
    parser.add_argument("--exchange", action="store_true",
                        help="measure the collectives on the whole gradient instead of through the hook")
    parser.add_argument("--wire", nargs="+", default=["plain"], choices=["plain", "compact"],
                        help="the sparse collectives' wire formats to measure")
    parser.add_argument("--counters", action="store_true",
                        help="as root: ranks in network namespaces, stats() checked against the interfaces' tx_bytes")
    parser.add_argument("--prefix", default="gxbytes", help="name prefix of the namespaces --counters creates")
    cli.add_worker_arg(parser)
    args = parser.parse_args(argv)
    cli.check(parser, args, positive=("steps",), unit=("density",))
    if args.counters and args.exchange:
        parser.error("--counters measures the hook; leave out --exchange")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if cli.ran_as_worker(args, run_worker):
        return
    if args.counters:
        cli.require_emulation("bytes_per_step --counters")
    rows = []
    for world_size in args.world_sizes:  # with --counters, each rank in its own namespace (an unshaped link each)
        for collective, wire, ranks in run_group("bench.bytes_per_step", world_size, args, 1800.0,
                                                 namespaces=args.counters, prefix=args.prefix):
            def mean(key: str) -> float:
                return statistics.mean(r[key] for r in ranks)

            rows.append({"world_size": world_size, "collective": collective, "wire": wire, "density": args.density,
                         "level": "exchange" if args.exchange else "hook", "parameters": ranks[0]["parameters"],
                         "buckets": ranks[0]["buckets"], "k": ranks[0]["k"], "sent_mean": mean("bytes_sent"),
                         "sent_max": max(r["bytes_sent"] for r in ranks),
                         "sent_mean_all_steps": statistics.mean(r.get("bytes_sent_mean", r["bytes_sent"])
                                                                for r in ranks),
                         "received_max": None if args.exchange else max(r["bytes_received"] for r in ranks),
                         "seconds_median": None if args.exchange else statistics.median(r["seconds"] for r in ranks),
                         "interface_over_stats": statistics.mean(r["interface_bytes_steps"] / r["stats_bytes_steps"]
                                                                 for r in ranks) if args.counters else None,
                         "interface_per_step_mean": mean("interface_bytes_steps") / args.steps
                         if args.counters else None})

    def ratio(row: dict, name: str, wire: str) -> float | None:  # row's bytes over those of a method of its P
        other = next((r for r in rows if (r["world_size"], r["collective"], r["wire"]) == (row["world_size"], name,
                                                                                             wire)), None)
        return other and row["sent_mean"] / other["sent_mean"]

    print(report.table(rows, [
        ("P", "3d", "world_size"), ("collective", ">10", "collective"), ("wire", ">7", "wire"),
        ("params", "d", "parameters"), ("k", "d", "k"), ("sent/rank mean", ".0f", "sent_mean"),
        ("sent max", ".0f", "sent_max"), ("recv max", ".0f", "received_max"),
        ("all steps", ".0f", "sent_mean_all_steps"), ("vs dense", ".4f", lambda r: ratio(r, "dense", "plain")),
        ("vs gtopk", ".4f", lambda r: ratio(r, "gtopk", r["wire"])),
        ("vs plain", ".4f", lambda r: ratio(r, r["collective"], "plain")), ("s/step", ".3f", "seconds_median"),
        *([("iface/step", ".0f", "interface_per_step_mean"), ("iface/stats", ".4f", "interface_over_stats")]
          if args.counters else [])]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

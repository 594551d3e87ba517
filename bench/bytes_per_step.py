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

from bench.digits import mlp
from bench.emulated_network import TxCounter
from bench.harness import cli, report
from bench.harness.launch import run_group
from bench.harness.methods import Recipe, attached, hook_state, numel_of
from bench.harness.train import Trainer
from gtopk_ext.ddp import COLLECTIVES as HOOK_COLLECTIVES

COLLECTIVES = ("dense", "allgather", "gtopk", "oktopk")
WARMUP = 2  # the hook's dense iterations (start_iter)


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(32, 784, generator=generator), torch.randint(0, 10, (32,), generator=generator)


def runs(collectives: tuple[str, ...], wires: tuple[str, ...]) -> list[tuple[str, str]]:
    """(collective, wire) pairs to measure: every sparse collective with every wire, dense once (plain)."""
    return [(c, w) for c in collectives for w in (("plain",) if c == "dense" else wires)]


def measure(rank: int, world_size: int, density: float, steps: int, hidden: tuple[int, int],
            collectives: tuple[str, ...], wires: tuple[str, ...], counter: TxCounter) -> dict:
    """Per (collective, wire): bytes from ``stats()`` per compressed step (median) and over all of them, and the
    bytes the interface of ``counter`` sent over those steps (0 where it counts none)."""
    results = {}
    for collective, wire in runs(collectives, wires):
        recipe = Recipe(collective, lambda ddp, world_size, args: attached(ddp, hook_state(
            density, collective=collective, wire=wire, start_iter=WARMUP)))
        trainer = Trainer(recipe, mlp(list(hidden), inputs=784), argparse.Namespace(lr=0.01, momentum=0.0), world_size)
        generator = torch.Generator().manual_seed(rank)
        measured, received = [], []
        for step in range(WARMUP + steps):
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


def measure_exchanges(rank: int, world_size: int, density: float, steps: int, hidden: tuple[int, int],
                      collectives: tuple[str, ...], wires: tuple[str, ...]) -> dict:
    """Bytes of each collective on the model's whole flattened gradient, step by step (see the module doc)."""
    import gtopk_ext as gx
    from gtopk_ext.collectives import OkTopkState, Traffic, ring_allreduce_bytes

    model = mlp(list(hidden), inputs=784)
    parameters = list(model.parameters())
    numel = sum(p.numel() for p in parameters)
    optimizer = torch.optim.SGD(parameters, lr=0.01)
    compressor = gx.make_compressor("gaussiank", density)
    measured = runs(collectives, wires)
    residuals = {run: torch.zeros(numel) for run in measured if run[0] != "dense"}
    oktopk_states = {run: OkTopkState() for run in measured}
    generator = torch.Generator().manual_seed(rank)
    sent: dict[tuple[str, str], list[int]] = {run: [] for run in measured}
    for _ in range(steps):
        x, y = batch(generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in parameters])
        for run in measured:
            collective, wire = run
            if collective == "dense":
                sent[run].append(ring_allreduce_bytes(4 * numel, world_size))
                continue
            traffic, residual = Traffic(), residuals[run]
            collective_now = gx.collectives.collective_named(collective)
            gx.reduction.reduce(grad, residual, lambda: compressor.compress(grad, residual), collective_now,
                                dist.group.WORLD, k=compressor.k_for(numel), wire=gx.wire.wire_named(wire),
                                backend=None, traffic=traffic, state=oktopk_states[run], out=torch.empty_like(grad))
            sent[run].append(traffic.sent)
        dist.all_reduce(grad)  # the model follows the dense average, the same for every collective
        offset = 0
        for p in parameters:
            p.grad.copy_(grad[offset:offset + p.numel()].view_as(p).div_(world_size))
            offset += p.numel()
        optimizer.step()
    return {run: {"parameters": numel, "buckets": 1, "k": numel if run[0] == "dense" else compressor.k_for(numel),
                  "bytes_sent": statistics.median(sent[run]), "bytes_sent_mean": statistics.mean(sent[run]),
                  "bytes_received": None, "seconds": None} for run in measured}


def run_worker(args: argparse.Namespace, rank: int, world_size: int, config: dict) -> list:
    """One rank: every rank's measurements (``measure`` with the interface's counter in a namespace, or
    ``measure_exchanges``), as [collective, wire, result] lists."""
    options = (rank, world_size, args.density, args.steps, tuple(args.hidden), tuple(config["collectives"]),
               tuple(args.wire))
    if args.exchange:
        results = measure_exchanges(*options)
    else:
        results = measure(*options, counter=TxCounter(config["ifname"]))
    every = [None] * world_size
    dist.all_gather_object(every, [[*key, value] for key, value in results.items()])
    return every


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--density", type=float, default=0.01)
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
    parser.add_argument("--json", help="write the rows here")
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
    # the hook: the collectives it offers
    collectives = COLLECTIVES if args.exchange else tuple(c for c in COLLECTIVES if c in HOOK_COLLECTIVES)
    rows = []
    for world_size in args.world_sizes:
        # with --counters, each rank in its own namespace (one unshaped link each)
        per_rank = [{(collective, wire): value for collective, wire, value in ranks}
                    for ranks in run_group("bench.bytes_per_step", world_size, args, 1800.0, namespaces=args.counters,
                                           prefix=args.prefix, collectives=list(collectives))]
        for collective, wire in runs(collectives, tuple(args.wire)):
            ranks = [r[collective, wire] for r in per_rank]
            rows.append({"world_size": world_size, "collective": collective, "wire": wire, "density": args.density,
                         "level": "exchange" if args.exchange else "hook",
                         "parameters": ranks[0]["parameters"], "buckets": ranks[0]["buckets"], "k": ranks[0]["k"],
                         "sent_mean": statistics.mean(r["bytes_sent"] for r in ranks),
                         "sent_max": max(r["bytes_sent"] for r in ranks),
                         "sent_mean_all_steps": statistics.mean(r.get("bytes_sent_mean", r["bytes_sent"])
                                                                for r in ranks),
                         "received_max": None if args.exchange else max(r["bytes_received"] for r in ranks),
                         "seconds_median": None if args.exchange else statistics.median(r["seconds"] for r in ranks),
                         "interface_over_stats": statistics.mean(r["interface_bytes_steps"] / r["stats_bytes_steps"]
                                                                 for r in ranks) if args.counters else None,
                         "interface_per_step_mean": statistics.mean(r["interface_bytes_steps"] for r in ranks)
                         / args.steps if args.counters else None})

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
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Scaling on an emulated network: dense allreduce, TopK-SGD's allgather, gTop-k and Ok-Topk (plain and compact
wire) over links limited with ``tc tbf``, each rank in its own network namespace, with the bytes each rank put on its
link; with --local-size L, nodes of L ranks and the hierarchical collective. Time per exchange, bytes and selection
time feed bench/cost_model.py. Needs root, ``ip`` and ``tc`` (else exit status 2). docs/scaling.md.

    python -m bench.netem_scaling --loopback --sizes 100000 --world-sizes 2   # no namespaces, no shaping
    python -m bench.netem_scaling --cleanup                          # what killed runs left behind
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import gtopk_ext as gx
from bench.cost_model import METHODS, WIRES, bytes_per_rank, features
from bench.emulated_network import TxCounter, cleanup_stale, rate_name
from bench.harness import cli, report
from bench.harness.launch import run_group
from bench.harness.train import barrier_bytes, gathered, slowest
from gtopk_ext.costs import parse_rate


def run_worker(args: argparse.Namespace, rank: int, world_size: int, config: dict) -> list[dict]:
    """One rank: every configuration, each on the same gradient; on a link, as many repetitions as fill
    ``--seconds-per-config`` of predicted wire time (1 to ``--repeats``), none past ``--max-wire-seconds``."""
    counter, rate = TxCounter(config["ifname"]), config["link_rate"]
    one_barrier = barrier_bytes(counter)  # each measurement is bracketed by barriers: not the exchange's traffic

    def measure(exchange, repeats: int) -> dict:
        dist.barrier()
        times, start_bytes = [], counter.read()
        for _ in range(repeats):
            dist.barrier()
            start_time = time.perf_counter()
            exchange()
            times.append(time.perf_counter() - start_time)
        dist.barrier()
        sent_per_rank = gathered((counter.read() - start_bytes - (repeats + 1) * one_barrier) / repeats)
        times = slowest(times).tolist()
        return {"time_s": statistics.median(times), "times_s": times,
                "tx_bytes": statistics.mean(sent_per_rank) if counter.path else None,
                "tx_bytes_per_rank": sent_per_rank if counter.path else None}

    # Warm-up: every exchange once, the collectives' header checks on (hierarchical: also makes the node groups).
    warm = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    for method, _, wire, _ in configurations(args, world_size):
        exchange_for(method, warm, gx.make_compressor("gaussiank", density=0.01), wire, None, args.local_size, True)()
    node_group = gx.hierarchical.node_groups(dist.group.WORLD, args.local_size)[0] if args.local_size > 1 else None
    rows = []
    for numel in args.sizes:
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + 1))
        compressors = {density: gx.make_compressor("gaussiank", density=density) for density in args.densities}
        select_s = {}
        for density, compressor in compressors.items():
            for turn in range(world_size):  # one rank at a time: the selection time of an idle machine
                dist.barrier()
                if turn == rank:
                    start_time = time.perf_counter()
                    compressor.compress(grad)
                    elapsed = time.perf_counter() - start_time
            select_s[density] = statistics.median(gathered(elapsed))
        for method, density, wire, group_size in configurations(args, world_size):
            k, local = numel if density is None else compressors[density].k_for(numel), min(args.local_size, group_size)
            model_bytes = (bytes_per_rank(method, numel, k, group_size, wire) if local == 1
                           else features(method, numel, k, group_size, 1.0, wire, local).get("beta", 0.0))
            predicted = None if rate is None else model_bytes * 8 / rate
            skip = (f"predicted {predicted:.0f} s per exchange > --max-wire-seconds {args.max_wire_seconds:g}"
                    if predicted is not None and predicted > args.max_wire_seconds else None)
            repeats = (0 if skip else args.repeats if predicted is None
                       else max(1, min(args.repeats, int(args.seconds_per_config / max(predicted, 1e-9)))))
            row = {"method": method, "wire": wire, "local_size": local, "numel": numel, "density": density, "k": k,
                   "world_size": group_size, "rate_bps": rate, "rate": rate_name(rate), "repeats": repeats,
                   "model_bytes": model_bytes, "predicted_wire_s": predicted, "select_s": select_s.get(density),
                   "cores": os.cpu_count(), "skipped": skip}
            if skip is None:
                row.update(measure(exchange_for(method, grad, compressors.get(density), wire,
                                                node_group if group_size < world_size else None, args.local_size),
                                   repeats))
            rows.append(row)
            if rank == 0:
                print(report.table([row], COLUMNS, header=False), flush=True)
        del grad
    return rows


def configurations(args: argparse.Namespace, world_size: int) -> list[tuple[str, float | None, str, int]]:
    """(method, density, wire, ranks it runs on) of every exchange on one group: dense (and inside a node when there
    are nodes), the sparse methods per density and wire, hierarchical (with nodes; plain wire) per density."""
    local, out = args.local_size, []
    for method in args.methods:
        if method == "dense":
            out += [("dense", None, "plain", size) for size in dict.fromkeys((world_size, local)) if size > 1]
        elif method == "hierarchical":
            out += [("hierarchical", density, "plain", world_size) for density in args.densities if local > 1]
        else:
            out += [(method, density, wire, world_size) for density in args.densities for wire in args.wires]
    return out


def exchange_for(method: str, grad, compressor, wire: str, node_group, local: int, check: bool = False):
    """One call of the collective on ``compressor``'s message of ``grad``, its header agreement off (as the hook runs
    it once agreed); Ok-Topk primed by a call, so a steady step is timed; ``node_group``: dense inside the node.
    Hierarchical selects inside the call (on its shard)."""
    if method == "dense":
        return lambda: dist.all_reduce(grad, group=node_group)
    msg = compressor.compress(grad)
    if method == "hierarchical":
        return lambda: gx.hierarchical.hierarchical_allreduce(grad, None, compressor, msg.k, local)
    if method == "oktopk":
        state = gx.collectives.OkTopkState()
        gx.collectives.oktopk_allreduce(msg, state=state, check=check, wire=wire)
        return lambda: gx.collectives.oktopk_allreduce(msg, state=state, check=check, wire=wire)
    function = gx.collectives.sparse_allgather if method == "allgather" else gx.collectives.gtopk_allreduce
    return lambda: function(msg, check=check, wire=wire)


COLUMNS = [("P", "2d", "world_size"), ("L", "2d", "local_size"), ("rate", ">8", "rate"), ("method", ">12", "method"),
           ("wire", ">7", "wire"), ("n", "10d", "numel"), ("density", "7g", "density"), ("k", "9d", "k"),
           ("reps", "4d", "repeats"), ("ms/exch", "9.1f", lambda r: r.get("time_s") and 1e3 * r["time_s"]),
           ("MB sent", "9.3f", lambda r: r.get("tx_bytes") and r["tx_bytes"] / 1e6),
           ("MB model", "9.3f", lambda r: r["model_bytes"] / 1e6),
           ("sent/model", "10.3f",
            lambda r: r.get("tx_bytes") and r["model_bytes"] and r["tx_bytes"] / r["model_bytes"]),
           ("select ms", "9.1f", lambda r: r["select_s"] and 1e3 * r["select_s"]), ("skipped", "", "skipped")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__, densities=[0.001, 0.01], json=None)
    parser.add_argument("--sizes", type=lambda s: int(float(s)), nargs="+", default=[1_000_000, 25_000_000,
                                                                                     100_000_000])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rates", type=parse_rate, nargs="+", default=[parse_rate("1gbit"), parse_rate("100mbit")],
                        help="link rates (tbf), e.g. 1gbit 100mbit")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="hierarchical runs only with --local-size above 1")
    parser.add_argument("--wires", nargs="+", choices=WIRES, default=["plain", "compact"],
                        help="the sparse collectives' wire formats (hierarchical: plain only); the scaling page's "
                             "runs measured plain and compact")
    parser.add_argument("--local-size", type=int, default=1,
                        help="ranks per emulated node (a namespace each, unshaped inside); 1: a link per rank")
    parser.add_argument("--repeats", type=int, default=5, help="most repetitions of one exchange")
    parser.add_argument("--seconds-per-config", type=float, default=2.0,
                        help="repetitions fill this much predicted wire time (at least 1, at most --repeats)")
    parser.add_argument("--max-wire-seconds", type=float, default=6.0,
                        help="skip exchanges whose predicted wire time is longer")
    parser.add_argument("--group-timeout", type=float, default=900.0, help="seconds one process group may take")
    parser.add_argument("--loopback", action="store_true",
                        help="no namespaces and no shaping: plain processes on 127.0.0.1 (bytes not counted)")
    parser.add_argument("--prefix", default="gxnet", help="name prefix of the namespaces this run creates")
    parser.add_argument("--cleanup", action="store_true",
                        help="only delete namespaces left by killed runs (this prefix, process gone), then exit")
    cli.add_worker_arg(parser)
    args = parser.parse_args(argv)
    cli.check(parser, args, positive=("repeats",), unit=("densities",))
    problems = [f"--world-sizes must be >= 2 and multiples of --local-size {args.local_size}, got {p}"
                for p in args.world_sizes if p < 2 or args.local_size < 1 or p % args.local_size]
    problems += [f"--sizes must be in [1, 2^31 - 1], got {n}" for n in args.sizes if not 0 < n < 2**31]
    if problems:
        parser.error("; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if cli.ran_as_worker(args, run_worker, "group_timeout"):
        return 0
    if args.cleanup or not args.loopback:
        cli.require_emulation("netem_scaling")
    if args.cleanup:
        removed = cleanup_stale(args.prefix)
        print(f"removed {len(removed)} namespace(s): {' '.join(removed) or '-'}")
        return 0
    rows: list[dict] = []
    started = time.perf_counter()
    print(report.table([], COLUMNS), flush=True)
    for world_size in args.world_sizes:
        for rate_bps in [None] if args.loopback else args.rates:
            rows += run_group("bench.netem_scaling", world_size, args, args.group_timeout, rate_bps=rate_bps,
                              prefix=args.prefix, ranks_per_host=args.local_size, link_rate=rate_bps)
    elapsed = time.perf_counter() - started
    skipped = [row for row in rows if row["skipped"]]
    print(f"\n{len(rows) - len(skipped)} exchanges measured, {len(skipped)} skipped, in {elapsed:.0f} s")
    if args.json:
        report.write_json(args.json, args, network="loopback (no shaping)" if args.loopback else
                          "one namespace per rank, veth to a bridge, tbf on both ends of every link",
                          elapsed_s=elapsed, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

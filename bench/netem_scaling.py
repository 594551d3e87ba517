"""Scaling on an emulated network: dense allreduce, TopK-SGD's sparse allgather, gTop-k and Ok-Topk (plain and
compact wire) over links limited with ``tc tbf``, with the bytes each rank actually put on its link; and on two
levels, the hierarchical collective against them.

Every rank runs in its own network namespace with one veth link to a bridge in a namespace of its own, all of
them created by this script (names ``<prefix><pid>-...``, addresses 10.77.0.0/24 that exist only inside them).
Both ends of every link are limited with ``tc tbf`` to the rate under test, so a link behaves as a full-duplex
Ethernet port of that rate. Gloo binds to the namespace's interface; bytes sent per rank come from the
interface's ``tx_bytes`` counter (TCP/IP headers and ACKs included), next to the model's payload bytes.

``--local-size L`` groups L consecutive ranks into a node instead: one namespace per node, its ranks talking over
the namespace's loopback (unshaped), the node's one link limited; every method then runs on the whole group, and
two more: ``hierarchical`` (gtopk_ext.hierarchical.hierarchical_allreduce, gTop-k between nodes, plain wire; its
time includes its selection on the shard) and a dense allreduce inside the node (rows with world_size L), which
pins the intra-node costs; bytes are then counted per node link.

For each world size P, rate, gradient size n, density and wire: time per exchange (the slowest rank's, median over
repetitions), bytes sent per rank, and each rank's Gaussian-k selection time (ranks select one at a time, so the
2-core machine's contention does not inflate it). Exchanges whose predicted wire time exceeds
``--max-wire-seconds`` are skipped and listed (by default: dense 100M and 25M on 100 Mbit/s).
Needs root, ``ip`` and ``tc`` with tbf; without them it says so and exits with status 2. Everything it creates
is removed on exit, on failure and on SIGINT/SIGTERM; ``--cleanup`` removes what a killed run left behind.

    python -m bench.netem_scaling --json bench_netem.json          # full run, both wires: 3 sizes, P = 2, 4, 8
    python -m bench.netem_scaling --sizes 1e6 25e6 --world-sizes 2 4 6 8 --json w.json   # 12 minutes on 2 cores
    python -m bench.netem_scaling --loopback --sizes 100000 --world-sizes 2   # no namespaces, no shaping
    python -m bench.netem_scaling --local-size 2 --world-sizes 4 --sizes 4e6 --wires plain
    python -m bench.netem_scaling --cleanup
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.emulated_network import TxCounter, check_can_emulate, cleanup_stale, parse_rate, rate_name
from bench.harness import cli, report
from bench.harness.launch import run_group
from bench.harness.traffic import METHODS, WIRES, bytes_per_rank, features


@dataclass(frozen=True)
class Plan:
    """What one exchange configuration does: skipped (with why) or repeated ``repeats`` times."""

    predicted_s: float | None
    repeats: int
    skip: str | None


def plan_exchange(model_bytes: float, rate_bps: int | None, args: argparse.Namespace) -> Plan:
    """The same on every rank: a pure function of the configuration. Repetitions fill ``--seconds-per-config``
    of predicted wire time, between 1 and ``--repeats``."""
    if rate_bps is None:
        return Plan(None, args.repeats, None)
    predicted = model_bytes * 8 / rate_bps
    if predicted > args.max_wire_seconds:
        return Plan(predicted, 0, f"predicted {predicted:.0f} s per exchange > --max-wire-seconds "
                                  f"{args.max_wire_seconds:g}")
    return Plan(predicted, max(1, min(args.repeats, int(args.seconds_per_config / max(predicted, 1e-9)))), None)


# ----------------------------------------------------------------------------------------------- worker side

def run_worker(args: argparse.Namespace, rank: int, world_size: int, config: dict) -> list[dict]:
    """One rank: measures every configuration."""
    import torch
    import torch.distributed as dist

    import gtopk_ext as gx
    from bench.harness.train import barrier_bytes, gathered, slowest

    rate_bps = config["link_rate"]
    counter = TxCounter(config["ifname"])
    one_barrier = barrier_bytes(counter)  # each measurement is bracketed by barriers: not the exchange's traffic

    def measure(exchange, repeats: int) -> dict:
        times = []
        dist.barrier()
        start_bytes = counter.read()
        for _ in range(repeats):
            dist.barrier()
            start_time = time.perf_counter()
            exchange()
            times.append(time.perf_counter() - start_time)
        dist.barrier()
        sent = (counter.read() - start_bytes - (repeats + 1) * one_barrier) / repeats
        slowest_times = slowest(times).tolist()
        sent_per_rank = gathered(sent)
        return {"time_s": statistics.median(slowest_times), "times_s": slowest_times,
                "tx_bytes": statistics.mean(sent_per_rank) if config["ifname"] else None,
                "tx_bytes_per_rank": sent_per_rank if config["ifname"] else None}

    # Warm-up: every collective once on a small message on each wire, with the collectives' header checks on
    # (hierarchical: also creates the node groups).
    local = args.local_size
    warm = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    warm_compressor = gx.make_compressor("gaussiank", density=0.01)
    warm_msg = warm_compressor.compress(warm)
    dist.all_reduce(warm.clone())
    for wire in args.wires:
        gx.collectives.sparse_allgather(warm_msg, wire=wire)
        gx.collectives.gtopk_allreduce(warm_msg, wire=wire)
        gx.collectives.oktopk_allreduce(warm_msg, wire=wire)
    node_group = None
    if local > 1:
        gx.hierarchical.hierarchical_allreduce(warm, None, warm_compressor, warm_msg.k, local)
        node_group = gx.hierarchical.node_groups(dist.group.WORLD, local)[0]

    rows = []
    for numel in args.sizes:
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + 1))
        messages, select_s = {}, {}
        for density in args.densities:
            compressor = gx.make_compressor("gaussiank", density=density)
            for turn in range(world_size):  # one rank at a time: the selection time of an idle machine
                dist.barrier()
                if turn == rank:
                    start_time = time.perf_counter()
                    messages[density] = compressor.compress(grad)
                    elapsed = time.perf_counter() - start_time
            select_s[density] = gathered(elapsed)
        for method, density, wire, group_size in configurations(args, world_size):
            k = numel if density is None else messages[density].k
            model_bytes = link_bytes(method, numel, k, group_size, wire, local)
            plan = plan_exchange(model_bytes, rate_bps, args)
            row = {"method": method, "wire": wire, "local_size": min(local, group_size), "numel": numel,
                   "density": density, "k": k, "world_size": group_size, "rate_bps": rate_bps,
                   "rate": rate_name(rate_bps), "repeats": plan.repeats, "model_bytes": model_bytes,
                   "predicted_wire_s": plan.predicted_s,
                   "select_s": None if density is None else statistics.median(select_s[density]),
                   "cores": os.cpu_count(), "skipped": plan.skip}
            if plan.skip is None:
                exchange = exchange_for(method, grad, messages.get(density), density, wire,
                                        node_group if group_size < world_size else None, local)
                row.update(measure(exchange, plan.repeats))
            rows.append(row)
            if rank == 0:
                print(format_row(row), flush=True)
        del grad, messages
    return rows


def configurations(args: argparse.Namespace, world_size: int) -> list[tuple[str, float | None, str, int]]:
    """(method, density, wire, ranks it runs on) of every exchange measured on one group, in order: dense once
    (and inside a node when there are nodes), the sparse methods per density and wire, hierarchical (only with
    nodes; plain wire) per density."""
    local = args.local_size
    out = []
    for method in args.methods:
        if method == "dense":
            out.append(("dense", None, "plain", world_size))
            if local > 1:
                out.append(("dense", None, "plain", local))
        elif method == "hierarchical":
            if local > 1:
                out += [("hierarchical", density, "plain", world_size) for density in args.densities]
        else:
            out += [(method, density, wire, world_size) for density in args.densities for wire in args.wires]
    return out


def link_bytes(method: str, numel: int, k: int, world_size: int, wire: str, local: int) -> float:
    """What the model puts on a link in one exchange: a rank's bytes (one rank per link), or with nodes, the bytes
    the node's link carries on the exchange's critical path (none for a dense allreduce inside the node)."""
    if local == 1:
        return bytes_per_rank(method, numel, k, world_size, wire)
    return features(method, numel, k, world_size, 1.0, wire, min(local, world_size)).get("beta", 0.0)


def exchange_for(method: str, grad, msg, density: float | None, wire: str, node_group, local: int):
    """The exchange to time: one call of the collective, with the header agreement off (as the DDP hook runs
    it after the warm-up has checked the headers). Ok-Topk's state is primed by one call first: the exchange
    timed is a steady step, which reuses the regions and the threshold. ``node_group``: a dense allreduce inside
    the node instead of the whole group. Hierarchical selects inside the call (on its shard: k over the local
    ranks)."""
    import torch.distributed as dist

    import gtopk_ext as gx
    from gtopk_ext import collectives, hierarchical

    if method == "dense":
        return lambda: dist.all_reduce(grad, group=node_group)
    if method == "allgather":
        return lambda: collectives.sparse_allgather(msg, check=False, wire=wire)
    if method == "gtopk":
        return lambda: collectives.gtopk_allreduce(msg, check=False, wire=wire)
    if method == "hierarchical":
        compressor = gx.make_compressor("gaussiank", density=density)
        return lambda: hierarchical.hierarchical_allreduce(grad, None, compressor, msg.k, local)
    state = collectives.OkTopkState()
    collectives.oktopk_allreduce(msg, state=state, check=False, wire=wire)
    return lambda: collectives.oktopk_allreduce(msg, state=state, check=False, wire=wire)


# ------------------------------------------------------------------------------------------------- the driver

HEADER = (f"{'P':>2} {'L':>2} {'rate':>8} {'method':>12} {'wire':>7} {'n':>10} {'density':>7} {'k':>9} {'reps':>4} "
          f"{'ms/exch':>9} {'MB sent':>9} {'MB model':>9} {'sent/model':>10} {'select ms':>9}")


def format_row(row: dict) -> str:
    density = "-" if row["density"] is None else f"{row['density']:g}"
    select = "-" if row["select_s"] is None else f"{row['select_s'] * 1e3:.1f}"
    start = (f"{row['world_size']:>2} {row['local_size']:>2} {row['rate']:>8} {row['method']:>12} {row['wire']:>7} "
             f"{row['numel']:>10} {density:>7} {row['k']:>9} {row['repeats']:>4} ")
    if row["skipped"]:
        return start + f"skipped: {row['skipped']}"
    sent = row["tx_bytes"]
    sent_text = "-" if sent is None else f"{sent / 1e6:.3f}"
    ratio = "-" if sent is None or not row["model_bytes"] else f"{sent / row['model_bytes']:.3f}"
    return (start + f"{row['time_s'] * 1e3:>9.1f} {sent_text:>9} {row['model_bytes'] / 1e6:>9.3f} {ratio:>10} "
            f"{select:>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=lambda s: int(float(s)), nargs="+", default=[1_000_000, 25_000_000,
                                                                                     100_000_000])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rates", type=parse_rate, nargs="+", default=[parse_rate("1gbit"), parse_rate("100mbit")],
                        help="link rates (tbf), e.g. 1gbit 100mbit")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="hierarchical runs only with --local-size above 1")
    parser.add_argument("--wires", nargs="+", choices=WIRES, default=list(WIRES),
                        help="the sparse collectives' wire formats (hierarchical: plain only)")
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
    parser.add_argument("--json", type=Path, help="write the rows here")
    cli.add_worker_arg(parser)
    args = parser.parse_args(argv)
    if cli.ran_as_worker(args, run_worker, "group_timeout"):
        return 0
    problems = [f"--world-sizes must be >= 2 and multiples of --local-size {args.local_size}, got {p}"
                for p in args.world_sizes if p < 2 or args.local_size < 1 or p % args.local_size]
    problems += [f"--densities must be in (0, 1], got {d}" for d in args.densities if not 0 < d <= 1]
    problems += [f"--sizes must be in [1, 2^31 - 1], got {n}" for n in args.sizes if not 0 < n < 2**31]
    if args.repeats < 1:
        problems.append(f"--repeats must be >= 1, got {args.repeats}")
    if problems:
        parser.error("; ".join(problems))
    if not args.loopback or args.cleanup:
        reason = check_can_emulate()
        if reason:
            print(f"netem_scaling cannot run: {reason}", file=sys.stderr)
            return 2
    if args.cleanup:
        removed = cleanup_stale(args.prefix)
        print(f"removed {len(removed)} namespace(s): {' '.join(removed) or '-'}")
        return 0

    rows: list[dict] = []
    started = time.perf_counter()
    print(HEADER, flush=True)
    for world_size in args.world_sizes:
        for rate_bps in [None] if args.loopback else args.rates:
            rows += run_group("bench.netem_scaling", world_size, args, args.group_timeout, rate_bps=rate_bps,
                              prefix=args.prefix, ranks_per_host=args.local_size, link_rate=rate_bps)
    elapsed = time.perf_counter() - started
    skipped = [row for row in rows if row["skipped"]]
    print(f"\n{len(rows) - len(skipped)} exchanges measured, {len(skipped)} skipped, in {elapsed:.0f} s")
    for row in skipped:
        print(f"  skipped: P={row['world_size']} {row['rate']} {row['method']} n={row['numel']}: {row['skipped']}")
    if args.json:
        report.write_json(args.json, args, network="loopback (no shaping)" if args.loopback else
                          "one namespace per rank, veth to a bridge, tbf on both ends of every link",
                          elapsed_s=elapsed, rows=rows)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

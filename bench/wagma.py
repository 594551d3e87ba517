"""WAGMA benchmark: throughput and test accuracy of DDP gradient allreduce, synchronous group model averaging and
wait-avoiding group model averaging, on P Gloo processes with a straggler, each rank behind an emulated link of
``--rate`` (bench/emulated_network.py: its own network namespace, tbf; needs root, else loopback) or, with
``--loopback``, on 127.0.0.1.

The task is the demo's (bench/digits.py): scikit-learn's bundled digits and its MLP (or CNN). Every rank trains on
its own shard with the same seeds for every method; a straggler sleeps ``--sleep-ms`` per step: always
``--slow-rank`` (``--straggler fixed``) or a rank drawn at random each step, the same draw on every rank
(``--straggler random``). Throughput is steps per second of the whole job (steps / the slowest rank's wall time,
group averaging's last in-flight average included); accuracy is that of the globally averaged model after the same
number of steps. Methods run interleaved, ``--repeats`` times, and the table shows medians.

    python -m bench.wagma --json wagma.json                # 1 Gbit/s links
    python -m bench.wagma --loopback --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gtopk_ext as gx  # noqa: E402
from bench.digits import MODELS, load_digits_split, make_model  # noqa: E402
from bench.emulated_network import Networks, network_name, parse_rate, run_ranks, runs_on_loopback  # noqa: E402
from gtopk_ext.utils import destroy_process_group  # noqa: E402

METHODS = ("ddp", "group-sync", "group-wait-avoiding")


def run_method(method: str, rank: int, world_size: int, args: argparse.Namespace, data: tuple,
               repeat: int) -> dict:
    """Trains one model with ``method`` for args.steps steps; returns the job's throughput and test accuracy."""
    train_x, train_y, test_x, test_y = data
    shard = torch.arange(rank, len(train_y), world_size)
    batches = torch.Generator().manual_seed(1000 * repeat + rank)
    stragglers = torch.Generator().manual_seed(repeat)  # the same draws on every rank
    model = make_model(args.model)  # the same initial weights on every rank and for every method
    averager = None
    if method == "ddp":
        trained = DistributedDataParallel(model)
    else:
        trained = model
        averager = gx.GroupModelAverager(args.group_size, args.global_period,
                                         wait_avoiding=method == "group-wait-avoiding")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        slow = (args.slow_rank if args.straggler == "fixed"
                else int(torch.randint(0, world_size, (1,), generator=stragglers)))
        if rank == slow:
            time.sleep(args.sleep_ms / 1000)
        index = shard[torch.randint(0, len(shard), (args.batch_size,), generator=batches)]
        optimizer.zero_grad()
        loss_fn(trained(train_x[index]), train_y[index]).backward()
        optimizer.step()
        if averager is not None:
            averager.average_parameters(model.parameters())
    if averager is not None:
        averager.finish(model.parameters())
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    with torch.no_grad():  # evaluate the consensus (global average) model; DDP's replicas are equal already
        for p in model.parameters():
            dist.all_reduce(p)
            p.div_(world_size)
        accuracy = float((model(test_x).argmax(1) == test_y).float().mean())
    return {"steps_per_s": args.steps / float(elapsed), "accuracy": accuracy}


def run_worker(config: dict) -> None:
    """One rank (started by emulated_network.run_ranks): every method, interleaved; rank 0 writes the runs."""
    args = argparse.Namespace(**config["args"])
    rank, world_size = config["rank"], config["world_size"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{config['master_addr']}:{config['port']}", rank=rank,
                            world_size=world_size)
    try:
        data = load_digits_split()
        runs = {method: [] for method in args.methods}
        for repeat in range(args.repeats):
            order = args.methods[repeat % len(args.methods):] + args.methods[:repeat % len(args.methods)]
            for method in order:  # interleaved, starting elsewhere each repeat, so drifts spread evenly
                runs[method].append(run_method(method, rank, world_size, args, data, repeat))
        if rank == 0:
            Path(config["out"]).write_text(json.dumps(runs))
    finally:
        destroy_process_group()


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    baseline = statistics.median(r["steps_per_s"] for r in runs["ddp"]) if "ddp" in runs else None
    for method, results in runs.items():
        rate = statistics.median(r["steps_per_s"] for r in results)
        rows.append({"method": method, "steps_per_s": rate,
                     "steps_per_s_min": min(r["steps_per_s"] for r in results),
                     "steps_per_s_max": max(r["steps_per_s"] for r in results),
                     "speedup_vs_ddp": rate / baseline if baseline else None,
                     "accuracy": statistics.median(r["accuracy"] for r in results)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--global-period", type=int, default=10)
    parser.add_argument("--straggler", choices=("fixed", "random"), default="fixed")
    parser.add_argument("--slow-rank", type=int, default=None, help="the fixed straggler (default: the last)")
    parser.add_argument("--sleep-ms", type=float, default=10.0, help="the straggler's extra time per step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    parser.add_argument("--rate", type=parse_rate, default=parse_rate("1gbit"),
                        help="every rank in its own network namespace behind a link of this rate (needs root)")
    parser.add_argument("--loopback", action="store_true", help="plain processes on 127.0.0.1, no shaping")
    parser.add_argument("--prefix", default="gxwagma", help="name prefix of the namespaces this run creates")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the whole job may take")
    parser.add_argument("--json", default=None, help="write the settings, every run and the table here")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(json.loads(args.worker.read_text()))
        return
    args.methods = args.methods.split(",")
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {METHODS}")
    if args.slow_rank is None:
        args.slow_rank = args.world_size - 1
    if not 0 <= args.slow_rank < args.world_size:
        parser.error(f"--slow-rank must be in [0, {args.world_size}), got {args.slow_rank}")
    if args.world_size % args.group_size:
        parser.error(f"--group-size {args.group_size} must divide --world-size {args.world_size}")

    args.loopback = runs_on_loopback("wagma", args.loopback)
    links = network_name(None if args.loopback else args.rate)
    networks = Networks(args.prefix)
    try:
        with tempfile.TemporaryDirectory(prefix="wagma_") as tmp:
            network = None if args.loopback else networks.create(args.world_size, args.rate)
            out = Path(tmp) / "runs.json"
            worker_args = {key: value for key, value in vars(args).items() if key != "worker"}
            run_ranks("bench.wagma", args.world_size, network, {"args": worker_args, "out": str(out)}, Path(tmp),
                      "wagma", args.timeout)
            runs = json.loads(out.read_text())
    finally:
        networks.close()
    rows = summarize(runs)
    print(f"{args.world_size} Gloo processes on {links}, digits, {args.model}, "
          f"batch {args.batch_size}/rank, {args.steps} steps, straggler {args.straggler} "
          f"(+{args.sleep_ms:g} ms/step), group size {args.group_size}, global period {args.global_period}, "
          f"median of {args.repeats}")
    print(f"{'method':<22}{'steps/s':>9}{'(min-max)':>16}{'vs DDP':>8}{'test acc':>10}")
    for row in rows:
        spread = f"({row['steps_per_s_min']:.1f}-{row['steps_per_s_max']:.1f})"
        ratio = f"{row['speedup_vs_ddp']:.2f}x" if row["speedup_vs_ddp"] else "-"
        print(f"{row['method']:<22}{row['steps_per_s']:>9.1f}{spread:>16}{ratio:>8}{row['accuracy']:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "torch": torch.__version__,
                       "machine": platform.platform(), "cpus": os.cpu_count(), "runs": runs, "table": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()

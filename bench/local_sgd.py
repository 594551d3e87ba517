"""Local SGD: SparseLocalSGD against DiLoCo (its dense case), PyTorch's local SGD, DDP and gtopk_ext's gradient
hook on the digits, one method after the other from the same weights on the same batches, each rank behind an
emulated link (as root) or on loopback: validation loss against training seconds and bytes. docs/local_sgd.md.
``diloco-equal`` is DiLoCo with the H that gives it about the bytes of the first ``sparse-`` method.

    python -m bench.local_sgd --rate 100mbit --json local_sgd_100mbit.json --plot local_sgd_100mbit.png
    python -m bench.local_sgd --loopback --steps 64 --methods ddp diloco-8 sparse-gtopk-0.01-8
"""

from __future__ import annotations

import argparse
import math

import torch

import gtopk_ext as gx
from bench.digits import load_digits_split, make_model
from bench.emulated_network import TxCounter, network_name
from bench.harness import cli, report
from bench.harness.launch import run_group
from bench.harness.methods import LocalMethod, add_outer_arguments, method, method_name, numel_of
from bench.harness.train import Trainer, evaluate, train_curve
from gtopk_ext.collectives import ring_allreduce_bytes

DEFAULT_METHODS = ("ddp", "hook-gtopk-0.01", "postlocal-16", "diloco-16", "sparse-gtopk-0.05-16", "diloco-equal",
                   "sparse-gtopk-0.01-16", "diloco-600", "sparse-allgather-0.01-16")
HEADER_BYTES = 96  # SparseLocalSGD's per-sync header (an allgather of 4 int64 on 4 ranks), in the estimate only


def sync_bytes(method: LocalMethod, numel: int, world_size: int) -> float:
    """About what one rank sends per exchange (SparseLocalSGD counts its own exactly; this sets diloco-equal)."""
    if method.kind != "sparse":
        return ring_allreduce_bytes(numel * 4, world_size)
    k = gx.compressors.k_for_density(method.density, numel)
    rounds = (world_size - 1 if method.collective == "allgather"
              else math.ceil(math.log2(world_size)) + (world_size & (world_size - 1) != 0))
    return HEADER_BYTES + rounds * gx.wire.payload_size(method.wire, k, numel, torch.float32, head_words=1)


def equal_bytes_period(sparse: LocalMethod, numel: int, world_size: int) -> int:
    dense = LocalMethod("diloco", 1)
    return max(1, round(sparse.period * sync_bytes(dense, numel, world_size) / sync_bytes(sparse, numel, world_size)))


def run_method(name: str, rank: int, world_size: int, args: argparse.Namespace, data: tuple, tx: TxCounter) -> dict:
    train_x, train_y, test_x, test_y = data
    shard = torch.arange(rank, len(train_y), world_size)
    # the same batches for every method; seed 0 draws the batches of the runs recorded before --seed
    batches = torch.Generator().manual_seed(1000 + rank + 100_003 * args.seed)
    trainer = Trainer(args.periods.get(name, name), make_model(args.model, args.seed), args, world_size)

    def loss_at(step: int):
        index = shard[torch.randint(0, len(shard), (args.batch_size,), generator=batches)]
        return lambda model: torch.nn.functional.cross_entropy(model(train_x[index]), train_y[index])

    def evaluation(model) -> dict:
        accuracy, loss = evaluate(model, test_x, test_y)
        return {"val_loss": loss, "accuracy": accuracy}

    curve, _ = train_curve(trainer, args.steps, loss_at, evaluation, args.eval_every, tx)
    return {"method": name, "label": method(args.periods.get(name, name)).label, "curve": curve}


def run_worker(args: argparse.Namespace, rank: int, world_size: int, config: dict) -> list:
    """One rank: every method in turn."""
    data = load_digits_split()
    tx = TxCounter(config["ifname"])
    runs = []
    for name in args.methods:
        runs.append(run_method(name, rank, world_size, args, data, tx))
        if rank == 0:
            final = runs[-1]["curve"][-1]
            print(f"  {runs[-1]['label']}: val loss {final['val_loss']:.4f}, {final['seconds']:.1f} s, "
                  f"{final['bytes_sent'] / 1e6:.2f} MB", flush=True)
    return runs


def summarize(runs: list[dict]) -> list[dict]:
    ddp = next((r["curve"][-1] for r in runs if r["method"] == "ddp"), None)
    rows = []
    for run in runs:
        final = run["curve"][-1]
        rows.append({"method": run["method"], "label": run["label"], "val_loss": final["val_loss"],
                     "accuracy": final["accuracy"], "seconds": final["seconds"], "mb_sent": final["bytes_sent"] / 1e6,
                     "tx_mb": final["tx_bytes"] / 1e6,
                     "loss_vs_ddp": final["val_loss"] / ddp["val_loss"] - 1 if ddp else None,
                     "bytes_vs_ddp": final["bytes_sent"] / ddp["bytes_sent"] if ddp else None})
    return rows


COLUMNS = [("method", "", "label"), ("val loss", ".4f", "val_loss"), ("vs DDP", "+.1%", "loss_vs_ddp"),
           ("acc", ".3f", "accuracy"), ("seconds", ".1f", "seconds"), ("MB sent", ".3f", "mb_sent"),
           ("bytes/DDP", "", lambda r: r["bytes_vs_ddp"] and f"1/{1 / r['bytes_vs_ddp']:.0f}"),
           ("tx MB", ".2f", "tx_mb")]


def line_style(index: int, run: dict) -> dict:
    kind = run["method"].split("-")[0]
    return {"color": "black" if kind in ("ddp", "hook") else f"C{index % 10}",
            "linestyle": {"hook": ":", "postlocal": "--", "diloco": "--"}.get(kind, "-")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__, world_size=4, steps=640, eval_every=32, batch_size=32, model="mlp", lr=0.05,
                        momentum=0.9, seed=0, json=None, plot=None)
    add_outer_arguments(parser)
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        type=lambda text: text if text == "diloco-equal" else method_name(text))
    cli.add_network_args(parser, prefix="gxlocalsgd", rate="100mbit", timeout=3600.0)
    args = parser.parse_args(argv)
    cli.check(parser, args, positive=("world_size", "steps", "eval_every", "batch_size"))
    args.periods = {}  # diloco-equal is DiLoCo with this H
    if "diloco-equal" in args.methods:
        sparse = next((method(t) for t in args.methods if t.startswith("sparse-")), None)
        if sparse is None:
            parser.error("diloco-equal needs a sparse-<collective>-<density>-<H> method in --methods")
        period = equal_bytes_period(sparse, numel_of(make_model(args.model)), args.world_size)
        args.periods["diloco-equal"] = f"diloco-{period}"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if cli.ran_as_worker(args, run_worker):
        return
    rate = cli.link_rate("local_sgd", args)
    links = network_name(rate)
    print(f"{args.world_size} Gloo processes on {links}, digits {args.model} "
          f"({numel_of(make_model(args.model))} parameters), batch {args.batch_size}/rank, {args.steps} inner steps "
          f"(SGD lr {args.lr}, momentum {args.momentum}), outer lr {args.outer_lr}, "
          f"{'Nesterov ' * (args.outer_nesterov and args.outer_momentum > 0)}momentum {args.outer_momentum}, "
          f"seed {args.seed}", flush=True)
    runs = run_group("bench.local_sgd", args.world_size, args, args.timeout, rate_bps=rate, prefix=args.prefix)
    rows = summarize(runs)
    print(report.table(rows, COLUMNS))
    if args.plot:  # validation loss against training seconds and MB sent per rank
        panels = [(x_label, x, "log", "validation loss", lambda c: c["val_loss"], "log")
                  for x_label, x in (("training seconds (slowest rank)", lambda c: c["seconds"]),
                                     ("MB sent per rank", lambda c: c["bytes_sent"] / 1e6))]
        report.plot_curves(runs, args.plot, f"{args.world_size} ranks, {links}, digits {args.model}, {args.steps} "
                           f"inner steps", panels, line_style)
    if args.json:
        report.write_json(args.json, args, runs=runs, table=rows)


if __name__ == "__main__":
    main()

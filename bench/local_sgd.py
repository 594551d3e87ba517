"""Local SGD: SparseLocalSGD against DiLoCo (its dense case), PyTorch's local SGD, DDP and gtopk_ext's gradient
hook on the digits, one method after the other from the same weights on the same batches, each rank behind an
emulated link (as root) or on loopback: validation loss against training seconds and bytes. docs/local_sgd.md.
``diloco-equal`` is DiLoCo with the H that gives it about the bytes of the first ``sparse-`` method.

    python -m bench.local_sgd --loopback --steps 64 --methods ddp diloco-8 sparse-gtopk-0.01-8
"""

from __future__ import annotations

import argparse

import torch

import gtopk_ext as gx
from bench.digits import load_digits_split, make_model
from bench.emulated_network import TxCounter, network_name
from bench.harness import cli, report
from bench.harness.launch import run_group
from bench.harness.methods import add_outer_arguments, method, method_name, numel_of
from bench.harness.regime import CALIBRATION_STEPS, add_regime_args, check_regime_args, link_rate
from bench.harness.train import Trainer, batch_loss, evaluation, train_curve
from gtopk_ext.collectives import ring_allreduce_bytes

DEFAULT_METHODS = ("ddp", "hook-gtopk-0.01", "postlocal-16", "diloco-16", "sparse-gtopk-0.05-16", "diloco-equal",
                   "sparse-gtopk-0.01-16", "diloco-600", "sparse-allgather-0.01-16")
HEADER_BYTES = 96  # SparseLocalSGD's per-sync header (an allgather of 4 int64 on 4 ranks), in the estimate only
COLUMNS = [("method", "", "label"), ("val loss", ".4f", "val_loss"), ("vs DDP", "+.1%", "loss_vs_ddp"),
           ("acc", ".3f", "accuracy"), ("seconds", ".1f", "seconds"), ("MB sent", ".3f", "mb_sent"),
           ("bytes/DDP", "", lambda r: r["bytes_vs_ddp"] and f"1/{1 / r['bytes_vs_ddp']:.0f}"),
           ("tx MB", ".2f", "tx_mb")]


def equal_bytes_period(sparse: str, numel: int, world_size: int) -> int:
    """The H at which DiLoCo sends about what the ``sparse`` method does (SparseLocalSGD counts its own exactly)."""
    sparse = method(sparse)
    k = gx.compressors.k_for_density(sparse.density, numel)
    messages = gx.collectives.collective_named(sparse.collective).messages(world_size)
    sync = HEADER_BYTES + messages * gx.wire.payload_size(sparse.wire, k, numel, torch.float32, head_words=1)
    return max(1, round(sparse.period * ring_allreduce_bytes(numel * 4, world_size) / sync))


def run_worker(args: argparse.Namespace, rank: int, world_size: int, config: dict) -> list:
    """One rank: every method in turn, each rank on its shard."""
    train_x, train_y, test_x, test_y = load_digits_split()
    shard, runs = torch.arange(rank, len(train_y), world_size), []
    for name in args.methods:
        # the same batches for every method; seed 0 draws the batches of the runs recorded before --seed
        batches = torch.Generator().manual_seed(1000 + rank + 100_003 * args.seed)
        trainer = Trainer(args.periods.get(name, name), make_model(args.model, args.seed), args, world_size)

        def loss_at(step: int):  # the next batch of this rank's shard
            return batch_loss(train_x, train_y, shard[torch.randint(len(shard), (args.batch_size,), generator=batches)])

        curve, _ = train_curve(trainer, args.steps, loss_at, evaluation(test_x, test_y, "accuracy", "val_loss"),
                               args.eval_every, TxCounter(config["ifname"]))
        runs.append({"method": name, "label": method(args.periods.get(name, name)).label, "curve": curve})
        if rank == 0:
            print(f"  {runs[-1]['label']}: val loss {curve[-1]['val_loss']:.4f}, {curve[-1]['seconds']:.1f} s, "
                  f"{curve[-1]['bytes_sent'] / 1e6:.2f} MB", flush=True)
    return runs


def summarize(runs: list[dict]) -> list[dict]:
    ddp = next((r["curve"][-1] for r in runs if r["method"] == "ddp"), None)
    return [{"method": run["method"], "label": run["label"], "val_loss": final["val_loss"],
             "accuracy": final["accuracy"], "seconds": final["seconds"], "mb_sent": final["bytes_sent"] / 1e6,
             "tx_mb": final["tx_bytes"] / 1e6, "loss_vs_ddp": final["val_loss"] / ddp["val_loss"] - 1 if ddp else None,
             "bytes_vs_ddp": final["bytes_sent"] / ddp["bytes_sent"] if ddp else None}
            for run, final in ((run, run["curve"][-1]) for run in runs)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__, world_size=4, steps=640, eval_every=32, batch_size=32, model="mlp", lr=0.05,
                        momentum=0.9, seed=0, json=None, plot=None)
    add_outer_arguments(parser)
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        type=lambda text: text if text == "diloco-equal" else method_name(text))
    cli.add_network_args(parser, prefix="gxlocalsgd", rate="100mbit", timeout=3600.0)
    add_regime_args(parser)
    args = parser.parse_args(argv)
    check_regime_args(parser, args)
    cli.check(parser, args, positive=("world_size", "steps", "eval_every", "batch_size"))
    args.periods = {}  # diloco-equal is DiLoCo with this H
    if "diloco-equal" in args.methods:
        sparse = next((name for name in args.methods if name.startswith("sparse-")), None)
        if sparse is None:
            parser.error("diloco-equal needs a sparse-<collective>-<density>-<H> method in --methods")
        period = equal_bytes_period(sparse, numel_of(make_model(args.model)), args.world_size)
        args.periods["diloco-equal"] = f"diloco-{period}"
    return args


def measure_floor(args: argparse.Namespace) -> float:
    """The compute floor's step here (seconds): the floor method's mean step on loopback."""
    settings = {**vars(args), "methods": ["floor"], "steps": CALIBRATION_STEPS, "eval_every": CALIBRATION_STEPS}
    return run_group("bench.local_sgd", args.world_size, settings, args.timeout)[0]["curve"][-1]["seconds"] / \
        CALIBRATION_STEPS


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if cli.ran_as_worker(args, run_worker):
        return
    rate, _ = link_rate(args, "local_sgd", numel_of(make_model(args.model)), lambda: measure_floor(args))
    print(f"{args.world_size} Gloo processes on {network_name(rate)}, digits {args.model} "
          f"({numel_of(make_model(args.model))} parameters), batch {args.batch_size}/rank, {args.steps} inner steps "
          f"(SGD lr {args.lr}, momentum {args.momentum}), outer lr {args.outer_lr}, "
          f"{'Nesterov ' * (args.outer_nesterov and args.outer_momentum > 0)}momentum {args.outer_momentum}, "
          f"seed {args.seed}", flush=True)
    runs = run_group("bench.local_sgd", args.world_size, args, args.timeout, rate_bps=rate, prefix=args.prefix)
    rows = summarize(runs)
    print(report.table(rows, COLUMNS))
    if args.plot:  # validation loss against training seconds and MB sent per rank
        kinds = [run["method"].split("-")[0] for run in runs]
        report.plot_curves(runs, args.plot, f"{args.world_size} ranks, {network_name(rate)}, digits {args.model}, "
                           f"{args.steps} inner steps", "validation loss", lambda c: c["val_loss"],
                           [("training seconds (slowest rank)", lambda c: c["seconds"], "log"),
                            ("MB sent per rank", lambda c: c["bytes_sent"] / 1e6, "log")], "log",
                           lambda i, run: {"color": "black" if kinds[i] in ("ddp", "hook") else f"C{i % 10}",
                                           "linestyle": {"hook": ":", "postlocal": "--", "diloco": "--"}.get(
                                               kinds[i], "-")})
    if args.json:
        report.write_json(args.json, args, runs=runs, table=rows)


if __name__ == "__main__":
    main()

"""FSDP2 inside each node and, between nodes, either FSDP2's own dense all-reduce (HSDP: a 2-D mesh) or gtopk_ext's
sparse hook (a 1-D shard mesh and ``gx.register_sparse_all_reduce``), on bench.lm's language model, corpus, batches
and validation loss, every method from the same weights. A torchrun worker, run by torchrun agents as nodes on
emulated links (as root) or on loopback; docs/fsdp.md:

    python -m bench.emulated_network torchrun --nnodes 2 --nproc-per-node 2 --rate 1gbit -- \\
        -m bench.fsdp_lm --steps 100 --json fsdp_lm.json --plot fsdp_lm.png
    python -m bench.fsdp_lm --regime 30 --nnodes 2 --nproc-per-node 2 --steps 100 --json fsdp_lm.json

With --regime R (run as above, not under torchrun) it launches the agents itself: first the method ``floor`` on
loopback for a few steps (the compute floor: FSDP2 inside each node and nothing between the nodes; or --floor-ms),
then the run on links of the rate where HSDP's float32 all-reduce between the nodes takes R x that step
(bench/harness/regime.py).

Per method: the step time (the slowest rank's, between two barriers; the median over the steps after the method's
warm-up and ``--settle`` more), the bytes each node sent on its link (emulated links only; one barrier per step taken
off) and by the method's own count (the hook's ``state.stats()``; for HSDP a ring all-reduce of the padded float32
shards), the paths the hook's groups took, and the validation loss. Paths are relative to the repository's root.
"""

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import gtopk_ext as gx
from bench.emulated_network import RANK_IFNAME, Network, TxCounter
from bench.harness import cli, report
from bench.harness.launch import ROOT, run_torchrun
from bench.harness.regime import (CALIBRATION_STEPS, Regime, add_regime_args, check_regime_args, floor_seconds,
                                  measured_ratio)
from bench.harness.train import barrier_bytes, gathered, sgd
from bench.lm import TransformerLM, batch_at, lm_loss, load_corpus, validation_loss
from gtopk_ext.costs import ring_allreduce_bytes
from gtopk_ext.paths import MODES

# Under bench.emulated_network, Gloo is bound to the node's link; elsewhere there is no link to count.
EMULATED = os.environ.get("GLOO_SOCKET_IFNAME") == RANK_IFNAME
# The logits are a view (Linear on [B, T, d]); lm_loss only reshapes them, never writes to them in place.
warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")


def parsed(name: str) -> tuple[str, float, str]:
    """A method's (kind, density, path): ``hsdp`` (no hook; density 1); ``floor`` (FSDP2 inside each node, nothing
    between the nodes: each node trains its own replica; the compute floor's step); ``sparse-<d>`` (the momentum in the
    optimizer), ``dgc-<d>`` (Nesterov momentum correction in the hook) or ``recipe-<d>`` (``gx.SparseFSDPState.recipe``)
    with an optional ``-<path>``, the hook's path policy (default ``auto``). docs/fsdp.md."""
    kind, _, rest = name.partition("-")
    density, _, path = rest.partition("-")
    try:
        if name in ("hsdp", "floor"):
            return kind, 1.0, ""
        if kind in ("sparse", "dgc", "recipe") and 0 < float(density) <= 1 and path in ("", *MODES):
            return kind, float(density), path or "auto"
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"hsdp, floor, or sparse-, dgc- or recipe-<density>[-<path>] (path: one of "
                                     f"{MODES}), got {name!r}")


def parse_args(argv=None):
    parser = cli.parser(__doc__, steps=100, eval_every=20, batch_size=8, lr=0.1, momentum=0.9, seed=0, json=None,
                        plot=None)
    parser.add_argument("--methods", nargs="+", type=lambda text: parsed(text) and text,
                        default=["hsdp", "sparse-0.01", "sparse-0.001"])
    # Sequences of 64: docs/language_model.md's configuration (at 128, lr 0.1 lifts the loss above its start for
    # the first twenty-odd steps).
    for flag, default in (("--seq-len", 64), ("--d-model", 256), ("--layers", 7), ("--heads", 4),
                          ("--val-windows", 128), ("--start-iter", 2), ("--warmup-steps", 44), ("--settle", 3)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--val-percent", type=float, default=5.0)
    parser.add_argument("--collective", default="gtopk", choices=gx.collectives.SPARSE_COLLECTIVES)
    parser.add_argument("--wire", default="plain", choices=("plain", "compact"))
    add_regime_args(parser)
    parser.add_argument("--nnodes", type=int, default=2, help="with --regime: the torchrun agents (nodes) to launch")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="with --regime: ranks per node")
    parser.add_argument("--timeout", type=float, default=7200.0, help="with --regime: seconds each launch may take")
    args = parser.parse_args(argv)
    check_regime_args(parser, args)
    for name in ("nnodes", "nproc_per_node"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def launch_in_regime(args: argparse.Namespace, argv: list[str]) -> None:
    """--regime outside torchrun: the floor (HSDP on loopback, unless --floor-ms), then ``argv`` under torchrun agents
    as --nnodes nodes behind links at the regime's rate, --floor-ms set so that the workers report the regime."""
    cli.require_emulation("bench.fsdp_lm --regime")
    numel = sum(p.numel() for p in TransformerLM(args, args.seed).parameters())
    with tempfile.TemporaryDirectory(prefix="fsdp_lm_") as tmp:
        if args.floor_ms is None:
            out = Path(tmp) / "floor.json"
            calibration = ["--methods", "floor", "--steps", str(CALIBRATION_STEPS), "--eval-every",
                           str(CALIBRATION_STEPS), "--json", str(out), "--plot", str(out.with_suffix(".png"))]
            run_torchrun(["-m", "bench.fsdp_lm", *argv, *calibration], args.nnodes, args.nproc_per_node, None,
                         Path(tmp), "fsdp-floor", args.timeout)
            args.floor_ms = 1e3 * floor_seconds(json.loads(out.read_text())["runs"][0]["step_seconds"])
        # HSDP's exchange on a node's link: its ranks' shards, all-reduced over the nodes, i.e. the whole model's
        regime = Regime.of(args.regime, args.floor_ms / 1e3, numel, args.nnodes)
        print(regime.describe().replace("a rank and step", "a node and step (HSDP)"), flush=True)
        with Network("gxfsdp", args.nnodes, regime.rate_bps) as network:
            run_torchrun(["-m", "bench.fsdp_lm", *argv, "--floor-ms", repr(args.floor_ms)], args.nnodes,
                         args.nproc_per_node, network, Path(tmp), "fsdp-lm", args.timeout)
    if args.json and "hsdp" in args.methods:
        table = json.loads((ROOT / args.json).read_text())["table"]  # the workers' paths: from the root
        hsdp = next(row for row in table if row["method"] == "hsdp")
        print(measured_ratio(hsdp["step_s"], regime.floor_seconds).replace("DDP", "HSDP"))


def build(name: str, mesh, args):
    """The method's sharded model and its hook state (None for HSDP), and its steps before the steady state."""
    model = TransformerLM(args, args.seed)  # the same weights on every rank and for every method
    kind, density, path = parsed(name)
    state, warmup = None, 0
    if kind not in ("hsdp", "floor"):
        options = dict(collective=args.collective, wire=args.wire, start_iter=args.start_iter, path=path)
        if kind == "recipe":
            state = gx.SparseFSDPState.recipe(mesh, density, args.warmup_steps, args.momentum, **options)
        else:
            correction = gx.MomentumCorrection(args.momentum, nesterov=True) if kind == "dgc" else None
            state = gx.SparseFSDPState(mesh, density, momentum=correction, **options)
        warmup = args.start_iter + (args.warmup_steps if kind == "recipe" else 0)
    # HSDP: FSDP2 all-reduces over the 2-D mesh's rows; the floor: sharded inside the node only, like the hook's
    shard_mesh = mesh["shard"] if kind == "floor" else mesh if state is None else state.shard_mesh
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    if state is not None:
        gx.register_sparse_all_reduce(model, state)
    return model, state, warmup + args.settle


def run_method(name: str, mesh, args, train: torch.Tensor, val_batches: torch.Tensor, tx: TxCounter) -> dict:
    rank, world, node_size = dist.get_rank(), dist.get_world_size(), mesh.size(1)
    model, state, first_steady = build(name, mesh, args)
    optimizer = sgd(model, args, momentum_in_hook=state is not None and state.config.momentum is not None)
    # HSDP's own count: a ring all-reduce over the nodes of each padded float32 shard (dim 0 padded by FSDP)
    hsdp_bytes = ring_allreduce_bytes(4 * sum(math.ceil(p.shape[0] / node_size) * math.prod(p.shape[1:])
                                              for p in model.parameters()), mesh.size(0))
    barrier_tx, counted = barrier_bytes(tx), lambda: state.stats()["total"]["run_bytes_sent"] if state else 0
    steps, paths, curve = [], Counter(), [{"step": 0, **validation_loss(model, val_batches, rank, world)}]
    for step in range(1, args.steps + 1):
        batch = batch_at(train, step, rank, world, args)  # bench.lm's batches
        dist.barrier()
        begin, link, hook = time.perf_counter(), tx.read(), counted()
        loss = lm_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()  # the step ends when the slowest rank's does
        steps.append([time.perf_counter() - begin, tx.read() - link - barrier_tx,
                      counted() - hook if state else hsdp_bytes if name == "hsdp" else 0, loss.item()])
        if state and step > first_steady:
            paths.update(g["path"] for g in state.stats()["groups"].values())
        if step % args.eval_every == 0 or step == args.steps:
            curve.append({"step": step, **validation_loss(model, val_batches, rank, world)})
            if rank == 0:
                print(f"{name} step {step}: validation loss {curve[-1]['val_loss']:.4f}", flush=True)
    every = torch.tensor(gathered(steps))  # [rank, step, (seconds, link bytes, counted bytes, loss)]
    seconds = every[:, :, 0].max(0).values.tolist()
    link = every[::node_size, :, 1].T.tolist()  # a node's: its first rank's counter
    sent = every[:, :, 2].reshape(-1, node_size, args.steps).sum(1).T.tolist()  # per node: its ranks' sum
    all_paths = [None] * world
    dist.all_gather_object(all_paths, dict(paths))
    for point in curve:
        point.update(seconds=sum(seconds[:point["step"]]),  # and a node's bytes so far (the mean over the nodes)
                     link_bytes=sum(map(statistics.mean, link[:point["step"]])),
                     bytes_sent=sum(map(statistics.mean, sent[:point["step"]])))
    return {"method": name, "label": name, "first_steady_step": first_steady + 1, "curve": curve,
            "final_val_loss": curve[-1]["val_loss"], "step_seconds": seconds, "link_bytes_per_node": link,
            "bytes_sent_per_node": sent, "train_loss": every[:, :, 3].mean(0).tolist(),
            "paths": dict(sum((Counter(p) for p in all_paths), Counter())),  # over the ranks' steady group calls
            "parameters": sum(p.numel() for p in model.parameters()), "load_average": os.getloadavg()}


def summarize(records: list[dict]) -> list[dict]:
    """One row per method: the medians over the steady steps and the sums over the run, a node's figures the mean
    over the nodes; ratios to HSDP where it ran."""
    rows = []
    for r in records:
        link, sent = ([statistics.mean(nodes) for nodes in r[key]]
                      for key in ("link_bytes_per_node", "bytes_sent_per_node"))
        steady = r["first_steady_step"] - 1
        rows.append({"method": r["method"], "final_val_loss": r["final_val_loss"],
                     **{key: statistics.median(values[steady:]) if values[steady:] else None
                        for key, values in (("step_s", r["step_seconds"]), ("link_step", link), ("sent_step", sent))},
                     "link_run": sum(link), "sent_run": sum(sent), "seconds": sum(r["step_seconds"]),
                     "paths": ", ".join(f"{path} {n}" for path, n in sorted(r["paths"].items())) or None})
    hsdp = next((row for row in rows if row["method"] == "hsdp"), None)
    for row in rows:
        for key in ("final_val_loss", "step_s", "link_step", "sent_step", "link_run", "sent_run"):
            row[key + "_vs_hsdp"] = row[key] / hsdp[key] if hsdp and row[key] and hsdp[key] else None
    return rows


def ratio(key):
    return lambda row: row[key] and f"{row[key]:.3g}x"


def mb(key):
    return lambda row: row[key] / 1e6 if row[key] else None  # no link counted on loopback


COLUMNS = [("method", "", "method"), ("final val loss", ".4f", "final_val_loss"),
           ("vs HSDP", "", ratio("final_val_loss_vs_hsdp")), ("steady step s", ".3f", "step_s"),
           ("vs HSDP", "", ratio("step_s_vs_hsdp")), ("link MB/node/step", ".3f", mb("link_step")),
           ("vs HSDP", "", ratio("link_step_vs_hsdp")), ("counted MB/node/step", ".3f", mb("sent_step")),
           ("link MB/node, run", ".1f", mb("link_run")), ("counted MB/node, run", ".1f", mb("sent_run")),
           ("training s", ".1f", "seconds"), ("paths (steady group calls)", "", "paths")]


def link_name() -> str:
    """The emulated link's rate (the tbf of this namespace's interface), or loopback."""
    if not EMULATED:
        return "loopback"
    qdisc = subprocess.run(["tc", "qdisc", "show", "dev", RANK_IFNAME], capture_output=True, text=True).stdout
    rate = re.search(r"tbf .* rate (\S+)", qdisc)
    return f"{rate[1]}/s links (tbf)" if rate else "unshaped links"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.regime is not None and "LOCAL_RANK" not in os.environ:
        return launch_in_regime(args, sys.argv[1:] if argv is None else list(argv))
    if args.regime is not None and args.floor_ms is None and EMULATED:  # (the launcher's floor run: on loopback)
        raise SystemExit("bench.fsdp_lm: --regime launches torchrun itself: run python -m bench.fsdp_lm --regime R "
                         "directly, not under torchrun (or give the rate with the launcher's --rate instead)")
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = gx.fsdp.node_mesh()  # nodes of $LOCAL_WORLD_SIZE ranks (torchrun's agents)
        if args.val_windows % world:
            raise SystemExit(f"--val-windows ({args.val_windows}) must be a multiple of the world size ({world}): "
                             f"FSDP's forward is a collective of the node")
        train, val_batches, _ = load_corpus(args)
        tx = TxCounter(RANK_IFNAME if EMULATED else None)
        records, link = [], link_name()
        if args.regime is not None and EMULATED:
            link += f", regime R = {args.regime:g} (floor {args.floor_ms:.0f} ms)"
        title = (f"{mesh.size(0)} nodes x {mesh.size(1)} ranks, Gloo on {link}; byte-level transformer "
                 f"d={args.d_model}, {args.layers} layers, {args.heads} heads, sequence {args.seq_len}, batch "
                 f"{args.batch_size}/rank, {args.steps} steps, SGD lr {args.lr:g} momentum {args.momentum:g}, "
                 f"{args.collective} {args.wire}")
        for name in args.methods:
            records.append(run_method(name, mesh, args, train, val_batches, tx))
            if rank == 0 and args.json:
                report.write_json(args.json, args, setting=title, link=link, table=summarize(records), runs=records)
        if rank == 0:
            print(f"\n{title}, {records[0]['parameters'] / 1e6:.2f}M parameters\n")
            print(report.table(summarize(records), COLUMNS, markdown=True))
            if args.plot:
                report.plot_curves(records, args.plot, title, "validation loss (nats per byte)",
                                   lambda c: c["val_loss"], [("step", lambda c: c["step"], "linear"),
                                                             ("training seconds (slowest rank)",
                                                              lambda c: c["seconds"], "linear")])
    finally:
        gx.destroy_process_group()


if __name__ == "__main__":
    main()

"""Local SGD benchmark: SparseLocalSGD against DiLoCo (its dense case), PyTorch's local SGD
(``PostLocalSGDOptimizer`` with ``PeriodicModelAverager``), DDP and gtopk_ext's gradient hook, on P Gloo processes,
each rank behind an emulated link of ``--rate`` (bench/emulated_network.py: its own network namespace, tbf; needs
root) or, with ``--loopback``, on 127.0.0.1.

The task is the demo's (bench/digits.py): scikit-learn's bundled digits and its MLP. Every method starts from the
same weights, takes the same number of inner steps with the same inner optimizer on the same batches (each rank
its own shard), one method after the other in one process group. Per method, every ``--eval-every`` steps:
validation loss and accuracy of the consensus model (the mean of the replicas, formed by an allreduce that is not
counted; after a sync the replicas are that model already), the training seconds so far (the slowest rank's
time in its steps and syncs, evaluation excluded) and the bytes a rank sent so far: from the method's own count
(DDP and PyTorch's averager: a ring allreduce of the model per exchange; gtopk_ext: its ``stats()``) and, on the
emulated network, from the rank's interface counter (TCP/IP headers included). Local methods sync after their
last step when it is not a sync step already, so every method ends with one model.

Methods (``--methods``): ``ddp``; ``hook-<collective>-<density>`` (gtopk_ext's DDP hook); ``postlocal-<H>``
(PyTorch's local SGD: average the weights every H steps); ``diloco-<H>`` (SparseLocalSGD with density 1 and the
dense collective); ``sparse-<collective>-<density>-<H>`` (SparseLocalSGD), ``sparse-<collective>-<density>-<H>-compact``
on the compact wire (4 bytes a pair instead of 8). ``diloco-equal`` is DiLoCo with the H that gives it about the
bytes of the first ``sparse-`` method in the list.

    python -m bench.local_sgd --rate 100mbit --json local_sgd_100mbit.json --plot local_sgd_100mbit.png
    python -m bench.local_sgd --loopback --steps 64 --methods ddp diloco-8 sparse-gtopk-0.01-8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parameters_to_vector, vector_to_parameters

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gtopk_ext as gx  # noqa: E402
from bench.digits import MODELS, load_digits_split, make_model  # noqa: E402
from bench.emulated_network import (Networks, TxCounter, cleanup_stale, network_name, parse_rate,  # noqa: E402
                                    join_group, run_ranks, runs_on_loopback)
from gtopk_ext.collectives import ring_allreduce_bytes  # noqa: E402
from gtopk_ext.utils import destroy_process_group  # noqa: E402

DEFAULT_METHODS = ("ddp", "hook-gtopk-0.01", "postlocal-16", "diloco-16", "sparse-gtopk-0.05-16", "diloco-equal",
                   "sparse-gtopk-0.01-16", "diloco-600", "sparse-allgather-0.01-16")
HEADER_BYTES = 96  # SparseLocalSGD's per-sync header (an allgather of 4 int64 on 4 ranks), in the estimate only


@dataclass(frozen=True)
class Method:
    """A parsed ``--methods`` entry."""

    name: str
    kind: str  # "ddp", "hook", "postlocal", "diloco", "sparse"
    period: int = 1  # H: inner steps between exchanges
    collective: str = "dense"
    density: float = 1.0
    wire: str = "plain"

    @property
    def label(self) -> str:
        if self.kind == "ddp":
            return "DDP allreduce"
        if self.kind == "hook":
            return f"gtopk_ext hook, {self.collective} d={self.density:g}"
        if self.kind == "postlocal":
            return f"PyTorch PostLocalSGD, H={self.period}"
        if self.kind == "diloco":
            return f"DiLoCo (dense), H={self.period}"
        compact = ", compact wire" if self.wire == "compact" else ""
        return f"SparseLocalSGD {self.collective} d={self.density:g}, H={self.period}{compact}"


def parse_method(text: str) -> Method:
    parts = text.split("-")
    try:
        if text == "ddp":
            return Method(text, "ddp")
        if parts[0] == "hook" and len(parts) == 3:
            return Method(text, "hook", collective=parts[1], density=float(parts[2]))
        if parts[0] in ("postlocal", "diloco") and len(parts) == 2:
            return Method(text, parts[0], period=int(parts[1]))
        if parts[0] == "sparse" and (len(parts) == 4 or len(parts) == 5 and parts[4] == "compact"):
            return Method(text, "sparse", period=int(parts[3]), collective=parts[1], density=float(parts[2]),
                          wire="compact" if len(parts) == 5 else "plain")
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"unknown method {text!r}: expected ddp, hook-<collective>-<density>, "
                                     f"postlocal-<H>, diloco-<H>, diloco-equal or "
                                     f"sparse-<collective>-<density>-<H>[-compact]")


def sync_bytes(method: Method, numel: int, world_size: int) -> float:
    """About what one rank sends per exchange (SparseLocalSGD counts its own exactly; this sets diloco-equal)."""
    if method.kind in ("diloco", "postlocal", "ddp"):
        return ring_allreduce_bytes(numel * 4, world_size)
    k = gx.compressors.k_for_density(method.density, numel)
    rounds = (world_size - 1 if method.collective == "allgather"
              else math.ceil(math.log2(world_size)) + (world_size & (world_size - 1) != 0))
    return HEADER_BYTES + rounds * gx.wire.payload_size(method.wire, k, numel, torch.float32, head_words=1)


def equal_bytes_period(sparse: Method, numel: int, world_size: int) -> int:
    dense = Method("diloco", "diloco")
    return max(1, round(sparse.period * sync_bytes(dense, numel, world_size) / sync_bytes(sparse, numel, world_size)))


# ------------------------------------------------------------------------------------------------ worker side

class LocalExchange:
    """A local method's exchange around its inner optimizer: PyTorch's local SGD (``PostLocalSGDOptimizer`` with
    ``PeriodicModelAverager``: the weights averaged every H steps, from the first), DiLoCo or SparseLocalSGD (a
    sync after every H-th step), and the bytes this rank sent so far (a ring allreduce of the model per average;
    SparseLocalSGD's own count). Use :attr:`optimizer` as the inner optimizer and call :meth:`after_step` after
    each of its steps."""

    def __init__(self, method: Method, model: torch.nn.Module, inner: torch.optim.Optimizer,
                 args: argparse.Namespace, world_size: int):
        self.method, self.model, self.world_size = method, model, world_size
        self.model_bytes = 4 * sum(p.numel() for p in model.parameters())
        self.outer, self.averager, self.counted, self.steps, self.finished = None, None, 0, 0, False
        if method.kind == "postlocal":
            self.averager = PeriodicModelAverager(period=method.period, warmup_steps=0)
            self.optimizer = PostLocalSGDOptimizer(optim=inner, averager=self.averager)
        else:
            self.optimizer = inner
            self.outer = gx.SparseLocalSGD(model.parameters(), sync_every=method.period, density=method.density,
                                           collective=method.collective, outer_lr=args.outer_lr,
                                           outer_momentum=args.outer_momentum, nesterov=args.outer_momentum > 0,
                                           wire=method.wire)

    def after_step(self) -> None:
        self.steps += 1
        if self.outer is not None:
            self.outer.step()
        elif self.synced():
            self.counted += ring_allreduce_bytes(self.model_bytes, self.world_size)

    def synced(self) -> bool:
        """Whether the replicas are one model now (right after an average or a sync, or :meth:`finish`)."""
        if self.finished:
            return True
        if self.outer is not None:
            return self.steps % self.method.period == 0
        return (self.steps - 1) % self.method.period == 0

    def finish(self) -> None:
        """Exchanges once more when the last step was not an exchange: every method ends with one model."""
        if self.synced():
            return
        if self.outer is not None:
            self.outer.sync()
        else:
            average_parameters(self.model.parameters(), dist.group.WORLD)
            self.counted += ring_allreduce_bytes(self.model_bytes, self.world_size)
        self.finished = True

    def bytes_sent(self) -> int:
        return self.outer.stats()["bytes_sent"] if self.outer is not None else self.counted


class Trainer:
    """One method's model, inner optimizer and exchange, and its own count of the bytes this rank sent."""

    def __init__(self, method: Method, args: argparse.Namespace, world_size: int):
        self.method, self.world_size = method, world_size
        self.model = make_model(args.model)  # the same initial weights on every rank and for every method
        self.numel = sum(p.numel() for p in self.model.parameters())
        self.trained, self.local, self.hook_state = self.model, None, None
        inner = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=args.momentum)
        if method.kind in ("ddp", "hook"):
            self.trained = DistributedDataParallel(self.model)
            if method.kind == "hook":
                self.hook_state = gx.SparseGradState(density=method.density, collective=method.collective,
                                                     stats_logging_frequency=0)
                self.trained.register_comm_hook(self.hook_state, gx.sparse_grad_hook)
        else:
            self.local = LocalExchange(method, self.model, inner, args, world_size)
            inner = self.local.optimizer
        self.inner = inner
        self.counted = 0  # bytes sent by DDP and the hook

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.inner.zero_grad()
        torch.nn.functional.cross_entropy(self.trained(x), y).backward()
        self.inner.step()
        if self.local is not None:
            self.local.after_step()
        elif self.hook_state is not None:
            self.counted += self.hook_state.stats()["total"]["bytes_sent"]
        else:
            self.counted += ring_allreduce_bytes(self.numel * 4, self.world_size)

    def finish(self) -> None:
        if self.local is not None:
            self.local.finish()

    def bytes_sent(self) -> int:
        return self.local.bytes_sent() if self.local is not None else self.counted


@torch.no_grad()
def load_consensus(model: torch.nn.Module, evaluation: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """``evaluation`` (a model of the same shape) set to the mean of the replicas of ``model`` (an allreduce that
    the byte counts leave out)."""
    mean = parameters_to_vector(model.parameters()).detach().clone()
    dist.all_reduce(mean)
    vector_to_parameters(mean.div_(world_size), evaluation.parameters())
    return evaluation


@torch.no_grad()
def evaluate(model: torch.nn.Module, evaluation: torch.nn.Module, world_size: int, test_x, test_y) -> dict:
    """Validation loss and accuracy of the mean of the replicas."""
    logits = load_consensus(model, evaluation, world_size)(test_x)
    return {"val_loss": float(torch.nn.functional.cross_entropy(logits, test_y)),
            "accuracy": float((logits.argmax(1) == test_y).float().mean())}


def run_method(method: Method, rank: int, world_size: int, args: argparse.Namespace, data: tuple,
               tx: TxCounter) -> dict:
    train_x, train_y, test_x, test_y = data
    shard = torch.arange(rank, len(train_y), world_size)
    batches = torch.Generator().manual_seed(1000 + rank)  # the same batches for every method
    trainer = Trainer(method, args, world_size)
    evaluation = make_model(args.model)
    curve, seconds, tx_sent = [], 0.0, 0
    for step in range(1, args.steps + 1):
        index = shard[torch.randint(0, len(shard), (args.batch_size,), generator=batches)]
        dist.barrier()  # every method's steps start together, as the slowest rank's time is what counts
        before, start = tx.read(), time.perf_counter()
        trainer.step(train_x[index], train_y[index])
        if step == args.steps:
            trainer.finish()
        seconds += time.perf_counter() - start
        tx_sent += tx.read() - before
        if step % args.eval_every == 0 or step == args.steps:
            slowest = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            curve.append({"step": step, "seconds": float(slowest), "bytes_sent": trainer.bytes_sent(),
                          "tx_bytes": tx_sent, **evaluate(trainer.model, evaluation, world_size, test_x, test_y)})
    return {"method": method.name, "label": method.label, "period": method.period, "density": method.density,
            "collective": method.collective, "curve": curve}


def run_worker(config: dict) -> None:
    """One rank (started by emulated_network.run_ranks): every method in turn; rank 0 writes the runs."""
    args, rank, world_size = join_group(config)
    try:
        data = load_digits_split()
        tx = TxCounter(config["ifname"])
        runs = []
        for text in args.methods:
            runs.append(run_method(Method(**text), rank, world_size, args, data, tx))
            if rank == 0:
                final = runs[-1]["curve"][-1]
                print(f"  {runs[-1]['label']}: val loss {final['val_loss']:.4f}, {final['seconds']:.1f} s, "
                      f"{final['bytes_sent'] / 1e6:.2f} MB", flush=True)
        if rank == 0:
            Path(config["out"]).write_text(json.dumps(runs))
    finally:
        destroy_process_group()


# ------------------------------------------------------------------------------------------------ driver side

def run_group(module: str, world_size: int, rate_bps: int | None, prefix: str, worker_args: dict,
              timeout: float):
    """Runs ``python -m <module> --worker <config>`` on ``world_size`` ranks, each in its own network namespace
    (named ``<prefix><pid>-...``) behind a tbf link of ``rate_bps``, or on loopback (None); returns what the
    workers wrote to ``config["out"]`` (JSON). The worker gets ``config["args"] = worker_args``."""
    if rate_bps is not None:
        cleanup_stale(prefix)
    networks = Networks(prefix)
    try:
        with tempfile.TemporaryDirectory(prefix=f"{module.rsplit('.', 1)[-1]}_") as tmp:
            network = None if rate_bps is None else networks.create(world_size, rate_bps)
            out = Path(tmp) / "out.json"
            run_ranks(module, world_size, network, {"args": worker_args, "out": str(out)}, Path(tmp),
                      module.rsplit(".", 1)[-1], timeout)
            return json.loads(out.read_text())
    finally:
        networks.close()


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


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Validation loss against training seconds and against MB sent per rank, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(13, 5))
    for index, run in enumerate(runs):
        kind = run["method"].split("-")[0]
        color = "black" if kind in ("ddp", "hook") else f"C{index % 10}"
        line = {"hook": ":", "postlocal": "--", "diloco": "--"}.get(kind, "-")
        curve = run["curve"]
        loss = [c["val_loss"] for c in curve]
        by_time.plot([c["seconds"] for c in curve], loss, line, color=color, label=run["label"], marker=".")
        sent = [(c["bytes_sent"] / 1e6, c["val_loss"]) for c in curve if c["bytes_sent"]]  # log axis: none at 0
        by_bytes.plot(*zip(*sent), line, color=color, marker=".")
    by_time.set(xlabel="training seconds (slowest rank)", ylabel="validation loss", xscale="log", yscale="log")
    by_bytes.set(xlabel="MB sent per rank", ylabel="validation loss", xscale="log", yscale="log")
    for ax in (by_time, by_bytes):
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.94), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.84))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=640, help="inner steps of every method")
    parser.add_argument("--eval-every", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--lr", type=float, default=0.05, help="inner SGD")
    parser.add_argument("--momentum", type=float, default=0.9, help="inner SGD")
    # DiLoCo's published outer step (lr 0.7, Nesterov 0.9, for H = 500 AdamW steps of a language model)
    # overshoots on this task; lr 1 without momentum does best for every local method here.
    parser.add_argument("--outer-lr", type=float, default=1.0, help="DiLoCo and SparseLocalSGD")
    parser.add_argument("--outer-momentum", type=float, default=0.0, help="Nesterov when > 0")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        type=lambda text: text if text == "diloco-equal" else parse_method(text).name)
    parser.add_argument("--rate", type=parse_rate, default=parse_rate("100mbit"),
                        help="every rank in its own network namespace behind a link of this rate (needs root)")
    parser.add_argument("--loopback", action="store_true", help="plain processes on 127.0.0.1, no shaping")
    parser.add_argument("--prefix", default="gxlocalsgd", help="name prefix of the namespaces this run creates")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds the whole job may take")
    parser.add_argument("--json", default=None, help="write the settings, every curve and the table here")
    parser.add_argument("--plot", type=Path, default=None, help="write the loss curves here (PNG)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(json.loads(args.worker.read_text()))
        return
    numel = sum(p.numel() for p in make_model(args.model).parameters())
    methods = []
    for text in args.methods:
        if text == "diloco-equal":
            sparse = next((parse_method(t) for t in args.methods if t.startswith("sparse-")), None)
            if sparse is None:
                parser.error("diloco-equal needs a sparse-<collective>-<density>-<H> method in --methods")
            period = equal_bytes_period(sparse, numel, args.world_size)
            methods.append(Method("diloco-equal", "diloco", period=period))
        else:
            methods.append(parse_method(text))
    args.methods = [vars(m) for m in methods]

    args.loopback = runs_on_loopback("local_sgd", args.loopback)
    links = network_name(None if args.loopback else args.rate)
    print(f"{args.world_size} Gloo processes on {links}, digits {args.model} ({numel} parameters), batch "
          f"{args.batch_size}/rank, {args.steps} inner steps (SGD lr {args.lr}, momentum {args.momentum}), outer lr "
          f"{args.outer_lr}, Nesterov momentum {args.outer_momentum}", flush=True)
    worker_args = {key: value for key, value in vars(args).items() if key not in ("worker", "plot")}
    runs = run_group("bench.local_sgd", args.world_size, None if args.loopback else args.rate, args.prefix,
                     worker_args, args.timeout)
    for run, method in zip(runs, methods):
        run["label"] = method.label
    rows = summarize(runs)
    print(f"{'method':<42}{'val loss':>9}{'vs DDP':>8}{'acc':>7}{'seconds':>9}{'MB sent':>10}{'bytes/DDP':>11}"
          f"{'tx MB':>8}")
    for row in rows:
        versus = f"{100 * row['loss_vs_ddp']:+.1f}%" if row["loss_vs_ddp"] is not None else "-"
        share = f"1/{1 / row['bytes_vs_ddp']:.0f}" if row["bytes_vs_ddp"] else "-"
        print(f"{row['label']:<42}{row['val_loss']:>9.4f}{versus:>8}{row['accuracy']:>7.3f}{row['seconds']:>9.1f}"
              f"{row['mb_sent']:>10.3f}{share:>11}{row['tx_mb']:>8.2f}")
    if args.plot:
        plot(runs, args.plot, f"{args.world_size} ranks, {links}, digits {args.model}, {args.steps} inner steps")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "plot"}, "torch": torch.__version__,
                       "machine": platform.platform(), "cpus": os.cpu_count(), "runs": runs, "table": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()

"""Against the hooks users already have: gtopk_ext's hook next to DDP's allreduce, ``fp16_compress_hook``,
``bf16_compress_hook`` and PowerSGD, and a no-communication compute floor, training the same model on the same
batches in one Gloo process group, each rank behind an emulated link (bench/emulated_network.py: its own network
namespace, ``tc tbf`` at ``--rate``; needs root) or, with ``--loopback``, on 127.0.0.1.

Every method has its own DDP model from the same initial weights and gets the same batches; the methods take
their steps interleaved, the order rotated every step, each step started by a barrier, so machine load and
network drift hit all alike. Per method:

- ms/step: the slowest rank's zero_grad + forward + backward (DDP's wait for every bucket included) + optimizer
  step; median and p25-p75 over the steps after the first ``WARMUP_STEPS`` (DDP rebuilds its buckets after the
  first; the hooks run dense warm-up iterations). Evaluation is outside every timed step.
- MB sent per rank per step: from the rank's interface counter (tx_bytes in its namespace, TCP/IP headers and
  ACKs included; not on loopback) read around that method's steps, and from the method's own accounting
  (gtopk_ext: ``state.stats()``; PowerSGD: ring allreduces of the elements it counts; DDP and the fp16/bf16
  hooks: a ring allreduce of the model).
- CPU ms/step per rank: the process's CPU time (all threads: Gloo's and any hook's worker count) over the step.
- test accuracy every ``--eval-every`` steps (rank 0's replica), and the steps and training seconds (sum of the
  slowest rank's step times) to reach ``--target``.
- the machine's load from other processes during the run: all busy CPU time (/proc/stat) minus the ranks' and
  this driver's own, in cores.

PowerSGD runs with one bucket (``bucket_cap_mb`` above the model's size): with several buckets on Gloo, its
hook's future callbacks allreduce P and Q on Gloo's threads while the autograd thread issues the next bucket's
allreduce, so ranks issue their collectives in different orders; the group then fails ("Received data size
doesn't match expected size") or hangs until its timeout (here: 2 and 4 ranks, 8 buckets, every run, at the first
compressed step). Every other method keeps DDP's default buckets, as a user would (or ``--bucket-cap-mb``).
gtopk_ext's hook runs each bucket on its communication thread while the backward pass goes on; the ``-sync``
methods force it to finish each bucket inside the hook call, which shows what the overlap is worth.

The floor's hook divides the bucket by the world size and returns: no communication, each rank trains on its own
data. Its accuracy is that of rank 0's replica trained alone; its step time is the compute floor.

    python -m bench.peers --json peers.json --plot peers.png             # CNN, 4 ranks, 1 Gbit/s
    python -m bench.peers --model mlp --steps 40 --methods ddp fp16 powersgd-1 gtopk-0.01 gtopk-0.001 floor
    python -m bench.peers --loopback --world-size 2 --steps 10            # no root: no namespaces, no shaping
    python -m bench.peers --rate 20mbit --world-size 2 --model deep --bucket-cap-mb 2 \
        --methods gtopk-0.01 gtopk-0.01-sync --steps 20                    # what the hook's overlap is worth
"""

# No `from __future__ import annotations`: DDP checks the hooks' annotations against dist.GradBucket.
import argparse
import gc
import hashlib
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gtopk_ext as gx  # noqa: E402
from bench.digits import load_digits_split, make_model  # noqa: E402
from bench.emulated_network import (Networks, TxCounter, cleanup_stale, network_name, parse_rate,  # noqa: E402
                                    join_group, run_ranks, runs_on_loopback)
from bench.gradients import wide_mlp  # noqa: E402
from gtopk_ext.utils import destroy_process_group  # noqa: E402

START_ITER = 2  # dense iterations of every compressing hook (PowerSGD and gtopk_ext need at least 2)
DGC_WARMUP_ITERS = 20  # the dgc methods' sparsity warm-up by default (from DGC_WARMUP_START to theirs)
DGC_WARMUP_START = 0.25  # DGC's
WARMUP_STEPS = START_ITER + 1  # steps left out of the timing and byte statistics
MODELS = ("cnn", "mlp", "deep")
DEEP_LAYERS = 8  # --model deep: this many equal hidden layers, so that many buckets overlap the backward


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce (reduce-scatter + allgather) of ``nbytes``."""
    return 2 * (world_size - 1) * nbytes // world_size


# ---------------------------------------------------------------------------------------------------- methods

class Accounting:
    """A method's own count of what it sent: ``bytes_sent()`` after a step gives this rank's bytes in that step;
    ``buckets()`` the number of buckets its hook saw (None when the hook does not say)."""

    def bytes_sent(self) -> int:
        raise NotImplementedError

    def buckets(self) -> Optional[int]:
        return None


class DenseAccounting(Accounting):
    """Hooks that allreduce every element (DDP's own, fp16/bf16 compression): the model's size on the wire."""

    def __init__(self, numel: int, wire_bytes: int, world_size: int):
        self.per_step = ring_allreduce_bytes(numel * wire_bytes, world_size)

    def bytes_sent(self) -> int:
        return self.per_step


class PowerSGDAccounting(Accounting):
    """PowerSGD counts the elements it allreduces (P, Q and the uncompressed tensors) as it goes; a step that adds
    none ran its dense warm-up."""

    def __init__(self, state: powerSGD_hook.PowerSGDState, numel: int, world_size: int):
        self.state, self.world_size, self.counted = state, world_size, 0
        self.dense = ring_allreduce_bytes(numel * 4, world_size)

    def bytes_sent(self) -> int:
        total = self.state.total_numel_after_compression
        numel, self.counted = total - self.counted, total
        return ring_allreduce_bytes(numel * 4, self.world_size) if numel else self.dense

    def buckets(self) -> Optional[int]:
        return len(self.state.error_dict)


class GtopkExtAccounting(Accounting):
    def __init__(self, state: gx.SparseGradState):
        self.state = state

    def bytes_sent(self) -> int:
        return self.state.stats()["total"]["bytes_sent"]

    def buckets(self) -> Optional[int]:
        return len(self.state.stats()["buckets"])


class NoAccounting(Accounting):
    def bytes_sent(self) -> int:
        return 0


def no_communication_hook(world_size: int, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The compute floor: the bucket divided by the world size, as every averaging hook does, and nothing sent."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer().div_(world_size))
    return future


@dataclass(frozen=True)
class Recipe:
    """One method: ``attach(ddp_model, world_size, args)`` registers its hook (or none) and returns its accounting;
    ``one_bucket``: the DDP model is built with a single bucket; ``momentum_in_hook``: the hook applies the momentum
    (momentum correction), so the optimizer runs without it."""

    label: str
    attach: Callable[[DistributedDataParallel, int, argparse.Namespace], Accounting]
    one_bucket: bool = False
    momentum_in_hook: bool = False


def numel_of(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def allreduce_recipe(label: str, hook=None, wire_bytes: int = 4) -> Recipe:
    def attach(ddp, world_size, args):
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        return DenseAccounting(numel_of(ddp), wire_bytes, world_size)
    return Recipe(label, attach)


def powersgd_recipe(rank: int) -> Recipe:
    def attach(ddp, world_size, args):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=START_ITER)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return PowerSGDAccounting(state, numel_of(ddp), world_size)
    return Recipe(f"PowerSGD rank {rank} (one bucket)", attach, one_bucket=True)


def gtopk_ext_recipe(label: str, **state_kwargs) -> Recipe:
    """gtopk_ext's hook with ``SparseGradState(**state_kwargs)`` and the shared dense warm-up."""
    def attach(ddp, world_size, args):
        state = gx.SparseGradState(start_iter=START_ITER, stats_logging_frequency=0, **state_kwargs)
        ddp.register_comm_hook(state, gx.sparse_grad_hook)
        return GtopkExtAccounting(state)
    return Recipe(label, attach)


def dgc_recipe(density: float, per_tensor: bool = False) -> Recipe:
    """gtopk_ext with Deep Gradient Compression's momentum correction (the optimizer's momentum moves into the
    hook) and its exponential sparsity warm-up from ``--dgc-warmup-start`` over the first ``--dgc-warmup``
    iterations, with momentum factor masking after the warm-up (during it most elements are sent nearly every
    step: masking would train them without momentum; bench.demo measured it); ``per_tensor`` (or
    ``--dgc-per-tensor``): each parameter selects its share of k. The other levers are the ``--dgc-*`` options
    (:func:`add_dgc_arguments`)."""
    def attach(ddp, world_size, args):
        dense_below = args.dgc_min_compress_numel
        optional = {} if dense_below is None else {"min_compress_numel": dense_below}  # None: the hook's default
        schedule = gx.exponential_warmup(density, args.dgc_warmup, start_density=args.dgc_warmup_start)
        state = gx.SparseGradState(
            start_iter=args.dgc_dense_steps, stats_logging_frequency=0, density=density, momentum=args.momentum,
            nesterov=args.dgc_nesterov, clip_norm=args.dgc_clip_norm, per_tensor=per_tensor or args.dgc_per_tensor,
            density_schedule=schedule, masking_start_iter=args.dgc_warmup, **optional)
        ddp.register_comm_hook(state, gx.sparse_grad_hook)
        return GtopkExtAccounting(state)
    label = f"Gaussian-k + gTop-k, d={density:g}, momentum correction + warm-up" + (" + per-tensor" * per_tensor)
    return Recipe(label, attach, momentum_in_hook=True)


def add_dgc_arguments(parser: argparse.ArgumentParser) -> None:
    """The levers of :func:`dgc_recipe` (bench.peers and bench.lm): the defaults are the recipe."""
    parser.add_argument("--dgc-warmup", type=int, default=DGC_WARMUP_ITERS,
                        help="iterations of the dgc methods' sparsity warm-up (masking starts after it)")
    parser.add_argument("--dgc-warmup-start", type=float, default=DGC_WARMUP_START,
                        help="the density the warm-up starts from (falling geometrically to the method's)")
    parser.add_argument("--dgc-dense-steps", type=int, default=START_ITER,
                        help="dense allreduce steps (at least 2), the warm-up's first iterations included")
    parser.add_argument("--dgc-per-tensor", action="store_true",
                        help="each parameter of a bucket selects its share of k")
    parser.add_argument("--dgc-nesterov", action="store_true", help="Nesterov momentum correction")
    parser.add_argument("--dgc-clip-norm", type=float, default=None,
                        help="local gradient clipping: each bucket's norm at most this / sqrt(P)")
    parser.add_argument("--dgc-min-compress-numel", type=int, default=None,
                        help="buckets of fewer elements go dense (default: the hook's)")


def floor_recipe() -> Recipe:
    def attach(ddp, world_size, args):
        ddp.register_comm_hook(world_size, no_communication_hook)
        return NoAccounting()
    return Recipe("no communication (compute floor)", attach)


# The methods by name; a new recipe (the best gtopk_ext settings of the day) is one more entry.
RECIPES: dict[str, Recipe] = {
    "ddp": allreduce_recipe("DDP allreduce"),
    "fp16": allreduce_recipe("fp16_compress_hook", default_hooks.fp16_compress_hook, wire_bytes=2),
    "bf16": allreduce_recipe("bf16_compress_hook", default_hooks.bf16_compress_hook, wire_bytes=2),
    **{f"powersgd-{rank}": powersgd_recipe(rank) for rank in (1, 2, 4)},
    **{f"{collective}-{density:g}": gtopk_ext_recipe(f"Gaussian-k + {collective}, d={density:g}",
                                                     density=density, collective=collective)
       for collective in ("gtopk", "allgather", "oktopk") for density in (0.01, 0.001)},
    **{f"dgc-{density:g}": dgc_recipe(density) for density in (0.01, 0.001)},
    **{f"gtopk-{density:g}-sync": gtopk_ext_recipe(f"Gaussian-k + gtopk, d={density:g}, each bucket finished in "
                                                   f"the hook call", density=density, synchronous=True)
       for density in (0.01, 0.001)},
    "floor": floor_recipe(),
}


# ------------------------------------------------------------------------------------------------ worker side

def build_model(args: argparse.Namespace, seed: int) -> nn.Module:
    if args.model == "cnn":
        return make_model("cnn", seed)
    if args.model == "mlp":
        return wide_mlp(args.mlp_params, seed)
    width = max(16, round(math.sqrt(args.mlp_params / DEEP_LAYERS)))
    torch.manual_seed(seed)
    layers = [nn.Flatten(), nn.Linear(64, width), nn.ReLU()]
    for _ in range(DEEP_LAYERS - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class Contestant:
    """One method's DDP model, optimizer and accounting, and what its steps measured on this rank."""

    def __init__(self, recipe: Recipe, args: argparse.Namespace, seed: int, world_size: int):
        model = build_model(args, seed)  # the same initial weights for every method
        # One bucket: a cap above the model's size (DDP's first bucket then has that cap too).
        cap_mb = numel_of(model) * 4 / 2**20 + 1 if recipe.one_bucket else args.bucket_cap_mb
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=cap_mb)
        self.accounting = recipe.attach(self.ddp, world_size, args)
        in_optimizer = not recipe.momentum_in_hook
        self.optimizer = torch.optim.SGD(model.parameters(), lr=args.lr,
                                         momentum=args.momentum if in_optimizer else 0.0,
                                         nesterov=args.nesterov and in_optimizer)
        self.seconds, self.cpu_seconds, self.tx_bytes, self.own_bytes = [], [], [], []
        self.evals: list[tuple[int, float]] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, counter: TxCounter) -> None:
        dist.barrier()  # every rank starts the step together: the slowest rank's time is the step's
        tx, cpu, start = counter.read(), time.process_time(), time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(self.ddp(x), y).backward()
        self.optimizer.step()
        self.seconds.append(time.perf_counter() - start)
        self.cpu_seconds.append(time.process_time() - cpu)
        self.tx_bytes.append(counter.read() - tx)
        self.own_bytes.append(self.accounting.bytes_sent())

    @torch.no_grad()
    def evaluate(self, step: int, test_x: torch.Tensor, test_y: torch.Tensor) -> None:
        accuracy = (self.ddp.module(test_x).argmax(1) == test_y).float().mean()
        self.evals.append((step, float(accuracy)))


def step_batches(seed: int, steps: int, n_train: int, rank: int, world_size: int, batch_size: int):
    """This rank's index batch of every step: each global batch of world_size * batch_size drawn from one shuffle
    per epoch shared by every rank (same seed), split by rank; the same for every method."""
    global_batch = world_size * batch_size
    per_epoch = n_train // global_batch
    if per_epoch < 1:
        raise ValueError(f"--batch-size {batch_size} x --world-size {world_size} exceeds the {n_train} training "
                         f"images")
    batches = []
    for epoch in range(-(-steps // per_epoch)):
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        batches += [order[start + rank * batch_size: start + (rank + 1) * batch_size]
                    for start in range(0, per_epoch * global_batch, global_batch)]
    return batches[:steps]


def run_seed(seed: int, args: argparse.Namespace, rank: int, world_size: int, data: tuple, counter: TxCounter,
             progress) -> dict:
    """Every method for ``args.steps`` interleaved steps; rank 0 gets every rank's measurements."""
    train_x, train_y, test_x, test_y = data
    contestants = {name: Contestant(RECIPES[name], args, seed, world_size) for name in args.methods}
    batches = step_batches(seed, args.steps, len(train_y), rank, world_size, args.batch_size)
    if rank == 0:
        for contestant in contestants.values():
            contestant.evaluate(0, test_x, test_y)
    names = list(contestants)
    for step, index in enumerate(batches, start=1):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:  # a rotating order: no method always runs first
            if progress is not None:
                progress.set_description(f"seed {seed} step {step} {name}", refresh=False)
            contestants[name].step(train_x[index], train_y[index], counter)
            if progress is not None:
                progress.update()
        if rank == 0 and (step % args.eval_every == 0 or step == args.steps):
            for contestant in contestants.values():
                contestant.evaluate(step, test_x, test_y)
    results = {}
    for name, contestant in contestants.items():
        mine = torch.tensor([contestant.seconds, contestant.cpu_seconds, contestant.tx_bytes, contestant.own_bytes],
                            dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine)
        seconds, cpu, tx, own = torch.stack(gathered).transpose(0, 1).tolist()  # each [rank][step]
        results[name] = {"seconds": seconds, "cpu_seconds": cpu, "tx_bytes": tx if counter.path else None,
                         "own_bytes": own, "buckets": contestant.accounting.buckets(), "evals": contestant.evals,
                         "digest": parameters_digest(contestant.ddp.module)}
    return results


def parameters_digest(model: nn.Module) -> str:
    """A digest of the parameters' bits: equal digests, bitwise equal models."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run_worker(config: dict) -> None:
    """One rank (started by emulated_network.run_ranks); rank 0 writes every seed's measurements."""
    args, rank, world_size = join_group(config, "timeout")
    try:
        data = load_digits_split()
        counter = TxCounter(config["ifname"])
        progress = None
        if rank == 0 and not args.no_progress:
            from tqdm import tqdm

            # Its output is a log file that the driver streams: redrawn every 0.1 s it would flood a redirect.
            progress = tqdm(total=len(args.seeds) * args.steps * len(args.methods), unit="step",
                            mininterval=0.5 if config["tty"] else 30, file=sys.stdout)
        runs = []
        for seed in args.seeds:
            runs.append(run_seed(seed, args, rank, world_size, data, counter, progress))
            gc.collect()  # DDP models sit in reference cycles: free one seed's models before the next seed's
        if progress is not None:
            progress.close()
        if rank == 0:
            Path(config["out"]).write_text(json.dumps({"parameters": numel_of(build_model(args, 0)), "runs": runs}))
    finally:
        destroy_process_group()


# ------------------------------------------------------------------------------------------------ driver side

def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    low, median, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, median, high


def summarize(name: str, runs: list[dict], args: argparse.Namespace) -> dict:
    """One method's row from every seed's measurements (per step: the slowest rank's time, the mean over ranks of
    CPU time and bytes; pooled over the steps after the warm-up of every seed)."""
    timed = slice(WARMUP_STEPS, None)
    slowest, cpu, tx, own, curves = [], [], [], [], []
    for run in runs:
        step_seconds = [max(per_rank) for per_rank in zip(*run["seconds"])]
        slowest += step_seconds[timed]
        cpu += [statistics.fmean(per_rank) for per_rank in zip(*run["cpu_seconds"])][timed]
        own += [statistics.fmean(per_rank) for per_rank in zip(*run["own_bytes"])][timed]
        if run["tx_bytes"] is not None:
            tx += [statistics.fmean(per_rank) for per_rank in zip(*run["tx_bytes"])][timed]
        elapsed = [0.0]
        for seconds in step_seconds:
            elapsed.append(elapsed[-1] + seconds)
        curves.append([{"step": step, "accuracy": accuracy, "train_seconds": elapsed[step]}
                       for step, accuracy in run["evals"]])
    low, median, high = quartiles(slowest)
    reached = [next((point for point in curve if point["accuracy"] >= args.target), None) for curve in curves]
    all_reached = all(point is not None for point in reached)
    return {
        "method": name, "label": RECIPES[name].label, "ms_per_step": 1e3 * median, "ms_per_step_p25": 1e3 * low,
        "ms_per_step_p75": 1e3 * high, "cpu_ms_per_step": 1e3 * statistics.median(cpu),
        "tx_mb_per_step": statistics.fmean(tx) / 1e6 if tx else None,
        "own_mb_per_step": statistics.fmean(own) / 1e6, "buckets": runs[0]["buckets"],
        "final_accuracy": statistics.fmean(curve[-1]["accuracy"] for curve in curves),
        "steps_to_target": statistics.median(p["step"] for p in reached) if all_reached else None,
        "seconds_to_target": statistics.median(p["train_seconds"] for p in reached) if all_reached else None,
        "curves": curves,
    }


def cpu_busy_seconds() -> float:
    """Busy CPU time of the whole machine since boot (/proc/stat: everything but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    guest = sum(fields[8:10])  # guest time is counted in user time already
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU time of this driver and its finished children (the ranks)."""
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def markdown_table(rows: list[dict], args: argparse.Namespace) -> str:
    ddp = next((row for row in rows if row["method"] == "ddp"), None)
    target = f"{100 * args.target:g}%"
    lines = [f"| method | ms/step (p25-p75) | vs DDP | MB/rank/step wire | MB/rank/step own | CPU ms/step/rank | "
             f"test acc | steps to {target} | s to {target} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        ratio = f"{row['ms_per_step'] / ddp['ms_per_step']:.2f}x" if ddp else "-"
        wire = "-" if row["tx_mb_per_step"] is None else f"{row['tx_mb_per_step']:.3f}"
        steps = "-" if row["steps_to_target"] is None else f"{row['steps_to_target']:g}"
        seconds = "-" if row["seconds_to_target"] is None else f"{row['seconds_to_target']:.1f}"
        lines.append(f"| {row['label']} | {row['ms_per_step']:.1f} ({row['ms_per_step_p25']:.1f}-"
                     f"{row['ms_per_step_p75']:.1f}) | {ratio} | {wire} | {row['own_mb_per_step']:.3f} | "
                     f"{row['cpu_ms_per_step']:.1f} | {100 * row['final_accuracy']:.1f}% | {steps} | {seconds} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Test accuracy against training seconds, one line per method (means over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for row in rows:
        points = list(zip(*row["curves"]))  # per eval: one point per seed
        style = {"color": "black", "linestyle": "--"} if row["method"] == "floor" else {}
        ax.plot([statistics.fmean(p["train_seconds"] for p in seeds) for seeds in points],
                [100 * statistics.fmean(p["accuracy"] for p in seeds) for seeds in points],
                marker=".", label=row["label"], **style)
    ax.set_xlabel("training seconds (slowest rank's steps, evaluation excluded)")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    parser.add_argument("--model", choices=MODELS, default="cnn",
                        help="cnn: the demo's CNN (0.6M parameters); mlp: 64-h-h-10 with about --mlp-params; "
                             f"deep: {DEEP_LAYERS} equal hidden layers with about --mlp-params")
    parser.add_argument("--mlp-params", type=lambda s: int(float(s)), default=17_100_000,
                        help="parameters of --model mlp or deep (17.1M: mlp's h = 4097)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket cap of every method but PowerSGD (default: DDP's own, 25)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rate", type=parse_rate, default=parse_rate("1gbit"),
                        help="every rank in its own network namespace behind a link of this rate (needs root)")
    parser.add_argument("--loopback", action="store_true", help="plain processes on 127.0.0.1, no shaping")
    parser.add_argument("--steps", type=int, default=100, help="steps of every method per seed")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.9, help="test accuracy whose steps and seconds to report")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="one interleaved run per seed (initial weights and batches); statistics pool them")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--nesterov", action="store_true",
                        help="Nesterov momentum in the optimizer (the dgc methods': --dgc-nesterov, in the hook)")
    add_dgc_arguments(parser)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the whole job may take")
    parser.add_argument("--prefix", default="gxpeers", help="name prefix of the namespaces this run creates")
    parser.add_argument("--json", type=Path, help="write the settings, the load, every measurement and the table")
    parser.add_argument("--plot", type=Path, default=Path("peers.png"), help="accuracy against training seconds")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    for name in ("world_size", "steps", "eval_every", "batch_size", "mlp_params"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps left out of the statistics, got "
                     f"{args.steps}")
    if not 0 < args.target <= 1:
        parser.error(f"--target must be an accuracy in (0, 1], got {args.target}")
    args.methods = list(dict.fromkeys(args.methods))
    args.seeds = list(dict.fromkeys(args.seeds))
    return args


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(json.loads(args.worker.read_text()))
        return 0
    args.loopback = runs_on_loopback("peers", args.loopback)
    network = network_name(None if args.loopback else args.rate)
    networks = Networks(args.prefix)
    if not args.loopback:
        cleanup_stale(args.prefix)
    try:
        with tempfile.TemporaryDirectory(prefix="peers_") as tmp:
            links = None if args.loopback else networks.create(args.world_size, args.rate)
            out = Path(tmp) / "runs.json"
            worker_args = {key: str(value) if isinstance(value, Path) else value
                           for key, value in vars(args).items() if key != "worker"}
            busy, ours, started = cpu_busy_seconds(), own_cpu_seconds(), time.perf_counter()
            load_before = os.getloadavg()
            run_ranks("bench.peers", args.world_size, links,
                      {"args": worker_args, "out": str(out), "tty": sys.stdout.isatty()}, Path(tmp), "peers",
                      args.timeout)
            wall = time.perf_counter() - started
            others = max(0.0, cpu_busy_seconds() - busy - (own_cpu_seconds() - ours))
            measured = json.loads(out.read_text())
    finally:
        networks.close()
    load = {"wall_seconds": wall, "cpus": os.cpu_count(), "other_processes_cores": others / wall,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    runs = measured["runs"]
    rows = [summarize(name, [run[name] for run in runs], args) for name in args.methods]
    model = f"{args.model.upper()} ({measured['parameters'] / 1e6:.3g}M parameters)"
    setting = (f"{args.world_size} ranks on {network}, digits, {model}, batch {args.batch_size}/rank, "
               f"{args.steps} steps, seeds {' '.join(map(str, args.seeds))}")
    print(f"\n{setting}; steps after the first {WARMUP_STEPS}; other processes kept "
          f"{load['other_processes_cores']:.2f} of {load['cpus']} cores busy\n")
    print(markdown_table(rows, args))
    for name in args.methods:  # the hook forced to finish each bucket in the call must not change a bit
        if name.endswith("-sync") and name[:-len("-sync")] in args.methods:
            equal = all(run[name]["digest"] == run[name[:-len("-sync")]]["digest"] for run in runs)
            print(f"\n{name[:-len('-sync')]} and {name}: parameters bitwise equal after every seed: {equal}")
    plot(rows, args.plot, setting)
    print(f"\nwrote {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({
            "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
            "network": network, "torch": torch.__version__, "machine": platform.platform(), "load": load,
            "warmup_steps": WARMUP_STEPS, "parameters": measured["parameters"], "table": rows, "runs": runs}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

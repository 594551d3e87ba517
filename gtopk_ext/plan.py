"""Which method trains fastest on a cluster: each method's step time from the byte formulas and the link, and its time
to DDP's loss from the steps it needed in the races (docs/race.md), against DDP, the 16-bit hooks, PowerSGD and
DiLoCo.

    python -m gtopk_ext.plan --params 1.3e9 --tokens-per-gpu 16384 --gpu-tflops 400 --link 10gbit --nodes 8

The model: a step computes 6NT/F (N parameters, T tokens per GPU, F flop/s achieved), then exchanges what the
method sends between the nodes (inside a node the exchange is far faster and left out): a ring allreduce's 2(n-1)/n
of its bytes for the dense methods and PowerSGD, the package's byte formula for the sparse ones, a local method's
once every H steps; at the link's rate with the frames' headers, plus a latency per message. ``--overlap`` of the
compute hides a per-step method's exchange (DDP's buckets go out during the backward). The dense steps before a
method's steady state (PowerSGD's 2, the AdamW recipe's 2) are counted apart, and the package's own work per
element (selection and error feedback; ``--select-ns``, measured on an H100: 0.48 ms for 25M elements) per step.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Callable

from gtopk_ext.collectives import collective_named
from gtopk_ext.costs import WIRE_OVERHEAD, parse_rate, ring_allreduce_bytes
from gtopk_ext.wire import wire_named

# Bytes per element of each dense step before a method's steady state: PowerSGD's and the AdamW recipe's 2 float32
# steps (DDP rebuilds its buckets after the first).
DENSE_START = (4, 4)


def gpu_ratio(tflops: float, tokens: float, link_bps: float) -> float:
    """R of data-parallel nodes that achieve ``tflops`` on ``tokens`` per GPU and step over ``link_bps`` links:
    4F / (3 T bw), the limit of many nodes (each node's link carries 8N bytes a step)."""
    return 4 * tflops * 1e12 / (3 * tokens * link_bps / 8)


@dataclass(frozen=True)
class Cluster:
    params: float
    compute_s: float  # one step's compute on one GPU
    link_bps: float
    nodes: int
    gpus_per_node: int = 8
    latency_s: float = 20e-6
    d_model: int = 2048
    overlap: float = 2 / 3
    select_s: float = 0.48e-3 / 25e6  # per element and step, the package's selection and error feedback

    @property
    def ratio(self) -> float:
        """R: DDP's exchange time over the compute's, its ring on these nodes (:func:`gpu_ratio`: many nodes)."""
        return self.seconds(ring_allreduce_bytes(4 * round(self.params), self.nodes), 0) / self.compute_s

    def seconds(self, link_bytes: float, messages: float) -> float:
        return 8 * WIRE_OVERHEAD * link_bytes / self.link_bps + messages * self.latency_s


@dataclass(frozen=True)
class Method:
    """A method as the races ran it: its name there, bytes a node's link carries at an exchange, exchanges every
    ``period`` steps (1: every step, overlapped with the backward), and its steps to DDP's loss over DDP's
    (measured: docs/race.md; None where not measured)."""

    name: str
    label: str
    exchange: Callable[[Cluster], tuple[float, float]]  # bytes on a node's link and messages, per exchange
    steps_vs_ddp: float | None
    period: int = 1
    sparse: bool = False  # the package's selection runs on every GPU's gradient (its node's share)
    warmup: tuple[int, ...] = ()  # dense steps first: bytes per element of each
    work: float = 1.0  # the method's own work per element, in units of the selection's (``select_s``)

    def step_seconds(self, c: Cluster) -> float:
        work = self.work * c.select_s * c.params / c.gpus_per_node / self.period if self.sparse else 0.0
        return step_seconds(c, *self.exchange(c), self.period) + work

    def seconds_to(self, c: Cluster, ddp_steps: float) -> float | None:
        """Seconds to DDP's loss after ``ddp_steps`` of DDP's steps."""
        if self.steps_vs_ddp is None:
            return None
        steps = self.steps_vs_ddp * ddp_steps
        warm = self.warmup[:math.ceil(steps)]
        return sum(step_seconds(c, *dense(c, size)) for size in warm) + (steps - len(warm)) * self.step_seconds(c)


def step_seconds(c: Cluster, link_bytes: float, messages: float, period: int = 1) -> float:
    """The compute, then an exchange of ``link_bytes`` in ``messages`` every ``period`` steps (every step: the
    compute's ``overlap`` hides it in part)."""
    exchange = c.seconds(link_bytes, messages) / period
    return c.compute_s + max(0.0, exchange - (c.overlap * c.compute_s if period == 1 else 0.0))


def dense(c: Cluster, element_bytes: int) -> tuple[float, float]:
    """A ring allreduce between the nodes: its bytes on a node's link and messages."""
    return ring_allreduce_bytes(element_bytes * round(c.params), c.nodes), 2 * (c.nodes - 1)


def powersgd(rank: int):
    """P and Q of rank ``rank`` for each matrix, allreduced: (m + n) r of m n elements; a transformer's matrices are
    d x d (attention, 1/3 of the elements) and d x 4d (the MLP, 2/3): 1.5 r / d of the elements."""
    return lambda c: (ring_allreduce_bytes(4 * round(1.5 * rank / c.d_model * c.params), c.nodes), 4 * (c.nodes - 1))


def sparse_exchange(collective: str, wire: str, density: float):
    """A sparse exchange between the nodes at ``density``: the package's byte formula for ``collective`` on ``wire``
    (gTop-k: log2(n) rounds; the allgather: every node's k pairs to every other), in its messages."""
    def exchange(c: Cluster) -> tuple[float, float]:
        numel, reducer = round(c.params), collective_named(collective)
        k = max(1, round(density * numel))
        return reducer.mean_bytes(numel, k, c.nodes, wire_named(wire)), reducer.messages(c.nodes)
    return exchange


# The LM race's methods (docs/race.md: 4 ranks, the means of seeds 0 and 1; the 4-bit wire's in
# docs/language_model.md): steps to DDP's 500-step loss over DDP's steps (490) on the same 1000-step schedule; None:
# not reached in 1000 (over 2.04x). The AdamW recipe's work per element is 2.9 selections' (the DCT there and back,
# a top-k per chunk, the decoding of every rank's message), measured at R = 3 on the race's CPUs (docs/race.md); not
# measured on a GPU.
ADAMW_WORK = 2.9
METHODS = (
    Method("ddp", "DDP", lambda c: dense(c, 4), 1.0),
    Method("bf16", "bf16_compress_hook", lambda c: dense(c, 2), 1.0),
    Method("powersgd-4", "PowerSGD rank 4", powersgd(4), 780 / 490, warmup=DENSE_START),
    Method("diloco-32", "DiLoCo H=32 (dense; outer lr 0.7, Nesterov 0.9)", lambda c: dense(c, 4), 920 / 490,
           period=32),
    Method("adamw-0.01", "gtopk_ext AdamW recipe, d=0.01", sparse_exchange("allgather", "compact", 0.01), 480 / 490,
           sparse=True, work=ADAMW_WORK),
    Method("adamw-0.001", "gtopk_ext AdamW recipe, d=0.001", sparse_exchange("allgather", "compact", 0.001), None,
           sparse=True, work=ADAMW_WORK),
    Method("adamw-0.004-4bit", "gtopk_ext AdamW recipe, d=0.004, 4-bit wire",
           sparse_exchange("allgather", "4bit", 0.004), 570 / 490, sparse=True, work=ADAMW_WORK),
    Method("sparse-gtopk-0.02-32", "SparseLocalSGD's earlier defaults (gtopk d=0.02, H=32)",
           sparse_exchange("gtopk", "plain", 0.02), None, period=32, sparse=True),
    Method("sparseloco-0.015625-8", "SparseLocalSGD defaults (SparseLoCo, d=1/64, H=8)",
           sparse_exchange("allgather", "2bit", 1 / 64), 570 / 490, period=8, sparse=True),
)
PEERS = ("ddp", "bf16", "powersgd-4", "diloco-32")


def plan(c: Cluster, ddp_steps: float) -> list[dict]:
    """A row per method: its step (seconds), seconds to DDP's loss, and whether it is a peer."""
    return [{"method": m.name, "label": m.label, "peer": m.name in PEERS, "step_s": m.step_seconds(c),
             "seconds_to_target": m.seconds_to(c, ddp_steps), "steps_vs_ddp": m.steps_vs_ddp} for m in METHODS]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--params", type=float, required=True, help="the model's parameters")
    parser.add_argument("--tokens-per-gpu", type=float, default=16384, help="tokens a GPU computes a step")
    parser.add_argument("--gpu-tflops", type=float, default=400, help="Tflop/s a GPU achieves (H100: about 400)")
    parser.add_argument("--compute-ms", type=float, default=None,
                        help="a step's compute, measured (instead of 6 params tokens / flops)")
    parser.add_argument("--link", type=parse_rate, required=True, help="each node's link, e.g. 10gbit")
    parser.add_argument("--nodes", type=int, required=True, help="nodes (data-parallel groups across the link)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--latency-us", type=float, default=20.0, help="a message's latency between nodes")
    parser.add_argument("--d-model", type=int, default=None,
                        help="the transformer's width, for PowerSGD's bytes (default: from --params, N = 12 L d^2 "
                             "with L = d / 128)")
    parser.add_argument("--overlap", type=float, default=2 / 3,
                        help="share of the compute that hides a per-step exchange (the backward's)")
    parser.add_argument("--select-ns", type=float, default=0.48e6 / 25e6,
                        help="ns per element and step of the package's selection and error feedback")
    parser.add_argument("--ddp-steps", type=float, default=10_000, help="DDP's steps to the loss you want")
    args = parser.parse_args(argv)
    for name in ("params", "tokens_per_gpu", "gpu_tflops", "link", "latency_us", "ddp_steps", "select_ns"):
        if not getattr(args, name) >= 0 or (name not in ("latency_us", "select_ns") and not getattr(args, name) > 0):
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name, low in (("nodes", 2), ("gpus_per_node", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if not 0 <= args.overlap <= 1:
        parser.error(f"--overlap must be in [0, 1], got {args.overlap}")
    return args


def cluster_of(args: argparse.Namespace) -> Cluster:
    compute = (args.compute_ms / 1e3 if args.compute_ms else
               6 * args.params * args.tokens_per_gpu / (args.gpu_tflops * 1e12))
    d_model = args.d_model or 128 * round((args.params * 128 / 12) ** (1 / 3) / 128) or 128
    return Cluster(args.params, compute, args.link, args.nodes, args.gpus_per_node, args.latency_us * 1e-6, d_model,
                   args.overlap, args.select_ns * 1e-9)


def duration(seconds: float) -> str:
    return (f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200
            else f"{seconds / 3600:.1f} h")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    c = cluster_of(args)
    rows = plan(c, args.ddp_steps)
    size = f"{args.params / 1e9:.3g}B" if args.params >= 1e9 else f"{args.params / 1e6:.3g}M"
    link = f"{args.link / 1e9:g} Gbit/s" if args.link >= 1e9 else f"{args.link / 1e6:.4g} Mbit/s"
    print(f"{size} parameters, {args.nodes} nodes x {args.gpus_per_node} GPUs, compute {1e3 * c.compute_s:.0f} ms a "
          f"step, links of {link}: R = {c.ratio:.3g}\n")
    best = min((r["seconds_to_target"] for r in rows if r["seconds_to_target"] is not None), default=None)
    print(f"{'method':56} {'step (ms)':>10} {'steps vs DDP':>13} {'time to target':>15}")
    for r in rows:
        hours = "-" if r["seconds_to_target"] is None else duration(r["seconds_to_target"])
        mark = " <- fastest" if best is not None and r["seconds_to_target"] == best else ""
        steps = "-" if r["steps_vs_ddp"] is None else f"{r['steps_vs_ddp']:.2f}x"
        print(f"{r['label']:56} {1e3 * r['step_s']:10.0f} {steps:>13} {hours:>15}{mark}")
    print(f"\nto DDP's loss after {args.ddp_steps:g} of its steps; '-': not measured in the races (docs/race.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

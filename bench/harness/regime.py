"""The users' regime on this machine: emulated links at the rate where DDP's exchange takes R times the compute's step,
and a method's seconds to a target there from its steps (a full run) and its step time (a short one at that rate).

R = the time DDP's float32 exchange of the gradient takes on the link / the time the step's compute takes. On GPU
nodes with a hierarchical allreduce each node's link carries about 8N bytes a step for N parameters, and the compute
takes 6NT/F (T tokens per GPU and step, F flop/s achieved): R = 4F / (3 T bw), whatever N. This machine computes
100-300x slower than a GPU and its links are not slower, so its races choose the rate by R (docs/race.md).
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from typing import Callable

from bench.harness import cli
from gtopk_ext.costs import WIRE_OVERHEAD, ring_allreduce_bytes
from gtopk_ext.plan import gpu_ratio

TIMED_STEPS = 20  # a method's steady step time: the median over this many steps after its warm-up
CALIBRATION_STEPS = 12  # the compute floor's run; its first 2 steps are left out
# Deployments and the R they have (gpu_ratio): (what, achieved Tflop/s, tokens per GPU and step, link bits/s).
DEPLOYMENTS = (("H100s, 16,384 tokens/GPU, 400 Gbit/s InfiniBand", 400, 16384, 400e9),
               ("H100s, 16,384 tokens/GPU, 100 Gbit/s Ethernet", 400, 16384, 100e9),
               ("A100s, 8,192 tokens/GPU, 25 Gbit/s Ethernet", 150, 8192, 25e9),
               ("H100s, 16,384 tokens/GPU, 10 Gbit/s Ethernet", 400, 16384, 10e9),
               ("H100s, 16,384 tokens/GPU, 1 Gbit/s between sites", 400, 16384, 1e9))


def nearest_deployment(ratio: float) -> tuple[str, float]:
    """The deployment of DEPLOYMENTS whose R is nearest ``ratio`` (by factor), and its R."""
    found = min(DEPLOYMENTS, key=lambda d: abs(math.log(gpu_ratio(*d[1:]) / ratio)))
    return found[0], gpu_ratio(*found[1:])


@dataclass(frozen=True)
class Regime:
    """R, this machine's compute floor (seconds a step, no communication) and DDP's bytes a rank sends a step."""

    ratio: float
    floor_seconds: float
    ddp_bytes: float

    @classmethod
    def of(cls, ratio: float, floor_seconds: float, numel: int, world_size: int) -> Regime:
        """DDP's bytes: a ring allreduce of ``numel`` float32 elements over ``world_size`` ranks."""
        return cls(ratio, floor_seconds, ring_allreduce_bytes(4 * numel, world_size))

    @property
    def rate_bps(self) -> int:
        """The links' rate at which DDP's exchange takes ``ratio`` x the floor's step."""
        return round(8 * WIRE_OVERHEAD * self.ddp_bytes / (self.ratio * self.floor_seconds))

    def describe(self) -> str:
        name, their_ratio = nearest_deployment(self.ratio)
        return (f"regime R = {self.ratio:g}: DDP sends {self.ddp_bytes / 1e6:.3g} MB a rank and step, the compute "
                f"floor's step takes {1e3 * self.floor_seconds:.0f} ms here: links of {self.rate_bps / 1e6:.4g} "
                f"Mbit/s (DDP's exchange {self.ratio * self.floor_seconds:.3g} s); like {name} (R = "
                f"{their_ratio:.2g}); no latency added (the links' own only)")


def measured_ratio(ddp_step_seconds: float, floor_step_seconds: float) -> str:
    """What DDP's step took at the regime's rate, as an R: (DDP's step - the floor's) / the floor's (what the links'
    headers, TCP and Gloo add, less what DDP's overlap of the exchange with the backward hides)."""
    return (f"measured: DDP's step {1e3 * ddp_step_seconds:.0f} ms, the floor's {1e3 * floor_step_seconds:.0f} ms: "
            f"R = {(ddp_step_seconds - floor_step_seconds) / floor_step_seconds:.3g} as DDP ran")


def add_regime_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--regime", type=float, default=None, metavar="R",
                        help="links at the rate where DDP's exchange takes R x the compute floor's step (measured "
                             "first, or --floor-ms); wins over --rate. R = 4F / (3 T bw) on GPU nodes: about 3 for "
                             "H100s at 16k tokens/GPU on 100 Gbit/s Ethernet, 30 on 10 Gbit/s, 300 on 1 Gbit/s")
    parser.add_argument("--floor-ms", type=float, default=None,
                        help="with --regime: the compute floor's ms a step, instead of measuring it")


def check_regime_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("regime", "floor_ms"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.floor_ms is not None and args.regime is None:
        parser.error("--floor-ms goes with --regime")


def link_rate(args: argparse.Namespace, program: str, numel: int,
              measure_floor: Callable[[], float]) -> tuple[int | None, Regime | None]:
    """The links' rate (None: loopback) and the regime: with --regime, the floor's step (``measure_floor()``, or
    --floor-ms) and DDP's float32 ring allreduce of ``numel`` elements over --world-size ranks give it (--rate and
    --floor-ms are set, and what it chose is said); else --rate's (cli.link_rate)."""
    if args.regime is None:
        return cli.link_rate(program, args), None
    cli.require_emulation(f"{program} --regime")
    regime = Regime.of(args.regime, args.floor_ms / 1e3 if args.floor_ms else measure_floor(), numel, args.world_size)
    args.rate, args.floor_ms = regime.rate_bps, 1e3 * regime.floor_seconds
    print(regime.describe(), flush=True)
    return args.rate, regime


def floor_seconds(step_seconds: list[float]) -> float:
    """The compute floor's step from a calibration run's step times: the median after the first 2."""
    return statistics.median(step_seconds[2:] or step_seconds)


def probe_steps(warmup: int, period: int | None = None) -> int:
    """Steps a method runs to time its steady state: its warm-up and TIMED_STEPS more, or (a method exchanging every
    ``period`` steps) whole periods, at least TIMED_STEPS steps."""
    return period * math.ceil(TIMED_STEPS / period) if period else warmup + TIMED_STEPS


def steady_seconds(step_seconds: list[float], period: int | None = None, skip: int = 0) -> float:
    """A method's step after its warm-up, from a probe's ``step_seconds`` (:func:`probe_steps` of them): the median of
    the last TIMED_STEPS, or (exchanging every ``period`` steps) the mean over the whole periods after the first
    ``skip`` steps (an overlapped exchange's first period waits for none)."""
    return statistics.fmean(step_seconds[skip:]) if period else statistics.median(step_seconds[-TIMED_STEPS:])


def seconds_for(steps: int, step_seconds: list[float], period: int | None = None, skip: int = 0) -> float:
    """Seconds ``steps`` steps take, from a probe's ``step_seconds``: the probe's own first steps, then each further
    one at :func:`steady_seconds`."""
    if steps <= len(step_seconds):
        return sum(step_seconds[:steps])
    return sum(step_seconds) + (steps - len(step_seconds)) * steady_seconds(step_seconds, period, skip)

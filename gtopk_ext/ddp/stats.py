"""The DDP hook's statistics: per bucket for the latest step, totals for the run, and a summary to print."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Union

import torch

from gtopk_ext.costs import Traffic, format_bytes, latest_line, sent_and_received

if TYPE_CHECKING:
    from gtopk_ext.ddp.state import SparseGradState

SUMMED = ("numel", "k", "selected", "bytes_sent", "bytes_received", "select_seconds", "exchange_seconds")
SUMMARY_BUCKETS = 12  # rows of buckets a summary shows: it fits one screen


@dataclass
class BucketStats:
    """What the hook did with one bucket in its latest step."""

    path: str  # "sparse", "dense16", "dense8" or "dense" (gtopk_ext.paths); "nonfinite" (a rank's sum was not)
    numel: int
    k: int  # slots sent per rank (numel on the dense paths)
    selected: Union[int, torch.Tensor] = 0  # elements the compressor selected before truncation to k
    select_seconds: float = 0.0  # grad + residual, statistics, compaction, residual update
    exchange_seconds: float = 0.0  # the collective and the average (a dense bucket: from issuing its allreduce)
    traffic: Traffic = field(default_factory=Traffic, repr=False)


class RunTotals:
    """This rank's counts over the run: ``steps`` (iterations), ``compressed_steps`` (those in which a bucket went
    sparse), ``bytes_sent``, ``bytes_received``. Saved in the hook's state_dict, so they continue on resume."""

    FIELDS = ("steps", "compressed_steps", "bytes_sent", "bytes_received")

    def __init__(self, saved: dict | None = None):
        for name in self.FIELDS:
            setattr(self, name, int((saved or {}).get(name, 0)))
        # The BucketStats already counted: a bucket that a step did not reduce again (DDP rebuilt the buckets into
        # fewer) keeps its old one, which must not count twice. Holding them keeps their ids from being reused.
        self._counted: dict[int, BucketStats] = {}

    def add_step(self, buckets: Iterable[BucketStats]) -> None:
        """Counts one iteration, made of the buckets' stats that are new since the previous call."""
        buckets = list(buckets)
        new = [b for b in buckets if id(b) not in self._counted]
        self._counted = {id(b): b for b in buckets}
        self.steps += 1
        self.compressed_steps += any(b.path == "sparse" for b in new)
        self.bytes_sent += sum(b.traffic.sent for b in new)
        self.bytes_received += sum(b.traffic.received for b in new)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.FIELDS}


def step_stats(iteration: int, bucket_stats: dict[int, BucketStats], totals: RunTotals) -> dict:
    """:meth:`SparseGradState.stats`'s dict."""
    buckets = {}
    for index, s in sorted(bucket_stats.items()):
        selected = int(s.selected) if isinstance(s.selected, torch.Tensor) else s.selected
        buckets[index] = {"path": s.path, "numel": s.numel, "k": s.k, "selected": selected,
                          "bytes_sent": s.traffic.sent, "bytes_received": s.traffic.received,
                          "select_seconds": s.select_seconds, "exchange_seconds": s.exchange_seconds}
    total = {key: sum(b[key] for b in buckets.values()) for key in SUMMED}
    return {"iter": iteration, "buckets": buckets, "total": total, "run": totals.as_dict()}


def summary(state: SparseGradState) -> str:
    """:meth:`SparseGradState.summary`: the configuration, the run's totals, the latest step and its buckets."""
    stats = state.stats()
    run, total = stats["run"], stats["total"]
    lines = [f"SparseGradState: {state.compressor} + {state.collective}, density {state.density_at(state.iter):g}, "
             f"{state.wire} wire, error feedback {'on' if state.error_feedback else 'off'}{_momentum(state)}",
             f"run: {run['steps']} steps ({run['compressed_steps']} compressed); "
             + sent_and_received(run["bytes_sent"], run["bytes_received"], run["steps"], "step")]
    if not stats["buckets"]:
        return "\n".join(lines + ["latest step: none yet"])
    lines.append(latest_line("step", stats["iter"], total["bytes_sent"], total["k"], total["numel"],
                             f"selecting {1e3 * total['select_seconds']:.2f} ms, exchanging "
                             f"{1e3 * total['exchange_seconds']:.2f} ms"))
    lines.append(f"  {'bucket':>6} {'path':<9} {'elements':>11} {'k':>9} {'sent':>10} {'select ms':>9} "
                 f"{'exchange ms':>11}")
    rows = list(stats["buckets"].items())
    for index, b in rows[:SUMMARY_BUCKETS]:
        lines.append(f"  {index:>6} {b['path']:<9} {b['numel']:>11,} {b['k']:>9,} {format_bytes(b['bytes_sent']):>10} "
                     f"{1e3 * b['select_seconds']:>9.2f} {1e3 * b['exchange_seconds']:>11.2f}")
    if len(rows) > SUMMARY_BUCKETS:
        lines.append(f"  ... {len(rows) - SUMMARY_BUCKETS} more buckets (state.stats()['buckets'])")
    return "\n".join(lines)


def _momentum(state: SparseGradState) -> str:
    correction = state.momentum_correction
    if correction is None:
        return ""
    parts = [f"momentum correction {correction.momentum:g}", "nesterov" if correction.nesterov else "",
             f"weight decay {correction.weight_decay:g}" if correction.weight_decay else "",
             f"clip norm {correction.clip_norm:g}" if correction.clip_norm is not None else ""]
    return "".join(f", {p}" for p in parts if p)


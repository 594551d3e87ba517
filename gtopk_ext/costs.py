"""What moving bytes costs: this rank's byte counter, and the byte formulas of the collectives (the ring
algorithms the backends run; the hierarchical collective's node phases), shared by the library and the benchmarks'
cost model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Traffic:
    """Bytes this rank sent and received, counted by the collectives that are given one. Collectives run by the
    backend (all_gather, all_reduce) are counted as a ring algorithm moves them."""

    sent: int = 0
    received: int = 0

    def add(self, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received


def format_bytes(count: float) -> str:
    """A byte count to read: 812 B, 4.1 kB, 2.35 MB (powers of 1000)."""
    units, power = ("B", "kB", "MB", "GB"), 0
    while abs(count) >= 1000 and power < len(units) - 1:
        count, power = count / 1000, power + 1
    return f"{count:.0f} B" if power == 0 else f"{count:.3g} {units[power]}"


def sent_and_received(sent: int, received: int, times: int, unit: str) -> str:
    """The summaries' run line (SparseGradState's and SparseLocalSGD's): this rank's totals and what it sent per
    ``unit`` over ``times`` of them."""
    return (f"this rank sent {format_bytes(sent)}, received {format_bytes(received)} "
            f"({format_bytes(sent / max(times, 1))} sent a {unit})")


def latest_line(unit: str, index: int, sent: int, k: int, numel: int, rest: str) -> str:
    """The summaries' line of the latest step or sync: its bytes sent and k (per rank) of its elements, then
    ``rest``."""
    return (f"latest {unit} (#{index}): sent {format_bytes(sent)}, k {k:,} of {numel:,} elements "
            f"({k / max(numel, 1):.4g}), {rest}")


def ring_allgather_bytes(nbytes: int, size: int) -> int:
    return (size - 1) * nbytes


def ring_allreduce_bytes(nbytes: int, size: int) -> int:
    return 2 * (size - 1) * nbytes // size


def inner_result_slots(inner: str, share: int, nodes: int) -> int:
    """At most how many slots the ``inner`` collective's result on a shard has, ``share`` selected on each of
    ``nodes`` nodes: gTop-k and Ok-Topk keep ``share``, the allgather their union."""
    return share * nodes if inner == "allgather" else share


def node_gather_bytes(width: int, most: int, element_size: int) -> int:
    """Bytes of one rank's message in :func:`node_allgather`: a header and ``most`` index-value pairs, or the
    widest shard (``width`` elements) and its flags when that is fewer."""
    return min(8 + most * (4 + element_size), (width + 1) * element_size)

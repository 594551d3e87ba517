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

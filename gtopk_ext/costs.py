"""What moving bytes costs: byte formulas, the summaries' byte lines, the alpha-beta terms bench/cost_model.py fits."""

from __future__ import annotations

import argparse
import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gtopk_ext.collectives import Collective
    from gtopk_ext.wire import Wire


# Bytes on an Ethernet link per byte of TCP payload in full 1500-byte frames: Ethernet (14), IP (20), TCP (32) headers.
WIRE_OVERHEAD = (1448 + 66) / 1448


def parse_rate(text: str) -> int:
    """A link's rate for argparse: '1gbit', '100mbit', '250kbit' or a plain number of bits per second -> bits per
    second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmg]?)(?:bit)?", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"rate must look like 1gbit, 100mbit or 5e8, got {text!r}")
    return int(float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]])


SUMMARY_ROWS = 12  # rows of buckets or groups a summary shows: it fits one screen


def format_bytes(count: float) -> str:
    """A byte count to read: 812 B, 4.1 kB, 2.35 MB (powers of 1000)."""
    units, power = ("B", "kB", "MB", "GB"), 0
    while abs(count) >= 1000 and power < len(units) - 1:
        count, power = count / 1000, power + 1
    return f"{count:.0f} B" if power == 0 else f"{count:.3g} {units[power]}"


def sent_and_received(sent: int, received: int, times: int, unit: str) -> str:
    """The summaries' run line: this rank's totals and what it sent per ``unit`` over ``times`` of them."""
    return (f"this rank sent {format_bytes(sent)}, received {format_bytes(received)} "
            f"({format_bytes(sent / max(times, 1))} sent a {unit})")


def latest_line(unit: str, index: int, sent: int, k: int, numel: int, rest: str) -> str:
    """The summaries' line of the latest step or sync, then ``rest``."""
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


def exchange_terms(collective: Collective, numel: int, k: int, size: int, share: float, wire: Wire,
                   local: int = 1) -> dict[str, float]:
    """``collective``'s :meth:`~gtopk_ext.collectives.Collective.cost_terms` on ``size`` ranks in nodes of
    ``local`` (every message inside the node when there is one node)."""
    if local < 1 or size % local:
        raise ValueError(f"local must divide size, got local={local}, size={size}")
    terms = collective.cost_terms(numel, k, size, local, share, wire)
    if size == local:
        terms["alpha_intra"] = terms.get("alpha_intra", 0.0) + terms.pop("alpha")
        terms["beta_intra"] = terms.get("beta_intra", 0.0) + terms.pop("beta")
    return terms


def hierarchical_terms(inner: Collective, numel: int, k: int, size: int, share: float, wire: Wire,
                       local: int) -> dict[str, float]:
    """The hierarchical collective's terms in nodes of ``local`` ranks: the node's reduce-scatter and allgather, its
    passes over the gradient (``copy``), and ``inner`` between the nodes on each shard (sharing the node's link)."""
    if local < 1 or size % local:
        raise ValueError(f"local must divide size, got local={local}, size={size}")
    nodes, shard, shard_k = size // local, math.ceil(numel / local), math.ceil(max(k, local) / local)
    gathered = node_gather_bytes(shard, min(shard, inner_result_slots(inner.name, shard_k, nodes)), 4)
    terms = {"alpha_intra": 2 * (local - 1), "beta_intra": (local - 1) * (4 * shard + gathered),
             "copy": numel * share}
    if nodes > 1:
        for name, value in exchange_terms(inner, shard, shard_k, nodes, share, wire).items():
            terms[name] = terms.get(name, 0.0) + value * (local if name == "beta" else 1)
    return terms

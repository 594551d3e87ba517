"""What each collective puts on the links in one exchange: the byte and message counts of the cost model's formulas
(docs/scaling.md states them), which bench/netem_scaling.py also prints beside what it measured."""

from __future__ import annotations

import math

import torch

from gtopk_ext.costs import inner_result_slots, node_gather_bytes
from gtopk_ext.wire import payload_size

METHODS = ("dense", "allgather", "gtopk", "oktopk", "hierarchical")
SPARSE_METHODS = ("allgather", "gtopk", "oktopk")
WIRES = ("plain", "compact")


def message_bytes(k: int, numel: int, wire: str = "plain") -> int:
    """A message of k float32 pairs of a tensor of ``numel`` elements, its count in front."""
    return payload_size(wire, k, numel, torch.float32, head_words=1)


def butterfly(world_size: int) -> tuple[int, bool]:
    """(gTop-k's rounds, whether ranks beyond the largest power of two fold in and get the result back)."""
    largest = 1 << (world_size.bit_length() - 1)
    return largest.bit_length() - 1, largest != world_size


def bytes_per_rank(method: str, numel: int, k: int, world_size: int, wire: str = "plain") -> float:
    """Bytes a rank sends in one exchange, the mean over the ranks, on one level of network: what its link
    carries, but for gTop-k on a P that is not a power of two, whose fold and return only the ranks beyond the
    largest power of two take part in (each sends a message and gets one back with its mask)."""
    terms = features(method, numel, k, world_size, 1.0, wire)
    rounds, folds = butterfly(world_size)
    if method != "gtopk" or not folds:
        return terms["beta"]
    largest, message = 1 << rounds, message_bytes(k, numel, wire)
    check = 2 * (world_size - 1) / world_size * 4 if wire == "compact" else 0
    return (largest * rounds * message + (world_size - largest) * (2 * message + (k + 7) // 8)) / world_size + check


def _flat_features(method: str, numel: int, k: int, p: int, local: int, share: float, wire: str) -> dict:
    """Coefficients of one exchange on p ranks in nodes of ``local``; alpha and beta are the inter-node link's."""
    message = message_bytes(k, numel, wire)
    if method == "dense":
        return {"alpha": 2 * (p - 1), "beta": 2 * (p - 1) / p * 4 * numel}
    if method == "allgather":
        terms = {"alpha": p - 1, "beta": (p - 1) * message, "scatter": p * k * share, "zero": numel * share}
        if wire == "compact":
            terms.update(encode=k * share, decode=(p + 1) * k * share)
        return terms
    if method == "gtopk":
        rounds, folds = butterfly(p)
        intra = min(rounds, local.bit_length() - 1) if local & (local - 1) == 0 else 0
        terms = {"alpha": rounds - intra + 2 * folds, "alpha_intra": intra,
                 "beta": (rounds - intra) * local * message + folds * (2 * message + (k + 7) // 8),
                 "beta_intra": intra * message, "merge": (rounds + folds) * 2 * k * share}
        if wire == "compact":
            terms.update(encode=(rounds + 2 * folds) * k * share, decode=(2 * rounds + 3 * folds) * k * share)
    elif method == "oktopk":  # each of its messages carries its own header (the compact wire's page table)
        pair, header = (8, 0) if wire == "plain" else (4, message_bytes(0, numel, wire))
        terms = {"alpha": 4 * (p - 1),
                 "beta": local * (p - local) / p * 2 * k * pair + 2 * local * (p - local) * header + 24 * (p - 1),
                 "beta_intra": (local - 1) / p * 2 * k * pair + 2 * (local - 1) * header, "merge": 2 * k * share}
        if wire == "compact":
            terms.update(encode=k * share, decode=(1 + 2 * (p - 1) / p) * k * share)
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if wire == "compact":  # the corruption check's int32 allreduce
        terms["alpha"] += 2 * (p - 1)
        terms["beta"] += 2 * (p - 1) / p * 4
    return terms


def features(method: str, numel: int, k: int, world_size: int, share: float, wire: str = "plain", local: int = 1,
             inner: str = "gtopk") -> dict[str, float]:
    """The coefficients of alpha, beta (the link between nodes, or every rank's link when local = 1),
    alpha_intra, beta_intra and the per-element costs in one exchange's time, selection excluded (docs/scaling.md).
    ``share``: how many ranks share one core (compute terms take that much longer); ``local``: ranks per
    node; ``inner``: the hierarchical collective's sparse collective between nodes."""
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {WIRES}, got {wire!r}")
    if local < 1 or world_size % local:
        raise ValueError(f"local must divide world_size, got local={local}, world_size={world_size}")
    nodes = world_size // local
    if method == "hierarchical":
        shard, shard_k = math.ceil(numel / local), math.ceil(max(k, local) / local)
        gathered = node_gather_bytes(shard, min(shard, inner_result_slots(inner, shard_k, nodes)), 4)
        terms = {"alpha_intra": 2 * (local - 1), "beta_intra": (local - 1) * (4 * shard + gathered),
                 "copy": numel * share}
        if nodes > 1:  # the local ranks' inner collectives share the node's link
            for name, value in features(inner, shard, shard_k, nodes, share, wire).items():
                terms[name] = terms.get(name, 0.0) + value * (local if name == "beta" else 1)
        return terms
    terms = _flat_features(method, numel, k, world_size, local, share, wire)
    if nodes == 1:  # every message stays inside the node
        terms["alpha_intra"] = terms.get("alpha_intra", 0.0) + terms.pop("alpha")
        terms["beta_intra"] = terms.get("beta_intra", 0.0) + terms.pop("beta")
    return terms

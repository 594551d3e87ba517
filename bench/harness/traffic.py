"""What each collective puts on the links in one exchange: the byte and message counts of bench/cost_model.py's
formulas (its docstring states them), which bench/netem_scaling.py also prints beside what it measured."""

from __future__ import annotations

import math

from gtopk_ext._contract import wire_num_pages
from gtopk_ext.costs import inner_result_slots, node_gather_bytes

METHODS = ("dense", "allgather", "gtopk", "oktopk", "hierarchical")
SPARSE_METHODS = ("allgather", "gtopk", "oktopk")
WIRES = ("plain", "compact")


def message_bytes(k: int, numel: int, wire: str = "plain", head_words: int = 1) -> int:
    """A message of k pairs of a tensor of ``numel`` elements: ``head_words`` int32 words (the count, ...), then
    plain: 8 bytes a pair; compact: a scale word, the page table (a word per 65,536 elements, +1), 4 bytes a pair."""
    if wire == "plain":
        return 4 * head_words + 8 * k
    return 4 * (head_words + 2 + wire_num_pages(numel)) + 4 * k


def oktopk_run_bytes(n: float, numel: int, wire: str) -> float:
    """One Ok-Topk message of n pairs (its size travels first, as a count): plain, 8 bytes a pair; compact, a
    message of its own with n as the head."""
    return 8 * n if wire == "plain" else message_bytes(0, numel, wire) + 4 * n


def check_allreduce_bytes(world_size: int) -> int:
    """The compact wire's corruption check: one int32 allreduce (a ring's bytes)."""
    return 2 * (world_size - 1) * 4 // world_size


def butterfly(world_size: int) -> tuple[int, bool]:
    """(gTop-k's rounds, whether ranks beyond the largest power of two fold in and get the result back)."""
    largest = 1 << (world_size.bit_length() - 1)
    return largest.bit_length() - 1, largest != world_size


def bytes_per_rank(method: str, numel: int, k: int, world_size: int, wire: str = "plain") -> float:
    """Bytes a rank sends in one exchange, the mean over the ranks, on one level of network."""
    p = world_size
    if method == "dense":
        return 2 * (p - 1) * numel * 4 // p
    if method == "allgather":
        return (p - 1) * message_bytes(k, numel, wire)
    check = check_allreduce_bytes(p) if wire == "compact" else 0
    if method == "gtopk":
        rounds, folds = butterfly(p)
        largest, message = 1 << rounds, message_bytes(k, numel, wire)
        extra = p - largest  # ranks folded in: each sends a message and gets one back with its mask
        return (largest * rounds * message + extra * (2 * message + (k + 7) // 8)) / p + check
    if method == "oktopk":
        return 2 * (p - 1) * oktopk_run_bytes(k / p, numel, wire) + 24 * (p - 1) + check
    raise ValueError(f"method must be one of {METHODS[:4]}, got {method!r}")


def _flat_features(method: str, numel: int, k: int, p: int, local: int, share: float, wire: str) -> dict:
    """Coefficients of one exchange on p ranks in nodes of ``local`` (see the module doc); alpha and beta are the
    inter-node link's."""
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
    elif method == "oktopk":
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
    alpha_intra, beta_intra and the per-element costs in one exchange's time, selection excluded (see the module
    doc). ``share``: how many ranks share one core (compute terms take that much longer); ``local``: ranks per
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

"""The hierarchical collective: dense inside a node (fast links), the error-feedback reduction between nodes among
the ranks of the same local rank, each on its shard; the result shared back inside the node. A composition above
the flat collectives."""

from __future__ import annotations

import functools
import operator
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gtopk_ext.collectives import (SPARSE_COLLECTIVES, OkTopkState, Reduced, Traffic, collective_named,
                                   group_rank_and_size, keep_unapplied)
from gtopk_ext.collectives._transport import sparse_alltoallv
from gtopk_ext.compressors import Compressor, tensor_shares
from gtopk_ext.costs import inner_result_slots, node_gather_bytes, ring_allgather_bytes
from gtopk_ext.message import SparseMessage, padding_message
from gtopk_ext.ops import is_finite
from gtopk_ext.wire import Rounding, WireLike, wire_named


# Per (process group name, local_size): (that group, this rank's node group, its cross-node group); a group
# destroyed and created again under the same name gets new ones.
_node_groups: dict[tuple[str, int], tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]] = {}


@dataclass
class HierarchicalResult:
    """What :func:`hierarchical_allreduce` did on this rank. ``average``: the flat average over the group of what
    was applied, in the tensor's dtype, the same on every rank (None when a flag was raised: nothing changed).
    ``msg``: this rank's selection, indices into the whole tensor; ``applied``: the mask of its slots inside the
    average; ``shard``: the slice this rank selected from (and keeps the residual of)."""

    average: torch.Tensor | None
    msg: SparseMessage
    applied: torch.Tensor
    shard: slice


@dataclass(frozen=True)
class Hierarchical:
    """The DDP hook's option to reduce hierarchically (:func:`hierarchical_allreduce`): a node is ``local_size``
    consecutive ranks of the group (None: torchrun's ``LOCAL_WORLD_SIZE``); the hook's collective and wire run
    between nodes. The node groups are created at the first compressed step (see :func:`node_groups`)."""

    local_size: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "local_size", resolve_local_size(self.local_size))


def resolve_local_size(local_size: int | None) -> int:
    """``local_size``, or torchrun's ``LOCAL_WORLD_SIZE`` when it is None."""
    if local_size is None:
        from_env = os.environ.get("LOCAL_WORLD_SIZE")
        if from_env is None:
            raise ValueError("collective='hierarchical' needs local_size (the ranks per node): LOCAL_WORLD_SIZE is "
                             "not set (torchrun sets it); pass local_size=...")
        local_size = int(from_env)
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
        raise ValueError(f"local_size must be an int >= 1 (the ranks per node), got {local_size!r}")
    return local_size


def node_groups(group: dist.ProcessGroup, local_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (node group: its ``local_size`` consecutive group ranks, cross-node group: the ranks of the same
    local rank on every node), created at the first call and cached. Every rank of ``group`` must make its first
    call at the same point (group names count the groups created before). Only ``group``'s ranks create them:
    when ``group`` is not the whole world, create the groups that every rank must create before this call."""
    key = (group.group_name, local_size)
    if _node_groups.get(key, (None,))[0] is not group:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if size % local_size:
            raise ValueError(f"local_size ({local_size}) must divide the group's size ({size}): a node is local_size "
                             f"consecutive ranks")
        node, local_rank = divmod(rank, local_size)
        node_ranks = [dist.get_global_rank(group, node * local_size + i) for i in range(local_size)]
        cross_ranks = [dist.get_global_rank(group, n * local_size + local_rank) for n in range(size // local_size)]
        _node_groups[key] = (group, dist.new_group(node_ranks, use_local_synchronization=True),
                             dist.new_group(cross_ranks, use_local_synchronization=True))
    return _node_groups[key][1:]


def forget_node_groups() -> None:
    """Let go of the cached groups of :func:`node_groups` (held past ``dist.destroy_process_group``, their Gloo
    threads can abort the process at exit)."""
    _node_groups.clear()


def shard_bounds(numel: int, local_size: int) -> list[int]:
    """The start of each local rank's shard, then the end: ``local_size`` contiguous shards of
    ``ceil(numel / local_size)`` elements, the last ones shorter."""
    width = -(-numel // local_size)
    return [min(numel, width * i) for i in range(local_size + 1)]


def hierarchical_allreduce(tensor: torch.Tensor, residual: torch.Tensor | None, compressor: Compressor, k: int,
                           local_size: int, group: dist.ProcessGroup | None = None, *, inner: str = "gtopk",
                           inner_state: OkTopkState | None = None, step: int | None = None,
                           traffic: Traffic | None = None, flags: torch.Tensor | None = None,
                           nonfinite_flag: int = 1, wire: WireLike = "plain",
                           rounding: Rounding | None = None) -> HierarchicalResult:
    """Dense inside a node, sparse between nodes (a node: ``local_size`` consecutive ranks of ``group``):

    1. a dense reduce-scatter inside the node of ``tensor + residual`` (flat): local rank l gets its node's sum
       of shard l (:func:`shard_bounds`);
    2. local rank l selects its share of k (at least one slot) from that sum with ``compressor`` and runs the
       ``inner`` sparse collective (``inner_state`` for oktopk) with local rank l of the other nodes;
    3. an allgather inside the node of every shard's average: the result, the same on every rank.

    ``residual`` (the tensor's size, or None: no error feedback) is zero outside this rank's shard, and on return
    holds there the shard's node sum minus what was applied. ``flags`` (int32[1], optional): bits this rank
    raises, on return their OR over the group; a non-finite shard raises ``nonfinite_flag``. When any bit is
    raised nothing is applied and ``tensor`` and ``residual`` are unchanged. With the compact ``wire`` the
    rounding errors this rank answers for stay in its residual, and are added to ``rounding`` when given. Every
    rank must pass the same k, local_size, inner and wire."""
    group, rank, size = group_rank_and_size(group)
    if inner not in SPARSE_COLLECTIVES:
        raise ValueError(f"inner must be one of {SPARSE_COLLECTIVES}, got {inner!r}")
    wire = wire_named(wire)
    collective = collective_named(inner, compressor.backend)
    node_group, cross_group = node_groups(group, local_size)
    local_rank, numel, device = rank % local_size, tensor.numel(), tensor.device
    backend = compressor.backend[device]
    bounds = shard_bounds(numel, local_size)
    widths = [end - start for start, end in zip(bounds, bounds[1:])]
    shard = slice(bounds[local_rank], bounds[local_rank + 1])
    width = widths[0]

    # 1. Reduce-scatter inside the node.
    acc = tensor if residual is None else tensor + residual
    shard_acc = node_reduce_scatter(acc, bounds, node_group, local_rank, traffic)

    # 2. The sparse collective between nodes on this shard; what it does not apply stays in `kept`.
    raised = torch.zeros(1, dtype=torch.int32, device=device) if flags is None else flags.clone()
    # At least one slot per nonempty shard: a shard without any would keep its residual forever.
    shares = tensor_shares(max(k, local_size), widths)
    share = shares[local_rank]
    shard_rounding = Rounding()  # indices into the shard
    kept = torch.zeros_like(shard_acc) if residual is not None else None
    if not is_finite(shard_acc):
        raised.bitwise_or_(nonfinite_flag)
    if share and not int(raised) & nonfinite_flag:
        msg = compressor.compress(shard_acc, kept, step=step, k=share)
    else:
        msg = padding_message(shard_acc, max(share, 1))
    if share == 0:  # an empty shard (numel < local_size): on every node alike, nothing to exchange
        reduced = Reduced(summed=shard_acc.float(), applied=torch.zeros(1, dtype=torch.bool, device=device))
    else:
        reduced = collective.reduce(msg, cross_group, wire=wire, traffic=traffic, flags=raised,
                                    rounding=shard_rounding, state=inner_state)
    applied = reduced.applied if reduced.applied is not None else torch.ones(share, dtype=torch.bool, device=device)

    # 3. Allgather inside the node of the shards' averages (as pairs of indices into the shard and values) and flags.
    if reduced.glob is not None:  # gTop-k's and Ok-Topk's share slots: distinct indices, then (0, 0) padding
        indices, values = reduced.glob.indices, (reduced.glob.values.float() / size).to(tensor.dtype)
    else:  # the allgather's dense sum
        mine = (reduced.summed / size).to(tensor.dtype)
        indices = mine.nonzero().view(-1).to(torch.int32)
        values = mine[indices.long()]
    most = min(width, inner_result_slots(inner, max(shares), size // local_size))
    average, combined = node_allgather(indices, values, int(raised), widths, most, node_group, traffic)
    if flags is not None:
        flags.fill_(combined)
    shifted = SparseMessage(msg.values, msg.indices + shard.start, msg.count, numel, msg.stats)
    if combined:
        return HierarchicalResult(None, shifted, torch.zeros_like(applied), shard)
    if residual is not None:
        if share:
            keep_unapplied(kept, msg, applied, shard_rounding, backend)
        else:
            kept.copy_(shard_acc)
        residual.zero_()
        residual[shard].copy_(kept)
    if rounding is not None:
        error_indices, errors = shard_rounding.pairs(tensor.dtype, device)
        rounding.add(error_indices + shard.start, errors)
    return HierarchicalResult(average, shifted, applied, shard)


def node_reduce_scatter(tensor: torch.Tensor, bounds: list[int], node_group: dist.ProcessGroup, local_rank: int,
                        traffic: Traffic | None) -> torch.Tensor:
    """Shard ``local_rank`` (of ``bounds``) of the sum over the node's ranks of ``tensor`` (flat, contiguous): this
    rank's own part, then the others' in local-rank order. Every rank sends shard r straight to local rank r, all
    at once: the same bytes as a ring, faster than Gloo's ``reduce_scatter`` (docs/scaling.md)."""
    shards = [tensor[start:end] for start, end in zip(bounds, bounds[1:])]
    mine = shards[local_rank]
    received = sparse_alltoallv([shard.view(torch.uint8) for shard in shards],
                                 [mine.numel() * mine.element_size()] * len(shards), node_group, local_rank, traffic)
    total = mine.clone()
    for r, payload in enumerate(received):
        if r != local_rank and payload is not None:
            total += payload.view(tensor.dtype)
    return total


def node_allgather(indices: torch.Tensor, values: torch.Tensor, flags: int, widths: list[int], most: int,
                   node_group: dist.ProcessGroup, traffic: Traffic | None) -> tuple[torch.Tensor, int]:
    """(every local rank's shard of ``widths``: zero but for its (``indices``: int32 into the shard, ``values``)
    pairs, concatenated; the OR of their ``flags``), gathered inside the node. A rank has at most ``most`` pairs;
    an index may repeat with value 0 (padding). When that many pairs take fewer bytes than the widest shard, only
    they cross (the same choice on every rank)."""
    local_size, width, dtype, device = len(widths), widths[0], values.dtype, values.device
    count = indices.numel()
    if count > most:
        raise RuntimeError(f"a shard's result has {count} slots, more than the {most} its selections allow")
    nbytes = node_gather_bytes(width, most, values.element_size())
    sparse = nbytes < (width + 1) * values.element_size()
    values_at = 8 + 4 * most  # a sparse message: count and flags (int32), most indices (int32), most values
    if sparse:
        packed = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        packed[:8].view(torch.int32).copy_(torch.tensor([count, flags], dtype=torch.int32))
        packed[8:8 + 4 * count].view(torch.int32).copy_(indices)
        packed[values_at:values_at + count * values.element_size()].view(dtype).copy_(values)
    else:
        packed = torch.zeros(width + 1, dtype=dtype, device=device)
        packed.index_add_(0, indices.long(), values)
        packed[width] = flags
    gathered = [torch.empty_like(packed) for _ in range(local_size)]
    dist.all_gather(gathered, packed, group=node_group)
    if traffic is not None:
        traffic.add(ring_allgather_bytes(nbytes, local_size), ring_allgather_bytes(nbytes, local_size))
    if not sparse:
        combined = functools.reduce(operator.or_, (int(g[width]) for g in gathered))
        return torch.cat([g[:w] for g, w in zip(gathered, widths)]), combined
    combined, all_indices, all_values, start = 0, [], [], 0
    for g, w in zip(gathered, widths):
        count, raised = g[:8].view(torch.int32).tolist()
        combined |= raised
        all_indices.append(g[8:8 + 4 * count].view(torch.int32).long() + start)
        all_values.append(g[values_at:].view(dtype)[:count])
        start += w
    result = torch.zeros(start, dtype=dtype, device=device)
    return result.index_add_(0, torch.cat(all_indices), torch.cat(all_values)), combined

"""gTop-k (Shi et al., ICDCS 2019): the global top-k by pairwise sparse merges in log2(P) rounds, O(k log P)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gtopk_ext import ops
from gtopk_ext.backends import BackendLike
from gtopk_ext.collectives._protocol import (Collective, Reduced, agree_on_message, carried_dtype,
                                             check_cost, group_rank_and_size, payload_head)
from gtopk_ext.collectives._transport import (Traffic, allreduce_counts, exchange, in_set, mask_from_bytes,
                                              mask_to_bytes, raise_if_corrupt, recv_from, send_to)
from gtopk_ext.message import SparseMessage
from gtopk_ext.wire import Rounding, WireLike, rounding_error, wire_named


def butterfly_shape(size: int) -> tuple[int, int]:
    """(gTop-k's rounds on ``size`` ranks, the ranks beyond the largest power of two, which fold in first)."""
    rounds = size.bit_length() - 1
    return rounds, size - (1 << rounds)


def gtopk_allreduce(msg: SparseMessage, group: dist.ProcessGroup | None = None, *, check: bool = True,
                    traffic: Traffic | None = None, flags: torch.Tensor | None = None, wire: WireLike = "plain",
                    rounding: Rounding | None = None, backend: BackendLike = None
                    ) -> tuple[SparseMessage, torch.Tensor]:
    """gTop-k: the global top-k of the sum of every rank's sparse message, in O(k log P) traffic.

    In round r each rank merges its current set with that of rank ``rank XOR 2^r``
    (:func:`gtopk_ext.ops.merge_topk`); when P is not a power of two, the ranks past the largest power of two
    first fold their set into rank ``rank - 2^floor(log2 P)`` and receive the result at the end. Returns
    ``(glob, applied)``: ``glob``, the same SparseMessage on every rank (values summed over ranks, not averaged,
    in :func:`carried_dtype` of the message's dtype; ``glob.count``: the size of the last merged union);
    ``applied[j]``, whether this rank's slot j is inside glob's sums. The caller keeps ``msg.values[~applied]``
    (error feedback). ``check`` and ``flags`` as in :func:`sparse_allgather`.

    ``wire="compact"`` (:mod:`gtopk_ext.wire`) sends each set in 4 bytes a pair, its used slots only (the others
    are not applied). Both partners of a round merge the sets as the wire carried them, so they compute the same
    merge; the rounding error of a set that reaches glob is added to ``rounding`` (when given) by exactly one
    rank. A corrupted compact payload raises ValueError on every rank, nothing of it written out of bounds.
    """
    group, rank, size = group_rank_and_size(group)
    if check:
        agree_on_message(msg, flags, group, "gtopk_allreduce", traffic, wire=wire)
    k, dtype, numel = msg.values.numel(), carried_dtype(msg.values.dtype), msg.numel
    device = msg.values.device
    applied = torch.ones(k, dtype=torch.bool, device=device)
    own_values = msg.values.to(dtype, copy=True)
    if size == 1:
        return SparseMessage(own_values, msg.indices.clone(), msg.count.clone(), numel), applied
    wire = wire_named(wire)
    compact = wire.lossy
    rounds, _ = butterfly_shape(size)
    butterfly = 1 << rounds  # the ranks below it merge pairwise; those above fold in first
    head_words = 1 if flags is None else 2
    received_size = wire.payload_size(k, numel, dtype, head_words)
    mask_size = (k + 7) // 8  # a folded rank's applied mask comes back with the result, a bit per slot
    own_indices, own_values, order = wire.ascending(msg.indices, own_values, msg.count)
    invalid = torch.zeros(1, dtype=torch.int32, device=device)  # signs of corruption in what this rank decoded

    def decode(payload: torch.Tensor):
        peer_indices, peer_values, peer_head, peer_invalid = wire.unpack(payload, k, numel, dtype, head_words,
                                                                         backend)
        if peer_invalid is not None:
            invalid.add_(peer_invalid)
        return peer_indices, peer_values, peer_head

    def sent_slots_only(slots_applied: torch.Tensor) -> torch.Tensor:
        """With compact, the slots past the count are not sent, so not applied."""
        return slots_applied & (torch.arange(k, device=device) < msg.count.clamp(0, k)) if compact else slots_applied

    def keep_error(indices: torch.Tensor, values: torch.Tensor, sent_values: torch.Tensor, count: torch.Tensor):
        """This rank answers for the rounding error of the set it sends (its used slots)."""
        used = torch.arange(k, device=device) < count.clamp(0, k)
        kept_errors.append((indices, torch.where(used, rounding_error(values, sent_values), 0), used))

    if rank >= butterfly:  # folded into rank - butterfly; the result comes back with this rank's applied mask
        partner = rank - butterfly
        payload, _, sent = wire.pack(own_indices, own_values, payload_head(msg.count, flags), numel, backend)
        send_to(payload, partner, group, traffic)
        result = recv_from(torch.empty(received_size + mask_size, dtype=torch.uint8, device=device), partner, group,
                       traffic)
        indices, values, head = decode(result[:received_size])
        if flags is not None:
            flags.copy_(head[1:])
        applied = sent_slots_only(mask_from_bytes(result[received_size:], k))
        if compact:
            raise_if_corrupt(int(allreduce_counts(invalid, group, traffic)), "gtopk_allreduce")
            if rounding is not None:
                rounding.add(own_indices, torch.where(applied, rounding_error(own_values, sent), 0))
        return (SparseMessage(values.clone(), indices.clone(), head[:1].clone(), numel),
                _in_slot_order(applied, order))

    indices, values, count = own_indices, own_values, msg.count
    raised = None if flags is None else flags.clone()  # the OR of the flags this rank has seen so far
    # (slot indices, applied mask) of every contribution this rank answers for: its slots, a folded rank's, and
    # with compact the rounding errors it keeps (their mask: still in the set).
    tracked = [(own_indices, applied)]
    kept_errors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (indices, errors, still in the set)
    folded = rank + butterfly
    if folded < size:
        received = recv_from(torch.empty(received_size, dtype=torch.uint8, device=device), folded, group, traffic)
        folded_indices, folded_values, folded_head = decode(received)
        raised = None if flags is None else raised.bitwise_or_(folded_head[1:])
        tracked.append((folded_indices, torch.ones(k, dtype=torch.bool, device=device)))
        indices, values, count = ops.merge_topk(indices, values, folded_indices, folded_values, k, backend=backend)
        _mark_survivors(tracked, indices, count, numel)
    for bit in range(rounds):
        peer = rank ^ (1 << bit)
        payload, sent_indices, sent_values = wire.pack(indices, values, payload_head(count, raised), numel, backend)
        if compact:
            if rank & ((1 << bit) - 1) == 0:  # the lowest rank holding the set keeps its rounding error
                keep_error(indices, values, sent_values, count)
            indices, values = sent_indices, sent_values  # merge what the partner merges
        received = torch.empty(received_size, dtype=torch.uint8, device=device)
        exchange(payload, received, peer, group, traffic)
        peer_indices, peer_values, peer_head = decode(received)
        raised = None if flags is None else raised.bitwise_or_(peer_head[1:])
        # Both partners put the lower rank's set first, so they compute bitwise the same merge.
        if rank < peer:
            indices, values, count = ops.merge_topk(indices, values, peer_indices, peer_values, k, backend=backend)
        else:
            indices, values, count = ops.merge_topk(peer_indices, peer_values, indices, values, k, backend=backend)
        _mark_survivors(tracked + [(i, alive) for i, _, alive in kept_errors], indices, count, numel)
    if size != butterfly and (compact or folded < size):  # glob, as the wire carries it to the folded ranks
        payload, sent_indices, sent_values = wire.pack(indices, values, payload_head(count, raised), numel, backend)
        if compact:  # every rank takes glob as the wire carries it; rank 0 keeps the rounding error
            if rank == 0:
                keep_error(indices, values, sent_values, count)
            indices, values = sent_indices, sent_values
        if folded < size:
            send_to(torch.cat([payload, mask_to_bytes(tracked[1][1])]), folded, group, traffic)
    if flags is not None:
        flags.copy_(raised)
    if compact:
        raise_if_corrupt(int(allreduce_counts(invalid, group, traffic)), "gtopk_allreduce")
        if rounding is not None:
            for error_indices, errors, alive in kept_errors:
                rounding.add(error_indices, torch.where(alive, errors, 0))
    return SparseMessage(values, indices, count, numel), _in_slot_order(sent_slots_only(applied), order)


def _in_slot_order(mask: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """A mask over slots that were permuted by ``order`` (:func:`gtopk_ext.wire.ascending`), in the original
    slot order."""
    return mask if order is None else torch.empty_like(mask).index_put_((order,), mask)


def _mark_survivors(tracked: list[tuple[torch.Tensor, torch.Tensor]], kept_indices: torch.Tensor,
                    union_size: torch.Tensor, numel: int) -> None:
    """A contribution whose index left the set in this merge is out of every later sum too. The kept indices are
    those of the first ``union_size`` slots (the rest is padding), read on the device: no host sync."""
    in_use = torch.arange(kept_indices.numel(), device=kept_indices.device) < union_size
    found = in_set(kept_indices, [slot_indices for slot_indices, _ in tracked], numel, in_use)
    for (_, applied), survived in zip(tracked, found):
        applied &= survived


class GTopK(Collective):
    """:func:`gtopk_allreduce`."""

    name = "gtopk"

    def messages(self, size):
        rounds, folded = butterfly_shape(size)
        return ((1 << rounds) * rounds + 2 * folded) / size  # ranks folded in send twice

    def cost_terms(self, numel, k, size, local, share, wire):
        rounds, folded = butterfly_shape(size)
        folds = int(folded > 0)  # the slowest path: a folded rank's partner sends and receives once more
        intra = min(rounds, local.bit_length() - 1) if local & (local - 1) == 0 else 0  # rounds inside a node
        message = wire.payload_size(k, numel, torch.float32, 1)
        terms = {"alpha": rounds - intra + 2 * folds, "alpha_intra": intra,
                 "beta": (rounds - intra) * local * message + folds * (2 * message + (k + 7) // 8),
                 "beta_intra": intra * message, "merge": (rounds + folds) * 2 * k * share}
        if wire.lossy:
            terms.update(encode=(rounds + 2 * folds) * k * share, decode=(2 * rounds + 3 * folds) * k * share)
        messages, sent = check_cost(size, wire)
        terms["alpha"] += messages
        terms["beta"] += sent
        return terms

    def mean_bytes(self, numel, k, size, wire):
        rounds, folded = butterfly_shape(size)  # only the ranks folded in, and their partners, send the fold and return
        message = wire.payload_size(k, numel, torch.float32, 1)
        sent = (1 << rounds) * rounds * message + folded * (2 * message + (k + 7) // 8)
        return sent / size + check_cost(size, wire)[1]

    def reduce(self, msg, group, *, wire, traffic=None, flags=None, rounding=None, state=None):
        glob, applied = gtopk_allreduce(msg, group, check=False, traffic=traffic, flags=flags, wire=wire,
                                        rounding=rounding, backend=self.backend[msg.values.device])
        return Reduced(glob=glob, applied=applied)

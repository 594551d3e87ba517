"""TopK-SGD's sparse allgather: every rank's k pairs to every rank, O(kP) bytes."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from gtopk_ext import ops
from gtopk_ext.backends import BackendLike
from gtopk_ext.collectives._protocol import Collective, Reduced, agree_on_message, group_rank_and_size, payload_head
from gtopk_ext.collectives._transport import Traffic, add_traffic, raise_if_corrupt
from gtopk_ext.costs import ring_allgather_bytes
from gtopk_ext.message import SparseMessage
from gtopk_ext.wire import Rounding, WireLike, rounding_error, wire_named


def sparse_allgather(msg: SparseMessage, group: dist.ProcessGroup | None = None, *, dtype: torch.dtype | None = None,
                     check: bool = True, traffic: Traffic | None = None, flags: torch.Tensor | None = None,
                     wire: WireLike = "plain", rounding: Rounding | None = None,
                     backend: BackendLike = None, senders: torch.Tensor | None = None) -> torch.Tensor:
    """TopK-SGD: every rank's k pairs, scatter-added into a flat dense tensor of ``msg.numel`` elements: the SUM
    over the group's ranks (not averaged), identical on every rank, accumulated in float32, returned in ``dtype``
    (default the message's). ``check=False`` skips the header agreement: only when the caller has made sure every
    rank passes the same k, numel, dtype, wire and flags or none. ``flags`` (int32[1], optional): bits this rank
    raises; on return it holds their OR over the group.

    ``wire`` (:mod:`gtopk_ext.wire`): ``"plain"`` (exact) or a lossy one (``"compact"``, ``"2bit"``,
    ``"4bit"``). With a lossy wire, what it took off this rank's values is added to ``rounding`` when given: add
    it to the residual, or it is lost. A corrupted lossy payload raises ValueError on every rank, nothing written.
    ``senders`` (float32, ``msg.numel`` elements): 1 is added at each index for every rank that sent it (its used
    slots), for an average over the ranks that sent each element."""
    group, _, size = group_rank_and_size(group)
    if check:
        agree_on_message(msg, flags, group, "sparse_allgather", traffic, wire=wire)
    wire = wire_named(wire)
    head = payload_head(msg.count, flags)
    indices, values, _ = wire.ascending(msg.indices, msg.values, msg.count)
    payload, _, sent = wire.pack(indices, values, head, msg.numel, backend)
    if wire.lossy and rounding is not None:
        rounding.add(indices, rounding_error(values, sent))
    gathered = [torch.empty_like(payload) for _ in range(size)]
    dist.all_gather(gathered, payload, group=group)
    add_traffic(traffic, ring_allgather_bytes(payload.numel(), size))
    pairs = [wire.unpack(p, msg.values.numel(), msg.numel, msg.values.dtype, head.numel(), backend) for p in gathered]
    if wire.lossy:
        raise_if_corrupt(int(sum(invalid for _, _, _, invalid in pairs)), "sparse_allgather")
    if flags is not None:
        flags.copy_(functools.reduce(torch.bitwise_or, [h[1:] for _, _, h, _ in pairs]))
    total = torch.zeros(msg.numel, dtype=torch.float32, device=msg.values.device)
    indices = torch.cat([i for i, _, _, _ in pairs])
    ops.scatter_add_(total, indices, torch.cat([v for _, v, _, _ in pairs]).float(), backend=backend)
    if senders is not None:  # the used slots: the first count of each payload's k (no host sync)
        slots = torch.arange(msg.values.numel(), device=indices.device)
        used = torch.cat([(slots < h[0]).float() for _, _, h, _ in pairs])
        ops.scatter_add_(senders, indices, used, backend=backend)
    return total.to(dtype or msg.values.dtype)


class Allgather(Collective):
    """:func:`sparse_allgather`: every slot of every rank is applied."""

    name = "allgather"

    def messages(self, size):
        return size - 1

    def cost_terms(self, numel, k, size, local, share, wire):
        message = wire.payload_size(k, numel, torch.float32, 1)
        terms = {"alpha": size - 1, "beta": (size - 1) * message, "scatter": size * k * share, "zero": numel * share}
        if wire.lossy:
            terms.update(encode=k * share, decode=(size + 1) * k * share)
        return terms  # every rank decodes every payload: no corruption check after the exchange

    counts_senders = True

    def reduce(self, msg, group, *, wire, traffic=None, flags=None, rounding=None, state=None, senders=False):
        counts = torch.zeros(msg.numel, dtype=torch.float32, device=msg.values.device) if senders else None
        summed = sparse_allgather(msg, group, dtype=torch.float32, check=False, traffic=traffic, flags=flags,
                                  wire=wire, rounding=rounding, backend=self.backend[msg.values.device],
                                  senders=counts)
        return Reduced(summed=summed, senders=counts)

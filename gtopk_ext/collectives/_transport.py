"""Moving bytes between ranks, counted (:class:`Traffic`): point-to-point exchanges (through host memory on Gloo),
a sparse all-to-all, small count exchanges, and the signs of a corrupted payload."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gtopk_ext.costs import ring_allgather_bytes, ring_allreduce_bytes


@dataclass
class Traffic:
    """Bytes this rank sent and received, counted by the collectives that are given one. Collectives run by the
    backend (all_gather, all_reduce) are counted as a ring algorithm moves them."""

    sent: int = 0
    received: int = 0

    def add(self, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received


def add_traffic(traffic: Traffic | None, sent: int, received: int | None = None) -> None:
    """Counts in ``traffic`` when the caller gave one; ``received`` defaults to ``sent`` (a ring)."""
    if traffic is not None:
        traffic.add(sent, sent if received is None else received)


# A large message goes in pieces of at least EXCHANGE_PIECE_BYTES, at most EXCHANGE_PIECES of them: on Gloo one
# message each way moves at about half a link's rate (docs/performance.md).
EXCHANGE_PIECE_BYTES = 128 * 1024
EXCHANGE_PIECES = 8


def pieces(buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``buffer`` (flat) as the pieces :func:`exchange` moves; a message and its receiver's buffer, of the same
    size, split alike."""
    count = -(-(buffer.numel() * buffer.element_size()) // EXCHANGE_PIECE_BYTES)
    return buffer.tensor_split(min(EXCHANGE_PIECES, max(1, count)))


def exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group: dist.ProcessGroup,
             traffic: Traffic | None) -> None:
    """Send ``send`` to and receive ``recv`` from group rank ``peer`` at the same time (flat buffers)."""
    global_peer = dist.get_global_rank(group, peer)
    sent, received = p2p_buffer(send, group), p2p_buffer(recv, group)
    # Each piece's send and receive posted together (all sends first moved at the single message's pace).
    ops = [dist.P2POp(op, piece, global_peer, group)
           for out, into in itertools.zip_longest(pieces(sent), pieces(received))
           for op, piece in ((dist.isend, out), (dist.irecv, into)) if piece is not None]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if received is not recv:
        recv.copy_(received)
    add_traffic(traffic, send.numel() * send.element_size(), recv.numel() * recv.element_size())


def send_to(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, traffic: Traffic | None) -> None:
    dist.send(p2p_buffer(tensor, group), dist.get_global_rank(group, peer), group=group)
    add_traffic(traffic, tensor.numel() * tensor.element_size(), 0)


def recv_from(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, traffic: Traffic | None) -> torch.Tensor:
    buffer = p2p_buffer(tensor, group)
    dist.recv(buffer, dist.get_global_rank(group, peer), group=group)
    if buffer is not tensor:
        tensor.copy_(buffer)
    add_traffic(traffic, 0, tensor.numel() * tensor.element_size())
    return tensor


def p2p_buffer(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The tensor that a point-to-point op may hand to the group's backend: Gloo's send and recv read and write
    the buffer from the CPU, so a CUDA tensor goes through a host copy (the caller copies a received one back);
    Gloo's collectives and NCCL take CUDA tensors as they are."""
    return tensor.to(p2p_device(tensor.device, group))


def p2p_device(device: torch.device, group: dist.ProcessGroup) -> torch.device:
    return torch.device("cpu") if dist.get_backend(group) == dist.Backend.GLOO else device


def sparse_alltoallv(payloads: list[torch.Tensor | None], recv_nbytes: list[int], group: dist.ProcessGroup,
                      rank: int, traffic: Traffic | None) -> list[torch.Tensor | None]:
    """Sends ``payloads[r]`` to every group rank r != rank and receives ``recv_nbytes[r]`` bytes from each, all at
    once; in round s of the paper's destination rotation a rank sends to rank + s and receives from rank - s, so
    no rank is every sender's first destination. Empty messages are not sent (both sides know their size).
    Returns the received payloads by source rank (None for this rank and for empty ones)."""
    size = len(payloads)
    device = payloads[rank].device
    works, received, sent_bytes = [], [None] * size, 0
    for shift in range(1, size):
        destination, source = (rank + shift) % size, (rank - shift) % size
        payload = payloads[destination]
        if payload is not None and payload.numel():
            works.append(dist.P2POp(dist.isend, p2p_buffer(payload, group), dist.get_global_rank(group, destination),
                                    group))
            sent_bytes += payload.numel()
        if recv_nbytes[source]:
            received[source] = torch.empty(recv_nbytes[source], dtype=torch.uint8,
                                           device=p2p_device(device, group))
            works.append(dist.P2POp(dist.irecv, received[source], dist.get_global_rank(group, source), group))
    if works:
        for work in dist.batch_isend_irecv(works):
            work.wait()
    received = [None if payload is None else payload.to(device) for payload in received]
    add_traffic(traffic, sent_bytes, sum(nbytes for r, nbytes in enumerate(recv_nbytes) if r != rank))
    return received


def exchange_counts(counts: list[int], group: dist.ProcessGroup, device: torch.device,
                     traffic: Traffic | None) -> list[int]:
    """All-to-all of one count per rank pair: ``counts[r]`` goes to rank r; returns the count from each rank."""
    size = len(counts)
    send = torch.tensor(counts, dtype=torch.int64, device=device)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    add_traffic(traffic, 8 * (size - 1))
    return received.tolist()


def gather_counts(counts: list[int], group: dist.ProcessGroup, device: torch.device,
                  traffic: Traffic | None) -> list[list[int]]:
    """Every rank's ``counts`` (the same number on every rank), in group-rank order."""
    mine = torch.tensor(counts, dtype=torch.int64, device=device)
    size = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    add_traffic(traffic, ring_allgather_bytes(mine.numel() * 8, size))
    return [g.tolist() for g in gathered]


def allreduce_counts(counts: torch.Tensor, group: dist.ProcessGroup, traffic: Traffic | None) -> torch.Tensor:
    dist.all_reduce(counts, group=group)
    add_traffic(traffic, ring_allreduce_bytes(counts.numel() * counts.element_size(), dist.get_world_size(group)))
    return counts


def raise_if_corrupt(invalid: int, what: str) -> None:
    """Raise when the compact payloads decoded by the group showed ``invalid`` signs of corruption (the same
    number on every rank, so every rank raises alike)."""
    if invalid:
        raise ValueError(f"{what}: a compact payload arrived corrupted ({invalid} slots or table entries that no "
                         "encoding makes); nothing of it was written")


def mask_to_bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as bits, 8 slots a byte (slot j: bit j % 8 of byte j // 8)."""
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, -mask.numel() % 8)).view(-1, 8)
    return (bits << torch.arange(8, dtype=torch.uint8, device=mask.device)).sum(1, dtype=torch.uint8)


def mask_from_bytes(raw: torch.Tensor, k: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=raw.device)
    return ((raw.unsqueeze(1) >> shifts) & 1).view(-1)[:k].bool()


def in_set(set_indices: torch.Tensor, queries: list[torch.Tensor], numel: int,
           used: torch.Tensor | None = None) -> list[torch.Tensor]:
    """For each tensor of ``queries``, whether each of its indices is one of ``set_indices`` (``used``: the mask of
    the slots of ``set_indices`` that count; None: all); every index in [0, ``numel``). A bitmap over the index
    space, zeroed again after use and kept per thread and device: O(k) a call, where a binary search is O(k log k)."""
    slots = set_indices.long() if used is None else torch.where(used, set_indices, numel).long()
    marks = kept_tensor(f"bitmap {set_indices.device}", numel + 1, torch.bool, set_indices.device, torch.zeros)
    marks.index_fill_(0, slots, True)
    try:
        return [marks.index_select(0, q) for q in queries]
    finally:
        marks.index_fill_(0, slots, False)


_kept = threading.local()


def kept_tensor(key: str, numel: int, dtype: torch.dtype, device: torch.device, make=torch.empty) -> torch.Tensor:
    """``numel`` elements of a tensor kept between calls under ``key``, made by ``make`` when none is large enough;
    one per thread (the hooks reduce on threads of their own)."""
    kept = getattr(_kept, key, None)
    if kept is None or kept.numel() < numel:
        kept = make(numel, dtype=dtype, device=device)
        setattr(_kept, key, kept)
    return kept[:numel]

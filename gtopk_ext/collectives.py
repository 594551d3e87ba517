"""Sparse collectives on torch.distributed (Gloo or NCCL, any process group): TopK-SGD's allgather and the
gTop-k butterfly allreduce of Shi et al. (ICDCS 2019), for any world size.

Before any payload moves, the ranks agree on a small header (k, numel, dtype): Gloo aborts the whole process
when a message's size differs from the receiver's buffer, and a check between two partners only would leave the
other ranks waiting, so the header is gathered over the group and every rank raises the same clear error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gtopk_ext import ops
from gtopk_ext._contract import FLOAT_DTYPES
from gtopk_ext.compressors import SparseMessage

DTYPE_CODES = {dtype: code for code, dtype in enumerate(FLOAT_DTYPES, start=1)}  # header codes of the op dtypes
MAX_NUMEL = 2**31 - 1
_INVALID = -1  # a header field of a rank whose own input was invalid


class Disagreement(ValueError):
    """The ranks' headers disagree (or a rank's input was invalid): raised on every rank alike, after a header
    exchange that every rank took part in, so the group is still in step."""


@dataclass
class Traffic:
    """Bytes this rank sent and received, counted by the collectives that are given one. Collectives run by the
    backend (all_gather, all_reduce) are counted as a ring algorithm moves them."""

    sent: int = 0
    received: int = 0

    def add(self, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int, int]:
    """``(group, rank in it, its size)``; ``None`` is the default (world) group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the process group it was given")
    return group, rank, dist.get_world_size(group)


def ring_allgather_bytes(nbytes: int, size: int) -> int:
    return (size - 1) * nbytes


def ring_allreduce_bytes(nbytes: int, size: int) -> int:
    return 2 * (size - 1) * nbytes // size


def gather_headers(fields: dict[str, int], group: dist.ProcessGroup, device: torch.device,
                   traffic: Traffic | None = None) -> list[dict[str, int]]:
    """Every rank's ``fields`` (same names on every rank, int64 values), in group-rank order."""
    header = torch.tensor(list(fields.values()), dtype=torch.int64, device=device)
    size = dist.get_world_size(group)
    gathered = [torch.empty_like(header) for _ in range(size)]
    dist.all_gather(gathered, header, group=group)
    if traffic is not None:
        nbytes = ring_allgather_bytes(header.numel() * 8, size)
        traffic.add(nbytes, nbytes)
    return [dict(zip(fields, h.tolist())) for h in gathered]


def require_same(headers: list[dict[str, int]], names: tuple[str, ...], what: str) -> None:
    """Raise (on every rank alike, since all hold the same headers) when a rank's input was invalid or the
    ranks disagree on one of ``names``."""
    invalid = [rank for rank, h in enumerate(headers) if h["valid"] == 0]
    if invalid:
        raise Disagreement(f"{what}: the input of rank(s) {invalid} was invalid (see the error on those ranks)")
    for name in names:
        seen = [h[name] for h in headers]
        if len(set(seen)) > 1:
            listing = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(seen))
            raise Disagreement(f"{what}: {name} differs across ranks ({listing}); every rank must pass the same "
                             f"{', '.join(names)}")


def check_message(msg: SparseMessage, name: str = "msg") -> None:
    """Raise a clear error unless ``msg`` is a well-formed SparseMessage."""
    if not isinstance(msg, SparseMessage):
        raise TypeError(f"{name} must be a SparseMessage, got {type(msg).__name__}")
    values, indices, count = msg.values, msg.indices, msg.count
    for field_name, tensor in (("values", values), ("indices", indices), ("count", count)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}.{field_name} must be a tensor, got {type(tensor).__name__}")
    if values.dtype not in DTYPE_CODES:
        raise TypeError(f"{name}.values must be float32, float16 or bfloat16, got {values.dtype}")
    if indices.dtype != torch.int32:
        raise TypeError(f"{name}.indices must be int32, got {indices.dtype}")
    if values.dim() != 1 or indices.shape != values.shape or values.numel() == 0:
        raise ValueError(f"{name}.values and {name}.indices must be 1-D with the same k >= 1 slots, got shapes "
                         f"{tuple(values.shape)} and {tuple(indices.shape)}")
    if count.dtype != torch.int32 or count.shape != (1,):
        raise ValueError(f"{name}.count must be int32 of shape (1,), got {count.dtype} of shape {tuple(count.shape)}")
    if indices.device != values.device or count.device != values.device:
        raise ValueError(f"{name}'s tensors must be on one device, got values on {values.device}, indices on "
                         f"{indices.device}, count on {count.device}")
    if not isinstance(msg.numel, int) or not 0 < msg.numel <= MAX_NUMEL:
        raise ValueError(f"{name}.numel must be an int in [1, 2^31 - 1], got {msg.numel!r}")
    if not bool(((indices >= 0) & (indices < msg.numel)).all()):
        raise ValueError(f"{name}.indices must lie in [0, {name}.numel = {msg.numel}), got "
                         f"{int(indices.min())} to {int(indices.max())}")


def _agree_on_message(msg: SparseMessage, flags: torch.Tensor | None, group: dist.ProcessGroup, what: str,
                      traffic: Traffic | None) -> None:
    """Every rank checks its message and the ranks compare (k, numel, dtype, whether flags are sent), so all of
    them raise together.

    Any local error (not only the checks' TypeError and ValueError) is held until the headers are exchanged:
    raising before would leave the other ranks waiting for this one until the group's timeout."""
    try:
        check_message(msg)
        _check_flags(flags, msg.values.device)
        fields = {"valid": 1, "k": msg.k, "numel": msg.numel, "dtype": DTYPE_CODES[msg.values.dtype],
                  "flags": int(flags is not None)}
        device, local_error = msg.values.device, None
    except Exception as error:  # noqa: BLE001 - raised below, once every rank knows
        fields = {"valid": 0, "k": _INVALID, "numel": _INVALID, "dtype": _INVALID, "flags": _INVALID}
        values = getattr(msg, "values", None)
        usable = isinstance(values, torch.Tensor) and values.device.type != "meta"
        device = values.device if usable else torch.device("cpu")
        local_error = error
    headers = gather_headers(fields, group, device, traffic)
    if local_error is not None:
        raise local_error
    require_same(headers, ("k", "numel", "dtype", "flags"), what)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def _head(count: torch.Tensor, flags: torch.Tensor | None) -> torch.Tensor:
    """The int32 words in front of a payload: the count, then the flags when the caller sends some."""
    count = count.reshape(1).int()
    return count if flags is None else torch.cat([count, flags.reshape(1).int()])


def _pack(indices: torch.Tensor, values: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """One uint8 tensor per send: the head (int32 words), then the k indices (int32), then the k values' bits."""
    return torch.cat([_as_bytes(head), _as_bytes(indices), _as_bytes(values)])


def _packed_size(k: int, dtype: torch.dtype, head_words: int) -> int:
    return 4 * head_words + k * (4 + torch.empty((), dtype=dtype).element_size())


def _unpack(payload: torch.Tensor, k: int, dtype: torch.dtype, head_words: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices, values, head)`` of a payload made by :func:`_pack` (views, no copy)."""
    start = 4 * head_words
    indices = payload[start:start + 4 * k].view(torch.int32)
    values = payload[start + 4 * k:_packed_size(k, dtype, head_words)].view(dtype)
    return indices, values, payload[:start].view(torch.int32)


def _check_flags(flags: torch.Tensor | None, device: torch.device) -> None:
    if flags is not None and (not isinstance(flags, torch.Tensor) or flags.dtype != torch.int32
                              or flags.shape != (1,) or flags.device != device):
        raise ValueError(f"flags must be an int32 tensor of shape (1,) on {device}, got "
                         f"{getattr(flags, 'dtype', type(flags).__name__)} of shape "
                         f"{tuple(getattr(flags, 'shape', ()))}")


def sparse_allgather(msg: SparseMessage, group: dist.ProcessGroup | None = None, *, dtype: torch.dtype | None = None,
                     check: bool = True, traffic: Traffic | None = None, flags: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """TopK-SGD: every rank's k pairs, scatter-added into a flat dense tensor of ``msg.numel`` elements: the SUM
    over the group's ranks (not averaged), identical on every rank. Accumulates in float32 and returns ``dtype``
    (default the message's). ``check=False`` skips the header agreement: only when the caller has already made
    sure every rank passes the same k, numel, dtype and flags or none. ``flags`` (int32[1], optional): bits this
    rank raises, carried inside the payload; on return it holds their OR over the group."""
    group, _, size = group_rank_and_size(group)
    if check:
        _agree_on_message(msg, flags, group, "sparse_allgather", traffic)
    head = _head(msg.count, flags)
    payload = _pack(msg.indices, msg.values, head)
    gathered = [torch.empty_like(payload) for _ in range(size)]
    dist.all_gather(gathered, payload, group=group)
    if traffic is not None:
        nbytes = ring_allgather_bytes(payload.numel(), size)
        traffic.add(nbytes, nbytes)
    pairs = [_unpack(p, msg.k, msg.values.dtype, head.numel()) for p in gathered]
    if flags is not None:
        flags.copy_(_or_flags(h[1:] for _, _, h in pairs))
    total = torch.zeros(msg.numel, dtype=torch.float32, device=msg.values.device)
    ops.scatter_add_(total, torch.cat([i for i, _, _ in pairs]), torch.cat([v for _, v, _ in pairs]).float(),
                     backend=msg.backend)
    return total.to(dtype or msg.values.dtype)


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group: dist.ProcessGroup,
              traffic: Traffic | None) -> None:
    """Send ``send`` to and receive ``recv`` from group rank ``peer`` at the same time."""
    global_peer = dist.get_global_rank(group, peer)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, global_peer, group),
                                    dist.P2POp(dist.irecv, recv, global_peer, group)])
    for work in works:
        work.wait()
    if traffic is not None:
        traffic.add(send.numel() * send.element_size(), recv.numel() * recv.element_size())


def _send(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, traffic: Traffic | None) -> None:
    dist.send(tensor, dist.get_global_rank(group, peer), group=group)
    if traffic is not None:
        traffic.add(tensor.numel() * tensor.element_size(), 0)


def _recv(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, traffic: Traffic | None) -> torch.Tensor:
    dist.recv(tensor, dist.get_global_rank(group, peer), group=group)
    if traffic is not None:
        traffic.add(0, tensor.numel() * tensor.element_size())
    return tensor


def carried_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which gTop-k carries a message's values between merges: float32 for float16 (a sum over
    ranks of values inside float16's range can leave it: two ranks' 40000 make 80000), else the message's."""
    return torch.float32 if dtype == torch.float16 else dtype


def _or_flags(flag_words) -> torch.Tensor:
    combined = None
    for words in flag_words:
        combined = words.clone() if combined is None else combined.bitwise_or_(words)
    return combined


def gtopk_allreduce(msg: SparseMessage, group: dist.ProcessGroup | None = None, *, check: bool = True,
                    traffic: Traffic | None = None, flags: torch.Tensor | None = None
                    ) -> tuple[SparseMessage, torch.Tensor]:
    """gTop-k: the global top-k of the sum of every rank's sparse message, in O(k log P) traffic.

    In round r each rank merges its current set with that of rank ``rank XOR 2^r``
    (:func:`gtopk_ext.ops.merge_topk`). For a world size P that is not a power of two, the ranks past the largest
    power of two first fold their set into rank ``rank - 2^floor(log2 P)`` and receive the result at the end.
    Returns ``(glob, applied)``: ``glob`` is the same SparseMessage on every rank (values summed over ranks, not
    averaged, in :func:`carried_dtype` of the message's dtype: float32 for float16; ``glob.count`` is the size of
    the last merged union); ``applied[j]`` is True where this rank's slot j is inside glob's sums, i.e. its
    index survived every merge on its path. The caller keeps ``msg.values[~applied]`` (error feedback): nothing
    is lost. ``check`` and ``flags`` as in :func:`sparse_allgather` (the flags ride along every merge).
    """
    group, rank, size = group_rank_and_size(group)
    if check:
        _agree_on_message(msg, flags, group, "gtopk_allreduce", traffic)
    k, dtype = msg.k, carried_dtype(msg.values.dtype)
    device = msg.values.device
    applied = torch.ones(k, dtype=torch.bool, device=device)
    own_values = msg.values.to(dtype, copy=True)
    if size == 1:
        return SparseMessage(own_values, msg.indices.clone(), msg.count.clone(), msg.numel,
                             backend=msg.backend), applied
    butterfly = 1 << (size.bit_length() - 1)
    head_words = 1 if flags is None else 2
    payload_size = _packed_size(k, dtype, head_words)

    if rank >= butterfly:  # folded into rank - butterfly; the result comes back with this rank's applied mask
        partner = rank - butterfly
        _send(_pack(msg.indices, own_values, _head(msg.count, flags)), partner, group, traffic)
        result = _recv(torch.empty(payload_size + k, dtype=torch.uint8, device=device), partner, group, traffic)
        indices, values, head = _unpack(result, k, dtype, head_words)
        if flags is not None:
            flags.copy_(head[1:])
        return (SparseMessage(values.clone(), indices.clone(), head[:1].clone(), msg.numel, backend=msg.backend),
                result[payload_size:].bool())

    indices, values, count = msg.indices, own_values, msg.count
    raised = None if flags is None else flags.clone()  # the OR of the flags this rank has seen so far
    # (slot indices, applied mask) of every contributor this rank answers for: itself and a folded rank.
    tracked = [(msg.indices, applied)]
    folded = rank + butterfly
    if folded < size:
        received = _recv(torch.empty(payload_size, dtype=torch.uint8, device=device), folded, group, traffic)
        folded_indices, folded_values, folded_head = _unpack(received, k, dtype, head_words)
        raised = None if flags is None else raised.bitwise_or_(folded_head[1:])
        tracked.append((folded_indices, torch.ones(k, dtype=torch.bool, device=device)))
        indices, values, count = ops.merge_topk(indices, values, folded_indices, folded_values, k,
                                                backend=msg.backend)
        _mark_survivors(tracked, indices, count)
    for bit in range(butterfly.bit_length() - 1):
        peer = rank ^ (1 << bit)
        received = torch.empty(payload_size, dtype=torch.uint8, device=device)
        _exchange(_pack(indices, values, _head(count, raised)), received, peer, group, traffic)
        peer_indices, peer_values, peer_head = _unpack(received, k, dtype, head_words)
        raised = None if flags is None else raised.bitwise_or_(peer_head[1:])
        # Both partners put the lower rank's set first, so they compute bitwise the same merge.
        if rank < peer:
            indices, values, count = ops.merge_topk(indices, values, peer_indices, peer_values, k,
                                                    backend=msg.backend)
        else:
            indices, values, count = ops.merge_topk(peer_indices, peer_values, indices, values, k,
                                                    backend=msg.backend)
        _mark_survivors(tracked, indices, count)
    if folded < size:
        folded_applied = tracked[1][1]
        _send(torch.cat([_pack(indices, values, _head(count, raised)), folded_applied.to(torch.uint8)]), folded,
              group, traffic)
    if flags is not None:
        flags.copy_(raised)
    return SparseMessage(values, indices, count, msg.numel, backend=msg.backend), applied


def _mark_survivors(tracked: list[tuple[torch.Tensor, torch.Tensor]], kept_indices: torch.Tensor,
                    union_size: torch.Tensor) -> None:
    """A contribution whose index left the set in this merge is out of every later sum too. The kept indices
    ascend up to the union's size; the padding after them is replaced by a sentinel above every index so that a
    binary search finds the survivors without reading the size on the host."""
    k = kept_indices.numel()
    in_use = torch.arange(k, device=kept_indices.device) < union_size
    sorted_kept = torch.where(in_use, kept_indices, torch.iinfo(torch.int32).max)
    for slot_indices, applied in tracked:
        found = sorted_kept[torch.searchsorted(sorted_kept, slot_indices).clamp_(max=k - 1)]
        applied &= found == slot_indices

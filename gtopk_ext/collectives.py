"""Sparse collectives on torch.distributed (Gloo or NCCL, any process group): TopK-SGD's allgather, the
gTop-k butterfly allreduce of Shi et al. (ICDCS 2019) and the Ok-Topk sparse allreduce of Li and Hoefler
(PPoPP 2022), for any world size.

Before any payload moves, the ranks agree on a small header (k, numel, dtype): Gloo aborts the whole process
when a message's size differs from the receiver's buffer, and a check between two partners only would leave the
other ranks waiting, so the header is gathered over the group and every rank raises the same clear error.
"""

from __future__ import annotations

import functools
import math
import operator
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from gtopk_ext import ops
from gtopk_ext._worker import Disagreement
from gtopk_ext._contract import FLOAT_DTYPES
from gtopk_ext.compressors import Compressor, SparseMessage, tensor_shares
from gtopk_ext.wire import (WIRES, Rounding, as_bytes, ascending, check_wire, pack, payload_size, rounding_error,
                            unpack)

DTYPE_CODES = {dtype: code for code, dtype in enumerate(FLOAT_DTYPES, start=1)}  # header codes of the op dtypes
MAX_NUMEL = 2**31 - 1
_INVALID = -1  # a header field of a rank whose own input was invalid


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
                      traffic: Traffic | None, extra: Callable[[], dict[str, int]] | None = None,
                      extra_names: tuple[str, ...] = (), wire: str = "plain") -> None:
    """Every rank checks its message and wire format and the ranks compare (k, numel, dtype, whether flags are
    sent, the wire), and the fields ``extra()`` returns (named ``extra_names``), so all of them raise together.

    Any local error (not only the checks' TypeError and ValueError) is held until the headers are exchanged:
    raising before would leave the other ranks waiting for this one until the group's timeout."""
    try:
        check_message(msg)
        _check_flags(flags, msg.values.device)
        check_wire(wire)
        fields = {"valid": 1, "k": msg.k, "numel": msg.numel, "dtype": DTYPE_CODES[msg.values.dtype],
                  "flags": int(flags is not None), "wire": WIRES.index(wire),
                  **(extra() if extra is not None else {})}
        device, local_error = msg.values.device, None
    except Exception as error:  # noqa: BLE001 - raised below, once every rank knows
        fields = {"valid": 0, **dict.fromkeys(("k", "numel", "dtype", "flags", "wire", *extra_names), _INVALID)}
        values = getattr(msg, "values", None)
        usable = isinstance(values, torch.Tensor) and values.device.type != "meta"
        device = values.device if usable else torch.device("cpu")
        local_error = error
    headers = gather_headers(fields, group, device, traffic)
    if local_error is not None:
        raise local_error
    require_same(headers, ("k", "numel", "dtype", "flags", "wire", *extra_names), what)


def _head(count: torch.Tensor, flags: torch.Tensor | None) -> torch.Tensor:
    """The int32 words in front of a payload: the count, then the flags when the caller sends some."""
    count = count.reshape(1).int()
    return count if flags is None else torch.cat([count, flags.reshape(1).int()])


def _check_flags(flags: torch.Tensor | None, device: torch.device) -> None:
    if flags is not None and (not isinstance(flags, torch.Tensor) or flags.dtype != torch.int32
                              or flags.shape != (1,) or flags.device != device):
        raise ValueError(f"flags must be an int32 tensor of shape (1,) on {device}, got "
                         f"{getattr(flags, 'dtype', type(flags).__name__)} of shape "
                         f"{tuple(getattr(flags, 'shape', ()))}")


def sparse_allgather(msg: SparseMessage, group: dist.ProcessGroup | None = None, *, dtype: torch.dtype | None = None,
                     check: bool = True, traffic: Traffic | None = None, flags: torch.Tensor | None = None,
                     wire: str = "plain", rounding: Rounding | None = None) -> torch.Tensor:
    """TopK-SGD: every rank's k pairs, scatter-added into a flat dense tensor of ``msg.numel`` elements: the SUM
    over the group's ranks (not averaged), identical on every rank. Accumulates in float32 and returns ``dtype``
    (default the message's). ``check=False`` skips the header agreement: only when the caller has already made
    sure every rank passes the same k, numel, dtype, wire and flags or none. ``flags`` (int32[1], optional): bits
    this rank raises, carried inside the payload; on return it holds their OR over the group.

    ``wire`` (:mod:`gtopk_ext.wire`): ``"plain"`` or ``"compact"`` (4 bytes a pair; the used slots only). With
    compact, what the wire took off this rank's values (float16 rounding, and the slots past the count, which
    are not sent) is added to ``rounding`` when given: add it to the residual, or it is lost. A corrupted
    compact payload raises ValueError on every rank (every rank decodes every payload), nothing written."""
    group, _, size = group_rank_and_size(group)
    if check:
        _agree_on_message(msg, flags, group, "sparse_allgather", traffic, wire=wire)
    head = _head(msg.count, flags)
    indices, values = msg.indices, msg.values
    if wire == "compact":
        indices, values, _ = ascending(indices, values, msg.count)
    payload, _, sent = pack(wire, indices, values, head, msg.numel, msg.backend)
    if wire == "compact" and rounding is not None:
        rounding.add(indices, rounding_error(values, sent))
    gathered = [torch.empty_like(payload) for _ in range(size)]
    dist.all_gather(gathered, payload, group=group)
    if traffic is not None:
        nbytes = ring_allgather_bytes(payload.numel(), size)
        traffic.add(nbytes, nbytes)
    pairs = [unpack(wire, p, msg.k, msg.numel, msg.values.dtype, head.numel(), msg.backend) for p in gathered]
    if wire == "compact":
        _raise_if_corrupt(int(sum(invalid for _, _, _, invalid in pairs)), "sparse_allgather")
    if flags is not None:
        flags.copy_(_or_flags(h[1:] for _, _, h, _ in pairs))
    total = torch.zeros(msg.numel, dtype=torch.float32, device=msg.values.device)
    ops.scatter_add_(total, torch.cat([i for i, _, _, _ in pairs]), torch.cat([v for _, v, _, _ in pairs]).float(),
                     backend=msg.backend)
    return total.to(dtype or msg.values.dtype)


def _raise_if_corrupt(invalid: int, what: str) -> None:
    """Raise when the compact payloads decoded by the group showed ``invalid`` signs of corruption (the same
    number on every rank, so every rank raises alike)."""
    if invalid:
        raise ValueError(f"{what}: a compact payload arrived corrupted ({invalid} slots or table entries that no "
                         "encoding makes); nothing of it was written")


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group: dist.ProcessGroup,
              traffic: Traffic | None) -> None:
    """Send ``send`` to and receive ``recv`` from group rank ``peer`` at the same time."""
    global_peer = dist.get_global_rank(group, peer)
    sent, received = _p2p_buffer(send, group), _p2p_buffer(recv, group)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, global_peer, group),
                                    dist.P2POp(dist.irecv, received, global_peer, group)])
    for work in works:
        work.wait()
    if received is not recv:
        recv.copy_(received)
    if traffic is not None:
        traffic.add(send.numel() * send.element_size(), recv.numel() * recv.element_size())


def _send(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, traffic: Traffic | None) -> None:
    dist.send(_p2p_buffer(tensor, group), dist.get_global_rank(group, peer), group=group)
    if traffic is not None:
        traffic.add(tensor.numel() * tensor.element_size(), 0)


def _recv(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, traffic: Traffic | None) -> torch.Tensor:
    buffer = _p2p_buffer(tensor, group)
    dist.recv(buffer, dist.get_global_rank(group, peer), group=group)
    if buffer is not tensor:
        tensor.copy_(buffer)
    if traffic is not None:
        traffic.add(0, tensor.numel() * tensor.element_size())
    return tensor


def _p2p_buffer(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The tensor that a point-to-point op may hand to the group's backend: Gloo's send and recv read and write
    the buffer from the CPU, so a CUDA tensor goes through a host copy (the caller copies a received one back);
    Gloo's collectives and NCCL take CUDA tensors as they are."""
    return tensor.to(_p2p_device(tensor.device, group))


def _p2p_device(device: torch.device, group: dist.ProcessGroup) -> torch.device:
    return torch.device("cpu") if dist.get_backend(group) == dist.Backend.GLOO else device


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
                    traffic: Traffic | None = None, flags: torch.Tensor | None = None, wire: str = "plain",
                    rounding: Rounding | None = None) -> tuple[SparseMessage, torch.Tensor]:
    """gTop-k: the global top-k of the sum of every rank's sparse message, in O(k log P) traffic.

    In round r each rank merges its current set with that of rank ``rank XOR 2^r``
    (:func:`gtopk_ext.ops.merge_topk`). For a world size P that is not a power of two, the ranks past the largest
    power of two first fold their set into rank ``rank - 2^floor(log2 P)`` and receive the result at the end.
    Returns ``(glob, applied)``: ``glob`` is the same SparseMessage on every rank (values summed over ranks, not
    averaged, in :func:`carried_dtype` of the message's dtype: float32 for float16; ``glob.count`` is the size of
    the last merged union); ``applied[j]`` is True where this rank's slot j is inside glob's sums, i.e. its
    index survived every merge on its path. The caller keeps ``msg.values[~applied]`` (error feedback): nothing
    is lost. ``check`` and ``flags`` as in :func:`sparse_allgather` (the flags ride along every merge).

    ``wire="compact"`` (:mod:`gtopk_ext.wire`) sends each set in 4 bytes a pair, its used slots only (slots past
    the count are then not applied). Both partners of a round merge the sets as the wire carried them, so they
    still compute the same merge; the rounding error of a set that survives into glob is added to ``rounding``
    (when given) by exactly one rank: the sender of a rank's own message, and for a merged set forwarded in a
    later round the lowest rank of the ranks holding it (of round r: the one whose low r bits are 0). When some
    ranks were folded, every rank takes glob as the wire carries it to them (rank 0 keeps that rounding error),
    so glob stays the same everywhere. A corrupted compact payload raises ValueError on every rank (an int32
    allreduce at the end), after nothing of it was written out of bounds.
    """
    group, rank, size = group_rank_and_size(group)
    if check:
        _agree_on_message(msg, flags, group, "gtopk_allreduce", traffic, wire=wire)
    k, dtype, numel, backend = msg.k, carried_dtype(msg.values.dtype), msg.numel, msg.backend
    device = msg.values.device
    applied = torch.ones(k, dtype=torch.bool, device=device)
    own_values = msg.values.to(dtype, copy=True)
    if size == 1:
        return SparseMessage(own_values, msg.indices.clone(), msg.count.clone(), numel, backend=backend), applied
    compact = wire == "compact"
    butterfly = 1 << (size.bit_length() - 1)
    head_words = 1 if flags is None else 2
    received_size = payload_size(wire, k, numel, dtype, head_words)
    mask_size = (k + 7) // 8  # a folded rank's applied mask comes back with the result, a bit per slot
    own_indices, order = msg.indices, None
    if compact:
        own_indices, own_values, order = ascending(msg.indices, own_values, msg.count)
    invalid = torch.zeros(1, dtype=torch.int32, device=device)  # signs of corruption in what this rank decoded

    def decode(payload: torch.Tensor, payload_wire: str = wire):
        peer_indices, peer_values, peer_head, peer_invalid = unpack(payload_wire, payload, k, numel, dtype,
                                                                    head_words, backend)
        if peer_invalid is not None:
            invalid.add_(peer_invalid)
        return peer_indices, peer_values, peer_head

    def sent_slots_only(slots_applied: torch.Tensor) -> torch.Tensor:
        """With compact, the slots past the count are not sent, so not applied."""
        return slots_applied & (torch.arange(k, device=device) < msg.count.clamp(0, k)) if compact else slots_applied

    if rank >= butterfly:  # folded into rank - butterfly; the result comes back with this rank's applied mask
        partner = rank - butterfly
        payload, _, sent = pack(wire, own_indices, own_values, _head(msg.count, flags), numel, backend)
        _send(payload, partner, group, traffic)
        result = _recv(torch.empty(received_size + mask_size, dtype=torch.uint8, device=device), partner, group,
                       traffic)
        indices, values, head = decode(result[:received_size])
        if flags is not None:
            flags.copy_(head[1:])
        applied = sent_slots_only(_mask_from_bytes(result[received_size:], k))
        if compact:
            _raise_if_corrupt(_allreduce_invalid(invalid, group, traffic), "gtopk_allreduce")
            if rounding is not None:
                rounding.add(own_indices, torch.where(applied, rounding_error(own_values, sent), 0))
        return (SparseMessage(values.clone(), indices.clone(), head[:1].clone(), numel, backend=backend),
                _in_slot_order(applied, order))

    indices, values, count = own_indices, own_values, msg.count
    raised = None if flags is None else flags.clone()  # the OR of the flags this rank has seen so far
    # (slot indices, applied mask) of every contribution this rank answers for: its slots, a folded rank's, and
    # with compact the rounding errors it keeps (their mask: still in the set).
    tracked = [(own_indices, applied)]
    kept_errors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (indices, errors, still in the set)
    folded = rank + butterfly
    if folded < size:
        received = _recv(torch.empty(received_size, dtype=torch.uint8, device=device), folded, group, traffic)
        folded_indices, folded_values, folded_head = decode(received)
        raised = None if flags is None else raised.bitwise_or_(folded_head[1:])
        tracked.append((folded_indices, torch.ones(k, dtype=torch.bool, device=device)))
        indices, values, count = ops.merge_topk(indices, values, folded_indices, folded_values, k, backend=backend)
        _mark_survivors(tracked, indices, count)
    for bit in range(butterfly.bit_length() - 1):
        peer = rank ^ (1 << bit)
        payload, sent_indices, sent_values = pack(wire, indices, values, _head(count, raised), numel, backend)
        if compact:
            if rank & ((1 << bit) - 1) == 0:  # this rank keeps the rounding error of the set it sends
                used = torch.arange(k, device=device) < count.clamp(0, k)
                errors = torch.where(used, rounding_error(values, sent_values), 0)
                kept_errors.append((indices, errors, used))
            indices, values = sent_indices, sent_values  # merge what the partner merges
        received = torch.empty(received_size, dtype=torch.uint8, device=device)
        _exchange(payload, received, peer, group, traffic)
        peer_indices, peer_values, peer_head = decode(received)
        raised = None if flags is None else raised.bitwise_or_(peer_head[1:])
        # Both partners put the lower rank's set first, so they compute bitwise the same merge.
        if rank < peer:
            indices, values, count = ops.merge_topk(indices, values, peer_indices, peer_values, k, backend=backend)
        else:
            indices, values, count = ops.merge_topk(peer_indices, peer_values, indices, values, k, backend=backend)
        _mark_survivors(tracked + [(i, alive) for i, _, alive in kept_errors], indices, count)
    if size != butterfly and (compact or folded < size):  # glob, as the wire carries it to the folded ranks
        payload, sent_indices, sent_values = pack(wire, indices, values, _head(count, raised), numel, backend)
        if compact:  # every rank takes glob as the wire carries it; rank 0 keeps the rounding error
            if rank == 0:
                used = torch.arange(k, device=device) < count.clamp(0, k)
                kept_errors.append((indices, torch.where(used, rounding_error(values, sent_values), 0), used))
            indices, values = sent_indices, sent_values
        if folded < size:
            _send(torch.cat([payload, _mask_to_bytes(tracked[1][1])]), folded, group, traffic)
    if flags is not None:
        flags.copy_(raised)
    if compact:
        _raise_if_corrupt(_allreduce_invalid(invalid, group, traffic), "gtopk_allreduce")
        if rounding is not None:
            for error_indices, errors, alive in kept_errors:
                rounding.add(error_indices, torch.where(alive, errors, 0))
    return SparseMessage(values, indices, count, numel, backend=backend), _in_slot_order(sent_slots_only(applied),
                                                                                         order)


def _mask_to_bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as bits, 8 slots a byte (slot j: bit j % 8 of byte j // 8)."""
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, -mask.numel() % 8)).view(-1, 8)
    return (bits << torch.arange(8, dtype=torch.uint8, device=mask.device)).sum(1, dtype=torch.uint8)


def _mask_from_bytes(raw: torch.Tensor, k: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=raw.device)
    return ((raw.unsqueeze(1) >> shifts) & 1).view(-1)[:k].bool()


def _in_slot_order(mask: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """A mask over slots that were permuted by ``order`` (:func:`gtopk_ext.wire.ascending`), in the original
    slot order."""
    return mask if order is None else torch.empty_like(mask).index_put_((order,), mask)


def _allreduce_invalid(invalid: torch.Tensor, group: dist.ProcessGroup, traffic: Traffic | None) -> int:
    """The group's total of the corruption signs that its ranks decoded (one int32 allreduce)."""
    return int(_allreduce_counts(invalid, group, traffic))


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


# ----- Ok-Topk -----

# The paper re-evaluates its global threshold every 32 (or 128) iterations and its regions periodically;
# 32 is the default of both periods here.
OKTOPK_PERIOD = 32
# A reused global threshold stays while the pairs it selects over all regions number within these fractions of k
# (the bounds the paper's code keeps its local selection in); outside them it is re-estimated in the same step.
OKTOPK_REUSE_BOUNDS = (0.75, 1.25)
# Sub-bins per octave of the threshold estimate's second histogram: its relative resolution is 1/256.
OKTOPK_SUB_BINS = 256


@dataclass
class OkTopkState:
    """What :func:`oktopk_allreduce` keeps between the steps of one bucket: keep one per bucket, the same on every
    rank (every rank makes the same calls with it, so its fields stay equal across ranks).

    ``boundaries`` (the P - 1 first indices of regions 1..P-1) are re-estimated every ``boundary_period`` calls,
    ``threshold`` (the global threshold on |summed value|) every ``threshold_period`` calls and whenever the pairs
    it selects leave ``OKTOPK_REUSE_BOUNDS`` times k; both also when the bucket's numel or the world size differ
    from those they were estimated for. ``step`` counts the calls.
    """

    boundary_period: int = OKTOPK_PERIOD
    threshold_period: int = OKTOPK_PERIOD
    step: int = 0
    boundaries: list[int] | None = None
    threshold: float | None = None
    shape: tuple[int, int] | None = None  # (numel, world size) that boundaries and threshold were estimated for

    def __post_init__(self) -> None:
        for name in ("boundary_period", "threshold_period"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"OkTopkState: {name} must be an int >= 1, got {value!r}")

    def plan(self, numel: int, size: int) -> tuple[bool, bool]:
        """(re-estimate the boundaries, re-estimate the threshold) for a call on ``numel`` elements and ``size``
        ranks. Pure: ranks compare it before anything changes."""
        fresh = self.shape != (numel, size)
        return (fresh or self.boundaries is None or self.step % self.boundary_period == 0,
                fresh or self.threshold is None or self.step % self.threshold_period == 0)

    def state_dict(self) -> dict:
        return {"boundary_period": self.boundary_period, "threshold_period": self.threshold_period,
                "step": self.step, "boundaries": None if self.boundaries is None else list(self.boundaries),
                "threshold": self.threshold, "shape": None if self.shape is None else list(self.shape)}

    def load_state_dict(self, state_dict: dict) -> None:
        restored = OkTopkState(**{**state_dict, "shape": None if state_dict.get("shape") is None
                                  else tuple(state_dict["shape"])})
        self.__dict__.update(restored.__dict__)


def _pack_pairs(wire: str, indices: torch.Tensor, values: torch.Tensor, numel: int,
                backend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(payload, sent_indices, sent_values)`` of a run of n ascending pairs (n is known to the receiver from
    the counts; an empty run is an empty payload, not sent): plain, n int32 indices then n values' bits;
    compact, :func:`gtopk_ext.wire.pack` with n as the head."""
    n = indices.numel()
    if wire == "plain" or n == 0:
        return torch.cat([as_bytes(indices), as_bytes(values)]), indices, values
    return pack(wire, indices, values, torch.tensor([n], dtype=torch.int32, device=indices.device), numel, backend)


def _pairs_size(wire: str, n: int, numel: int, dtype: torch.dtype) -> int:
    if wire == "plain" or n == 0:
        return n * (4 + torch.empty((), dtype=dtype).element_size())
    return payload_size(wire, n, numel, dtype, 1)


def _unpack_pairs(wire: str, payload: torch.Tensor, n: int, numel: int, dtype: torch.dtype, backend,
                  invalid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The n pairs of a payload made by :func:`_pack_pairs`; signs of corruption are added to ``invalid``."""
    if wire == "plain":
        return payload[:4 * n].view(torch.int32), payload[4 * n:].view(dtype)
    indices, values, _, payload_invalid = unpack(wire, payload, n, numel, dtype, 1, backend)
    invalid.add_(payload_invalid)
    return indices, values


def _in_sorted(sorted_indices: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Whether each of ``indices`` is one of ``sorted_indices`` (ascending)."""
    if sorted_indices.numel() == 0:
        return torch.zeros(indices.shape, dtype=torch.bool, device=indices.device)
    found = torch.searchsorted(sorted_indices, indices).clamp_(max=sorted_indices.numel() - 1)
    return sorted_indices[found] == indices


def _sparse_alltoallv(payloads: list[torch.Tensor | None], recv_nbytes: list[int], group: dist.ProcessGroup,
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
            works.append(dist.P2POp(dist.isend, _p2p_buffer(payload, group), dist.get_global_rank(group, destination),
                                    group))
            sent_bytes += payload.numel()
        if recv_nbytes[source]:
            received[source] = torch.empty(recv_nbytes[source], dtype=torch.uint8,
                                           device=_p2p_device(device, group))
            works.append(dist.P2POp(dist.irecv, received[source], dist.get_global_rank(group, source), group))
    if works:
        for work in dist.batch_isend_irecv(works):
            work.wait()
    received = [None if payload is None else payload.to(device) for payload in received]
    if traffic is not None:
        traffic.add(sent_bytes, sum(nbytes for r, nbytes in enumerate(recv_nbytes) if r != rank))
    return received


def _exchange_counts(counts: list[int], group: dist.ProcessGroup, device: torch.device,
                     traffic: Traffic | None) -> list[int]:
    """All-to-all of one count per rank pair: ``counts[r]`` goes to rank r; returns the count from each rank."""
    size = len(counts)
    send = torch.tensor(counts, dtype=torch.int64, device=device)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    if traffic is not None:
        traffic.add(8 * (size - 1), 8 * (size - 1))
    return received.tolist()


def _gather_counts(counts: list[int], group: dist.ProcessGroup, size: int, device: torch.device,
                   traffic: Traffic | None) -> list[list[int]]:
    """Every rank's ``counts`` (the same number on every rank), in group-rank order."""
    mine = torch.tensor(counts, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    if traffic is not None:
        nbytes = ring_allgather_bytes(mine.numel() * 8, size)
        traffic.add(nbytes, nbytes)
    return [g.tolist() for g in gathered]


def _allreduce_counts(counts: torch.Tensor, group: dist.ProcessGroup, traffic: Traffic | None) -> torch.Tensor:
    dist.all_reduce(counts, group=group)
    if traffic is not None:
        nbytes = ring_allreduce_bytes(counts.numel() * counts.element_size(), dist.get_world_size(group))
        traffic.add(nbytes, nbytes)
    return counts


def _balanced_boundaries(sorted_indices: torch.Tensor, numel: int, group: dist.ProcessGroup, size: int,
                         traffic: Traffic | None) -> list[int]:
    """The paper's region boundaries: each rank splits its own selected indices into P runs of equal count, and
    the ranks average those P - 1 split points (one allreduce of P - 1 integers). Averages of ascending lists
    ascend, so the regions are ordered; a rank that selected nothing proposes equal-width regions."""
    n = sorted_indices.numel()
    if n:
        positions = torch.tensor([n * i // size for i in range(1, size)], device=sorted_indices.device)
        proposal = sorted_indices[positions].long()
    else:
        proposal = torch.tensor([numel * i // size for i in range(1, size)], dtype=torch.int64,
                                device=sorted_indices.device)
    return (_allreduce_counts(proposal, group, traffic) // size).tolist()


def _octave_edges(device: torch.device) -> torch.Tensor:
    """2^-149 (float32's smallest subnormal), 2^-148, ..., 2^127, then +inf: float32 magnitudes by octave."""
    powers = torch.ldexp(torch.ones(277, dtype=torch.float32), torch.arange(-149, 128, dtype=torch.int32))
    return torch.cat([powers, torch.tensor([math.inf])]).to(device)


def _count_at_least(magnitude: torch.Tensor, edges: torch.Tensor, group: dist.ProcessGroup,
                    traffic: Traffic | None) -> torch.Tensor:
    """``at_least[i]`` = how many magnitudes over all ranks are >= edges[i] (exact: the same comparisons as the
    selection's), from one allreduce of a histogram."""
    bins = torch.bucketize(magnitude, edges, right=True)  # how many edges each magnitude reaches
    # Bin 0 (below every edge) counts for nothing. int32 is enough: the sums of all regions have distinct
    # indices, fewer than numel < 2^31.
    histogram = torch.bincount(bins, minlength=edges.numel() + 1)[1:].int()
    return _allreduce_counts(histogram, group, traffic).flip(0).cumsum(0).flip(0)


def _global_threshold(magnitude: torch.Tensor, k: int, group: dist.ProcessGroup, traffic: Traffic | None) -> float:
    """The threshold on the regions' |sums| that the k-th largest of them over all ranks reaches, to 1/256 of its
    value: the lowest edge that at least k magnitudes reach (all nonzero ones when fewer than k are nonzero).

    The paper allgathers every region's sums to compute the exact threshold, O(Pk) bytes; two histogram
    allreduces find it here with O(1) bytes (278 + 256 int32 counts): one by octave, then one of 256 sub-bins
    inside the octave that holds the k-th largest. Selecting at the lower edge of its sub-bin keeps at least k (plus the
    ties of one sub-bin), so nothing starves when many values are equal; the surplus is cut at the end."""
    edges = _octave_edges(magnitude.device)
    at_least = _count_at_least(magnitude, edges, group, traffic)
    octave = int((at_least >= k).sum()) - 1  # at_least descends: the last edge that k magnitudes reach
    if octave < 0:
        return float(edges[0])
    if octave == edges.numel() - 1:  # k or more infinite (or NaN) sums
        return math.inf
    low, high = edges[octave], edges[octave + 1]
    sub_edges = low * (1 + torch.arange(OKTOPK_SUB_BINS, dtype=torch.float32, device=low.device) / OKTOPK_SUB_BINS)
    inside = magnitude[(magnitude >= low) & (magnitude < high)]
    sub_at_least = _count_at_least(inside, sub_edges, group, traffic) + at_least[octave + 1]
    return float(sub_edges[int((sub_at_least >= k).sum()) - 1])


def _threshold_holds(kept: int, nonzero: int, k: int) -> bool:
    """Whether a reused threshold that keeps ``kept`` of the ``nonzero`` nonzero sums may stay: it keeps between
    ``OKTOPK_REUSE_BOUNDS`` times k, or every nonzero sum when there are at most k (as a fresh estimate would:
    density 1 stays the dense sum)."""
    low, high = OKTOPK_REUSE_BOUNDS
    return kept == nonzero if nonzero <= k else low * k <= kept <= high * k


def _sum_by_index(runs: list[tuple[torch.Tensor, torch.Tensor]], backend) -> tuple[torch.Tensor, torch.Tensor]:
    """(ascending distinct indices, float32 sums of their values) of ascending runs of pairs, summed in run order
    then slot order: one linear merge per run (:func:`gtopk_ext.ops.merge_topk` with room for the whole union)."""
    indices, sums = runs[0][0][:0], torch.zeros(0, dtype=torch.float32, device=runs[0][1].device)
    for run_indices, run_values in runs:
        room = indices.numel() + run_indices.numel()
        if room:
            indices, sums, union = ops.merge_topk(indices, sums, run_indices, run_values.float(), room,
                                                  backend=backend)
            indices, sums = indices[:int(union)], sums[:int(union)]
    return indices, sums


def _largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of the k largest |values| (NaN as +inf), ascending; among equal ones the lower positions."""
    magnitude = values.float().abs().nan_to_num(nan=math.inf, posinf=math.inf)
    kth = torch.kthvalue(magnitude, magnitude.numel() - k + 1).values
    above, tied = magnitude > kth, magnitude == kth
    return (above | (tied & (tied.cumsum(0) <= k - above.sum()))).nonzero().squeeze(1)


def oktopk_allreduce(msg: SparseMessage, group: dist.ProcessGroup | None = None, *, state: OkTopkState | None = None,
                     check: bool = True, traffic: Traffic | None = None, flags: torch.Tensor | None = None,
                     wire: str = "plain", rounding: Rounding | None = None) -> tuple[SparseMessage, torch.Tensor]:
    """Ok-Topk (Li and Hoefler, PPoPP 2022): a global top-k of the sum of every rank's sparse message with about
    2k(P-1)/P pairs sent per rank, for any world size P.

    1. Split and reduce: the index space is cut into P regions, region r owned by rank r; each rank sends the pairs
       of its message (its first ``min(count, k)`` slots, sorted by index) to the owners of their regions, and
       each owner sums what it receives per index (float32, in source-rank order).
    2. Each owner keeps its sums whose |value| reaches the global threshold (NaN and inf always).
    3. Allgatherv: every owner sends what it kept to every rank; all ranks concatenate the regions in order. If
       more than k were kept, the k largest |sums| stay (NaN counts as infinite; ties to the lower index).

    Region boundaries follow the paper: every rank proposes the P - 1 indices that split its own selection into
    equal counts and the ranks average them (an allreduce of P - 1 integers), so the regions hold about equal
    numbers of pairs; re-estimated every ``state.boundary_period`` calls (gradients change slowly). The global
    threshold is reused between re-estimations, as in the paper, every ``state.threshold_period`` calls; unlike
    the paper it is also re-estimated at once when what it keeps drifts (:func:`_threshold_holds`), which bounds
    the pairs of phase 3 by 1.25k. The estimate itself is two histogram allreduces of O(1) bytes instead of the
    paper's allgather of every region's sums (:func:`_global_threshold`). ``state=None`` re-estimates both in
    the call. Message sizes: each phase first exchanges its counts (an all-to-all of one integer per rank pair,
    then an allgather of two, three with flags, per rank: O(P) bytes, counted in ``traffic``), so payloads carry
    exactly the pairs, nothing overflows a fixed capacity, and empty messages are not sent.

    Returns ``(glob, applied)`` as :func:`gtopk_allreduce` does: ``glob`` is bitwise the same SparseMessage on
    every rank (values summed over ranks, not averaged, in :func:`carried_dtype` of the message's dtype; indices
    ascending, distinct, padded with (0, 0) to k slots; ``glob.count`` is how many sums reached the threshold
    before the cut to k); ``applied[j]`` is True where this rank's slot j is inside glob's sums. Slots past
    ``min(count, k)`` are not sent, so not applied. The caller keeps ``msg.values[~applied]``: nothing is lost.
    ``check`` as in :func:`sparse_allgather` (with it, the ranks also compare their states' plans and whether
    they pass flags). ``flags`` (int32[1], optional): bits this rank raises, carried with the kept counts; on
    return it holds their OR over the group.

    ``wire="compact"`` (:mod:`gtopk_ext.wire`) sends the pairs of both phases in 4 bytes a pair (plus 4 bytes per
    65536 elements and message). Its rounding errors go to ``rounding`` (when given) where they reach glob: of
    phase 1 by the sender of each pair, of phase 3 by the owner of the region (all ranks, the owner included,
    use the kept sums as the wire carried them). A corrupted compact payload raises ValueError on every rank (an
    int32 allreduce at the end), after nothing of it was written out of bounds.
    """
    group, rank, size = group_rank_and_size(group)
    if state is None:
        state = OkTopkState()
    if check:
        def plan_fields() -> dict[str, int]:
            if not isinstance(state, OkTopkState):
                raise TypeError(f"state must be an OkTopkState or None, got {type(state).__name__}")
            repartition, reestimate = state.plan(msg.numel, size)
            return {"state_step": state.step, "repartition": int(repartition), "reestimate": int(reestimate)}

        _agree_on_message(msg, flags, group, "oktopk_allreduce", traffic, plan_fields,
                          ("state_step", "repartition", "reestimate"), wire=wire)
    k, numel, device = msg.k, msg.numel, msg.values.device
    dtype = carried_dtype(msg.values.dtype)
    if size == 1:
        return (SparseMessage(msg.values.to(dtype, copy=True), msg.indices.clone(), msg.count.clone(), numel,
                              backend=msg.backend), torch.ones(k, dtype=torch.bool, device=device))
    repartition, reestimate = state.plan(numel, size)
    state.shape = (numel, size)

    # 1. Split and reduce.
    used = min(max(int(msg.count), 0), k)
    indices, values = msg.indices[:used], msg.values[:used]
    if used > 1 and not bool((indices[1:] >= indices[:-1]).all()):  # compressors send them ascending already
        indices, order = torch.sort(indices, stable=True)
        values = values[order]
    if repartition:
        state.boundaries = _balanced_boundaries(indices, numel, group, size, traffic)
    region_starts = torch.tensor(state.boundaries, dtype=torch.int32, device=device)
    cuts = [0, *torch.searchsorted(indices, region_starts).tolist(), used]
    send_counts = [end - start for start, end in zip(cuts, cuts[1:])]
    recv_counts = _exchange_counts(send_counts, group, device, traffic)
    compact, backend = wire == "compact", msg.backend
    invalid = torch.zeros(1, dtype=torch.int32, device=device)  # signs of corruption in what this rank decoded
    sent_errors = []  # (indices, rounding errors) of the pairs this rank sent, with compact
    outgoing = []
    for r, (start, end) in enumerate(zip(cuts, cuts[1:])):
        run = (indices[start:end], values[start:end])
        if r == rank:  # its own region's pairs stay here, exact
            outgoing.append(run[0][:0].view(torch.uint8))
            continue
        payload, _, sent = _pack_pairs(wire, *run, numel, backend)
        outgoing.append(payload)
        if compact:
            sent_errors.append((run[0], rounding_error(run[1], sent)))
    incoming = _sparse_alltoallv(outgoing, [_pairs_size(wire, c, numel, values.dtype) for c in recv_counts], group,
                                 rank, traffic)
    runs = [_unpack_pairs(wire, incoming[r], recv_counts[r], numel, values.dtype, backend, invalid) if r != rank
            else (indices[cuts[r]:cuts[r + 1]], values[cuts[r]:cuts[r + 1]]) for r in range(size)
            if r == rank or incoming[r] is not None]
    region_indices, region_sums = _sum_by_index(runs, msg.backend)

    # 2. The global threshold.
    magnitude = region_sums.abs().nan_to_num(nan=math.inf, posinf=math.inf)
    threshold = _global_threshold(magnitude, k, group, traffic) if reestimate else state.threshold
    nonzero = int((magnitude > 0).sum())
    raised = [] if flags is None else [int(flags)]
    while True:
        kept = magnitude >= threshold
        counts = _gather_counts([int(kept.sum()), nonzero, *raised], group, size, device, traffic)
        kept_counts = [c[0] for c in counts]
        if reestimate or _threshold_holds(sum(kept_counts), sum(c[1] for c in counts), k):
            break
        threshold, reestimate = _global_threshold(magnitude, k, group, traffic), True
    if flags is not None:
        flags.fill_(functools.reduce(operator.or_, (c[2] for c in counts)))
    state.threshold = threshold
    state.step += 1

    # 3. Allgatherv of the kept sums.
    own_indices, own_sums = region_indices[kept], region_sums[kept].to(dtype)
    payload, _, sent_sums = _pack_pairs(wire, own_indices, own_sums, numel, backend)
    if compact:  # every rank, this one included, uses the sums as the wire carries them
        sent_errors.append((own_indices, rounding_error(own_sums, sent_sums)))
    incoming = _sparse_alltoallv([payload] * size, [_pairs_size(wire, c, numel, dtype) for c in kept_counts], group,
                                 rank, traffic)
    parts = [(own_indices, sent_sums) if r == rank else
             _unpack_pairs(wire, incoming[r], kept_counts[r], numel, dtype, backend, invalid) for r in range(size)
             if r == rank or incoming[r] is not None]
    glob_indices, glob_values = torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts])
    if glob_indices.numel() > k:
        best = _largest(glob_values, k)
        glob_indices, glob_values = glob_indices[best], glob_values[best]
    applied = torch.zeros(k, dtype=torch.bool, device=device)
    applied[:used] = _in_sorted(glob_indices, msg.indices[:used])
    if compact:
        _raise_if_corrupt(_allreduce_invalid(invalid, group, traffic), "oktopk_allreduce")
        if rounding is not None:
            for error_indices, errors in sent_errors:
                rounding.add(error_indices, torch.where(_in_sorted(glob_indices, error_indices), errors, 0))
    padding = k - glob_indices.numel()
    glob = SparseMessage(torch.cat([glob_values, glob_values.new_zeros(padding)]),
                         torch.cat([glob_indices, glob_indices.new_zeros(padding)]),
                         torch.tensor([sum(kept_counts)], dtype=torch.int32, device=device), numel,
                         backend=msg.backend)
    return glob, applied


# ----- hierarchical: dense inside a node, sparse between nodes -----

HIERARCHICAL_INNER = ("gtopk", "allgather", "oktopk")
# Per (process group name, local_size): (that group, this rank's node group, its cross-node group), created once
# per group (a group destroyed and created again under the same name gets new ones).
_node_groups: dict[tuple[str, int], tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]] = {}


@dataclass
class HierarchicalResult:
    """What :func:`hierarchical_allreduce` did on this rank.

    ``average``: the flat average over the group's ranks of what was applied, in the tensor's dtype, bitwise the
    same on every rank; None when a flag was raised (then nothing was changed). ``msg``: this rank's selection
    from its shard's accumulation, indices into the whole tensor; ``applied``: the mask over its slots of those
    inside the average. ``shard``: the slice of the tensor this rank selected from (and keeps the residual of).
    """

    average: torch.Tensor | None
    msg: SparseMessage
    applied: torch.Tensor
    shard: slice


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
    local rank on every node), created at the first call and cached. Every rank of ``group`` makes its first call
    for the same (group, local_size) at the same point (the groups' names count the groups created before). Only
    ``group``'s ranks create them, which moves their count past that of any other rank: when ``group`` is not the
    whole world, create groups that every rank must create before this first call."""
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
    """Let go of the cached groups of :func:`node_groups` (a group held past ``dist.destroy_process_group`` keeps
    its Gloo threads until the interpreter finalizes, where they can abort the process)."""
    _node_groups.clear()


def shard_bounds(numel: int, local_size: int) -> list[int]:
    """The start of each local rank's shard, then the end: ``local_size`` contiguous shards of
    ``ceil(numel / local_size)`` elements, the last ones shorter (so that padding the tensor at its end to
    ``local_size`` times that width lines the shards up)."""
    width = -(-numel // local_size)
    return [min(numel, width * i) for i in range(local_size + 1)]


def hierarchical_allreduce(tensor: torch.Tensor, residual: torch.Tensor | None, compressor: Compressor, k: int,
                           local_size: int, group: dist.ProcessGroup | None = None, *, inner: str = "gtopk",
                           inner_state: OkTopkState | None = None, step: int | None = None,
                           traffic: Traffic | None = None, flags: torch.Tensor | None = None,
                           nonfinite_flag: int = 1, wire: str = "plain",
                           rounding: Rounding | None = None) -> HierarchicalResult:
    """Dense inside a node, sparse between nodes (a node: ``local_size`` consecutive ranks of ``group``).

    1. Dense reduce-scatter inside the node of ``tensor + residual`` (flat): local rank l gets its node's sum of
       shard l (:func:`shard_bounds`).
    2. Local rank l selects ``tensor_shares(max(k, local_size), shard sizes)[l]`` slots of that sum with
       ``compressor`` (so the shards send k slots in all, at least one each) and runs the ``inner`` sparse
       collective (gtopk, allgather or oktopk, with ``inner_state`` for oktopk) with the ranks of local rank l on
       the other nodes.
    3. Allgather inside the node of every shard's average (as index-value pairs when they take fewer bytes): the
       result, the same on every rank.

    ``residual`` (flat, the tensor's size, or None: no error feedback) is zero outside this rank's shard and
    becomes, on return, zero outside it and the shard's node sum minus what was applied inside it: every other
    element of ``tensor + residual`` is in the average. ``flags`` (int32[1], optional): bits this rank raises;
    on return their OR over the group. A shard whose node sum is not finite sends nothing and raises
    ``nonfinite_flag``; when any bit is raised, nothing is applied and ``tensor`` and ``residual`` are left as
    they were (``average`` None). ``wire``: the inner collective's wire format; with ``"compact"`` the rounding
    errors this rank answers for stay in its residual, and are added to ``rounding`` (indices into the whole
    tensor) when given. Every rank must pass the same k, local_size, inner and wire."""
    group, rank, size = group_rank_and_size(group)
    if inner not in HIERARCHICAL_INNER:
        raise ValueError(f"inner must be one of {HIERARCHICAL_INNER}, got {inner!r}")
    check_wire(wire)
    node_group, cross_group = node_groups(group, local_size)
    local_rank, numel, device = rank % local_size, tensor.numel(), tensor.device
    bounds = shard_bounds(numel, local_size)
    widths = [end - start for start, end in zip(bounds, bounds[1:])]
    shard = slice(bounds[local_rank], bounds[local_rank + 1])
    width = widths[0]

    # 1. Reduce-scatter inside the node.
    acc = tensor if residual is None else tensor + residual
    shard_acc = node_reduce_scatter(acc, bounds, node_group, local_rank, traffic)

    # 2. The sparse collective between nodes on this shard.
    raised = torch.zeros(1, dtype=torch.int32, device=device) if flags is None else flags.clone()
    # At least one slot per nonempty shard: a shard without any would keep its residual forever.
    shares = tensor_shares(max(k, local_size), widths)
    share = shares[local_rank]
    shard_rounding = Rounding()  # indices into the shard
    on_wire = dict(check=False, traffic=traffic, flags=raised, wire=wire, rounding=shard_rounding)
    if not is_finite(shard_acc):
        raised.bitwise_or_(nonfinite_flag)
    if share and not int(raised) & nonfinite_flag:
        msg = compressor.compress(shard_acc, None, step=step, k=share)
    else:
        msg = padding_message(shard_acc, max(share, 1), compressor)
    if share == 0:  # an empty shard (numel < local_size): on every node alike, nothing to exchange
        glob, applied = shard_acc.float(), torch.zeros(1, dtype=torch.bool, device=device)
    elif inner == "allgather":
        glob = sparse_allgather(msg, cross_group, dtype=torch.float32, **on_wire)
        applied = torch.ones(share, dtype=torch.bool, device=device)
    elif inner == "oktopk":
        glob, applied = oktopk_allreduce(msg, cross_group, state=inner_state, **on_wire)
    else:
        glob, applied = gtopk_allreduce(msg, cross_group, **on_wire)

    # 3. Allgather inside the node of the shards' averages (as pairs of indices into the shard and values) and flags.
    if isinstance(glob, SparseMessage):  # gTop-k's and Ok-Topk's share slots: distinct indices, then (0, 0) padding
        indices, values = glob.indices, (glob.values.float() / size).to(tensor.dtype)
    else:  # the allgather's dense sum
        mine = (glob / size).to(tensor.dtype)
        indices = mine.nonzero().view(-1).to(torch.int32)
        values = mine[indices.long()]
    most = min(width, inner_result_slots(inner, max(shares), size // local_size))
    average, combined = node_allgather(indices, values, int(raised), widths, most, node_group, traffic)
    if flags is not None:
        flags.fill_(combined)
    shifted = SparseMessage(msg.values, msg.indices + shard.start, msg.count, numel, msg.stats, msg.backend)
    if combined:
        return HierarchicalResult(None, shifted, torch.zeros_like(applied), shard)
    if residual is not None:
        residual.zero_()
        kept = residual[shard].copy_(shard_acc)
        if share:
            ops.residual_update_(kept, msg.indices, msg.values * applied, backend=msg.backend)
            shard_rounding.add_to(kept, backend=msg.backend)
    if rounding is not None:
        error_indices, errors = shard_rounding.pairs(tensor.dtype, device)
        rounding.add(error_indices + shard.start, errors)
    return HierarchicalResult(average, shifted, applied, shard)


def node_reduce_scatter(tensor: torch.Tensor, bounds: list[int], node_group: dist.ProcessGroup, local_rank: int,
                        traffic: Traffic | None) -> torch.Tensor:
    """Shard ``local_rank`` (of ``bounds``) of the sum over the node's ranks of ``tensor`` (flat, contiguous): this
    rank's own part, then the others' in local-rank order. Every rank sends shard r straight to local rank r, all
    at once: on Gloo this took a third to a sixth of ``dist.reduce_scatter``'s time on 2 and 4 ranks (the same
    bytes as a ring)."""
    shards = [tensor[start:end] for start, end in zip(bounds, bounds[1:])]
    mine = shards[local_rank]
    received = _sparse_alltoallv([shard.view(torch.uint8) for shard in shards],
                                 [mine.numel() * mine.element_size()] * len(shards), node_group, local_rank, traffic)
    total = mine.clone()
    for r, payload in enumerate(received):
        if r != local_rank and payload is not None:
            total += payload.view(tensor.dtype)
    return total


def inner_result_slots(inner: str, share: int, nodes: int) -> int:
    """At most how many slots the ``inner`` collective's result on a shard has, ``share`` selected on each of
    ``nodes`` nodes: gTop-k and Ok-Topk keep ``share``, the allgather their union."""
    return share * nodes if inner == "allgather" else share


def node_gather_bytes(width: int, most: int, element_size: int) -> int:
    """Bytes of one rank's message in :func:`node_allgather`: a header and ``most`` index-value pairs, or the
    widest shard (``width`` elements) and its flags when that is fewer."""
    return min(8 + most * (4 + element_size), (width + 1) * element_size)


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


def padding_message(tensor: torch.Tensor, k: int, compressor: Compressor) -> SparseMessage:
    """k padding slots (index 0, value 0) of a message about ``tensor``: what a rank that selects nothing sends."""
    device = tensor.device
    return SparseMessage(tensor.new_zeros(k), torch.zeros(k, dtype=torch.int32, device=device),
                         torch.zeros(1, dtype=torch.int32, device=device), max(tensor.numel(), 1),
                         backend=compressor.backend.for_device(device))


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite (one host sync; aminmax: one vectorised pass)."""
    if not tensor.numel():
        return True
    smallest, largest = torch.aminmax(tensor)
    return math.isfinite(smallest) and math.isfinite(largest)

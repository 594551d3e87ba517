"""The protocol every collective of this package follows.

Before any payload moves, the ranks agree on a small header (k, numel, dtype, the wire, the caller's plan): Gloo
aborts the whole process when a message's size differs from the receiver's buffer, and a check between two
partners only would leave the other ranks waiting, so the header is gathered over the group and every rank raises
the same clear error (:class:`Disagreement`). A caller that reduces the same tensor step after step (a bucket)
keeps an :class:`Agreement`: the header is exchanged again only when the plan changes. A collective is a
:class:`Collective`, its result a :class:`Reduced`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from gtopk_ext import ops
from gtopk_ext._contract import FLOAT_DTYPES
from gtopk_ext._worker import Disagreement
from gtopk_ext.backends import Backend, BackendChoice, BackendLike
from gtopk_ext.collectives._transport import Traffic, gather_counts
from gtopk_ext.compressors import COMPRESSOR_KINDS
from gtopk_ext.message import SparseMessage
from gtopk_ext.wire import WIRES, Rounding, Wire, WireLike, wire_named

DTYPE_CODES = {dtype: code for code, dtype in enumerate(FLOAT_DTYPES, start=1)}  # header codes of the op dtypes
# The names behind the header fields that are codes, for the errors; gtopk_ext.collectives, which defines the
# collectives, adds theirs.
FIELD_NAMES: dict[str, dict[int, str]] = {"dtype": {code: str(dtype) for dtype, code in DTYPE_CODES.items()},
                                          "wire": {wire.code: wire.name for wire in WIRES.values()},
                                          "compressor": dict(enumerate(COMPRESSOR_KINDS))}
MAX_NUMEL = 2**31 - 1
_INVALID = -1  # a header field of a rank whose own input was invalid


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int, int]:
    """``(group, rank in it, its size)``; ``None`` is the default (world) group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the process group it was given")
    return group, rank, dist.get_world_size(group)


def gather_headers(fields: dict[str, int], group: dist.ProcessGroup, device: torch.device,
                   traffic: Traffic | None = None) -> list[dict[str, int]]:
    """Every rank's ``fields`` (same names on every rank, int64 values), in group-rank order."""
    return [dict(zip(fields, h)) for h in gather_counts(list(fields.values()), group, device, traffic)]


def require_same(headers: list[dict[str, int]], names: tuple[str, ...], what: str) -> None:
    """Raise (on every rank alike, since all hold the same headers) when a rank's input was invalid or the
    ranks disagree on one of ``names``."""
    invalid = [rank for rank, h in enumerate(headers) if h["valid"] == 0]
    if invalid:
        raise Disagreement(f"{what}: the input of rank(s) {invalid} was invalid (see the error on those ranks)")
    for name in names:
        seen = [h[name] for h in headers]
        if len(set(seen)) > 1:
            listing = ", ".join(f"rank {rank}: {_readable(name, value)}" for rank, value in enumerate(seen))
            raise Disagreement(f"{what}: {name} differs across ranks ({listing}); every rank must pass the same "
                             f"{', '.join(names)}")


def _readable(name: str, value: int) -> object:
    """A header field as the user wrote it: the name behind a code (FIELD_NAMES), else the number."""
    names = FIELD_NAMES.get(name, {})
    return repr(names[value]) if value in names else value


def check_message(msg: SparseMessage, flags: torch.Tensor | None) -> None:
    """Raise a clear error unless ``msg`` is a well-formed SparseMessage and ``flags`` None or int32[1] on its
    device."""
    if not isinstance(msg, SparseMessage):
        raise TypeError(f"msg must be a SparseMessage, got {type(msg).__name__}")
    values, indices, count = msg.values, msg.indices, msg.count
    for field_name, tensor in (("values", values), ("indices", indices), ("count", count)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"msg.{field_name} must be a tensor, got {type(tensor).__name__}")
    if values.dtype not in DTYPE_CODES:
        raise TypeError(f"msg.values must be float32, float16 or bfloat16, got {values.dtype}")
    if indices.dtype != torch.int32:
        raise TypeError(f"msg.indices must be int32, got {indices.dtype}")
    if values.dim() != 1 or indices.shape != values.shape or values.numel() == 0:
        raise ValueError(f"msg.values and msg.indices must be 1-D with the same k >= 1 slots, got shapes "
                         f"{tuple(values.shape)} and {tuple(indices.shape)}")
    if count.dtype != torch.int32 or count.shape != (1,):
        raise ValueError(f"msg.count must be int32 of shape (1,), got {count.dtype} of shape {tuple(count.shape)}")
    if indices.device != values.device or count.device != values.device:
        raise ValueError(f"msg's tensors must be on one device, got values on {values.device}, indices on "
                         f"{indices.device}, count on {count.device}")
    if not isinstance(msg.numel, int) or not 0 < msg.numel <= MAX_NUMEL:
        raise ValueError(f"msg.numel must be an int in [1, 2^31 - 1], got {msg.numel!r}")
    if not bool(((indices >= 0) & (indices < msg.numel)).all()):
        raise ValueError(f"msg.indices must lie in [0, msg.numel = {msg.numel}), got "
                         f"{int(indices.min())} to {int(indices.max())}")
    if flags is not None and (not isinstance(flags, torch.Tensor) or flags.dtype != torch.int32
                              or flags.shape != (1,) or flags.device != values.device):
        raise ValueError(f"flags must be an int32 tensor of shape (1,) on {values.device}, got "
                         f"{getattr(flags, 'dtype', type(flags).__name__)} of shape "
                         f"{tuple(getattr(flags, 'shape', ()))}")


def agree_on_message(msg: SparseMessage, flags: torch.Tensor | None, group: dist.ProcessGroup, what: str,
                     traffic: Traffic | None, extra: Callable[[], dict[str, int]] | None = None,
                     extra_names: tuple[str, ...] = (), wire: WireLike = "plain") -> None:
    """Every rank checks its message, flags and wire, and the ranks compare (k, numel, dtype, whether flags are
    sent, the wire) and the fields ``extra()`` returns (named ``extra_names``): all raise together, any local error
    held until the headers are exchanged (else the other ranks would wait for this one until the timeout)."""
    try:
        check_message(msg, flags)
        fields = {"valid": 1, "k": msg.k, "numel": msg.numel, "dtype": DTYPE_CODES[msg.values.dtype],
                  "flags": int(flags is not None), "wire": wire_named(wire).code, **(extra() if extra else {})}
        device, local_error = msg.values.device, None
    except Exception as error:  # noqa: BLE001 - raised below, once every rank knows
        fields = {"valid": 0, **dict.fromkeys(("k", "numel", "dtype", "flags", "wire", *extra_names), _INVALID)}
        values = getattr(msg, "values", None)
        usable = isinstance(values, torch.Tensor) and values.device.type != "meta"
        device, local_error = values.device if usable else torch.device("cpu"), error
    headers = gather_headers(fields, group, device, traffic)
    if local_error is not None:
        raise local_error
    require_same(headers, ("k", "numel", "dtype", "flags", "wire", *extra_names), what)


def payload_head(count: torch.Tensor, flags: torch.Tensor | None) -> torch.Tensor:
    """The int32 words in front of a payload: the count, then the flags when the caller sends some."""
    count = count.reshape(1).int()
    return count if flags is None else torch.cat([count, flags.reshape(1).int()])


def carried_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which gTop-k carries a message's values between merges: float32 for float16 (a sum over
    ranks of values inside float16's range can leave it: two ranks' 40000 make 80000), else the message's."""
    return torch.float32 if dtype == torch.float16 else dtype


@dataclass(eq=False)
class Agreement:
    """What the ranks have checked they share about one tensor that they reduce step after step (a bucket): while
    the plan stays the same, :func:`agree` exchanges no header."""

    fields: dict[str, int] | None = None


def agree(fields: dict[str, int], group: dist.ProcessGroup, device: torch.device, what: str, *,
          traffic: Traffic | None = None, agreement: Agreement | None = None, volatile: dict[str, int] | None = None,
          reported: dict[str, int] | None = None) -> list[dict[str, int]] | None:
    """The ranks compare ``fields`` and ``volatile`` (int values, the same names on every rank) and all raise the
    same :class:`Disagreement` when they differ. With an ``agreement`` whose ``fields`` are these, nothing is
    exchanged (``volatile`` fields, such as the iteration, are compared only when ``fields`` change). Returns every
    rank's header (``reported`` fields travel along uncompared), or None when nothing was exchanged."""
    if agreement is not None and agreement.fields == fields:
        return None
    headers = gather_headers({"valid": 1, **(volatile or {}), **fields, **(reported or {})}, group, device, traffic)
    require_same(headers, (*(volatile or {}), *fields), what)
    if agreement is not None:
        agreement.fields = dict(fields)
    return headers


def message_fields(numel: int, dtype: torch.dtype, sparse: bool, k: int, wire: Wire) -> dict[str, int]:
    """The header fields that fix a payload's size: what every rank must share before a message moves."""
    return {"numel": numel, "dtype": DTYPE_CODES[dtype], "sparse": int(sparse), "k": k, "wire": wire.code}


@dataclass
class Reduced:
    """A collective's result on this rank: the SUM over the group's ranks of what was applied, as ``glob`` (a
    SparseMessage with distinct indices: gTop-k, Ok-Topk) or ``summed`` (a dense float32 tensor: the allgather,
    the dense collectives), bitwise the same on every rank; ``applied``, the mask over this rank's message slots
    of those inside the sum (None: all of them); ``senders`` (when asked for), how many ranks sent each element."""

    glob: SparseMessage | None = None
    summed: torch.Tensor | None = None
    applied: torch.Tensor | None = None
    senders: torch.Tensor | None = None

    def average_into(self, out: torch.Tensor, size: int, backend: Backend | None = None) -> torch.Tensor:
        """``out`` (flat, the tensor's numel) becomes the sum divided by ``size`` (with ``senders``: by how many
        ranks sent each element, 0 where none did), in out's dtype (divided in float32)."""
        if self.senders is not None:
            return out.copy_(self.summed.div_(self.senders.clamp(min=1)))
        if self.glob is None:
            return out.copy_(self.summed.div_(size))
        out.zero_()
        # glob's indices are distinct: dividing its values equals dividing the dense sum.
        return ops.scatter_add_(out, self.glob.indices, (self.glob.values.float() / size).to(out.dtype),
                                backend=backend)


def keep_unapplied(residual: torch.Tensor, msg: SparseMessage, applied: torch.Tensor | None, rounding: Rounding,
                   backend: Backend | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Error feedback's completion, after the compressor took the sent slots out of ``residual``: the slots the
    collective did not apply (``applied`` False), and the wire's rounding errors, go back in. Returns the
    rounding's (indices, errors)."""
    if applied is not None:
        ops.scatter_add_(residual, msg.indices, msg.values * ~applied, backend=backend, check=False)
    error_indices, errors = rounding.pairs(residual.dtype, residual.device)
    if rounding.parts:
        ops.scatter_add_(residual, error_indices, errors, backend=backend, check=False)
    return error_indices, errors


def with_check_cost(terms: dict[str, float], size: int, wire: Wire) -> dict[str, float]:
    """``terms`` plus the messages and bytes a rank sends in the corruption check that follows an exchange on a
    lossy wire (an int32 allreduce over the group, a ring); none on the plain wire."""
    if wire.lossy:
        terms["alpha"] += 2 * (size - 1)
        terms["beta"] += 2 * (size - 1) / size * 4
    return terms


class Collective:
    """Reduces every rank's message over a process group (see :class:`Reduced`).

    ``sparse``: whether it moves the message's k slots (else the whole tensor, dense). :meth:`new_state`: the
    state the caller keeps per tensor, which every rank passes alike (None: none). Every rank must call
    :meth:`reduce` with the same k, numel, dtype, wire and flags (or none), as :func:`agree` checks."""

    name = ""
    sparse = True
    counts_senders = False  # reduce(..., senders=True) counts the ranks that sent each element (Reduced.senders)

    def __init__(self, backend: BackendLike = None):
        self.backend = backend if isinstance(backend, BackendChoice) else BackendChoice(backend)

    def new_state(self):
        return None

    def reduce(self, msg: SparseMessage, group: dist.ProcessGroup, *, wire: Wire, traffic: Traffic | None = None,
               flags: torch.Tensor | None = None, rounding: Rounding | None = None, state=None) -> Reduced:
        """(A collective whose ``counts_senders`` is True also takes ``senders=True``.)"""
        raise NotImplementedError

    def wire_bytes(self, numel: int, k: int, size: int, dtype: torch.dtype, wire: Wire) -> int:
        """About how many bytes a rank sends in one :meth:`reduce` of k slots of ``numel`` elements over ``size``
        ranks (the path policy's prior, before any exchange was timed)."""
        return round(self.messages(size) * wire.payload_size(k, numel, dtype, 2))

    def messages(self, size: int) -> float:
        """How many messages of k slots a rank sends in one :meth:`reduce`, the mean over the ranks."""
        raise NotImplementedError

    def cost_terms(self, numel: int, k: int, size: int, local: int, share: float, wire: Wire) -> dict[str, float]:
        """One :meth:`reduce` of k float32 slots of ``numel`` elements over ``size`` ranks in nodes of ``local``,
        as the coefficients of the alpha-beta model (docs/scaling.md, :func:`gtopk_ext.costs.exchange_terms`):
        ``alpha`` and ``beta``, the messages and bytes on the slowest path between nodes, ``alpha_intra`` and
        ``beta_intra`` inside a node, and the per-element work (``merge``, ``scatter``, ``zero``, ``encode``,
        ``decode``) times ``share``, the ranks that share a core."""
        raise NotImplementedError(f"{type(self).__name__} has no cost model")

    def mean_bytes(self, numel: int, k: int, size: int, wire: Wire) -> float:
        """Bytes a rank sends in one :meth:`reduce` on one level of network, the mean over the ranks (the cost
        model's count): its ``beta``, where every rank sends alike."""
        return self.cost_terms(numel, k, size, 1, 1.0, wire)["beta"]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

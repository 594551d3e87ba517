"""The wire formats of the sparse collectives: how a message's k (index, value) slots become the bytes sent.

* :class:`PlainWire` (``"plain"``): int32 indices, then the values in their dtype: exact.
* :class:`CompactWire` (``"compact"``): :func:`gtopk_ext.ops.wire_encode`'s 4 bytes a pair, the used slots only;
  the rounding errors go to a :class:`Rounding`, which the reduction adds to the residual (by exactly one rank).
* :class:`TwoBitWire` (``"2bit"``): the compact wire's indices and 2 bits a value (SparseLoCo's), 2.25 bytes a
  pair; its (large) rounding errors go to the residual as the compact wire's do.
* :class:`FourBitWire` (``"4bit"``): a 12-bit index within a page of 4,096 elements and a 4-bit value on a
  geometric scale of that page's own magnitudes: 2 bytes a pair, plus 6 bytes a page (its count and its scale);
  for selections that fill every page (``chunktopk``'s chunks of 4,096), the rounding kept as on the compact wire.

A payload is one uint8 tensor: the head (int32 words: the count, then any flags), then the format's parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import torch

from gtopk_ext import ops
from gtopk_ext._contract import wire_num_pages


@dataclass
class Rounding:
    """The compact wire's rounding errors that this rank answers for, as sparse (index, error) pairs: what a value
    was minus what the network carried of it."""

    parts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def add(self, indices: torch.Tensor, errors: torch.Tensor) -> None:
        self.parts.append((indices, errors))

    def pairs(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 indices, errors in ``dtype``) of every part, concatenated."""
        if not self.parts:
            return torch.zeros(0, dtype=torch.int32, device=device), torch.zeros(0, dtype=dtype, device=device)
        return (torch.cat([i for i, _ in self.parts]).to(device),
                torch.cat([e.to(dtype) for _, e in self.parts]).to(device))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, as a flat uint8 view (a copy when it is not contiguous)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def rounding_error(values: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """``values - sent``, exact (sent is values rounded, or 0 for a slot not sent); 0 where both are the same
    infinity or both NaN."""
    arrived = (sent == values) | (values.isnan() & sent.isnan())
    return torch.where(arrived, torch.zeros_like(values), values - sent)


class Wire:
    """A wire format. ``lossy``: the values arrive rounded (their errors go to a :class:`Rounding`), only the used
    slots are sent (they must ascend: :meth:`ascending`), and a corrupted payload is detected when decoded."""

    name = ""
    code = 0  # in headers
    lossy = False

    def payload_size(self, k: int, numel: int, dtype: torch.dtype, head_words: int) -> int:
        """Bytes of the payload of k slots of a tensor of ``numel`` elements, values in ``dtype``."""
        raise NotImplementedError

    def pack(self, indices: torch.Tensor, values: torch.Tensor, head: torch.Tensor, numel: int,
             backend=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(payload, sent_indices, sent_values)``: the payload of the slots, ``head[0]`` being their count, and
        the slots as the receiver will decode them (values in their dtype)."""
        raise NotImplementedError

    def unpack(self, payload: torch.Tensor, k: int, numel: int, dtype: torch.dtype, head_words: int,
               backend=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(indices, values in dtype, head, invalid)`` of a payload made by :meth:`pack`; ``invalid`` (lossy
        wires only) is :func:`gtopk_ext.ops.wire_decode`'s count of the signs of corruption."""
        raise NotImplementedError

    def ascending(self, indices: torch.Tensor, values: torch.Tensor, count: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(indices, values, order)``: the slots as this wire needs them, and the permutation applied (None:
        unchanged)."""
        return indices, values, None

    # A run of n pairs whose n the receiver knows (Ok-Topk's phases): no head on the plain wire, n as the head
    # on the compact one; an empty run is an empty payload, which is not sent.

    def pairs_size(self, n: int, numel: int, dtype: torch.dtype) -> int:
        return 0 if n == 0 else self.payload_size(n, numel, dtype, 1)

    def pack_pairs(self, indices: torch.Tensor, values: torch.Tensor, numel: int,
                   backend=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = indices.numel()
        if n == 0:
            return torch.cat([as_bytes(indices), as_bytes(values)]), indices, values
        return self.pack(indices, values, torch.tensor([n], dtype=torch.int32, device=indices.device), numel,
                         backend)

    def unpack_pairs(self, payload: torch.Tensor, n: int, numel: int, dtype: torch.dtype, backend,
                     invalid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The n pairs of a payload made by :meth:`pack_pairs`; signs of corruption are added to ``invalid``."""
        indices, values, _, payload_invalid = self.unpack(payload, n, numel, dtype, 1, backend)
        if payload_invalid is not None:
            invalid.add_(payload_invalid)
        return indices, values

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PlainWire(Wire):
    name = "plain"

    def payload_size(self, k, numel, dtype, head_words):
        return 4 * head_words + k * (4 + torch.empty((), dtype=dtype).element_size())

    def pack(self, indices, values, head, numel, backend=None):
        return torch.cat([as_bytes(head), as_bytes(indices), as_bytes(values)]), indices, values

    def unpack(self, payload, k, numel, dtype, head_words, backend=None):
        start = 4 * head_words
        head = payload[:start].view(torch.int32)
        indices = payload[start:start + 4 * k].view(torch.int32)
        values = payload[start + 4 * k:self.payload_size(k, numel, dtype, head_words)].view(dtype)
        return indices, values, head, None

    # No head: the pairs alone.
    def pairs_size(self, n, numel, dtype):
        return n * (4 + torch.empty((), dtype=dtype).element_size())

    def pack_pairs(self, indices, values, numel, backend=None):
        return torch.cat([as_bytes(indices), as_bytes(values)]), indices, values

    def unpack_pairs(self, payload, n, numel, dtype, backend, invalid):
        return payload[:4 * n].view(torch.int32), payload[4 * n:].view(dtype)


class CompactWire(Wire):
    name = "compact"
    code = 1
    lossy = True

    def payload_size(self, k, numel, dtype, head_words):
        return 4 * (head_words + 1 + wire_num_pages(numel) + 1) + 4 * k

    def pack(self, indices, values, head, numel, backend=None):
        count = head[:1].contiguous()
        halves, low, pages, shift = ops.wire_encode(indices, values, count, numel, backend=backend)
        sent_indices, sent_values, _ = ops.wire_decode(halves, low, pages, shift, count, numel, backend=backend)
        payload = torch.cat([as_bytes(head), as_bytes(shift), as_bytes(pages), as_bytes(halves), as_bytes(low)])
        return payload, sent_indices, sent_values.to(values.dtype)

    def unpack(self, payload, k, numel, dtype, head_words, backend=None):
        start = 4 * head_words
        head = payload[:start].view(torch.int32)
        pages_end = start + 4 * (1 + wire_num_pages(numel) + 1)
        shift = payload[start:start + 4].view(torch.int32)
        pages = payload[start + 4:pages_end].view(torch.int32)
        halves = payload[pages_end:pages_end + 2 * k].view(torch.float16)
        low = payload[pages_end + 2 * k:pages_end + 4 * k].view(torch.int16)
        indices, values, invalid = ops.wire_decode(halves, low, pages, shift, head[:1].contiguous(), numel,
                                                   backend=backend)
        return indices, values.to(dtype), head, invalid

    def ascending(self, indices, values, count):
        used = min(max(int(count), 0), indices.numel())
        head = indices[:used]
        if used < 2 or bool((head[1:] >= head[:-1]).all()):
            return indices, values, None
        order = torch.cat([torch.sort(head, stable=True).indices,
                           torch.arange(used, indices.numel(), device=indices.device)])
        return indices[order], values[order], order


class TwoBitWire(CompactWire):
    """Each value as its sign and one of two magnitudes per message (4 levels): the mean |value| splits the used
    slots, each side is sent as its mean |value| (two float32 levels: one Lloyd step of a 2-level quantizer, so
    the levels fit the message's own spread), 4 values a byte; indices as on the compact wire."""

    name = "2bit"
    code = 2

    def payload_size(self, k, numel, dtype, head_words):
        return 4 * (head_words + wire_num_pages(numel) + 1 + 2) + 2 * k + (k + 3) // 4

    def pack(self, indices, values, head, numel, backend=None):
        count = head[:1].contiguous()
        _, low, pages, _ = ops.wire_encode(indices, values, count, numel, backend=backend)
        used = torch.arange(values.numel(), device=values.device) < count
        magnitude = values.float().abs() * used
        upper = used & (magnitude * used.sum().clamp(min=1) > magnitude.sum())  # above the mean |value|
        lower = used & ~upper
        levels = torch.stack([(magnitude * lower).sum() / lower.sum().clamp(min=1),
                              (magnitude * upper).sum() / upper.sum().clamp(min=1)])
        codes = (values < 0).to(torch.uint8) * 2 + upper.to(torch.uint8)
        quads = torch.cat([codes, codes.new_zeros(-codes.numel() % 4)]).view(-1, 4)
        packed = quads[:, 0] | quads[:, 1] << 2 | quads[:, 2] << 4 | quads[:, 3] << 6
        payload = torch.cat([as_bytes(head), as_bytes(pages), as_bytes(levels), as_bytes(low), packed])
        return payload, torch.where(used, indices, 0), self._values(codes, levels, used, values.dtype)

    def unpack(self, payload, k, numel, dtype, head_words, backend=None):
        start = 4 * head_words
        pages_end = start + 4 * (wire_num_pages(numel) + 1)
        head = payload[:start].view(torch.int32)
        pages = payload[start:pages_end].view(torch.int32)
        levels = payload[pages_end:pages_end + 8].view(torch.float32)
        low = payload[pages_end + 8:pages_end + 8 + 2 * k].view(torch.int16)
        packed = payload[pages_end + 8 + 2 * k:self.payload_size(k, numel, dtype, head_words)]
        count = head[:1].contiguous()
        zero = torch.zeros(1, dtype=torch.int32, device=payload.device)
        indices, _, invalid = ops.wire_decode(torch.zeros(k, dtype=torch.float16, device=payload.device), low, pages,
                                              zero, count, numel, backend=backend)
        codes = torch.stack([packed >> shift & 3 for shift in (0, 2, 4, 6)], dim=1).reshape(-1)[:k]
        used = torch.arange(k, device=payload.device) < count
        return indices, self._values(codes, levels, used, dtype), head, invalid

    @staticmethod
    def _values(codes: torch.Tensor, levels: torch.Tensor, used: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The values 2-bit ``codes`` stand for: (1 - 2 x sign bit) x levels[magnitude bit], 0 past the count."""
        signs = 1.0 - (codes >> 1).float() * 2
        return (signs * levels[(codes & 1).long()] * used).to(dtype)


class FourBitWire(CompactWire):
    """A pair in 16 bits: the index's low 12 bits (its page of 4,096 elements from the page's count) and a 4-bit
    code, a sign and a magnitude: 0, or one of 7 levels spaced geometrically from the page's smallest to its largest
    nonzero finite |value| (both sent in bfloat16), the nearer of the two around the value. A page's levels fit
    its own spread, so a tensor of small values keeps its share of precision beside one of large values. A page
    holds at most 65,535 slots (duplicate indices included); more arrive as a corrupted payload."""

    name = "4bit"
    code = 3
    PAGE_SHIFT = 12
    LEVELS = 7  # magnitude codes 1..7; code 0 is the value 0 (a non-finite value too: its flag stops the step)

    @classmethod
    def num_pages(cls, numel: int) -> int:
        return (numel + (1 << cls.PAGE_SHIFT) - 1) >> cls.PAGE_SHIFT

    def payload_size(self, k, numel, dtype, head_words):
        return 4 * head_words + 6 * self.num_pages(numel) + 2 * k

    def pack(self, indices, values, head, numel, backend=None):
        device, k, pages = values.device, values.numel(), self.num_pages(numel)
        used = torch.arange(k, device=device) < head[:1].clamp(0, k)
        page = torch.where(used, indices.long() >> self.PAGE_SHIFT, 0)
        counts = torch.zeros(pages, dtype=torch.int64, device=device).index_add_(0, page, used.long())
        magnitude = values.float().abs()
        scaled = used & magnitude.isfinite() & (magnitude > 0)
        bounds = self._page_bounds(magnitude, page, scaled, pages).to(torch.bfloat16)
        bounds = torch.where(bounds.isinf(), torch.finfo(torch.bfloat16).max, bounds)  # rounded up past the range
        scale = self._log_scale(bounds.float()[:, page])
        low, span = scale
        position = torch.where(span > 0, (magnitude.clamp(min=1e-45).log() - low) / span.clamp(min=1e-30) * (
            self.LEVELS - 1), 0.0)  # 0 at the page's smallest level, LEVELS - 1 at its largest
        below = position.floor().clamp(0, self.LEVELS - 2)
        lower, upper = self._level(scale, below), self._level(scale, below + 1)
        nearer = below + ((upper - magnitude).abs() < (magnitude - lower).abs())  # a tie takes the lower level
        codes = (torch.where(scaled, nearer.long() + 1, 0) | (values < 0).long() << 3) * used
        pairs = ((indices.long() & ((1 << self.PAGE_SHIFT) - 1)) * used | codes << self.PAGE_SHIFT).to(torch.int32)
        payload = torch.cat([as_bytes(head), as_bytes(counts.to(torch.int16)), as_bytes(bounds),
                             as_bytes(pairs.to(torch.int16))])
        return payload, torch.where(used, indices, 0), self._values(codes, scale, values.dtype)

    def unpack(self, payload, k, numel, dtype, head_words, backend=None):
        device, pages = payload.device, self.num_pages(numel)
        start = 4 * head_words
        head = payload[:start].view(torch.int32)
        counts = payload[start:start + 2 * pages].view(torch.int16).long() & 0xFFFF
        bounds = payload[start + 2 * pages:start + 6 * pages].view(torch.bfloat16).float().view(2, pages)
        end = self.payload_size(k, numel, dtype, head_words)
        pairs = payload[start + 6 * pages:end].view(torch.int16).long() & 0xFFFF
        # One host sync: the count, the table's bad bounds, and what its counts sum to.
        count, bad_table, total = torch.stack([head[0].long(), (~bounds.isfinite() | (bounds < 0)).sum(),
                                               counts.sum()]).tolist()
        count = min(max(count, 0), k)
        if bad_table or total != count:
            zeros = torch.zeros(k, dtype=torch.int32, device=device)
            return zeros, zeros.to(dtype), head, torch.tensor([max(bad_table, 1)], dtype=torch.int32, device=device)
        used = torch.arange(k, device=device) < count
        lengths = (numel - torch.arange(pages, device=device) * (1 << self.PAGE_SHIFT)).clamp(max=1 << self.PAGE_SHIFT)
        page = torch.cat([torch.repeat_interleave(torch.arange(pages, device=device), counts, output_size=count),
                          torch.zeros(k - count, dtype=torch.int64, device=device)])
        low = pairs & ((1 << self.PAGE_SHIFT) - 1)
        same_page = torch.cat([torch.zeros(1, dtype=torch.bool, device=device), page[1:] == page[:-1]])
        descending = same_page & (low < torch.cat([low[:1], low[:-1]]))
        bad = used & ((low >= lengths[page]) | descending)
        indices = torch.where(used & ~bad, page << self.PAGE_SHIFT | low, 0).to(torch.int32)
        codes = torch.where(used & ~bad, pairs >> self.PAGE_SHIFT, 0)
        invalid = bad.sum().to(torch.int32).reshape(1)
        return indices, self._values(codes, self._log_scale(bounds[:, page]), dtype), head, invalid

    @staticmethod
    def _page_bounds(magnitude, page, mask, pages):
        """Each page's smallest and largest masked magnitude, stacked; 0 and 0 where none is masked."""
        low = magnitude.new_full((pages,), float("inf")).scatter_reduce_(
            0, page, torch.where(mask, magnitude, float("inf")), "amin")
        high = magnitude.new_zeros(pages).scatter_reduce_(0, page, torch.where(mask, magnitude, 0.0), "amax")
        return torch.stack([torch.where(low.isinf(), 0.0, low), high])

    @staticmethod
    def _log_scale(bounds):
        """(log of the smallest level, log of the largest minus it) of pages' ``bounds``; a span of 0 where the
        smallest is 0."""
        tiny = torch.finfo(torch.float32).tiny
        low = bounds[0].clamp(min=tiny).log()
        return low, torch.where(bounds[0] > 0, bounds[1].clamp(min=tiny).log() - low, 0.0)

    @classmethod
    def _level(cls, scale, position):
        """The magnitude of level ``position`` (0 .. LEVELS - 1) on a :meth:`_log_scale`."""
        low, span = scale
        return (low + span * (position / (cls.LEVELS - 1))).exp()

    @classmethod
    def _values(cls, codes, scale, dtype):
        """The values 4-bit ``codes`` stand for on each slot's page's :meth:`_log_scale`: code 0 is 0."""
        magnitude = cls._level(scale, ((codes & 7) - 1).clamp(min=0).float())
        signs = 1.0 - (codes >> 3).float() * 2
        return torch.where((codes & 7) > 0, signs * magnitude, 0.0).to(dtype)


WIRES = {wire.name: wire for wire in (PlainWire(), CompactWire(), TwoBitWire(), FourBitWire())}
WireLike = Union[str, Wire]


def wire_named(wire: WireLike) -> Wire:
    """The :class:`Wire` of a name in :data:`WIRES` (a Wire is returned as it is)."""
    if isinstance(wire, Wire):
        return wire
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {tuple(WIRES)}, got {wire!r}")
    return WIRES[wire]


def payload_size(wire: WireLike, k: int, numel: int, dtype: torch.dtype, head_words: int) -> int:
    """:meth:`Wire.payload_size` of the wire named ``wire``."""
    return wire_named(wire).payload_size(k, numel, dtype, head_words)

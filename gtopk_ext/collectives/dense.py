"""The dense allreduces, as collectives of the same protocol: ``dense`` in the tensor's own dtype (a warm-up, a
small bucket, a rank's sum that is not finite), and ``dense16`` and ``dense8``, bfloat16 or scaled 8-bit floats on
the wire with every rounding error written where the caller says (the reduction: into the residual)."""

from __future__ import annotations

import math
from time import perf_counter

import torch
import torch.distributed as dist

from gtopk_ext.collectives._protocol import Collective
from gtopk_ext.collectives._transport import Traffic, add_traffic, kept_tensor, p2p_device
from gtopk_ext.costs import ring_allreduce_bytes
from gtopk_ext.ops import is_finite

# torch 2.14 renamed all_gather_into_tensor (the name older torch versions have).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SEGMENT = 1 << 19  # elements of one ring message at most: the next segment travels while this one is summed


def _kept_buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer of ``numel`` elements, kept between calls on the CPU, where a new large tensor costs its page faults
    every time (the allocator gives large blocks back to the system)."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    return kept_tensor(name, numel, dtype, device)


def _segments(chunk: int) -> tuple[int, int]:
    """How a chunk of the ring travels: (count, length) of its segments of at most :data:`SEGMENT` elements."""
    count = max(1, -(-chunk // SEGMENT))
    return count, -(-chunk // count)


def _reduce_scatter(parts: tuple[torch.Tensor, ...], losses: tuple | list, send: torch.Tensor, receive: torch.Tensor,
                    codec: "RoundedDense", group: dist.ProcessGroup, rank: int, size: int) -> None:
    """The ring reduce-scatter: at step s this rank sends chunk (rank - s) % P (its own values, then the partial
    sum it received plus its own) and receives chunk (rank - s - 1) % P, adding its own values to it in float32 in
    its ``parts`` (whose chunks it no longer needs once sent); each rounding's loss goes to ``losses``. Each chunk
    travels in segments (tagged by their number; ``send`` and ``receive`` hold their bytes), so that summing one
    overlaps receiving the next."""
    if size == 1:
        return
    count, length = _segments(parts[0].numel())
    stride = codec.message_bytes(length)

    def segment(values: torch.Tensor, j: int) -> torch.Tensor:
        return values[j * length:(j + 1) * length]

    def message(buffer: torch.Tensor, j: int, n: int) -> torch.Tensor:  # segment j's bytes, n elements
        return buffer[j * stride:j * stride + codec.message_bytes(n)]

    def post_receive(c: int, j: int):
        n = segment(parts[c], j).numel()
        return dist.irecv(message(receive, j, n), group=group, group_src=(rank - 1) % size, tag=j)

    def post_send(c: int, j: int):
        values = segment(parts[c], j)
        sent = message(send, j, values.numel())
        codec.encode(values, sent, None if losses[c] is None else segment(losses[c], j))
        return dist.isend(sent, group=group, group_dst=(rank + 1) % size, tag=j)

    receiving = [post_receive((rank - 1) % size, j) for j in range(count)]
    sending = [post_send(rank, j) for j in range(count)]
    for step in range(size - 1):
        c = (rank - step - 1) % size
        for j in range(count):
            receiving[j].wait()
            values = segment(parts[c], j)
            codec.add_decoded(values, message(receive, j, values.numel()))
            if step < size - 2:
                receiving[j] = post_receive((c - 1) % size, j)
                sending[j].wait()
                sending[j] = post_send(c, j)
    for work in sending:
        work.wait()


class DenseAllreduce(Collective):
    """Every element: ``tensor / P`` summed over the group by the backend's allreduce (divided first, as
    torch's averagers do: float16 values cannot overflow in the sum)."""

    name = "dense"
    sparse = False

    def reduce_dense(self, tensor: torch.Tensor, group: dist.ProcessGroup, size: int, traffic: Traffic | None = None,
                     on_done=None) -> torch.futures.Future:
        """A future of ``tensor``, averaged in place, issued now and completed by the backend (asynchronous);
        ``on_done(start, end)`` is called with the ``perf_counter`` times of issue and completion."""
        add_traffic(traffic, ring_allreduce_bytes(tensor.numel() * tensor.element_size(), size))
        tensor.div_(size)
        start = perf_counter()

        def finished(future):
            if on_done is not None:
                on_done(start, perf_counter())
            return future.value()[0]

        return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(finished)

    def wire_bytes(self, numel, k, size, dtype, wire=None):
        return ring_allreduce_bytes(numel * torch.empty((), dtype=dtype).element_size(), size)

    def cost_terms(self, numel, k, size, local, share, wire):
        return {"alpha": 2 * (size - 1), "beta": 2 * (size - 1) / size * 4 * numel}  # float32, a ring


class RoundedDense(Collective):
    """Every element rounded to a narrower float on the wire, summed in float32: a ring reduce-scatter whose ranks
    add their own float32 values to the partial sums they receive and pass them on rounded, then an allgather of
    the chunks' averages, rounded. Nothing is lost to the rounding: each rank writes what its roundings took (of
    every partial sum it sent on, and ``P`` times that of the average of the chunk it completed) for the caller to
    keep: ``sum over ranks (tensor) = P x average + sum over ranks (lost)``, to float32 rounding. (A ring for both
    phases: one flow per link direction, as the backends' allreduce.)

    A subclass is the wire's format: a message of n elements is ``header_size`` bytes and n elements of
    ``element_size`` bytes. ``encode(values, message, lost)`` writes ``values`` rounded into ``message`` (bytes) and
    what the rounding took into ``lost`` (None: dropped); ``add_decoded(values, message)`` adds the elements
    ``message`` holds to ``values``, ``decode(values, message)`` writes them there."""

    sparse = False
    element_size: int
    header_size: int

    def message_bytes(self, numel: int) -> int:
        return self.header_size + numel * self.element_size

    def reduce_dense(self, tensor: torch.Tensor, group: dist.ProcessGroup, size: int,
                     traffic: Traffic | None = None, lost: torch.Tensor | None = None) -> None:
        """``tensor`` (flat float32) becomes the average over the group in place. ``lost`` (float32, the tensor's
        shape; None: dropped) is overwritten with what this rank lost to the rounding; a non-finite element
        loses nothing (it reaches the average)."""
        host = p2p_device(tensor.device, group)
        if host != tensor.device:  # Gloo sends and receives from host memory: the ring runs on a copy there
            staged, staged_lost = tensor.to(host), None if lost is None else torch.empty(lost.shape, device=host)
            self.reduce_dense(staged, group, size, traffic, staged_lost)
            tensor.copy_(staged)
            if lost is not None:
                lost.copy_(staged_lost)
            return
        numel, rank = tensor.numel(), dist.get_rank(group)
        chunk = -(-numel // size)
        cuts = [c * chunk for c in range(1, size)]
        parts = tensor.tensor_split(cuts)
        losses = [None] * size if lost is None else lost.tensor_split(cuts)
        count, length = _segments(chunk)
        row = self.message_bytes(chunk) + self.element_size  # the allgather's message: a chunk and a flag
        wire = _kept_buffer("wire", 2 * max(count * self.message_bytes(length), row) + size * row, torch.uint8,
                            tensor.device)
        send, receive = wire[:len(wire) - size * row].chunk(2)
        gathered = wire[len(wire) - size * row:].view(size, row)
        _reduce_scatter(parts, losses, send, receive, self, group, rank, size)  # 1.
        # 2. This rank completed chunk (rank + 1) % P: its average, rounded, then a flag saying whether the chunk
        # holds a non-finite value (only then can lost values be non-finite: a non-finite element reaches the sum).
        mine = (rank + 1) % size
        average = parts[mine].div_(size)
        sent = self.message_bytes(average.numel())
        send[sent:row].zero_()  # a shorter last chunk's padding, and the flag
        send[row - 1] = 0 if is_finite(average) else 1
        self.encode(average, send[:sent], losses[mine])
        if losses[mine] is not None:  # every rank applies the rounded average: the rounding is P times this one
            losses[mine].mul_(size)
        # 3. Allgather of the rounded averages: rank r's row holds chunk (r + 1) % P.
        _all_gather_single(gathered.view(-1), send[:row], group=group)
        for owner in range(size):
            part = parts[(owner + 1) % size]
            self.decode(part, gathered[owner, :self.message_bytes(part.numel())])
        if lost is not None and bool(gathered[:, row - 1].any()):
            lost.nan_to_num_(0.0, 0.0, 0.0)
        add_traffic(traffic, self.wire_bytes(numel, numel, size, tensor.dtype))

    def wire_bytes(self, numel, k, size, dtype, wire=None):
        chunk = -(-numel // size)  # two phases, (P - 1) chunks each (one header a segment), and the flag
        count, _ = _segments(chunk)
        return (size - 1) * (count * self.header_size + chunk * self.element_size + self.message_bytes(chunk + 1))


class Dense16(RoundedDense):
    """Every element in bfloat16 (the bytes of fp16_compress_hook, float32's range: no overflow)."""

    name = "dense16"
    wire_dtype = torch.bfloat16
    element_size, header_size = 2, 0

    def encode(self, values, message, lost):
        sent = message.view(self.wire_dtype).copy_(values)
        if lost is not None:  # in float32 first: a subtraction mixing dtypes is much slower on the CPU
            torch.sub(values, lost.copy_(sent), out=lost)

    def add_decoded(self, values, message):
        values.add_(message.view(self.wire_dtype))

    def decode(self, values, message):
        values.copy_(message.view(self.wire_dtype))


class Dense8(RoundedDense):
    """Every element in 8 bits: float8 e5m2 (e4m3's conversions are much slower on the CPU) times a power of two per
    message, a byte ahead of its elements, that brings the message's largest magnitude to the format's largest. A
    quarter of float32's bytes; each rounding takes up to 1/8 of an element, which the residual keeps."""

    name = "dense8"
    wire_dtype = torch.float8_e5m2
    element_size, header_size = 1, 1
    _LARGEST = 57344.0  # e5m2's largest finite value
    _BIAS = 128  # the header byte is the exponent plus this

    def _exponent(self, values: torch.Tensor) -> int:
        low, high = torch.aminmax(values)
        largest = float(torch.maximum(-low, high))  # one host sync
        if not math.isfinite(largest) or largest == 0.0:  # a non-finite element must reach the sum as it is
            return 0
        return max(-120, min(120, math.floor(math.log2(self._LARGEST / largest))))

    def encode(self, values, message, lost):
        exponent = self._exponent(values) if values.numel() else 0
        message[0] = exponent + self._BIAS
        sent = torch.mul(values, 2.0 ** exponent, out=message[1:].view(self.wire_dtype))
        if lost is not None:  # exact: scaling by a power of two rounds nothing
            torch.add(values, lost.copy_(sent), alpha=-2.0 ** -exponent, out=lost)

    def _scale(self, message: torch.Tensor) -> float:
        return 2.0 ** -(int(message[0]) - self._BIAS)

    def add_decoded(self, values, message):
        decoded = _kept_buffer("scaled", values.numel(), values.dtype, values.device).copy_(
            message[1:].view(self.wire_dtype))
        values.add_(decoded, alpha=self._scale(message))

    def decode(self, values, message):
        values.copy_(message[1:].view(self.wire_dtype)).mul_(self._scale(message))

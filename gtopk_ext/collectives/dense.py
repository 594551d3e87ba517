"""The dense allreduces, as collectives of the same protocol: ``dense`` in the tensor's own dtype (a warm-up, a
small bucket, a rank's sum that is not finite), and ``dense16``, bfloat16 on the wire with every rounding error
written where the caller says (the reduction: into the residual)."""

from __future__ import annotations

import threading
from time import perf_counter

import torch
import torch.distributed as dist

from gtopk_ext.collectives._protocol import Collective
from gtopk_ext.costs import Traffic, ring_allreduce_bytes
from gtopk_ext.ops import is_finite

# torch 2.14 renamed all_gather_into_tensor (the name older torch versions have).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_kept = threading.local()
SEGMENT = 1 << 19  # elements of one ring message at most: the next segment travels while this one is summed


def _wire_buffers(size: int, row: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense16's bfloat16 buffers: send and receive (``row`` elements each) and the allgather's (size, row),
    kept between calls on the CPU, where a new tensor of this size costs its page faults every time (the allocator
    gives large blocks back to the system: a third of the collective's time). One set per thread: the hooks reduce
    on threads of their own."""
    numel = (size + 2) * row
    if device.type != "cpu":
        kept = torch.empty(numel, dtype=Dense16.wire_dtype, device=device)
    else:
        kept = getattr(_kept, "buffer", None)
        if kept is None or kept.numel() < numel:
            kept = _kept.buffer = torch.empty(numel, dtype=Dense16.wire_dtype)
    return kept[:row], kept[row:2 * row], kept[2 * row:numel].view(size, row)


def _round(values: torch.Tensor, out: torch.Tensor, lost: torch.Tensor | None) -> None:
    """``out[:n]`` = ``values`` in bfloat16 and ``lost`` (None: dropped) = what that rounding took."""
    sent = out[:values.numel()].copy_(values)
    if lost is not None:  # in float32 first: a subtraction mixing dtypes takes 5x longer on the CPU
        torch.sub(values, lost.copy_(sent), out=lost)


def _reduce_scatter(parts: list[torch.Tensor], losses: list, send: torch.Tensor, receive: torch.Tensor,
                    group: dist.ProcessGroup, rank: int, size: int) -> None:
    """Dense16's ring reduce-scatter: at step s this rank sends chunk (rank - s) % P (its own values, then the
    partial sum it received plus its own) and receives chunk (rank - s - 1) % P, adding its own values to it in
    float32 in its ``parts`` (whose chunks it no longer needs once sent); each rounding's loss goes to ``losses``.
    Each chunk travels in segments (tagged by their number), so that summing one overlaps receiving the next."""
    if size == 1:
        return
    count = max(1, -(-parts[0].numel() // SEGMENT))
    length = -(-parts[0].numel() // count)

    def segment(values: torch.Tensor, j: int, n: int = length) -> torch.Tensor:  # segment j, n elements at most
        return values[j * length:j * length + min(length, n)]

    def post_receive(c: int, j: int):
        n = segment(parts[c], j).numel()
        return dist.irecv(segment(receive, j, n), group=group, group_src=(rank - 1) % size, tag=j)

    def post_send(c: int, j: int):
        values = segment(parts[c], j)
        sent = segment(send, j, values.numel())
        _round(values, sent, None if losses[c] is None else segment(losses[c], j))
        return dist.isend(sent, group=group, group_dst=(rank + 1) % size, tag=j)

    receiving = [post_receive((rank - 1) % size, j) for j in range(count)]
    sending = [post_send(rank, j) for j in range(count)]
    for step in range(size - 1):
        c = (rank - step - 1) % size
        for j in range(count):
            receiving[j].wait()
            values = segment(parts[c], j)
            values.add_(segment(receive, j, values.numel()))
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

    def reduce_dense(self, tensor: torch.Tensor, group: dist.ProcessGroup, size: int,
                     traffic: Traffic | None = None,
                     on_done=None) -> torch.futures.Future:
        """A future of ``tensor``, averaged in place, issued now and completed by the backend (asynchronous);
        ``on_done(start, end)`` is called with the ``perf_counter`` times of issue and completion."""
        if traffic is not None:
            nbytes = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), size)
            traffic.add(nbytes, nbytes)
        tensor.div_(size)
        start = perf_counter()

        def finished(future):
            if on_done is not None:
                on_done(start, perf_counter())
            return future.value()[0]

        return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(finished)

    def wire_bytes(self, numel, k, size, dtype, wire=None):
        return ring_allreduce_bytes(numel * torch.empty((), dtype=dtype).element_size(), size)


class Dense16(Collective):
    """Every element in bfloat16 (the bytes of fp16_compress_hook, float32's range: no overflow), summed in
    float32: a ring reduce-scatter whose ranks add their own float32 values to the partial sums they receive in
    bfloat16 and pass them on rounded, then an allgather of the chunks' averages in bfloat16. Nothing is lost to the
    rounding: each rank writes what its roundings took (of every partial sum it sent on, and ``P`` times that of
    the average of the chunk it completed) for the caller to keep: ``sum over ranks (tensor) = P x average + sum
    over ranks (lost)``, to float32 rounding. (A ring, not an all-to-all, for both phases: one flow per link
    direction, as the backends' allreduce; the all-to-all's incast ran 20% slower on 1 Gbit/s links.)"""

    name = "dense16"
    sparse = False
    wire_dtype = torch.bfloat16

    def reduce_dense(self, tensor: torch.Tensor, group: dist.ProcessGroup, size: int,
                     traffic: Traffic | None = None, lost: torch.Tensor | None = None) -> None:
        """``tensor`` (flat float32) becomes the average over the group in place. ``lost`` (float32, the tensor's
        shape; None: dropped) is overwritten with what this rank lost to the rounding; a non-finite element
        loses nothing (it reaches the average)."""
        numel, rank = tensor.numel(), dist.get_rank(group)
        chunk = -(-numel // size)
        parts = [tensor[min(c * chunk, numel):min((c + 1) * chunk, numel)] for c in range(size)]
        losses = [None] * size if lost is None else [
            lost[min(c * chunk, numel):min((c + 1) * chunk, numel)] for c in range(size)]
        send, receive, gathered = _wire_buffers(size, chunk + 1, tensor.device)
        _reduce_scatter(parts, losses, send, receive, group, rank, size)  # 1.
        # 2. This rank completed chunk (rank + 1) % P: its average, rounded, then a word saying whether the chunk
        # holds a non-finite value (only then can lost values be non-finite: a non-finite element reaches the sum).
        mine = (rank + 1) % size
        average = parts[mine].div_(size)
        send[average.numel():chunk].zero_()
        send[chunk] = 0.0 if is_finite(average) else 1.0
        _round(average, send, losses[mine])
        if losses[mine] is not None:  # every rank applies the rounded average: the rounding is P times this one
            losses[mine].mul_(size)
        # 3. Allgather of the rounded averages: rank r's row holds chunk (r + 1) % P.
        _all_gather_single(gathered.view(-1), send, group=group)
        for owner in range(size):
            part = parts[(owner + 1) % size]
            part.copy_(gathered[owner, :part.numel()])
        if lost is not None and bool(gathered[:, chunk].any()):
            lost.nan_to_num_(0.0, 0.0, 0.0)
        if traffic is not None:
            nbytes = self.wire_bytes(numel, numel, size, tensor.dtype)
            traffic.add(nbytes, nbytes)

    def wire_bytes(self, numel, k, size, dtype, wire=None):
        chunk = -(-numel // size)  # two phases, (P - 1) chunks of 2 bytes an element each (and a flag word)
        return (size - 1) * (2 * chunk + 2 * (chunk + 1))

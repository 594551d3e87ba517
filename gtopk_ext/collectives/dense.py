"""The dense allreduces, as collectives of the same protocol: ``dense`` in the tensor's own dtype (a warm-up, a
small bucket, a rank's sum that is not finite), and ``dense16``, bfloat16 on the wire with every rounding error
written where the caller says (the reduction: into the residual)."""

from __future__ import annotations

from time import perf_counter

import torch
import torch.distributed as dist

from gtopk_ext.collectives._protocol import Collective
from gtopk_ext.costs import Traffic, ring_allreduce_bytes

# torch 2.14 renamed all_gather_into_tensor (the name older torch versions have).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
    float32: a reduce-scatter as an all-to-all of bfloat16 chunks, each rank summing its chunk, then an allgather
    of the chunks' averages in bfloat16. Nothing is lost to the rounding: :meth:`reduce_dense` writes what each
    element of this rank lost (its own rounding, plus ``P`` times the rounding of the average of the chunk it
    summed), for the caller to keep: ``sum over ranks (tensor) = P x average + sum over ranks (lost)``, to
    float32 rounding."""

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
        sent = torch.empty(chunk * size, dtype=self.wire_dtype, device=tensor.device)
        sent[numel:].zero_()
        sent[:numel].copy_(tensor)
        if lost is not None:
            torch.sub(tensor, sent[:numel], out=lost)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)
        average = received.view(size, chunk).sum(0, dtype=torch.float32).div_(size)
        # Each rank's chunk of the average, then a word saying whether it holds a non-finite value (only then can
        # a rank's lost values be non-finite: its own element was, and reached the average).
        rounded = torch.empty(chunk + 1, dtype=self.wire_dtype, device=tensor.device)
        rounded[:chunk].copy_(average)
        rounded[chunk] = 0.0 if bool(torch.isfinite(average).all()) else 1.0
        if lost is not None:  # this rank summed its chunk: the average's rounding there is its to keep
            start, end = rank * chunk, min((rank + 1) * chunk, numel)
            lost[start:end].add_(average.sub_(rounded[:chunk])[:max(end - start, 0)], alpha=size)
        gathered = torch.empty(size, chunk + 1, dtype=self.wire_dtype, device=tensor.device)
        _all_gather_single(gathered.view(-1), rounded, group=group)
        for owner, part in enumerate(tensor.split(chunk)):
            part.copy_(gathered[owner, :part.numel()])
        if lost is not None and bool(gathered[:, chunk].any()):
            lost.nan_to_num_(0.0, 0.0, 0.0)
        if traffic is not None:
            nbytes = self.wire_bytes(numel, numel, size, tensor.dtype)
            traffic.add(nbytes, nbytes)

    def wire_bytes(self, numel, k, size, dtype, wire=None):
        chunk = -(-numel // size)  # two phases, (P - 1) chunks of 2 bytes an element each (and a flag word)
        return (size - 1) * (2 * chunk + 2 * (chunk + 1))

"""The dense allreduce, as a collective of the same protocol: what a bucket takes during a warm-up, when it is
small, or when any rank's sum is not finite."""

from __future__ import annotations

from time import perf_counter

import torch
import torch.distributed as dist

from gtopk_ext.collectives._protocol import Collective
from gtopk_ext.costs import Traffic, ring_allreduce_bytes


class DenseAllreduce(Collective):
    """Every element: ``tensor / P`` summed over the group by the backend's allreduce (divided first, as
    torch's averagers do: float16 values cannot overflow in the sum)."""

    name = "dense"
    sparse = False

    def reduce_dense(self, tensor: torch.Tensor, group: dist.ProcessGroup, size: int,
                     traffic: Traffic | None = None,
                     on_done=None) -> torch.futures.Future:
        """A future of ``tensor``, averaged in place, issued now and completed by the backend (asynchronous);
        ``on_done(seconds)`` is called with the time from issue to completion."""
        if traffic is not None:
            nbytes = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), size)
            traffic.add(nbytes, nbytes)
        tensor.div_(size)
        start = perf_counter()

        def finished(future):
            if on_done is not None:
                on_done(perf_counter() - start)
            return future.value()[0]

        return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(finished)

"""The DDP communication hook, in the shape of PyTorch's PowerSGD hook: the state is data (:mod:`gtopk_ext.ddp.state`),
this module the algorithm, one bucket at a time on the state's worker while the backward pass goes on, each bucket's
step the one reduction of every front end (:func:`gtopk_ext.reduction.reduce_step`).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against dist.GradBucket.
import functools
import logging
from itertools import accumulate
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from gtopk_ext._worker import Disagreement, Worker, complete, fail, future_on
from gtopk_ext.collectives import DTYPE_CODES, group_rank_and_size
from gtopk_ext.ddp.state import SparseGradState
from gtopk_ext.ddp.store import BucketMemory, Layout
from gtopk_ext.momentum import DecoupledMomentum
from gtopk_ext.reduction import Slot, reduce_step

logger = logging.getLogger("gtopk_ext.ddp")


def sparse_grad_hook(state: SparseGradState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradient averaged over ranks, sparsified (see :class:`SparseGradState`).

    Register with ``ddp_model.register_comm_hook(state, sparse_grad_hook)``; it returns a future of the bucket's
    buffer, which holds the average of what every rank applied. The bucket goes to the state's worker and the
    backward pass goes on; on the worker, for each bucket in turn (:func:`_reduce_bucket`):

    1. Begin the iteration (its first bucket): with a loss scaler, put back what a skipped step took and bring the
       residuals to this step's loss scale.
    2. Layout: the bucket's parameters, which the residuals follow when DDP changes its buckets; after a restore, a
       first iteration's bucket made of the checkpoint's buckets is reduced as those buckets.
    3. Reduce: :func:`gtopk_ext.reduction.reduce_step` (plan, momentum correction, the sparse or a dense path).
    4. End the iteration (its last bucket): count the run's totals, advance ``state.iter``, log.
    5. Complete the bucket's future once its exchange is done.

    Why a worker thread, not a chain of futures as in PowerSGD's hook: on Gloo a callback runs on the thread that
    completed the previous collective, so ranks could issue collectives in different orders; one thread per state
    issues them in DDP's order. The last bucket returns once every bucket is issued (DDP's own collectives follow).
    """
    result = reduce_buffer(state, bucket.buffer(), bucket.index(), is_last=bucket.is_last(),
                           parameters=bucket.parameters())
    # DDP reads the future in C++, where an exception set on it from Python reads "Unable to cast <message> to
    # Tensor"; raised again in a callback, it reaches backward() as an error naming its type and message.
    return result.then(_value)


def _value(future: torch.futures.Future) -> torch.Tensor:
    return future.value()


def reduce_buffer(state: SparseGradState, buffer: torch.Tensor, bucket_index: int, *, is_last: bool = True,
                  parameters: Optional[Sequence[torch.Tensor]] = None) -> torch.futures.Future:
    """Average ``buffer`` (a flat bucket) over the group as :func:`sparse_grad_hook` does, into a future of
    ``buffer``. ``parameters``: the bucket's, in order (the residuals follow them when DDP changes its buckets);
    ``is_last`` ends the iteration. Every rank must make the same calls, in the same order."""
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or buffer.dtype not in DTYPE_CODES:
        raise ValueError(f"buffer must be a flat float32, float16 or bfloat16 tensor, got "
                         f"{getattr(buffer, 'dtype', type(buffer).__name__)} of shape "
                         f"{tuple(getattr(buffer, 'shape', ()))}")
    parameters = None if parameters is None else list(parameters)
    if state.worker is None or state.worker.closed:
        state.worker = Worker(group_rank_and_size(state.process_group)[0], "sparse_grad_hook")
    worker = state.worker
    if worker.failure is not None:
        raise RuntimeError(f"sparse_grad_hook: an earlier exchange failed ({worker.failure}); the state "
                           f"cannot go on") from worker.failure
    job = functools.partial(_reduce_bucket, state, buffer, bucket_index, is_last, parameters)
    if not state.synchronous:
        result = worker.submit(job, buffer.device)
        if is_last:
            worker.drain()
        return result
    result = future_on(buffer.device)
    try:
        job(result)
        result.wait()
    except Disagreement:
        raise
    except BaseException as error:
        worker.fail(error)
        raise
    return result


def _reduce_bucket(state: SparseGradState, buffer: torch.Tensor, index: int, is_last: bool,
                   parameters: Optional[list[torch.Tensor]], result: torch.futures.Future) -> None:
    """Steps 1-5 of :func:`sparse_grad_hook` for one bucket, on the worker."""
    store, scaling = state.store, state.loss_scaling
    # 1. Begin the iteration.
    if scaling.scaler is not None and not scaling.open:
        unclaimed = [*store.unclaimed["residual"].values(), *store.unclaimed["velocity"].values()]
        if scaling.start_iteration(store.residuals, store.tensors["velocity"], unclaimed,
                                   state.config.compressor.backend):
            for slot in state.buckets.values():  # the bounds hold for the old scale
                slot.bound = None
    # 2. Layout.
    layout = store.layout_of(parameters, buffer.numel())
    parts = store.checkpoint_parts(index, layout)
    # 3. Reduce.
    if parts is None:
        store.record(index, layout)
        reduced = _reduce(state, buffer, index, layout, parameters)
    else:
        reduced = _reduce_in_parts(state, buffer, layout, parameters, parts)
    # 4. End the iteration.
    if is_last:
        scaling.open = store.restored = False
        # The run's totals count only the stats new since the previous iteration (see RunTotals.counted).
        totals, buckets = state.totals, [slot.stats for slot in state.buckets.values() if slot.stats is not None]
        new = [b for b in buckets if id(b) not in totals.counted]
        totals.counted = {id(b): b for b in buckets}
        totals.steps += 1
        totals.compressed_steps += any(b.path == "sparse" for b in new)
        totals.bytes_sent += sum(b.traffic.sent for b in new)
        totals.bytes_received += sum(b.traffic.received for b in new)
        for b in new:
            totals.paths[b.path] = totals.paths.get(b.path, 0) + 1
        state.iter += 1
        if state.stats_logging_frequency and state.iter % state.stats_logging_frequency == 0:
            total = state.stats()["total"]
            logger.info("sparse_grad_hook iter %d: selected %d for k %d of %d elements; sent %d B, received %d B; "
                        "selecting %.3f ms, exchanging %.3f ms", state.iter, total["selected"], total["k"],
                        total["numel"], total["bytes_sent"], total["bytes_received"], 1e3 * total["select_seconds"],
                        1e3 * total["exchange_seconds"])
    # 5. Complete the bucket's future when its exchange is done; a failure (of a dense allreduce) goes through the
    # worker, which prefers the cause another rank published. Under DecoupledMomentum the output's norm is kept, for
    # SparseAdamW to tell a later rescaling of the gradients.
    worker, iteration = state.worker, state.iter - is_last
    ids = (frozenset(id(p) for p in parameters) if isinstance(state.config.momentum, DecoupledMomentum)
           and parameters is not None else None)

    def forward(future):
        try:
            future.wait()
        except BaseException as error:  # noqa: BLE001 - handed to DDP and to the other ranks
            worker.fail(error)
            fail(result, worker.failure)
        else:
            if ids is not None:
                state.adam.norms[index] = (iteration, torch.linalg.vector_norm(buffer, dtype=torch.float32), ids)
            complete(result, buffer)

    reduced.add_done_callback(forward)


def _reduce(state: SparseGradState, tensor: torch.Tensor, index: int, layout: Layout,
            parameters: Optional[list[torch.Tensor]]) -> torch.futures.Future:
    """Step 3 of one bucket (or one part of a bucket, in a checkpoint's layout)."""
    config = state.config
    slot = state.buckets.get(index)
    if slot is None:
        slot = state.buckets[index] = Slot(config.reducer)
    decays = config.momentum is not None and config.momentum.weight_decay and parameters is not None
    return reduce_step(tensor, slot, BucketMemory(state.store, index, tensor, layout), config, index=index,
                       iteration=state.iter, group=state.worker.group, what="sparse_grad_hook",
                       parts=None if layout is None else [numel for _, numel in layout],
                       weights=[p.detach().reshape(-1) for p in parameters] if decays else None,
                       scaling=state.loss_scaling if state.loss_scaling.scaler is not None else None,
                       queue=state.worker)


def _reduce_in_parts(state: SparseGradState, buffer: torch.Tensor, layout: Layout,
                     parameters: list[torch.Tensor], parts: list[tuple[int, Layout]]) -> torch.futures.Future:
    """A bucket made of the checkpoint's buckets is reduced as those buckets, then put together again."""
    offsets = dict(zip((o for o, _ in layout), accumulate((n for _, n in layout), initial=0)))
    by_ordinal = dict(zip((o for o, _ in layout), parameters))
    slices = [[slice(offsets[o], offsets[o] + n) for o, n in part_layout] for _, part_layout in parts]
    futures = [_reduce(state, torch.cat([buffer[s] for s in part_slices]), index, part_layout,
                       [by_ordinal[o] for o, _ in part_layout])
               for (index, part_layout), part_slices in zip(parts, slices)]

    result = future_on(buffer.device)

    def scatter_back(_):
        try:
            for future, part_slices in zip(futures, slices):
                for s, piece in zip(part_slices, future.value().split([s.stop - s.start for s in part_slices])):
                    buffer[s] = piece
        except BaseException as error:  # noqa: BLE001 - a part's failure is the bucket's
            fail(result, error)
        else:
            complete(result, buffer)

    # collect_all's future holds futures, not tensors: the buffer is handed on through a future on its device.
    torch.futures.collect_all(futures).add_done_callback(scatter_back)
    return result


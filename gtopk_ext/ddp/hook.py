"""The DDP communication hook: sparsified gradients with error feedback, in the shape of PyTorch's PowerSGD hook.

    state = gx.SparseGradState(process_group=None, density=0.01)   # gtopk collective, Gaussian-k compressor
    ddp_model.register_comm_hook(state, gx.sparse_grad_hook)

The state is data (:mod:`gtopk_ext.ddp.state`); this module is the algorithm, one bucket at a time on the state's
worker while the backward pass goes on.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against dist.GradBucket.
import logging
import math
from time import perf_counter
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from gtopk_ext._worker import Disagreement, Worker, complete, fail, future_on
from gtopk_ext.collectives import DTYPE_CODES, DenseAllreduce
from gtopk_ext.compressors import k_for_density
from gtopk_ext.ddp import dgc
from gtopk_ext.ddp.residuals import Layout, hold_unused
from gtopk_ext.ddp.selection import STEPS_PER_ITER, parameter_maxima, select
from gtopk_ext.ddp.state import BucketStats, SparseGradState
from gtopk_ext.hierarchical import hierarchical_allreduce
from gtopk_ext.ops import is_finite
from gtopk_ext.paths import ROUNDED, PathPlan
from gtopk_ext.reduction import FLAG_NONFINITE, Outcome, plan_path, reduce, reduce_rounded
from gtopk_ext.wire import Rounding, wire_named

logger = logging.getLogger("gtopk_ext.hooks")


def sparse_grad_hook(state: SparseGradState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradient averaged over ranks, sparsified (see :class:`SparseGradState`).

    Register with ``ddp_model.register_comm_hook(state, sparse_grad_hook)``; it returns a future of the bucket's
    buffer, holding the average of what every rank applied this step. The bucket is handed to the state's
    communication thread and the backward pass goes on; on that thread, for each bucket in turn:

    1. Plan: k follows from replicated configuration (the iteration, the density schedule, the bucket's size),
       and the path from the state's :class:`gtopk_ext.PathPolicy`: dense during the warm-up, for small buckets
       and the dense collective; else, with ``auto``, the cheapest of sparse, dense16, dense8 and dense that the
       ranks' measured costs predict (:func:`gtopk_ext.reduction.plan_path`). Ranks exchange a header only when a
       bucket's plan is new or changed, and all raise the same error if they differ.
    2. Prepare: DGC's clipping and momentum correction turn the gradient into what enters the residual; each
       parameter's largest |gradient| says which parameters this rank did not use (their residual waits) and
       whether grad + residual can be non-finite.
    3. Reduce (:func:`gtopk_ext.reduction.reduce`): acc = grad + residual is compressed to k slots, reduced by the
       sparse collective (gTop-k, allgather or Ok-Topk; the hierarchical one with ``hierarchical=``), and the
       bucket becomes the average of what was applied; what was not (not selected, dropped by a merge, lost to
       the wire's rounding) stays in the residual. A rank whose acc is not finite raises a flag instead.
    4. Keep: the loss scaler's record of what the step took, and momentum factor masking.
    5. Dense paths (the warm-up, small buckets, the dense collective, or a flag raised by any rank): the bucket
       (plus any residual it still holds) is divided by P and allreduced asynchronously. On the dense16 and
       dense8 paths all of grad + residual is averaged in bfloat16 or scaled 8-bit floats (float32 sums) and the
       rounding stays in the residual.

    Why a thread rather than a chain of futures as in PyTorch's PowerSGD hook: on Gloo a future's callback runs on
    the thread that completed the previous collective, so a callback that issues the next collective races the
    autograd thread issuing the next bucket's, and ranks can issue them in different orders (PowerSGD's hook with
    several buckets on Gloo fails that way); gTop-k also needs log2(P) dependent rounds. One thread per state that
    takes the buckets in DDP's order issues every collective in the same order on every rank. The last bucket of
    an iteration returns only once every bucket has been issued: DDP issues collectives of its own right after it
    (``find_unused_parameters=True``); the exchanges of the earlier buckets overlap the backward pass.
    """
    return reduce_buffer(state, bucket.buffer(), bucket.index(), is_last=bucket.is_last(),
                         parameters=bucket.parameters())


def reduce_buffer(state: SparseGradState, buffer: torch.Tensor, bucket_index: int, *, is_last: bool = True,
                  parameters: Optional[Sequence[torch.Tensor]] = None) -> torch.futures.Future:
    """Average ``buffer`` (a flat bucket) over the group as :func:`sparse_grad_hook` does; the future's value is
    ``buffer``, overwritten. ``parameters``: the bucket's parameters in order (lets residuals follow them when
    DDP changes its buckets); ``is_last`` ends the iteration. Every rank must make the same calls, in the same
    order."""
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or buffer.dtype not in DTYPE_CODES:
        raise ValueError(f"buffer must be a flat float32, float16 or bfloat16 tensor, got "
                         f"{getattr(buffer, 'dtype', type(buffer).__name__)} of shape "
                         f"{tuple(getattr(buffer, 'shape', ()))}")
    parameters = None if parameters is None else list(parameters)

    def job(result: torch.futures.Future) -> None:
        _reduce_bucket(state, buffer, bucket_index, is_last, parameters, result)

    worker = state.worker()
    if worker.failure is not None:
        raise RuntimeError(f"sparse_grad_hook: an earlier exchange failed ({worker.failure}); the state "
                           f"cannot go on") from worker.failure
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


# ----- the algorithm, one bucket at a time (on the worker) -----


def _reduce_bucket(state: SparseGradState, buffer: torch.Tensor, index: int, is_last: bool,
                   parameters: Optional[list[torch.Tensor]], result: torch.futures.Future) -> None:
    if not state.iteration_open:
        state.iteration_open = True
        if state.loss_scaling.start_iteration(state.residual_store, state.velocity_store,
                                              state.compressor_now.backend):
            state.residual_bounds = {}
    store = state.residual_store
    layout = store.layout_of(parameters, buffer.numel())
    parts = store.checkpoint_parts(index, layout)
    if parts is None:
        store.record(index, layout)
        state.velocity_store.record(index, layout)
        reduced = _reduce_part(state, buffer, index, layout, parameters)
    else:
        reduced = _reduce_in_parts(state, buffer, layout, parameters, parts)
    if is_last:
        _end_iteration(state)
    _chain(reduced, result, buffer, state.thread)


def _reduce_part(state: SparseGradState, tensor: torch.Tensor, index: int, layout: Layout,
                 parameters: Optional[list[torch.Tensor]]) -> torch.futures.Future:
    """Steps 1-5 of :func:`sparse_grad_hook` for one bucket; a future of ``tensor``, averaged."""
    group, size = state.thread.group, dist.get_world_size(state.thread.group)
    numel = tensor.numel()
    # 1. Plan.
    may_compress = state.collective != "dense" and state.iter >= state.start_iter
    density = state.density_at(state.iter) if may_compress else 1.0
    k = k_for_density(density, numel) if may_compress else None
    if may_compress:
        state.use_density(density)
    stats = state.bucket_stats[index] = BucketStats("dense", numel, numel, selected=numel)
    plan = state.agreed_plans.setdefault(index, PathPlan())
    path = plan_path(tensor, group, plan, state.path_policy, iteration=state.iter, k=k, collective=state.collective_now,
                     wire=wire_named(state.wire), what="sparse_grad_hook",
                     volatile={"iter": state.iter, "bucket_index": index}, traffic=stats.traffic)
    stats.path = path
    # 2. Prepare.
    dgc.clip_bucket(state.momentum_correction, tensor, size)
    if path != "sparse":
        if state.momentum and is_finite(tensor):  # an inf must not poison the velocity
            dgc.increment(state.momentum_correction, state.velocity_store, _velocities_before(state), tensor, index,
                          layout, parameters, [1.0] * len(layout or [None]), sent_whole=True)
        if path in ROUNDED:
            return _reduce_rounded(state, path, tensor, index, layout, stats, plan)
        if state.error_feedback and state.residual_store.holds_any(index, layout):
            _flush_into(state, tensor, index, layout)
        return _dense_allreduce(state, tensor, group, size, stats, plan)
    stats.k, stats.selected = k, 0
    if state.hierarchical is not None:
        return _reduce_hierarchical(state, tensor, index, layout, k, stats, plan)
    start = perf_counter()
    residual = state.residual_store.residual(index, tensor, layout) if state.error_feedback else None
    # max |grad| of each parameter: one pass that tells both whether acc = grad + residual can be non-finite and
    # which parameters this rank did not use.
    maxima = parameter_maxima(tensor, layout).tolist()
    velocity = None
    if state.momentum and all(math.isfinite(m) for m in maxima):  # tensor becomes the increment of v
        velocity = dgc.increment(state.momentum_correction, state.velocity_store, _velocities_before(state), tensor,
                                 index, layout, parameters, maxima, sent_whole=False)
        unused = [m == 0 for m in maxima]
        maxima = [0.0 if zero else m for zero, m in zip(unused, parameter_maxima(tensor, layout).tolist())]
    finite = _accumulation_is_finite(state, tensor, residual, maxima, index)

    # 3. Reduce: select (unless acc is not finite: then a flag), exchange, keep what was not applied.
    msg = None
    if finite:
        begin = perf_counter()
        msg, bound = select(state.compressor_now, tensor, residual, maxima, layout, k, _draw_step(state, index))
        if residual is not None and bound is not None:
            state.residual_bounds[index] = (residual, bound)
        else:
            state.residual_bounds.pop(index, None)
        stats.select_seconds = perf_counter() - begin
    collective = state.collective_now
    outcome = reduce(tensor, residual, msg, collective, group, k=k, wire=wire_named(state.wire),
                     backend=state.compressor_now.backend.for_device(tensor.device), traffic=stats.traffic,
                     state=state.oktopk_states.setdefault(index, collective.new_state()) if collective.stateful
                     else None)
    stats.selected = outcome.msg.count
    stats.exchange_seconds = perf_counter() - start - stats.select_seconds
    if outcome.nonfinite:  # 5. every rank goes dense
        stats.path, stats.k, stats.selected = "nonfinite", numel, numel
        if finite and residual is not None:  # its whole sum is in tensor: nothing stays behind
            del state.residuals[index]
            state.residual_bounds.pop(index, None)
            state.loss_scaling.record_taken(index, None, residual)
        return _dense_allreduce(state, tensor, group, size, stats, plan)
    plan.costs.observe_sparse(numel, k, stats.select_seconds, stats.exchange_seconds)

    # 4. Keep.
    if residual is not None:
        state.loss_scaling.record_taken(index, *outcome.taken())
    if velocity is not None and state.iter >= state.masking_start_iter:
        dgc.mask(velocity, outcome.msg.indices, outcome.msg.count, outcome.applied)
    return _done(tensor)


def _reduce_hierarchical(state: SparseGradState, tensor: torch.Tensor, index: int, layout: Layout, k: int,
                         stats: BucketStats, plan: PathPlan) -> torch.futures.Future:
    """Steps 2-5 of :func:`sparse_grad_hook` with ``hierarchical=``: the collective selects, from this rank's
    shard of its node's sum, and raises the non-finite flag inside its payloads."""
    group, size = state.thread.group, dist.get_world_size(state.thread.group)
    start = perf_counter()
    residual = state.residual_store.residual(index, tensor, layout) if state.error_feedback else None
    maxima = parameter_maxima(tensor, layout).tolist()
    held = hold_unused(residual, maxima, layout) if residual is not None else []
    collective = state.collective_now
    inner_state = state.oktopk_states.setdefault(index, collective.new_state()) if collective.stateful else None
    rounding = Rounding()
    result = hierarchical_allreduce(tensor, residual, state.compressor_now, k, state.hierarchical.local_size, group,
                                    inner=state.collective, inner_state=inner_state,
                                    step=_draw_step(state, index), traffic=stats.traffic,
                                    nonfinite_flag=FLAG_NONFINITE, wire=state.wire, rounding=rounding)
    for part, saved in held:  # kept out of this step: its parameter was unused here
        part.add_(saved)
    stats.selected, stats.exchange_seconds = result.msg.count, perf_counter() - start
    if result.average is None:  # a flag: every rank goes dense, nothing was changed
        stats.path, stats.k, stats.selected = "nonfinite", tensor.numel(), tensor.numel()
        if residual is not None and _accumulation_is_finite(state, tensor, residual, maxima, index):
            _flush_into(state, tensor, index, layout)
        return _dense_allreduce(state, tensor, group, size, stats, plan)
    plan.costs.observe_sparse(tensor.numel(), k, 0.0, stats.exchange_seconds)
    tensor.copy_(result.average)
    if residual is not None:
        kept = Outcome(result.msg, result.applied, rounding.pairs(residual.dtype, residual.device))
        state.loss_scaling.record_taken(index, *kept.taken())
    return _done(tensor)


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    done = future_on(tensor.device)
    done.set_result(tensor)
    return done


def _velocities_before(state: SparseGradState) -> Optional[dict[int, torch.Tensor]]:
    return state.loss_scaling.velocities_before if state.loss_scaling.scaler is not None else None


def _draw_step(state: SparseGradState, index: int) -> int:
    """The step that seeds randomk's draw for this bucket and iteration."""
    return state.iter * STEPS_PER_ITER + index


def _dense_allreduce(state: SparseGradState, tensor: torch.Tensor, group: dist.ProcessGroup, size: int,
                     stats: BucketStats, plan: PathPlan) -> torch.futures.Future:
    def done(start: float, end: float) -> None:
        stats.exchange_seconds = end - start
        plan.costs.observe_dense(tensor.numel(), state.dense_queue.own_seconds(start, end))

    return DenseAllreduce().reduce_dense(tensor, group, size, stats.traffic, on_done=done)


def _reduce_rounded(state: SparseGradState, path: str, tensor: torch.Tensor, index: int, layout: Layout,
                    stats: BucketStats, plan: PathPlan) -> torch.futures.Future:
    """Step 5 on a rounded dense path (dense16, dense8): all of grad + residual is sent, the rounding stays in
    the residual. A parameter this rank did not use keeps its residual out, as on the sparse path."""
    start = perf_counter()
    residual, held = None, []
    if state.error_feedback:
        residual = state.residual_store.residual(index, tensor, layout)
        held = hold_unused(residual, parameter_maxima(tensor, layout).tolist(), layout)
        state.residual_bounds.pop(index, None)
        if state.loss_scaling.scaler is not None:
            state.loss_scaling.record_taken(index, None, residual.clone())
    reduce_rounded(path, tensor, residual, state.thread.group, stats.traffic)
    for part, saved in held:  # the part now holds the chunk's rounding, if this rank summed it
        part.add_(saved)
    stats.exchange_seconds = perf_counter() - start
    plan.costs.observe_dense(tensor.numel(), stats.exchange_seconds, path)
    return _done(tensor)


def _flush_into(state: SparseGradState, tensor: torch.Tensor, index: int, layout: Layout) -> None:
    """A dense bucket sends the residual it still has (parts left by an earlier layout) with its gradient."""
    residual = state.residual_store.residual(index, tensor, layout)
    tensor.add_(residual)
    del state.residuals[index]
    state.loss_scaling.record_taken(index, None, residual)


def _accumulation_is_finite(state: SparseGradState, tensor: torch.Tensor, residual: Optional[torch.Tensor],
                            maxima: list[float], index: int) -> bool:
    """Whether acc = grad + residual is finite; a full check only when the bounds allow an overflow."""
    if not all(math.isfinite(m) for m in maxima):
        return False
    if residual is None:
        return True
    residual_with_bound, bound = state.residual_bounds.get(index, (None, None))
    if residual_with_bound is residual and max(maxima) + float(bound) < torch.finfo(tensor.dtype).max:
        return True
    return is_finite(tensor + residual)


def _reduce_in_parts(state: SparseGradState, buffer: torch.Tensor, layout: Layout,
                     parameters: list[torch.Tensor], parts: list[tuple[int, Layout]]) -> torch.futures.Future:
    """A bucket made of the checkpoint's buckets is reduced as those buckets, then put together again."""
    offsets, offset = {}, 0
    for ordinal, numel in layout:
        offsets[ordinal] = offset
        offset += numel
    by_ordinal = dict(zip((o for o, _ in layout), parameters))
    slices = [[slice(offsets[o], offsets[o] + n) for o, n in part_layout] for _, part_layout in parts]
    futures = [_reduce_part(state, torch.cat([buffer[s] for s in part_slices]), index, part_layout,
                            [by_ordinal[o] for o, _ in part_layout])
               for (index, part_layout), part_slices in zip(parts, slices)]

    result = future_on(buffer.device)

    def scatter_back(_):
        try:
            for future, part_slices in zip(futures, slices):
                reduced, offset = future.value(), 0
                for s in part_slices:
                    width = s.stop - s.start
                    buffer[s] = reduced[offset:offset + width]
                    offset += width
        except BaseException as error:  # noqa: BLE001 - a part's failure is the bucket's
            fail(result, error)
        else:
            complete(result, buffer)

    # collect_all's future holds futures, not tensors: the buffer is handed on through a future on its device.
    torch.futures.collect_all(futures).add_done_callback(scatter_back)
    return result


def _chain(reduced: torch.futures.Future, result: torch.futures.Future, value: torch.Tensor,
           thread: Worker) -> None:
    """Complete ``result`` with ``value`` when ``reduced`` completes; a failure (of a dense allreduce) goes
    through ``thread``, which prefers the cause another rank published."""

    def forward(future):
        try:
            future.wait()
        except BaseException as error:  # noqa: BLE001 - handed to DDP and to the other ranks
            thread.fail(error)
            fail(result, thread.failure)
        else:
            complete(result, value)

    reduced.add_done_callback(forward)


def _end_iteration(state: SparseGradState) -> None:
    state.iteration_open = False
    state.residual_store.restored = False
    state.run_totals.add_step(state.bucket_stats.values())
    state.iter += 1
    if state.stats_logging_frequency and state.iter % state.stats_logging_frequency == 0:
        total = state._stats_now()["total"]
        logger.info("sparse_grad_hook iter %d: selected %d for k %d of %d elements; sent %d B, received %d B; "
                    "selecting %.3f ms, exchanging %.3f ms", state.iter, total["selected"], total["k"],
                    total["numel"], total["bytes_sent"], total["bytes_received"], 1e3 * total["select_seconds"],
                    1e3 * total["exchange_seconds"])

"""The one error-feedback reduction of every front end (the DDP and FSDP2 hooks, SparseLocalSGD), and the only
caller of the collectives: a tensor plus its residual takes this step's path, and what this rank did not get applied
(not selected, dropped by a merge, lost to the wire's rounding) stays in its residual, so ``tensor + old residual ==
what was applied + new residual`` on every rank, to float rounding.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from time import perf_counter
from typing import Optional

import torch
import torch.distributed as dist

from gtopk_ext import dct, ops
from gtopk_ext._worker import future_on
from gtopk_ext.amp import LossScaling
from gtopk_ext.backends import Backend
from gtopk_ext.collectives import COLLECTIVES, Collective, Traffic, agree, keep_unapplied
from gtopk_ext.collectives._protocol import message_fields
from gtopk_ext.compressors import hold_unused, k_for_density, part_maxima, select
from gtopk_ext.config import SparseConfig
from gtopk_ext.hierarchical import hierarchical_allreduce
from gtopk_ext.message import SparseMessage, padding_message
from gtopk_ext.momentum import DecoupledMomentum, clip, clip_together, increment, mask
from gtopk_ext.ops import is_finite
from gtopk_ext.paths import ROUNDED, PathPlan, agreed_costs, own_seconds, predicted
from gtopk_ext.wire import Rounding, Wire

FLAG_NONFINITE = 1  # a flag bit carried inside the sparse payload (every rank learns the OR)
# A tag compared across ranks inside the flags, with no round of its own: its bits, then their complement. The OR
# over the ranks of both halves shares a bit exactly when two ranks' tags differ in it.
TAG_BITS = 15
TAG_MASK = (1 << TAG_BITS) - 1
STEPS_PER_ITER = 1 << 20  # randomk's draws: step = iteration * STEPS_PER_ITER + the tensor's index
_DENSE = {name: COLLECTIVES[name]() for name in ("dense", *ROUNDED)}


@dataclass
class StepStats:
    """What the reduction did with one tensor in its latest step."""

    path: str  # "sparse", "dense16", "dense8" or "dense" (gtopk_ext.paths); "nonfinite" (a rank's sum was not)
    numel: int
    k: int  # slots sent per rank (numel on the dense paths)
    selected: int | torch.Tensor = 0  # elements the compressor selected before truncation to k
    select_seconds: float = 0.0  # grad + residual, statistics, compaction, residual update
    exchange_seconds: float = 0.0  # the collective and the average (a dense path: from issuing its allreduce)
    traffic: Traffic = field(default_factory=Traffic, repr=False)
    SUMMED = ("numel", "k", "selected", "bytes_sent", "bytes_received", "select_seconds", "exchange_seconds")

    def as_dict(self) -> dict:
        """The figures a front end's ``stats()`` reports (bytes: this rank's); ``SUMMED``: those it adds up."""
        return {"path": self.path, "numel": self.numel, "k": self.k, "selected": int(self.selected),
                "bytes_sent": self.traffic.sent, "bytes_received": self.traffic.received,
                "select_seconds": self.select_seconds, "exchange_seconds": self.exchange_seconds}


class Slot:
    """What the reduction keeps per tensor between steps: the ``plan`` agreed with the other ranks, the latest
    ``stats``, Ok-Topk's state, and ``bound``: (residual, a bound on its max |value|) from the latest sparse step."""

    __slots__ = ("plan", "stats", "oktopk", "bound")

    def __init__(self, collective: Collective):
        self.plan = PathPlan()
        self.stats: Optional[StepStats] = None
        self.oktopk = collective.new_state()
        self.bound: Optional[tuple[torch.Tensor, torch.Tensor]] = None


class Memory:
    """One tensor's tensors between steps, by kind (``"residual"``, ``"velocity"``): here plain tensors made at
    registration (an FSDP parameter group's); the DDP hook's follow the parameters (``ddp.store.BucketMemory``)."""

    def __init__(self, **tensors: torch.Tensor):
        self.tensors = tensors

    def get(self, kind: str) -> torch.Tensor:
        return self.tensors[kind]

    def held(self, kind: str) -> Optional[torch.Tensor]:
        """The tensor of ``kind`` where one is held (a dense step adds it to what it sends), else None."""
        return self.tensors.get(kind)

    def forget(self, kind: str) -> None:
        """All of the tensor of ``kind`` was sent: nothing stays."""
        self.tensors[kind].zero_()


def reduce_step(tensor: torch.Tensor, slot: Slot, memory: Memory, config: SparseConfig, *, index: int,
                iteration: int, group: dist.ProcessGroup, what: str, parts: Optional[list[int]] = None,
                weights: Optional[list[torch.Tensor]] = None, clip_over: Optional[tuple[dist.ProcessGroup, int]] = None,
                scaling: Optional[LossScaling] = None, queue=None) -> torch.futures.Future:
    """One step of ``tensor`` (flat: this rank's gradient of the front end's tensor ``index``) over ``group``: a
    future of ``tensor``, which becomes the average over the ranks of what was applied.

    1. Plan (:func:`plan_path`): k from the iteration's density, and the path every rank takes (dense during the
       warm-up, for small tensors and the dense collective, else ``config.path``'s).
    2. Prepare: DGC's clipping and momentum correction (``weights``: the parameters laid end to end as in
       ``tensor``, for weight decay), or AdamW's decoupled momentum (:func:`prepare_decoupled`: the gradient
       clipped over ``clip_over``, a group whose ranks hold pieces of that many gradients, by default ``group``,
       and in DCT coefficients; the residual, m, decayed; the average goes back to elements before it is
       returned); each part's largest |gradient| (``parts``: their sizes) tells which parts this rank did not use
       (their residual waits) and whether grad + residual can be non-finite.
    3. Reduce (sparse, :func:`reduce`): acc = grad + residual compressed to k slots, reduced by the collective (or
       the hierarchical one); what was not applied stays in the residual. A rank whose acc is not finite raises a
       flag instead.
    4. Keep: the loss scaler's record of what the step took (``scaling``), and momentum factor masking.
    5. Dense (the warm-up, small tensors, the dense collective, a flag from any rank): the tensor, plus any residual
       it holds, averaged; dense16 and dense8 in bfloat16 or scaled 8-bit floats, the rounding kept in the residual.

    ``queue``: its ``busy_until`` is when this group's latest asynchronous allreduce completed (the DDP hook's
    worker), so that a dense step's own time is told from its wait in the queue."""
    numel = tensor.numel()
    stats = slot.stats = StepStats("dense", numel, numel, selected=numel)
    # 1. Plan.
    may_compress = config.collective != "dense" and iteration >= config.start_iter
    density = config.density_at(iteration) if may_compress else 1.0
    k = k_for_density(density, numel) if may_compress else None
    path = stats.path = plan_path(tensor, group, slot.plan, config, iteration=iteration, k=k, index=index, what=what,
                                  traffic=stats.traffic)
    # 2. Prepare.
    correction = config.momentum
    finish = _returned
    if isinstance(correction, DecoupledMomentum):  # then plain error feedback in DCT coefficients, the average back
        prepare_decoupled(tensor, memory, correction, parts, clip_over or (group,))
        finish = functools.partial(_returned, back=functools.partial(dct.inverse_, chunk=correction.chunk,
                                                                     parts=parts))
        correction = None
    elif correction is not None and correction.clip_norm is not None:
        clip(tensor, correction.clip_norm / math.sqrt(dist.get_world_size(group)))
    accumulates = correction is not None and correction.accumulates
    record = None if scaling is None else functools.partial(scaling.velocities_before.__setitem__, index)
    if path != "sparse":
        if accumulates and is_finite(tensor):  # an inf must not poison the velocity
            increment(correction, memory.get("velocity"), tensor, weights, parts, [1.0] * len(parts or [numel]),
                      record=record, sent_whole=True)
        if path in ROUNDED:
            return finish(_reduce_rounded(path, tensor, slot, memory, config, index, group, parts, scaling))
        held = memory.held("residual") if config.error_feedback else None
        if held is not None:  # 5. a residual left by sparse steps (or another layout) is sent too
            tensor.add_(held)
        return finish(_dense(tensor, held, slot, memory, group, queue, scaling, index))
    stats.k, stats.selected = k, 0
    compressor = config.compressor_at(density)
    start = perf_counter()
    residual = memory.get("residual") if config.error_feedback else None
    maxima = part_maxima(tensor, parts).tolist()
    velocity = None
    if config.hierarchical is not None:
        outcome, finite = _reduce_hierarchical(tensor, residual, maxima, slot, config, compressor, k,
                                               iteration * STEPS_PER_ITER + index, group, parts)
    else:
        if accumulates and all(math.isfinite(m) for m in maxima):  # tensor becomes the increment of the residual
            velocity = memory.get("velocity")
            increment(correction, velocity, tensor, weights, parts, maxima, record=record, sent_whole=False)
            maxima = [0.0 if old == 0 else new for old, new in zip(maxima, part_maxima(tensor, parts).tolist())]
        finite = _accumulation_is_finite(tensor, residual, maxima, slot)
        # 3. Reduce: select (unless acc is not finite: then a flag), exchange, keep what was not applied.
        msg = None
        if finite:
            begin = perf_counter()
            msg, bound = select(compressor, tensor, residual, maxima, parts, k, iteration * STEPS_PER_ITER + index)
            slot.bound = (residual, bound) if residual is not None and bound is not None else None
            stats.select_seconds = perf_counter() - begin
        outcome = reduce(tensor, residual, msg, config.reducer, group, k=k, wire=config.wire,
                         backend=compressor.backend[tensor.device], traffic=stats.traffic, state=slot.oktopk)
    stats.selected = outcome.msg.count
    stats.exchange_seconds = perf_counter() - start - stats.select_seconds
    if outcome.nonfinite:  # 5. every rank goes dense; a finite rank's whole sum is in tensor
        stats.path = "nonfinite"
        return finish(_dense(tensor, residual if finite else None, slot, memory, group, queue, scaling, index))
    slot.plan.costs.observe_sparse(numel, k, stats.select_seconds, stats.exchange_seconds)

    # 4. Keep.
    if residual is not None and scaling is not None:
        scaling.taken[index] = outcome.taken()
    if velocity is not None and iteration >= correction.masking_start_iter:
        mask(velocity, outcome.msg.indices, outcome.msg.count, outcome.applied)
    return finish(_done(tensor))


def prepare_decoupled(tensor: torch.Tensor, memory: Memory, correction: DecoupledMomentum,
                      parts: Optional[list[int]], clip_over: tuple) -> None:
    """Step 2 with :class:`DecoupledMomentum`: ``tensor`` is clipped over ``clip_over`` and becomes its DCT
    coefficients; the residual (m, in coefficients) decays by ``beta``, so that grad + residual is the new m."""
    if correction.clip_norm is not None:
        clip_together(tensor, correction.clip_norm, *clip_over)
    dct.forward_(tensor, correction.chunk, parts)
    memory.get("residual").mul_(correction.beta)


def _returned(future: torch.futures.Future, back=None) -> torch.futures.Future:
    """``future``, or one whose tensor ``back`` has changed in place first (DCT coefficients back to elements)."""
    if back is None:
        return future

    def then(done: torch.futures.Future) -> torch.Tensor:
        tensor = done.value()
        back(tensor)
        return tensor

    return future.then(then)


def _reduce_hierarchical(tensor: torch.Tensor, residual: Optional[torch.Tensor], maxima: list[float], slot: Slot,
                         config: SparseConfig, compressor, k: int, step: int, group: dist.ProcessGroup,
                         parts: Optional[list[int]]) -> tuple[Outcome, bool]:
    """Step 3 with ``config.hierarchical``, whose collective selects (from this rank's shard of its node's sum) and
    raises the flag; after a flag, whether this rank's grad + residual is finite (then all of it is in ``tensor``)."""
    held = hold_unused(residual, maxima, parts) if residual is not None else []
    rounding = Rounding()
    result = hierarchical_allreduce(tensor, residual, compressor, k, config.hierarchical.local_size, group,
                                    inner=config.collective, inner_state=slot.oktopk, step=step,
                                    traffic=slot.stats.traffic, nonfinite_flag=FLAG_NONFINITE, wire=config.wire,
                                    rounding=rounding)
    for part, saved in held:  # kept out of this step: its parameter was unused here
        part.add_(saved)
    errors = rounding.pairs(tensor.dtype, tensor.device)
    if result.average is None:  # a flag: nothing was changed
        finite = residual is not None and _accumulation_is_finite(tensor, residual, maxima, slot)
        if finite:
            tensor.add_(residual)
        return Outcome(result.msg, result.applied, errors, nonfinite=True), finite
    tensor.copy_(result.average)
    return Outcome(result.msg, result.applied, errors), True


def _reduce_rounded(path: str, tensor: torch.Tensor, slot: Slot, memory: Memory, config: SparseConfig, index: int,
                    group: dist.ProcessGroup, parts: Optional[list[int]],
                    scaling: Optional[LossScaling]) -> torch.futures.Future:
    """Step 5 on a rounded dense path (dense16, dense8): all of grad + residual is sent (but a part this rank did not
    use), the rounding stays in the residual."""
    start = perf_counter()
    residual, held = None, []
    if config.error_feedback:
        residual = memory.get("residual")
        if parts is not None:
            held = hold_unused(residual, part_maxima(tensor, parts).tolist(), parts)
        slot.bound = None
        if scaling is not None:
            scaling.taken[index] = (None, residual.clone())
        tensor.add_(residual)
    _DENSE[path].reduce_dense(tensor, group, dist.get_world_size(group), slot.stats.traffic, lost=residual)
    for part, saved in held:  # the part now holds the chunk's rounding, if this rank summed it
        part.add_(saved)
    slot.stats.exchange_seconds = perf_counter() - start
    slot.plan.costs.observe_dense(tensor.numel(), slot.stats.exchange_seconds, path)
    return _done(tensor)


def _dense(tensor: torch.Tensor, residual: Optional[torch.Tensor], slot: Slot, memory: Memory,
           group: dist.ProcessGroup, queue, scaling: Optional[LossScaling], index: int) -> torch.futures.Future:
    """Step 5: ``tensor / P`` allreduced asynchronously, its own time the dense path's cost; ``residual``: all of it
    is in ``tensor``, so none stays (a step the loss scaler skips puts it back)."""
    stats, plan = slot.stats, slot.plan
    stats.k = stats.selected = tensor.numel()
    if residual is not None:
        memory.forget("residual")
        slot.bound = None
        if scaling is not None:
            scaling.taken[index] = (None, residual)

    def done(start: float, end: float) -> None:
        stats.exchange_seconds = end - start
        plan.costs.observe_dense(tensor.numel(), end - start if queue is None else own_seconds(queue, start, end))

    return _DENSE["dense"].reduce_dense(tensor, group, dist.get_world_size(group), stats.traffic, on_done=done)


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    done = future_on(tensor.device)
    done.set_result(tensor)
    return done


def _accumulation_is_finite(tensor: torch.Tensor, residual: Optional[torch.Tensor], maxima: list[float],
                            slot: Slot) -> bool:
    """Whether acc = grad + residual is finite; a full check only when the latest bound allows an overflow."""
    if not all(math.isfinite(m) for m in maxima):
        return False
    if residual is None:
        return True
    bound = slot.bound
    if bound is not None and bound[0] is residual and max(maxima) + float(bound[1]) < torch.finfo(tensor.dtype).max:
        return True
    return is_finite(tensor + residual)


def plan_path(tensor: torch.Tensor, group: dist.ProcessGroup, plan: PathPlan, config: SparseConfig, *,
              iteration: int, k: int | None, index: int, what: str, traffic: Traffic | None = None) -> str:
    """Step 1: the ranks check they share ``tensor``'s plan (size, dtype, k, wire, and the configuration: a rank
    with another collective would wait in another protocol; the header crosses only when the plan changes) and
    take the same path (``k`` None: the tensor may not compress, it goes dense). With ``auto`` the path follows
    from the mean of the ranks' measured costs in the header, or from the policy's calibration."""
    numel, size, policy, wire = tensor.numel(), dist.get_world_size(group), config.path, config.wire
    compress = k is not None and numel >= max(policy.min_compress_numel, 1)
    auto = compress and policy.mode == "auto"
    if auto and iteration >= plan.until:
        plan.round += 1
    fields = {**message_fields(numel, tensor.dtype, compress, k if compress else numel, wire),
              "round": plan.round if auto else 0, **config.fields()}
    headers = agree(fields, group, tensor.device, what, traffic=traffic, agreement=plan.agreement,
                    volatile={"iter": iteration, "index": index}, reported=plan.costs.report())
    if not compress:
        plan.path = "dense"
    elif not auto:
        plan.path = "dense" if policy.mode in ROUNDED and tensor.dtype != torch.float32 else policy.mode
    elif headers is not None and fields != plan.decided:  # a new plan (agreed again unchanged: a resume)
        calibrated = (policy.calibration or {}).get(index)
        if calibrated is not None and calibrated["numel"] != numel:
            raise ValueError(f"{what}: the path policy's calibration of tensor {index} is for {calibrated['numel']} "
                             f"elements, this one has {numel}: it was made for another model or bucketing")
        plan.agreed = calibrated or {"numel": numel, **agreed_costs(headers)}
        plan.measured += calibrated is None
        plan.decide(policy, predicted(plan.agreed, numel=numel, k=k, size=size, dtype=tensor.dtype,
                                      collective=config.reducer, wire=wire), plan.agreed, iteration, k=k, numel=numel)
        plan.decided = fields
    plan.sparse_steps = plan.sparse_steps + 1 if plan.path == "sparse" else 0
    return plan.path


@dataclass
class Outcome:
    """What :func:`reduce` did on this rank: ``msg``, the slots it sent; ``applied``, the mask of those in the
    average (None: all); ``errors``, (indices, errors) of the wire's rounding, now in its residual; ``nonfinite``:
    a rank's sum was not finite, nothing was applied; ``disagreed``: the ranks' tags differed, nothing was
    applied."""

    msg: SparseMessage
    applied: torch.Tensor | None
    errors: tuple[torch.Tensor, torch.Tensor]
    nonfinite: bool = False
    disagreed: bool = False

    def taken(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) this step took out of the residual: the applied slots less the rounding kept."""
        values = self.msg.values if self.applied is None else self.msg.values * self.applied
        error_indices, errors = self.errors
        return torch.cat([self.msg.indices, error_indices]), torch.cat([values, -errors])


def reduce(tensor: torch.Tensor, residual: torch.Tensor | None, msg: SparseMessage | None, collective: Collective,
           group: dist.ProcessGroup, *, k: int, wire: Wire, backend: Backend | None, traffic: Traffic | None = None,
           state=None, out: torch.Tensor | None = None, senders: bool = False, tag: int | None = None) -> Outcome:
    """The sparse exchange of ``tensor`` (flat) over ``group``: ``msg`` is ``tensor + residual`` compressed to k
    slots, the rest left in ``residual``, or None from a rank whose sum is not finite (it raises a flag). ``out``
    (default ``tensor``) becomes the average of what was applied (``senders``: each element's sum divided by how
    many ranks sent it, SparseLoCo's average; the collective must count them); what was not goes back into the
    residual. After a flag nothing is applied: a finite rank's ``tensor`` holds all of its ``tensor + residual``.
    ``tag`` (an int of TAG_BITS bits): the ranks check that they passed the same one from the payload's flags, in
    the same exchange; where they did not, nothing is applied, as after a flag (``disagreed``)."""
    if senders and not collective.counts_senders:
        raise ValueError(f"averaging over the ranks that sent each element needs a collective that counts them "
                         f"(allgather), got {collective.name!r}")
    finite = msg is not None
    flags = torch.zeros(1, dtype=torch.int32, device=tensor.device)
    if tag is not None:
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= TAG_MASK:
            raise ValueError(f"tag must be an int in [0, {TAG_MASK}], got {tag!r}")
        flags[0] = tag << 1 | (~tag & TAG_MASK) << (1 + TAG_BITS)
    if not finite:
        flags[0] |= FLAG_NONFINITE
        msg = padding_message(tensor, k)
    rounding = Rounding()
    reduced = collective.reduce(msg, group, wire=wire, traffic=traffic, flags=flags, rounding=rounding, state=state,
                                **({"senders": True} if senders else {}))
    raised = int(flags)
    disagreed = tag is not None and bool(raised >> 1 & raised >> (1 + TAG_BITS) & TAG_MASK)
    if raised & FLAG_NONFINITE or disagreed:
        if finite and residual is not None:  # all of this rank's sum back in tensor (for the hook's dense average)
            ops.scatter_add_(residual, msg.indices, msg.values, backend=backend, check=False)
            tensor.copy_(residual)
        nothing = torch.zeros_like(msg.indices, dtype=torch.bool)
        return Outcome(msg, nothing, rounding.pairs(tensor.dtype, tensor.device),
                       nonfinite=bool(raised & FLAG_NONFINITE), disagreed=disagreed)
    errors = (keep_unapplied(residual, msg, reduced.applied, rounding, backend) if residual is not None
              else rounding.pairs(tensor.dtype, tensor.device))
    reduced.average_into(tensor if out is None else out, dist.get_world_size(group), backend)
    return Outcome(msg, reduced.applied, errors)

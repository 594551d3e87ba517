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

from gtopk_ext import ops
from gtopk_ext._worker import future_on
from gtopk_ext.amp import LossScaling
from gtopk_ext.backends import Backend
from gtopk_ext.collectives import COLLECTIVES, Collective, Traffic, agree, keep_unapplied
from gtopk_ext.collectives._protocol import message_fields
from gtopk_ext.compressors import hold_unused, k_for_density, part_maxima, select
from gtopk_ext.config import SparseConfig
from gtopk_ext.hierarchical import hierarchical_allreduce
from gtopk_ext.message import SparseMessage, padding_message
from gtopk_ext.momentum import clip, increment, mask
from gtopk_ext.ops import is_finite
from gtopk_ext.paths import ROUNDED, PathPlan, PathPolicy, agreed_costs, own_seconds, predicted
from gtopk_ext.wire import Rounding, Wire

FLAG_NONFINITE = 1  # a flag bit carried inside the sparse payload (every rank learns the OR)
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
    """What the reduction keeps per tensor between steps (a DDP bucket, an FSDP parameter group): the ``plan`` agreed
    with the other ranks, the latest ``stats``, Ok-Topk's state, and ``bound``: (residual, a bound on its max |value|)
    from the latest sparse step, so that the next can tell that grad + residual is finite without summing them."""

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
                weights: Optional[list[torch.Tensor]] = None, scaling: Optional[LossScaling] = None,
                queue=None) -> torch.futures.Future:
    """One step of ``tensor`` (flat: this rank's gradient of the front end's tensor ``index``) over ``group``: a
    future of ``tensor``, which becomes the average over the ranks of what was applied.

    1. Plan (:func:`plan_path`): k from the iteration, the density schedule and the tensor's size; the path dense
       during the warm-up, for small tensors and the dense collective, else ``config.path``'s (``auto``: the
       cheapest that the ranks' measured costs, or the policy's calibration, predict). The ranks exchange a header
       only when the plan changes, and all raise the same error if they differ.
    2. Prepare: DGC's clipping and momentum correction (``weights``: the parameters laid end to end as in
       ``tensor``, for weight decay) make the gradient what enters the residual; each part's largest |gradient|
       (``parts``: their sizes) tells which parts this rank did not use (their residual waits) and whether
       grad + residual can be non-finite.
    3. Reduce (sparse, :func:`reduce`): acc = grad + residual is compressed to k slots and reduced by the
       collective (or the hierarchical one); what was not applied stays in the residual. A rank whose acc is not
       finite raises a flag instead.
    4. Keep: the loss scaler's record of what the step took (``scaling``), and momentum factor masking.
    5. Dense (the warm-up, small tensors, the dense collective, a flag from any rank): the tensor, plus any residual
       it holds, / P, allreduced asynchronously; dense16 and dense8 average all of grad + residual in bfloat16 or
       scaled 8-bit floats (float32 sums), the rounding kept in the residual.

    ``queue``: its ``busy_until`` is when this group's latest asynchronous allreduce completed (the DDP hook's
    worker), so that a dense step's own time is told from its wait in the queue."""
    size = dist.get_world_size(group)
    numel = tensor.numel()
    stats = slot.stats = StepStats("dense", numel, numel, selected=numel)
    # 1. Plan.
    may_compress = config.collective != "dense" and iteration >= config.start_iter
    density = config.density_at(iteration) if may_compress else 1.0
    k = k_for_density(density, numel) if may_compress else None
    path = stats.path = plan_path(tensor, group, slot.plan, config.path, iteration=iteration, k=k, index=index,
                                  collective=config.reducer, wire=config.wire, what=what,
                                  volatile={"iter": iteration, "index": index}, traffic=stats.traffic)
    # 2. Prepare.
    correction = config.momentum
    if correction is not None and correction.clip_norm is not None:
        clip(tensor, correction.clip_norm / math.sqrt(size))
    accumulates = correction is not None and correction.accumulates
    record = None if scaling is None else functools.partial(scaling.velocities_before.__setitem__, index)
    if path != "sparse":
        if accumulates and is_finite(tensor):  # an inf must not poison the velocity
            increment(correction, memory.get("velocity"), tensor, weights, parts, [1.0] * len(parts or [numel]),
                      record=record, sent_whole=True)
        if path in ROUNDED:
            return _reduce_rounded(path, tensor, slot, memory, config, index, group, parts, scaling)
        held = memory.held("residual") if config.error_feedback else None
        if held is not None:  # 5. a residual left by sparse steps (or another layout) is sent too
            tensor.add_(held)
            memory.forget("residual")
            if scaling is not None:
                scaling.taken[index] = (None, held)
        return _allreduce(tensor, slot, group, size, queue)
    stats.k, stats.selected = k, 0
    compressor = config.compressor_at(density)
    backend = compressor.backend[tensor.device]
    if config.hierarchical is not None:
        return _reduce_hierarchical(tensor, slot, memory, config, compressor, k, index, iteration, group, parts,
                                    scaling, queue)
    start = perf_counter()
    residual = memory.get("residual") if config.error_feedback else None
    maxima = part_maxima(tensor, parts).tolist()
    velocity = None
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
    outcome = reduce(tensor, residual, msg, config.reducer, group, k=k, wire=config.wire, backend=backend,
                     traffic=stats.traffic, state=slot.oktopk)
    stats.selected = outcome.msg.count
    stats.exchange_seconds = perf_counter() - start - stats.select_seconds
    if outcome.nonfinite:  # 5. every rank goes dense
        stats.path, stats.k, stats.selected = "nonfinite", numel, numel
        if finite and residual is not None:  # its whole sum is in tensor: nothing stays behind
            memory.forget("residual")
            slot.bound = None
            if scaling is not None:
                scaling.taken[index] = (None, residual)
        return _allreduce(tensor, slot, group, size, queue)
    slot.plan.costs.observe_sparse(numel, k, stats.select_seconds, stats.exchange_seconds)

    # 4. Keep.
    if residual is not None and scaling is not None:
        scaling.taken[index] = outcome.taken()
    if velocity is not None and iteration >= correction.masking_start_iter:
        mask(velocity, outcome.msg.indices, outcome.msg.count, outcome.applied)
    return _done(tensor)


def _reduce_hierarchical(tensor: torch.Tensor, slot: Slot, memory: Memory, config: SparseConfig, compressor, k: int,
                         index: int, iteration: int, group: dist.ProcessGroup, parts: Optional[list[int]],
                         scaling: Optional[LossScaling], queue) -> torch.futures.Future:
    """Steps 3-5 with ``config.hierarchical``: the collective selects, from this rank's shard of its node's sum,
    and raises the non-finite flag inside its payloads."""
    stats, start = slot.stats, perf_counter()
    residual = memory.get("residual") if config.error_feedback else None
    maxima = part_maxima(tensor, parts).tolist()
    held = hold_unused(residual, maxima, parts) if residual is not None else []
    rounding = Rounding()
    result = hierarchical_allreduce(tensor, residual, compressor, k, config.hierarchical.local_size, group,
                                    inner=config.collective, inner_state=slot.oktopk,
                                    step=iteration * STEPS_PER_ITER + index, traffic=stats.traffic,
                                    nonfinite_flag=FLAG_NONFINITE, wire=config.wire, rounding=rounding)
    for part, saved in held:  # kept out of this step: its parameter was unused here
        part.add_(saved)
    stats.selected, stats.exchange_seconds = result.msg.count, perf_counter() - start
    if result.average is None:  # a flag: every rank goes dense, nothing was changed
        stats.path, stats.k, stats.selected = "nonfinite", tensor.numel(), tensor.numel()
        if residual is not None and _accumulation_is_finite(tensor, residual, maxima, slot):
            tensor.add_(residual)
            memory.forget("residual")
            if scaling is not None:
                scaling.taken[index] = (None, residual)
        return _allreduce(tensor, slot, group, dist.get_world_size(group), queue)
    slot.plan.costs.observe_sparse(tensor.numel(), k, 0.0, stats.exchange_seconds)
    tensor.copy_(result.average)
    if residual is not None and scaling is not None:
        kept = Outcome(result.msg, result.applied, rounding.pairs(residual.dtype, residual.device))
        scaling.taken[index] = kept.taken()
    return _done(tensor)


def _reduce_rounded(path: str, tensor: torch.Tensor, slot: Slot, memory: Memory, config: SparseConfig, index: int,
                    group: dist.ProcessGroup, parts: Optional[list[int]],
                    scaling: Optional[LossScaling]) -> torch.futures.Future:
    """Step 5 on a rounded dense path (dense16, dense8): all of grad + residual is sent, the rounding stays in the
    residual. A part this rank did not use keeps its residual out, as on the sparse path."""
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


def _allreduce(tensor: torch.Tensor, slot: Slot, group: dist.ProcessGroup, size: int,
               queue) -> torch.futures.Future:
    """Step 5: ``tensor / P`` allreduced asynchronously; its time, less its wait behind the group's earlier
    allreduces, is the dense path's cost."""
    stats, plan = slot.stats, slot.plan

    def done(start: float, end: float) -> None:
        stats.exchange_seconds = end - start
        plan.costs.observe_dense(tensor.numel(), end - start if queue is None else own_seconds(queue, start, end))

    return _DENSE["dense"].reduce_dense(tensor, group, size, stats.traffic, on_done=done)


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
    if slot.bound is not None and slot.bound[0] is residual:
        if max(maxima) + float(slot.bound[1]) < torch.finfo(tensor.dtype).max:
            return True
    return is_finite(tensor + residual)


def plan_path(tensor: torch.Tensor, group: dist.ProcessGroup, plan: PathPlan, policy: PathPolicy, *,
              iteration: int, k: int | None, index: int, collective: Collective, wire: Wire, what: str,
              volatile: dict[str, int] | None = None, traffic: Traffic | None = None) -> str:
    """Step 1: the ranks check they share ``tensor``'s plan (size, dtype, k, wire, policy; the header crosses only
    when it changes) and take the same path: ``"sparse"``, ``"dense16"``, ``"dense8"`` or ``"dense"``. ``k``: None
    when the tensor may not compress this step (it goes dense). With ``auto`` the header carries each rank's
    measured costs (``plan.costs``), and the path follows from their mean, or from the policy's calibration."""
    numel, size = tensor.numel(), dist.get_world_size(group)
    compress = k is not None and numel >= max(policy.min_compress_numel, 1)
    auto = compress and policy.mode == "auto"
    if auto and iteration >= plan.until:
        plan.round += 1
    fields = {**message_fields(numel, tensor.dtype, compress, k if compress else numel, wire),
              "policy": policy.code, "round": plan.round if auto else 0}
    headers = agree(fields, group, tensor.device, what, traffic=traffic, agreement=plan.agreement,
                    volatile=volatile, reported=plan.costs.report())
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
                                      collective=collective, wire=wire), plan.agreed, iteration, k=k, numel=numel)
        plan.decided = fields
    plan.sparse_steps = plan.sparse_steps + 1 if plan.path == "sparse" else 0
    return plan.path


@dataclass
class Outcome:
    """What :func:`reduce` did on this rank: ``msg``, the slots it sent; ``applied``, the mask of those in the
    average (None: all); ``errors``, (indices, errors) of the wire's rounding, now in its residual; ``nonfinite``:
    a rank's sum was not finite, nothing was applied, every rank goes dense (this rank's tensor holds what to send)."""

    msg: SparseMessage
    applied: torch.Tensor | None
    errors: tuple[torch.Tensor, torch.Tensor]
    nonfinite: bool = False

    def taken(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) this step took out of the residual: the applied slots less the rounding kept."""
        values = self.msg.values if self.applied is None else self.msg.values * self.applied
        error_indices, errors = self.errors
        return torch.cat([self.msg.indices, error_indices]), torch.cat([values, -errors])


def reduce(tensor: torch.Tensor, residual: torch.Tensor | None, msg: SparseMessage | None, collective: Collective,
           group: dist.ProcessGroup, *, k: int, wire: Wire, backend: Backend | None, traffic: Traffic | None = None,
           state=None, out: torch.Tensor | None = None) -> Outcome:
    """The sparse exchange of ``tensor`` (flat) over ``group``, after the selection: ``msg`` is ``tensor +
    residual`` compressed to k slots, the rest left in ``residual``, or None from a rank whose sum is not finite (it
    raises a flag inside the payloads). ``out`` (default ``tensor``) becomes the average of what was applied; what
    was not goes back into the residual. After a flag nothing is applied and every rank goes dense: a finite rank
    with all of ``tensor + residual`` (now in its ``tensor`` and its residual), the others with their tensor."""
    size = dist.get_world_size(group)
    finite = msg is not None
    flags = torch.zeros(1, dtype=torch.int32, device=tensor.device)
    if not finite:
        flags[0] = FLAG_NONFINITE
        msg = padding_message(tensor, k)
    rounding = Rounding()
    reduced = collective.reduce(msg, group, wire=wire, traffic=traffic, flags=flags, rounding=rounding, state=state)
    if int(flags) & FLAG_NONFINITE:
        if finite and residual is not None:  # all of this rank's sum goes into the dense average
            ops.scatter_add_(residual, msg.indices, msg.values, backend=backend, check=False)
            tensor.copy_(residual)
        nothing = torch.zeros_like(msg.indices, dtype=torch.bool)
        return Outcome(msg, nothing, rounding.pairs(tensor.dtype, tensor.device), nonfinite=True)
    errors = (keep_unapplied(residual, msg, reduced.applied, rounding, backend) if residual is not None
              else rounding.pairs(tensor.dtype, tensor.device))
    reduced.average_into(tensor if out is None else out, size, backend)
    return Outcome(msg, reduced.applied, errors)

"""WAGMA-SGD: wait-avoiding group model averaging (Li et al., "Breaking (Global) Barriers in Parallel Stochastic
Optimization with Wait-Avoiding Group Averaging", TPDS 2021), on ``torch.distributed``.

Use it like ``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager``: every rank trains
its own replica (no DDP gradient allreduce) and calls ``averager.average_parameters(model.parameters())`` after
each ``optimizer.step()``.

What is reproduced from the paper:

- Group averaging: after each local step a rank averages its weights with a group of ``group_size`` ranks only,
  and the groups change every step by a butterfly pattern (:func:`butterfly_groups`), so a rank's update reaches
  every rank within about ``log_group_size(P)`` steps (exactly, with exact averages, when P is a power of the
  group size; within ``ceil(log_S P) + 1`` steps for the other world sizes the tests enumerate).
- A global average every ``global_period`` steps (and at every warm-up step) bounds how far replicas drift.
- One flattened buffer per step and dtype: one collective per step, not one per tensor. Each rank divides its
  weights by the group's size before the allreduce sums them (as torch's averagers do): float16 weights of
  30000 on 4 ranks would sum to inf.
- Wait avoidance, in the form that Gloo and NCCL allow: with ``wait_avoiding=True`` the group allreduce of step t
  runs asynchronously on a snapshot s_t of the weights while step t+1 computes, and its group mean a_t is
  applied at step t+1 as ``x <- x + (a_t - s_t)`` (bounded staleness of one step). This is "the group average of
  the snapshot plus the local progress ``x - s_t`` made since the snapshot". It is chosen because over each
  group ``sum(a_t - s_t) = 0``: the sum of the weights over all ranks is exactly what it would be without
  averaging, so no rank's progress is lost or counted twice (a blend such as ``(x + a_t) / 2`` drops half of
  it), and with no local progress it equals the synchronous group average, one step later.

What is not reproduced: in the paper's MPI code the group allreduce is triggered by the first rank of the group
to arrive and uses the weights that slower ranks last published, without their participation, so a straggler
delays nobody. Gloo and NCCL collectives start only when every member calls them, so here every member takes
part in every group allreduce: a rank that is more than one step ahead of a slow group member waits for it (at
its next ``average_parameters``), and the slowness spreads through the rotating groups, so in the long run all
ranks advance at the straggler's pace. What the wait-avoiding mode hides is the communication time (and short,
random delays), not a persistent straggler. The global average is synchronous, as in the paper.

Requirements: constructing the averager is collective over the default process group, like ``dist.new_group``:
every rank of the default group constructs it (with the same arguments, in the same order relative to other
group creations), also ranks outside ``process_group``, for which ``average_parameters`` does nothing. The
parameters given to ``average_parameters`` must have the same shapes, dtypes and order on every rank, and the
same on every call; it averages all of them, also those without a gradient this step (filtering by gradient, as
torch's averagers do, would give ranks different buffer layouts).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GroupModelAverager", "butterfly_groups", "group_schedule_length"]


def _check_group_size(world_size: int, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if group_size < 1 or world_size % group_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"group_size must divide the process group's size {world_size} (one of {divisors}), "
                         f"got {group_size}")


def _butterfly_shape(world_size: int, group_size: int) -> tuple[int, int, int]:
    """``(levels, block, rest)``: world_size = block * rest with block = group_size**levels the largest such
    power, and ``rest`` not divisible by group_size."""
    levels, block = 0, 1
    while world_size % (block * group_size) == 0:
        levels, block = levels + 1, block * group_size
    return levels, block, world_size // block


def _diagonal_levels(group_size: int, rest: int) -> int:
    """Diagonal levels needed to spread an update over ``rest`` blocks: the smallest K with group_size**K >= rest."""
    count = 0
    while rest > 1 and group_size**count < rest:
        count += 1
    return count


def group_schedule_length(world_size: int, group_size: int) -> int:
    """How many group rounds the butterfly schedule has before it repeats (1 when group_size is 1 or world_size)."""
    _check_group_size(world_size, group_size)
    if group_size in (1, world_size):
        return 1
    levels, _, rest = _butterfly_shape(world_size, group_size)
    return levels + _diagonal_levels(group_size, rest)


def butterfly_groups(world_size: int, group_size: int, round_index: int) -> list[list[int]]:
    """The partition of ranks ``0 .. world_size-1`` into groups of ``group_size`` used by group round
    ``round_index``; consecutive rounds use different partitions (unless group_size is 1 or world_size).

    Write world_size = S**L * r with S = group_size and r not divisible by S, and a rank as the digits
    ``x = d_0 + S*d_1 + ... + S**(L-1)*d_(L-1) + S**L * d_L`` (d_L < r). Round levels 0 .. L-1 are the butterfly
    of the paper: the group of x varies digit d_level (partner stride S**level). When r > 1, K more "diagonal"
    levels (S**K >= r) merge the r blocks: level L+k groups ``{(d_0 = i, d_L = c + i * S**k mod r)}`` for
    i < S, with the middle digits fixed, so the block offsets an update reaches grow like S**k. The schedule
    cycles through the levels.
    """
    if isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0:
        raise ValueError(f"round_index must be a non-negative int, got {round_index!r}")
    length = group_schedule_length(world_size, group_size)
    if group_size in (1, world_size):
        return [list(range(start, start + group_size)) for start in range(0, world_size, group_size)]
    levels, block, rest = _butterfly_shape(world_size, group_size)
    level = round_index % length
    if level < levels:
        stride = group_size**level
        return [[base + i * stride for i in range(group_size)]
                for base in range(world_size) if (base // stride) % group_size == 0]
    slope = group_size ** (level - levels)
    groups = []
    for middle in range(0, block, group_size):  # d_0 = 0, middle digits fixed
        for offset in range(rest):
            groups.append([i + middle + block * ((offset + i * slope) % rest) for i in range(group_size)])
    return groups


class _Bucket:
    """The parameters of one (device, dtype), with the flat buffers their collective works on."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.kind = (params[0].device, params[0].dtype)
        self.params = params
        self.numels = [p.numel() for p in params]
        total = sum(self.numels)
        self.snapshot = params[0].new_empty(total)  # the weights sent (wait-avoiding: s_t)
        self.reduced = params[0].new_empty(total)   # the buffer the allreduce sums in place

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [chunk.view_as(p) for chunk, p in zip(flat.split(self.numels), self.params)]

    def flatten_into(self, flat: torch.Tensor) -> torch.Tensor:
        torch.cat([p.detach().reshape(-1) for p in self.params], out=flat)
        return flat


class GroupModelAverager:
    """Group model averaging with rotating butterfly groups, a periodic global average and (by default)
    one-step-stale asynchronous group averages; see the module docstring for what is and is not the paper's.

    Args:
        group_size: ranks per group; must divide the size of ``process_group`` (1: no group averaging, only the
            global averages; the size itself: every step averages globally).
        global_period: every ``global_period``-th step after warm-up averages over the whole process group
            (1: every step).
        warmup_steps: the first ``warmup_steps`` steps average globally.
        process_group: the ranks that average (default: the whole default group).
        wait_avoiding: True: the group allreduce of step t runs asynchronously and is applied at step t+1;
            False: synchronous group averages.

    ``step`` counts the calls of :meth:`average_parameters`; :meth:`state_dict` / :meth:`load_state_dict` save
    and restore it. Call :meth:`finish` before evaluating or checkpointing the weights in wait-avoiding mode.
    """

    def __init__(self, group_size: int, global_period: int, warmup_steps: int = 0,
                 process_group: dist.ProcessGroup | None = None, wait_avoiding: bool = True) -> None:
        if isinstance(global_period, bool) or not isinstance(global_period, int) or global_period < 1:
            raise ValueError(f"global_period must be a positive int, got {global_period!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
        if not dist.is_initialized():
            raise RuntimeError("GroupModelAverager needs torch.distributed to be initialized "
                               "(dist.init_process_group) first")
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        member_ranks = self._member_global_ranks(process_group)
        _check_group_size(len(member_ranks), group_size)
        self.group_size = group_size
        self.global_period = global_period
        self.warmup_steps = warmup_steps
        self.wait_avoiding = wait_avoiding
        self.world_size = len(member_ranks)
        self.step = 0
        self._rank = member_ranks.index(dist.get_rank()) if dist.get_rank() in member_ranks else None
        self._round_groups = self._create_round_groups(member_ranks)
        self._buckets: list[_Bucket] | None = None
        self._layout: list[tuple] | None = None
        self._pending: list[dist.Work] | None = None  # the in-flight group allreduce (wait-avoiding mode)

    @staticmethod
    def _member_global_ranks(process_group: dist.ProcessGroup | None) -> list[int]:
        """The global ranks of process_group in group-rank order, known on every rank (also non-members, which
        must create the same subgroups)."""
        if process_group is None or process_group is dist.group.WORLD:
            return list(range(dist.get_world_size()))
        rank_in_group = dist.get_rank(process_group)  # -1 outside the group
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rank_in_group)
        members = sorted((group_rank, global_rank) for global_rank, group_rank in enumerate(everyone)
                         if group_rank >= 0)
        return [global_rank for _, global_rank in members]

    def _create_round_groups(self, member_ranks: list[int]) -> list[dist.ProcessGroup | None]:
        """For each level of the schedule: this rank's subgroup (None: a group of one). Every rank creates every
        subgroup, in the same order (dist.new_group's rule); a rank set used by several levels is created once."""
        created: dict[tuple[int, ...], Any] = {}
        mine = []
        for level in range(group_schedule_length(self.world_size, self.group_size)):
            my_group = None
            for local_ranks in butterfly_groups(self.world_size, self.group_size, level):
                key = tuple(sorted(local_ranks))
                if key not in created:
                    if len(key) == 1:
                        created[key] = None  # a group of one averages nothing
                    elif len(key) == self.world_size:
                        created[key] = self.process_group
                    else:
                        created[key] = dist.new_group([member_ranks[r] for r in key])
                if self._rank in key:
                    my_group = created[key]
            mine.append(my_group)
        return mine

    def is_global_step(self, step: int) -> bool:
        """Whether ``step`` averages over the whole process group (warm-up, or every global_period-th step)."""
        return step < self.warmup_steps or (step - self.warmup_steps + 1) % self.global_period == 0

    def group_round(self, step: int) -> int:
        """The group round of a non-global ``step``: how many group steps came before it."""
        after_warmup = step - self.warmup_steps
        return after_warmup - after_warmup // self.global_period

    @torch.no_grad()
    def average_parameters(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]) -> None:
        """Averages the parameters (a model's ``parameters()`` or an optimizer's ``param_groups``) for this step,
        then advances ``step``. Call it on every rank of the process group after every ``optimizer.step()``."""
        step = self.step
        self.step += 1
        if self._rank is None:
            return
        buckets = self._prepare(params)
        self._apply_pending(buckets)
        if self.is_global_step(step):
            self._average_now(buckets, self.process_group, self.world_size)
            return
        group = self._round_groups[self.group_round(step) % len(self._round_groups)]
        if group is None:
            return
        if not self.wait_avoiding:
            self._average_now(buckets, group, self.group_size)
            return
        works = []
        for bucket in buckets:
            bucket.flatten_into(bucket.snapshot)
            torch.div(bucket.snapshot, self.group_size, out=bucket.reduced)
            works.append(dist.all_reduce(bucket.reduced, group=group, async_op=True))
        self._pending = works

    @torch.no_grad()
    def finish(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]) -> None:
        """Waits for the in-flight group average (wait-avoiding mode) and applies it now, so the weights are
        complete before evaluation or a checkpoint. Does not advance ``step``; a no-op when nothing is in flight."""
        if self._pending is not None:
            self._apply_pending(self._prepare(params))

    def state_dict(self) -> dict[str, Any]:
        """The averager's position: ``{"step": int}`` plus its configuration, for checking on resume. A group
        average still in flight is not part of it: call :meth:`finish` before saving the model."""
        return {"step": self.step, "group_size": self.group_size, "global_period": self.global_period,
                "warmup_steps": self.warmup_steps, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``step``; the saved group size and world size must match this averager's."""
        for key in ("group_size", "world_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"state_dict was saved with {key}={state[key]}, this averager has "
                                 f"{key}={getattr(self, key)}")
        if self._pending is not None:
            raise RuntimeError("load_state_dict while a group average is in flight: call finish(params) first")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"state_dict['step'] must be a non-negative int, got {step!r}")
        self.step = step

    def _average_now(self, buckets: list[_Bucket], group: dist.ProcessGroup, size: int) -> None:
        for bucket in buckets:
            flat = bucket.flatten_into(bucket.reduced).div_(size)
            dist.all_reduce(flat, group=group)
            torch._foreach_copy_(bucket.params, bucket.views(flat))

    def _apply_pending(self, buckets: list[_Bucket]) -> None:
        """x <- x + (group mean of the snapshots - own snapshot): see the module docstring for why."""
        if self._pending is None:
            return
        for work in self._pending:
            work.wait()
        self._pending = None
        for bucket in buckets:
            correction = bucket.reduced.sub_(bucket.snapshot)
            torch._foreach_add_(bucket.params, bucket.views(correction))

    def _prepare(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]) -> list[_Bucket]:
        """Checks the parameters and returns their buckets, created on the first call and the same on every call;
        the first call also checks that every rank has the same layout (one small collective)."""
        tensors = _parameter_list(params)
        layout = [(tuple(t.shape), t.dtype, t.device) for t in tensors]
        if self._buckets is None:
            self._check_same_layout_on_all_ranks(layout)
            by_kind: dict[tuple, list[torch.Tensor]] = {}
            for t in tensors:
                by_kind.setdefault((t.device, t.dtype), []).append(t)
            self._buckets, self._layout = [_Bucket(group) for group in by_kind.values()], layout
        elif layout != self._layout:
            raise ValueError("average_parameters got different parameters (shapes, dtypes or devices) than on its "
                             "first call; every call must pass the same parameters")
        for bucket in self._buckets:  # the same layout, maybe new tensor objects (e.g. a reloaded model)
            bucket.params = [t for t in tensors if (t.device, t.dtype) == bucket.kind]
        return self._buckets

    def _check_same_layout_on_all_ranks(self, layout: list[tuple]) -> None:
        signature = repr([(shape, str(dtype)) for shape, dtype, _ in layout])
        device = layout[0][2] if dist.get_backend(self.process_group) == "nccl" else torch.device("cpu")
        mine = torch.tensor([len(layout), sum(math.prod(s) for s, _, _ in layout), zlib.crc32(signature.encode())],
                            dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self.process_group)
        if any(not torch.equal(other, mine) for other in everyone):
            summary = [(int(t[0]), int(t[1])) for t in everyone]
            raise ValueError("average_parameters needs the same parameters (shapes, dtypes, order) on every rank; "
                             f"(tensor count, element count) per rank: {summary}")


def _parameter_list(params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]) -> list[torch.Tensor]:
    """The tensors of a model's parameters or an optimizer's param_groups, checked to be floating point."""
    tensors: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            tensors.extend(item["params"])
        elif isinstance(item, torch.Tensor):
            tensors.append(item)
        else:
            raise TypeError(f"params must hold tensors or param_group dicts, got {type(item).__name__}")
    if not tensors:
        raise ValueError("params is empty: pass model.parameters() or optimizer.param_groups")
    for index, t in enumerate(tensors):
        if not t.is_floating_point():
            raise TypeError(f"params[{index}] has dtype {t.dtype}; only floating-point parameters can be averaged")
    return tensors

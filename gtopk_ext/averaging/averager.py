"""GroupModelAverager: group model averaging with rotating butterfly groups (see :mod:`gtopk_ext.averaging`)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from gtopk_ext._validate import check_int
from gtopk_ext.averaging._wait_avoiding import _WaitAvoidingRounds
from gtopk_ext.averaging.butterfly import _check_group_size, butterfly_groups, group_schedule_length
from gtopk_ext.collectives import agree

__all__ = ["GroupModelAverager"]


class _Bucket:
    """The parameters of one (device, dtype), with the flat buffers their exchanges work on."""

    def __init__(self, params: list[torch.Tensor], wait_avoiding: bool) -> None:
        self.kind = (params[0].device, params[0].dtype)
        self.params = params
        self.numels = [p.numel() for p in params]
        total = sum(self.numels)
        self.reduced = params[0].new_empty(total)  # the buffer an allreduce sums in place
        if wait_avoiding:  # see _WaitAvoidingRounds
            self.published = params[0].new_empty(total)
            self.staging = params[0].new_empty(total)
            self.correction = params[0].new_zeros(total)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [chunk.view_as(p) for chunk, p in zip(flat.split(self.numels), self.params)]

    def flatten_into(self, flat: torch.Tensor) -> torch.Tensor:
        torch.cat([p.detach().reshape(-1) for p in self.params], out=flat)
        return flat


class GroupModelAverager:
    """Group model averaging with rotating butterfly groups, a periodic global average and (by default) wait
    avoidance (see :mod:`gtopk_ext.averaging`).

    Args:
        group_size: ranks per group; must divide the size of ``process_group`` (1: no group averaging, only the
            global averages; the size itself: every step averages over everyone).
        global_period: every ``global_period``-th step after warm-up averages over the whole process group,
            synchronously (1: every step).
        warmup_steps: the first ``warmup_steps`` steps average globally.
        process_group: the ranks that average (default: the whole default group).
        wait_avoiding: True: group averages run on a communication thread with the weights each rank last
            published, and no rank waits for them; False: synchronous group averages.
        timeout: seconds a wait-avoiding call may wait for the other ranks before it raises TimeoutError and
            stops the averaging on every rank.

    ``step`` counts the calls of :meth:`average_parameters`.
    """

    def __init__(self, group_size: int, global_period: int, warmup_steps: int = 0,
                 process_group: dist.ProcessGroup | None = None, wait_avoiding: bool = True,
                 timeout: float = 1800.0) -> None:
        check_int("global_period", global_period, 1)
        check_int("warmup_steps", warmup_steps)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
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
        # Wait-avoiding mode: the communication thread alone uses groups of its own (collectives on one group
        # from two threads could pair up differently on different ranks).
        everyone = dist.new_group(member_ranks) if wait_avoiding else self.process_group
        self._round_groups = self._create_round_groups(member_ranks, everyone)
        self._buckets: list[_Bucket] | None = None
        self._layout: list[tuple] | None = None
        self._loaded_correction: list[torch.Tensor] | None = None
        self._rounds = None
        if wait_avoiding:
            control = dist.new_group(member_ranks, backend="gloo")  # collective: created on every rank
            if self._rank is not None:
                self._rounds = _WaitAvoidingRounds(self, member_ranks, self._rank, self._round_groups, everyone,
                                                   control, float(timeout))

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

    def _create_round_groups(self, member_ranks: list[int], everyone: dist.ProcessGroup
                             ) -> list[tuple[dist.ProcessGroup | None, list[int]]]:
        """For each level of the schedule: this rank's subgroup (None: a group of one) and its other members
        (indices into member_ranks). Every rank creates every subgroup, in the same order (dist.new_group's rule);
        a rank set used by several levels is created once."""
        created: dict[tuple[int, ...], Any] = {}
        mine = []
        for level in range(group_schedule_length(self.world_size, self.group_size)):
            my_group, partners = None, []
            for local_ranks in butterfly_groups(self.world_size, self.group_size, level):
                key = tuple(sorted(local_ranks))
                if key not in created:
                    if len(key) == 1:
                        created[key] = None  # a group of one averages nothing
                    elif len(key) == self.world_size:
                        created[key] = everyone
                    else:
                        created[key] = dist.new_group([member_ranks[r] for r in key])
                if self._rank in key:
                    my_group, partners = created[key], [r for r in key if r != self._rank]
            mine.append((my_group, partners))
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
        then advances ``step``; on every rank of the process group after every ``optimizer.step()``. Wait-avoiding
        mode: returns without waiting, except at a global step."""
        step = self.step
        if self._rank is None:
            self.step += 1
            return
        buckets = self._prepare(params)
        if self._rounds is not None:
            self._rounds.publish(step)
            if self.is_global_step(step):
                self._rounds.take_global_average(step)
        elif self.is_global_step(step):
            self._average_now(buckets, self.process_group, self.world_size)
        else:
            group, _ = self._round_groups[self.group_round(step) % len(self._round_groups)]
            if group is not None:
                self._average_now(buckets, group, self.group_size)
        self.step += 1

    @torch.no_grad()
    def finish(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]) -> None:
        """Collective in wait-avoiding mode: completes every group round up to this step and applies their averages;
        raises on every rank if the ranks are at different steps. Synchronous mode: a no-op."""
        if self._rounds is not None:
            self._prepare(params)
            self._rounds.end_run(self.step, apply=True)

    def state_dict(self) -> dict[str, Any]:
        """``{"step": int}`` plus the configuration. Wait-avoiding mode: collective like :meth:`finish`, and it saves
        the averages the weights do not hold yet (``"correction"``, applied by the next call after
        :meth:`load_state_dict`)."""
        state = {"step": self.step, "group_size": self.group_size, "global_period": self.global_period,
                 "warmup_steps": self.warmup_steps, "world_size": self.world_size}
        if self._rounds is not None:
            self._rounds.end_run(self.step, apply=False)
            if self._buckets is not None:
                state["correction"] = [bucket.correction.clone() for bucket in self._buckets]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``step`` (and, wait-avoiding, the saved corrections); the saved group size and world size must
        match this averager's."""
        for key in ("group_size", "world_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"state_dict was saved with {key}={state[key]}, this averager has "
                                 f"{key}={getattr(self, key)}")
        if self._rounds is not None and self._rounds.in_run:
            raise RuntimeError("load_state_dict while group rounds are in flight: call finish(params) first")
        step = check_int("state_dict['step']", state["step"])
        correction = state.get("correction")
        if correction is not None and (not isinstance(correction, (list, tuple))
                                       or not all(isinstance(t, torch.Tensor) for t in correction)):
            raise ValueError("state_dict['correction'] must be a list of tensors, as state_dict() saves it")
        self.step = step
        self._loaded_correction = list(correction) if correction is not None and self._rounds is not None else None
        if self._buckets is not None:
            self._restore_correction()

    def _average_now(self, buckets: list[_Bucket], group: dist.ProcessGroup, size: int) -> None:
        for bucket in buckets:
            flat = bucket.flatten_into(bucket.reduced).div_(size)  # divide first: float16 sums would overflow
            dist.all_reduce(flat, group=group)
            torch._foreach_copy_(bucket.params, bucket.views(flat))

    def _restore_correction(self) -> None:
        saved, self._loaded_correction = self._loaded_correction, None
        if saved is None:
            return
        if [(t.numel(), t.dtype) for t in saved] != [(b.correction.numel(), b.correction.dtype) for b in self._buckets]:
            raise ValueError("state_dict['correction'] does not fit these parameters (element counts and dtypes "
                             "per (device, dtype) bucket differ)")
        for tensor, bucket in zip(saved, self._buckets):
            bucket.correction.copy_(tensor.reshape(-1))

    def _prepare(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]) -> list[_Bucket]:
        """The parameters' buckets, created (and checked against every rank's, collectively) on the first call.
        Wait-avoiding mode: an error stops the averaging on every rank."""
        try:
            return self._buckets_for(params)
        except Exception as exc:
            if self._rounds is not None:
                self._rounds.stop(exc)
            raise

    def _buckets_for(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]) -> list[_Bucket]:
        if self._rounds is not None and self._rounds.stopped_here:
            self._rounds.check_failure()
        tensors = _parameter_list(params)
        layout = [(tuple(t.shape), t.dtype, t.device) for t in tensors]
        if self._buckets is not None and layout != self._layout:
            raise ValueError("average_parameters got different parameters (shapes, dtypes or devices) than on its "
                             "first call; every call must pass the same parameters")
        # Another rank's failure after the local checks: this rank's own bad input is what it reports, whichever
        # rank raised first.
        if self._rounds is not None:
            self._rounds.check_failure()
        if self._buckets is None:
            self._check_same_layout_on_all_ranks(layout)
            by_kind: dict[tuple, list[torch.Tensor]] = {}
            for t in tensors:
                by_kind.setdefault((t.device, t.dtype), []).append(t)
            self._buckets = [_Bucket(group, self.wait_avoiding) for group in by_kind.values()]
            self._layout = layout
            self._restore_correction()
            if self._rounds is not None:
                self._rounds.buckets = self._buckets
        for bucket in self._buckets:  # the same layout, maybe new tensor objects (e.g. a reloaded model)
            bucket.params = [t for t in tensors if (t.device, t.dtype) == bucket.kind]
        return self._buckets

    def _check_same_layout_on_all_ranks(self, layout: list[tuple]) -> None:
        signature = repr([(shape, str(dtype)) for shape, dtype, _ in layout])
        device = layout[0][2] if dist.get_backend(self.process_group) == "nccl" else torch.device("cpu")
        agree({"tensors": len(layout), "numel": sum(math.prod(s) for s, _, _ in layout),
               "signature": zlib.crc32(signature.encode())}, self.process_group, device,
              "average_parameters needs the same parameters (shapes, dtypes, order) on every rank")


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

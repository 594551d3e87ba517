"""WAGMA-SGD: wait-avoiding group model averaging (Li et al., "Breaking (Global) Barriers in Parallel Stochastic
Optimization with Wait-Avoiding Group Averaging", TPDS 2021), on ``torch.distributed``.

Use it like ``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager``: every rank trains
its own replica (no DDP gradient allreduce) and calls ``averager.average_parameters(model.parameters())`` after
each ``optimizer.step()``, and every rank calls ``averager.finish(model.parameters())`` at the end (and before
evaluating the averaged model).

- Group averaging: after each local step a rank averages its weights with a group of ``group_size`` ranks only,
  and the groups change every step by a butterfly pattern (:func:`butterfly_groups`), so a rank's update reaches
  every rank within about ``log_group_size(P)`` steps (exactly, with exact averages, when P is a power of the
  group size; within ``ceil(log_S P) + 1`` steps for the other world sizes the tests enumerate).
- A global average every ``global_period`` steps (and at every warm-up step) bounds how far replicas drift; it is
  synchronous, as in the paper.
- One flattened buffer per step and dtype. Each rank divides its weights by the group's size before the allreduce
  sums them (as torch's averagers do): float16 weights of 30000 on 4 ranks would sum to inf.

Wait avoidance (``wait_avoiding=True``), as in the paper: a straggler delays nobody between global averages.
Gloo and NCCL collectives start only when every member calls them, so each rank has a communication thread that
takes part in every group allreduce on the rank's behalf, with the rank's *published* weights p:

- ``average_parameters`` at step t applies the corrections that arrived since its last call, publishes the
  weights (a copy) and returns at once: the training loop never waits for a group round.
- Group round t is activated by the first member of its group whose training loop reaches step t: that member's
  thread tells the others' threads (a small message), and every member's thread then joins the allreduce with the
  weights its rank last published, also when that rank is still computing an earlier step.
- A round turns p into the group mean a; the thread keeps p <- a and adds the correction ``a - p`` to what the
  rank applies at its next call. Over each group these corrections sum to zero, so the sum of the weights over
  all ranks is exactly what the updates put in: no rank's progress is lost or counted twice. A rank that is
  behind is represented by its last weights with every later group average applied (what its replica would be),
  and its own progress is added on top when it arrives.
- The global average of step t waits for every rank (the threads run it once every rank reached step t);
  staleness is therefore bounded by ``global_period``.

Why threads and messages: the paper's MPI code starts the group allreduce on the first arrival inside the
library; with Gloo and NCCL only a participant that is always ready (the thread) can stand in for a busy rank. The
activation and end-of-run messages go over a Gloo group of their own (small CPU tensors), so the data
allreduces may use any backend: NCCL's communicators are then used by one thread per rank, in the same round
order on every member, and a member enters an allreduce only after every member of its group has committed to
it, so an error never strands a rank inside a collective. The thread's buffers cost four copies of the
parameters.

``finish(params)`` is collective: every rank's thread completes the rounds up to the rank's current step, the
ranks check that they all stopped at the same step (a clear error otherwise), and each rank applies its last
corrections; it returns once every rank has called it. ``state_dict()`` does the same wait (it is collective in
wait-avoiding mode) and saves the corrections not yet applied, so a checkpoint of (weights, state_dict) loses
nothing. An error on one rank (bad parameters, a failed collective, a timeout) is sent to every rank: each
raises it from its next call of the averager.

Requirements: constructing the averager is collective over the default process group, like ``dist.new_group``:
every rank of the default group constructs it (with the same arguments, in the same order relative to other
group creations), also ranks outside ``process_group``, for which ``average_parameters`` does nothing. The
parameters given to ``average_parameters`` must have the same shapes, dtypes and order on every rank, and the
same on every call; it averages all of them, also those without a gradient this step (filtering by gradient, as
torch's averagers do, would give ranks different buffer layouts). In wait-avoiding mode, call ``finish`` before
``destroy_process_group``.
"""

from __future__ import annotations

import math
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterable
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


# Control messages between the ranks' threads: int64 [kind, sender (index among the members), value].
_ACTIVATE = 1  # value: a round the sender joins; sent to that round's other members
_FINISH = 2    # value: the step at which the sender's run of rounds ends (finish / state_dict); sent to all
_ABORT = 3     # value: the global rank where the error happened; the sender stopped; sent to all


class _Stop(Exception):
    """Raised inside the communication thread to end the run of rounds after an error."""


class _WaitAvoidingRounds:
    """One rank's side of wait-avoiding group averaging: the communication thread that runs every round (group
    and global) for the rank, the thread that receives the control messages, and what they share with the training
    loop, under one lock (``_cond``).

    Per bucket: ``published`` p (the weights the thread exchanges for the rank), ``staging`` (a new snapshot from
    the training loop on its way to the thread, or a global average on its way back), ``correction`` (the sum of
    ``a - p`` of the rounds the training loop has not applied yet) and ``reduced`` (the allreduce's buffer).
    Invariant: weights + correction = p + the progress the training loop made since it last published.

    A run of rounds starts at the first call after construction or after a finish and ends at finish or
    state_dict (both collective); the threads exist only during a run.
    """

    def __init__(self, schedule: GroupModelAverager, member_ranks: list[int], rank: int,
                 round_groups: list[tuple[dist.ProcessGroup | None, list[int]]],
                 global_group: dist.ProcessGroup, control: dist.ProcessGroup, timeout: float) -> None:
        self._schedule = schedule
        self._member_ranks = member_ranks
        self._rank = rank
        self._everyone = [i for i in range(len(member_ranks)) if i != rank]
        self._round_groups = round_groups
        self._global_group = global_group
        self._control = control  # a Gloo group for the control messages, whatever backend the data uses
        self._timeout = timeout
        self.buckets: list[_Bucket] | None = None
        self._cond = threading.Condition()
        # written by the training loop
        self._arrived = 0                          # steps the training loop has published
        self._drain_at: int | None = None          # the step at which this run ends
        self._staged: str | None = None            # None, "snapshot" or "average": what staging holds
        self._stop_reason: BaseException | None = None  # an error of the training loop, for every rank
        # written by the threads
        self._done = 0                             # rounds completed
        self._running = False
        self._failure: BaseException | None = None
        self._activations: dict[int, set[int]] = {}  # round -> members whose thread joined it
        self._finishes: dict[int, deque[int]] = {j: deque() for j in self._everyone}
        self._aborted: dict[int, int] = {}  # member -> the global rank where the error happened
        self._receive_error: BaseException | None = None
        # Sends not yet waited for: kept, since a Gloo send whose Work is freed in flight takes the process down.
        self._sends: list[dist.Work] = []

    # ----------------------------------------------------------------------------------------- training loop

    def publish(self, step: int) -> None:
        """Applies the corrections that arrived, publishes the weights for the rounds from ``step`` on, and lets the
        thread run round ``step`` (it activates the group's round unless a faster member did already)."""
        with self._cond:
            self._start_run(step)
            for bucket in self.buckets:
                self._apply_correction(bucket)
                bucket.flatten_into(bucket.staging)
            self._staged = "snapshot"
            self._arrived = step + 1
            self._cond.notify_all()

    def take_global_average(self, step: int) -> None:
        """Waits for the global round of ``step`` (every rank's weights) and sets the weights to its average."""
        with self._cond:
            self._wait_in_training_loop(lambda: self._done > step, f"the global average of step {step}")
            for bucket in self.buckets:
                torch._foreach_copy_(bucket.params, bucket.views(bucket.staging))
            self._staged = None

    def end_run(self, step: int, apply: bool) -> None:
        """finish / state_dict: completes this rank's rounds before ``step`` and checks, with every rank, that all
        stopped at the same step; ``apply`` then applies the corrections (else they stay for state_dict)."""
        with self._cond:
            self._start_run(step)
            self._drain_at = step
            self._cond.notify_all()
            self._wait_in_training_loop(lambda: not self._running, f"finishing at step {step}")
            self._drain_at = None
            if apply and self.buckets is not None:
                for bucket in self.buckets:
                    self._apply_correction(bucket)

    def stop(self, reason: BaseException) -> None:
        """An error in the training loop: every rank's thread stops and the error reaches every rank."""
        with self._cond:
            if self._failure is not None or self._stop_reason is not None:
                return
            self._start_run(self._done)
            self._stop_reason = reason
            self._cond.notify_all()

    def check_failure(self) -> None:
        with self._cond:
            self._raise_failure()

    @property
    def stopped_here(self) -> bool:
        """Whether this rank's training loop stopped the averaging (its own error)."""
        return self._stop_reason is not None

    @property
    def in_run(self) -> bool:
        return self._running

    def _apply_correction(self, bucket: _Bucket) -> None:
        torch._foreach_add_(bucket.params, bucket.views(bucket.correction))
        bucket.correction.zero_()

    def _raise_failure(self) -> None:
        failure = self._failure if self._failure is not None else self._stop_reason
        if failure is not None:
            raise RuntimeError(f"wait-avoiding group averaging stopped on rank {dist.get_rank()}: "
                               f"{failure}") from failure

    def _wait_in_training_loop(self, ready: Callable[[], bool], what: str) -> None:
        self._raise_failure()
        if not self._cond.wait_for(lambda: ready() or self._failure is not None, timeout=self._timeout):
            self._stop_reason = TimeoutError(f"{what} took more than timeout={self._timeout} s")
            self._cond.notify_all()
            raise self._stop_reason
        self._raise_failure()

    def _start_run(self, step: int) -> None:
        """Starts the threads if no run is going on (the lock is held); the run's rounds start at ``step``."""
        self._raise_failure()
        if self._running:
            return
        self._running, self._done, self._arrived = True, step, step
        threading.Thread(target=self._communicate, name="gtopk_ext-wagma", daemon=True).start()
        if self._everyone:
            threading.Thread(target=self._receive, name="gtopk_ext-wagma-receive", daemon=True).start()

    # ------------------------------------------------------------------------------------- the threads

    def _receive(self) -> None:
        """Receives control messages until every other member's _FINISH of this run is in: a member sends nothing
        after it in a run, and a member's messages arrive in the order sent. (After an _ABORT it receives until the
        process group is destroyed: it is a daemon thread.)"""
        box = torch.empty(3, dtype=torch.int64)
        try:
            with self._cond:
                if all(self._finishes[j] for j in self._everyone):  # received by the previous run's receiver
                    return
            while True:
                dist.irecv(box, src=None, group=self._control).wait()
                kind, sender, value = box.tolist()
                with self._cond:
                    if kind == _ACTIVATE:
                        self._activations.setdefault(value, set()).add(sender)
                    elif kind == _FINISH:
                        self._finishes[sender].append(value)
                    else:
                        self._aborted[sender] = value
                    self._cond.notify_all()
                    if kind == _FINISH and all(self._finishes[j] for j in self._everyone):
                        return
        except Exception as exc:  # a peer's connection closed: the rounds waiting on messages stop
            with self._cond:
                self._receive_error = exc
                self._cond.notify_all()

    def _send(self, kind: int, value: int, to: list[int]) -> None:
        message = torch.tensor([kind, self._rank, value], dtype=torch.int64)
        self._sends += [dist.isend(message, dst=self._member_ranks[j], group=self._control) for j in to]

    def _wait_for_sends(self) -> None:
        """Waits for the messages sent so far; only where every receiver is known to take them."""
        for work in self._sends:
            work.wait()
        self._sends = []

    def _communicate(self) -> None:
        try:
            while self._run_round(self._done):
                pass
            self._finish_run()
        except BaseException as exc:  # noqa: BLE001 -- every error must reach the training loop and every rank
            with self._cond:
                self._failure = exc.__cause__ if isinstance(exc, _Stop) and exc.__cause__ else exc
                self._running = False
                self._cond.notify_all()
            # Every member learns it, also one waiting for this rank to join a round. Not waited for: a member that
            # stopped may never receive it.
            self._send(_ABORT, min(self._aborted.values(), default=dist.get_rank()), self._everyone)

    def _check_stopped(self, round_index: int, partners: list[int], committed: bool = False) -> None:
        """Raises _Stop when the run must end (the lock is held): an error here or on another rank, or ranks that
        stopped at different steps (a member that ended its run at or before a round that this rank's training
        loop passed, or that this rank's thread has joined)."""
        if self._stop_reason is not None:
            raise _Stop() from self._stop_reason
        if self._aborted:
            origin = min(self._aborted.values())
            raise _Stop() from RuntimeError(f"rank {origin} stopped wait-avoiding group averaging after an error "
                                            "(its own exception says which)")
        if self._receive_error is not None:
            raise _Stop() from RuntimeError(f"receiving the control messages failed: {self._receive_error}")
        ahead = committed or self._arrived > round_index
        early = {self._member_ranks[j]: self._finishes[j][0] for j in partners
                 if ahead and self._finishes[j] and self._finishes[j][0] <= round_index}
        if early or (self._drain_at is not None and self._drain_at < round_index):
            ended = f"ends its run at step {self._drain_at}" if not early else f"is at step {self._arrived}"
            raise _Stop() from RuntimeError(
                f"finish() or state_dict() was called at different steps: rank {dist.get_rank()} {ended} and has "
                f"joined round {round_index} of members ahead of it, while rank(s) ended their runs at steps {early}; "
                "every rank must call average_parameters equally often")

    def _wait(self, ready: Callable[[], bool], round_index: int, partners: list[int]) -> None:
        with self._cond:
            while True:
                self._check_stopped(round_index, partners)
                if ready():
                    return
                self._cond.wait()

    def _run_round(self, r: int) -> bool:
        """Runs round ``r`` (the lock is not held); False when the run ends before it."""
        synchronous = self._schedule.is_global_step(r)
        if synchronous:
            group, partners = self._global_group, self._everyone
        else:
            group, partners = self._round_groups[self._schedule.group_round(r) % len(self._round_groups)]

        def activated() -> bool:  # by this rank reaching step r, or (group rounds) by the first member to reach it
            return self._arrived > r or (not synchronous and bool(self._activations.get(r)))

        def ends_here() -> bool:  # finish / state_dict at step r (a member that activated r is then an error)
            return self._drain_at is not None and self._drain_at <= r

        self._wait(lambda: ends_here() or activated(), r, partners)
        with self._cond:
            if ends_here():
                return False
        self._send(_ACTIVATE, r, partners)
        # Committed: a member enters the allreduce exactly when every member of the group has joined the round, so
        # an error on one rank never leaves another inside a collective. A member that stopped without joining
        # says so (_ABORT or _FINISH), and a member's _ACTIVATE, when sent, arrives before its _ABORT.
        with self._cond:
            joined = self._activations.setdefault(r, set())
            self._cond.wait_for(lambda: all(j in joined or j in self._aborted or self._finishes[j] for j in partners)
                                or self._receive_error is not None)
            if not all(j in joined for j in partners):
                self._check_stopped(r, partners, committed=True)  # a member stopped or finished: raises
                raise _Stop() from RuntimeError(f"round {r}: a member ended its run without joining it")
            del self._activations[r]
            for bucket in self.buckets:
                if self._staged == "snapshot":
                    bucket.published.copy_(bucket.staging)
                torch.div(bucket.published, len(partners) + 1, out=bucket.reduced)  # divide first: no fp16 inf
            if self._staged == "snapshot":
                self._staged = None
        if partners:
            for work in [dist.all_reduce(b.reduced, group=group, async_op=True) for b in self.buckets]:
                work.wait()
        self._wait_for_sends()  # received already: every partner joined this round, after the earlier ones
        with self._cond:
            for bucket in self.buckets:
                if synchronous:  # the training loop sets its weights to the average; nothing left to correct
                    bucket.published.copy_(bucket.reduced)
                    bucket.staging.copy_(bucket.reduced)
                    bucket.correction.zero_()
                else:
                    change = bucket.reduced.sub_(bucket.published)  # a - p: sums to zero over the group
                    bucket.correction.add_(change)
                    bucket.published.add_(change)
                    if self._staged == "snapshot":  # published during the allreduce: it lacks this round too
                        bucket.staging.add_(change)
            if synchronous:
                self._staged = "average"
            self._done = r + 1
            self._cond.notify_all()
        return True

    def _finish_run(self) -> None:
        """Ends the run at the requested step: tells every member and checks that all ended at the same step."""
        step = self._drain_at
        self._send(_FINISH, step, self._everyone)
        self._wait(lambda: all(self._finishes[j] for j in self._everyone), step, [])
        with self._cond:
            steps = {self._member_ranks[j]: self._finishes[j].popleft() for j in self._everyone}
        self._wait_for_sends()  # every member receives until it has every member's _FINISH
        if any(s != step for s in steps.values()):
            raise RuntimeError(f"finish() or state_dict() was called at different steps: at step {step} on rank "
                               f"{dist.get_rank()}, {steps} on the others; every rank must call average_parameters "
                               "equally often")
        with self._cond:
            self._running = False
            self._cond.notify_all()


class GroupModelAverager:
    """Group model averaging with rotating butterfly groups, a periodic global average and (by default) wait
    avoidance: see the module docstring.

    Args:
        group_size: ranks per group; must divide the size of ``process_group`` (1: no group averaging, only the
            global averages; the size itself: every step averages over everyone).
        global_period: every ``global_period``-th step after warm-up averages over the whole process group,
            synchronously (1: every step).
        warmup_steps: the first ``warmup_steps`` steps average globally.
        process_group: the ranks that average (default: the whole default group).
        wait_avoiding: True: group averages run on a communication thread with the weights each rank last
            published, and no rank waits for them; False: synchronous group averages.
        timeout: seconds a call may wait for the other ranks (wait-avoiding mode: a global average, finish,
            state_dict) before it raises TimeoutError on this rank and stops the averaging on every rank.

    ``step`` counts the calls of :meth:`average_parameters`; :meth:`state_dict` / :meth:`load_state_dict` save
    and restore it. In wait-avoiding mode call :meth:`finish` on every rank before evaluating the weights, at the
    end, and before ``destroy_process_group``.
    """

    def __init__(self, group_size: int, global_period: int, warmup_steps: int = 0,
                 process_group: dist.ProcessGroup | None = None, wait_avoiding: bool = True,
                 timeout: float = 1800.0) -> None:
        if isinstance(global_period, bool) or not isinstance(global_period, int) or global_period < 1:
            raise ValueError(f"global_period must be a positive int, got {global_period!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
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
        then advances ``step``. Call it on every rank of the process group after every ``optimizer.step()``.
        Wait-avoiding mode: applies the group averages that completed since the last call, publishes the weights
        and returns without waiting, except at a global step."""
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
        """Collective (wait-avoiding mode): waits until every group round up to this step is done on every rank and
        applies their averages, so the weights are complete; raises on every rank if the ranks are at different
        steps. Does not advance ``step``. Synchronous mode: nothing is in flight, a no-op."""
        if self._rounds is not None:
            self._prepare(params)
            self._rounds.end_run(self.step, apply=True)

    def state_dict(self) -> dict[str, Any]:
        """The averager's position: ``{"step": int}`` plus its configuration, for checking on resume. Wait-avoiding
        mode: collective, like :meth:`finish` it waits for the rounds in flight on every rank, and it saves the
        averages they brought that the weights do not hold yet (``"correction"``, applied by the next call after
        :meth:`load_state_dict`); with :meth:`finish` called just before, there are none."""
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
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"state_dict['step'] must be a non-negative int, got {step!r}")
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
        """Checks the parameters and returns their buckets, created on the first call and the same on every call;
        the first call also checks that every rank has the same layout (one small collective). Wait-avoiding
        mode: an error stops the averaging on every rank."""
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

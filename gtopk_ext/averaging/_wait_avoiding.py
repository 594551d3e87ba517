"""One rank's side of WAGMA's wait-avoiding group rounds (see :mod:`gtopk_ext.averaging`).

A thread (a :class:`gtopk_ext._worker.Worker`) joins each group round with the weights p its rank last published,
once the round's first member has sent the others an activation message (over a Gloo group of its own). The round
turns p into the group mean a; the thread sets p <- a and adds ``a - p`` to the correction the training loop
applies at its next call: over a group the corrections sum to zero, so no progress is lost or counted twice."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gtopk_ext._worker import _CLOSE_SECONDS, Worker, complete

if TYPE_CHECKING:
    from gtopk_ext.averaging.averager import GroupModelAverager, _Bucket


# Control messages between the ranks' threads: int64 [kind, sender (index among the members), value].
_ACTIVATE = 1  # value: a round the sender joins; sent to that round's other members
_FINISH = 2    # value: the step at which the sender's run of rounds ends (finish / state_dict); sent to all
_STOP = 3      # no value: the sender stopped after an error and joins no later round; its last message; sent to all


class _Stop(Exception):
    """Ends the run of rounds once the worker has failed (it failed the run, and this rank sent _STOP)."""


class _WaitAvoidingRounds:
    """A :class:`Worker` per run of rounds, whose one job runs every round (group and global) for the rank, a
    thread that receives the control messages, and what they share with the training loop, under ``_cond``.

    Per bucket: ``published`` p, ``staging`` (a snapshot on its way to the thread, or a global average on its way
    back), ``correction`` (the ``a - p`` not applied yet) and ``reduced`` (the allreduce's buffer). Invariant:
    weights + correction = p + the progress the training loop made since it last published.

    A run starts at the first call after construction or after a finish and ends at finish or state_dict; its
    worker and threads exist only during a run (a failed run's worker keeps the failure until closed).

    A failure here or on another rank fails the worker, which carries it to every rank; this rank then sends _STOP
    to every member (see :meth:`_wake` and the commit rule of :meth:`_run_round`).
    """

    def __init__(self, schedule: GroupModelAverager, member_ranks: list[int], rank: int, control: dist.ProcessGroup,
                 timeout: float) -> None:
        self._schedule = schedule
        self._member_ranks = member_ranks
        self._rank = rank
        self._everyone = [i for i in range(len(member_ranks)) if i != rank]
        self._control = control  # a Gloo group for the control messages, whatever backend the data uses
        self._timeout = timeout
        self.buckets: list[_Bucket] | None = None
        self._cond = threading.Condition()
        # written by the training loop
        self._arrived = 0                          # steps the training loop has published
        self._drain_at: int | None = None          # the step at which this run ends
        self._staged: str | None = None            # None, "snapshot" or "average": what staging holds
        self.stopped_here = False                  # this rank's training loop stopped the averaging (its error)
        self._worker: Worker | None = None         # the current run's, or the failed run's
        self._run: torch.futures.Future | None = None  # the current run's job: done when the run is over
        # written by the threads
        self._done = 0                             # rounds completed
        self._activations: dict[int, set[int]] = {}  # round -> members whose thread joined it
        self._finishes: dict[int, deque[int]] = {j: deque() for j in self._everyone}
        self._stopped: set[int] = set()            # members that sent _STOP
        self._left = False                         # this rank sent _STOP
        self._receiving = False                    # a receiver thread runs
        self._receive_error: BaseException | None = None
        # Sends not yet waited for: kept, since a Gloo send whose Work is freed in flight takes the process down.
        self._sends: list[dist.Work] = []
        self._stop_sends: list[dist.Work] = []  # never waited for: a member that stopped may never receive them

    def publish(self, step: int) -> None:
        """Applies the corrections that arrived, publishes the weights and lets the thread run round ``step``."""
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
        """finish / state_dict: completes the rounds before ``step``, checks that every rank stopped there, and
        applies the corrections when ``apply`` (else they stay for state_dict)."""
        with self._cond:
            self._start_run(step)
            self._drain_at = step
            self._cond.notify_all()
            self._wait_in_training_loop(self._run.done, f"finishing at step {step}")
            self._drain_at = None
            if apply and self.buckets is not None:
                for bucket in self.buckets:
                    self._apply_correction(bucket)
        # The run is over: its threads end here, not where the interpreter may be finalizing (the worker's thread
        # is still inside the torch call that completed the run).
        self._worker.close()

    def stop(self, reason: BaseException) -> None:
        """An error in the training loop: the averaging stops on every rank, and each raises it from its next call."""
        with self._cond:
            if self._worker is not None and self._worker.failure is not None:
                return
            self.stopped_here = True
            self._start_run(self._done)  # a worker to publish it, and a receiver for the members' _STOP
            self._worker.fail(reason)

    def check_failure(self) -> None:
        with self._cond:
            self._raise_failure()

    @property
    def in_run(self) -> bool:
        return self._run is not None and not self._run.done()

    def _apply_correction(self, bucket: _Bucket) -> None:
        torch._foreach_add_(bucket.params, bucket.views(bucket.correction))
        bucket.correction.zero_()

    def _raise_failure(self) -> None:
        failure = None if self._worker is None else self._worker.failure
        if failure is not None:
            raise RuntimeError(f"wait-avoiding group averaging stopped on rank {dist.get_rank()}: "
                               f"{failure}") from failure

    def _wait_in_training_loop(self, ready: Callable[[], bool], what: str) -> None:
        self._raise_failure()
        if not self._cond.wait_for(lambda: ready() or self._worker.failure is not None, timeout=self._timeout):
            error = TimeoutError(f"{what} took more than timeout={self._timeout} s")
            self.stop(error)
            raise error
        self._raise_failure()

    def _start_run(self, step: int) -> None:
        """Starts a run if none is going on (the lock is held); its rounds start at ``step``."""
        self._raise_failure()
        if self.in_run:
            return
        self._done, self._arrived = step, step
        self._worker = Worker(self._control, "wagma", wake=self._wake)
        self._run = self._worker.submit(self._run_rounds)
        self._run.add_done_callback(self._notify)
        if self._everyone and not self._receiving:  # else the previous run's receiver goes on
            self._receiving = True
            threading.Thread(target=self._receive, name="gtopk_ext-wagma-receive", daemon=True).start()

    def _notify(self, _: torch.futures.Future) -> None:
        with self._cond:
            self._cond.notify_all()

    def _wake(self) -> None:
        """Called by the worker when it fails or closes. After a failure every member learns that this rank joins
        no later round (not waited for: a member that stopped may never receive it). Closing waits a while for the
        receiver to end: a thread still inside a torch call when the interpreter finalizes aborts the process."""
        with self._cond:
            if self._worker.failure is not None and not self._left:
                self._left = True
                for j in self._everyone:
                    try:
                        self._stop_sends += self._send(_STOP, 0, [j])
                    except RuntimeError:  # its connection is closed: that member is gone
                        pass
            self._cond.notify_all()
            if self._worker.closed:
                self._cond.wait_for(lambda: not self._receiving, timeout=_CLOSE_SECONDS)

    def _receive(self) -> None:
        """Receives control messages until every other member's last message of the run is in (its _FINISH or
        _STOP); a member's messages arrive in the order sent."""
        box = torch.empty(3, dtype=torch.int64)
        try:
            with self._cond:
                receiving = self._still_receiving()  # the previous run's receiver may have received them all
            while receiving:
                dist.irecv(box, src=None, group=self._control).wait()
                kind, sender, value = box.tolist()
                with self._cond:
                    if kind == _ACTIVATE:
                        self._activations.setdefault(value, set()).add(sender)
                    elif kind == _FINISH:
                        self._finishes[sender].append(value)
                    else:
                        self._stopped.add(sender)
                    receiving = self._still_receiving()
                    self._cond.notify_all()
        except Exception as exc:  # a peer's connection closed: the rounds waiting on messages stop
            with self._cond:
                self._receive_error = exc
                self._receiving = False
                self._cond.notify_all()

    def _still_receiving(self) -> bool:
        self._receiving = not all(self._finishes[j] or j in self._stopped for j in self._everyone)
        return self._receiving

    def _send(self, kind: int, value: int, to: list[int]) -> list[dist.Work]:
        message = torch.tensor([kind, self._rank, value], dtype=torch.int64)
        return [dist.isend(message, dst=self._member_ranks[j], group=self._control) for j in to]

    def _wait_for_sends(self) -> None:
        """Waits for the messages sent so far; only where every receiver is known to take them."""
        for work in self._sends:
            work.wait()
        self._sends = []

    def _run_rounds(self, result: torch.futures.Future) -> None:
        """The worker's job: the rounds from ``_done`` on until the run ends; an error fails the worker."""
        try:
            while self._run_round(self._done):
                pass
            self._finish_run()
        except _Stop:
            return
        complete(result)

    def _check_stopped(self, round_index: int, partners: list[int], committed: bool = False) -> None:
        """Raises when the run must end (the lock is held): a failure here or on another rank, the worker closing,
        or ranks that stopped at different steps."""
        if self._worker.failure is not None:
            raise _Stop()
        if self._worker.closed:
            raise RuntimeError("the averaging was closed (destroy_process_group or exit) with group rounds in flight: "
                               "call finish(params) on every rank first")
        if self._stopped:  # the worker takes the cause that rank published, if it can read it
            raise RuntimeError(f"rank {self._member_ranks[min(self._stopped)]} stopped wait-avoiding group averaging "
                               "after an error")
        if self._receive_error is not None:
            raise RuntimeError(f"receiving the control messages failed: {self._receive_error}")
        ahead = committed or self._arrived > round_index
        early = {self._member_ranks[j]: self._finishes[j][0] for j in partners
                 if ahead and self._finishes[j] and self._finishes[j][0] <= round_index}
        if early or (self._drain_at is not None and self._drain_at < round_index):
            ended = f"ends its run at step {self._drain_at}" if not early else f"is at step {self._arrived}"
            raise RuntimeError(
                f"finish() or state_dict() was called at different steps: rank {dist.get_rank()} {ended} and has "
                f"joined round {round_index} of members ahead of it, while rank(s) ended their runs at steps {early}; "
                "every rank must call average_parameters equally often")

    def _wait(self, ready: Callable[[], bool], round_index: int, partners: list[int]) -> None:
        """Waits until ``ready()`` (the lock is held), raising when the run must end."""
        while True:
            self._check_stopped(round_index, partners)
            if ready():
                return
            self._cond.wait()

    def _run_round(self, r: int) -> bool:
        """Runs round ``r`` (the lock is not held); False when the run ends before it."""
        synchronous = self._schedule.is_global_step(r)
        group, partners = self._schedule._group_at(r)

        def activated() -> bool:  # by this rank reaching step r, or (group rounds) by the first member to reach it
            return self._arrived > r or (not synchronous and bool(self._activations.get(r)))

        def ends_here() -> bool:  # finish / state_dict at step r (a member that activated r is then an error)
            return self._drain_at is not None and self._drain_at <= r

        with self._cond:
            self._wait(lambda: ends_here() or activated(), r, partners)
            if ends_here():
                return False
            self._sends += self._send(_ACTIVATE, r, partners)  # under the lock: never after this rank's _STOP
            # Committed: a member enters the allreduce exactly when every member has joined the round. A member that
            # stopped without joining says so (_STOP or _FINISH), after any _ACTIVATE it sent, so the members'
            # messages alone decide and this wait ignores the worker's failure. Closing ends it: the process is
            # going away, and a collective its peers start without it fails when it does.
            joined = self._activations.setdefault(r, set())
            self._cond.wait_for(lambda: all(j in joined or j in self._stopped or self._finishes[j] for j in partners)
                                or self._receive_error is not None or self._worker.closed)
            if not all(j in joined for j in partners):
                self._check_stopped(r, partners, committed=True)  # a member stopped or finished: raises
                raise RuntimeError(f"round {r}: a member ended its run without joining it")
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
        with self._cond:
            self._check_stopped(step, [])  # never a _FINISH after this rank's _STOP
            self._sends += self._send(_FINISH, step, self._everyone)
            self._wait(lambda: all(self._finishes[j] for j in self._everyone), step, [])
            steps = {self._member_ranks[j]: self._finishes[j].popleft() for j in self._everyone}
        self._wait_for_sends()  # every member receives until it has every member's _FINISH
        if any(s != step for s in steps.values()):
            raise RuntimeError(f"finish() or state_dict() was called at different steps: at step {step} on rank "
                               f"{dist.get_rank()}, {steps} on the others; every rank must call average_parameters "
                               "equally often")

"""One background worker per state (the DDP hook's, a run of WAGMA's rounds): runs jobs in order on a thread of its
own, publishes a failure to the other ranks and fails their waiting jobs with it, and closes before the interpreter
finalizes."""

from __future__ import annotations

import atexit
import builtins
import logging
import queue
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

logger = logging.getLogger(__name__)

# How often a waiting rank looks for another rank's published failure.
_FAILURE_POLL_SECONDS = 0.25
# How long closing a worker waits for the job in flight (a peer that is gone fails it sooner).
_CLOSE_SECONDS = 10.0
# Per process group, how many workers have started on it here: the same on every member, since the members start
# their workers in the same order.
_states_started: dict[str, int] = {}
_open_threads: set["Worker"] = set()  # closed at exit, before the interpreter finalizes


class Disagreement(ValueError):
    """An error raised on every rank alike (the ranks' headers disagree, or a rank's input was invalid), after an
    exchange that every rank took part in: the group is still in step, so a worker fails only that job."""


class Worker:
    """Runs jobs one at a time in the order they were handed over, so every rank issues its collectives in the
    same order (Gloo pairs collectives by that order).

    A failure on one rank is published in the group's store (the first one published stands, on every rank); a
    rank whose jobs wait finds it within ``_FAILURE_POLL_SECONDS`` and fails them with the same exception type,
    instead of waiting until the group's timeout. The worker is unusable after that.

    ``wake`` is called, with no lock of the worker held, when it fails or starts closing, so that a job waiting on
    a condition of its own (WAGMA's rounds) looks again at ``failure`` and ``closed``. ``busy_until``: when the
    latest asynchronous collective its jobs issued completed (``perf_counter``), set by the issuer."""

    def __init__(self, group: dist.ProcessGroup, name: str = "sparse_grad_hook",
                 wake: Optional[Callable[[], None]] = None):
        self.group = group
        self.name = name
        self._wake = wake
        self.rank = dist.get_rank(group)
        self.failure: Optional[BaseException] = None
        self.closed = False
        self.busy_until = 0.0
        self._store = distributed_c10d._get_process_group_store(group)
        serial = _states_started[group.group_name] = _states_started.get(group.group_name, -1) + 1
        self._key = f"gtopk_ext/{name}/{group.group_name}/{serial}/failure"
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[torch.futures.Future] = []  # results not yet set, oldest first
        self._lock = threading.Lock()
        self._busy = threading.Event()
        self._closing = threading.Event()
        self._worker = threading.Thread(target=self._serve, name=f"gtopk_ext-{name}", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name=f"gtopk_ext-{name}-watch", daemon=True)
        self._worker.start()
        self._watcher.start()
        _open_threads.add(self)

    def close(self) -> None:
        """End both threads once the jobs handed over have finished, and let go of the group. Runs at exit and
        from :func:`gtopk_ext.destroy_process_group`: a daemon thread still inside a torch call when the
        interpreter finalizes aborts the process."""
        if self.closed:
            return
        self.closed = True
        _open_threads.discard(self)
        self._closing.set()
        self._busy.set()  # wakes the watcher
        if self._wake is not None:
            self._wake()
        self._jobs.put(None)
        for thread in (self._worker, self._watcher):
            if thread is not threading.current_thread():
                thread.join(_CLOSE_SECONDS)
        if not self._worker.is_alive():  # else its jobs still need them
            self.group = self._store = None

    def submit(self, job: Callable[[torch.futures.Future], None],
               device: torch.device = torch.device("cpu")) -> torch.futures.Future:
        """Queue ``job(result)``, which must eventually complete ``result`` (or raise). On a CUDA ``device`` the job
        runs on the stream that is current here (the one that produced its gradient), and ``result`` makes its
        consumer's stream wait for the job's kernels."""
        result = future_on(device)
        if device.type == "cuda":
            job = on_stream(job, torch.cuda.current_stream(device))
        with self._lock:
            self._pending.append(result)
            self._busy.set()
        result.add_done_callback(self._done)
        self._jobs.put((job, result))
        return result

    def drain(self) -> None:
        """Wait until every job handed over has finished (successfully or not)."""
        if self.closed or threading.current_thread() is self._worker:
            return
        finished = self.submit(complete)
        try:
            finished.wait()
        except BaseException:  # noqa: BLE001 - a failure reaches the caller through its jobs' futures
            pass

    def _done(self, result: torch.futures.Future) -> None:
        with self._lock:
            if result in self._pending:
                self._pending.remove(result)
            if not self._pending:
                self._busy.clear()

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, result = item
            if self.failure is not None:
                fail(result, self.failure)
                continue
            try:
                job(result)
            except Disagreement as error:  # raised on every rank alike: the group is still in step
                fail(result, error)
            except BaseException as error:  # noqa: BLE001 - handed to DDP and to the other ranks
                self.fail(error)

    def fail(self, error: BaseException) -> None:
        """This rank failed: tell the others, and fail every job still waiting here. A failure another rank
        published first is the cause (this one may be its echo, such as a connection that rank closed).
        ``failure`` is set only once it is in the store, where a peer told of it by other means finds it."""
        with self._lock:  # one failure per rank, also when two threads fail at once
            if self.failure is None:
                record = f"{type(error).__name__}\n{self.rank}\n{error}"
                try:  # the first failure published stays, on every rank alike
                    stored = self._store.compare_set(self._key, "", record).decode()
                    self.failure = error if stored == record else self._decode(stored)
                except Exception:  # noqa: BLE001 - the store itself is gone: the group's timeout is all that is left
                    logger.exception("%s: could not publish the failure of rank %d", self.name, self.rank)
                    self.failure = error
        self._stopped()

    def _decode(self, record: str) -> BaseException:
        type_name, rank, message = record.split("\n", 2)
        kind = getattr(builtins, type_name, None)
        kind = kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError
        return kind(f"{self.name}: rank {rank} stopped after an error: {message}")

    def _stopped(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._busy.clear()
        for result in pending:
            fail(result, self.failure)
        if self._wake is not None:
            self._wake()

    def _watch(self) -> None:
        """While jobs wait, look for a failure another rank published."""
        while self.failure is None:
            self._busy.wait()
            if self._closing.wait(_FAILURE_POLL_SECONDS):
                return
            try:
                published = (self._decode(self._store.get(self._key).decode())
                             if self._busy.is_set() and self._store.check([self._key]) else None)
            except Exception:  # noqa: BLE001 - the group is being torn down
                return
            if published is not None:
                with self._lock:
                    self.failure = self.failure or published
                self._stopped()


@atexit.register
def close_workers() -> None:
    """Close every open :class:`Worker`; a state used afterwards starts a new one."""
    for thread in list(_open_threads):
        thread.close()


def future_on(device: torch.device) -> torch.futures.Future:
    """A future whose value may hold tensors on ``device``: a CUDA one records, when set, an event on the setting
    thread's stream that the consumer's stream then waits for."""
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


def on_stream(job: Callable[[torch.futures.Future], None], stream: "torch.cuda.Stream"
               ) -> Callable[[torch.futures.Future], None]:
    def on_stream(result: torch.futures.Future) -> None:
        with torch.cuda.stream(stream):
            job(result)

    return on_stream


def fail(result: torch.futures.Future, error: BaseException) -> None:
    complete(result, error=error)


def complete(result: torch.futures.Future, value=None, error: Optional[BaseException] = None) -> None:
    """Set ``result`` unless it is already set (a failure seen by the watching thread can get there first)."""
    if result.done():
        return
    try:
        if error is None:
            result.set_result(value)
        else:
            result.set_exception(error)
    except RuntimeError:  # set by another thread in between
        if not result.done():
            raise

"""What the stream worker's roles share, and nothing else: the bookkeeping between poll and
commit (`Shared`), the completion queue (`Completions`), and the two ports through which a
role reaches delivery or recovery without importing them (`DeliveryPort`,
`RecoveryPort`). `workers.hosting.worker.StreamWorker` builds one of each and hands them to the
roles; the error table is `workers.stream.actions`.

Threads: `Shared` is written by the consumer thread, and by the rebalance listener while
the consumer thread waits inside poll(); both hold `lock`. `Completions` is thread-safe:
the engine loop and the producer's I/O thread put, the consumer thread takes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

from kafka import TopicPartition

from dgstream.workers.commit import Marks, OffsetTracker, Ready
from dgstream.workers.faults.outage import OutageClock
from dgstream.workers.faults.poison import PoisonGuard
from dgstream.workers.hosting.metrics import WorkerMetrics
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.results.decisions import Decisions
from dgstream.workers.steps.batches import Batch, Output
from dgstream.workers.stream.actions import counts_when_abandoned

__all__ = ["CLOSE_TIMEOUT_S", "Completions", "DeliveryPort", "RecoveryPort", "Shared"]

# Close the clients (and stop the engine loop) within this bound on the way out.
CLOSE_TIMEOUT_S = 10.0


class Shared:
    """The consumer thread's bookkeeping, which the listener also touches (under `lock`).

    `log` is read at each use, not kept: a test may wrap the worker's logger after the
    roles were built (bench/harness/faults.py, `LogTap`)."""

    def __init__(self, settings: WorkerSettings, log: Any, metrics: WorkerMetrics) -> None:
        self.settings = settings
        self.log = log
        self.metrics = metrics
        self.lock = threading.RLock()  # consumer-thread bookkeeping vs the listener
        self.failure: BaseException | None = None  # the first one sticks: see fail()
        self.offsets = OffsetTracker()
        self.assignment: set[TopicPartition] = set()
        self.acc: Batch | None = None  # the batch being filled
        # Where to read again after open work was abandoned (the consumer thread applies
        # it): the group's committed offset, else this first offset polled.
        self.rewind: dict[TopicPartition, int] = {}
        self.closing = False  # teardown under way: the listener only forgets partitions
        self.outage = OutageClock(settings.outage)
        b = settings.batching
        self.poison = PoisonGuard(settings.poison, b.max_in_flight * b.max_records)
        self.submitted = 0  # batches sent to the engine loop (consumer thread)
        self.classified = 0  # batches the engine answered or failed (engine loop)

    def fail(self, exc: BaseException) -> None:
        """The replica is to fail with `exc`, unless it already is (with an earlier one):
        the consumer thread raises it at its next control step."""
        self.failure = self.failure or exc

    def engine_idle(self) -> bool:
        """Every batch submitted has been through the engine."""
        return self.submitted == self.classified


class Completions:
    """Batches finished by the engine loop or the producer's I/O thread, in the order they
    finished, for the consumer thread; `wait` wakes on each (and on `wake`)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Batch, BaseException | None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.last_error: str | None = None  # what the last failure reported said

    def done(self, batch: Batch) -> None:
        """Every output of `batch` is acknowledged (exactly-once: in the open transaction)."""
        self._q.put((batch, None))
        self._wake.set()

    def failed(self, batch: Batch, exc: BaseException) -> None:
        """`batch` ended with `exc`. Only its first ending counts; an abandoned batch's
        ending is dropped unless the error table says it still counts."""
        with batch.lock:
            if batch.reported:
                return
            batch.reported = True
        Decisions.end_trace(batch, exc)
        if batch.cancelled and not counts_when_abandoned(exc):
            return  # abandoned already: its records are read again
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._q.put((batch, exc))
        self._wake.set()

    def take(self) -> Iterator[tuple[Batch, BaseException | None]]:
        """What finished since the last call (consumer thread)."""
        while True:
            try:
                yield self._q.get_nowait()
            except queue.Empty:
                return

    def wake(self) -> None:
        self._wake.set()

    def wait(self, timeout_s: float) -> None:
        """Until something finished or `wake()` was called, at most `timeout_s`."""
        self._wake.wait(timeout_s)
        self._wake.clear()


class DeliveryPort(Protocol):
    """What the other roles ask of delivery (`workers.stream.delivery`)."""

    # Work between poll and commit must be abandoned when this member may not finish it
    # (partitions lost, a revocation not finished in time).
    must_abandon_unfinished: ClassVar[bool]
    broken: bool  # the producer is unusable: replace it before new work

    def send(self, batch: Batch, outputs: list[Output]) -> None: ...
    def delivered(self, batch: Batch) -> None: ...
    def in_transaction(self) -> set[int]: ...
    def abort(self, cancel: Callable[[], None]) -> None: ...
    def after_failed_send(self) -> None: ...
    def commit(
        self, ready: Callable[[], Ready], *, sync: bool, marks: Marks | None = None
    ) -> Ready: ...
    def renew(self) -> None: ...


class RecoveryPort(Protocol):
    """What the other roles ask of recovery (`workers.stream.recovery`)."""

    def apply_completions(self) -> None: ...
    def settle(self, *, sync: bool, marks: Marks | None = None) -> None: ...
    def abandon(self, reason: str) -> None: ...

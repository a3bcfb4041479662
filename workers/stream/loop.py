"""The consume loop: the consumer thread's busy loop, and drain's finish. It runs whoever
calls `StreamWorker.run()`; every consumer call happens here or in the rebalance listener
while this thread waits inside poll().

The loop is the conductor: each step is one call into the role that owns it, and the roles
never call each other (they share `Shared`, the completion queue and the error table).
docs/worker.md walks through the numbered steps.
"""

from __future__ import annotations

import threading
import time

from dgstream.workers.faults.errors import WorkerFailed
from dgstream.workers.steps.batches import Batch
from dgstream.workers.stream.engine_stage import EngineStage
from dgstream.workers.stream.intake import Intake
from dgstream.workers.stream.ownership import Ownership
from dgstream.workers.stream.recovery import Recovery
from dgstream.workers.stream.shared import Completions, DeliveryPort, Shared

__all__ = ["ConsumeLoop"]


class ConsumeLoop:
    """Steps 1-6 of the worker, until a stop, a drain or a failure."""

    def __init__(
        self,
        shared: Shared,
        completions: Completions,
        *,
        intake: Intake,
        ownership: Ownership,
        recovery: Recovery,
        delivery: DeliveryPort,
        engine: EngineStage,
    ) -> None:
        self._s = shared
        self._completions = completions
        self._intake = intake
        self._ownership = ownership
        self._recovery = recovery
        self._delivery = delivery
        self._engine = engine

    def run(self, stop: threading.Event, drain: threading.Event) -> None:
        s, intake = self._s, self._intake
        while True:
            self._settle()  # 1. settle
            if self._control(stop, drain):  # 2. control
                return
            self._ownership.update_lag()
            if intake.full():  # 3. backpressure: wait, polling with the partitions paused
                intake.hold()
                continue
            intake.release()
            records = intake.poll()  # 4. poll
            with s.lock:
                records = self._ownership.refresh(records)
                if records:
                    intake.take(records)  # 5. parse
                self._submit_due()  # 6. submit

    def _settle(self) -> None:
        """Step 1: acknowledged batches -> contiguous prefixes -> commit; while this member
        is not settled in its group only the first (`workers.stream.intake.REJOIN_POLL_MS`):
        a commit then is refused anyway, and its round trip would only delay the poll the
        rebalance waits for."""
        with self._s.lock:
            if self._intake.rejoin_pending():
                self._recovery.apply_completions()
            else:
                self._recovery.settle(sync=True)

    def _control(self, stop: threading.Event, drain: threading.Event) -> bool:
        """Step 2: whether to leave the loop (raises on a failure)."""
        s = self._s
        if self._delivery.broken and s.failure is None:
            self._renew_producer("an abort failed")
        if s.failure is not None:
            raise WorkerFailed(f"{type(s.failure).__name__}: {s.failure}") from s.failure
        if stop.is_set():
            return True
        if drain.is_set():
            self.finish_in_flight()
            return True
        return False

    def _submit_due(self) -> None:
        """Step 6: the batch being filled goes to the engine when it is due."""
        batch = self._intake.due()
        if batch is not None:
            self._submit(batch)

    def _submit(self, batch: Batch) -> None:
        """The batch goes to the engine, once the attempt counts it needs are committed."""
        s = self._s
        marks = self._intake.marks_for(batch)
        if marks and self._intake.rejoin_pending():
            # The counts must be committed before the batch runs, and no commit gets
            # through while the member rejoins: the batch waits for the rejoin.
            self._intake.defer(marks)
            return
        if marks:
            self._recovery.settle(sync=True, marks=marks)
            if s.acc is not batch or s.failure is not None:
                return  # abandoned meanwhile (a stale membership): read again
        s.acc = None
        s.offsets.track(batch)
        s.submitted += 1
        s.metrics.set_in_flight(s.offsets.in_flight)
        self._engine.submit(batch)

    def _renew_producer(self, reason: str) -> None:
        """A new producer in place of one that kafka-python made unusable (its idempotent
        sender treats a record the broker refused for good as fatal). The open work is
        abandoned first; under exactly-once the new producer fences the old one."""
        s = self._s
        with s.lock:
            self._recovery.apply_completions()
            self._recovery.abandon(f"producer reset: {reason}")
            self._delivery.renew()
        s.metrics.record_producer_reset()
        s.log.warning("producer_reset", reason=reason[:300])

    def finish_in_flight(self) -> None:
        """drain(): submit what was polled, wait for everything in flight, commit. It keeps
        polling with the partitions paused while it waits (`Intake.hold`): a rebalance
        under way must finish before anything can be committed, and it finishes only
        inside a poll()."""
        s, recovery, intake = self._s, self._recovery, self._intake
        deadline = time.monotonic() + s.settings.drain_timeout_s
        while True:
            with s.lock:
                if s.acc is not None and len(s.acc):
                    self._submit(s.acc)  # (it waits while its attempt counts cannot commit)
                if s.acc is not None and not len(s.acc):
                    s.acc = None
            if not s.offsets.in_flight and s.acc is None:
                break
            if time.monotonic() >= deadline:
                break
            if s.failure is not None:
                raise WorkerFailed(f"{s.failure}") from s.failure
            intake.hold()
            self._settle()
        with s.lock:
            if not intake.rejoin_pending():
                recovery.settle(sync=True)
            left = s.offsets.in_flight + (s.acc is not None)
            if not left:
                # Leaving cleanly is no crash: undo the attempt counts of partitions
                # this incarnation made no progress on.
                marks = s.poison.write_back(set(s.assignment))
                if marks:
                    recovery.settle(sync=True, marks=marks)
            if left:
                # The next owner reads them again (the batch never submitted too);
                # nothing of theirs may reach the output after this (exactly-once: no
                # transaction left open until its timeout, holding back every
                # read_committed reader of the output partitions).
                recovery.abandon("drain timeout")
        if left:
            s.log.warning(
                "drain_timeout", abandoned_batches=left, seconds=s.settings.drain_timeout_s
            )

"""Intake: how much to poll and for how long, what to do while every batch slot is taken,
filling the batch being filled with parsed records, and when it goes to the engine (steps
3-6 of the busy loop, docs/worker.md). Runs on the consumer thread only (it owns the
consumer's poll() and seek()); the batch being filled is `Shared.acc`.

Parsing never raises: a record that is not a request (or names an unknown question set,
or is poison: `workers.faults.poison`) gets its `RequestError` and becomes a dead letter of its
batch. While a partition is suspect every batch takes one record; the rest are sought back
and polled again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kafka import TopicPartition

from dgstream.schemas import ErrorCode, RequestError, record_id
from dgstream.schemas.cloudevents import CONTENT_TYPE
from dgstream.workers.commit import Marks
from dgstream.workers.kafka.quirks import (
    committed_offset,
    held_back,
    rejoin_pending,
    unpark_resumed,
)
from dgstream.workers.steps.batches import Batch, Entry, tp_name
from dgstream.workers.steps.inputs import InputReader
from dgstream.workers.stream.shared import Completions, Shared

__all__ = ["FULL_WAIT_S", "IDLE_POLL_MS", "REJOIN_POLL_MS", "Intake"]

# When every batch slot is taken, wait this long for a completion before polling (with the
# partitions paused) and looking again: short against one batch (tens of milliseconds
# with the fake engine on a CPU), so a freed slot is refilled at once. Completions also
# wake the loop directly. Whatever it waits for, the loop polls at least this often: a
# rebalance under way always has a poll() to finish in.
FULL_WAIT_S = 0.05
# While this member is not settled in its group (`workers.kafka.quirks.rejoin_pending`: a
# rejoin due, or a join under way) poll this long at a time and commit nothing, so the
# JoinGroup/SyncGroup round trip (which waits for the other members) completes inside
# poll() rather than between calls. A join waits on the slowest member (seconds when one
# is busy, a member's session when one is frozen); 2 s bounds how late the loop sees a
# stop or a drain meanwhile.
REJOIN_POLL_MS = 2_000
# When nothing is in flight and no batch is being filled, poll waits this long for data
# (it returns as soon as some arrives; the bound only sets how often control is checked).
IDLE_POLL_MS = 100
# Fairness across partitions. kafka-python hands out one partition's fetched records
# until they run out (a fetch of a partition can hold 1 MB compressed: hundreds of
# thousands of small records) before another partition's, and meanwhile may not even
# fetch the others (`workers.kafka.quirks.held_back`): a flood on one partition delayed
# another's request by 57 s (2026-12-07). Once one partition has filled this many
# batches' worth of records in a row while another is held back, it sits out one poll
# (paused): the others' fetch responses are read and they are fetched again. One batch:
# the flood then takes at most every other batch while others have records.
FAIR_TURN_BATCHES = 1

Records = dict[TopicPartition, list[Any]]


class Intake:
    """The consumer's reads and the batch being filled."""

    def __init__(
        self,
        shared: Shared,
        completions: Completions,
        consumer: Any,
        clock: Callable[[], float] = time.monotonic,  # tests pass their own
    ) -> None:
        self._s = shared
        self._completions = completions
        self._consumer = consumer
        self._clock = clock
        self._inputs = InputReader(shared.settings, shared.metrics, shared.log)
        self._seq = 0
        self._marks: dict[TopicPartition, tuple[int, str]] = {}  # to commit before submitting
        self._paused: set[TopicPartition] = set()  # paused by hold(), resumed by release()
        self._streak: tuple[TopicPartition | None, int] = (None, 0)  # the last records' tp

    def rejoin_pending(self) -> bool:
        """A rejoin is due: poll long enough for it, commit nothing meanwhile."""
        return rejoin_pending(self._consumer)

    def slots(self) -> int:
        """Batches allowed between poll and commit: one while a partition is suspect."""
        return 1 if self._s.poison.careful() else self._s.settings.batching.max_in_flight

    def full(self) -> bool:
        """Step 3: every slot is taken (the batch being filled needs one), or an outage
        holds new work back until its next try."""
        return self._s.offsets.in_flight >= self.slots() or self._s.outage.holding()

    def poll(self) -> Records:
        """Step 4: up to `max_records - len(batch)` records; waits no longer than the batch
        being filled may still wait, and long enough for a rejoin."""
        b, acc = self._s.settings.batching, self._s.acc
        if acc is not None and len(acc):
            timeout_ms = max(0, int((acc.started + b.max_wait_ms / 1000 - self._clock()) * 1000))
        elif self._s.offsets.in_flight:
            timeout_ms = b.max_wait_ms
        else:
            timeout_ms = IDLE_POLL_MS
        if self.rejoin_pending():
            timeout_ms = max(timeout_ms, REJOIN_POLL_MS)
        room = (1 if self._s.poison.careful() else b.max_records) - (len(acc) if acc else 0)
        hog = self._hog()
        if hog is not None:
            records = self._turn(hog, max(room, 1))
            if records:
                return records
        return self._poll(timeout_ms, max(room, 1))

    def _hog(self) -> TopicPartition | None:
        """The partition that filled `FAIR_TURN_BATCHES` batches in a row while another
        is held back behind it; None when there is none."""
        tp, run = self._streak
        if tp is None or run < FAIR_TURN_BATCHES * self._s.settings.batching.max_records:
            return None
        if held_back(self._consumer, tp):
            return tp
        self._streak = (tp, 0)  # nobody waits: look again after another run
        return None

    def _turn(self, hog: TopicPartition, room: int) -> Records:
        """One poll without `hog` (paused: kafka-python parks its records, hands out the
        others' fetched ones and fetches them again), then `hog` resumed (its parked
        records come back)."""
        consumer = self._consumer
        self._streak = (None, 0)
        if hog not in consumer.assignment():  # revoked since its last records
            return {}
        consumer.pause(hog)
        try:
            records = self._poll(0, room)
        finally:
            # The poll may have revoked it (a rebalance completes inside poll): resuming a
            # partition no longer assigned raises.
            if hog in consumer.assignment():
                consumer.resume(hog)
        return records

    def _poll(self, timeout_ms: int, max_records: int) -> Records:
        unpark_resumed(self._consumer)
        records: Records = self._consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        return records

    def hold(self) -> None:
        """Steps 3 and 4 while every slot is taken (or an outage pauses new work): wait for a
        completion, then poll with every assigned partition paused, so that a rebalance,
        the heartbeat's poll-interval check and a pending commit's callbacks all have a
        poll() to run in, while no record is fetched or returned. Polled long enough for a
        rejoin when one is pending. A partition assigned during that poll (not paused yet)
        may return records: they are sought back, and it is paused at the next hold.

        pause() rather than stopping to poll: a member that stops polling while its group
        rebalances is never settled again (kafka-python takes a join only inside poll()),
        and every commit is then refused as RebalanceInProgressError (2026-12-07: the
        worker stalled for good). `workers.kafka.quirks.unpark_resumed` makes a paused
        partition's parked records come back once it is resumed (`release`)."""
        self._completions.wait(FULL_WAIT_S)
        consumer = self._consumer
        assigned = set(consumer.assignment())
        new = assigned - self._paused
        if new:
            consumer.pause(*sorted(new, key=_order))
            self._paused |= new
        self._paused &= assigned | new
        rejoin = self.rejoin_pending()
        records = self._poll(REJOIN_POLL_MS if rejoin else 0, 1)
        with self._s.lock:
            self._s.assignment = set(consumer.assignment())
            for tp, recs in (records or {}).items():
                if recs and tp in self._s.assignment:
                    consumer.seek(tp, recs[0].offset)

    def release(self) -> None:
        """A slot is free again: resume what `hold` paused (their parked records come back
        in line at the next poll)."""
        if not self._paused:
            return
        consumer = self._consumer
        still = self._paused & set(consumer.assignment())
        self._paused = set()
        if still:
            consumer.resume(*sorted(still, key=_order))

    def take(self, records: Records) -> None:
        """Step 5: parse the polled records into the batch being filled (a new one when
        none is), as many as it has room for; the rest are sought back."""
        s = self._s
        for tp, recs in records.items():
            if recs and not s.poison.known(tp):
                self._first_seen(tp, recs[0].offset)
        if s.acc is None:
            self._seq += 1
            s.acc = Batch(self._seq, started=self._clock())
        acc = s.acc
        room = 1 - len(acc) if s.poison.careful() else sum(map(len, records.values()))
        n = 0
        for tp, recs in records.items():
            if recs:
                s.offsets.saw(tp, recs[0].offset)
            taken = 0
            for rec in recs:
                if n >= room:
                    self._consumer.seek(tp, rec.offset)
                    break
                n += 1
                taken += 1
                acc.add(self.entry(tp, rec))
            if taken:
                last, run = self._streak
                self._streak = (tp, run + taken if tp == last else taken)
        s.metrics.record_consumed(n)

    def entry(self, tp: TopicPartition, rec: Any) -> Entry:
        """One record as the batch holds it: parsed into a request, or refused."""
        s = self._s
        entry = Entry(tp, rec.offset, rec.key, rec.value, rec.timestamp, list(rec.headers or ()))
        killed = s.poison.poison(tp, rec.offset)
        if killed is not None:
            entry.error = RequestError(
                code=ErrorCode.POISON,
                message=f"this record was running alone when {killed.alone} worker "
                "incarnations died (an engine crash on it, or the process killed); it is "
                "not tried again",
            )
            return entry
        # A body without an id (Jev's) is named after its record: its key, else its place.
        fallback = record_id(rec.key, tp.topic, tp.partition, rec.offset)
        entry.fallback_id = fallback.value
        # Framing (if any), then the JSON (a structured CloudEvent by its content type).
        parsed = self._inputs.parse(rec.value, fallback, _header(entry.headers, CONTENT_TYPE))
        if isinstance(parsed, RequestError):
            entry.error = parsed
        elif parsed.question_set is not None and parsed.question_set not in (
            s.settings.question_sets
        ):
            entry.error = RequestError(
                code=ErrorCode.UNKNOWN_QUESTION_SET,
                message=f"question_set: no question set named {parsed.question_set!r} "
                f"in pipeline {s.settings.pipeline!r}",
                field="question_set",
            )
        else:
            entry.request = parsed
        return entry

    def _first_seen(self, tp: TopicPartition, first: int) -> None:
        """The partition's first records this incarnation: count the attempt (committed
        before they run, in the committed offset's metadata)."""
        s = self._s
        try:
            meta = committed_offset(self._consumer, tp, metadata=True)
        except Exception as exc:
            s.log.warning("committed_offset_unknown", partition=tp_name(tp), error=str(exc))
            meta = None
        committed = None if meta is None else meta.offset
        text = None if meta is None else meta.metadata
        self._marks[tp] = s.poison.first_seen(tp, first, committed, text)
        if s.poison.suspect(tp):
            s.log.warning("partition_suspect", partition=tp_name(tp), offset=first, seen=text)

    def due(self) -> Batch | None:
        """Step 6's question: the batch being filled, when it is to go to the engine now
        (full, waited `max_wait_ms`, or the engine idle); None otherwise."""
        acc, b = self._s.acc, self._s.settings.batching
        if acc is None or not len(acc):
            return None
        if (
            len(acc) >= b.max_records
            or self._s.poison.careful()
            or self._clock() - acc.started >= b.max_wait_ms / 1000
            or self._s.engine_idle()
        ):
            return acc
        return None

    def marks_for(self, batch: Batch) -> Marks:
        """The attempt counts to commit before `batch` runs (`workers.faults.poison`): those of
        partitions first seen since the last batch, and one for each suspect partition's
        record about to run alone."""
        marks, self._marks = self._marks, {}
        for e in batch.entries:
            mark = self._s.poison.before_alone(e.tp, e.offset)
            if mark is not None:
                marks[e.tp] = mark
        return marks

    def defer(self, marks: Marks) -> None:
        """`marks` could not be committed yet (the member is rejoining): they go with the
        next batch's (this batch waits: it must not run before its count is committed)."""
        self._marks = {**marks, **self._marks}


def _order(tp: TopicPartition) -> tuple[str, int]:
    return tp.topic, tp.partition


def _header(headers: list[tuple[str, bytes | None]], name: str) -> str | None:
    """A record header's value as text (the first of that name, compared ignoring case)."""
    for key, value in headers:
        if key.lower() == name and value:
            return bytes(value).decode("utf-8", "replace")
    return None

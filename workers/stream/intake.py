"""Intake: how much to poll and for how long, what to do while every batch slot is taken,
filling the batch being filled with parsed records, and when it goes to the engine (steps
3-6 of the busy loop, docs/worker.md). Runs on the consumer thread only (it owns the
consumer's poll() and seek()); the batch being filled is `Shared.acc`.

Parsing never raises: a record that is not a request (or names an unknown question set,
or is poison: `workers.poison`) gets its `RequestError` and becomes a dead letter of its
batch. While a partition is suspect every batch takes one record; the rest are sought back
and polled again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from kafka import TopicPartition

from schemas import ErrorCode, RequestError, record_id
from schemas.cloudevents import CONTENT_TYPE
from workers.batches import Batch, Entry, tp_name
from workers.commit import Marks
from workers.inputs import InputReader
from workers.kafka_quirks import committed_offset, rejoin_pending
from workers.stream.shared import Completions, Shared

__all__ = ["FULL_POLL_EVERY_S", "FULL_WAIT_S", "IDLE_POLL_MS", "REJOIN_POLL_MS", "Intake"]

# When every batch slot is taken, wait this long for a completion before looking again:
# short against one batch (tens of milliseconds with the fake engine on a CPU), so a
# freed slot is refilled at once. Completions also wake the loop directly.
FULL_WAIT_S = 0.05
# While full, still call poll() at least this often, so the heartbeat thread's
# poll-interval check (max_poll_interval_ms) and rebalances see a live member. One second:
# well below any sane max_poll_interval_ms, and rebalances wait for this member's rejoin.
FULL_POLL_EVERY_S = 1.0
# A rejoin is pending (`workers.kafka_quirks.rejoin_pending`): poll this long at a time,
# and commit nothing in between, so the JoinGroup/SyncGroup round trip (which waits for the
# other members) completes inside poll() rather than between calls. A join waits on the
# slowest member (seconds when one is busy, a member's session when one is frozen); 2 s
# bounds how late the loop sees a stop or a drain meanwhile.
REJOIN_POLL_MS = 2_000
# When nothing is in flight and no batch is being filled, poll waits this long for data
# (it returns as soon as some arrives; the bound only sets how often control is checked).
IDLE_POLL_MS = 100

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
        self._last_poll = -math.inf  # never: the first wait while full polls
        self._marks: dict[TopicPartition, tuple[int, str]] = {}  # to commit before submitting

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
        being filled may still wait."""
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
        records: Records = self._consumer.poll(timeout_ms=timeout_ms, max_records=max(room, 1))
        self._last_poll = self._clock()
        return records

    def wait_full(self) -> None:
        """Every slot taken (or an outage pausing): wait for a completion; keep the
        membership alive meanwhile.

        No pause()/resume(): kafka-python 3.0's fetcher parks the parsed records of a paused
        partition and gives them back only while no other partition's records are in line
        (`Fetcher.fetch_records` tests `_next_partition_records is None`, which a drained
        batch never resets), and a parked partition is not fetched again: it stalls for
        good. Instead the loop stops polling, and when it must poll (a rejoin is due, or a
        second has passed) it takes at most one record and seeks back to it."""
        self._completions.wait(FULL_WAIT_S)
        rejoin = self.rejoin_pending()
        if not rejoin and self._clock() - self._last_poll < FULL_POLL_EVERY_S:
            return
        consumer = self._consumer
        records = consumer.poll(timeout_ms=REJOIN_POLL_MS if rejoin else 0, max_records=1)
        self._last_poll = self._clock()
        with self._s.lock:
            self._s.assignment = set(consumer.assignment())
            for tp, recs in (records or {}).items():
                if recs and tp in self._s.assignment:
                    consumer.seek(tp, recs[0].offset)

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
            for rec in recs:
                if n >= room:
                    self._consumer.seek(tp, rec.offset)
                    break
                n += 1
                acc.add(self.entry(tp, rec))
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
        """The attempt counts to commit before `batch` runs (`workers.poison`): those of
        partitions first seen since the last batch, and one for each suspect partition's
        record about to run alone."""
        marks, self._marks = self._marks, {}
        for e in batch.entries:
            mark = self._s.poison.before_alone(e.tp, e.offset)
            if mark is not None:
                marks[e.tp] = mark
        return marks


def _header(headers: list[tuple[str, bytes | None]], name: str) -> str | None:
    """A record header's value as text (the first of that name, compared ignoring case)."""
    for key, value in headers:
        if key.lower() == name and value:
            return bytes(value).decode("utf-8", "replace")
    return None

"""Intake without a broker: how long and how much it polls, what it does while every slot
is taken, how it fills and parses the batch being filled, and when that batch is due. A
fake consumer (`stream_fakes.FakeConsumer`) records the polls and seeks."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from kafka.errors import KafkaTimeoutError
from kafka.structs import OffsetAndMetadata
from stream_fakes import T0, T1, FakeConsumer, Rec, RecordingLog, batch, shared

from dgstream.schemas import ErrorCode
from dgstream.workers.faults.outage import Outage
from dgstream.workers.hosting.settings import Batching
from dgstream.workers.stream.intake import IDLE_POLL_MS, REJOIN_POLL_MS, Intake
from dgstream.workers.stream.shared import Completions, Shared

pytestmark = pytest.mark.unit

QUESTIONS = {"urgent": {"type": "yes_no", "instructions": "Is it urgent?"}}
SUSPECT = "dgstream:v1;started=2;alone=0"  # two incarnations died at this offset


def _request(rid: str | None = "r1", **extra: Any) -> bytes:
    body: dict[str, Any] = {"state": "hello", "questions": QUESTIONS, **extra}
    if rid is not None:
        body["id"] = rid
    return json.dumps(body).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _intake(
    *, batching: Batching | None = None, **overrides: Any
) -> tuple[Intake, Shared, FakeConsumer, Completions, Clock]:
    s = shared(batching=batching or Batching(max_records=4, max_wait_ms=50), **overrides)
    consumer, done, clock = FakeConsumer(), Completions(), Clock()
    return Intake(s, done, consumer, clock), s, consumer, done, clock


def _log(s: Shared) -> RecordingLog:
    assert isinstance(s.log, RecordingLog)
    return s.log


def _suspect(intake: Intake, consumer: FakeConsumer, tp: Any = T0, at: int = 0) -> None:
    consumer.offsets[tp] = OffsetAndMetadata(at, SUSPECT, -1)
    intake.take({tp: [Rec(at, _request())]})


# ------------------------------------------------------------------ slots, backpressure


def test_a_suspect_partition_leaves_one_slot() -> None:
    intake, _, consumer, _, _ = _intake(batching=Batching(max_records=4, max_in_flight=3))
    assert intake.slots() == 3
    _suspect(intake, consumer)
    assert intake.slots() == 1


def test_full_when_every_slot_is_taken_or_an_outage_holds_new_work() -> None:
    intake, s, _, _, _ = _intake(batching=Batching(max_records=4, max_in_flight=2))
    s.offsets.track(batch(1, (T0, 0)))
    assert not intake.full()
    s.offsets.track(batch(2, (T0, 1)))
    assert intake.full()
    s.offsets.forget({T0})
    assert not intake.full()
    s.outage.hit(Outage("engine", "down"))
    assert intake.full()


# ------------------------------------------------------------------ polling


def test_an_idle_worker_polls_briefly_for_a_whole_batch() -> None:
    intake, _, consumer, _, _ = _intake()
    consumer.feed({T0: [Rec(0)]})
    assert intake.poll() == {T0: [Rec(0)]}
    assert consumer.polls == [(IDLE_POLL_MS, 4)]


def test_with_work_in_flight_a_poll_waits_up_to_the_batch_wait() -> None:
    intake, s, consumer, _, _ = _intake(batching=Batching(max_records=4, max_wait_ms=70))
    s.offsets.track(batch(1, (T0, 0)))
    intake.poll()
    assert consumer.polls == [(70, 4)]


def test_a_batch_being_filled_bounds_the_poll_by_its_remaining_wait_and_room() -> None:
    intake, s, consumer, _, clock = _intake(batching=Batching(max_records=4, max_wait_ms=1000))
    s.acc = batch(1, (T0, 0))
    s.acc.started = clock.now - 0.25
    intake.poll()
    assert consumer.polls == [(750, 3)]
    s.acc.started = clock.now  # just started: the whole wait
    intake.poll()
    assert consumer.polls[-1] == (1000, 3)
    s.acc.started = clock.now - 5  # waited past its bound: do not wait at all
    intake.poll()
    assert consumer.polls[-1] == (0, 3)


def test_a_full_batch_still_polls_one_record() -> None:
    intake, s, consumer, _, _ = _intake(batching=Batching(max_records=2, max_wait_ms=1000))
    s.acc = batch(1, (T0, 0), (T0, 1))
    intake.poll()
    assert consumer.polls[-1][1] == 1


def test_a_pending_rejoin_makes_the_poll_long_enough_for_it() -> None:
    intake, _, consumer, _, _ = _intake()
    consumer.rejoin = True
    assert intake.rejoin_pending()
    intake.poll()
    assert consumer.polls == [(REJOIN_POLL_MS, 4)]


def test_a_suspect_partition_polls_one_record_at_a_time() -> None:
    intake, s, consumer, _, _ = _intake()
    _suspect(intake, consumer)
    s.acc = None
    intake.poll()
    assert consumer.polls[-1] == (IDLE_POLL_MS, 1)


# ------------------------------------------------------------------ while full


def test_while_full_it_waits_for_a_completion_then_polls_with_every_partition_paused() -> None:
    """A rebalance needs a poll() to finish in: holding never skips it, and the poll
    returns nothing because every assigned partition is paused."""
    intake, s, consumer, done, _ = _intake()
    done.wake()
    intake.hold()
    assert consumer.polls == [(0, 1)]
    assert consumer.paused == {T0, T1} and consumer.seeks == []
    assert s.assignment == {T0, T1}
    done.wake()
    intake.hold()  # still full: polls again, pauses nothing twice
    assert consumer.polls == [(0, 1), (0, 1)]
    assert consumer.pauses == [("pause", {T0, T1})]


def test_while_full_with_nothing_finishing_it_polls_after_a_short_wait() -> None:
    intake, _, consumer, _, _ = _intake()
    holding = threading.Thread(target=intake.hold, daemon=True)
    holding.start()
    holding.join(30)  # FULL_WAIT_S, unless the machine stalls for half a minute
    assert not holding.is_alive(), "hold waited for a completion that never came"
    assert consumer.polls == [(0, 1)]


def test_while_full_a_pending_rejoin_is_polled_long_enough() -> None:
    intake, _, consumer, done, _ = _intake()
    consumer.rejoin = True
    done.wake()
    intake.hold()
    assert consumer.polls == [(REJOIN_POLL_MS, 1)]


def test_a_partition_assigned_during_a_hold_is_sought_back_and_paused_next() -> None:
    intake, s, consumer, done, _ = _intake()
    consumer.assigned = {T0}
    done.wake()
    intake.hold()
    assert consumer.paused == {T0}
    # The poll's rebalance assigned T1 (not paused yet): what it returned goes back.
    consumer.assigned = {T0, T1}
    consumer.feed({T1: [Rec(3), Rec(4)]})
    done.wake()
    intake.hold()
    assert consumer.seeks == [(T1, 3)] and s.assignment == {T0, T1}
    done.wake()
    intake.hold()
    assert consumer.paused == {T0, T1}


def test_records_of_a_partition_no_longer_assigned_are_left_alone() -> None:
    intake, _, consumer, done, _ = _intake()
    consumer.assigned = {T0}
    consumer.feed({T1: [Rec(3)]})
    done.wake()
    intake.hold()
    assert consumer.seeks == []


def test_a_free_slot_resumes_what_was_paused_and_nothing_revoked() -> None:
    intake, _, consumer, done, _ = _intake()
    done.wake()
    intake.hold()
    consumer.assigned = {T1}  # T0 revoked meanwhile
    intake.release()
    assert consumer.pauses[-1] == ("resume", {T1})
    intake.release()  # nothing paused any more: no call
    assert len(consumer.pauses) == 2


def test_every_poll_lets_parked_records_of_resumed_partitions_back() -> None:
    """kafka-python hands a resumed partition's parked records back only when nothing is
    in line; a drained records object in line is cleared before each poll."""

    class Drained:
        def __bool__(self) -> bool:
            return False

    intake, _, consumer, done, _ = _intake()
    for step in (intake.poll, intake.hold):
        consumer._fetcher = SimpleNamespace(_next_partition_records=Drained())
        done.wake()
        step()
        assert consumer._fetcher._next_partition_records is None, step


def _behind(consumer: FakeConsumer, waiting: Any) -> None:
    """kafka-python's fetcher with `waiting`'s fetch response in line behind the records
    being handed out (`workers.kafka.quirks.held_back`)."""
    consumer.stand_at({T0: 0, T1: 0})
    consumer._fetcher = SimpleNamespace(
        _completed_fetches=[SimpleNamespace(topic_partition=waiting)],
        _nodes_with_pending_fetch_requests=set(),
        _next_partition_records=None,
    )


def test_a_partition_that_filled_a_batch_sits_out_a_poll_while_another_waits() -> None:
    intake, _, consumer, _, _ = _intake()
    _behind(consumer, T1)
    intake.take({T0: [Rec(i, _request(f"r{i}")) for i in range(4)]})  # a batch's worth
    intake.poll()
    assert consumer.pauses == [("pause", {T0}), ("resume", {T0})]


def test_a_partition_revoked_during_its_turn_is_not_resumed() -> None:
    """A rebalance completes inside poll(): the partition sitting out may be gone after it,
    and kafka-python's resume() raises KeyError for a partition it does not hold."""
    intake, _, consumer, _, _ = _intake()
    _behind(consumer, T1)
    intake.take({T0: [Rec(i, _request(f"r{i}")) for i in range(4)]})
    polled = consumer.poll

    def revoking(timeout_ms: int, max_records: int) -> Any:
        consumer.assigned = {T1}
        return polled(timeout_ms, max_records)

    consumer.poll = revoking  # type: ignore[method-assign]
    intake.poll()
    assert consumer.pauses == [("pause", {T0})]


# ------------------------------------------------------------------ filling the batch


def test_records_fill_one_batch_in_order_and_count() -> None:
    intake, s, consumer, _, clock = _intake()
    intake.take({T0: [Rec(5, _request("a")), Rec(6, _request("b"))], T1: [Rec(0, _request("c"))]})
    assert s.acc is not None and s.acc.seq == 1 and s.acc.started == clock.now
    assert [(e.tp, e.offset) for e in s.acc.entries] == [(T0, 5), (T0, 6), (T1, 0)]
    assert s.acc.last == {T0: 6, T1: 0}
    assert s.metrics.consumed == 3 and consumer.seeks == []
    assert s.offsets.lag_base(T0) == 5 and s.offsets.lag_base(T1) == 0
    intake.take({T0: [Rec(7, _request("d"))]})
    assert s.acc.seq == 1 and len(s.acc) == 4 and s.offsets.lag_base(T0) == 5
    s.acc = None
    intake.take({T1: [Rec(1, _request("e"))]})
    assert s.acc is not None and s.acc.seq == 2


def test_an_empty_partition_in_a_poll_changes_nothing_of_it() -> None:
    intake, s, consumer, _, _ = _intake()
    intake.take({T0: [], T1: [Rec(4, _request())]})
    assert s.offsets.lag_base(T0) is None and not s.poison.known(T0)
    assert [lookup[0] for lookup in consumer.lookups] == [T1]


def test_a_partitions_first_records_read_and_mark_its_attempt_count() -> None:
    intake, s, consumer, _, _ = _intake()
    consumer.offsets[T0] = OffsetAndMetadata(5, "dgstream:v1;started=1;alone=0", -1)
    intake.take({T0: [Rec(5, _request())]})
    assert consumer.lookups == [(T0, {"metadata": True, "timeout_ms": 10_000})]
    intake.take({T0: [Rec(6, _request())]})  # known now: not asked again
    assert len(consumer.lookups) == 1
    assert s.acc is not None
    assert intake.marks_for(s.acc) == {T0: (5, "dgstream:v1;started=2;alone=0")}
    assert intake.marks_for(s.acc) == {}  # taken once
    assert _log(s).named("partition_suspect") == []


def test_an_unknown_committed_offset_counts_from_scratch_and_says_so() -> None:
    intake, s, consumer, _, _ = _intake()
    consumer.offsets[T0] = KafkaTimeoutError("coordinator unknown")
    intake.take({T0: [Rec(5, _request())]})
    assert _log(s).named("committed_offset_unknown") == [
        ("warning", {"partition": "in-0", "error": "KafkaTimeoutError: coordinator unknown"})
    ]
    assert s.acc is not None
    assert intake.marks_for(s.acc) == {T0: (5, "dgstream:v1;started=1;alone=0")}


def test_a_suspect_partition_takes_one_record_and_seeks_back_to_the_rest() -> None:
    intake, s, consumer, _, _ = _intake()
    consumer.offsets[T0] = OffsetAndMetadata(5, SUSPECT, -1)
    intake.take({T0: [Rec(5, _request()), Rec(6, _request())], T1: [Rec(0, _request())]})
    assert s.acc is not None and [e.offset for e in s.acc.entries] == [5]
    assert consumer.seeks == [(T0, 6), (T1, 0)] and s.metrics.consumed == 1
    assert _log(s).named("partition_suspect") == [
        ("warning", {"partition": "in-0", "offset": 5, "seen": SUSPECT})
    ]
    intake.take({T0: [Rec(6, _request())]})  # the batch holds one already
    assert len(s.acc) == 1 and consumer.seeks[-1] == (T0, 6)


# ------------------------------------------------------------------ parsing


def test_a_good_record_becomes_a_request_named_by_its_key_when_it_has_no_id() -> None:
    intake, _, _, _, _ = _intake()
    e = intake.entry(T0, Rec(3, _request(None), key=b"order-9", headers=[("h", b"v")]))
    assert e.error is None and e.request is not None and e.request.id == "order-9"
    assert e.fallback_id == "order-9" and e.headers == [("h", b"v")]
    assert e.value == _request(None)  # the original bytes, for a dead letter
    assert (e.tp, e.offset, e.key, e.timestamp_ms) == (T0, 3, b"order-9", 1_700_000_000_000)
    keyless = intake.entry(T1, Rec(8, _request(None)))
    assert keyless.fallback_id == "in-1-8" and keyless.request is not None


def test_a_record_that_is_no_request_carries_its_refusal() -> None:
    intake, _, _, _, _ = _intake()
    e = intake.entry(T0, Rec(3, b"not json"))
    assert e.request is None and e.error is not None and e.error.code is ErrorCode.INVALID_JSON
    assert intake.entry(T0, Rec(4, None)).error is not None  # a tombstone


def test_a_parse_limit_of_the_settings_applies() -> None:
    from dgstream.schemas import ParseLimits

    intake, _, _, _, _ = _intake(parse_limits=ParseLimits(max_message_bytes=32))
    e = intake.entry(T0, Rec(3, _request()))
    assert e.error is not None and e.error.code is ErrorCode.MESSAGE_TOO_LARGE


def test_an_unknown_question_set_is_refused_naming_the_pipeline() -> None:
    intake, _, _, _, _ = _intake(question_sets={"known": QUESTIONS})
    body = json.dumps({"id": "q1", "state": "s", "question_set": "nope"}).encode()
    e = intake.entry(T0, Rec(3, body))
    assert e.request is None and e.error is not None
    assert e.error.code is ErrorCode.UNKNOWN_QUESTION_SET and e.error.field == "question_set"
    assert e.error.message == "question_set: no question set named 'nope' in pipeline 'p'"
    known = json.dumps({"id": "q2", "state": "s", "question_set": "known"}).encode()
    assert intake.entry(T0, Rec(4, known)).request is not None


def test_a_poison_record_is_refused_without_parsing() -> None:
    intake, s, _, _, _ = _intake()
    s.poison.first_seen(T0, 5, 5, "dgstream:v1;started=3;alone=2")
    e = intake.entry(T0, Rec(5, _request()))
    assert e.request is None and e.error is not None and e.error.code is ErrorCode.POISON
    assert e.error.message == (
        "this record was running alone when 2 worker incarnations died (an engine crash "
        "on it, or the process killed); it is not tried again"
    )
    assert e.fallback_id is None
    assert intake.entry(T0, Rec(6, _request())).request is not None  # only that record


def test_a_content_type_header_of_a_structured_cloudevent_makes_the_value_one() -> None:
    # A plain request's JSON (no `specversion`): only the record's content-type header can
    # make it a structured CloudEvent, which it then is not (its attributes are missing).
    intake, _, _, _, _ = _intake()
    structured = b"application/cloudevents+json"
    trace = ("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")

    def code(headers: list[tuple[str, bytes | None]]) -> ErrorCode | None:
        e = intake.entry(T0, Rec(3, _request(), headers=headers))
        return None if e.error is None else e.error.code

    # Looked up by name, ignoring case, after other headers.
    assert code([trace, ("Content-Type", structured)]) is ErrorCode.INVALID_CLOUDEVENT
    # The first header of that name with a value decides.
    assert code([("content-type", b"application/json"), ("content-type", structured)]) is None
    assert code([("content-type", b""), ("content-type", structured)]) is (
        ErrorCode.INVALID_CLOUDEVENT
    )
    assert code([("content-type", None), ("content-type", structured)]) is (
        ErrorCode.INVALID_CLOUDEVENT
    )
    # Another header holding that value is not the content type.
    assert code([("x-content-type", structured), trace]) is None
    assert code([]) is None
    # Any bytes: a header that is not UTF-8 is read with replacement, never raised on.
    assert code([("content-type", b"\xff\xfe" + structured)]) is None
    assert code([("content-type", structured + b"; x=\xff")]) is ErrorCode.INVALID_CLOUDEVENT
    e = intake.entry(T0, Rec(4, _request(), headers=[("content-type", structured)]))
    assert e.error is not None and e.error.field == "specversion"


def test_a_framed_record_read_while_the_registry_is_away_is_counted_and_logged() -> None:
    from dgstream.schemas.framing import frame

    # Nothing listens on port 1 of the loopback: the registry is down, not the record bad.
    intake, s, _, _, _ = _intake(
        input_framing="confluent", schema_registry={"url": "http://127.0.0.1:1", "timeout_s": 5}
    )
    e = intake.entry(T0, Rec(3, frame(7, _request("framed"))))
    assert e.error is None and e.request is not None and e.request.id == "framed"
    assert s.metrics.registry_unverified == 1
    assert _log(s).named("registry_unreachable") == [("warning", {"schema_id": 7})]


# ------------------------------------------------------------------ when a batch is due


def test_no_batch_is_due_while_nothing_was_taken() -> None:
    intake, s, _, _, _ = _intake()
    assert intake.due() is None
    s.acc = batch(1)
    assert intake.due() is None


def test_the_batch_goes_at_once_while_the_engine_is_idle() -> None:
    intake, s, _, _, _ = _intake(batching=Batching(max_records=4, max_wait_ms=60_000))
    s.acc = batch(1, (T0, 0))
    assert intake.due() is s.acc
    s.submitted = 1  # the engine is busy with another
    assert intake.due() is None
    s.classified = 1
    assert intake.due() is s.acc


def test_a_busy_engine_gets_the_batch_when_it_is_full_or_has_waited() -> None:
    intake, s, _, _, clock = _intake(batching=Batching(max_records=2, max_wait_ms=60_000))
    s.submitted = 1
    s.acc = batch(1, (T0, 0))
    s.acc.started = clock.now
    assert intake.due() is None
    s.acc.add(batch(2, (T0, 1)).entries[0])
    assert intake.due() is s.acc
    s.acc = batch(3, (T0, 2))
    s.acc.started = clock.now - 59.99  # not quite max_wait_ms
    assert intake.due() is None
    s.acc.started = clock.now - 60.0  # max_wait_ms, to the tick
    assert intake.due() is s.acc


def test_a_suspect_partitions_record_goes_alone_at_once() -> None:
    intake, s, consumer, _, _ = _intake(batching=Batching(max_records=4, max_wait_ms=60_000))
    _suspect(intake, consumer)
    s.submitted = 1
    assert intake.due() is s.acc
    assert s.acc is not None
    assert intake.marks_for(s.acc) == {T0: (0, "dgstream:v1;started=3;alone=1")}


# ------------------------------------------------------------------ fairness


def _fetched(consumer: FakeConsumer, *waiting: Any, fetching: bool = True) -> None:
    """kafka-python's fetcher with fetch responses of `waiting` in line, and a fetch in
    flight to the (one) leader or not; T0 and T1 fetchable."""
    consumer.stand_at({T0: 0, T1: 3})
    consumer._fetcher = SimpleNamespace(
        _completed_fetches=[SimpleNamespace(topic_partition=tp) for tp in waiting],
        _nodes_with_pending_fetch_requests={1} if fetching else set(),
        _next_partition_records=None,
        _manager=SimpleNamespace(cluster=SimpleNamespace(leader_for_partition=lambda tp: 1)),
    )


def _flooded(intake: Intake, consumer: FakeConsumer, records: int) -> None:
    """T0 has filled `records` in a row; T1's fetch response waits behind it."""
    intake.take({T0: [Rec(i, _request(f"f{i}")) for i in range(records)]})
    _fetched(consumer, T1)


def test_a_partition_that_filled_a_batch_while_another_waits_sits_out_one_poll() -> None:
    intake, s, consumer, _, _ = _intake()  # max_records 4
    s.assignment = {T0, T1}
    _flooded(intake, consumer, 4)
    s.acc = None
    consumer.feed({T1: [Rec(3, _request("q"))]})
    assert intake.poll() == {T1: [Rec(3, _request("q"))]}
    assert consumer.polls == [(0, 4)]  # the turn: no waiting, the others' fetched records
    assert consumer.pauses == [("pause", {T0}), ("resume", {T0})]
    assert consumer.paused == set()
    intake.poll()  # the turn is over: an ordinary poll, T0 not paused
    assert consumer.polls[-1] == (IDLE_POLL_MS, 4) and len(consumer.pauses) == 2


def test_an_empty_turn_falls_back_to_an_ordinary_poll() -> None:
    intake, s, consumer, _, _ = _intake()
    s.assignment = {T0, T1}
    _flooded(intake, consumer, 4)
    s.acc = None
    consumer.feed({})  # the turn finds nothing fetched for T1 yet
    consumer.feed({T0: [Rec(4)]})
    assert intake.poll() == {T0: [Rec(4)]}
    assert consumer.polls == [(0, 4), (IDLE_POLL_MS, 4)]


def test_no_turn_below_a_batch_or_when_nobody_waits() -> None:
    intake, s, consumer, _, _ = _intake()
    s.assignment = {T0, T1}
    _flooded(intake, consumer, 3)  # less than a batch in a row
    s.acc = None
    intake.poll()
    assert consumer.pauses == []
    intake.take({T0: [Rec(10, _request("g"))]})  # now a batch in a row
    s.acc = None
    _fetched(consumer, T0)  # ... but only T0's own next response waits, T1 is fetched
    intake.poll()
    assert consumer.pauses == []
    del consumer._fetcher  # nor on a kafka-python without the fetcher's state
    intake.poll()
    assert consumer.pauses == []


def test_a_partition_that_is_not_even_fetched_behind_the_run_gets_a_turn() -> None:
    """kafka-python sends no fetch while any response is in line: T1 is not asked for
    its new records at all while T0's are handed out."""
    intake, s, consumer, _, _ = _intake()
    s.assignment = {T0, T1}
    intake.take({T0: [Rec(i, _request(f"f{i}")) for i in range(4)]})
    _fetched(consumer, T0, fetching=False)
    s.acc = None
    intake.poll()
    assert consumer.pauses == [("pause", {T0}), ("resume", {T0})]


def test_records_of_another_partition_break_the_run() -> None:
    intake, s, consumer, _, _ = _intake()
    s.assignment = {T0, T1}
    intake.take({T0: [Rec(0, _request("a")), Rec(1, _request("b"))]})
    intake.take({T1: [Rec(0, _request("c"))]})
    intake.take({T0: [Rec(2, _request("d")), Rec(3, _request("e"))]})
    _fetched(consumer, T1)
    s.acc = None
    intake.poll()
    assert consumer.pauses == []  # T0's last run is 2 records, not 4

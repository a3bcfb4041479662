"""Recovery without a broker: what each error kind that reaches the consumer thread makes
the worker do (the error table's actions), the commit step, and abandoning open work. A
fake delivery (`stream_fakes.FakeDelivery`) records the commits and aborts asked of it."""

from __future__ import annotations

from typing import Any

import pytest
from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError, NotEnoughReplicasError
from stream_fakes import T0, T1, FakeConsumer, FakeDelivery, Meta, RecordingLog, batch, shared

from dgstream.workers.engine.types import EngineConfigError, FatalEngineError
from dgstream.workers.faults.errors import CommitRefused, OutputFailed, SendFailed, WorkerFailed
from dgstream.workers.faults.outage import Outage, OutageClock
from dgstream.workers.hosting.settings import OutageTuning
from dgstream.workers.stream.recovery import REDO_LIMIT, Recovery
from dgstream.workers.stream.shared import Completions, Shared

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _recovery(
    **overrides: Any,
) -> tuple[Recovery, Shared, Completions, FakeDelivery, FakeConsumer, Clock]:
    s, done, delivery, consumer, clock = (
        shared(**overrides),
        Completions(),
        FakeDelivery(),
        FakeConsumer(),
        Clock(),
    )
    s.outage = OutageClock(s.settings.outage, clock)
    return Recovery(s, done, delivery, consumer), s, done, delivery, consumer, clock


def _log(s: Shared) -> RecordingLog:
    assert isinstance(s.log, RecordingLog)
    return s.log


def _in_flight(s: Shared, *batches: Any) -> None:
    for b in batches:
        for tp in b.last:
            s.offsets.saw(tp, min(e.offset for e in b.entries if e.tp == tp))
        s.offsets.track(b)


# ------------------------------------------------------------------ completions


def test_a_delivered_batch_is_handed_to_delivery_and_becomes_committable() -> None:
    r, s, done, delivery, _, _ = _recovery()
    b = batch(1, (T0, 0), (T0, 1))
    _in_flight(s, b)
    done.done(b)
    r.apply_completions()
    assert delivery.calls == [("delivered", 1)]
    assert s.offsets.ready() == {T0: (2, 1)}
    assert s.failure is None and _log(s).events == []


def test_the_first_batch_through_ends_an_outage() -> None:
    r, s, done, _, _, clock = _recovery()
    s.outage.hit(Outage("engine", "down"))
    s.metrics.record_outage_try("engine")
    clock.now += 2.34567
    done.done(batch(1, (T0, 0)))
    r.apply_completions()
    assert not s.outage.active and s.metrics.outage is None
    assert _log(s).named("outage_over") == [
        ("info", {"kind": "engine", "tries": 1, "lasted_s": 2.346})
    ]


def test_an_outage_abandons_the_open_work_and_holds_new_work_for_the_pause() -> None:
    tuning = OutageTuning(initial_backoff_s=0.1234, max_backoff_s=10, budget_s=60)
    r, s, done, delivery, _, clock = _recovery(outage=tuning)
    b1, b2 = batch(1, (T0, 5), (T0, 6)), batch(2, (T1, 9))
    _in_flight(s, b1, b2)
    message = "x" * 400
    done.failed(b1, Outage("engine", message))
    r.apply_completions()
    assert b1.cancelled and b2.cancelled and delivery.names() == ["abort"]
    assert s.rewind == {T0: 5, T1: 9} and s.offsets.in_flight == 0
    assert s.outage.tries == 1 and s.outage.holding() and s.outage.kind == "engine"
    assert s.metrics.outage_tries == 1 and s.metrics.outage == "engine"
    assert _log(s).named("outage") == [
        ("warning", {"kind": "engine", "tries": 1, "pause_s": 0.123, "error": "x" * 300})
    ]
    ((level, fields),) = _log(s).named("open_work_abandoned")
    assert level == "warning" and fields["reason"] == f"engine unavailable: {message}"
    assert fields["batches"] == 2 and fields["partitions"] == ["in-0", "in-1"]
    clock.now += 0.2
    assert not s.outage.holding() and s.failure is None


def test_an_outage_past_its_budget_writes_the_attempts_back_and_fails() -> None:
    r, s, done, delivery, _, clock = _recovery(outage=OutageTuning(budget_s=5))
    s.assignment = {T0}
    s.poison.first_seen(T0, 0, 0, "dgstream:v1;started=1;alone=0")  # counted at T0 = 0
    b = batch(1, (T0, 0))
    _in_flight(s, b)
    s.outage.hit(Outage("output", "no leader"))
    clock.now += 6
    done.failed(b, SendFailed(NotEnoughReplicasError("no ISR")))
    r.apply_completions()
    assert delivery.names() == ["abort", "commit"]
    assert delivery.calls[1] == ("commit", {}, True, {T0: (0, "dgstream:v1;started=1;alone=0")})
    assert isinstance(s.failure, WorkerFailed)
    assert str(s.failure) == (
        "output unavailable: NotEnoughReplicasError: [Error 19] NotEnoughReplicasError: "
        "no ISR for longer than the outage budget (5 s)"
    )
    assert _log(s).named("outage") == []  # no pause announced: it fails
    ((_, fields),) = _log(s).named("open_work_abandoned")
    assert fields["reason"] == (
        "output unavailable: NotEnoughReplicasError: [Error 19] NotEnoughReplicasError: no ISR"
    )


def test_an_outage_past_its_budget_fails_even_when_the_write_back_cannot_commit() -> None:
    r, s, done, delivery, _, clock = _recovery(outage=OutageTuning(budget_s=5))
    s.assignment = {T0}
    s.poison.first_seen(T0, 0, 0, "")
    s.outage.hit(Outage("engine", "down"))
    clock.now += 6
    delivery.commit_error = KafkaTimeoutError("the coordinator is out of reach too")
    done.failed(batch(1, (T0, 0)), Outage("engine", "still down"))
    r.apply_completions()
    assert (
        str(s.failure) == "engine unavailable: still down for longer than the outage budget (5 s)"
    )


def test_an_outage_with_nothing_to_write_back_commits_nothing() -> None:
    r, s, done, delivery, _, clock = _recovery(outage=OutageTuning(budget_s=5))
    s.outage.hit(Outage("engine", "down"))
    clock.now += 6
    done.failed(batch(1, (T0, 0)), Outage("engine", "still down"))
    r.apply_completions()
    assert delivery.calls == [] and isinstance(s.failure, WorkerFailed)


def test_an_output_refused_for_good_is_read_again_at_once() -> None:
    r, s, done, delivery, _, _ = _recovery()
    b = batch(1, (T0, 3))
    _in_flight(s, b)
    done.failed(b, SendFailed(MessageSizeTooLargeError("too large"), "an output to 'out' failed"))
    r.apply_completions()
    assert delivery.names() == ["abort", "after_failed_send"]
    assert s.rewind == {T0: 3} and not s.outage.active and s.failure is None
    ((_, fields),) = _log(s).named("open_work_abandoned")
    assert fields["reason"] == (
        "an output to 'out' failed: MessageSizeTooLargeError: [Error 10] "
        "MessageSizeTooLargeError: too large"
    )


def test_refusals_that_keep_coming_back_become_an_output_outage() -> None:
    r, s, done, delivery, _, _ = _recovery()
    for seq in range(1, REDO_LIMIT + 2):
        b = batch(seq, (T0, seq))
        _in_flight(s, b)
        done.failed(b, SendFailed(MessageSizeTooLargeError("again")))
        r.apply_completions()
        assert s.outage.active is (seq > REDO_LIMIT)
    assert delivery.names().count("after_failed_send") == REDO_LIMIT
    assert s.outage.kind == "output" and s.outage.tries == 1
    assert s.outage.error == (
        "outputs keep failing: an output failed: MessageSizeTooLargeError: [Error 10] "
        "MessageSizeTooLargeError: again"
    )


def test_a_long_refusal_is_cut_to_500_characters_in_the_outage() -> None:
    r, s, done, _, _, _ = _recovery()
    for seq in range(1, REDO_LIMIT + 2):
        b = batch(seq, (T0, seq))
        _in_flight(s, b)
        done.failed(b, SendFailed(MessageSizeTooLargeError("x" * 1000)))
        r.apply_completions()
    assert len(s.outage.error) == 500
    assert s.outage.error.startswith("outputs keep failing: an output failed: ")


def test_a_commit_in_between_starts_the_count_of_refusals_again() -> None:
    r, s, done, delivery, _, _ = _recovery()
    for seq in range(1, 2 * REDO_LIMIT + 1):
        if seq == REDO_LIMIT + 1:
            good = batch(100, (T1, 0))
            _in_flight(s, good)
            done.done(good)
            r.settle(sync=True)
            assert delivery.calls[-1] == ("commit", {T1: (1, 1)}, True, {})
        b = batch(seq, (T0, seq))
        _in_flight(s, b)
        done.failed(b, SendFailed(MessageSizeTooLargeError("again")))
        r.apply_completions()
    assert not s.outage.active
    assert delivery.names().count("after_failed_send") == 2 * REDO_LIMIT


def test_an_output_outage_of_a_send_backs_off_without_a_redo() -> None:
    r, s, done, delivery, _, _ = _recovery()
    b = batch(1, (T0, 0))
    _in_flight(s, b)
    done.failed(b, SendFailed(KafkaTimeoutError("no metadata")))
    r.apply_completions()
    assert delivery.names() == ["abort"] and s.outage.kind == "output"
    assert s.outage.error == "KafkaTimeoutError: KafkaTimeoutError: no metadata"


def test_a_retriable_error_raised_by_a_send_itself_is_an_output_outage() -> None:
    r, s, done, _, _, _ = _recovery()
    done.failed(batch(1, (T0, 0)), KafkaTimeoutError("max_block_ms"))
    r.apply_completions()
    assert s.outage.kind == "output" and s.failure is None


@pytest.mark.parametrize(
    "error",
    [FatalEngineError("the GPU fell off"), EngineConfigError("bad"), ValueError("a bug")],
    ids=["fatal", "config", "bug"],
)
def test_a_broken_engine_or_a_bug_fails_the_replica(error: BaseException) -> None:
    r, s, done, delivery, _, _ = _recovery()
    done.failed(batch(1, (T0, 0)), error)
    done.failed(batch(2, (T0, 1)), ValueError("a later one"))
    r.apply_completions()
    assert s.failure is error  # the first one sticks
    assert delivery.calls == []


def test_an_abandoned_batch_reports_only_a_broken_engine() -> None:
    r, s, done, delivery, _, _ = _recovery()
    quiet, loud = batch(1, (T0, 0)), batch(2, (T0, 1))
    quiet.cancelled = loud.cancelled = True
    done.failed(quiet, ValueError("after the abandon"))
    done.done(quiet)  # an acknowledgement that raced the abandon
    r.apply_completions()
    assert s.failure is None and done.last_error is None
    assert delivery.calls == [("delivered", 1)]
    done.failed(loud, FatalEngineError("broken"))
    r.apply_completions()
    assert isinstance(s.failure, FatalEngineError)


def test_the_queue_keeps_a_batchs_first_ending_only() -> None:
    r, s, done, _, _, _ = _recovery()
    b = batch(1, (T0, 0))
    done.failed(b, ValueError("first"))
    done.failed(b, FatalEngineError("second"))
    r.apply_completions()
    assert isinstance(s.failure, ValueError) and done.last_error == "ValueError: first"


# ------------------------------------------------------------------ the commit step


def test_settling_commits_the_done_prefix_and_retires_it() -> None:
    r, s, done, delivery, _, _ = _recovery()
    s.poison.first_seen(T0, 0, 0, "dgstream:v1;started=1;alone=0")
    b1, b2 = batch(1, (T0, 0)), batch(2, (T0, 1))
    _in_flight(s, b1, b2)
    s.metrics.set_in_flight(2)
    done.done(b1)
    r.settle(sync=False, marks={T1: (4, "m")})
    assert delivery.calls[-1] == ("commit", {T0: (1, 1)}, False, {T1: (4, "m")})
    assert s.offsets.committed == {T0: 1} and s.offsets.in_flight == 1
    assert s.metrics.in_flight == 1
    assert s.poison.write_back({T0})[T0][0] == 1  # the guard's count moved to the commit


def test_settling_with_nothing_done_retires_nothing() -> None:
    r, s, _, delivery, _, _ = _recovery()
    _in_flight(s, batch(1, (T0, 0)))
    s.metrics.set_in_flight(1)
    r.settle(sync=True)
    assert delivery.calls == [("commit", {}, True, {})]
    assert s.offsets.in_flight == 1 and s.offsets.committed == {}


def test_settling_commits_an_idle_partition_up_to_the_consumers_position() -> None:
    r, s, done, delivery, consumer, _ = _recovery()
    s.assignment = {T0, T1}
    b = batch(1, (T0, 0), (T1, 4))
    _in_flight(s, b)
    done.done(b)
    r.settle(sync=True)
    assert s.offsets.committed == {T0: 1, T1: 5}
    # The fetcher passed what it never returns (a transaction's marker, aborted records)
    # in both; T1's last poll was dropped for a rewind, so its position proves nothing.
    consumer.stand_at({T0: 3, T1: 7})
    s.rewind[T1] = 5
    r.settle(sync=False)  # the rebalance listener reads no positions
    r.settle(sync=True)
    assert delivery.calls[-2:] == [("commit", {}, False, {}), ("commit", {T0: (3, 0)}, True, {})]
    assert s.offsets.committed == {T0: 3, T1: 5} and s.offsets.in_flight == 0
    # Records of T1 polled and not yet sent (the batch being filled): not idle either.
    s.rewind.clear()
    s.acc = batch(2, (T1, 7))
    r.settle(sync=True)
    assert delivery.calls[-1] == ("commit", {}, True, {})
    assert s.offsets.committed == {T0: 3, T1: 5}


def test_settling_after_a_failure_commits_nothing() -> None:
    r, s, done, delivery, _, _ = _recovery()
    b = batch(1, (T0, 0))
    _in_flight(s, b)
    done.done(b)
    s.fail(WorkerFailed("earlier"))
    r.settle(sync=True)
    assert delivery.calls == [("delivered", 1)]


def test_a_refused_commit_abandons_the_open_work_and_the_member_carries_on() -> None:
    r, s, done, delivery, _, _ = _recovery()
    b = batch(1, (T0, 7))
    _in_flight(s, b)
    done.done(b)
    delivery.commit_error = CommitRefused("not a member of the group now")
    r.settle(sync=True)
    assert delivery.names() == ["delivered", "abort"] and b.cancelled
    assert s.rewind == {T0: 7} and s.failure is None and not s.outage.active
    ((_, fields),) = _log(s).named("open_work_abandoned")
    assert fields["reason"] == "not a member of the group now"


@pytest.mark.parametrize(
    ("cause", "outage"),
    [(NotEnoughReplicasError("no ISR"), True), (MessageSizeTooLargeError("big"), False)],
    ids=["outage", "refusal"],
)
def test_a_transaction_whose_output_failed_is_handled_by_that_output_error(
    cause: BaseException, outage: bool
) -> None:
    r, s, _, delivery, _, _ = _recovery()
    b = batch(1, (T0, 7))
    _in_flight(s, b)
    delivery.commit_error = OutputFailed(cause)
    r.settle(sync=True)
    assert b.cancelled and s.outage.active is outage
    assert (("after_failed_send",) in delivery.calls) is not outage  # a redo


def test_a_commit_that_must_fail_the_replica_is_raised() -> None:
    r, _, _, delivery, _, _ = _recovery()
    delivery.commit_error = WorkerFailed("fenced: another live member")
    with pytest.raises(WorkerFailed, match="fenced"):
        r.settle(sync=True)


def test_a_new_member_id_abandons_the_work_fetched_under_the_old_one() -> None:
    r, s, _, delivery, consumer, _ = _recovery()
    r.settle(sync=True)  # the work is fetched under m-1
    b = batch(1, (T0, 4))
    _in_flight(s, b)
    consumer.meta = Meta(member_id="m-2")
    r.settle(sync=True)
    assert delivery.names() == ["commit", "abort", "commit"] and b.cancelled
    ((_, fields),) = _log(s).named("open_work_abandoned")
    assert fields["reason"] == "member id changed from m-1 to m-2"
    r.settle(sync=True)  # m-2 is the member now: nothing more is abandoned
    assert delivery.names().count("abort") == 1


def test_out_of_the_group_or_no_metadata_abandons_nothing() -> None:
    r, s, _, delivery, consumer, _ = _recovery()
    r.settle(sync=True)
    _in_flight(s, batch(1, (T0, 4)))
    consumer.meta = Meta(member_id="")  # out of the group: not a new member yet
    r.settle(sync=True)
    consumer.meta = RuntimeError("closed")
    r.settle(sync=True)
    consumer.meta = Meta(member_id="m-1")
    r.settle(sync=True)
    assert "abort" not in delivery.names()
    assert delivery.names() == ["commit"] * 4


# ------------------------------------------------------------------ abandoning


def test_abandoning_with_nothing_polled_aborts_nothing() -> None:
    r, s, _, delivery, _, _ = _recovery()
    r.abandon("nothing there")
    assert delivery.calls == [] and _log(s).events == [] and s.rewind == {}


def test_abandoning_drops_the_batch_being_filled_and_rewinds_its_partitions() -> None:
    r, s, _, delivery, _, _ = _recovery()
    s.offsets.saw(T1, 20)
    s.acc = batch(1, (T1, 20), (T1, 21))
    s.rewind = {T1: 25}
    r.abandon("stopping")
    assert s.acc is None and s.rewind == {T1: 20} and delivery.names() == ["abort"]
    ((_, fields),) = _log(s).named("open_work_abandoned")
    assert fields == {"reason": "stopping", "batches": 0, "partitions": ["in-1"]}


def test_abandoning_covers_the_batches_in_flight_and_the_one_being_filled() -> None:
    r, s, _, _, _, _ = _recovery()
    flying = batch(1, (T0, 3))
    _in_flight(s, flying)
    s.offsets.saw(T1, 8)
    s.acc = batch(2, (T1, 8))
    r.abandon("both")
    assert s.rewind == {T0: 3, T1: 8} and flying.cancelled and s.acc is None
    assert s.offsets.in_flight == 0
    ((_, fields),) = _log(s).named("open_work_abandoned")
    assert fields["batches"] == 1 and fields["partitions"] == ["in-0", "in-1"]


def test_a_rewind_goes_to_the_committed_offset_and_keeps_an_earlier_one() -> None:
    r, s, done, _, _, _ = _recovery()
    first = batch(1, (T0, 0))
    _in_flight(s, first)
    done.done(first)
    r.settle(sync=True)  # committed: 1
    s.rewind = {T0: 0}  # an earlier abandon, not applied yet
    _in_flight(s, batch(2, (T0, 1)))
    r.abandon("again")
    assert s.rewind == {T0: 0}
    s.rewind = {}
    _in_flight(s, batch(3, (T0, 1)))
    r.abandon("once more")
    assert s.rewind == {T0: 1}


def test_a_partition_with_no_known_start_is_not_rewound() -> None:
    r, s, _, _, _, _ = _recovery()
    b = batch(1, (T0, 3))
    s.offsets.track(b)  # never `saw`: no lag base
    r.abandon("lost")
    assert s.rewind == {} and b.cancelled and s.offsets.in_flight == 0


def test_abandoning_keeps_the_committed_offsets_and_counts_the_slots_free() -> None:
    r, s, done, _, _, _ = _recovery()
    first = batch(1, (T0, 0))
    _in_flight(s, first)
    done.done(first)
    r.settle(sync=True)
    _in_flight(s, batch(2, (T0, 1)), batch(3, (T0, 2)))
    s.metrics.set_in_flight(2)
    r.abandon("x")
    assert s.offsets.committed == {T0: 1} and s.offsets.in_flight == 0
    assert s.metrics.in_flight == 0


def test_a_fenced_abort_fails_the_replica_and_the_work_is_still_forgotten() -> None:
    r, s, _, delivery, _, _ = _recovery()
    b = batch(1, (T0, 3))
    _in_flight(s, b)
    delivery.abort_error = WorkerFailed("fenced: another producer with this transactional id")
    r.abandon("revoke timeout")
    assert isinstance(s.failure, WorkerFailed) and "fenced" in str(s.failure)
    assert b.cancelled and s.offsets.in_flight == 0
    assert len(_log(s).named("open_work_abandoned")) == 1

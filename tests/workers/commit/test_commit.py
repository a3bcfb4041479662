"""The commit path without a broker: the offset tracker's contiguous prefixes, and the order
of the committers' Kafka calls (fakes of kafka-python's clients, `tests/kafka_fakes.py`)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kafka import TopicPartition
from kafka.errors import (
    CommitFailedError,
    FencedInstanceIdError,
    KafkaError,
    KafkaTimeoutError,
    NotEnoughReplicasError,
    ProducerFencedError,
)
from kafka_fakes import Calls, FakeConsumer, FakeProducer

from dgstream.workers.commit import AtLeastOnceCommitter, ExactlyOnceCommitter, OffsetTracker
from dgstream.workers.faults.errors import CommitRefused, OutputFailed, WorkerFailed
from dgstream.workers.hosting.logs import get_logger
from dgstream.workers.steps.batches import Batch, Entry, Output

pytestmark = pytest.mark.unit

T0, T1 = TopicPartition("in", 0), TopicPartition("in", 1)


def _batch(seq: int, *records: tuple[TopicPartition, int]) -> Batch:
    b = Batch(seq)
    for tp, off in records:
        b.add(Entry(tp, off, None, b"{}", 0))
    return b


def _output(b: Batch) -> Output:
    return Output("out", b"k%d" % b.seq, b"v", [], b.entries[0], None)


# --------------------------------------------------------------------------- the tracker


@pytest.mark.parametrize(
    ("tracked", "committed", "position", "expected"),
    [
        (False, 10, 12, {T0: (12, 0)}),  # past a marker and an aborted record: committed
        (False, 10, 10, {}),  # nothing skipped since the commit
        (False, 10, 9, {}),  # behind the commit (a rewind under way): never backwards
        (False, None, 12, {}),  # never committed here: where its work began is unknown
        (True, 10, 12, {}),  # a batch of it in flight: its own prefix decides
    ],
    ids=["skipped-tail", "caught-up", "behind", "never-committed", "in-flight"],
)
def test_an_idle_partition_commits_up_to_the_consumers_position(
    tracked: bool, committed: int | None, position: int, expected: dict[TopicPartition, Any]
) -> None:  # see also test_done_batches_commit_up_to_the_position_past_their_marker
    t = OffsetTracker()
    if committed is not None:
        t.committed[T0] = committed
    if tracked:
        t.track(_batch(1, (T0, 10)))
    assert t.ready({T0: position}) == expected
    assert t.ready() == {}  # without positions, as before
    t.retire(t.ready({T0: position}))
    assert t.committed.get(T0) == (12 if expected else committed)
    assert t.in_flight == (1 if tracked else 0)


@pytest.mark.parametrize(
    ("done", "position", "expected"),
    [
        ((True, True), 14, {T0: (14, 2)}),  # past the last transaction's marker: at once
        ((True, True), 13, {T0: (13, 2)}),  # no marker: the batches' own offset
        ((True, True), None, {T0: (13, 2)}),  # no position known (a rewind, or held)
        ((True, False), 14, {T0: (11, 1)}),  # a later batch open: only the done prefix
        ((False, True), 14, {}),  # the oldest open: nothing
    ],
    ids=["past-marker", "no-marker", "no-position", "later-open", "oldest-open"],
)
def test_done_batches_commit_up_to_the_position_past_their_marker(
    done: tuple[bool, bool], position: int | None, expected: dict[TopicPartition, Any]
) -> None:
    """One commit, not two: the batches' records and the marker after them (behind a
    transactional upstream every transaction ends in one) go in the same commit, never
    past a batch still open."""
    t = OffsetTracker()  # never committed: the batches say where the work began
    b1, b2 = _batch(1, (T0, 10)), _batch(2, (T0, 11), (T0, 12))
    for b, d in zip((b1, b2), done, strict=True):
        t.track(b)
        b.done = d
    idle = {} if position is None else {T0: position}
    assert t.ready(idle) == expected
    t.retire(t.ready(idle))
    assert t.committed.get(T0) == (expected[T0][0] if expected else None)
    assert t.ready(idle) == {}  # nothing left to commit until more is done or read


def test_a_partition_commits_only_its_contiguous_done_prefix() -> None:
    t = OffsetTracker()
    b1, b2, b3 = _batch(1, (T0, 0), (T0, 1)), _batch(2, (T0, 2)), _batch(3, (T0, 3))
    for b in (b1, b2, b3):
        t.track(b)
    b2.done = b3.done = True  # later batches finished first
    assert t.ready() == {}  # committing 4 would skip offsets 0-1 on a crash
    b1.done = True
    assert t.ready() == {T0: (4, 3)}
    t.retire(t.ready())
    assert t.committed == {T0: 4} and t.in_flight == 0 and t.ready() == {}


def test_a_batch_of_two_partitions_holds_its_slot_until_both_are_committed() -> None:
    t = OffsetTracker()
    both, later = _batch(1, (T0, 5), (T1, 7)), _batch(2, (T1, 8))
    t.track(both)
    t.track(later)
    both.done = True
    assert t.ready() == {T0: (6, 1), T1: (8, 1)}
    t.retire({T0: (6, 1)})  # only one partition's commit went through
    assert t.in_flight == 2 and t.committed == {T0: 6}
    t.retire({T1: (8, 1)})
    assert t.in_flight == 1  # `later` is still open
    assert t.ready() == {}


def test_forgetting_partitions_abandons_their_batches() -> None:
    t = OffsetTracker()
    t.saw(T0, 10)
    assert t.lag_base(T0) == 10  # nothing committed yet: the first offset polled
    a, b = _batch(1, (T0, 10)), _batch(2, (T0, 11), (T1, 0))
    t.track(a)
    t.track(b)
    a.done = True
    t.retire(t.ready())
    assert t.lag_base(T0) == 11
    assert t.forget({T0}) == 1  # b's T0 part; b still holds T1
    assert t.in_flight == 1 and T0 not in t.committed and t.lag_base(T0) is None
    assert t.forget({T1}, keep_committed=True) == 1
    assert t.in_flight == 0


# --------------------------------------------------------------------------- at-least-once


def _alo() -> tuple[Calls, AtLeastOnceCommitter, OffsetTracker, Batch]:
    calls = Calls()
    committer = AtLeastOnceCommitter(FakeConsumer(calls), get_logger(), timeout_s=5)
    tracker = OffsetTracker()
    b = _batch(1, (T0, 0), (T1, 3))
    tracker.track(b)
    return calls, committer, tracker, b


def test_at_least_once_commits_nothing_until_acknowledged_then_the_next_offsets() -> None:
    calls, committer, tracker, b = _alo()
    assert committer.commit(tracker.ready, sync=True) == {}
    assert calls.events == []
    b.done = True
    assert committer.commit(tracker.ready, sync=True) == {T0: (1, 1), T1: (4, 1)}
    assert calls.names() == ["commit"]
    assert calls.events[0][1:] == ({T0: 1, T1: 4}, 5000)  # bounded: 5 s
    # The listener's commits do not wait.
    committer.commit(tracker.ready, sync=False)
    assert calls.names() == ["commit", "commit_async"]


@pytest.mark.parametrize("error", [CommitFailedError("rebalancing"), KafkaError("timeout")])
def test_at_least_once_a_failed_commit_is_tried_again_later(error: Exception) -> None:
    calls, committer, tracker, b = _alo()
    b.done = True
    calls.fail["commit"] = error
    assert committer.commit(tracker.ready, sync=True) == {}
    del calls.fail["commit"]
    assert committer.commit(tracker.ready, sync=True) == {T0: (1, 1), T1: (4, 1)}


def test_at_least_once_a_fenced_static_member_stops() -> None:
    calls, committer, tracker, b = _alo()
    b.done = True
    calls.fail["commit"] = FencedInstanceIdError()
    with pytest.raises(WorkerFailed, match="fenced"):
        committer.commit(tracker.ready, sync=True)


# --------------------------------------------------------------------------- exactly-once


def _eos(
    timeout_s: float = 5.0,
) -> tuple[Calls, ExactlyOnceCommitter, OffsetTracker, FakeConsumer]:
    calls = Calls()
    consumer = FakeConsumer(calls, {T0, T1})
    committer = ExactlyOnceCommitter(FakeProducer(calls), consumer, timeout_s)
    committer.start()
    return calls, committer, OffsetTracker(), consumer


def test_exactly_once_commit_is_flush_then_offsets_then_commit_then_begin() -> None:
    calls, committer, tracker, _ = _eos()
    assert calls.names() == ["init_transactions", "begin_transaction"]
    b = _batch(1, (T0, 0), (T1, 3))
    tracker.track(b)
    assert committer.commit(tracker.ready) == {}  # nothing sent: no transaction to commit
    committer.send(b, [_output(b)])
    assert committer.in_transaction() == {id(b)}
    done = committer.commit(tracker.ready)
    assert done == {T0: (1, 1), T1: (4, 1)} and b.done
    assert calls.names()[2:] == [
        "send",
        "flush",
        "send_offsets_to_transaction",
        "commit_transaction",
        "begin_transaction",
    ]
    assert 0 < calls.events[3][1] <= 5.0  # the flush is bounded too
    offsets, member = calls.events[4][1:]
    assert offsets == {T0: 1, T1: 4} and member == (1, "member-1")


def test_exactly_once_a_send_racing_a_commit_goes_into_the_next_transaction() -> None:
    """The engine loop sends while the consumer thread commits: the late batch's outputs
    must not be committed without its offsets."""
    calls, committer, tracker, _ = _eos()
    first, late = _batch(1, (T0, 0)), _batch(2, (T0, 1))
    tracker.track(first)
    tracker.track(late)
    committer.send(first, [_output(first)])
    racer = threading.Thread(target=committer.send, args=(late, [_output(late)]))

    def race() -> None:
        racer.start()
        racer.join(0.2)  # without the lock, the send lands here, inside the commit

    calls.during["commit_transaction"] = race
    assert committer.commit(tracker.ready) == {T0: (1, 1)}
    racer.join(5)
    assert not late.done
    i = calls.names().index("commit_transaction")
    assert calls.names()[i + 1 :] == ["begin_transaction", "send"]  # after the commit
    tracker.retire({T0: (1, 1)})
    assert committer.commit(tracker.ready) == {T0: (2, 1)}


@pytest.mark.parametrize("step", ["send_offsets_to_transaction", "commit_transaction"])
def test_exactly_once_a_fenced_producer_stops_the_worker(step: str) -> None:
    """Another incarnation took the transactional id: this one must stop (the new one has
    aborted what this one left open)."""
    calls, committer, tracker, _ = _eos()
    b = _batch(1, (T0, 0))
    tracker.track(b)
    committer.send(b, [_output(b)])
    calls.fail[step] = ProducerFencedError()
    with pytest.raises(WorkerFailed, match="transaction commit failed"):
        committer.commit(tracker.ready)
    assert "begin_transaction" not in calls.names()[2:]


def test_exactly_once_a_failed_output_makes_the_commit_abortable() -> None:
    """kafka-python fails the commit with the error of an output that could not be
    produced: the worker aborts and handles the cause (an outage, a bad reply topic)."""
    calls, committer, tracker, _ = _eos()
    b = _batch(1, (T0, 0))
    tracker.track(b)
    committer.send(b, [_output(b)])
    calls.fail["commit_transaction"] = KafkaError("NotEnoughReplicas")
    with pytest.raises(OutputFailed) as caught:
        committer.commit(tracker.ready)
    assert "NotEnoughReplicas" in str(caught.value.cause)


def test_exactly_once_an_output_that_failed_stops_the_commit_before_the_offsets() -> None:
    """kafka-python would wait forever to add offsets to a transaction whose output failed:
    the committer looks at the outputs first."""
    calls, committer, tracker, _ = _eos()
    calls.fail["delivery"] = NotEnoughReplicasError()
    b = _batch(1, (T0, 0))
    tracker.track(b)
    committer.send(b, [_output(b)])
    with pytest.raises(OutputFailed) as caught:
        committer.commit(tracker.ready)
    assert isinstance(caught.value.cause, NotEnoughReplicasError)
    assert "send_offsets_to_transaction" not in calls.names()


def test_exactly_once_a_send_that_raised_breaks_the_transaction_until_aborted() -> None:
    """Part of a batch's outputs are in the transaction: it must not be committed."""
    calls, committer, tracker, _ = _eos()
    good, bad = _batch(1, (T0, 0)), _batch(2, (T0, 1))
    tracker.track(good)
    tracker.track(bad)
    committer.send(good, [_output(good)])
    calls.fail["send"] = KafkaTimeoutError("no metadata for the output topic")
    with pytest.raises(KafkaTimeoutError):
        committer.send(bad, [_output(bad)])
    del calls.fail["send"]
    with pytest.raises(OutputFailed):
        committer.commit(tracker.ready)
    assert "commit_transaction" not in calls.names()
    committer.abort()
    assert committer.commit(tracker.ready) == {}  # usable again, nothing in it


def _sent_batch(committer: ExactlyOnceCommitter, tracker: OffsetTracker) -> Batch:
    b = _batch(1, (T0, 0), (T1, 3))
    tracker.track(b)
    committer.send(b, [_output(b)])
    return b


@pytest.mark.parametrize(
    ("generation", "member"), [(-1, ""), (-1, "member-1"), (3, "")], ids=["reset", "gen", "id"]
)
def test_exactly_once_a_member_out_of_the_group_commits_nothing(
    generation: int, member: str
) -> None:
    """After UNKNOWN_MEMBER_ID kafka-python resets the generation to -1 and the member id
    to "" until it rejoins; a transactional offset commit carrying those is not checked
    against the group by the coordinator, so a zombie would commit for partitions that
    another member now owns. The committer refuses before any call."""
    calls, committer, tracker, consumer = _eos()
    _sent_batch(committer, tracker)
    consumer.meta.generation_id, consumer.meta.member_id = generation, member
    with pytest.raises(CommitRefused, match="not a member"):
        committer.commit(tracker.ready)
    assert calls.names()[-1] == "flush"  # no offsets sent, nothing committed


def test_exactly_once_offsets_of_a_partition_no_longer_owned_are_refused() -> None:
    calls, committer, tracker, consumer = _eos()
    _sent_batch(committer, tracker)
    consumer._assignment = {T0}
    with pytest.raises(CommitRefused, match="in-1"):
        committer.commit(tracker.ready)
    assert "commit_transaction" not in calls.names()


def test_exactly_once_a_stale_generation_refused_by_the_coordinator_is_abortable() -> None:
    calls, committer, tracker, _ = _eos()
    _sent_batch(committer, tracker)
    calls.fail["send_offsets_to_transaction"] = CommitFailedError("ILLEGAL_GENERATION")
    with pytest.raises(CommitRefused, match="refused"):
        committer.commit(tracker.ready)
    assert "commit_transaction" not in calls.names()


@pytest.mark.parametrize("step", ["send_offsets_to_transaction", "commit_transaction"])
def test_exactly_once_a_commit_that_hangs_gives_up_in_time(step: str) -> None:
    """kafka-python waits on these without a bound; a broker that never answers must not
    hold the worker forever."""
    calls, committer, tracker, _ = _eos(timeout_s=0.3)
    _sent_batch(committer, tracker)
    release = threading.Event()
    calls.during[step] = lambda: release.wait(30)
    try:
        with pytest.raises(WorkerFailed, match=f"{step} did not complete in 0.3 s"):
            committer.commit(tracker.ready)
    finally:
        release.set()


def test_exactly_once_abort_cancels_the_batches_in_flight() -> None:
    """A batch still in the engine when the transaction is aborted must not send into the
    next one (it would be committed there without its offsets)."""
    calls, committer, tracker, _ = _eos()
    sent = _sent_batch(committer, tracker)
    late = _batch(2, (T0, 1))

    def cancel() -> None:
        sent.cancelled = late.cancelled = True

    committer.abort(cancel)
    assert committer.in_transaction() == set()
    assert calls.names()[-2:] == ["abort_transaction", "begin_transaction"]
    assert committer.send(late, [_output(late)]) is None
    assert calls.names()[-1] == "begin_transaction"  # nothing sent
    assert committer.commit(tracker.ready) == {}

"""The commit path's details that a regression would get wrong without a crash: what a
commit carries beside the offsets (the poison marks' metadata, the leader epoch), which
records a send carries, what an error says, how long a flush waits, and the tracker's
edges (partitions it never saw). Broker-free, with the fakes of `tests/kafka_fakes.py`."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kafka import TopicPartition
from kafka.errors import KafkaError, KafkaTimeoutError, ProducerFencedError
from kafka.structs import OffsetAndMetadata
from kafka_fakes import Calls, FakeConsumer, FakeProducer

from dgstream.workers.commit import AtLeastOnceCommitter, ExactlyOnceCommitter, OffsetTracker
from dgstream.workers.commit.committers import CallTimedOut, bounded
from dgstream.workers.faults.errors import CommitRefused, OutputFailed, WorkerFailed
from dgstream.workers.steps.batches import Batch, Entry, Output

pytestmark = pytest.mark.unit

T0, T1, T2 = TopicPartition("in", 0), TopicPartition("in", 1), TopicPartition("in", 2)


def _batch(seq: int, *records: tuple[TopicPartition, int]) -> Batch:
    b = Batch(seq)
    for tp, off in records:
        b.add(Entry(tp, off, None, b"{}", 0))
    return b


class _Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


# --------------------------------------------------------------------------- metadata


def test_at_least_once_commits_the_marks_metadata_and_progress_where_work_is_done() -> None:
    calls, log = Calls(), _Log()
    consumer = FakeConsumer(calls)
    committer = AtLeastOnceCommitter(consumer, log, 5.0, lambda tp, off: f"{tp.partition}@{off}")
    tracker = OffsetTracker()
    b = _batch(1, (T0, 4))
    tracker.track(b)
    b.done = True
    committer.commit(tracker.ready, sync=True, marks={T2: (7, "poison:3")})
    assert consumer.committed == {
        T0: OffsetAndMetadata(5, f"{T0.partition}@5", -1),
        T2: OffsetAndMetadata(7, "poison:3", -1),
    }


def test_exactly_once_sends_the_marks_metadata_into_the_transaction() -> None:
    calls = Calls()
    producer = FakeProducer(calls)
    consumer = FakeConsumer(calls, {T0, T2})
    committer = ExactlyOnceCommitter(producer, consumer, 5.0, lambda tp, off: f"p{off}")
    committer.start()
    tracker = OffsetTracker()
    b = _batch(1, (T0, 4))
    tracker.track(b)
    committer.send(b, [Output("out", b"key", b"value", [("h", b"1")], b.entries[0], None)])
    committer.commit(tracker.ready, marks={T2: (7, "poison:3")})
    assert producer.offsets == {
        T0: OffsetAndMetadata(5, "p5", -1),
        T2: OffsetAndMetadata(7, "poison:3", -1),
    }
    # The output went out whole: topic, value, key and headers.
    assert producer.sent == [("out", b"value", b"key", [("h", b"1")])]


def test_at_least_once_a_failed_commit_is_logged_with_its_error() -> None:
    calls, log = Calls(), _Log()
    committer = AtLeastOnceCommitter(FakeConsumer(calls), log, 5.0)
    tracker = OffsetTracker()
    b = _batch(1, (T0, 0))
    tracker.track(b)
    b.done = True
    error = KafkaError("the coordinator moved")
    calls.fail["commit"] = error
    assert committer.commit(tracker.ready, sync=True) == {}
    assert log.warnings == [("commit_failed", {"error": f"KafkaError: {error}"})]


# --------------------------------------------------------------------------- errors


def _eos(**producer: Any) -> tuple[Calls, FakeProducer, ExactlyOnceCommitter, OffsetTracker]:
    calls = Calls()
    fake = FakeProducer(calls, **producer)
    committer = ExactlyOnceCommitter(fake, FakeConsumer(calls, {T0, T1}), 5.0)
    committer.start()
    tracker = OffsetTracker()
    b = _batch(1, (T0, 0), (T1, 3))
    tracker.track(b)
    committer.send(b, [Output("out", b"k", b"v", [], b.entries[0], None)])
    return calls, fake, committer, tracker


def test_a_send_that_raised_fails_the_commit_with_that_error() -> None:
    calls, _, committer, tracker = _eos()
    boom = KafkaError("refused at send")
    calls.fail["send"] = boom
    b = _batch(2, (T0, 1))
    tracker.track(b)
    with pytest.raises(KafkaError):
        committer.send(b, [Output("out", b"k", b"v", [], b.entries[0], None)])
    with pytest.raises(OutputFailed) as caught:
        committer.commit(tracker.ready)
    assert caught.value.cause is boom


def test_an_unexpected_commit_error_stops_the_worker_naming_it() -> None:
    calls, _, committer, tracker = _eos()
    calls.fail["commit_transaction"] = RuntimeError("the socket went away")
    with pytest.raises(
        WorkerFailed, match="transaction commit failed: RuntimeError: the socket went away"
    ):
        committer.commit(tracker.ready)


def test_a_flush_that_times_out_fails_the_commit_with_that_timeout() -> None:
    calls, _, committer, tracker = _eos()
    late = KafkaTimeoutError("flush took too long")
    calls.fail["flush"] = late
    with pytest.raises(OutputFailed) as caught:
        committer.commit(tracker.ready)
    assert caught.value.cause is late


def test_the_commit_flushes_again_until_every_output_is_delivered() -> None:
    """kafka-python's flush can return before a batch it split is delivered."""
    calls, _, committer, tracker = _eos(flushes_to_deliver=2)
    assert committer.commit(tracker.ready) == {T0: (1, 1), T1: (4, 1)}
    assert calls.names().count("flush") == 2
    assert calls.names()[-3:] == [
        "send_offsets_to_transaction",
        "commit_transaction",
        "begin_transaction",
    ]


def test_outputs_never_delivered_fail_the_commit_saying_how_many() -> None:
    calls = Calls()
    committer = ExactlyOnceCommitter(
        FakeProducer(calls, flushes_to_deliver=10**9), FakeConsumer(calls, {T0}), 0.2
    )
    committer.start()
    tracker = OffsetTracker()
    b = _batch(1, (T0, 0))
    tracker.track(b)
    out = Output("out", b"k", b"v", [], b.entries[0], None)
    committer.send(b, [out, out])
    with pytest.raises(OutputFailed) as caught:
        committer.commit(tracker.ready)
    assert isinstance(caught.value.cause, KafkaTimeoutError)
    assert "2 outputs not delivered" in str(caught.value.cause)
    assert "send_offsets_to_transaction" not in calls.names()


def test_offsets_of_partitions_no_longer_assigned_are_all_named() -> None:
    calls = Calls()
    committer = ExactlyOnceCommitter(FakeProducer(calls), FakeConsumer(calls, {T0}), 5.0)
    committer.start()
    tracker = OffsetTracker()
    b = _batch(1, (T0, 0), (T1, 0), (T2, 0))
    tracker.track(b)
    committer.send(b, [Output("out", b"k", b"v", [], b.entries[0], None)])
    with pytest.raises(CommitRefused, match=r"partitions no longer assigned: in-1, in-2$"):
        committer.commit(tracker.ready)


def test_an_abort_that_hangs_gives_up_naming_the_call() -> None:
    calls = Calls()
    committer = ExactlyOnceCommitter(FakeProducer(calls), FakeConsumer(calls, {T0}), 0.2)
    committer.start()
    release = threading.Event()
    calls.during["abort_transaction"] = lambda: release.wait(30)
    try:
        with pytest.raises(
            CallTimedOut, match=r"^CallTimedOut: abort_transaction did not complete in 0\.2 s"
        ):
            committer.abort()
    finally:
        release.set()


# --------------------------------------------------------------------------- bounded


def test_bounded_returns_the_calls_value() -> None:
    assert bounded(lambda: 42, 5.0, "answer") == 42


def test_a_call_that_timed_out_keeps_a_named_daemon_thread() -> None:
    """The thread outlives the timeout until the call returns: it must not keep the
    process alive (daemon), and a stack dump must say what it waits on (its name)."""
    release = threading.Event()
    try:
        with pytest.raises(CallTimedOut):
            bounded(lambda: release.wait(30), 0.05, "commit_transaction")
        waiting = [t for t in threading.enumerate() if t.name == "dgstream-commit_transaction"]
        assert waiting and all(t.daemon for t in waiting)
    finally:
        release.set()


# --------------------------------------------------------------------------- the tracker


def test_the_tracker_holds_each_submitted_batch_until_retired() -> None:
    t = OffsetTracker()
    b = _batch(7, (T0, 0))
    t.track(b)
    assert t.pending == {7: b}


def test_forgetting_counts_every_batch_and_tolerates_partitions_never_seen() -> None:
    t = OffsetTracker()
    for seq in (1, 2):
        t.track(_batch(seq, (T0, seq)))
    assert t.forget([T1]) == 0  # never tracked, never committed
    assert t.forget([T0]) == 2
    assert t.in_flight == 0


def test_a_fenced_commit_stops_the_worker_naming_the_fence() -> None:
    calls, _, committer, tracker = _eos()
    calls.fail["commit_transaction"] = ProducerFencedError()
    with pytest.raises(WorkerFailed, match="transaction commit failed: ProducerFencedError"):
        committer.commit(tracker.ready)


def test_the_batches_of_some_partitions_are_theirs_only() -> None:
    t = OffsetTracker()
    both, only_t1 = _batch(1, (T0, 0), (T1, 0)), _batch(2, (T1, 1))
    for b in (both, only_t1):
        t.track(b)
    assert t.batches([T0]) == [both]
    assert t.batches([T1]) == [both, only_t1]
    assert t.batches([T2]) == []  # never tracked


def test_offsets_the_coordinator_refused_do_not_ride_with_the_next_transaction() -> None:
    """kafka-python keeps refused offsets pending and sends them with the next
    transaction's (the fake does the same); the next commit carries its own only."""
    from kafka.errors import CommitFailedError

    calls, fake, committer, tracker = _eos()  # a batch of T0 and T1 sent
    calls.fail["send_offsets_to_transaction"] = CommitFailedError("UNKNOWN_MEMBER_ID")
    with pytest.raises(CommitRefused):
        committer.commit(tracker.ready)
    committer.abort()
    del calls.fail["send_offsets_to_transaction"]
    later, fresh = _batch(2, (T1, 9)), OffsetTracker()
    fresh.track(later)
    committer.send(later, [Output("out", b"k", b"v", [], later.entries[0], None)])
    assert committer.commit(fresh.ready) == {T1: (10, 1)}
    assert {tp: m.offset for tp, m in fake.offsets.items()} == {T1: 10}

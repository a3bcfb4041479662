"""Delivery's two halves without a broker: when a batch is done, what a failed send hands
the consumer thread, what an abort does, and the one choice between the halves. The
producer is a fake whose sends stay pending until the test acknowledges or fails them."""

from __future__ import annotations

from typing import Any

import pytest
from kafka.errors import KafkaError, MessageSizeTooLargeError, ProducerFencedError
from stream_fakes import (
    T0,
    FakeConsumer,
    ForgettingTopics,
    RecordingLog,
    SendingProducer,
    batch,
    output,
    shared,
)

from dgstream.workers.faults.errors import OutputFailed, SendFailed, WorkerFailed
from dgstream.workers.steps.batches import Batch
from dgstream.workers.stream.delivery import AtLeastOnce, Delivery, ExactlyOnce, delivery_for
from dgstream.workers.stream.shared import Completions, Shared

pytestmark = pytest.mark.unit


def _delivery(
    mode: str = "at_least_once", **overrides: Any
) -> tuple[Delivery, Shared, Completions, SendingProducer, ForgettingTopics]:
    s, done, topics = shared(delivery=mode, **overrides), Completions(), ForgettingTopics()
    d = delivery_for(s, done, topics, "client")  # type: ignore[arg-type]
    producer = SendingProducer()
    d.producer = producer
    d.open_committer(FakeConsumer())
    return d, s, done, producer, topics


def _taken(done: Completions) -> list[tuple[int, BaseException | None]]:
    return [(b.seq, exc) for b, exc in done.take()]


def test_the_settings_choose_the_half() -> None:
    assert type(_delivery("at_least_once")[0]) is AtLeastOnce
    assert type(_delivery("exactly_once")[0]) is ExactlyOnce
    assert not AtLeastOnce.must_abandon_unfinished and ExactlyOnce.must_abandon_unfinished


# ------------------------------------------------------------------ at-least-once


def test_a_batch_is_done_when_every_output_is_acknowledged() -> None:
    d, s, done, producer, _ = _delivery()
    b = batch(1, (T0, 0), (T0, 1))
    d.send(b, [output(b, i=0), output(b, "dead", "BAD_INPUT", i=1)])
    assert [(t, k) for t, k, _ in producer.sent] == [("out", b"k0"), ("dead", b"k1")]
    assert s.metrics.answered == 1 and s.metrics.dead_lettered == 1
    producer.sent[0][2].ack()
    assert _taken(done) == []
    producer.sent[1][2].ack()
    assert _taken(done) == [(1, None)]
    assert not b.done  # done once the consumer thread applies it
    d.delivered(b)
    assert b.done and d.in_transaction() == set()


def test_a_batch_without_outputs_is_done_at_once_and_a_cancelled_one_sends_nothing() -> None:
    d, _, done, producer, _ = _delivery()
    d.send(batch(1, (T0, 0)), [])
    assert _taken(done) == [(1, None)]
    cancelled = batch(2, (T0, 1))
    cancelled.cancelled = True
    d.send(cancelled, [output(cancelled)])
    assert producer.sent == [] and _taken(done) == []


def test_a_failed_output_reports_the_batch_once_and_asks_for_a_new_producer() -> None:
    d, _, done, producer, topics = _delivery()
    b = batch(1, (T0, 0), (T0, 1))
    d.send(b, [output(b, "replies", i=0), output(b, i=1)])
    refused = MessageSizeTooLargeError("too large")
    producer.sent[0][2].fail(refused)
    producer.sent[1][2].fail(refused)  # kafka-python fails the whole batch in flight
    producer.sent[1][2].ack()
    ((seq, exc),) = _taken(done)
    assert seq == 1 and isinstance(exc, SendFailed) and exc.cause is refused
    assert str(exc) == (
        "an output to 'replies' failed: MessageSizeTooLargeError: [Error 10] "
        "MessageSizeTooLargeError: too large"
    )
    assert topics.forgotten == ["replies", "out"] and d.broken
    d.after_failed_send()
    assert d.broken


def test_a_send_kafka_python_refuses_at_once_fails_the_batch_not_the_engine_loop() -> None:
    """producer.send() itself raises (no metadata within max_block_ms, a sender gone
    fatal): the batch fails with that error, as a refused send does."""
    from kafka.errors import KafkaTimeoutError

    d, _, done, producer, topics = _delivery()
    b = batch(1, (T0, 0), (T0, 1))
    refused = KafkaTimeoutError("Failed to update metadata after 60.0 secs.")
    producer.fail["send"] = refused
    d.send(b, [output(b, "replies", i=0), output(b, i=1)])
    ((seq, exc),) = _taken(done)
    assert seq == 1 and isinstance(exc, SendFailed) and exc.cause is refused
    assert topics.forgotten == ["replies"] and d.broken


def test_an_abort_cancels_and_sends_nothing_back() -> None:
    d, s, _, producer, _ = _delivery()
    b = batch(1, (T0, 0))

    def cancel() -> None:
        b.cancelled = True

    d.abort(cancel)
    assert b.cancelled and producer.calls == [] and s.metrics.transactions_aborted == 0


def test_answered_results_are_logged_one_by_one_only_at_debug() -> None:
    d, s, _, _, _ = _delivery(log_level="DEBUG")
    b = batch(1, (T0, 0), (T0, 1))
    d.send(b, [output(b, i=0), output(b, "dead", "BAD_INPUT", i=1)])
    assert isinstance(s.log, RecordingLog)
    assert s.log.named("answered") == [
        ("debug", {"key": "k0", "topic": "out", "trace_id": None})  # tracing off
    ]
    quiet, qs, _, _, _ = _delivery()
    quiet.send(b, [output(b)])
    assert isinstance(qs.log, RecordingLog) and qs.log.named("answered") == []


# ------------------------------------------------------------------ exactly-once


def _sent(d: Delivery, b: Batch) -> None:
    d.send(b, [output(b)])


def test_a_batch_is_done_once_its_outputs_are_in_the_transaction() -> None:
    d, _, done, producer, _ = _delivery("exactly_once")
    assert producer.calls == ["init_transactions", "begin_transaction"]
    b = batch(1, (T0, 0))
    _sent(d, b)
    assert _taken(done) == [(1, None)]
    assert d.in_transaction() == {id(b)}
    d.delivered(b)
    assert not b.done  # done when the transaction commits, with its offsets
    d.after_failed_send()
    assert not d.broken


def test_a_send_refused_after_an_output_failed_reports_that_output_error() -> None:
    d, _, done, producer, _ = _delivery("exactly_once")
    first = batch(1, (T0, 0))
    _sent(d, first)
    _taken(done)
    refused = MessageSizeTooLargeError("too large")
    producer.sent[0][2].fail(refused)
    _taken(done)  # the first batch's own failure
    producer.fail["send"] = KafkaError("Cannot perform send: a previous request failed")
    later = batch(2, (T0, 1))
    _sent(d, later)
    ((seq, exc),) = _taken(done)
    assert seq == 2 and isinstance(exc, SendFailed) and exc.cause is refused
    assert str(exc).startswith("a send into the transaction: MessageSizeTooLargeError")


def test_a_send_refused_with_no_output_error_seen_reports_its_own() -> None:
    d, _, done, producer, _ = _delivery("exactly_once")
    error = KafkaError("the transaction is in an error state")
    producer.fail["send"] = error
    _sent(d, batch(1, (T0, 0)))
    ((_, exc),) = _taken(done)
    assert isinstance(exc, SendFailed) and exc.cause is error


def test_a_commit_whose_output_failed_names_that_output_error_once() -> None:
    d, _, done, producer, _ = _delivery("exactly_once")
    b = batch(1, (T0, 0))
    _sent(d, b)
    refused = MessageSizeTooLargeError("too large")
    producer.sent[0][2].fail(refused)
    with pytest.raises(OutputFailed) as caught:
        d.commit(lambda: {}, sync=True)  # the committer's flush finds the failed output
    assert caught.value.cause is refused
    assert isinstance(caught.value.__cause__, OutputFailed)
    _taken(done)
    # Named once: a send refused later, with no output failing since, is its own error.
    later_error = KafkaError("the transaction is in an error state")
    producer.fail["send"] = later_error
    _sent(d, batch(2, (T0, 1)))
    ((_, exc),) = _taken(done)
    assert isinstance(exc, SendFailed) and exc.cause is later_error


def test_an_abort_aborts_the_transaction_and_counts() -> None:
    d, s, _, producer, _ = _delivery("exactly_once")
    b = batch(1, (T0, 0))
    _sent(d, b)
    d.abort(lambda: setattr(b, "cancelled", True))
    assert producer.calls[-2:] == ["abort_transaction", "begin_transaction"]
    assert b.cancelled and d.in_transaction() == set() and not d.broken
    assert s.metrics.transactions_aborted == 1


def test_an_abort_that_fails_leaves_the_producer_to_be_replaced() -> None:
    d, s, _, producer, _ = _delivery("exactly_once")
    producer.fail["abort_transaction"] = KafkaError("the producer is in a fatal state")
    cancelled: list[bool] = []
    d.abort(lambda: cancelled.append(True))
    assert cancelled and d.broken and s.metrics.transactions_aborted == 1
    assert isinstance(s.log, RecordingLog)
    assert s.log.named("abort_failed") == [
        ("warning", {"error": "KafkaError: KafkaError: the producer is in a fatal state"})
    ]


def test_a_fenced_producer_fails_the_replica_instead_of_a_new_one() -> None:
    d, s, _, producer, _ = _delivery("exactly_once")
    producer.fail["abort_transaction"] = KafkaError("ProducerFencedError")
    producer._transaction_manager.last_error = ProducerFencedError()
    with pytest.raises(WorkerFailed, match=r"^fenced: another producer with this transactional"):
        d.abort(lambda: None)
    assert not d.broken and s.metrics.transactions_aborted == 1

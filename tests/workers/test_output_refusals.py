"""Records whose output cannot be produced, on the real broker, under both delivery
guarantees: a result larger than its topic takes (known beforehand, or refused by the
broker after the topic's limit changed), a reply_topic that does not exist, is internal,
is one of the pipeline's own, or is outside the pipeline's allow-list. Each becomes a dead
letter with its own code; its neighbours are answered; the worker stays up."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.harness.faults import DELIVERIES, set_topic_config
from bench.harness.pipeline import INLINE, Pipeline, WorkerThread, count_duplicates
from bench.harness.waiting import wait_for
from dgstream.schemas import DeadLetter, ErrorCode
from dgstream.workers.kafka.admin import ensure_topics

pytestmark = pytest.mark.broker

_LIMIT = 3000  # bytes a record of the small topics may take


def _request(rid: str, **extra: Any) -> bytes:
    body = {"id": rid, "state": f"text of {rid}", "questions": INLINE, "metadata": {"n": 0}}
    body.update(extra)
    return json.dumps(body).encode()


def _big(rid: str, **extra: Any) -> bytes:
    """A request whose result (it echoes the metadata) is larger than _LIMIT."""
    return _request(rid, metadata={"n": 0, "pad": "y" * (_LIMIT + 500)}, **extra)


def _refused_by_the_broker(pipeline: Pipeline, topic: str) -> bool:
    """Whether `topic` now refuses a record of _LIMIT + 1000 bytes (a dynamic config
    change takes a moment to reach the log)."""
    from kafka import KafkaProducer
    from kafka.errors import MessageSizeTooLargeError

    producer = KafkaProducer(**pipeline.conn.client_kwargs(client_id="probe"), acks="all")
    try:
        producer.send(topic, key=b"probe", value=b"z" * (_LIMIT + 1000)).get(30)
    except MessageSizeTooLargeError:
        return True
    finally:
        producer.close(timeout=10)
    return False


@pytest.mark.parametrize("delivery", DELIVERIES)
def test_outputs_that_cannot_be_produced_are_dead_lettered_and_neighbours_answered(
    pipeline: Pipeline, worker_threads: list[WorkerThread], unique_name: Any, delivery: str
) -> None:
    reply = "dgstream.replies." + unique_name("ok")
    shrinking = "dgstream.replies." + unique_name("shrinks")
    ensure_topics(pipeline.conn, {reply: 1, shrinking: 1})
    # Known before the worker starts: results to the output topic are checked locally.
    set_topic_config(pipeline.conn, pipeline.output, {"max.message.bytes": str(_LIMIT)})
    settings = pipeline.settings(delivery=delivery, batching={"max_records": 16, "max_wait_ms": 20})
    wt = WorkerThread(settings).start()
    worker_threads.append(wt)
    results = pipeline.reader(read_committed=True)
    replies = pipeline.reader(reply, read_committed=True)
    # The worker learns that `shrinking` takes 1 MiB; then it takes _LIMIT bytes.
    pipeline.produce([_request("first", reply_topic=shrinking)])
    pipeline.reader(shrinking).read_until(lambda r: r.keys() == ["first"], 60, "the first reply")
    set_topic_config(pipeline.conn, shrinking, {"max.message.bytes": str(_LIMIT)})
    wait_for(lambda: _refused_by_the_broker(pipeline, shrinking), 30, "the new limit in force")

    good = [f"g{i}" for i in range(30)]
    bad = {
        "big-output": (_big("big-output"), ErrorCode.OUTPUT_TOO_LARGE),
        "big-refused": (_big("big-refused", reply_topic=shrinking), ErrorCode.OUTPUT_TOO_LARGE),
        "reply-missing": (
            _request("reply-missing", reply_topic="dgstream.replies." + unique_name("none")),
            ErrorCode.REPLY_TOPIC_UNKNOWN,
        ),
        "reply-internal": (
            _request("reply-internal", reply_topic="__consumer_offsets"),
            ErrorCode.REPLY_TOPIC_NOT_ALLOWED,
        ),
        "reply-input": (
            _request("reply-input", reply_topic=pipeline.input),
            ErrorCode.REPLY_TOPIC_NOT_ALLOWED,
        ),
        "reply-elsewhere": (
            _request("reply-elsewhere", reply_topic="elsewhere"),
            ErrorCode.REPLY_TOPIC_NOT_ALLOWED,
        ),
    }
    values = [_request(g) for g in good[:15]]
    values += [v for v, _ in bad.values()] + [_request("replied", reply_topic=reply)]
    values += [_request(g) for g in good[15:]]
    pipeline.produce(values, keys=[None] * len(values), partition=0)  # one partition: neighbours

    dead = pipeline.reader(pipeline.dead, read_committed=True)
    dead.read_until(lambda r: len(r.records) >= len(bad), 90, "the dead letters")
    results.read_until(lambda r: set(r.keys()) >= set(good), 90, "every good result")
    replies.read_until(lambda r: r.keys() == ["replied"], 60, "the allowed reply")
    wait_for(lambda: pipeline.lag() == 0, 60, "the group's lag to reach 0")
    results.read_to_end()
    dead.read_to_end()

    letters = {r.key.decode(): DeadLetter.model_validate_json(r.value) for r in dead.records}
    got = {rid: letters[rid].error.code for rid in letters}
    print("\ndead letters:", {k: v.value for k, v in got.items()})
    assert got == {rid: code for rid, (_, code) in bad.items()}
    for rid, (value, _) in bad.items():
        assert letters[rid].original_bytes() == value
        assert letters[rid].error.field in (None, "reply_topic")
    keys = results.keys()
    print("duplicates:", count_duplicates(keys))
    assert set(keys) == set(good)
    if delivery == "exactly_once":  # at-least-once reads a refused record's batch again
        assert sorted(keys) == sorted(good)
    status = wt.worker.status()
    assert status["state"] == "running" and wt.error is None
    refused = status["dead_letter_codes"].get("OUTPUT_TOO_LARGE", 0)
    if delivery == "exactly_once":
        assert refused == 2
    else:  # the batch read again after a refusal files its letters again (counted each time)
        assert refused >= 2
    wt.worker.drain()
    wt.join()

"""The producer's client against a real broker and a real stream worker (fake engine):
request-reply correlated by id, a batch with many in flight, refusal before sending, and
refusal by the pipeline (through the dead-letter topic)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from worker_helpers import Pipeline, WorkerThread

from dgstream import Client, ErrorCode, RequestFailed, RequestInvalid

pytestmark = [pytest.mark.broker]

QUESTIONS = {
    "toxic": {"type": "noul", "instructions": "Is it toxic?"},
    "kind": {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b": None}},
}


def test_classify_one_and_many(pipeline: Pipeline, worker_threads: list[WorkerThread]) -> None:
    worker_threads.append(WorkerThread(pipeline.settings()).start())
    with Client(pipeline.conn, pipeline.input, timeout_s=60) as client:
        one = client.classify("hello there", QUESTIONS, id="single-1", metadata={"k": 1})
        assert one.id == "single-1"
        assert set(one.answers) == {"toxic", "kind"}
        assert one.metadata == {"k": 1}
        requests: list[dict[str, Any]] = [
            {"id": f"many-{i}", "state": f"message {i}", "questions": QUESTIONS} for i in range(200)
        ]
        results = list(client.classify_many(requests, max_in_flight=64))
        assert [r.id for r in results] == [r["id"] for r in requests]
        assert all(set(r.answers) == {"toxic", "kind"} for r in results)
        # Results went to the client's own reply topic, not the pipeline's output topic.
        assert client.reply_topic != pipeline.output


def test_bad_request_is_refused_before_sending(pipeline: Pipeline) -> None:
    with Client(pipeline.conn, pipeline.input, timeout_s=5) as client:
        with pytest.raises(RequestInvalid) as info:
            client.submit(
                "x", {"q": {"type": "choice", "instructions": "?", "criteria": {"a": None}}}
            )
        assert info.value.error.code == ErrorCode.TOO_FEW_OPTIONS
        assert "questions.q" in info.value.error.message


def test_request_refused_by_the_pipeline_fails_with_its_code(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """An unknown question set passes the client's own check; the worker dead-letters it and
    the client raises RequestFailed with the worker's code. Another producer's request with
    the SAME id (and another reply topic), dead-lettered first, is passed over."""
    rid = "refused-1"
    with Client(pipeline.conn, pipeline.input, dead_letter_topic=pipeline.dead) as client:
        # Same key, same partition: the other producer's message is read first.
        other = {"id": rid, "state": "x", "question_set": "nope", "reply_topic": "elsewhere"}
        [other_meta] = pipeline.produce([json.dumps(other).encode()], keys=[rid.encode()])
        future = client.submit(request={"id": rid, "state": "x", "question_set": "nope"})
        worker_threads.append(WorkerThread(pipeline.settings()).start())
        with pytest.raises(RequestFailed) as info:
            future.result(timeout=60)
    assert info.value.error.code == ErrorCode.UNKNOWN_QUESTION_SET
    letter = info.value.dead_letter
    assert letter.request_id == rid
    assert json.loads(letter.original_bytes())["reply_topic"] == client.reply_topic
    assert letter.source.partition == other_meta.partition
    assert letter.source.offset > other_meta.offset

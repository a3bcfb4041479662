"""The producer's client against a real broker and a real stream worker (fake engine):
request-reply correlated by id, a batch with many in flight, refusal before sending."""

from __future__ import annotations

from typing import Any

import pytest
from worker_helpers import Pipeline, WorkerThread

from dgstream import Client, ErrorCode, RequestInvalid

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

"""The producer's client against a real broker and a real stream worker (fake engine):
request-reply correlated by id, a batch with many in flight, refusal before sending, and
refusal by the pipeline (through the dead-letter topic)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from bench.harness.pipeline import Pipeline, WorkerThread
from dgstream import ClassificationResult, Client, ErrorCode, RequestFailed, RequestInvalid

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


def test_jev_bodies_without_id_are_sent_keyed_and_answered(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """A Jev body goes as it is (no id added): keyed by an id the client draws, which the
    worker takes as the request's id, as it does for any keyed body."""
    worker_threads.append(WorkerThread(pipeline.settings()).start())
    body = {"model": "jev-latest", "state": "hello", "questions": QUESTIONS}
    with Client(pipeline.conn, pipeline.input, dead_letter_topic=pipeline.dead) as client:
        a, b = client.submit(request=body), client.submit(request=body)
        one, two = a.result(timeout=60), b.result(timeout=60)
        assert isinstance(one, ClassificationResult) and isinstance(two, ClassificationResult)
        assert one.id != two.id and one.id_source == two.id_source == "key"
        assert set(one.answers) == {"toxic", "kind"} and one.requested_model == "jev-latest"
        (many,) = client.classify_many([body])
        assert isinstance(many, ClassificationResult) and many.id_source == "key"
        # Refused by the pipeline: the dead letter names the drawn id, and the call fails.
        with pytest.raises(RequestFailed) as info:
            client.classify(request={"state": "x", "question_set": "nope"})
        assert info.value.error.code == ErrorCode.UNKNOWN_QUESTION_SET
        assert "id" not in json.loads(info.value.dead_letter.original_bytes())


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


def _reply_as(pipeline: Pipeline, formats: dict[str, str]) -> None:
    """Answer the requests on the input topic as pipelines would, request id -> output
    format: each reply on its request's reply topic, keyed like the request (the classifier
    on the fake engine), after the same reply keyed for someone else."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from transformers import AutoTokenizer

    from dgstream.schemas import ClassificationRequest, encode_output, parse_request, record_id
    from dgstream.workers.engine.classifier import Classifier
    from dgstream.workers.engine.fake import FakeEngine
    from dgstream.workers.engine.models import TRAINED_DIRS
    from dgstream.workers.engine.template import ChatFormat

    chat = ChatFormat(AutoTokenizer.from_pretrained(str(TRAINED_DIRS["demo"])))
    classifier = Classifier(FakeEngine(canvas_length=256), chat)
    consumer = KafkaConsumer(enable_auto_commit=False, **pipeline.conn.client_kwargs())
    producer = KafkaProducer(acks="all", **pipeline.conn.client_kwargs())
    parts = [
        TopicPartition(pipeline.input, p) for p in consumer.partitions_for_topic(pipeline.input)
    ]
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    try:
        pending = dict(formats)
        while pending:
            for tp, records in consumer.poll(timeout_ms=500).items():
                for rec in records:
                    fallback = record_id(rec.key, tp.topic, tp.partition, rec.offset)
                    req = parse_request(rec.value, fallback_id=fallback)
                    assert isinstance(req, ClassificationRequest) and req.reply_topic
                    (res,) = asyncio.run(classifier.classify([req]))
                    value = encode_output(res, pending.pop(req.id))  # type: ignore[arg-type]
                    producer.send(req.reply_topic, key=b"someone-else", value=value)
                    producer.send(req.reply_topic, key=rec.key, value=value)
            producer.flush()
    finally:
        consumer.close()
        producer.close()


def test_replies_in_either_output_format_are_read(pipeline: Pipeline) -> None:
    from dgstream import ClassificationResult, JevResponse

    with Client(pipeline.conn, pipeline.input, timeout_s=60) as client:
        jev = client.submit("hello there", QUESTIONS, id="jev-1")
        ours = client.submit("hello again", QUESTIONS, id="ours-1")
        replier = threading.Thread(
            target=_reply_as, args=(pipeline, {"jev-1": "jev", "ours-1": "dgstream"}), daemon=True
        )
        replier.start()
        a, b = jev.result(timeout=60), ours.result(timeout=60)
        replier.join(timeout=30)
    assert isinstance(a, JevResponse) and isinstance(b, ClassificationResult)
    assert set(a.answers) == set(b.answers) == {"toxic", "kind"}
    assert a.answers["toxic"].type == "noul" and a.usage.input_tokens > 0
    assert b.id == "ours-1"

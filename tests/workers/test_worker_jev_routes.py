"""A Jev pipeline through the real broker: Jev bodies in as their clients send them (no id),
results out in Jev's shape, each on the topic its route names, keyed and headed as its input
record was. The oracle: the fake engine's own answer for each request, recomputed here."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from bench.harness.pipeline import Pipeline, WorkerThread
from dgstream.schemas import ClassificationResult, record_id
from dgstream.workers.engine.factory import EngineSettings, build_classifier
from dgstream.workers.kafka.admin import ensure_topics
from dgstream.workers.routes import Route, Router

pytestmark = pytest.mark.broker

QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Does it need an answer today?"},
    "tone": {
        "type": "choice",
        "instructions": "Which tone?",
        "criteria": {"calm": None, "angry": "shouting, insults"},
    },
}
TRACE = ("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")


def _body(i: int) -> dict[str, Any]:
    state: Any = f"message {i}: the order is late" if i % 2 else {"order": i, "text": "late?"}
    return {"model": "jev-latest", "state": state, "questions": QUESTIONS}


def _expected(bodies: list[bytes], ids: list[str]) -> list[ClassificationResult]:
    """The fake engine's answers for the same requests, named as the worker names them."""
    from dgstream.schemas import parse_request

    classifier = build_classifier(EngineSettings(backend="fake"))
    reqs = []
    for raw, rid in zip(bodies, ids, strict=True):
        parsed = parse_request(raw, fallback_id=record_id(rid.encode(), "x", 0, 0))
        assert not hasattr(parsed, "code"), parsed
        reqs.append(parsed)
    out = asyncio.run(classifier.classify(reqs))
    assert all(isinstance(r, ClassificationResult) for r in out)
    return out  # type: ignore[return-value]


def test_jev_bodies_answered_in_jev_shape_on_their_routes(
    pipeline: Pipeline, worker_threads: list[WorkerThread], unique_name: Callable[[str], str]
) -> None:
    urgent = unique_name("urgent")
    ensure_topics(pipeline.conn, {urgent: 1})
    routes = [Route(name="urgent", when="urgent.p_yes >= 0.5", topic=urgent)]
    settings = pipeline.settings(question_sets={}, output_format="jev", routes=routes)
    n = 24
    ids = [f"order-{i}" for i in range(n)]
    bodies = [json.dumps(_body(i)).encode() for i in range(n)]
    pipeline.produce(
        bodies,
        keys=[rid.encode() for rid in ids],
        headers=[[TRACE, ("ce_id", r.encode())] for r in ids],
    )
    # Before the worker starts: two threads importing transformers' lazy modules at once
    # can fail the second import.
    router = Router(routes, pipeline.output)
    expected = {r.id: r for r in _expected(bodies, ids)}
    where = {rid: router.route(r).topic for rid, r in expected.items()}
    on_route = [rid for rid, t in where.items() if t == urgent]
    assert 0 < len(on_route) < n, "the route splits the traffic (else the test proves little)"
    wt = WorkerThread(settings).start()
    worker_threads.append(wt)

    default, routed = pipeline.reader(), pipeline.reader(urgent)
    default.read_until(lambda r: len(r.records) >= n - len(on_route), 60, "the default results")
    routed.read_until(lambda r: len(r.records) >= len(on_route), 60, "the routed results")

    seen = set()
    for reader, topic in ((default, pipeline.output), (routed, urgent)):
        for rec in reader.records:
            rid = rec.key.decode()  # Jev's shape has no id: the record's key names it
            seen.add(rid)
            assert where[rid] == topic, rid
            headers = dict(rec.headers)
            assert headers["traceparent"] == TRACE[1]
            # The result is an event of its own, caused by the request's.
            assert headers["ce_causationid"] == rid.encode() and headers["ce_id"] != rid.encode()
            assert headers["ce_type"] == b"dgstream.result.v1" and headers["ce_subject"]
            assert headers["output_format"] == b"jev"
            assert headers["route"] == (b"urgent" if topic == urgent else b"default")
            body = json.loads(rec.value)
            assert set(body) == {"model", "answers", "usage"}
            want = expected[rid].answers
            assert body["answers"]["urgent"] == {"type": "noul", "noul": want["urgent"].p_yes}
            tone = body["answers"]["tone"]
            assert tone["choice"] == want["tone"].choice
            assert tone["probabilities"] == want["tone"].probabilities
            assert body["usage"]["input_tokens"] > 0 and body["usage"]["output_tokens"] > 0
    assert seen == set(ids)
    status = wt.worker.status()
    assert status["routed"] == {"urgent": len(on_route), "default": n - len(on_route)}

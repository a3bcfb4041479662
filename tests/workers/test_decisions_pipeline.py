"""Decisions through a real broker: traces that continue the producer's (spans caught by the
OpenTelemetry SDK's in-memory exporter), audited and calibrated results, CloudEvents both
ways with the `cloudevents` SDK producing and consuming, OpenAI's moderation shape read by
the `openai` SDK, and a shadow deployment of the demo model compared with its primary by
`dgstream compare`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from cli_runner import run_cli

from bench.harness.pipeline import INLINE, Pipeline, WorkerThread
from bench.harness.waiting import wait_for
from dgstream.schemas import DeadLetter, ErrorCode
from dgstream.workers.results.calibration import Calibration, QuestionCalibration, tempered

pytestmark = pytest.mark.broker

URGENT_T = 3.0
CAL = Calibration(
    questions={
        "urgent": QuestionCalibration(
            kind="yes_no",
            labels=["yes", "no"],
            temperature=URGENT_T,
            examples=100,
            nll_before=1.0,
            nll_after=0.6,
            ece_before=0.2,
            ece_after=0.02,
        )
    }
)


def _body(rid: str | None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"state": f"text of {rid}", "questions": INLINE, **extra}
    if rid is not None:
        body["id"] = rid
    return body


def _raw(obj: Any) -> bytes:
    return json.dumps(obj).encode()


@pytest.fixture
def spans() -> Iterator[tuple[Any, Any]]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _producer_contexts(n: int) -> tuple[list[list[tuple[str, bytes]]], list[Any]]:
    """`n` producer spans (an SDK tracer of their own), each injected into headers."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    tracer = TracerProvider().get_tracer("test-producer")
    headers, contexts = [], []
    for i in range(n):
        span = tracer.start_span(f"send {i}", kind=SpanKind.PRODUCER)
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
        span.end()
        headers.append([(k, v.encode()) for k, v in carrier.items()])
        contexts.append(span.get_span_context())
    return headers, contexts


def _traceparent(rec: Any) -> tuple[str, str]:
    value = dict(rec.headers)["traceparent"].decode()
    _, trace_id, parent, _ = value.split("-")
    return trace_id, parent


@pytest.mark.slow
def test_traces_continue_the_producers_through_results_and_dead_letters(
    pipeline: Pipeline,
    worker_threads: list[WorkerThread],
    spans: tuple[Any, Any],
) -> None:
    import structlog.testing

    provider, exporter = spans
    # The worker's log events, as structlog hands them over (its own configuration is left
    # alone: a captured stream would be closed under later tests' workers).
    logs = structlog.testing.LogCapture()
    structlog.configure(processors=[logs])
    try:
        _traces(pipeline, worker_threads, provider, exporter, logs.entries)
    finally:
        structlog.reset_defaults()


def _traces(
    pipeline: Pipeline,
    worker_threads: list[WorkerThread],
    provider: Any,
    exporter: Any,
    logs: list[dict[str, Any]],
) -> None:
    wt = WorkerThread(pipeline.settings(), tracer_provider=provider).start()
    worker_threads.append(wt)
    headers, contexts = _producer_contexts(4)
    values = [_raw(_body(f"t{i}")) for i in range(3)] + [b'{"id": "t3", "state": ']
    plain = [_raw(_body("t4"))]
    pipeline.produce([*values, *plain], headers=[*headers, [("x", b"1")]])
    results = pipeline.reader()
    dead = pipeline.reader(pipeline.dead)
    results.read_until(lambda r: len(r.keys()) >= 4, 90, "the four results")
    dead.read_until(lambda r: len(r.records) >= 1, 60, "the dead letter")
    # The spans end when the outputs are acknowledged, just after a consumer can read them.
    wait_for(lambda: len(exporter.get_finished_spans()) >= 5 + 4, 30, "the spans")
    finished = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}
    records = {rec.value: rec for rec in results.records}
    for i, ctx in enumerate(contexts[:3]):
        rec = next(r for r in records.values() if json.loads(r.value)["id"] == f"t{i}")
        trace_id, parent = _traceparent(rec)
        assert trace_id == f"{ctx.trace_id:032x}"  # the producer's trace
        span = by_id[int(parent, 16)]  # the worker's span is the parent...
        assert span.name == f"process {pipeline.input}"
        assert span.parent.span_id == ctx.span_id  # ...and the producer's span is its parent
        assert span.attributes["messaging.message.id"] == f"t{i}"
        audit = json.loads(rec.value)["audit"]
        assert audit["route"] == "default"
    (letter,) = dead.records
    trace_id, parent = _traceparent(letter)
    assert trace_id == f"{contexts[3].trace_id:032x}"
    assert by_id[int(parent, 16)].parent.span_id == contexts[3].span_id
    # A record without a producer context is traced in its batch's trace.
    rec = next(r for r in records.values() if json.loads(r.value)["id"] == "t4")
    trace_id, parent = _traceparent(rec)
    own = by_id[int(parent, 16)]
    assert own.parent is not None
    assert by_id[own.parent.span_id].attributes.get("messaging.batch.message_count")
    assert trace_id == f"{own.context.trace_id:032x}"
    batches = [s for s in finished if s.attributes.get("messaging.batch.message_count")]
    linked = {(lk.context.trace_id, lk.context.span_id) for b in batches for lk in b.links}
    assert linked == {(c.trace_id, c.span_id) for c in contexts}
    names = {s.name for s in finished}
    assert {"wait", "engine read", "send"} <= names
    # The dead letter's log line names its trace.
    (logged,) = [e for e in logs if e.get("event") == "dead_letter"]
    assert logged["trace_id"] == f"{contexts[3].trace_id:032x}"
    wt.worker.drain()
    wt.join()


def test_results_are_audited_calibrated_and_cloudevents_both_ways(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    from cloudevents.v1.http import CloudEvent
    from cloudevents.v1.kafka import KafkaMessage, from_binary, to_structured

    urgent = pipeline.output + ".urgent"
    from dgstream.workers.kafka.admin import ensure_topics

    ensure_topics(pipeline.conn, {urgent: 1})
    routes = [{"name": "urgent", "when": "urgent.p_yes >= 0.5", "topic": urgent}]
    # No question sets: the routes name the inline questions.
    settings = pipeline.settings(routes=routes, calibration=CAL, question_sets={})
    wt = WorkerThread(settings).start()
    worker_threads.append(wt)
    structured = to_structured(
        CloudEvent({"type": "com.example.req", "source": "/shop", "id": "evt-7"}, _body(None))
    )
    bad_event = _raw({"specversion": "1.0", "id": "evt-8", "source": "/shop", "data": _body("x")})
    pipeline.produce(
        [_raw(_body("c1")), structured.value, bad_event],
        headers=[[("ce_id", b"evt-6"), ("ce_type", b"com.example.req")], [], []],
    )
    out = pipeline.reader()
    routed = pipeline.reader(urgent)
    dead = pipeline.reader(pipeline.dead)

    def two(_: Any) -> bool:
        out.poll(50)
        routed.poll(50)
        return len(out.records) + len(routed.records) >= 2

    out.read_until(two, 90, "both results")
    dead.read_until(lambda r: len(r.records) == 1, 60, "the refused event")
    got = {}
    for rec in [*out.records, *routed.records]:
        ev = from_binary(KafkaMessage(dict(rec.headers), rec.key, rec.value))
        got[ev["subject"]] = (rec, ev)
    assert set(got) == {"c1", "evt-7"}  # the structured event's id is its request's id
    for rid, cause in (("c1", "evt-6"), ("evt-7", "evt-7")):
        rec, ev = got[rid]
        assert ev["type"] == "dgstream.result.v1" and ev["source"] == "/dgstream/default/test"
        assert ev["causationid"] == cause and ev["id"] not in ("evt-6", "evt-7")
        body = ev.data
        urgent_answer = body["answers"]["urgent"]
        assert urgent_answer["p_yes"] == pytest.approx(
            tempered([urgent_answer["raw_p_yes"], 1 - urgent_answer["raw_p_yes"]], URGENT_T)[0],
            abs=2e-6,
        )
        audit = body["audit"]
        assert audit["calibration"] == CAL.hash and audit["route_acted"] is True
        assert audit["checkpoint_source"] == "content_hash"
        assert audit["route"] == ("urgent" if urgent_answer["p_yes"] >= 0.5 else "default")
        assert audit["route_rule"] == (
            "urgent.p_yes >= 0.5" if audit["route"] == "urgent" else None
        )
        assert rec.topic == (urgent if audit["route"] == "urgent" else pipeline.output)
    assert got["evt-7"][1].data["id_source"] == "event"
    (letter,) = dead.records
    dl = DeadLetter.from_record(letter.value, letter.key, letter.headers)
    assert dl.error.code is ErrorCode.INVALID_CLOUDEVENT and dl.error.field == "type"
    assert dl.original_bytes() == bad_event
    ev = from_binary(KafkaMessage(dict(letter.headers), letter.key, letter.value))
    assert ev["type"] == "dgstream.dead_letter.v1" and ev["subject"] == "x"
    wt.worker.drain()
    wt.join()


def test_openai_moderation_results_are_read_by_the_openai_sdk(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    from openai.types import ModerationCreateResponse

    settings = pipeline.settings(
        output_format="openai_moderation",
        moderation={"categories": {"harassment": "urgent"}, "threshold": 0.0},
        question_sets={},
    )
    wt = WorkerThread(settings).start()
    worker_threads.append(wt)
    pipeline.produce([_raw(_body(f"m{i}")) for i in range(3)])
    out = pipeline.reader()
    out.read_until(lambda r: len(r.records) >= 3, 90, "three results")
    for rec in out.records:
        parsed = ModerationCreateResponse.model_validate_json(rec.value)
        (m,) = parsed.results
        assert parsed.id == rec.key.decode() and parsed.model == "fake"
        assert m.flagged is True and m.categories.harassment is True  # threshold 0
        assert m.category_applied_input_types.harassment == ["text"]
        assert m.category_applied_input_types.hate == []
    wt.worker.drain()
    wt.join()


@pytest.mark.model
@pytest.mark.slow
def test_a_shadow_of_the_demo_model_is_compared_with_its_primary(
    pipeline: Pipeline, worker_threads: list[WorkerThread], unique_name: Any
) -> None:
    from dgstream.topology.demo_tasks import sample_events
    from dgstream.workers.engine.factory import EngineSettings
    from dgstream.workers.kafka.admin import ensure_topics

    block, shadow_out = unique_name("block"), unique_name("shadow")
    ensure_topics(pipeline.conn, {block: 3, shadow_out: 3, shadow_out + ".dlq": 1})
    engine = EngineSettings(backend="transformers", model="demo", device="cpu")
    primary = pipeline.settings(
        engine=engine,
        question_sets={},
        routes=[{"name": "block", "when": "insult.p_yes >= 0.9", "topic": block}],
    )
    insult = CAL.questions["urgent"].model_copy(update={"temperature": 2.0})
    shadow = pipeline.settings(
        engine=engine,
        question_sets={},
        pipeline="shadow",
        group_id=pipeline.group + "-shadow",
        output_topic=shadow_out,
        dead_letter_topic=shadow_out + ".dlq",
        shadow=True,
        calibration=Calibration(questions={"insult": insult}),
        # Changed routes, to a topic that does not exist: a shadow never writes there.
        routes=[{"name": "flag", "when": "insult.p_yes >= 0.5", "topic": unique_name("nowhere")}],
    )
    # One at a time: two threads importing transformers' model classes at once can race in
    # its lazy module (an ImportError in the second).
    for s in (primary, shadow):
        wt = WorkerThread(s).start()
        worker_threads.append(wt)
        wait_for(lambda wt=wt: wt.worker.state == "running" or wt.error, 180, "a worker up")
        assert wt.error is None, wt.error
    events = sample_events(16, seed=5)
    pipeline.produce([_raw(e) for e in events], keys=[e["id"].encode() for e in events])
    a, b = pipeline.reader(), pipeline.reader(block)
    s_out = pipeline.reader(shadow_out)

    def all_a(_: Any) -> bool:
        a.poll(50)
        b.poll(50)
        return len(set(a.keys()) | set(b.keys())) >= len(events)

    a.read_until(all_a, 240, "the primary's results")
    s_out.read_until(lambda r: len(set(r.keys())) >= len(events), 240, "the shadow's results")
    shadow_audits = [json.loads(r.value)["audit"] for r in s_out.records]
    assert all(x["route_acted"] is False and x["pipeline"] == "shadow" for x in shadow_audits)
    proc = run_cli(
        "compare",
        f"{pipeline.output},{block}",
        shadow_out,
        "--bootstrap",
        ",".join(pipeline.conn.bootstrap_servers),
        "--json",
        "--idle-s",
        "5",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["both"], report["only_a"], report["only_b"]) == (len(events), 0, 0)
    q = report["questions"]
    assert set(q) == {"has_link", "insult", "shouting", "language", "excitement", "(route)"}
    # A temperature keeps every answer; it moves the insult probabilities only.
    assert q["insult"]["agreement"] == 1.0
    assert q["insult"]["largest_shifts"][0]["shift"] > 0
    assert {s["id"] for s in q["insult"]["largest_shifts"]} <= {e["id"] for e in events}
    assert all(s["shift"] == 0 for s in q["has_link"]["largest_shifts"])
    routes = {(c["a"], c["b"]): c["count"] for c in q["(route)"]["confusion"]}
    assert set(routes) <= {("block", "flag"), ("default", "default"), ("default", "flag")}
    insults = sum(e["metadata"]["truth"]["insult"] == "yes" for e in events)
    assert routes.get(("block", "flag"), 0) >= 1 and insults >= 1
    text = run_cli(
        "compare",
        f"{pipeline.output},{block}",
        shadow_out,
        "--bootstrap",
        ",".join(pipeline.conn.bootstrap_servers),
        "--idle-s",
        "5",
        timeout=180,
    )
    assert "insult (yes_no): agreement 1.000" in text.stdout
    assert "block->flag" in text.stdout

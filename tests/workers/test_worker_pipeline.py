"""The stream worker on the real broker, without Ray: bad messages, engine failures, drain.

Engines that fail on purpose are defined here, wrapping the fake engine: they test the
pipeline's handling of engine errors, not an engine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from bench.harness.pipeline import (
    INLINE,
    Pipeline,
    WorkerThread,
    check_results,
    count_duplicates,
    request_bytes,
)
from bench.harness.waiting import wait_for
from dgstream.schemas import DeadLetter, ErrorCode
from dgstream.workers.engine.factory import EngineSettings, build_classifier
from dgstream.workers.engine.types import (
    FatalEngineError,
    Read,
    ReadRejected,
    ReadResult,
    RecoverableEngineError,
)
from dgstream.workers.hosting.worker import WorkerFailed
from dgstream.workers.kafka.admin import ensure_topics

pytestmark = pytest.mark.broker

_Q = {"q": {"type": "yes_no", "instructions": "Is it so?"}}


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


# (name, message value, expected code). The worker's parse limits are 4096 bytes a message
# and 200 characters of state.
BAD_MESSAGES: list[tuple[str, bytes | None, ErrorCode]] = [
    ("invalid json", b"{not json", ErrorCode.INVALID_JSON),
    ("non-UTF-8", b"\xff\xfe\xfa", ErrorCode.INVALID_UTF8),
    # (A body without an id is a Jev body: it is answered, named after its record.)
    ("missing state", _json({"id": "b-state-missing", "questions": _Q}), ErrorCode.MISSING_FIELD),
    (
        "unknown question kind",
        _json({"id": "b-kind", "state": "s", "questions": {"q": {"type": "banana"}}}),
        ErrorCode.UNKNOWN_QUESTION_KIND,
    ),
    (
        "unknown question_set",
        _json({"id": "b-set", "state": "s", "question_set": "nope"}),
        ErrorCode.UNKNOWN_QUESTION_SET,
    ),
    (
        "oversize state",
        _json({"id": "b-state", "state": "x" * 201, "questions": _Q}),
        ErrorCode.STATE_TOO_LARGE,
    ),
    (
        "dependency cycle",
        _json(
            {
                "id": "b-cycle",
                "state": "s",
                "questions": {
                    "a": {"type": "yes_no", "instructions": "a?", "depends_on": ["b"]},
                    "b": {"type": "yes_no", "instructions": "b?", "depends_on": ["a"]},
                },
            }
        ),
        ErrorCode.DEPENDENCY_CYCLE,
    ),
    ("empty message", b"", ErrorCode.EMPTY_MESSAGE),
    ("null value (tombstone)", None, ErrorCode.EMPTY_MESSAGE),
    ("not an object", b"[1, 2]", ErrorCode.NOT_AN_OBJECT),
    # Valid JSON, valid UTF-8, and once a crash loop of every worker: a lone surrogate.
    (
        "lone surrogate in a question id",
        _json({"id": "b-sur", "state": "s", "questions": {"\ud800": _Q["q"]}}),
        ErrorCode.INVALID_UNICODE,
    ),
    (
        "lone surrogate in the id",
        _json({"id": "b-\udc00", "state": "s", "questions": _Q}),
        ErrorCode.INVALID_UNICODE,
    ),
    (
        "unsupported schema version",
        _json({"schema_version": 2, "id": "b-v", "state": "s", "questions": _Q}),
        ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
    ),
    (
        "oversize message",
        _json({"id": "b-big", "state": "s", "questions": _Q, "metadata": {"p": "y" * 5000}}),
        ErrorCode.MESSAGE_TOO_LARGE,
    ),
    (
        "bad reply topic",
        _json({"id": "b-reply", "state": "s", "questions": _Q, "reply_topic": "no spaces"}),
        ErrorCode.INVALID_REPLY_TOPIC,
    ),
    (
        "state not a string",
        _json({"id": "b-type", "state": 5, "questions": _Q}),
        ErrorCode.WRONG_TYPE,
    ),
    (
        "unknown dependency",
        _json(
            {
                "id": "b-dep",
                "state": "s",
                "questions": {"a": {"type": "yes_no", "instructions": "a", "depends_on": ["z"]}},
            }
        ),
        ErrorCode.UNKNOWN_DEPENDENCY,
    ),
]


def _dead_letters(records: list[Any]) -> dict[tuple[int, int], DeadLetter]:
    out = {}
    for rec in records:
        letter = DeadLetter.model_validate_json(rec.value)
        assert dict(rec.headers)["error_code"] == letter.error.code.value.encode()
        out[(letter.source.partition, letter.source.offset)] = letter
    return out


def test_worker_bad_messages_dead_lettered_good_ones_answered_then_drain(
    pipeline: Pipeline, worker_threads: list[WorkerThread], unique_name: Any
) -> None:
    settings = pipeline.settings(
        parse_limits={"max_message_bytes": 4096, "max_state_chars": 200},
        batching={"max_records": 16, "max_wait_ms": 20},
        reply_topics=["reply-*"],
    )
    reply = unique_name("reply")
    ensure_topics(pipeline.conn, {reply: 1})  # a reply topic must exist (none is created)
    # Good and bad interleaved, on every partition.
    values: list[bytes | None] = []
    kinds: list[tuple[str, ErrorCode] | None] = []
    good: list[str] = []
    for i in range(60):
        values.append(request_bytes(f"g{i}", i))
        kinds.append(None)
        good.append(f"g{i}")
        if i < len(BAD_MESSAGES):
            name, raw, code = BAD_MESSAGES[i]
            values.append(raw)
            kinds.append((name, code))
    with_reply = {"id": "g-reply", "state": "hi", "questions": INLINE, "reply_topic": reply}
    values.append(_json({**with_reply, "metadata": {"n": 0}}))
    kinds.append(None)
    # A key on some bad ones: the dead letter keeps it (base64).
    # (A null value needs a key.)
    keys = [b"k-%d" % i if i % 3 == 0 or values[i] is None else None for i in range(len(values))]
    metas = pipeline.produce(values, keys=keys)
    bad_at = {(m.partition, m.offset): k for m, k in zip(metas, kinds, strict=True) if k}
    assert len(bad_at) == len(BAD_MESSAGES) >= 8

    wt = WorkerThread(settings).start()
    worker_threads.append(wt)
    results = pipeline.reader()
    dead = pipeline.reader(pipeline.dead)
    replies = pipeline.reader(reply)
    results.read_until(lambda r: set(r.ids()) >= set(good), 60, "every good request's result")
    dead.read_until(lambda r: len(r.records) >= len(BAD_MESSAGES), 60, "the dead letters")
    replies.read_until(lambda r: len(r.records) >= 1, 60, "the reply-topic result")

    # Each bad message is in the dead-letter topic once, with the right code and bytes.
    letters = _dead_letters(dead.records)
    assert set(letters) == set(bad_at)
    table = []
    for where, (name, code) in sorted(bad_at.items()):
        letter = letters[where]
        table.append((name, code.value, letter.error.code.value))
        assert letter.error.code == code, (name, letter.error)
        assert letter.source.topic == pipeline.input
        i = next(j for j, m in enumerate(metas) if (m.partition, m.offset) == where)
        assert letter.original_bytes() == (values[i] or b"")
        assert letter.source.key_bytes() == keys[i]
        assert letter.worker == settings.name
    print("\ndead letters (kind, expected, got):", *table, sep="\n  ")
    # A dead letter is keyed as its record was, else by the request's id when it has one.
    by_key = {rec.key: DeadLetter.model_validate_json(rec.value) for rec in dead.records}
    for key, letter in by_key.items():
        assert key == (letter.source.key_bytes() or (letter.request_id or "").encode() or None)
    assert {d.request_id: d for d in by_key.values()}["b-cycle"].error.code == (
        ErrorCode.DEPENDENCY_CYCLE
    )

    # Every good one is answered, once, with an answer per question; the reply goes to its
    # topic. A result is keyed by its record's key (ordering per key), else by its id.
    assert sorted(results.ids()) == sorted(good)
    want_keys = {
        json.loads(v)["id"]: k
        for v, k, kind in zip(values, keys, kinds, strict=True)
        if v and kind is None
    }
    for rec in results.records:
        rid = json.loads(rec.value)["id"]
        assert rec.key == (want_keys.get(rid) or rid.encode()), rid
    check_results(results.records, keyed_by_id=False)
    assert [r.key for r in replies.records] == [b"g-reply"]
    assert set(json.loads(replies.records[0].value)["answers"]) == set(INLINE)

    # The worker kept running, and says what it did.
    status = wt.worker.status()
    assert status["state"] == "running" and wt.error is None
    assert status["answered"] == len(good) + 1
    assert status["dead_lettered"] == len(BAD_MESSAGES)
    assert status["consumed"] == len(values)

    # Drain: everything committed, the group has no lag, the worker has stopped.
    final = wt.worker.drain()
    wt.join()
    assert final["state"] == "stopped" and wt.error is None
    assert pipeline.lag() == 0
    ends = {m.partition: m.offset + 1 for m in metas}
    committed = pipeline.committed()
    for p, end in ends.items():
        assert committed[p] >= end


# --------------------------------------------------------------------------- engine failures


class FlakyEngine:
    """The fake engine, failing on purpose: the first call (transient), any read of a
    request whose id starts with "poison" (always), and "rejected" ones (vLLM refusal)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    @property
    def info(self) -> Any:
        return self.inner.info

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
        self.calls += 1
        if self.calls == 1:
            raise RecoverableEngineError("transient: out of memory")
        for i, r in enumerate(reads):
            if r.tag.startswith("poison"):
                raise RecoverableEngineError(f"read {r.tag} breaks the engine")
            if r.tag.startswith("rejected"):
                raise ReadRejected(i, "extra_args: diffusion_canvas_length too large")
        out: list[ReadResult] = await self.inner.read(reads)
        return out

    async def close(self) -> None:
        await self.inner.close()


class FatalOnEngine(FlakyEngine):
    """Healthy until it reads a request whose id starts with "fatal"."""

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
        self.calls += 1
        if any(r.tag.startswith("fatal") for r in reads):
            raise FatalEngineError("CUDA error: device lost")
        out: list[ReadResult] = await self.inner.read(reads)
        return out


def _classifier_with(engine_type: type[FlakyEngine], settings: Any) -> Any:
    classifier = build_classifier(EngineSettings(backend="fake"), settings.question_sets, "t")
    classifier.engine = engine_type(classifier.engine)
    return classifier


def test_worker_recoverable_errors_retry_then_isolate_the_failing_request(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    settings = pipeline.settings(
        batching={"max_records": 32, "max_wait_ms": 200}, engine_retry_backoff_s=0.0
    )
    classifier = _classifier_with(FlakyEngine, settings)
    ids = [f"ok{i}" for i in range(30)] + ["poison-1", "poison-2", "rejected-1"]
    values = [request_bytes(rid, i) for i, rid in enumerate(ids)]
    # One partition: the poison requests share batches with good ones.
    pipeline.produce(values, keys=[rid.encode() for rid in ids], partition=0)

    wt = WorkerThread(settings, classifier=classifier).start()
    worker_threads.append(wt)
    results = pipeline.reader()
    dead = pipeline.reader(pipeline.dead)
    results.read_until(lambda r: len(set(r.keys())) >= 30, 60, "the good requests' results")
    dead.read_until(lambda r: len(r.records) >= 3, 60, "the failing requests' dead letters")

    assert sorted(results.keys()) == sorted(ids[:30])
    check_results(results.records)
    letters = {rec.key.decode(): DeadLetter.model_validate_json(rec.value) for rec in dead.records}
    assert sorted(letters) == ["poison-1", "poison-2", "rejected-1"]
    for rid, letter in letters.items():
        assert letter.error.code == ErrorCode.ENGINE_FAILED
        assert letter.request_id == rid
    assert "ReadRejected" in letters["rejected-1"].error.message
    assert "breaks the engine" in letters["poison-1"].error.message
    status = wt.worker.status()
    assert status["state"] == "running"
    # The transient failure was retried, the batch split: more calls than batches.
    assert status["engine_calls"] > status["batches"]
    print("\nengine calls", status["engine_calls"], "batches", status["batches"])
    wt.worker.drain()
    wt.join()
    assert pipeline.lag() == 0


def test_worker_fatal_engine_error_stops_without_commit_and_a_restart_answers_all(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    settings = pipeline.settings(batching={"max_records": 8, "max_wait_ms": 20})
    ids = [f"a{i}" for i in range(20)] + ["fatal-1"] + [f"b{i}" for i in range(20)]
    values = [request_bytes(rid, i) for i, rid in enumerate(ids)]
    metas = pipeline.produce(values, keys=[rid.encode() for rid in ids], partition=0)
    fatal_offset = metas[20].offset

    wt = WorkerThread(settings, classifier=_classifier_with(FatalOnEngine, settings)).start()
    worker_threads.append(wt)
    wt.join(60)
    assert isinstance(wt.error, WorkerFailed)
    assert "device lost" in str(wt.error)
    assert wt.worker.status()["state"] == "failed"
    # The batch holding the fatal request (and anything after it) was not committed.
    assert pipeline.committed().get(0, 0) <= fatal_offset

    # The restarted worker (same group, a healthy engine) answers everything left.
    again = WorkerThread(settings).start()
    worker_threads.append(again)
    results = pipeline.reader()
    results.read_until(lambda r: set(r.keys()) >= set(ids), 60, "every request's result")
    again.worker.drain()
    again.join()
    assert set(results.keys()) == set(ids)
    print("\nduplicates after the restart:", count_duplicates(results.keys()))
    assert pipeline.lag() == 0


def test_worker_stop_before_run_and_status_shape(pipeline: Pipeline) -> None:
    from dgstream.workers.hosting.worker import StreamWorker

    worker = StreamWorker(pipeline.settings())
    status = worker.status()
    for key in ("consumed", "answered", "dead_lettered", "batches", "in_flight", "lag"):
        assert key in status
    assert status["state"] == "new" and status["last_error"] is None
    assert worker.drain()["state"] == "stopped"
    wait_for(lambda: worker.wait_finished(0), 1, "the finished flag")


def test_worker_static_member_drain_leaves_the_group_at_once(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """A static member never sends LeaveGroup; drain removes it, so its partitions move now
    rather than after session_timeout_ms."""
    settings = pipeline.settings(
        static_membership=True,
        consumer={"session_timeout_ms": 60_000, "heartbeat_interval_ms": 3000},
    )
    ids = pipeline.produce_requests(50)
    wt = WorkerThread(settings).start()
    worker_threads.append(wt)
    results = pipeline.reader()
    results.read_until(lambda r: set(r.keys()) >= set(ids), 60, "every result")
    assert pipeline.members() == 1
    wt.worker.drain()
    wt.join()
    assert pipeline.members() == 0  # at once, not after the 60 s session timeout
    assert pipeline.lag() == 0


def test_worker_exactly_once_join_and_drain_mid_run_no_duplicates(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """Exactly-once through a cooperative rebalance (a member joins) and a drain (the first
    leaves): read_committed, every id exactly once."""
    engine = EngineSettings(backend="fake", fake_cost_per_read_s=0.002)
    first, second = (
        pipeline.settings(replica=i, delivery="exactly_once", engine=engine) for i in range(2)
    )
    ids = pipeline.produce_requests(1500)
    a = WorkerThread(first).start()
    worker_threads.append(a)
    results = pipeline.reader(read_committed=True)
    results.read_until(lambda r: len(r.records) >= 200, 60, "the first results")
    b = WorkerThread(second).start()
    worker_threads.append(b)
    wait_for(lambda: b.worker.status()["assignment"], 60, "the second worker to own partitions")
    final_a = a.worker.drain()
    a.join()
    assert final_a["state"] == "stopped" and a.error is None
    results.read_until(lambda r: set(r.keys()) >= set(ids), 120, "every result")
    wait_for(lambda: pipeline.lag() == 0, 60, "the group's lag to reach 0")
    results.read_to_end()
    keys = results.keys()
    print(f"\nexactly-once join + drain: first answered {final_a['answered']}, ", end="")
    print(f"second {b.worker.status()['answered']}, duplicates {count_duplicates(keys)}")
    assert sorted(keys) == sorted(ids)
    assert 0 < final_a["answered"] < len(ids)
    b.worker.drain()
    b.join()


def test_a_worker_that_owns_its_process_freezes_its_start_up_heap(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """`freeze_heap` (the pool's actor sets it): once the engine and the clients are built,
    what is alive moves out of the collector's full passes, and requests are answered as
    before. A worker without it (one sharing its process: a test, a benchmark, an embedding
    application) leaves the collector alone."""
    import gc

    gc.unfreeze()
    try:
        pipeline.produce([request_bytes("h0", 0)])
        shared = WorkerThread(pipeline.settings()).start()
        worker_threads.append(shared)
        results = pipeline.reader()
        results.read_until(lambda r: "h0" in r.ids(), 60, "the first worker's result")
        shared.worker.drain()
        shared.join()
        assert gc.get_freeze_count() == 0
        owner = WorkerThread(pipeline.settings(), freeze_heap=True).start()
        worker_threads.append(owner)
        pipeline.produce([request_bytes("h1", 1)])
        results.read_until(lambda r: "h1" in r.ids(), 60, "the second worker's result")
        # Everything alive at its start: at least the engine's model and its tokenizer.
        assert gc.get_freeze_count() > 1_000
        check_results(results.records)
    finally:
        gc.unfreeze()

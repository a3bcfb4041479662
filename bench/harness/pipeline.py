"""Helpers of the stream-worker tests: requests, topics, output readers, worker threads.

Every wait is on a condition with a deadline (`wait_for`, `OutputReader.read_until`), never
a bare sleep. The engine is the fake one (deterministic, no model) unless a test says
otherwise.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from bench.harness.waiting import wait_for
from dgstream.workers.kafka.settings import KafkaConnection

# The question set the pipelines know; requests name it or carry inline questions.
MODERATION: dict[str, Any] = {
    "toxic": {"type": "noul", "instructions": "Does the message insult someone?"},
    "category": {
        "type": "choice",
        "instructions": "What kind of message is it?",
        "criteria": {"spam": None, "chat": None, "news": None},
    },
    "severity": {
        "type": "score",
        "instructions": "How severe is it?",
        "criteria": ["none", "mild", "serious"],
        "depends_on": ["toxic"],
    },
}
INLINE: dict[str, Any] = {
    "urgent": {"type": "yes_no", "instructions": "Does it need an answer today?"},
    "language": {
        "type": "choice",
        "instructions": "Which language is it in?",
        "criteria": {"en": None, "de": None},
    },
}
QUESTION_SETS = {"moderation": MODERATION}
INPUT_PARTITIONS = 6


def request_bytes(rid: str, i: int) -> bytes:
    """Request `rid`: every other one names the question set, the rest ask inline."""
    body: dict[str, Any] = {"id": rid, "state": f"message number {i}: see you at the game"}
    if i % 2:
        body["question_set"] = "moderation"
    else:
        body["questions"] = INLINE
    body["metadata"] = {"n": i}
    return json.dumps(body).encode()


def expected_questions(i: int) -> set[str]:
    return set(MODERATION) if i % 2 else set(INLINE)


@dataclass
class OutputReader:
    """Reads a topic from its beginning without a group; keeps what it has read."""

    conn: KafkaConnection
    topic: str
    read_committed: bool = False
    records: list[Any] = field(default_factory=list)
    _consumer: Any = None

    def _open(self) -> Any:
        if self._consumer is None:
            from kafka import KafkaConsumer, TopicPartition

            c = KafkaConsumer(
                **self.conn.client_kwargs(client_id="dgstream-tests-reader"),
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                isolation_level="read_committed" if self.read_committed else "read_uncommitted",
            )
            parts = wait_for(lambda: c.partitions_for_topic(self.topic), 30, "topic metadata")
            tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
            c.assign(tps)
            c.seek_to_beginning(*tps)
            self._consumer = c
        return self._consumer

    def poll(self, timeout_ms: int = 200) -> int:
        got = 0
        for recs in self._open().poll(timeout_ms=timeout_ms).values():
            self.records.extend(recs)
            got += len(recs)
        return got

    def keys(self) -> list[str]:
        return [r.key.decode() for r in self.records if r.key is not None]

    def ids(self) -> list[str]:
        """The request id each record's value names (results and dead letters alike)."""
        out = []
        for r in self.records:
            body = json.loads(r.value) if r.value else {}
            rid = body.get("id", body.get("request_id"))
            if rid is not None:
                out.append(str(rid))
        return out

    def read_until(self, done: Callable[[OutputReader], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done(self):
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
            self.poll()

    def read_to_end(self, timeout_s: float = 30.0) -> None:
        """Everything up to the end offsets as of now (the last stable offset when reading
        committed)."""
        c = self._open()
        ends = c.end_offsets(list(c.assignment()))

        def at_end(_: OutputReader) -> bool:
            return all(c.position(tp) >= end for tp, end in ends.items())

        self.read_until(at_end, timeout_s, f"the end of {self.topic}")

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


@dataclass
class Pipeline:
    """The topics, group and connection of one test pipeline, and helpers around them."""

    conn: KafkaConnection
    input: str
    output: str
    dead: str
    group: str
    readers: list[OutputReader] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        conn: KafkaConnection,
        unique_name: Callable[[str], str],
        partitions: int = INPUT_PARTITIONS,
        output_partitions: int = 3,
    ) -> Pipeline:
        """A pipeline of new topics (the input of `partitions`) and a new group."""
        from dgstream.workers.kafka.admin import ensure_topics

        p = cls(
            conn,
            input=unique_name("in"),
            output=unique_name("out"),
            dead=unique_name("dlq"),
            group=unique_name("g"),
        )
        ensure_topics(conn, {p.input: partitions, p.output: output_partitions, p.dead: 1})
        return p

    def close(self) -> None:
        for r in self.readers:
            r.close()

    def settings(self, **overrides: Any) -> Any:
        from dgstream.workers.engine.factory import EngineSettings
        from dgstream.workers.hosting.settings import WorkerSettings

        base: dict[str, Any] = {
            "pipeline": "test",
            "input_topics": [self.input],
            "output_topic": self.output,
            "dead_letter_topic": self.dead,
            "group_id": self.group,
            "kafka": self.conn,
            "engine": EngineSettings(backend="fake"),
            "question_sets": QUESTION_SETS,
            # The broker's group.min.session.timeout.ms: a member that vanishes is noticed
            # in seconds, not the default 45.
            "consumer": {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        }
        base.update(overrides)
        return WorkerSettings.model_validate(base)

    def produce(
        self,
        values: list[bytes | None],
        *,
        keys: list[bytes | None] | None = None,
        headers: list[list[tuple[str, bytes | None]]] | None = None,
        **kw: Any,
    ) -> list[Any]:
        """Send, wait for the acknowledgements; returns their RecordMetadata in order."""
        from kafka import KafkaProducer

        producer = KafkaProducer(
            **self.conn.client_kwargs(client_id="dgstream-tests-producer"),
            acks="all",
            linger_ms=5,
        )
        try:
            futures = [
                producer.send(
                    self.input,
                    value=v,
                    key=None if keys is None else keys[i],
                    headers=None if headers is None else headers[i],
                    **kw,
                )
                for i, v in enumerate(values)
            ]
            producer.flush(timeout=60)
            return [f.get(timeout=60) for f in futures]
        finally:
            producer.close(timeout=10)

    def flood(self, n: int, partition: int = 0) -> None:
        """`n` one-byte records (each a dead letter) on `partition`, in large zstd batches
        as a librdkafka producer makes them."""
        from kafka import KafkaProducer

        producer = KafkaProducer(
            **self.conn.client_kwargs(client_id="dgstream-tests-flood"),
            acks="all",
            linger_ms=50,
            batch_size=1 << 20,
            compression_type="zstd",
        )
        try:
            for _ in range(n):
                producer.send(self.input, value=b"x", partition=partition)
            producer.flush(timeout=300)
        finally:
            producer.close(timeout=10)

    def produce_requests(self, n: int, prefix: str = "r", start: int = 0) -> list[str]:
        ids = [f"{prefix}{i}" for i in range(start, start + n)]
        values = [request_bytes(rid, start + k) for k, rid in enumerate(ids)]
        self.produce(values, keys=[rid.encode() for rid in ids])
        return ids

    def reader(self, topic: str | None = None, *, read_committed: bool = False) -> OutputReader:
        r = OutputReader(self.conn, topic or self.output, read_committed)
        self.readers.append(r)
        return r

    def lag(self) -> int:
        from dgstream.workers.kafka.admin import compute_lag

        return sum(compute_lag(self.conn, self.group, [self.input]).values())

    def members(self) -> int:
        """How many members the group has now."""
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(**self.conn.client_kwargs(client_id="dgstream-tests-admin"))
        try:
            described = admin.describe_groups([self.group])
        finally:
            admin.close()
        return len(described[self.group]["members"])

    def committed(self) -> dict[int, int]:
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(**self.conn.client_kwargs(client_id="dgstream-tests-admin"))
        try:
            offsets = admin.list_group_offsets({self.group: None}).get(self.group, {})
        finally:
            admin.close()
        return {tp.partition: int(meta.offset) for tp, meta in offsets.items()}


def count_duplicates(keys: list[str]) -> int:
    return sum(n - 1 for n in Counter(keys).values() if n > 1)


def check_results(
    records: list[Any], model: str = "fake", *, keyed_by_id: bool = True
) -> dict[str, dict[str, Any]]:
    """Every result: headers, an answer for every question of its request; id -> result.

    `keyed_by_id`: the requests were produced keyed by their ids (results take their
    record's key), so every result's key is its id."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        body = json.loads(rec.value)
        headers = dict(rec.headers)
        assert headers["schema_version"] == b"1"
        assert headers["model"] == model.encode()
        assert headers["worker"]
        if keyed_by_id:
            assert rec.key.decode() == body["id"]
        i = body["metadata"]["n"]
        assert set(body["answers"]) == expected_questions(i), body
        assert body["status"] == "ok"
        out[body["id"]] = body
    return out


class WorkerThread:
    """A `StreamWorker` running on a thread of the test process (no Ray)."""

    def __init__(self, settings: Any, **kwargs: Any) -> None:
        from dgstream.workers.hosting.worker import StreamWorker

        self.worker = StreamWorker(settings, **kwargs)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"test-{settings.name}", daemon=True)

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:
            self.error = exc

    def start(self) -> WorkerThread:
        self.thread.start()
        return self

    def join(self, timeout_s: float = 60.0) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the worker thread did not finish"

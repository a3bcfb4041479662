"""Kafka as it is in the field: requests produced by two clients dgstream does not use,
librdkafka (confluent-kafka) and Kafka's own Java console producer, in batches of every
codec (gzip, snappy, lz4, zstd), with keys and headers; part of librdkafka's in a committed
transaction and part in an aborted one. A pipeline of each delivery mode answers them and
writes its results compressed; a read_committed consumer checks every result: its key and
the input's headers kept, each request answered once, nothing aborted answered.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from support import segments
from support.field_clients import CODECS, Record, console_produce, finish, librdkafka_produce

from bench.harness.pipeline import (
    OutputReader,
    Pipeline,
    WorkerThread,
    check_results,
    request_bytes,
)
from bench.harness.waiting import wait_for
from dgstream.infra.kafka.broker import BrokerInfo
from dgstream.infra.kafka.broker.process import find_java
from dgstream.workers.kafka.admin import ensure_topics
from dgstream.workers.kafka.settings import KafkaConnection

pytestmark = [pytest.mark.broker, pytest.mark.slow]

PER_PRODUCER = 6  # requests each client sends in each codec
PARTITIONS = 2


@dataclass(frozen=True)
class FieldInput:
    topic: str
    records: dict[str, Record]  # request id -> what was sent (committed)
    aborted: set[str]  # request ids sent in an aborted transaction


def _records(client: str, codec: str, start: int, n: int) -> list[Record]:
    out = []
    for i in range(start, start + n):
        rid = f"{client}-{codec}-{i}"
        headers = [("traceparent", f"00-{uuid.uuid4().hex}-{i:016x}-01".encode())]
        headers += [("client", client.encode()), ("codec", codec.encode())]
        out.append(Record(rid.encode(), request_bytes(rid, i), headers))
    return out


@pytest.fixture(scope="module")
def field_input(kafka_broker: BrokerInfo) -> FieldInput:
    bootstrap = kafka_broker.bootstrap
    topic = f"field-in-{uuid.uuid4().hex[:10]}"
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap_servers)
    ensure_topics(conn, {topic: PARTITIONS})
    sent: dict[str, Record] = {}
    aborted: set[str] = set()
    java = find_java()
    # The JVMs start together (a few seconds each) while librdkafka sends.
    procs = []
    for codec in CODECS:
        recs = _records("java", codec, 0, PER_PRODUCER)
        sent.update((r.key.decode(), r) for r in recs)
        procs.append(
            (codec, console_produce(java, kafka_broker.lib_dir, bootstrap, topic, recs, codec))
        )
    for codec in CODECS:
        recs = _records("librdkafka", codec, 0, PER_PRODUCER)
        sent.update((r.key.decode(), r) for r in recs)
        librdkafka_produce(bootstrap, topic, recs, codec)
    # A transactional upstream: what it aborted must never be answered.
    committed = _records("librdkafka-txn", "zstd", 0, PER_PRODUCER)
    dropped = _records("librdkafka-txn", "zstd", 100, 3)
    sent.update((r.key.decode(), r) for r in committed)
    aborted.update(r.key.decode() for r in dropped)
    librdkafka_produce(
        bootstrap, topic, committed, "zstd", transactional_id=f"up-{topic}", abort=dropped
    )
    for codec, proc in procs:
        finish(proc, f"the console producer ({codec})")
    return FieldInput(topic, sent, aborted)


def _read_input(conn: KafkaConnection, topic: str) -> list[Any]:
    reader = OutputReader(conn, topic, read_committed=True)
    try:
        reader.read_to_end()
        return list(reader.records)
    finally:
        reader.close()


def test_the_inputs_are_batches_of_every_codec(
    field_input: FieldInput, kafka_broker: BrokerInfo, kafka_connection: KafkaConnection
) -> None:
    """The premise: each client's records sit in batches of the codec it was told (the log
    segments as the broker stores them), and kafka-python reads them all back."""
    data = kafka_broker.nodes[0].data_dir
    by_partition = {
        p: [b for b in segments.batches(data, field_input.topic, p) if not b.control]
        for p in range(PARTITIONS)
    }
    records = _read_input(kafka_connection, field_input.topic)
    assert sorted(r.key.decode() for r in records) == sorted(field_input.records)
    seen: Counter[tuple[str, str]] = Counter()
    for rec in records:
        headers = dict(rec.headers)
        (batch,) = [
            b for b in by_partition[rec.partition] if b.base_offset <= rec.offset <= b.last_offset
        ]
        assert batch.codec == headers["codec"].decode(), (rec.key, batch)
        seen[(headers["client"].decode(), batch.codec)] += 1
    for client in ("java", "librdkafka"):
        for codec in CODECS:
            assert seen[(client, codec)] == PER_PRODUCER, seen


@pytest.fixture
def field_pipeline(
    kafka_connection: KafkaConnection, field_input: FieldInput, unique_name: Any
) -> Iterator[Pipeline]:
    p = Pipeline(
        kafka_connection,
        input=field_input.topic,
        output=unique_name("out"),
        dead=unique_name("dlq"),
        group=unique_name("g"),
    )
    ensure_topics(kafka_connection, {p.output: 2, p.dead: 1})
    try:
        yield p
    finally:
        for r in p.readers:
            r.close()


@pytest.mark.parametrize(
    ("delivery", "out_codec"), [("at_least_once", "lz4"), ("exactly_once", "zstd")]
)
def test_every_field_client_and_codec_is_answered_once(
    field_input: FieldInput,
    field_pipeline: Pipeline,
    worker_threads: list[WorkerThread],
    kafka_broker: BrokerInfo,
    delivery: str,
    out_codec: str,
) -> None:
    p = field_pipeline
    settings = p.settings(delivery=delivery, producer={"compression_type": out_codec})
    worker = WorkerThread(settings).start()
    worker_threads.append(worker)
    out = p.reader(read_committed=True)
    want = set(field_input.records)
    out.read_until(lambda r: worker.error is not None or want <= set(r.keys()), 120, "every result")
    assert worker.error is None, worker.error
    # Everything consumed and committed, the aborted records' offsets included.
    wait_for(lambda: p.lag() == 0, 60, "the group's lag to reach 0")
    out.read_to_end()
    assert worker.error is None, worker.error
    keys = out.keys()
    assert Counter(keys).most_common(1)[0][1] == 1, "a request answered twice"
    assert set(keys) == want, set(keys) ^ want  # and nothing aborted upstream
    results = check_results(out.records)
    for rec in out.records:
        sent = field_input.records[rec.key.decode()]
        # The input's headers first, in order, then ours.
        assert list(rec.headers)[: len(sent.headers)] == sent.headers
        assert json.loads(sent.value)["metadata"] == results[rec.key.decode()]["metadata"]
    dead = p.reader(p.dead, read_committed=True)
    dead.read_to_end()
    assert dead.records == []
    # The results were written in the pipeline's codec (transaction markers never are).
    written = [
        b
        for part in range(2)
        for b in segments.batches(kafka_broker.nodes[0].data_dir, p.output, part)
        if not b.control
    ]
    assert written and {b.codec for b in written} == {out_codec}

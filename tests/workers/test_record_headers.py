"""Through a real broker: an input record's key and headers, read back by kafka-python,
become an output record that the producer accepts and a consumer reads back as the rule
says (input headers first, ours after, ours replacing theirs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from dgstream.workers.kafka.admin import ensure_topics
from dgstream.workers.kafka.settings import KafkaConnection
from dgstream.workers.steps.records import output_headers, output_key

pytestmark = pytest.mark.broker

INPUT_HEADERS = [
    ("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ("ce_id", b"evt-42"),
    ("ce_type", b"com.example.order.created"),
    ("model", b"upstream"),
    ("x-bin", b"\x00\xff"),
]
OURS = [("schema_version", b"1"), ("model", b"demo"), ("worker", b"w-0")]


def _send(conn: KafkaConnection, topic: str, key: bytes | None, headers: list[Any]) -> None:
    producer = KafkaProducer(acks="all", **conn.client_kwargs())
    try:
        producer.send(topic, key=key, value=b"{}", headers=headers).get(timeout=60)
    finally:
        producer.close()


def _read_one(conn: KafkaConnection, topic: str) -> Any:
    consumer = KafkaConsumer(enable_auto_commit=False, **conn.client_kwargs())
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        for _ in range(120):
            for records in consumer.poll(timeout_ms=500).values():
                return records[0]
        raise AssertionError(f"nothing on {topic}")
    finally:
        consumer.close()


@pytest.mark.parametrize("key", [b"order-17", None], ids=["keyed", "unkeyed"])
def test_key_and_headers_survive_the_round_trip(
    kafka_connection: KafkaConnection, unique_name: Callable[[str], str], key: bytes | None
) -> None:
    src, dst = unique_name("in"), unique_name("out")
    ensure_topics(kafka_connection, {src: 1, dst: 1})
    _send(kafka_connection, src, key, INPUT_HEADERS)
    rec = _read_one(kafka_connection, src)
    _send(kafka_connection, dst, output_key(rec.key, "req-1"), output_headers(rec.headers, OURS))
    out = _read_one(kafka_connection, dst)
    assert out.key == (key if key is not None else b"req-1")
    # The input's own `model` gives way to ours; its CloudEvents attributes are not copied.
    kept = [h for h in INPUT_HEADERS if h[0] != "model" and not h[0].startswith("ce_")]
    assert list(out.headers) == kept + OURS

"""Header keys of any bytes. The protocol types a header key as a string, but brokers do not
check it and librdkafka writes whatever bytes it is given; kafka-python 3.0 decodes each
key strictly and fails the whole record batch, which stopped the partition until an
operator skipped the batch (2026-12-07). Kafka's Java consumer reads such a key with the
bad bytes replaced. Here: the worker reads it as Java does, answers the record, keeps the
key's bytes intact where it copies them, and the partition goes on."""

from __future__ import annotations

import base64
import json
import pickle
import subprocess
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.harness.pipeline import Pipeline, WorkerThread, request_bytes
from dgstream.schemas import DeadLetter, ErrorCode, RequestError
from dgstream.schemas.headers import HeaderKey, java_text
from dgstream.workers.kafka.quirks import install

# Not UTF-8: a lone continuation byte, truncated sequences (inside and at the end), overlong
# forms, encoded surrogates (as Java's modified UTF-8 writes them), past U+10FFFF, bytes no
# UTF-8 has.
BAD_KEYS = [
    b"trace\x80id",
    b"x-\xe2\x82",
    b"\xe2\x82x",
    b"\xf0\x9f\x98",
    b"\xc0\xafetc",
    b"\xe0\x80\x80",
    b"sur\xed\xa0\x80rogate",
    b"\xed\xbf\xbf\xed\xb0",
    b"\xed\xa0x\xed\x9f",
    b"\xf4\x90\x80\x80",
    b"\xf5\xff\xfe",
]


@pytest.mark.unit
@pytest.mark.parametrize("raw", BAD_KEYS)
def test_a_header_key_keeps_its_bytes_and_reads_as_replaced_text(raw: bytes) -> None:
    key = HeaderKey(raw)
    assert key == java_text(raw) and "\ufffd" in key
    assert key.replace("\ufffd", "") == raw.decode("utf-8", "ignore")
    assert key.encode() == raw and key.encode("utf-8") == raw and key.encode("UTF8") == raw
    assert key.encode("utf-16") == str(key).encode("utf-16")
    assert key.lower() == str(key).lower()  # compared as text, like any key
    copy = pickle.loads(pickle.dumps(key))
    assert isinstance(copy, HeaderKey) and copy.raw == raw and copy == key
    assert json.dumps({"k": key}) == json.dumps({"k": str(key)})


@pytest.mark.unit
def test_a_dead_letter_keeps_a_bad_keys_bytes_beside_its_text() -> None:
    error = RequestError(code=ErrorCode.INVALID_JSON, message="value: not JSON")
    headers = [(HeaderKey(b"bad\xff"), b"1"), ("plain", None)]
    letter = DeadLetter.build(error, b"x", "in", 0, 7, None, None, "w", headers=headers)
    bad, plain = DeadLetter.model_validate_json(letter.model_dump_json()).headers
    assert (bad.key, bad.key_base64) == ("bad\ufffd", base64.b64encode(b"bad\xff").decode())
    assert (plain.key, plain.key_base64) == ("plain", None)
    (key, value), (plain_key, _) = letter.original_headers()
    assert isinstance(key, HeaderKey) and key.encode() == b"bad\xff" and value == b"1"
    assert plain_key == "plain" and not isinstance(plain_key, HeaderKey)


def _as_read(raw: bytes) -> str:
    """A header key as the worker's reader gives it: text when UTF-8, else a HeaderKey."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return HeaderKey(raw)


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=40), st.one_of(st.none(), st.binary(max_size=40)))))
def test_any_header_keys_bytes_survive_a_dead_letter(headers: list[tuple[bytes, Any]]) -> None:
    """Whatever a producer wrote as header keys and values, the JSON dead letter gives back
    the same bytes, in order."""
    error = RequestError(code=ErrorCode.INVALID_JSON, message="value: not JSON")
    read = [(_as_read(k), v) for k, v in headers]
    letter = DeadLetter.build(error, b"x", "in", 0, 1, None, None, "w", headers=read)
    back = DeadLetter.model_validate_json(letter.model_dump_json()).original_headers()
    assert [(k.encode("utf-8"), v) for k, v in back] == headers


@pytest.mark.unit
def test_the_record_reader_reads_a_batch_with_a_bad_key_like_any_other() -> None:
    """kafka-python's own reader refuses the record; the replacement reads the same
    fields kafka-python reads for a good one, and the records around it are unchanged."""
    from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

    install()
    builder = DefaultRecordBatchBuilder(
        magic=2, compression_type=0, is_transactional=0, producer_id=-1,
        producer_epoch=-1, base_sequence=-1, batch_size=1 << 20,
    )  # fmt: skip
    rows: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]]]] = [
        (b"k0", b"v0", [("good", b"1")]),
        (b"k1", b"v1", [(HeaderKey(b"bad\xff"), b"2"), ("also", None)]),
        (None, None, []),
        (b"k3", b"v3", [(HeaderKey(b"\xfe"), b"")]),
    ]
    for i, (key, value, headers) in enumerate(rows):
        builder.append(i, timestamp=1_700_000_000_000 + i, key=key, value=value, headers=headers)
    batch = DefaultRecordBatch(bytes(builder.build()))
    read = list(batch)
    assert [r.offset for r in read] == [0, 1, 2, 3]
    assert [r.timestamp for r in read] == [1_700_000_000_000 + i for i in range(4)]
    for record, (key, value, headers) in zip(read, rows, strict=True):
        assert (record.key, record.value) == (key, value)
        assert [(str(k), v) for k, v in record.headers] == [(str(k), v) for k, v in headers]
        assert [k.encode() for k, _ in record.headers] == [k.encode() for k, _ in headers]
    assert isinstance(read[1].headers[0][0], HeaderKey)


@pytest.mark.broker
def test_a_record_with_a_bad_header_key_is_answered_and_its_partition_goes_on(
    pipeline: Pipeline, worker_threads: list[WorkerThread], kafka_broker: Any
) -> None:
    """One partition: a request whose header keys are not UTF-8, then a good one. Both are
    answered; the result carries the key's original bytes; Java's consumer reads the key
    as the worker does."""
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(**pipeline.conn.client_kwargs(client_id="dgstream-tests-admin"))
    try:
        admin.create_topics([NewTopic(pipeline.input + "-one", 1, 1)])
    finally:
        admin.close()
    pipeline.input += "-one"
    headers = [(HeaderKey(raw), f"v{i}".encode()) for i, raw in enumerate(BAD_KEYS)]
    pipeline.produce(
        [request_bytes("bad-keys", 0), b"not json", request_bytes("after", 2)],
        keys=[b"bad-keys", b"refused", b"after"],
        headers=[[*headers, ("plain", b"p")], headers, []],
        partition=0,
    )
    worker_threads.append(WorkerThread(pipeline.settings()).start())
    reader = pipeline.reader()
    reader.read_until(lambda r: len(r.records) >= 2, 120, "both answered")
    by_key = {r.key: r for r in reader.records}
    assert set(by_key) == {b"bad-keys", b"after"}
    assert json.loads(by_key[b"after"].value)["status"] == "ok"
    answered = by_key[b"bad-keys"]
    assert json.loads(answered.value)["status"] == "ok"
    copied = [(k.encode(), v) for k, v in answered.headers][: len(BAD_KEYS) + 1]
    assert copied == [(raw, f"v{i}".encode()) for i, raw in enumerate(BAD_KEYS)] + [
        (b"plain", b"p")
    ]
    assert not reader.records or all(
        json.loads(r.value).get("status") == "ok" for r in reader.records
    )
    # A refused record's dead letter keeps each key's text and its bytes.
    dead = pipeline.reader(pipeline.dead)
    dead.read_until(lambda r: len(r.records) >= 1, 60, "the dead letter")
    (letter,) = [DeadLetter.from_record(r.value, r.key, r.headers) for r in dead.records]
    assert letter.error.code == ErrorCode.INVALID_JSON
    assert [h.key for h in letter.headers] == [str(k) for k, _ in headers]
    assert [base64.b64decode(h.key_base64 or "") for h in letter.headers] == list(BAD_KEYS)
    assert [(k.encode(), v) for k, v in letter.original_headers()] == [
        (raw, f"v{i}".encode()) for i, raw in enumerate(BAD_KEYS)
    ]
    # Kafka's Java consumer: the same keys, as text.
    java = _java_header_keys(kafka_broker, pipeline.input)
    assert java == [str(k) for k, _ in headers] + ["plain"], [ascii(k) for k in java]


def _java_header_keys(broker: Any, topic: str) -> list[str]:
    """The first record's header keys, as Kafka's own console consumer prints them."""
    from support.field_clients import _quiet_log4j

    from dgstream.infra.kafka.broker.process import find_java

    cmd = [
        find_java(),
        "-Xmx256m",
        "-XX:TieredStopAtLevel=1",
        "-Dstdout.encoding=UTF-8",
        f"-Dlog4j2.configurationFile={_quiet_log4j()}",
        "-cp",
        f"{broker.lib_dir}/*",
        "org.apache.kafka.tools.consumer.ConsoleConsumer",
        "--bootstrap-server",
        broker.bootstrap,
        "--topic",
        topic,
        "--from-beginning",
        "--max-messages",
        "1",
        "--timeout-ms",
        "60000",
        "--formatter-property",
        "print.headers=true",
        "--formatter-property",
        "print.value=false",
        "--formatter-property",
        "headers.separator=\u0001",
    ]
    out = subprocess.run(cmd, capture_output=True, timeout=120, check=True).stdout
    line = out.decode("utf-8").splitlines()[0]
    # key:value (the values here hold no colon).
    return [pair.rsplit(":", 1)[0] for pair in line.split("\u0001")]

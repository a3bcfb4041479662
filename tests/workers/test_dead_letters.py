"""Dead letters carry the original record byte for byte, and replay resumes, on the real
broker through the `dgstream dlq` command: a small bad record and a tombstone go in the
JSON document; one too large for that (base64 adds a third) goes raw, Kafka Connect's way;
`dgstream dlq --replay-to` sends each record back identical (value, key, headers), and a
second run sends nothing again. Only a record larger than the dead-letter topic takes is
kept in part (a prefix of its value; its key and headers where they fit, else named by
digest and count), points to its original, and is not replayed."""

from __future__ import annotations

from typing import Any

import pytest
from cli_runner import run_cli

from bench.harness.faults import set_topic_config
from bench.harness.pipeline import OutputReader, Pipeline, WorkerThread
from dgstream.schemas import DeadLetter, ErrorCode
from dgstream.schemas.dead_letter import RAW_FORMAT

pytestmark = pytest.mark.broker

# kafka-python writes no header without a value (Java's clients do; the unit tests cover it).
_H: list[tuple[str, bytes | None]] = [("trace", b"\x00\x01"), ("worker", b"not ours"), ("n", b"")]


def _records(pipeline: Pipeline, topic: str, n: int) -> list[Any]:
    r = OutputReader(pipeline.conn, topic)
    pipeline.readers.append(r)
    r.read_until(lambda x: len(x.records) >= n, 90, f"{n} records in {topic}")
    return r.records


def _dlq(pipeline: Pipeline, *extra: str) -> Any:
    boot = ",".join(pipeline.conn.bootstrap_servers)
    out = run_cli(
        "dlq", pipeline.dead, "--from-beginning", "--idle-s", "4", "--bootstrap", boot, *extra
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_dead_letters_keep_the_record_and_replay_it_once(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    big = b"{" + b"x" * 900_000  # INVALID_JSON; 1.2 MB in base64, over the topic's 1 MiB
    sent = [
        (b"{not json", b"k-small", _H),
        (None, b"k-tomb", _H[:1]),  # a tombstone: EMPTY_MESSAGE
        (big, b"k-big", _H),
    ]
    pipeline.produce(
        [v for v, _, _ in sent], keys=[k for _, k, _ in sent], headers=[h for _, _, h in sent]
    )
    worker_threads.append(WorkerThread(pipeline.settings()).start())
    letters = _records(pipeline, pipeline.dead, 3)
    raw = [(RAW_FORMAT, b"raw") in (r.headers or []) for r in letters]
    by_key = {
        DeadLetter.from_record(r.value, r.key, r.headers).source.key_bytes(): r for r in letters
    }
    assert raw.count(True) == 1 and by_key[b"k-big"].value == big  # the original, as it was
    for value, key, headers in sent:
        letter = DeadLetter.from_record(by_key[key].value, by_key[key].key, by_key[key].headers)
        assert letter.original_value() == value and letter.original_headers() == headers
        assert not letter.truncated
    codes = {DeadLetter.from_record(r.value, r.key, r.headers).error.code for r in letters}
    assert codes == {ErrorCode.INVALID_JSON, ErrorCode.EMPTY_MESSAGE}

    replay = pipeline.input + "-replay"
    out = _dlq(pipeline, "--replay-to", replay)
    assert "replayed 3" in out.stdout and out.stdout.count("INVALID_JSON") == 2
    assert "(raw)" in out.stdout
    again = _records(pipeline, replay, 3)
    assert sorted((r.key, r.value, list(r.headers)) for r in again) == sorted(
        (k, v, h)
        for v, k, h in sent  # byte for byte: value, key and headers
    )
    # A second run goes on where the first stopped: nothing to send.
    out = _dlq(pipeline, "--replay-to", replay)
    assert "replayed 0" in out.stdout, out.stdout
    # A new dead letter: only it.
    pipeline.produce([b"[still not a request]"], keys=[b"k-late"])
    _records(pipeline, pipeline.dead, 4)
    out = _dlq(pipeline, "--replay-to", replay)
    assert "replayed 1" in out.stdout, out.stdout
    final = OutputReader(pipeline.conn, replay)
    pipeline.readers.append(final)
    final.read_to_end()
    assert sorted(r.key for r in final.records) == [b"k-big", b"k-late", b"k-small", b"k-tomb"]


def test_a_letter_without_room_for_its_original_points_to_it(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """A dead-letter topic of 8,000 bytes and a record of 60 KB (its key, a header and its
    value 20 KB each): the letter keeps a prefix of the value, names the key by its digest
    and counts the header it left out; the original is where the letter says, and its
    digest matches. It is listed, and not replayed."""
    import hashlib

    from kafka import KafkaConsumer, TopicPartition

    set_topic_config(pipeline.conn, pipeline.dead, {"max.message.bytes": "8000"})
    key, value = b"K" * 20_000, b"<" + b"z" * 20_000
    headers: list[tuple[str, bytes | None]] = [("trace", b"t" * 20_000)]
    pipeline.produce([value], keys=[key], headers=[headers], partition=0)
    worker_threads.append(WorkerThread(pipeline.settings()).start())
    (rec,) = _records(pipeline, pipeline.dead, 1)
    assert dict(rec.headers)["dgstream.dead_letter.format"] == b"truncated"
    assert rec.key == b"sha256:" + hashlib.sha256(key).hexdigest().encode()
    letter = DeadLetter.from_record(rec.value, rec.key, rec.headers)
    assert letter.truncated and letter.error.code == ErrorCode.INVALID_JSON
    assert value.startswith(letter.original_bytes()) and len(letter.original_bytes()) > 4_000
    assert letter.source.key is None and letter.source.key_size == len(key)
    assert letter.source.key_sha256 == hashlib.sha256(key).hexdigest()
    assert letter.headers == [] and letter.headers_omitted == 1
    # By reference: the original, fetched where the letter says, is the one it names.
    consumer = KafkaConsumer(**pipeline.conn.client_kwargs(client_id="dgstream-tests-fetch"))
    try:
        tp = TopicPartition(letter.source.topic, letter.source.partition)
        consumer.assign([tp])
        consumer.seek(tp, letter.source.offset)
        got = consumer.poll(timeout_ms=10_000, max_records=1)[tp][0]
    finally:
        consumer.close()
    assert hashlib.sha256(got.value).hexdigest() == letter.original_sha256
    assert (got.key, list(got.headers)) == (key, headers)
    out = _dlq(pipeline, "--replay-to", pipeline.input + "-replay")
    assert "(truncated)" in out.stdout and "replayed 0 to" in out.stdout


def test_a_record_larger_than_the_dead_letter_topic_takes_keeps_a_prefix(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    set_topic_config(pipeline.conn, pipeline.dead, {"max.message.bytes": "4000"})
    value = b"<" + b"z" * 9_000  # neither its JSON letter nor itself fits 4000 bytes
    pipeline.produce([value], keys=[b"k-huge"])
    worker_threads.append(WorkerThread(pipeline.settings()).start())
    (rec,) = _records(pipeline, pipeline.dead, 1)
    letter = DeadLetter.from_record(rec.value, rec.key, rec.headers)
    assert letter.truncated and letter.original_size == len(value)
    assert value.startswith(letter.original_bytes()) and len(letter.original_bytes()) > 1000
    out = _dlq(pipeline, "--replay-to", pipeline.input + "-replay")
    assert "(truncated)" in out.stdout and "replayed 0 to" in out.stdout and "1 not" in out.stdout

"""Every record gets one answer or one dead letter that fits its topic, on the real broker:
the size arithmetic checked against the broker and kafka-python's
producer to the byte, then a worker given records at those limits and the report's
reproductions (a 2 MB key; 3 headers of 512 KB; requests of 1,048,576 and 1,048,577 bytes,
zstd). Each record is answered or dead-lettered exactly once, with its code, and the
worker never fails a batch (no send refused, no batch read again, no restart)."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from kafka.errors import MessageSizeTooLargeError
from kafka.record.default_records import DefaultRecordBatchBuilder as Builder
from kafka.record.util import size_of_varint

from bench.harness.faults import DELIVERIES, LogTap
from bench.harness.pipeline import INLINE, Pipeline, WorkerThread
from bench.harness.waiting import wait_for
from dgstream.schemas import DeadLetter, ErrorCode
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.kafka.admin import ensure_topics
from dgstream.workers.steps.records import key_digest
from dgstream.workers.steps.topics import TopicGuard, admin_describe

pytestmark = pytest.mark.broker

Headers = list[tuple[str, bytes]]
PRODUCER_MAX = 1_048_576  # kafka-python's and Java's max.request.size, the worker's default
SMALL = 30_000  # a topic's max.message.bytes far below the broker's


def _largest(request: int, batch: int | None) -> int:
    """The largest `size_of` (key, value and headers with their lengths) a record may
    have, from kafka-python's constants: its producer compares 61 + 21 + size_of with
    max_request_size; the broker the lone batch, 61 + (3 + size_of and its length), with
    max.message.bytes."""
    best = request - Builder.HEADER_STRUCT.size - Builder.MAX_RECORD_OVERHEAD
    if batch is not None:
        s = batch
        while Builder.HEADER_STRUCT.size + 3 + s + size_of_varint(3 + s) > batch:
            s -= 1
        best = min(best, s)
    return best


def _size_of(key: bytes | None, value: bytes | None, headers: Any) -> int:
    size: int = Builder.size_of(key, value, headers)
    return size


def _part(data: bytes) -> int:
    """What a key or value of these bytes takes in size_of: its length's varint and it."""
    return size_of_varint(len(data)) + len(data)


def _exact(target: int, make: Callable[[int], tuple[bytes, bytes, Headers]]) -> Any:
    """`make(n)` grown until its record's size_of is `target`, to the byte (a short pad
    header's name takes what a length's varint skips)."""
    n = max(0, target - _size_of(*make(0)) - 16)
    while True:
        k, v, h = make(n + 1)
        if _size_of(k, v, [*h, ("p", b"")]) > target:
            break
        n += 1
    k, v, h = make(n)
    short = target - _size_of(k, v, [*h, ("p", b"")])
    assert 0 <= short < 120, short
    record = (k, v, [*h, ("p" * (1 + short), b"")])
    assert _size_of(*record) == target
    return record


_RANDOM = os.urandom(2_200_000)  # incompressible: no codec makes it smaller


def _rand(n: int) -> bytes:
    return _RANDOM[:n]


_DIMS: dict[str, Callable[[int], tuple[bytes, bytes, Headers]]] = {
    "value": lambda n: (b"k", _rand(n), []),
    "key": lambda n: (_rand(n), b"{}", []),
    "headers": lambda n: (b"k", b"{}", [("h", _rand(n))]),
    "all three": lambda n: (_rand(n // 3), _rand(n // 3), [("h", _rand(n - 2 * (n // 3)))]),
}


def test_the_limits_are_the_producers_and_the_brokers_to_the_byte(
    pipeline: Pipeline, unique_name: Callable[[str], str]
) -> None:
    """A record of the largest size a topic's `Limit` allows is taken; one byte more is
    refused: by the producer's send() at Kafka's defaults, by the broker on a topic with a
    smaller max.message.bytes. On a topic that recompresses (compression.type a codec),
    the largest allowed is taken even when the codec cannot shrink it."""
    from kafka import KafkaAdminClient, KafkaProducer

    codecs = ["producer", "zstd", "gzip", "lz4", "snappy"]
    topics = {"default": (unique_name("default"), {})}
    for codec in codecs:
        configs = {"max.message.bytes": str(SMALL), "compression.type": codec}
        topics[codec] = (unique_name(f"small-{codec}"), configs)
    for name, configs in topics.values():
        ensure_topics(pipeline.conn, {name: 1}, configs=configs)
    admin = KafkaAdminClient(**pipeline.conn.client_kwargs(client_id="limits-admin"))
    guard = TopicGuard(pipeline.settings(), admin_describe(admin))
    producer = KafkaProducer(
        **pipeline.conn.client_kwargs(client_id="limits-producer"),
        acks="all",
        max_request_size=PRODUCER_MAX,
        enable_idempotence=False,  # a refused record must not end the producer
        retries=0,
        linger_ms=0,
    )
    try:
        for kind, (topic, _) in topics.items():
            known = guard.lookup(topic)
            assert known is not None
            limit = known.limit
            codec = "producer" if kind == "default" else kind
            assert limit.codec == codec
            if codec == "producer":  # the broker keeps the batch as sent: exact
                assert limit.max_size_of == _largest(PRODUCER_MAX, limit.batch)
            for dim, make in _DIMS.items():
                for delta in (-1, 0, 1):
                    key, value, headers = _exact(limit.max_size_of + delta, make)
                    assert limit.fits(key, value, headers) == (delta <= 0)
                    what = f"{kind} {dim} {delta:+d}"
                    try:
                        producer.send(topic, key=key, value=value, headers=headers).get(30)
                        taken = True
                    except MessageSizeTooLargeError:
                        taken = False
                    if delta <= 0:
                        assert taken, what
                    elif codec == "producer":
                        assert not taken, what
    finally:
        producer.close(timeout=10)
        admin.close()


# --------------------------------------------------------------------------- the worker

# The request every boundary row sends: the same id (the fake engine's reads are seeded
# by it) so that their results are the same bytes but for the key and headers.
SAME_ID = "same-0001"
_BODY = {"id": SAME_ID, "state": "see you at the game", "questions": INLINE}


def _request(rid: str = SAME_ID, size: int | None = None) -> bytes:
    body = json.dumps({**_BODY, "id": rid}).encode()
    if size is None:
        return body
    return body[:-1] + b" " * (size - len(body)) + b"}"  # padded to `size` bytes


@dataclass
class Row:
    """One input record and the one output it must get."""

    name: str
    value: bytes | None
    key: bytes
    headers: Headers = field(default_factory=list)
    # "result", or a dead letter's code
    expect: str = "result"
    cut: str | None = None  # a result's dgstream.shrunk
    form: str | None = None  # a dead letter's dgstream.dead_letter.format
    offset: int = -1


class Run:
    """A worker on a pipeline whose rows all go to partition 0, each followed by a good
    request (a neighbour must be answered too), and what came out of it."""

    def __init__(
        self, pipeline: Pipeline, threads: list[WorkerThread], settings: WorkerSettings
    ) -> None:
        self.p = pipeline
        self.rows: list[Row] = []
        self.good: list[bytes] = []
        self.worker = WorkerThread(settings)
        self.tap = LogTap(self.worker.worker)
        threads.append(self.worker)
        self.results = pipeline.reader(read_committed=True)
        self.dead = pipeline.reader(pipeline.dead, read_committed=True)
        self._letters: dict[int, DeadLetter] = {}  # id(record) -> its letter, read once

    def letter(self, rec: Any) -> DeadLetter:
        got = self._letters.get(id(rec))
        if got is None:
            got = self._letters[id(rec)] = _letter(rec)
        return got

    def produce(self, rows: list[Row], *, neighbours: bool = True) -> None:
        from kafka import KafkaProducer

        producer = KafkaProducer(
            **self.p.conn.client_kwargs(client_id="limits-rows"),
            acks="all",
            compression_type="zstd",  # the report's: large on the worker, small on the wire
            max_request_size=8 << 20,
            linger_ms=0,
        )
        try:
            for row in rows:
                fut = producer.send(
                    self.p.input, value=row.value, key=row.key, headers=row.headers, partition=0
                )
                row.offset = fut.get(60).offset
                self.rows.append(row)
                if neighbours:
                    key = f"good-{len(self.good):04d}".encode()
                    producer.send(
                        self.p.input, value=_request(key.decode()), key=key, partition=0
                    ).get(60)
                    self.good.append(key)
        finally:
            producer.close(timeout=10)

    def result_key(self, row: Row) -> bytes:
        return key_digest(row.key) if row.cut and "key" in row.cut else row.key

    def wait(self) -> None:
        """Until every row and neighbour has its output; then everything to the end."""
        results = {self.result_key(r) for r in self.rows if r.expect == "result"}
        results |= set(self.good)
        dead = {r.offset for r in self.rows if r.expect != "result"}
        self.results.read_until(
            lambda x: results <= {r.key for r in x.records}, 180, "every result"
        )
        self.dead.read_until(
            lambda x: dead <= {self.letter(r).source.offset for r in x.records},
            180,
            "every dead letter",
        )
        wait_for(lambda: self.p.lag() == 0, 90, "the group's lag to reach 0")
        self.results.read_to_end()
        self.dead.read_to_end()

    def check(self) -> None:
        """Each row's one output, as expected; nothing else went wrong."""
        by_key = Counter(r.key for r in self.results.records)
        letters = [(self.letter(r), r) for r in self.dead.records]
        by_offset = Counter(letter.source.offset for letter, _ in letters)
        for good in self.good:
            assert by_key[good] == 1, good
        for row in self.rows:
            if row.expect == "result":
                key = self.result_key(row)
                assert by_key[key] == 1 and by_offset[row.offset] == 0, row.name
                (rec,) = [r for r in self.results.records if r.key == key]
                headers = dict(rec.headers)
                cut = None if row.cut is None else row.cut.encode()
                assert headers.get("dgstream.shrunk") == cut, (row.name, headers)
                if row.cut:
                    assert headers["dgstream.source.offset"] == str(row.offset).encode()
                continue
            assert by_offset[row.offset] == 1, row.name
            assert by_key[row.key] == by_key[key_digest(row.key)] == 0, row.name
            ((letter, rec),) = [(d, r) for d, r in letters if d.source.offset == row.offset]
            assert letter.error.code == row.expect, (row.name, letter.error)
            form = dict(rec.headers)["dgstream.dead_letter.format"].decode()
            assert form == row.form, (row.name, form)
            assert (row.value or b"").startswith(letter.original_bytes())
            if not letter.truncated:  # all of it: the record as it was
                assert letter.original_value() == row.value
                assert letter.source.key_bytes() == row.key
            elif letter.original_sha256 is not None:
                assert letter.original_sha256 == hashlib.sha256(row.value or b"").hexdigest()
        # No refused send, no batch read again, no failure, the worker still up.
        w = self.worker
        assert w.error is None and w.worker.state == "running"
        status = w.worker.status()
        assert status["last_error"] is None, status["last_error"]
        assert "open_work_abandoned" not in self.tap.events
        assert "worker_failed" not in self.tap.events


def _letter(rec: Any) -> DeadLetter:
    return DeadLetter.from_record(rec.value, rec.key, rec.headers)


# A result's headers that are never cut (docs/errors.md, "Outputs cut to fit").
CORE = ("schema_version", "model", "worker", "output_format", "route")


@dataclass
class Probe:
    """What the probe's result says of every row that sends the same request: size_of
    without the key, as it is (`rest`) and with every header but the core ones left out
    and the record marked so (`least`)."""

    rest: int
    least: int


def _probe(run: Run, probe_key: bytes) -> Probe:
    run.results.read_until(
        lambda x: any(r.key == probe_key for r in x.records), 120, "the probe's result"
    )
    (rec,) = [r for r in run.results.records if r.key == probe_key]
    core = [(k, v) for k, v in rec.headers if k in CORE]
    dropped = len(rec.headers) - len(core)
    marks = [
        ("dgstream.shrunk", b"headers"),
        ("dgstream.shrunk.headers", str(dropped).encode()),
        ("dgstream.source.topic", run.p.input.encode()),
        ("dgstream.source.partition", b"0"),
        ("dgstream.source.offset", b"NN"),  # the rows' offsets have two digits
    ]
    return Probe(
        _size_of(rec.key, rec.value, rec.headers) - _part(probe_key),
        _size_of(rec.key, rec.value, [*core, *marks]) - _part(probe_key),
    )


def _fillers(run: Run) -> None:
    """Ten records first: every row's offset then has two digits (a record cut to fit
    names its offset; the raw dead letter too)."""
    run.produce(
        [Row(f"filler {i}", _request(f"fill-{i:03d}"), f"fill-{i}".encode()) for i in range(5)]
    )


def _length_for(part: int) -> int:
    """The length n of bytes whose part in size_of (n's varint and n) is `part`."""
    n = part - 1
    while n + size_of_varint(n) > part:
        n -= 1
    assert n + size_of_varint(n) == part, part
    return n


def _boundary_rows(probe: Probe, largest: int, tag: str) -> list[Row]:
    """Keys, then a header, that make the result exactly `largest + delta` (size_of).

    - A key, the result as it is: at -1 and 0 answered so; at +1 our CloudEvents
      attributes (the largest headers but the core) left out, the key kept.
    - A key, the result with every header but the core ones left out: at 0 answered so;
      at +1 the key replaced by its digest (and the headers back).
    - An input header, the result as it is: at -1 and 0 answered so; at +1 that header
      left out."""
    rows = []
    for what, base, cuts in (
        ("as is", probe.rest, ((-1, None), (0, None), (1, "headers"))),
        ("least", probe.least, ((0, "headers"), (1, "key"))),
    ):
        for delta, cut in cuts:
            n = _length_for(largest + delta - base)
            key = (f"{tag}{what}{delta:+d}".encode() * n)[:n]
            rows.append(Row(f"{tag} key, {what} {delta:+d}", _request(), key, cut=cut))
    name = "x-pad"
    for delta, cut in ((-1, None), (0, None), (1, "headers")):
        key = f"{tag}h{delta:+d}".encode().ljust(12, b".")
        # The result's header count stays under 128 (its varint, one byte, as before).
        part = largest + delta - probe.rest - _part(key) - _part(name.encode())
        row_headers = [(name, b"h" * _length_for(part))]
        rows.append(Row(f"{tag} header {delta:+d}", _request(), key, row_headers, cut=cut))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("delivery", DELIVERIES)
def test_records_at_kafkas_default_limits_are_each_answered_once(
    pipeline: Pipeline, worker_threads: list[WorkerThread], delivery: str
) -> None:
    settings = pipeline.settings(
        delivery=delivery, output_format="jev", batching={"max_records": 8, "max_wait_ms": 20}
    )
    run = Run(pipeline, worker_threads, settings)
    _fillers(run)
    probe = b"probe-key-0"
    run.produce([Row("probe", _request(), probe)], neighbours=False)
    run.worker.start()
    measured = _probe(run, probe)
    largest = _largest(PRODUCER_MAX, 1_048_588)
    assert largest == 1_048_576 - 82  # the producer's limit binds at Kafka's defaults
    two_mb = b"K" * 2_000_000
    big = [(f"h{i}", b"H" * (512 << 10)) for i in range(3)]
    rows = [
        *_boundary_rows(measured, largest, "d"),
        # The report's, and the parse limit (max_message_bytes, 1 MiB) either side.
        Row("request 1 MiB - 1", _request("under-01", 1_048_575), b"under-01"),
        Row("request of 1 MiB", _request("exact-01", 1_048_576), b"exact-01"),
        Row(
            "request 1 MiB + 1",
            _request("over-001", 1_048_577),
            b"over-001",
            expect=ErrorCode.MESSAGE_TOO_LARGE,
            form="truncated",
        ),
        Row("2 MB key", _request("bigkey-1"), two_mb, cut="key"),
        Row("3 headers of 512 KB", _request("bighdr-1"), b"bighdr-1", big, cut="headers"),
        Row(
            "2 MB key, not JSON",
            b"<not json>",
            two_mb + b"2",
            expect=ErrorCode.INVALID_JSON,
            form="truncated",
        ),
        Row(
            "3 headers of 512 KB, not JSON",
            b"<not json>",
            b"bighdr-2",
            big,
            expect=ErrorCode.INVALID_JSON,
            form="truncated",
        ),
        Row(
            "all three over",
            _request("all-0001", 1_048_577),
            two_mb + b"3",
            big,
            expect=ErrorCode.MESSAGE_TOO_LARGE,
            form="truncated",
        ),
        Row(
            "key and header of 700 KB",
            _request("combo-01"),
            b"c" * 700_000,
            [("x-pad", b"h" * 700_000)],
            cut="headers",
        ),
    ]
    run.produce(rows)
    run.wait()
    run.check()
    shrunk = [r for r in run.results.records if r.key in {key_digest(two_mb), b"bighdr-1"}]
    assert {dict(r.headers).get("dgstream.shrunk.headers") for r in shrunk} == {None, b"2"}
    letters = {_letter(r).source.offset: _letter(r) for r in run.dead.records}
    over = letters[rows[10].offset]
    assert over.original_size == 1_048_577 and over.request_id == "over-001"
    keyed = letters[rows[13].offset]  # the value whole, the key by its digest
    assert keyed.original_bytes() == b"<not json>" and keyed.source.key_size == 2_000_001
    assert keyed.source.key_sha256 == hashlib.sha256(two_mb + b"2").hexdigest()
    headed = letters[rows[14].offset]  # the value whole, two headers left out
    assert headed.original_bytes() == b"<not json>" and headed.headers_omitted == 2
    run.worker.worker.drain()
    run.worker.join()


@pytest.mark.slow
def test_records_at_a_smaller_topics_limit_are_each_answered_once(
    pipeline: Pipeline, worker_threads: list[WorkerThread], unique_name: Callable[[str], str]
) -> None:
    """The output and dead-letter topics take SMALL bytes: results at it either side, dead
    letters in each form (the raw one at its limit either side), a result that fits no
    topic it may go to (OUTPUT_TOO_LARGE, once)."""
    from bench.harness.faults import set_topic_config

    small = {"max.message.bytes": str(SMALL)}
    set_topic_config(pipeline.conn, pipeline.output, small)
    set_topic_config(pipeline.conn, pipeline.dead, small)
    tiny = "dgstream.replies." + unique_name("tiny")
    ensure_topics(pipeline.conn, {tiny: 1}, configs={"max.message.bytes": "300"})
    settings = pipeline.settings(output_format="jev", batching={"max_records": 8})
    run = Run(pipeline, worker_threads, settings)
    _fillers(run)
    probe = b"probe-key-0"
    raw_probe = Row("raw probe", b"<" * 25_000, b"dl-probe", expect=ErrorCode.INVALID_JSON)
    raw_probe.form = "raw"
    run.produce([Row("probe", _request(), probe), raw_probe], neighbours=False)
    run.worker.start()
    measured = _probe(run, probe)
    largest = _largest(PRODUCER_MAX, SMALL)
    run.dead.read_until(lambda x: len(x.records) >= 1, 120, "the raw probe's dead letter")
    (rec,) = run.dead.records
    assert dict(rec.headers)["dgstream.dead_letter.format"] == b"raw"
    raw_rest = _size_of(rec.key, rec.value, rec.headers) - _part(rec.value)

    def raw_row(delta: int, form: str) -> Row:
        n = _length_for(largest + delta - raw_rest)
        key = f"dl-{delta:+d}".encode().ljust(8, b".")  # as long as the probe's (its id)
        return Row(f"raw {delta:+d}", b"<" * n, key, expect=ErrorCode.INVALID_JSON, form=form)

    rows = [
        *_boundary_rows(measured, largest, "s"),
        raw_row(-1, "raw"),
        raw_row(0, "raw"),
        raw_row(1, "truncated"),
        Row("json", b"<short>", b"dl-json.", expect=ErrorCode.INVALID_JSON, form="json"),
        Row(
            "reply too small",
            json.dumps({**_BODY, "id": "reply-01", "reply_topic": tiny}).encode(),
            b"reply-01",
            expect=ErrorCode.OUTPUT_TOO_LARGE,
            form="json",
        ),
        Row(
            "key of 40 KB, not JSON",
            b"<not json>",
            b"k" * 40_000,
            expect=ErrorCode.INVALID_JSON,
            form="truncated",
        ),
        Row(  # nothing of it fits: where it is, and its key's digest
            "tombstone, key and header of 40 KB",
            None,
            b"t" * 40_000,
            [("x-pad", b"h" * 40_000)],
            expect=ErrorCode.EMPTY_MESSAGE,
            form="reference",
        ),
    ]
    run.produce(rows)
    run.wait()
    run.check()
    (nothing,) = [run.letter(r) for r in run.dead.records if run.letter(r).original_null]
    assert nothing.source.key_size == 40_000 and nothing.headers_omitted == 1
    run.worker.worker.drain()
    run.worker.join()

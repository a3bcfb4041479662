"""Record batches read within a bound (`workers.kafka.quirks.bound_batches`,
`workers.kafka.decompress`), without a broker: batches built by kafka-python's own builder, read
by kafka-python's own fetcher code (`Fetcher.PartitionRecords`) with the bound in place.

Within the bound a batch reads exactly as kafka-python reads it (every codec, hostile
bytes too: the bounded decoders are compared with kafka-python's); past it the batch is
one stand-in record at its last offset, and a value past the value bound is cut."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace
from typing import Any

import kafka.codec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import TopicPartition
from kafka.consumer.fetcher import Fetcher
from kafka.record.memory_records import MemoryRecords, MemoryRecordsBuilder

from dgstream.schemas import ErrorCode, FallbackId
from dgstream.workers.faults.poll_errors import unreadable_batch
from dgstream.workers.hosting.metrics import WorkerMetrics
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.kafka.decompress import (
    CutValue,
    OverBound,
    Undecodable,
    UnreadBatch,
    decompress,
)
from dgstream.workers.kafka.quirks import bound_batches
from dgstream.workers.steps.inputs import BATCH_RECORDS_AT_LIMIT, InputReader, bounds

pytestmark = pytest.mark.unit

TP = TopicPartition("in", 0)
GZIP, SNAPPY, LZ4, ZSTD = 1, 2, 3, 4
CODECS = {"none": 0, "gzip": GZIP, "snappy": SNAPPY, "lz4": LZ4, "zstd": ZSTD}
KAFKA_DECODERS = {
    GZIP: kafka.codec.gzip_decode,
    SNAPPY: kafka.codec.snappy_decode,
    LZ4: kafka.codec.lz4_decode,
    ZSTD: kafka.codec.zstd_decode,
}
ENCODERS = {
    GZIP: kafka.codec.gzip_encode,
    SNAPPY: kafka.codec.snappy_encode,
    LZ4: kafka.codec.lz4_encode,
    ZSTD: kafka.codec.zstd_encode,
}
PROPERTY = settings(
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def batch(codec: int, values: list[bytes | None], base_offset: int) -> bytes:
    """One v2 batch of `values` at `base_offset`, as a broker serves it (the base offset,
    outside the CRC, is the broker's to write)."""
    builder = MemoryRecordsBuilder(2, codec, 1 << 30)
    for v in values:
        builder.append(1_000, None, v, [("h", b"v")])
    builder.close()
    raw = bytearray(builder.buffer())
    raw[:8] = base_offset.to_bytes(8, "big", signed=True)
    return bytes(raw)


def bounded(batch_bytes: int, value_bytes: int) -> Any:
    """A consumer whose fetcher is kafka-python's class, bounded."""
    consumer = SimpleNamespace(_fetcher=SimpleNamespace(PartitionRecords=Fetcher.PartitionRecords))
    assert bound_batches(consumer, batch_bytes, value_bytes)
    return consumer


def read(consumer: Any, data: bytes, fetch_offset: int = 0, **kw: Any) -> tuple[list[Any], int]:
    """What the fetcher returns of `data` (a fetched partition), and where it then stands."""
    part = consumer._fetcher.PartitionRecords(fetch_offset, TP, MemoryRecords(data), **kw)
    records = part.take()
    return records, part.next_fetch_offset


@pytest.mark.parametrize("codec", CODECS.values(), ids=CODECS.keys())
def test_batches_within_the_bound_read_as_kafka_python_reads_them(codec: int) -> None:
    values: list[bytes | None] = [b'{"id": "a"}', None, b"", b"x" * 70_000]
    data = batch(codec, values, 10) + batch(codec, [b"next"], 14)
    got, at = read(bounded(1 << 20, 1 << 20), data, 10)
    plain = SimpleNamespace(_fetcher=SimpleNamespace(PartitionRecords=Fetcher.PartitionRecords))
    want, want_at = read(plain, data, 10)
    assert [(r.offset, r.value, r.headers) for r in got] == [
        (r.offset, r.value, r.headers) for r in want
    ]
    assert [r.offset for r in got] == [10, 11, 12, 13, 14] and at == want_at == 15
    assert all(type(r.value) in (bytes, type(None)) for r in got)


@pytest.mark.parametrize("codec", [GZIP, SNAPPY, LZ4, ZSTD], ids=["gzip", "snappy", "lz4", "zstd"])
def test_a_batch_past_the_bound_is_one_record_at_its_last_offset(codec: int) -> None:
    bomb = b"[]," * 400_000  # 1.2 MB, far past a 256 KiB bound
    data = b"".join(
        [
            batch(codec, [b"ok"], 0),
            batch(codec, [bomb, b"good", b"too"], 1),
            batch(codec, [b"after"], 4),
        ]
    )
    got, at = read(bounded(256 << 10, 1 << 20), data)
    assert [r.offset for r in got] == [0, 3, 4] and at == 5
    stand_in = got[1].value
    assert isinstance(stand_in, UnreadBatch) and stand_in == b""
    assert got[1].key is None and got[1].headers == []
    assert (stand_in.base_offset, stand_in.last_offset, stand_in.records) == (1, 3, 3)
    assert stand_in.codec == kafka_name(codec) and stand_in.limit == 256 << 10
    assert "offsets 1..3 (3 record(s)" in stand_in.describe()
    assert [got[0].value, got[2].value] == [b"ok", b"after"]


def kafka_name(codec: int) -> str:
    return {v: k for k, v in CODECS.items()}[codec]


def test_a_fetch_that_starts_inside_the_batch_still_gets_its_stand_in() -> None:
    """The worker seeks back to a record it could not take yet (the stand-in's offset,
    the batch's last); the broker then serves the batch from its start."""
    data = batch(ZSTD, [b"\0" * 300_000, b"b"], 7)
    got, at = read(bounded(100_000, 1 << 20), data, fetch_offset=8)
    assert [r.offset for r in got] == [8] and isinstance(got[0].value, UnreadBatch) and at == 9


def test_a_value_past_the_value_bound_keeps_its_start_and_its_size() -> None:
    long = bytes(range(256)) * 40  # 10,240 bytes
    got, _ = read(bounded(1 << 20, 4_097), batch(LZ4, [long, b"short"], 0))
    cut = got[0].value
    assert isinstance(cut, CutValue) and cut.size == len(long) and cut == long[:4_097]
    assert got[1].value == b"short" and type(got[1].value) is bytes


def test_bounded_decompression_keeps_memory_near_the_bound() -> None:
    """A zstd bomb of 64 MiB (a few KB compressed) against a 1 MiB bound: what
    decompression allocates stays within a few bounds, not the bomb's size."""
    bomb = kafka.codec.zstd_encode(b"\0" * (64 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(OverBound):
            decompress(ZSTD, memoryview(bomb), 1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


@pytest.mark.parametrize("codec", [GZIP, SNAPPY, LZ4, ZSTD], ids=["gzip", "snappy", "lz4", "zstd"])
@PROPERTY
@given(data=st.binary(max_size=3_000), limit=st.integers(0, 4_000))
def test_decompressing_any_payload_agrees_with_kafka_python(
    codec: int, data: bytes, limit: int
) -> None:
    """The same bytes, or an error where kafka-python errs, or OverBound where its output
    would be longer than the limit; never anything else."""
    check_agrees(codec, ENCODERS[codec](data), limit)


@pytest.mark.parametrize("codec", [GZIP, SNAPPY, LZ4, ZSTD], ids=["gzip", "snappy", "lz4", "zstd"])
@PROPERTY
@given(data=st.binary(max_size=2_000), cut=st.integers(0, 100), junk=st.binary(max_size=8))
def test_a_damaged_payload_fails_or_reads_as_kafka_python_reads_it(
    codec: int, data: bytes, cut: int, junk: bytes
) -> None:
    payload = ENCODERS[codec](data)
    check_agrees(codec, payload[: max(0, len(payload) - cut)] + junk, 1 << 20)


def check_agrees(codec: int, payload: bytes, limit: int) -> None:
    try:
        want: bytes | None = KAFKA_DECODERS[codec](payload)
    except Exception:
        want = None
    try:
        got = decompress(codec, memoryview(payload), limit)
    except OverBound:
        # Snappy states each block's length up front: a block stating more than the bound
        # is refused before it is decoded, valid or not.
        assert (want is not None and len(want) > limit) or (want is None and codec == SNAPPY)
        return
    except Undecodable:
        assert want is None
        return
    assert want is not None and got == want and len(got) <= limit


@pytest.mark.parametrize("codec", [GZIP, SNAPPY, LZ4, ZSTD], ids=["gzip", "snappy", "lz4", "zstd"])
def test_gzip_members_lz4_frames_and_zstd_frames_one_after_another(codec: int) -> None:
    """What follows the first member or frame is read as kafka-python reads it (gzip and
    zstd: read on, NUL padding skipped; lz4: ignored)."""
    two = ENCODERS[codec](b"first ") + ENCODERS[codec](b"second")
    check_agrees(codec, two, 1 << 20)
    check_agrees(codec, two + b"\0\0", 1 << 20)


def test_bytes_the_codec_refuses_are_an_undecodable_batch() -> None:
    """The fetcher raises what the bounded decoder raises; the worker names it as it
    names kafka-python's own decoding errors."""
    data = bytearray(batch(ZSTD, [b"payload" * 100], 0))
    data[-20:] = b"\xff" * 20  # the frame's last bytes (CRCs are not checked here)
    consumer = bounded(1 << 20, 1 << 20)
    with pytest.raises(Undecodable) as caught:
        read(consumer, bytes(data), check_crcs=False)
    got = unreadable_batch(caught.value, None)
    assert got is not None and got.cause == "UNDECODABLE_BATCH"


def test_a_consumer_without_kafka_pythons_fetcher_or_bounded_already_is_left_alone() -> None:
    assert bound_batches(SimpleNamespace(), 1, 1) is False
    assert bound_batches(SimpleNamespace(_fetcher=SimpleNamespace()), 1, 1) is False
    consumer = bounded(10, 10)
    first = consumer._fetcher.PartitionRecords
    assert bound_batches(consumer, 1 << 20, 1 << 20) is False
    assert consumer._fetcher.PartitionRecords is first
    assert Fetcher.PartitionRecords is not first  # kafka-python's class is untouched


def settings_with(**over: Any) -> WorkerSettings:
    base: dict[str, Any] = {
        "pipeline": "p",
        "input_topics": ["in"],
        "output_topic": "out",
        "dead_letter_topic": "dlq",
        "group_id": "g",
        "kafka": {"bootstrap_servers": "127.0.0.1:9"},
    }
    return WorkerSettings.model_validate({**base, **over})


def test_the_bounds_come_from_the_settings() -> None:
    assert bounds(settings_with()) == (BATCH_RECORDS_AT_LIMIT * (1 << 20), 1_048_577)
    small = settings_with(parse_limits={"max_message_bytes": 4096})
    assert bounds(small) == (BATCH_RECORDS_AT_LIMIT * 4096, 1_048_577)
    own = settings_with(
        consumer={"max_batch_bytes": 5_000_000},
        parse_limits={"max_message_bytes": 2_000_000},
        producer={"max_request_size": 3_000_000},
    )
    assert bounds(own) == (5_000_000, 3_000_001)


def test_what_the_bounds_left_is_refused_with_its_code_without_parsing() -> None:
    s = settings_with(parse_limits={"max_message_bytes": 4096})
    reader = InputReader(s, WorkerMetrics("p", "w"), log=None)
    fallback = FallbackId("in-0-3", "record")
    data = batch(ZSTD, [b"\0" * 300_000], 3)
    (rec,), _ = read(bounded(100_000, 1 << 20), data)
    err = reader.parse(rec.value, fallback)
    assert not isinstance(err, type(None)) and err.code == ErrorCode.BATCH_TOO_LARGE
    assert "offset 3 (1 record(s), zstd" in err.message and "100000 bytes" in err.message
    cut = CutValue.of(b'{"id": "x", "state": "' + b"s" * 9000 + b'"}', 4097)
    err = reader.parse(cut, fallback)
    assert getattr(err, "code", None) == ErrorCode.MESSAGE_TOO_LARGE
    assert "9024 bytes; the limit is 4096" in str(err)

"""Which poll errors are a batch the consumer cannot read, and where: kafka-python's own
exceptions, and any raised while it unpacks a batch (its record and codec modules)."""

from __future__ import annotations

from typing import Any

import pytest
from kafka import TopicPartition
from kafka.errors import CorruptRecordError, KafkaTimeoutError, UnsupportedCodecError

from dgstream.workers.faults.poll_errors import CAUSES, UnreadableBatch, unreadable_batch

pytestmark = pytest.mark.unit


class _Consumer:
    """What the classifier reads of a consumer: the fetcher's records in line, positions."""

    def __init__(self, tp: TopicPartition | None, position: int) -> None:
        held = type("Held", (), {"topic_partition": tp})() if tp else None
        self._fetcher = type("F", (), {"_next_partition_records": held})()
        self._position = position

    def position(self, tp: TopicPartition, timeout_ms: int | None = None) -> int:
        return self._position


def _raised_in(path: str, exc: BaseException) -> BaseException:
    """`exc` as if raised by code in the file `path`."""
    code = compile("def boom(e):\n    raise e\n", path, "exec")
    space: dict[str, Any] = {}
    exec(code, space)
    try:
        space["boom"](exc)
    except BaseException as caught:
        return caught
    raise AssertionError("not raised")


@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        (
            UnsupportedCodecError("Libraries for lz4 compression codec not found"),
            "UNSUPPORTED_CODEC",
        ),
        (CorruptRecordError("Record batch failed crc check"), "CORRUPT_BATCH"),
        (
            _raised_in("/site-packages/kafka/record/default_records.py", ValueError("bad frame")),
            "UNDECODABLE_BATCH",
        ),
        (
            _raised_in("/site-packages/kafka/codec.py", OSError("not a gzip file")),
            "UNDECODABLE_BATCH",
        ),
    ],
)
def test_unreadable_batches_are_named_with_their_place(exc: BaseException, cause: str) -> None:
    got = unreadable_batch(exc, _Consumer(TopicPartition("orders", 3), 1200))
    assert isinstance(got, UnreadableBatch)
    assert got.cause == cause and cause in CAUSES
    assert (got.topic, got.partition, got.offset) == ("orders", 3, 1200)
    assert got.describe().startswith(f"unreadable batch at orders/3@1200: {cause}: ")


@pytest.mark.parametrize(
    "exc",
    [
        KafkaTimeoutError("no answer"),
        ValueError("a bug of ours"),
        _raised_in("/site-packages/kafka/consumer/fetcher.py", RuntimeError("not decoding")),
        _raised_in("/work/workers/records.py", ValueError("ours, not kafka's")),
    ],
)
def test_other_errors_are_not(exc: BaseException) -> None:
    assert unreadable_batch(exc, _Consumer(TopicPartition("orders", 3), 5)) is None


def test_the_crc_message_names_the_place_when_the_fetcher_does_not() -> None:
    msg = (
        "Record batch for partition TopicPartition(topic='in.v2', partition=7) at offset 41 "
        "failed crc check"
    )
    got = unreadable_batch(CorruptRecordError(msg), _Consumer(None, 41))
    assert got is not None and (got.topic, got.partition, got.offset) == ("in.v2", 7, 41)


def test_an_unknown_place_is_said_so() -> None:
    got = unreadable_batch(UnsupportedCodecError("zstd"), None)
    assert got is not None and got.where == "an unknown partition" and got.offset is None


def test_a_codec_refusal_in_the_bounded_reading_is_an_undecodable_batch() -> None:
    """The worker's consumer decompresses through `workers.kafka.decompress` (its frames are
    ours, not kafka-python's codec module): the codec's refusal is still named."""
    from dgstream.workers.kafka.decompress import Undecodable

    try:
        raise Undecodable("zstd: ZstdError: Unknown frame descriptor") from ValueError("x")
    except Undecodable as exc:
        got = unreadable_batch(exc, _Consumer(TopicPartition("orders", 3), 77))
    assert got is not None and got.cause == "UNDECODABLE_BATCH"
    assert (got.topic, got.partition, got.offset) == ("orders", 3, 77)
    assert "Unknown frame descriptor" in got.detail


def test_a_batch_past_the_bound_is_no_poll_error() -> None:
    """It is read as far as the bound and stands as one record (dead-lettered), so its
    partition moves on: nothing about it reaches the poll as an error."""
    from dgstream.workers.kafka.decompress import OverBound

    assert unreadable_batch(OverBound(1 << 20, 2 << 20), _Consumer(None, 0)) is None

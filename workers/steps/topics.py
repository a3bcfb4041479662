"""Where an output may go, and how large it may be.

A result goes to the output topic, a route's topic (the pipeline's own outputs, like the
output topic) or the request's `reply_topic`. A reply topic must be
allowed by the pipeline (`WorkerSettings.reply_topics`, shell-style patterns; never an
internal topic, an input topic or the dead-letter topic), exist (the worker creates
none) and be writable; each refusal has its own code. Every record must fit its topic
(`Limit`, to the byte): the producer's `max_request_size` and the topic's
`max.message.bytes` (with its `compression.type`).

The cluster is asked once per topic (one metadata and one config request on an admin
connection of its own, bounded); a good answer is kept, a bad one for `BAD_TTL_S`, so that
a topic created later becomes usable and a flood of bad names costs one lookup each per
minute; a question that failed is asked again after as long (a flood of records does not
make a flood of questions), or at once after a refused send (`forget`).
"""

from __future__ import annotations

import fnmatch
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kafka.record.default_records import DefaultRecordBatchBuilder
from kafka.record.util import size_of_varint

from dgstream.schemas import ErrorCode, RequestError
from dgstream.workers.hosting.settings import WorkerSettings

__all__ = ["BAD_TTL_S", "Known", "Limit", "TopicGuard", "batch_size", "header_size", "record_size"]

# A bad reply topic is asked about again after this long (it may have been created).
BAD_TTL_S = 60.0
# Kafka's error codes in a metadata answer.
_UNKNOWN_TOPIC = 3
_TOPIC_AUTHORIZATION_FAILED = 29

# The v2 record batch's fixed header (baseOffset .. recordCount: 61 bytes), and what
# kafka-python's estimate adds for a record's own fields beyond its key, value and headers
# (its MAX_RECORD_OVERHEAD: a 5-byte length, a 10-byte timestamp delta, a 5-byte offset
# delta, the attributes byte). A record alone in its batch has a timestamp delta and an
# offset delta of 0 (one byte each) instead.
_BATCH_HEADER: int = DefaultRecordBatchBuilder.HEADER_STRUCT.size
_ESTIMATE_OVERHEAD: int = _BATCH_HEADER + DefaultRecordBatchBuilder.MAX_RECORD_OVERHEAD
_LONE_BODY = 3  # attributes, timestamp delta 0, offset delta 0


def record_size(
    key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]]
) -> int:
    """kafka-python's estimate of the record, the figure its producer compares with
    `max_request_size` (`KafkaProducer._ensure_valid_record_size`): send() raises
    MessageSizeTooLargeError above it."""
    size: int = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)
    return size


def batch_size(
    key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]]
) -> int:
    """Bytes of the record alone in an uncompressed v2 batch: what the broker compares with
    the topic's max.message.bytes (the whole batch, its 61-byte header included; measured
    on the test broker: a lone batch of exactly max.message.bytes is taken, one byte more
    refused). kafka-python never sends a batch that compression made larger
    (`DefaultRecordBatchBuilder._maybe_compress` sends it uncompressed instead), so a
    compressed batch is at most this."""
    size: int = _BATCH_HEADER + DefaultRecordBatchBuilder.size_in_bytes(0, 0, key, value, headers)
    return size


def header_size(name: str, value: bytes | None) -> int:
    """Bytes one header takes in a record (`DefaultRecordBatchBuilder.size_of`'s terms)."""
    n = len(name.encode("utf-8"))
    v = 1 if value is None else size_of_varint(len(value)) + len(value)
    return size_of_varint(n) + n + v


def _blocks(n: int, block: int) -> int:
    return -(-n // block) if n else 1


def _growth(codec: str, n: int) -> int:
    """The most a broker that recompresses `n` bytes of records with `codec` may add to
    them (incompressible bytes). Each codec stores what does not shrink; the bounds are
    its framing, and were checked against the test broker (Kafka 4.x), which added at most
    12/23/15/25 bytes (zstd/gzip/lz4/snappy) to random 5 KB records and 33/338/75/336 to
    random 1 MB ones."""
    if codec == "zstd":
        # RFC 8878: a frame header of at most 18 bytes, a 4-byte checksum, and a 3-byte
        # header per block of at most 128 KiB (stored raw when it does not shrink), one
        # more for the empty last block a stream may close with.
        return 22 + 3 * (_blocks(n, 128 << 10) + 1)
    if codec == "gzip":
        # zlib's deflateBound() for the default memLevel, plus gzip's 18-byte wrapper.
        return (n >> 12) + (n >> 14) + (n >> 25) + 7 + 18
    if codec == "lz4":
        # Kafka's LZ4 frame (KafkaLZ4BlockOutputStream): a 7-byte header, a 4-byte length
        # before each block of at most 64 KiB (stored raw when it does not shrink), a
        # 4-byte end mark; 4 more in case a content checksum is written.
        return 15 + 4 * _blocks(n, 64 << 10)
    if codec == "snappy":
        # xerial's stream: a 16-byte header, then 32 KiB blocks, each a 4-byte length and
        # snappy's MaxCompressedLength (32 + b + b/6) at worst.
        full, rest = divmod(n, 32 << 10)
        per = [32 << 10] * full + ([rest] if rest or not full else [])
        return 16 + sum(4 + 32 + b // 6 for b in per)
    return 0


# A topic's compression.type under which the broker keeps the batch as the producer
# sent it, or stores it uncompressed: no growth beyond `batch_size`.
_KEEPS_BATCH = frozenset({"producer", "uncompressed", "none", ""})


@dataclass(frozen=True)
class Limit:
    """What a record must pass to be produced to one topic, to the byte.

    - `request`: the producer's max_request_size, against kafka-python's estimate
      (`record_size`), checked in send() before anything goes out.
    - `batch`: the topic's max.message.bytes (None: not known), against the record's
      batch as the broker stores it (`batch_size`; kafka-python's producer splits a
      refused batch of several records, so only a lone record's batch must fit).
    - `codec`: the topic's compression.type; a codec there (not `producer`) makes the
      broker recompress what it takes, which may grow incompressible bytes (`_growth`).

    Both sizes are the record's `size_of` (key, value and headers with their lengths)
    plus fixed terms, so `max_size_of` answers for any record at once."""

    request: int
    batch: int | None = None
    codec: str = "producer"

    def fits_size_of(self, size_of: int) -> bool:
        """Whether a record whose key, value and headers take `size_of` bytes fits."""
        if _ESTIMATE_OVERHEAD + size_of > self.request:
            return False
        if self.batch is None:
            return True
        body = _LONE_BODY + size_of
        records = body + size_of_varint(body)
        if self.codec not in _KEEPS_BATCH:
            records += _growth(self.codec, records)
        return _BATCH_HEADER + records <= self.batch

    @functools.cached_property
    def max_size_of(self) -> int:
        """The largest `size_of` that fits (-1: none does). Both checks grow with it."""
        lo, hi = -1, max(self.request, 0)
        while hi - lo > 1:  # lo fits (or is -1), hi does not
            mid = (lo + hi) // 2
            if self.fits_size_of(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def fits(
        self, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]]
    ) -> bool:
        """Whether this record fits, by kafka-python's own functions."""
        if record_size(key, value, headers) > self.request:
            return False
        if self.batch is None:
            return True
        size = batch_size(key, value, headers)
        if self.codec not in _KEEPS_BATCH:
            size += _growth(self.codec, size - _BATCH_HEADER)
        return size <= self.batch

    def describe(self) -> str:
        """For messages: the limits that apply."""
        topic = "" if self.batch is None else f", max.message.bytes {self.batch}"
        codec = "" if self.codec in _KEEPS_BATCH else f" ({self.codec} on the broker)"
        return f"max_request_size {self.request}{topic}{codec}"


@dataclass(frozen=True)
class Known:
    """What the cluster said about a topic: why results may not go there (None: they
    may), the limit its records must fit, and when it said so."""

    refusal: RequestError | None
    limit: Limit
    at: float


# The cluster's answer about one topic: its metadata entry, its max.message.bytes and its
# compression.type (None when unknown).
Describe = Callable[[str], tuple[dict[str, Any], int | None, str | None]]


class TopicGuard:
    """Answers "may this record go to that topic?" for one worker.

    `lookup(topic)` asks the cluster (blocking: run it off the event loop); the rest are
    local. Thread-safe enough for one writer: entries are replaced whole."""

    def __init__(
        self,
        settings: WorkerSettings,
        describe: Describe,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._describe = describe
        self._clock = clock
        self._producer_max = settings.producer.max_request_size
        self._known: dict[str, Known] = {}
        self._failed: dict[str, float] = {}  # topic -> when a question about it failed
        self._never = set(settings.input_topics) | {settings.dead_letter_topic}
        # The pipeline's own outputs: the output topic and every route's topic.
        self._outputs = {settings.output_topic, *(r.topic for r in settings.routes)}

    # ---------------------------------------------------------------- names

    def by_name(self, topic: str) -> RequestError | None:
        """The allow-list's answer, without asking the cluster."""
        s = self._settings
        if topic in self._outputs:
            return None
        if topic.startswith("__") or topic in self._never:
            why = "an internal topic" if topic.startswith("__") else "one of the pipeline's own"
            return self._refuse(ErrorCode.REPLY_TOPIC_NOT_ALLOWED, topic, f"it is {why}")
        if not any(fnmatch.fnmatchcase(topic, p) for p in s.reply_topics):
            allowed = ", ".join(s.reply_topics) or "none"
            return self._refuse(
                ErrorCode.REPLY_TOPIC_NOT_ALLOWED,
                topic,
                f"pipeline {s.pipeline!r} allows {s.output_topic!r} and {allowed}",
            )
        return None

    def cached(self, topic: str) -> Known | None:
        known = self._known.get(topic)
        if known is None:
            return None
        if known.refusal is not None and self._clock() - known.at > BAD_TTL_S:
            return None
        return known

    # ---------------------------------------------------------------- the cluster

    def lookup(self, topic: str) -> Known | None:
        """Ask the cluster about `topic` (blocking) and remember the answer; None for a
        question that failed (nothing is remembered: it is asked again next time)."""
        try:
            meta, max_bytes, codec = self._describe(topic)
        except Exception:
            self._failed[topic] = self._clock()
            return None
        self._failed.pop(topic, None)
        own = topic in self._outputs or topic == self._settings.dead_letter_topic
        refusal = None if own else self._judge(topic, meta)
        limit = Limit(self._producer_max, max_bytes, codec or "producer")
        known = Known(refusal, limit, self._clock())
        self._known[topic] = known
        return known

    def _judge(self, topic: str, meta: dict[str, Any]) -> RequestError | None:
        code = meta.get("error_code", 0)
        if meta.get("is_internal"):
            return self._refuse(ErrorCode.REPLY_TOPIC_NOT_ALLOWED, topic, "it is internal")
        if code == _UNKNOWN_TOPIC:
            return self._refuse(ErrorCode.REPLY_TOPIC_UNKNOWN, topic, "no such topic")
        if code == _TOPIC_AUTHORIZATION_FAILED or "WRITE" not in (
            meta.get("authorized_operations") or ["WRITE"]
        ):
            return self._refuse(ErrorCode.REPLY_TOPIC_NOT_WRITABLE, topic, "not authorized")
        if code:
            return self._refuse(ErrorCode.REPLY_TOPIC_UNKNOWN, topic, f"metadata error {code}")
        return None

    def due(self, topic: str) -> bool:
        """Whether `topic` is to be asked about now: nothing is known of it (or a refusal
        that expired), and no question about it failed in the last `BAD_TTL_S`."""
        if self.cached(topic) is not None:
            return False
        failed = self._failed.get(topic)
        return failed is None or self._clock() - failed > BAD_TTL_S

    def forget(self, topic: str) -> None:
        """A write to `topic` failed against what was known (its limit or its ACLs may
        have changed): ask again next time."""
        self._known.pop(topic, None)
        self._failed.pop(topic, None)

    # ---------------------------------------------------------------- sizes

    def limit(self, topic: str) -> Limit:
        """What a record to `topic` must fit (the producer's limit alone until the topic
        was asked about)."""
        known = self._known.get(topic)
        return known.limit if known is not None else Limit(self._producer_max)

    @staticmethod
    def _refuse(code: ErrorCode, topic: str, why: str) -> RequestError:
        return RequestError(
            code=code, message=f"reply_topic: cannot write to {topic!r}: {why}", field="reply_topic"
        )


def admin_describe(admin: Any) -> Describe:
    """`TopicGuard`'s question to the cluster through a kafka-python admin client: the
    topic's metadata entry, its max.message.bytes and its compression.type (None when
    unknown)."""
    from kafka.admin import ConfigResource, ConfigResourceType

    names = ["max.message.bytes", "compression.type"]

    def describe(topic: str) -> tuple[dict[str, Any], int | None, str | None]:
        (meta,) = admin.describe_topics([topic])
        if meta.get("error_code", 0) or meta.get("is_internal"):
            return meta, None, None
        configs = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, configs=names)],
            config_filter="all",
        )
        entries = configs.get("topic", {}).get(topic, {})
        max_bytes = entries.get("max.message.bytes", {}).get("value")
        codec = entries.get("compression.type", {}).get("value")
        return meta, int(max_bytes) if max_bytes is not None else None, codec

    return describe

"""Where an output may go, and how large it may be.

A result goes to the output topic, a route's topic (the pipeline's own outputs, like the
output topic) or the request's `reply_topic`. A reply topic must be
allowed by the pipeline (`WorkerSettings.reply_topics`, shell-style patterns; never an
internal topic, an input topic or the dead-letter topic), exist (the worker creates
none) and be writable; each refusal has its own code. Every record must fit its topic:
`max.message.bytes` there and the producer's `max_request_size`.

The cluster is asked once per topic (one metadata and one config request on an admin
connection of its own, bounded); a good answer is kept, a bad one for `BAD_TTL_S`, so that
a topic created later becomes usable and a flood of bad names costs one lookup each per
minute.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kafka.record.default_records import DefaultRecordBatchBuilder

from schemas import ErrorCode, RequestError
from workers.settings import WorkerSettings

__all__ = ["BAD_TTL_S", "Known", "TopicGuard", "record_size"]

# A bad reply topic is asked about again after this long (it may have been created).
BAD_TTL_S = 60.0
# Kafka's error codes in a metadata answer.
_UNKNOWN_TOPIC = 3
_TOPIC_AUTHORIZATION_FAILED = 29


def record_size(
    key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]]
) -> int:
    """Bytes the record takes in a batch of its own (what the broker compares with
    max.message.bytes), as kafka-python's producer estimates it."""
    size: int = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)
    return size


@dataclass(frozen=True)
class Known:
    """What the cluster said about a topic: why results may not go there (None: they
    may), the largest record it takes, and when it said so."""

    refusal: RequestError | None
    max_bytes: int
    at: float


class TopicGuard:
    """Answers "may this record go to that topic?" for one worker.

    `lookup(topic)` asks the cluster (blocking: run it off the event loop); the rest are
    local. Thread-safe enough for one writer: entries are replaced whole."""

    def __init__(
        self,
        settings: WorkerSettings,
        describe: Callable[[str], tuple[dict[str, Any], int | None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._describe = describe  # topic -> (its metadata entry, its max.message.bytes)
        self._clock = clock
        self._producer_max = settings.producer.max_request_size
        self._known: dict[str, Known] = {}
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
            meta, max_bytes = self._describe(topic)
        except Exception:
            return None
        own = topic in self._outputs or topic == self._settings.dead_letter_topic
        refusal = None if own else self._judge(topic, meta)
        limit = min(max_bytes or self._producer_max, self._producer_max)
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

    def forget(self, topic: str) -> None:
        """A write to `topic` failed against what was known (its limit or its ACLs may
        have changed): ask again next time."""
        self._known.pop(topic, None)

    # ---------------------------------------------------------------- sizes

    def max_bytes(self, topic: str) -> int:
        """The largest record `topic` takes (the producer's limit until it was asked)."""
        known = self._known.get(topic)
        return known.max_bytes if known is not None else self._producer_max

    def too_large(self, topic: str, size: int) -> RequestError | None:
        limit = self.max_bytes(topic)
        if size <= limit:
            return None
        return RequestError(
            code=ErrorCode.OUTPUT_TOO_LARGE,
            message=f"the result is {size} bytes; {topic!r} takes at most {limit}",
        )

    @staticmethod
    def _refuse(code: ErrorCode, topic: str, why: str) -> RequestError:
        return RequestError(
            code=code, message=f"reply_topic: cannot write to {topic!r}: {why}", field="reply_topic"
        )


def admin_describe(admin: Any) -> Callable[[str], tuple[dict[str, Any], int | None]]:
    """`TopicGuard`'s question to the cluster through a kafka-python admin client: the
    topic's metadata entry and its max.message.bytes (None when unknown)."""
    from kafka.admin import ConfigResource, ConfigResourceType

    def describe(topic: str) -> tuple[dict[str, Any], int | None]:
        (meta,) = admin.describe_topics([topic])
        if meta.get("error_code", 0) or meta.get("is_internal"):
            return meta, None
        configs = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, configs=["max.message.bytes"])],
            config_filter="all",
        )
        entry = configs.get("topic", {}).get(topic, {}).get("max.message.bytes", {})
        value = entry.get("value")
        return meta, int(value) if value is not None else None

    return describe

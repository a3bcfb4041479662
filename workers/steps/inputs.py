"""Step 5's reading of one record value: the Schema Registry framing when the pipeline's
input is framed (`input_framing: confluent`: the magic byte and schema id read, the id
checked against the registry when one is configured), then `schemas.parse_request` on the
JSON. A refusal is a `RequestError` (the dead letter keeps the framed value as it came).

Before any of that, what the consumer's bounds (`bound_consumer`) left of a value: a
batch it did not read (BATCH_TOO_LARGE) or a value it kept only the start of
(MESSAGE_TOO_LARGE, as the whole value would have been), refused without parsing.
"""

from __future__ import annotations

import time
from typing import Any

from dgstream.schemas import (
    ClassificationRequest,
    ErrorCode,
    FallbackId,
    RequestError,
    parse_request,
)
from dgstream.schemas.framing import unframe
from dgstream.workers.hosting.metrics import WorkerMetrics
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.kafka.decompress import CutValue, UnreadBatch
from dgstream.workers.kafka.quirks import bound_batches
from dgstream.workers.kafka.schema_registry import RegistryClient

__all__ = ["BATCH_RECORDS_AT_LIMIT", "InputReader", "bound_consumer", "bounds"]

# While the registry is away, say so in the log at most this often (each record is counted).
_UNVERIFIED_LOG_EVERY_S = 60.0
# consumer.max_batch_bytes unset: a record batch may decompress to this many requests at
# the size limit (32 MiB with the default 1 MiB). The defaults of the producers the field
# uses stay far below: librdkafka's batch.size (1,000,000 bytes before compression) and
# Java's and kafka-python's (16,384) fill a batch with 1 MB at most, plus one record of any
# size; even a batch the broker takes whole (message.max.bytes, 1 MiB compressed) of
# varied JSON (3x-10x under zstd) fits. A bomb does not: 200 MB of JSON in 19 KB of zstd.
BATCH_RECORDS_AT_LIMIT = 32


def bounds(settings: WorkerSettings) -> tuple[int, int]:
    """(bytes one record batch may decompress to, bytes of one value kept whole).

    The second is one byte over the most the worker could use: any value longer is
    refused MESSAGE_TOO_LARGE (over max_message_bytes), and its dead letter holds at most
    the producer's max_request_size of it, so the first bytes kept are all it needs."""
    limits, explicit = settings.parse_limits, settings.consumer.max_batch_bytes
    batch = explicit if explicit is not None else BATCH_RECORDS_AT_LIMIT * limits.max_message_bytes
    value = max(limits.max_message_bytes, settings.producer.max_request_size) + 1
    return batch, value


def bound_consumer(consumer: Any, settings: WorkerSettings) -> bool:
    """Bound what one record batch and one value cost this consumer in memory
    (`workers.kafka.quirks.bound_batches` with `bounds(settings)`); call it on the
    worker's consumer before its first poll. Returns whether the bound is in place."""
    return bound_batches(consumer, *bounds(settings))


class InputReader:
    def __init__(
        self,
        settings: WorkerSettings,
        metrics: WorkerMetrics,
        log: Any,
        registry: RegistryClient | None = None,
    ) -> None:
        self._settings = settings
        self._framed = settings.input_framing == "confluent"
        self._registry = registry
        if registry is None and self._framed and settings.schema_registry is not None:
            self._registry = RegistryClient(settings.schema_registry)
        self._metrics = metrics
        self._log = log
        self._logged_at = float("-inf")

    def parse(
        self, value: bytes | None, fallback: FallbackId, content_type: str | None = None
    ) -> ClassificationRequest | RequestError:
        """`content_type`: the record's `content-type` header (a structured CloudEvent says
        so there)."""
        if isinstance(value, UnreadBatch):
            return RequestError(code=ErrorCode.BATCH_TOO_LARGE, message=value.describe())
        if isinstance(value, CutValue):
            limit = self._settings.parse_limits.max_message_bytes
            return RequestError(
                code=ErrorCode.MESSAGE_TOO_LARGE,
                message=f"the message has {value.size} bytes; the limit is {limit}",
            )
        if self._framed and value:  # no value at all stays EMPTY_MESSAGE
            got = self._unframe(value)
            if isinstance(got, RequestError):
                return got
            value = got
        return parse_request(
            value, self._settings.parse_limits, fallback_id=fallback, content_type=content_type
        )

    def _unframe(self, value: bytes) -> bytes | RequestError:
        framed = unframe(value)
        if isinstance(framed, RequestError):
            return framed
        schema_id, payload = framed
        if self._registry is None:
            return payload
        check = self._registry.check(schema_id)
        if check == "unknown":
            return RequestError(
                code=ErrorCode.SCHEMA_ID_UNKNOWN,
                message=f"value: schema id {schema_id} is unknown to the schema registry",
            )
        if check == "not_json":
            return RequestError(
                code=ErrorCode.SCHEMA_NOT_JSON,
                message=f"value: schema id {schema_id} names a schema that is not a JSON Schema",
            )
        if check == "unverified":
            self._metrics.record_registry_unverified()
            now = time.monotonic()
            if now - self._logged_at >= _UNVERIFIED_LOG_EVERY_S:
                self._logged_at = now
                self._log.warning("registry_unreachable", schema_id=schema_id)
        return payload

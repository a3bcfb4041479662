"""Step 5's reading of one record value: the Schema Registry framing when the pipeline's
input is framed (`input_framing: confluent`: the magic byte and schema id read, the id
checked against the registry when one is configured), then `schemas.parse_request` on the
JSON. A refusal is a `RequestError` (the dead letter keeps the framed value as it came).
"""

from __future__ import annotations

import time
from typing import Any

from schemas import ClassificationRequest, ErrorCode, FallbackId, RequestError, parse_request
from schemas.framing import unframe
from workers.metrics import WorkerMetrics
from workers.registry import RegistryClient
from workers.settings import WorkerSettings

__all__ = ["InputReader"]

# While the registry is away, say so in the log at most this often (each record is counted).
_UNVERIFIED_LOG_EVERY_S = 60.0


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

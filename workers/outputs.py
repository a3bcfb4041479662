"""Step 8 of the worker: one output per input record, in input order.

A result goes to the output topic, or to the request's `reply_topic` when the pipeline
allows it and the cluster has it (`workers.topics.TopicGuard`); a result that does not fit
its topic, or may not go where it asks, becomes a dead letter with the reason's code, and
its neighbours are answered. When the broker refuses a record anyway (the topic's limit or
ACLs changed since they were read), the worker forgets what it knew of that topic and reads
the batch again: this time the check here refuses the record. Nothing here raises: a bug in
building one output dead-letters that record.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any

from schemas import SCHEMA_VERSION, ClassificationResult, DeadLetter, ErrorCode, RequestError
from schemas.framing import frame
from workers.batches import Batch, Entry, Output
from workers.decisions import Decisions
from workers.outage import Outage
from workers.records import OutputRecord, output_headers, output_key, result_record
from workers.registry import RegistryClient, RegistryDown
from workers.routes import Router
from workers.settings import WorkerSettings
from workers.topics import Known, TopicGuard, record_size

__all__ = ["OutputBuilder"]

# A reply topic's lookup (one metadata and one config request) gives up after this long;
# the result is then sent as is, and the producer's own answer decides.
_LOOKUP_TIMEOUT_S = 5.0


class OutputBuilder:
    """Builds a batch's outputs (engine loop)."""

    def __init__(
        self,
        settings: WorkerSettings,
        model: bytes,
        topics: TopicGuard,
        log: Any,
        decisions: Decisions | None = None,
    ) -> None:
        self._settings = settings
        self._name = settings.name
        self._topics = topics
        self._log = log
        self._version = str(SCHEMA_VERSION).encode()
        self._result_headers: list[tuple[str, bytes]] = [
            ("schema_version", self._version),
            ("model", model),
            ("worker", self._name.encode()),
        ]
        self._router = Router(settings.routes, settings.output_topic)
        self._decisions = decisions
        self._registry: RegistryClient | None = None
        if settings.output_framing == "confluent" and settings.schema_registry is not None:
            self._registry = RegistryClient(settings.schema_registry)
            # The topics known now get their ids at once (a registry away fails the start:
            # a framed result cannot be written without its id).
            routed = () if settings.shadow else (r.topic for r in settings.routes)
            for topic in {settings.output_topic, *routed}:
                self._schema_id(topic)

    def _schema_id(self, topic: str) -> int:
        """The id of the result schema under the topic's subject (`<topic>-value`, the
        registry's default TopicNameStrategy), registered on first use (cached)."""
        assert self._registry is not None
        return self._registry.register(f"{topic}-value", _result_schema(self._settings))

    async def _framed(self, rec: OutputRecord) -> OutputRecord:
        if self._registry is None:
            return rec
        loop = asyncio.get_running_loop()
        try:
            schema_id = await loop.run_in_executor(None, self._schema_id, rec.topic)
        except RegistryDown as exc:
            raise Outage("output", f"the schema registry: {exc}"[:500]) from exc
        return rec._replace(value=frame(schema_id, rec.value))

    async def build(
        self, batch: Batch, outcomes: Sequence[ClassificationResult | RequestError]
    ) -> list[Output]:
        it = iter(outcomes)
        out: list[Output] = []
        trace = batch.trace
        for i, entry in enumerate(batch.entries):
            outcome = next(it) if entry.error is None else entry.error
            try:
                out.append(await self._output(entry, outcome, i, trace))
            except Outage:
                raise  # not the record's fault: the batch is held and tried again
            except Exception as exc:  # a bug must not poison the partition: dead-letter it
                self._log.error("output_failed", error=repr(exc), exc_info=True)
                error = RequestError(
                    code=ErrorCode.ENGINE_FAILED,
                    message=f"the worker could not build this request's output: {exc!r}"[:500],
                )
                out.append(self.dead_letter(entry, error, i, trace))
        return out

    async def _output(
        self, entry: Entry, outcome: ClassificationResult | RequestError, i: int, trace: Any
    ) -> Output:
        if isinstance(outcome, RequestError):
            return self.dead_letter(entry, outcome, i, trace)
        assert entry.request is not None
        d = self._decisions
        extra: list[tuple[str, bytes]] = []
        if d is not None:
            # Calibrated before the routes read it; audited once the route is known.
            outcome = d.calibrate(outcome)
            extra = d.result_headers(entry, entry.request, outcome, i, trace)
        # The topic (reply topic, else the first route that holds, else the output topic;
        # a shadow's always the output topic), the input's key and headers, the value in
        # the pipeline's format.
        s = self._settings
        rec = result_record(
            outcome,
            router=self._router,
            output_format=s.output_format,
            reply_topic=entry.request.reply_topic,
            input_key=entry.key,
            input_headers=entry.headers,
            ours=self._result_headers,
            audit=None if d is None else functools.partial(d.auditor.audit, entry.request),
            shadow=s.shadow,
            moderation=s.moderation,
            extra=extra,
        )
        refusal = await self._where(rec.topic)
        if refusal is not None:
            return self.dead_letter(entry, refusal, i, trace)
        rec = await self._framed(rec)
        headers: list[tuple[str, bytes | None]] = list(rec.headers)
        too_large = self._topics.too_large(rec.topic, record_size(rec.key, rec.value, headers))
        if too_large is not None:
            return self.dead_letter(entry, too_large, i, trace)
        return Output(rec.topic, rec.key, rec.value, headers, entry, None, rec.route)

    async def _where(self, topic: str) -> RequestError | None:
        """Why a result may not go to `topic` (None: it may); learns the topic's limit."""
        refusal = self._topics.by_name(topic)
        if refusal is not None:
            return refusal
        known = self._topics.cached(topic) or await self._lookup(topic)
        return None if known is None else known.refusal

    async def _lookup(self, topic: str) -> Known | None:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(None, self._topics.lookup, topic), _LOOKUP_TIMEOUT_S
            )
        except TimeoutError:
            return None

    def dead_letter(
        self, entry: Entry, error: RequestError, i: int | None = None, trace: Any = None
    ) -> Output:
        """The refused record's dead letter: the JSON document when it fits the
        dead-letter topic, else the original itself with the error in headers (Kafka
        Connect's convention), else, last, the JSON document with a prefix of the
        original (`truncated`)."""
        s = self._settings
        letter = self._letter(entry, error, None)
        # Keyed and headed as the input was (ordering per key; traces follow the record).
        key = output_key(entry.key, letter.request_id)
        value = letter.model_dump_json().encode()
        ours = [
            ("schema_version", self._version),
            ("worker", self._name.encode()),
            ("error_code", error.code.value.encode()),
        ]
        d = self._decisions
        if d is not None:
            ours += d.dead_letter_headers(entry, letter.request_id, i, trace)
        headers: list[tuple[str, bytes | None]] = [*output_headers(entry.headers, ours)]
        limit = self._topics.max_bytes(s.dead_letter_topic)
        form = "json"
        if record_size(key, value, headers) > limit:
            raw_headers: list[tuple[str, bytes | None]] = [*letter.raw_headers(s.pipeline)]
            if record_size(entry.key, entry.value, raw_headers) <= limit:
                form, key, headers = "raw", entry.key, raw_headers
                value = entry.value if entry.value is not None else b""
            else:
                form = "truncated"
                letter = self._letter(entry, error, self._room(letter, key, headers, limit))
                value = letter.model_dump_json().encode()
        self._log.info(
            "dead_letter",
            request_id=letter.request_id,
            trace_id=Decisions.trace_id(entry, i, trace),
            code=error.code.value,
            message=error.message[:300],
            topic=entry.tp.topic,
            partition=entry.tp.partition,
            offset=entry.offset,
            format=form,
        )
        return Output(s.dead_letter_topic, key, value, headers, entry, error.code.value)

    def _letter(self, entry: Entry, error: RequestError, keep: int | None) -> DeadLetter:
        return DeadLetter.build(
            error,
            entry.value,
            entry.tp.topic,
            entry.tp.partition,
            entry.offset,
            entry.key,
            entry.timestamp_ms if entry.timestamp_ms >= 0 else None,
            self._name,
            headers=entry.headers,
            max_original_bytes=keep,
            fallback_id=entry.fallback_id,
        )

    @staticmethod
    def _room(
        letter: DeadLetter, key: bytes | None, headers: list[tuple[str, bytes | None]], limit: int
    ) -> int:
        """How many bytes of the original a JSON dead letter of `limit` bytes holds."""
        empty = letter.model_copy(update={"original": ""}).model_dump_json().encode()
        spare = limit - record_size(key, empty, headers)
        return max(0, spare) * 3 // 4  # base64: 4 characters for 3 bytes


def _result_schema(settings: WorkerSettings) -> dict[str, Any]:
    """The JSON Schema of the results as this pipeline writes them (`schemas/json/`)."""
    import json
    from importlib.resources import files

    name = {
        "jev": "jev_result.schema.json",
        "openai_moderation": "openai_moderation_result.schema.json",
    }.get(settings.output_format, "result.schema.json")
    loaded: dict[str, Any] = json.loads(files("schemas").joinpath("json", name).read_text())
    return loaded

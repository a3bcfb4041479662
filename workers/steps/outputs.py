"""Step 8 of the worker: one output per input record, in input order. `OutputBuilder` is the
one owner of a record's way from the engine's answer to the bytes delivery sends: it
calibrates, routes, audits, encodes, keys, heads, frames and fits a result (steps 8.1-8.8
of `_result`), or dead-letters it, and hands delivery one `workers.steps.batches.Output` per
record. What it needs of a record travels in its `workers.results.decisions.RecordContext`.
`workers.steps.records` holds the pure rules it applies (keys, headers, fitting, dead-letter
forms), `workers.steps.topics` what it knows of each topic.

A result goes to the output topic, or to the request's `reply_topic` when the pipeline
allows it and the cluster has it (`workers.steps.topics.TopicGuard`); a result that may not go
where it asks becomes a dead letter with the reason's code, and its neighbours are
answered. Every record is made to fit its topic here, to the byte, by one decision
(`workers.steps.records`: `fit_record`, `dead_letter_record`): a result too large with the
input's key and headers sheds them (and says so), one too large without them is
dead-lettered `OUTPUT_TOO_LARGE`, and a dead letter takes the first of its forms that fits,
down to a reference to the original. So the producer never refuses a record in send(), and
the broker only when a topic's limit changed since it was read: the worker then forgets
what it knew of that topic and reads the batch again, and this time the record is cut to
the new limit. Nothing here raises but a dead-letter topic too small for any dead letter
(`WorkerFailed`: a configuration error, checked at start) and an outage: a bug in building
one output dead-letters that record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from dgstream.schemas import (
    SCHEMA_VERSION,
    ClassificationResult,
    DeadLetter,
    ErrorCode,
    RequestError,
    encode_output,
    get_format,
)
from dgstream.schemas.framing import frame
from dgstream.workers.faults.errors import WorkerFailed
from dgstream.workers.faults.outage import Outage
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.kafka.decompress import CutValue, UnreadBatch
from dgstream.workers.kafka.schema_registry import RegistryClient, RegistryDown
from dgstream.workers.results.decisions import Decisions, RecordContext, contexts
from dgstream.workers.routes import Router
from dgstream.workers.steps.batches import Batch, Output
from dgstream.workers.steps.records import (
    RESULT_CORE,
    Original,
    dead_letter_record,
    fit_record,
    output_headers,
    output_key,
    reference_floor,
)
from dgstream.workers.steps.topics import Known, Limit, TopicGuard, record_size

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
        self._format_options = settings.output_options()  # once, not per record
        self._format_name = settings.output_format.encode()
        self._decisions = decisions
        self._registry: RegistryClient | None = None
        if settings.output_framing == "confluent" and settings.schema_registry is not None:
            self._registry = RegistryClient(settings.schema_registry)
            # The topics known now get their ids at once (a registry away fails the start:
            # a framed result cannot be written without its id).
            routed = () if settings.shadow else (r.topic for r in settings.routes)
            for topic in {settings.output_topic, *routed}:
                self._schema_id(topic)
        self.check_dead_letter_topic(topics.limit(settings.dead_letter_topic))

    def check_dead_letter_topic(self, limit: Limit) -> None:
        """Fail (WorkerFailed) when a dead letter in its last form, nothing of the original
        kept, might not fit the dead-letter topic: no record could then be refused without
        a send the broker refuses, again and again. A configuration error, said at start."""
        s = self._settings
        ours = self._dead_letter_ours(ErrorCode.POISON)  # any code: the floor takes the longest
        fits, size = reference_floor(self._name, s.input_topics, ours, limit)
        if not fits:
            raise WorkerFailed(
                f"the dead-letter topic {s.dead_letter_topic!r} is too small for this "
                f"worker's dead letters: one that keeps nothing of its original but where it "
                f"was may take {size} bytes (kafka-python's estimate), and the topic takes "
                f"{limit.describe()}; raise its max.message.bytes (Kafka's default, "
                "1048588, is ample)"
            )

    def _schema_id(self, topic: str) -> int:
        """The id of the result schema under the topic's subject (`<topic>-value`, the
        registry's default TopicNameStrategy), registered on first use (cached)."""
        assert self._registry is not None
        return self._registry.register(f"{topic}-value", _result_schema(self._settings))

    async def _framed(self, topic: str, value: bytes) -> bytes:
        """`value` in the registry's wire format (the schema's id before it), when framed."""
        if self._registry is None:
            return value
        loop = asyncio.get_running_loop()
        try:
            schema_id = await loop.run_in_executor(None, self._schema_id, topic)
        except RegistryDown as exc:
            raise Outage("output", f"the schema registry: {exc}"[:500]) from exc
        return frame(schema_id, value)

    async def build(
        self,
        batch: Batch,
        outcomes: Sequence[ClassificationResult | RequestError],
        ctxs: Sequence[RecordContext] | None = None,
    ) -> list[Output]:
        """The batch's outputs, one per record in order; `ctxs`: the records' contexts, made
        here when not given."""
        if ctxs is None:
            d = self._decisions
            ctxs = d.contexts(batch) if d is not None else contexts(batch)
        it = iter(outcomes)
        out: list[Output] = []
        for ctx in ctxs:
            entry = ctx.entry
            outcome = next(it) if entry.error is None else entry.error
            try:
                if isinstance(outcome, RequestError):
                    out.append(await self.dead_letter(ctx, outcome))
                else:
                    out.append(await self._result(ctx, outcome))
            except (Outage, WorkerFailed):
                # An outage is not the record's fault: the batch is held and tried again. A
                # dead-letter topic too small for any letter fails the worker, loudly.
                raise
            except Exception as exc:  # a bug must not poison the partition: dead-letter it
                self._log.error("output_failed", error=repr(exc), exc_info=True)
                error = RequestError(
                    code=ErrorCode.ENGINE_FAILED,
                    message=f"the worker could not build this request's output: {exc!r}"[:500],
                )
                out.append(await self.dead_letter(ctx, error))
        return out

    async def _result(self, ctx: RecordContext, result: ClassificationResult) -> Output:
        """A result's record, every step of it here."""
        request, entry, d, s = ctx.request, ctx.entry, self._decisions, self._settings
        assert request is not None
        # 8.1 Calibrated before the routes read it.
        if d is not None:
            result = d.calibrate(result)
        # 8.2 The route: the reply topic, else the first route that holds, else the output
        # topic; a shadow evaluates the routes but writes to the output topic, and never
        # to a reply topic.
        match = self._router.route(result, None if s.shadow else request.reply_topic)
        topic = self._router.default.topic if s.shadow else match.topic
        # 8.3 Audited once the route is known; 8.4 the value in the pipeline's format.
        if d is not None:
            result = result.model_copy(update={"audit": d.audit(ctx, match.name)})
        value = encode_output(result, s.output_format, self._format_options)
        # 8.5 The input's key (else the request id), the input's headers, then ours: the
        # worker's, the format and route, CloudEvents attributes and trace context.
        ours = [
            *self._result_headers,
            ("output_format", self._format_name),
            ("route", match.name.encode()),
        ]
        if d is not None:
            ours += d.result_headers(ctx, result)
        headers = output_headers(entry.headers, ours)
        key = output_key(entry.key, result.id)
        # 8.6 May it go there (a reply topic allowed, existing, writable)? Learns the
        # topic's limit on the way.
        refusal = await self._where(topic)
        if refusal is not None:
            return await self.dead_letter(ctx, refusal)
        # 8.7 Framed for the schema registry, when the pipeline asks for it.
        value = await self._framed(topic, value)
        # 8.8 Fitted to its topic, to the byte: as it is, else without some of the input's
        # headers or its key, else dead-lettered.
        limit = self._topics.limit(topic)
        fitted = fit_record(value, key, headers, limit, keep=RESULT_CORE, source=ctx.source)
        if fitted is None:
            error = RequestError(
                code=ErrorCode.OUTPUT_TOO_LARGE,
                message=f"the result is {record_size(key, value, headers)} bytes "
                f"(kafka-python's estimate; its value {len(value)}), and does not fit "
                f"{topic!r} ({limit.describe()}) even without the input's key and "
                "headers",
            )
            return await self.dead_letter(ctx, error)
        if fitted.cut:
            self._log.warning(
                "output_shrunk",
                topic=topic,
                cut=",".join(fitted.cut),
                headers_dropped=fitted.dropped,
                source=f"{entry.tp.topic}/{entry.tp.partition}/{entry.offset}",
                trace_id=ctx.trace_id,
            )
        sent: list[tuple[str, bytes | None]] = list(fitted.headers)
        return Output(topic, fitted.key, value, sent, entry, None, match.name)

    async def _where(self, topic: str) -> RequestError | None:
        """Why a result may not go to `topic` (None: it may); learns the topic's limit."""
        refusal = self._topics.by_name(topic)
        if refusal is not None:
            return refusal
        known = self._topics.cached(topic)
        if known is None and self._topics.due(topic):
            known = await self._lookup(topic)
        return None if known is None else known.refusal

    async def _lookup(self, topic: str) -> Known | None:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(None, self._topics.lookup, topic), _LOOKUP_TIMEOUT_S
            )
        except TimeoutError:
            return None

    async def dead_letter(self, ctx: RecordContext, error: RequestError) -> Output:
        """The refused record's dead letter, in the first of its forms that fits the
        dead-letter topic (`workers.steps.records.dead_letter_record`): the JSON document, the
        original itself with the error in headers (Kafka Connect's convention), the
        document with part of the original, or with none of it but where it is."""
        s, entry = self._settings, ctx.entry
        letter = DeadLetter.build(
            error,
            entry.value,
            entry.tp.topic,
            entry.tp.partition,
            entry.offset,
            entry.key,
            entry.timestamp_ms if entry.timestamp_ms >= 0 else None,
            self._name,
            headers=entry.headers,
            fallback_id=entry.fallback_id,
            # What the consumer's memory bound left of the value (`workers.kafka.decompress`):
            # its first bytes, or nothing of a batch it did not read.
            complete=not isinstance(entry.value, CutValue | UnreadBatch),
            original_size=entry.value.size if isinstance(entry.value, CutValue) else None,
        )
        ours = self._dead_letter_ours(error.code)
        d = self._decisions
        if d is not None:
            ours += d.dead_letter_headers(ctx, letter.request_id)
        topic = s.dead_letter_topic
        if self._topics.due(topic):
            await self._lookup(topic)  # forgotten after a refused send: its limit again
        limit = self._topics.limit(topic)
        original = Original(entry.key, entry.value, entry.headers)
        chosen = dead_letter_record(letter, original, ours, limit, s.pipeline)
        if chosen is None:
            # Checked at start; the topic's limit went down since.
            self.check_dead_letter_topic(limit)
            raise WorkerFailed(f"no dead letter fits {topic!r} ({limit.describe()})")
        letter = chosen.letter
        self._log.info(
            "dead_letter",
            request_id=letter.request_id,
            trace_id=ctx.trace_id,
            code=error.code.value,
            message=error.message[:300],
            topic=entry.tp.topic,
            partition=entry.tp.partition,
            offset=entry.offset,
            format=chosen.form,
        )
        headers: list[tuple[str, bytes | None]] = list(chosen.headers)
        return Output(topic, chosen.key, chosen.value, headers, entry, error.code.value)

    def _dead_letter_ours(self, code: ErrorCode) -> list[tuple[str, bytes]]:
        return [
            ("schema_version", self._version),
            ("worker", self._name.encode()),
            ("error_code", code.value.encode()),
        ]


def _result_schema(settings: WorkerSettings) -> dict[str, Any]:
    """The JSON Schema of the results as this pipeline writes them (`schemas/json/`)."""
    import json
    from importlib.resources import files

    name = get_format(settings.output_format).schema_file
    loaded: dict[str, Any] = json.loads(files("schemas").joinpath("json", name).read_text())
    return loaded

"""Step 8 of the worker: one output per input record, in input order.

A result goes to the output topic, or to the request's `reply_topic` when the pipeline
allows it and the cluster has it (`workers.topics.TopicGuard`); a result that may not go
where it asks becomes a dead letter with the reason's code, and its neighbours are
answered. Every record is made to fit its topic here, to the byte, by one decision
(`workers.records`: `fit_record`, `dead_letter_record`): a result too large with the
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
import functools
from collections.abc import Sequence
from typing import Any

from schemas import (
    SCHEMA_VERSION,
    ClassificationResult,
    DeadLetter,
    ErrorCode,
    RequestError,
    get_format,
)
from schemas.framing import frame
from workers.batches import Batch, Entry, Output
from workers.decisions import Decisions
from workers.decompress import CutValue, UnreadBatch
from workers.errors import WorkerFailed
from workers.outage import Outage
from workers.records import (
    RESULT_CORE,
    Original,
    OutputRecord,
    dead_letter_record,
    fit_record,
    reference_floor,
    result_record,
)
from workers.registry import RegistryClient, RegistryDown
from workers.routes import Router
from workers.settings import WorkerSettings
from workers.topics import Known, Limit, TopicGuard, record_size

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
                out.append(await self.dead_letter(entry, error, i, trace))
        return out

    async def _output(
        self, entry: Entry, outcome: ClassificationResult | RequestError, i: int, trace: Any
    ) -> Output:
        if isinstance(outcome, RequestError):
            return await self.dead_letter(entry, outcome, i, trace)
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
            options=self._format_options,
            extra=extra,
        )
        refusal = await self._where(rec.topic)
        if refusal is not None:
            return await self.dead_letter(entry, refusal, i, trace)
        rec = await self._framed(rec)
        limit = self._topics.limit(rec.topic)
        source = (entry.tp.topic, entry.tp.partition, entry.offset)
        fitted = fit_record(rec.value, rec.key, rec.headers, limit, keep=RESULT_CORE, source=source)
        if fitted is None:
            error = RequestError(
                code=ErrorCode.OUTPUT_TOO_LARGE,
                message=f"the result is {record_size(rec.key, rec.value, rec.headers)} bytes "
                f"(kafka-python's estimate; its value {len(rec.value)}), and does not fit "
                f"{rec.topic!r} ({limit.describe()}) even without the input's key and "
                "headers",
            )
            return await self.dead_letter(entry, error, i, trace)
        if fitted.cut:
            self._log.warning(
                "output_shrunk",
                topic=rec.topic,
                cut=",".join(fitted.cut),
                headers_dropped=fitted.dropped,
                source=f"{entry.tp.topic}/{entry.tp.partition}/{entry.offset}",
                trace_id=Decisions.trace_id(entry, i, trace),
            )
        headers: list[tuple[str, bytes | None]] = list(fitted.headers)
        return Output(rec.topic, fitted.key, rec.value, headers, entry, None, rec.route)

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

    async def dead_letter(
        self, entry: Entry, error: RequestError, i: int | None = None, trace: Any = None
    ) -> Output:
        """The refused record's dead letter, in the first of its forms that fits the
        dead-letter topic (`workers.records.dead_letter_record`): the JSON document, the
        original itself with the error in headers (Kafka Connect's convention), the
        document with part of the original, or with none of it but where it is."""
        s = self._settings
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
            # What the consumer's memory bound left of the value (`workers.decompress`):
            # its first bytes, or nothing of a batch it did not read.
            complete=not isinstance(entry.value, CutValue | UnreadBatch),
            original_size=entry.value.size if isinstance(entry.value, CutValue) else None,
        )
        ours = self._dead_letter_ours(error.code)
        d = self._decisions
        if d is not None:
            ours += d.dead_letter_headers(entry, letter.request_id, i, trace)
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
            trace_id=Decisions.trace_id(entry, i, trace),
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

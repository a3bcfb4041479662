"""The producer's client: classify a state over Kafka and get the result back.

Request-reply: each request names this client's reply topic and is keyed by its id; a
background thread matches results to waiting calls. Requests are checked before sending
with the worker's own entry point, and the pipeline's dead letters fail the waiting call at
once. How results and dead letters are matched, the errors and the connection settings:
docs/client.md.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from dgstream.schemas import (
    ClassificationRequest,
    ClassificationResult,
    DeadLetter,
    FallbackId,
    JevResponse,
    ModerationResponse,
    RequestError,
    parse_request,
    read_output,
)
from dgstream.workers.kafka.probe import KafkaConnectError, check_connection
from dgstream.workers.kafka.settings import KafkaConnection

__all__ = ["Client", "KafkaConnectError", "Reply", "RequestFailed", "RequestInvalid"]

# What a call resolves to: the result in the pipeline's output format.
Reply = ClassificationResult | JevResponse | ModerationResponse


class RequestInvalid(ValueError):
    """The request was refused before sending; `.error` holds the code and the field."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


class RequestFailed(RuntimeError):
    """The pipeline refused the request (it went to the dead-letter topic); `.error` holds
    the worker's code and message, `.dead_letter` the whole record."""

    def __init__(self, letter: DeadLetter) -> None:
        super().__init__(f"{letter.error.code}: {letter.error.message}")
        self.error = letter.error
        self.dead_letter = letter


# File signatures of the formats the worker reads (dgstream.workers.images.decode.READ_FORMATS).
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


def image_data_url(data: bytes) -> str:
    """An image file's bytes as a data URL (its type from its signature; WebP by its RIFF
    header; anything else `image/unknown`: the worker reads the bytes, not the type)."""
    media = next((m for sig, m in _SIGNATURES if data.startswith(sig)), None)
    if media is None:
        media = "image/webp" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else "image/unknown"
    return f"data:{media};base64,{base64.b64encode(data).decode('ascii')}"


class Client:
    def __init__(
        self,
        kafka: str | list[str] | KafkaConnection,
        request_topic: str,
        *,
        reply_topic: str | None = None,
        dead_letter_topic: str | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        from kafka import KafkaConsumer, KafkaProducer, TopicPartition

        from dgstream.workers.kafka.admin import ensure_topics

        self.connection = (
            kafka
            if isinstance(kafka, KafkaConnection)
            else KafkaConnection(bootstrap_servers=kafka)
        )
        self.request_topic = request_topic
        # One reply topic per client by default: nobody else's results to skip.
        self.reply_topic = reply_topic or f"dgstream.replies.{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        check_connection(self.connection)
        ensure_topics(self.connection, {self.reply_topic: 1})
        kw = self.connection.client_kwargs()
        self._producer = KafkaProducer(acks="all", enable_idempotence=True, **kw)
        self._consumer = KafkaConsumer(enable_auto_commit=False, **kw)
        self.dead_letter_topic = dead_letter_topic
        watched = [self.reply_topic] + ([dead_letter_topic] if dead_letter_topic else [])
        parts = [
            TopicPartition(topic, p)
            for topic in watched
            for p in sorted(self._consumer.partitions_for_topic(topic) or {0})
        ]
        self._consumer.assign(parts)
        # Only results (and dead letters) of requests sent from now on matter.
        self._consumer.seek_to_end(*parts)
        for tp in parts:
            self._consumer.position(tp)
        self._pending: dict[str, Future[Reply]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="dgstream-replies", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    def submit(
        self,
        state: str | None = None,
        questions: Mapping[str, Any] | None = None,
        *,
        question_set: str | None = None,
        id: str | None = None,
        samples: int | str = 1,
        metadata: Mapping[str, Any] | None = None,
        request: Mapping[str, Any] | None = None,
        images: Sequence[str | bytes] | None = None,
        instructions: str | None = None,
    ) -> Future[Reply]:
        """Send one request; the future resolves to its result. `request`: a whole body
        in the wire shape (a Jev body without `id` too: it is keyed by a drawn id, which
        the worker takes as the request's id and the result's `id`). `images`: URLs, data
        URLs or image files' bytes (sent inline); until the pipeline's engine reads them,
        they come back as a dead letter (IMAGES_NOT_READ: docs/images.md). `instructions`:
        context for the questions, placed ahead of the state in the prompt."""
        body: dict[str, Any] = (
            dict(request)
            if request is not None
            else {
                "id": id or uuid.uuid4().hex,
                "state": state,
                "samples": samples,
            }
        )
        if request is None:
            if questions is not None:
                body["questions"] = dict(questions)
            if question_set is not None:
                body["question_set"] = question_set
            if metadata is not None:
                body["metadata"] = dict(metadata)
            if images is not None:
                # URLs and data URLs as given; an image file's bytes as a data URL.
                body["images"] = [i if isinstance(i, str) else image_data_url(i) for i in images]
            if instructions is not None:
                body["instructions"] = instructions
        body["reply_topic"] = self.reply_topic
        raw = json.dumps(body).encode()
        # A body without an id (Jev's) is sent as it is, keyed by an id drawn here: the
        # worker takes a record's valid key as the request's id (`schemas.record_id`).
        # Random, as the ids of the client's own requests: two sends are two requests.
        parsed = parse_request(raw, fallback_id=FallbackId(uuid.uuid4().hex, "key"))
        if isinstance(parsed, RequestError):
            raise RequestInvalid(parsed)
        assert isinstance(parsed, ClassificationRequest)
        future: Future[Reply] = Future()
        with self._lock:
            self._pending[parsed.id] = future
        self._producer.send(self.request_topic, key=parsed.id.encode(), value=raw)
        self._producer.flush()
        return future

    def classify(self, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Reply:
        """Classify one state; raises `RequestInvalid` before sending, `RequestFailed` when
        the pipeline refused it (with `dead_letter_topic`), `TimeoutError` when no result
        arrives in time."""
        future = self.submit(*args, **kwargs)
        try:
            return future.result(timeout=timeout_s or self.timeout_s)
        except FutureTimeout:
            self._forget(future)
            raise TimeoutError("no result within the timeout") from None

    def classify_many(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        max_in_flight: int = 256,
        timeout_s: float | None = None,
    ) -> Iterator[Reply]:
        """Send whole requests (dicts in the wire shape), keeping up to `max_in_flight`
        waiting; yields results in the order the requests were given."""
        window: list[Future[Reply]] = []
        for req in requests:
            window.append(self.submit(request=req))
            if len(window) >= max_in_flight:
                yield self._take(window.pop(0), timeout_s)
        while window:
            yield self._take(window.pop(0), timeout_s)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=10)
        self._producer.close()
        self._consumer.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _take(self, future: Future[Reply], timeout_s: float | None) -> Reply:
        try:
            return future.result(timeout=timeout_s or self.timeout_s)
        except FutureTimeout:
            self._forget(future)
            raise TimeoutError("no result within the timeout") from None

    def _forget(self, future: Future[Reply]) -> None:
        with self._lock:
            for key, value in list(self._pending.items()):
                if value is future:
                    del self._pending[key]

    def _listen(self) -> None:
        while not self._closed.is_set():
            polled = self._consumer.poll(timeout_ms=200)
            for tp, records in polled.items():
                for rec in records:
                    if tp.topic == self.reply_topic:
                        self._on_result(rec.value, rec.key)
                    else:
                        self._on_dead_letter(rec)

    def _on_result(self, value: bytes, key: bytes | None) -> None:
        try:
            result = read_output(value)
        except ValueError:
            return  # not a result of ours
        if isinstance(result, ClassificationResult | ModerationResponse):
            rid = result.id
        else:  # Jev's shape has no id: the record is keyed like the request
            try:
                rid = key.decode("utf-8") if key is not None else ""
            except UnicodeDecodeError:
                return
        with self._lock:
            future = self._pending.pop(rid, None)
        if future is not None and not future.done():
            future.set_result(result)

    def _on_dead_letter(self, rec: Any) -> None:
        try:  # either format: a JSON document, or the original with the error in headers
            letter = DeadLetter.from_record(rec.value, rec.key, rec.headers)
        except ValueError:
            return  # not a dead letter we can read
        with self._lock:
            if letter.request_id not in self._pending:
                return  # the common case: someone else's; its original is not decoded
        # Ours only: a waiting id AND our reply topic in the original request (another
        # producer may use the same id).
        try:
            original = json.loads(letter.original_bytes()) if not letter.truncated else {}
        except ValueError:
            return
        if not isinstance(original, dict) or original.get("reply_topic") != self.reply_topic:
            return
        with self._lock:
            future = self._pending.pop(letter.request_id or "", None)
        if future is not None and not future.done():
            future.set_exception(RequestFailed(letter))

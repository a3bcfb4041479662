"""What an output record (a result or a dead letter) carries besides its value: its key and
its headers, both taken from the input record so that consumers keep what they rely on.

- Key: the input record's key (ordering per key is what consumers rely on), else the
  request's id; None when there is neither (a dead letter of unreadable bytes).
- Headers: every input header (W3C `traceparent`/`tracestate`, anything else), in their
  order and repeats kept, then ours. Ours win a collision: an input header named like one
  of ours (compared ignoring case) is not copied, so a record never carries two `model`
  headers (a chained pipeline's input carries the previous pipeline's); with tracing on,
  our `traceparent` replaces the input's. The input's CloudEvents attributes (`ce_*`,
  `content-type`) are never copied: the output carries its own (`schemas.cloudevents`),
  else a CloudEvents consumer would take the result for the request. A null header value
  is copied as empty bytes (the Kafka client writes bytes only).

`workers.steps.outputs.OutputBuilder` puts a result's record together (its topic, key, value
and headers) by these rules; nothing here knows of routes, audits or traces.

The one place that decides an output's final form, so that every record fits its topic
(`workers.steps.topics.Limit`, to the byte) and the worker never sends what the producer or the
broker would refuse:

- `fit_record`, a result (and the dead letter's record around its document): as it is;
  else its headers other than the worker's own core ones left out, largest first, until
  it fits (the key kept: consumers order by it); else the same with the key replaced by
  `sha256:<hex of the key>` (the same key always gives the same digest, so the same
  partition). The record then says so: `dgstream.shrunk` (`headers`, `key`, or both),
  `dgstream.shrunk.headers` (how many), and where the input is
  (`dgstream.source.topic`, `.partition`, `.offset`) for what was cut. A result that does
  not fit even then is dead-lettered `OUTPUT_TOO_LARGE`.
- `dead_letter_record`, a dead letter, in this order: the JSON document (`json`, its
  record's copies of the input's key and headers cut as above: the document holds them);
  the original record itself with the error in headers (`raw`, Kafka Connect's way); the
  document without part of the original (`truncated`: the value whole with the key or the
  largest headers left out, else the key and headers that fit and a prefix of the value);
  last, nothing of the original (`reference`: topic, partition, offset, `original_sha256`).
  The error's message and field are cut to a few hundred bytes in the last two, so that
  the last always fits any dead-letter topic of at least `reference_floor` bytes (checked
  at start: `workers.steps.outputs`).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from collections.abc import Collection, Iterable, Sequence
from datetime import UTC, datetime
from typing import NamedTuple

from kafka.record.default_records import DefaultRecordBatchBuilder
from kafka.record.util import size_of_varint

from dgstream.schemas import (
    DeadLetter,
    ErrorCode,
    RequestError,
)
from dgstream.schemas.cloudevents import is_event_header
from dgstream.schemas.dead_letter import RAW_FORMAT, sha256_hex
from dgstream.workers.steps.topics import Limit, header_size, record_size

__all__ = [
    "DEAD_LETTER_CORE",
    "OWN_HEADERS",
    "RESULT_CORE",
    "SHRUNK",
    "SHRUNK_HEADERS",
    "Fitted",
    "Header",
    "LetterRecord",
    "Original",
    "dead_letter_record",
    "fit_record",
    "key_digest",
    "output_headers",
    "output_key",
    "reference_floor",
]

Header = tuple[str, bytes]

# What a record cut to fit its topic says about it (docs/errors.md, "Outputs cut to fit").
SHRUNK = "dgstream.shrunk"  # what was cut: "headers", "key" or "key,headers"
SHRUNK_HEADERS = "dgstream.shrunk.headers"  # how many headers were left out
SOURCE_TOPIC = "dgstream.source.topic"  # where the input record is, with what was cut
SOURCE_PARTITION = "dgstream.source.partition"
SOURCE_OFFSET = "dgstream.source.offset"
_DIGEST_PREFIX = b"sha256:"
_DIGEST_LEN = len(_DIGEST_PREFIX) + 64

# The names the worker writes itself, on results and on dead letters. An input header of
# one of these names is replaced, whether or not this record carries ours (an input's
# `dgstream.dead_letter.format: raw` copied onto a JSON dead letter would make it read as
# a raw one; a copied `dgstream.shrunk` would say a whole record was cut).
OWN_HEADERS = frozenset(
    {
        "schema_version",
        "model",
        "worker",
        "error_code",
        "output_format",
        "route",
        RAW_FORMAT,
        SHRUNK,
        SHRUNK_HEADERS,
        SOURCE_TOPIC,
        SOURCE_PARTITION,
        SOURCE_OFFSET,
    }
)
# The headers a record is never cut of (bounded by the configuration: the worker's and
# the model's names, the route's, a code); all others may go, largest first.
RESULT_CORE = frozenset({"schema_version", "model", "worker", "output_format", "route"})
DEAD_LETTER_CORE = frozenset({"schema_version", "worker", "error_code", RAW_FORMAT})
# How much of the error's message and field (JSON-escaped bytes) a cut dead letter keeps:
# a message names the field and says what is wrong in well under this; a field path is a
# few names (both quote the input, which may be as large as the input).
_MESSAGE_BYTES = 400
_FIELD_BYTES = 200
_ELLIPSIS = "\u2026"  # 3 bytes of UTF-8; pydantic writes it unescaped


def output_key(input_key: bytes | None, request_id: str | None) -> bytes | None:
    """The output record's key: the input's key, else the request id (UTF-8), else None."""
    if input_key is not None:
        return bytes(input_key)
    return None if request_id is None else request_id.encode("utf-8", "surrogatepass")


@functools.lru_cache(maxsize=64)
def _taken(names: tuple[str, ...]) -> frozenset[str]:
    """The input header names (lower case) that `ours` named `names` replace: a worker's
    records carry a few sets of names, so each set is worked out once."""
    return frozenset(name.lower() for name in OWN_HEADERS.union(names))


def output_headers(
    input_headers: Iterable[tuple[str, bytes | None]] | None, ours: Sequence[Header]
) -> list[Header]:
    """The input's headers without those named like ours, then `ours` (in that order)."""
    taken = _taken(tuple(name for name, _ in ours))
    out: list[Header] = []
    for name, value in input_headers or ():
        if name.lower() in taken or is_event_header(name):
            continue
        out.append((name, b"" if value is None else bytes(value)))
    out.extend((name, bytes(value)) for name, value in ours)
    return out


# --------------------------------------------------------------------------- fitting


def key_digest(key: bytes) -> bytes:
    """The key that stands for a key too large to carry: `sha256:<hex>` (deterministic, so
    a key's records keep one partition)."""
    return _DIGEST_PREFIX + hashlib.sha256(key).hexdigest().encode()


def _key_part(key: bytes | None) -> int:
    return 1 if key is None else size_of_varint(len(key)) + len(key)


def _headers_part(headers: Sequence[tuple[str, bytes | None]]) -> int:
    return size_of_varint(len(headers)) + sum(header_size(k, v) for k, v in headers)


def _encodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Fitted(NamedTuple):
    """A record's key and headers as they fit its topic, and what was cut."""

    key: bytes | None
    headers: list[Header]
    cut: tuple[str, ...]  # () as it was; "headers", "key" (in that order)
    dropped: int  # headers left out


def _markers(
    cut: tuple[str, ...], dropped: int, source: tuple[str, int, int] | None
) -> list[Header]:
    if not cut:
        return []
    out = [(SHRUNK, ",".join(sorted(cut, key=("key", "headers").index)).encode())]
    if dropped:
        out.append((SHRUNK_HEADERS, str(dropped).encode()))
    if source is not None:
        topic, partition, offset = source
        out += [
            (SOURCE_TOPIC, topic.encode()),
            (SOURCE_PARTITION, str(partition).encode()),
            (SOURCE_OFFSET, str(offset).encode()),
        ]
    return out


def fit_record(
    value: bytes,
    key: bytes | None,
    headers: Sequence[tuple[str, bytes | None]],
    limit: Limit,
    *,
    keep: Collection[str],
    source: tuple[str, int, int] | None = None,
) -> Fitted | None:
    """`key` and `headers` around `value` as they fit `limit` (the module's docstring):
    as they are; else without the headers not named in `keep`, largest first (the
    earlier of two alike first), as few as need be; else the same with the key's digest.
    `source` (topic, partition, offset of the input) is named on a record that was cut.
    None when even the value with the `keep` headers and the digest does not fit.

    The sizes are those kafka-python's producer and the broker compare (the headers'
    and key's terms of `size_of`), summed once and cut by difference: linear in the
    headers, whatever their number."""
    hs: list[Header] = [(k, b"" if v is None else bytes(v)) for k, v in headers]
    try:
        # kafka-python's own sum, once (`Limit.fits` is this sum against `max_size_of`);
        # it encodes every header name, so a name with no UTF-8 form raises.
        whole = DefaultRecordBatchBuilder.size_of(key, value, hs)
    except UnicodeEncodeError:
        whole = -1
    if 0 <= whole <= limit.max_size_of:
        return Fitted(key, hs, (), 0)
    unsendable = [i for i, (k, _) in enumerate(hs) if not _encodable(k)]
    # A header whose name has no UTF-8 form cannot be sent at all: it always goes.
    gone = set(unsendable)
    droppable = [i for i in range(len(hs)) if i not in gone and hs[i][0] not in keep]
    sizes = {i: header_size(*hs[i]) for i in droppable}
    order = sorted(droppable, key=lambda i: (-sizes[i], i))
    kept_total = sum(header_size(*hs[i]) for i in range(len(hs)) if i not in gone)
    most = limit.max_size_of
    value_part = _key_part(value)
    keys: list[bytes | None] = [key]
    if key is not None and len(key) > _DIGEST_LEN:
        keys.append(key_digest(key))
    for k in keys:
        key_cut = ("key",) if k is not key else ()
        total, n = kept_total, len(hs) - len(gone)
        for m in range(len(order) + 1):
            if m:
                total -= sizes[order[m - 1]]
                n -= 1
            dropped = m + len(gone)
            cut = (*key_cut, *(("headers",) if dropped else ()))
            marks = _markers(cut, dropped, source)
            size_of = (
                _key_part(k)
                + value_part
                + size_of_varint(n + len(marks))
                + total
                + sum(header_size(*h) for h in marks)
            )
            if size_of > most:
                continue
            out = set(order[:m]) | gone
            fitted = [h for i, h in enumerate(hs) if i not in out] + marks
            if limit.fits(k, value, fitted):  # kafka-python's own sums, to be sure
                return Fitted(k, fitted, cut, dropped)
    return None


class Original(NamedTuple):
    """The refused input record, as it was read."""

    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes | None]]


class LetterRecord(NamedTuple):
    """A dead letter as it is produced: its form, record and the letter it holds."""

    form: str  # json, raw, truncated, reference
    key: bytes | None
    value: bytes
    headers: list[Header]
    letter: DeadLetter


def _b64_len(n: int) -> int:
    return 4 * -(-n // 3)


def _cap(text: str, limit: int) -> str:
    """`text` cut so that its JSON string form holds at most `limit` bytes (an ellipsis
    says it was cut)."""
    out: list[str] = []
    used, room = 0, limit - len(_ELLIPSIS.encode())
    for ch in text:
        cost = len(json.dumps(ch, ensure_ascii=False).encode()) - 2  # its quotes
        if used + cost > room:
            return "".join(out) + _ELLIPSIS
        out.append(ch)
        used += cost
    return text


def _capped(error: RequestError) -> RequestError:
    message = _cap(error.message, _MESSAGE_BYTES)
    field = None if error.field is None else _cap(error.field, _FIELD_BYTES)
    if (message, field) == (error.message, error.field):
        return error
    return RequestError(code=error.code, message=message, field=field)


def dead_letter_record(
    letter: DeadLetter,
    original: Original,
    ours: Sequence[Header],
    limit: Limit,
    pipeline: str,
) -> LetterRecord | None:
    """The dead letter's record in the first form that fits `limit` (the module's
    docstring); None when not even the reference does (a dead-letter topic below
    `reference_floor`)."""
    # 1. The JSON document: keyed and headed as the input was (ordering per key; traces
    # follow the record), which its record may shed (the document holds them).
    value = letter.model_dump_json().encode()
    key = output_key(original.key, letter.request_id)
    headers = output_headers(original.headers, [*ours, (RAW_FORMAT, b"json")])
    fitted = fit_record(value, key, headers, limit, keep=DEAD_LETTER_CORE)
    if fitted is not None:
        return LetterRecord("json", fitted.key, value, fitted.headers, letter)
    # 2. The original itself, the error in headers (its key and headers cannot be cut);
    # not for a value the worker holds only part of, nor for a tombstone (the raw form
    # would make it an empty value).
    raw = letter.raw_headers(pipeline)
    raw_value = original.value
    sendable = not letter.truncated and all(_encodable(k) for k, _ in raw)
    if sendable and raw_value is not None and limit.fits(original.key, raw_value, raw):
        return LetterRecord("raw", original.key, raw_value, list(raw), letter)
    # 3. Part of the original, or none of it.
    return _cut(letter, original, ours, limit)


class _Cut:
    """A dead letter's document without part of its original, sized by parts: the JSON
    with nothing of the original, plus each kept header's JSON (and a comma between two),
    plus the value's base64 (which JSON never escapes). What is kept is chosen by these
    sums and checked by kafka-python's on the record built."""

    def __init__(
        self, letter: DeadLetter, original: Original, ours: Sequence[Header], limit: Limit
    ) -> None:
        self.limit = limit
        self.data = original.value or b""
        self.complete = not letter.truncated  # the value is all there is of it
        src = letter.source
        self.key = src.key_bytes()
        self.headers = letter.headers
        self.n = len(letter.headers)
        gone = (
            {}
            if self.key is None
            else {"key": None, "key_sha256": sha256_hex(self.key), "key_size": len(self.key)}
        )
        self.base = letter.model_copy(
            update={
                "error": _capped(letter.error),
                "original": "",
                "truncated": True,
                "headers": [],
                "headers_omitted": self.n,
                "source": src.model_copy(update=gone),
            }
        )
        self.with_key = self.base.model_copy(update={"source": src})
        self.empty = {
            True: len(self.with_key.model_dump_json().encode()),
            False: len(self.base.model_dump_json().encode()),
        }
        sizes = [len(h.model_dump_json().encode()) for h in letter.headers]
        self.order = sorted(range(self.n), key=lambda i: (-sizes[i], i))
        self.left_out = [0]  # the sizes of the m largest headers, for every m
        for i in self.order:
            self.left_out.append(self.left_out[-1] + sizes[i])
        # The record around it: a key no longer than its digest (else the digest), our
        # headers (which may shed their largest but the core), never the input's.
        rkey = output_key(original.key, letter.request_id)
        if rkey is not None and len(rkey) > _DIGEST_LEN:
            rkey = key_digest(rkey)
        self.envelope = fit_record(
            self.base.model_dump_json().encode(),
            rkey,
            output_headers(None, [*ours, (RAW_FORMAT, b"reference")]),
            limit,
            keep=DEAD_LETTER_CORE,
        )
        self.room = -1  # the longest document that fits beside the envelope
        if self.envelope is not None:
            room = limit.max_size_of - _key_part(self.envelope.key)
            room -= _headers_part(self.envelope.headers)
            doc = room - size_of_varint(max(room, 0))
            while doc > 0 and size_of_varint(doc) + doc > room:
                doc -= 1
            self.room = doc

    def length(self, keep_key: bool, m: int, n: int) -> int:
        """The document's bytes with the m largest headers left out, n of the value kept."""
        kept = self.n - m
        part = self.left_out[-1] - self.left_out[m] + max(0, kept - 1)
        digits = len(str(m)) - len(str(self.n))
        return self.empty[keep_key] + digits + part + _b64_len(n)

    def build(self, keep_key: bool, m: int, n: int) -> LetterRecord | None:
        assert self.envelope is not None
        out = set(self.order[:m])
        whole = keep_key and not m and n == len(self.data) and self.complete
        doc = (self.with_key if keep_key else self.base).model_copy(
            update={
                "original": base64.b64encode(self.data[:n]).decode("ascii"),
                "headers": [h for i, h in enumerate(self.headers) if i not in out],
                "headers_omitted": m,
                "truncated": not whole,
            }
        )
        value = doc.model_dump_json().encode()
        nothing = n == 0 and (self.key is None or not keep_key) and m == self.n
        # All of the original after all (only the error's text was cut): json.
        form = "json" if whole else "reference" if nothing else "truncated"
        # "truncated" and "reference" are as long: the envelope was fitted with one.
        env = self.envelope
        hs = [(k, form.encode() if k == RAW_FORMAT else v) for k, v in env.headers]
        if not self.limit.fits(env.key, value, hs):
            return None
        return LetterRecord(form, env.key, value, hs, doc)

    def choose(self) -> LetterRecord | None:
        """The value whole, the key and headers cut as little as need be; else the key and
        headers that fit without the value, and as much of the value as fits beside
        them; None when not even nothing of the original fits."""
        keys = [True, False] if self.key is not None else [True]
        for whole in (True, False):
            for keep_key in keys:
                for m in range(self.n + 1):
                    got = self._try(whole, keep_key, m)
                    if got is not None:
                        return got
        return None

    def _try(self, whole: bool, keep_key: bool, m: int) -> LetterRecord | None:
        head = self.length(keep_key, m, 0)
        if head > self.room:
            return None
        if whole:
            if head + _b64_len(len(self.data)) > self.room:
                return None
            return self.build(keep_key, m, len(self.data))
        n = min(len(self.data), (self.room - head) // 4 * 3)
        for _ in range(3):  # the sums and pydantic agree; were they not, a little less
            got = self.build(keep_key, m, n)
            if got is not None or n == 0:
                return got
            n = max(0, n - 3)
        return None


def _cut(
    letter: DeadLetter, original: Original, ours: Sequence[Header], limit: Limit
) -> LetterRecord | None:
    cut = _Cut(letter, original, ours, limit)
    return None if cut.envelope is None else cut.choose()


def reference_floor(
    worker: str, input_topics: Sequence[str], ours: Sequence[Header], limit: Limit
) -> tuple[bool, int]:
    """Whether the largest reference dead letter this worker can write fits `limit`, and
    its size (kafka-python's estimate): every field at its longest (a message and field
    cut to their caps, a 128-character id of 4-byte characters,
    the longest input topic, 19-digit numbers), keyed by a digest, with `ours` (the
    core headers: the others may be cut) and the markers of a cut record."""
    top = max(len(c.value) for c in ErrorCode)
    code = next(c for c in ErrorCode if len(c.value) == top)
    worst = DeadLetter(
        error=RequestError(
            code=code,
            message=_cap("m" * _MESSAGE_BYTES, _MESSAGE_BYTES),
            field=_cap("f" * _FIELD_BYTES, _FIELD_BYTES),
        ),
        original="",
        original_size=10**19 - 1,
        truncated=True,
        original_sha256="0" * 64,
        source={
            "topic": max(input_topics, key=len),
            "partition": 2**31 - 1,
            "offset": 10**19 - 1,
            "key": None,
            "key_sha256": "0" * 64,
            "key_size": 10**19 - 1,
            "timestamp_ms": 10**19 - 1,
        },
        headers=[],
        headers_omitted=2**31 - 1,
        request_id="\U0010ffff" * 128,
        worker=worker,
        time=datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    )
    value = worst.model_dump_json().encode()
    key = key_digest(b"")
    longest = max((c.value for c in ErrorCode), key=len).encode()
    core = [(k, longest if k == "error_code" else v) for k, v in ours if k in DEAD_LETTER_CORE]
    headers = [
        *core,
        (RAW_FORMAT, b"reference"),
        *_markers(("key", "headers"), 2**31 - 1, None),
    ]
    return limit.fits(key, value, headers), record_size(key, value, headers)

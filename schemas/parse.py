"""The one way the worker turns message bytes into a request (or a reason to refuse them)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from dgstream.schemas._common import (
    FIELD_CTX,
    LIMITS_CTX,
    SUFFIX_CTX,
    has_control,
    has_surrogate,
    json_type,
    printable,
)
from dgstream.schemas._version import SCHEMA_VERSION
from dgstream.schemas.cloudevents import EventRef, is_structured, unwrap
from dgstream.schemas.errors import ErrorCode, RequestError
from dgstream.schemas.kinds import kinds, question_types
from dgstream.schemas.names import TOPIC_CHARS
from dgstream.schemas.request import (
    MAX_ID_CHARS,
    MAX_QUESTIONS,
    ClassificationRequest,
    IdSource,
)


class ParseLimits(BaseModel):
    """Size limits the parser enforces (a worker setting, not part of the schema)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_message_bytes: int = Field(default=1 << 20, ge=1)
    max_state_chars: int = Field(default=32_000, ge=1)
    max_questions: int = Field(default=MAX_QUESTIONS, ge=1, le=MAX_QUESTIONS)


DEFAULT_LIMITS = ParseLimits()
_TOPIC_NAME = re.compile(f"[{TOPIC_CHARS}]+")
_NOT_TOPIC_CHARS = re.compile(f"[^{TOPIC_CHARS}]")


class FallbackId(NamedTuple):
    """The id a request without one gets, and where it came from (see `record_id`)."""

    value: str
    source: IdSource


def _valid_id(text: str) -> bool:
    return 0 < len(text) <= MAX_ID_CHARS and not has_control(text) and not has_surrogate(text)


def record_id(key: bytes | None, topic: str, partition: int, offset: int) -> FallbackId:
    """The id of a record whose request has none: its key when that is valid id text
    (UTF-8, 1..128 characters, no control characters), else "<topic>-<partition>-<offset>".

    Both are stable: reading the record again gives the same id. A topic name too long for
    an id (topics take 249 characters) is cut and followed by a hash of the whole name."""
    if key is not None:
        try:
            text = bytes(key).decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        if _valid_id(text):
            return FallbackId(text, "key")
    where = f"-{partition}-{offset}"
    name = topic
    if len(name) + len(where) > MAX_ID_CHARS or not _TOPIC_NAME.fullmatch(name):
        # Kafka's topic names are [a-zA-Z0-9._-]; anything else is replaced, and the hash
        # keeps two cut (or replaced) names apart.
        digest = hashlib.blake2b(topic.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()
        keep = _NOT_TOPIC_CHARS.sub("_", topic)[: MAX_ID_CHARS - len(where) - len(digest) - 1]
        name = f"{keep}~{digest}"
    return FallbackId(name + where, "record")


def parse_request(
    raw: bytes | None,
    limits: ParseLimits = DEFAULT_LIMITS,
    *,
    fallback_id: FallbackId | None = None,
    content_type: str | None = None,
) -> ClassificationRequest | RequestError:
    """Parse one message value. Returns the request, or the first reason to refuse it.

    Never raises, whatever the bytes. Checks, in order: empty, size, UTF-8, JSON (NaN,
    Infinity and duplicate keys refused), top-level object, lone surrogates, then either
    the structured-mode CloudEvent around the request (`content_type`, the record's
    `content-type` header, says `application/cloudevents+json`, or the object has
    `specversion`: `schemas.cloudevents.unwrap`; errors inside its data are named under
    `data.`), then schema_version and the models. A body without `id` takes the event's id
    when it came as an event, else `fallback_id` (the worker passes `record_id(...)` of the
    record; the request's `id_source` then says where it came from); without one, a
    missing id is refused (MISSING_FIELD).
    """
    try:
        return _parse(raw, limits, fallback_id, content_type)
    except Exception as exc:  # a bug here must not stop a partition: refuse the record
        return _error(
            ErrorCode.INVALID_VALUE,
            f"the message could not be read ({type(exc).__name__}: {exc})"[:500],
        )


def _parse(
    raw: bytes | None,
    limits: ParseLimits,
    fallback_id: FallbackId | None,
    content_type: str | None = None,
    *,
    event: EventRef | None = None,
) -> ClassificationRequest | RequestError:
    obj = _object(raw, limits)
    if isinstance(obj, RequestError):
        return obj
    if event is None and is_structured(obj, content_type):
        return _parse_event(obj, limits, fallback_id, content_type)
    return _checked(obj, limits, fallback_id, event)


def _object(raw: bytes | None, limits: ParseLimits) -> dict[str, Any] | RequestError:
    """The message's JSON object, or why the bytes are no JSON object."""
    if not raw:
        return _error(ErrorCode.EMPTY_MESSAGE, "the message is empty")
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")  # a surrogate then fails the UTF-8 check
    if len(raw) > limits.max_message_bytes:
        return _error(
            ErrorCode.MESSAGE_TOO_LARGE,
            f"the message has {len(raw)} bytes; the limit is {limits.max_message_bytes}",
        )
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        return _error(ErrorCode.INVALID_UTF8, f"the message is not UTF-8 (byte {exc.start})")
    try:
        obj = _strict_json(text)
    except json.JSONDecodeError as exc:
        return _error(
            ErrorCode.INVALID_JSON,
            f"the message is not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
        )
    except (ValueError, RecursionError) as exc:
        reason = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
        return _error(ErrorCode.INVALID_JSON, f"the message is not valid JSON: {reason}")
    if not isinstance(obj, dict):
        return _error(
            ErrorCode.NOT_AN_OBJECT, f"the message is a JSON {json_type(obj)}, not an object"
        )
    where = surrogate_path(obj) if "\\u" in text else None
    if where is not None:
        return _error(
            ErrorCode.INVALID_UNICODE,
            "a string holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its "
            "pair), which is no Unicode text",
            where or None,
        )
    return obj


def _parse_event(
    obj: dict[str, Any],
    limits: ParseLimits,
    fallback_id: FallbackId | None,
    content_type: str | None,
) -> ClassificationRequest | RequestError:
    """A structured-mode CloudEvent: its attributes checked, its data read as the request."""
    unwrapped = unwrap(obj, content_type)
    if isinstance(unwrapped, RequestError):
        return unwrapped
    data, ref = unwrapped
    if _valid_id(ref.id):
        fallback_id = FallbackId(ref.id, "event")
    where = "data"
    if isinstance(data, bytes):  # data_base64: a request message of its own
        where = "data_base64"
        got = _parse(data, limits, fallback_id, event=ref)
    elif isinstance(data, dict):
        got = _checked(data, limits, fallback_id, ref)
    else:
        got = _error(ErrorCode.NOT_AN_OBJECT, f"a JSON {json_type(data)}, not the request object")
    return _under(where, got) if isinstance(got, RequestError) else got


def _under(where: str, err: RequestError) -> RequestError:
    """An error in the event's data, its field named from the event: `data.<field>`."""
    if err.field is None:
        return RequestError(code=err.code, message=f"{where}: {err.message}", field=where)
    field = f"{where}.{err.field}"
    text = err.message[len(err.field) + 2 :] if err.message.startswith(err.field) else err.message
    return RequestError(code=err.code, message=f"{field}: {text}", field=field)


def _checked(
    obj: dict[str, Any],
    limits: ParseLimits,
    fallback_id: FallbackId | None,
    event: EventRef | None,
) -> ClassificationRequest | RequestError:
    """schema_version, then the models (and, for a request that came as an event, its
    attributes kept on the request)."""
    if "schema_version" in obj:
        version = obj["schema_version"]
        if type(version) is not int or version != SCHEMA_VERSION:
            return _error(
                ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
                f"version {version!r} is not supported (this worker reads {SCHEMA_VERSION})",
                "schema_version",
            )
    request = _validate(obj, limits, fallback_id)
    if event is not None and isinstance(request, ClassificationRequest):
        request._event = event
    return request


def _validate(
    obj: dict[str, Any], limits: ParseLimits, fallback_id: FallbackId | None
) -> ClassificationRequest | RequestError:
    """The models' checks, with the fallback id for a body that has none."""
    source: IdSource = "request"
    if "id" not in obj and fallback_id is not None:
        obj = {"id": fallback_id.value, **obj}
        source = fallback_id.source
    try:
        request = ClassificationRequest.model_validate(obj, context={LIMITS_CTX: limits})
    except ValidationError as exc:
        return _from_validation_error(exc)
    except RecursionError:
        return _error(ErrorCode.INVALID_VALUE, "the request is nested too deeply")
    request._id_source = source
    return request


def request_id_hint(raw: bytes | None) -> str | None:
    """Best effort: the `id` of a message that was refused, if it is JSON with a valid id.

    A message of up to HINT_LOAD_BYTES is parsed whole; a longer one (refused, most likely
    for its size, and perhaps only its first bytes: a dead letter's prefix, the consumer's
    `CutValue`) never is: its top-level members are scanned for `id` (and a CloudEvent's
    `data.id`) without building their values, as far as the bytes hold a JSON object
    (`_scan_ids`); what follows, complete or not, is not read."""
    if not raw:
        return None
    if len(raw) > HINT_LOAD_BYTES:
        ident, specversion, data_id = _scan_ids(raw)
        candidates = [data_id, ident] if specversion else [ident]
    else:
        try:
            obj = json.loads(bytes(raw).decode("utf-8"))
        except (ValueError, RecursionError, TypeError):
            return None
        if not isinstance(obj, dict):
            return None
        candidates = [obj.get("id")]
        if "specversion" in obj:  # a structured CloudEvent: the request's id, else the event's
            data = obj.get("data")
            candidates.insert(0, data.get("id") if isinstance(data, dict) else None)
    for ident in candidates:
        if isinstance(ident, str) and _valid_id(ident):
            return ident
    return None


# The id hint parses a message whole up to this size: `[[],...]` costs Python about 40
# bytes of objects per byte of JSON, so at most a few MiB, however hostile.
HINT_LOAD_BYTES = 64 * 1024
# A longer one is scanned, and the scan gives up (no hint) after this many brackets and
# strings outside the members it reads: about 10 ms of Python; a request has hundreds.
_HINT_SCAN_STEPS = 10_000
_WS = re.compile(rb"[ \t\n\r]*")
# Possessive: a string without its closing quote fails in one pass, not by backtracking.
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.S)
_SCALAR = re.compile(rb"[^\s,\]}]+")
_STRUCTURAL = re.compile(rb'["\[\]{}]')
# An id token longer than this cannot decode to a valid id (128 characters, each at most
# a 12-byte escaped surrogate pair), so it is not decoded.
_ID_TOKEN_BYTES = MAX_ID_CHARS * 12 + 2
# Keys longer than this (as JSON text) are none of those the hint reads.
_KEY_TOKEN_BYTES = 80
_KEYS = ("id", "specversion", "data")
_OPENING = (0x5B, 0x7B)  # "[", "{"


class _Scan:
    """A bounded walk over JSON bytes that skips values without building them."""

    def __init__(self, raw: bytes) -> None:
        self.raw, self.steps = raw, _HINT_SCAN_STEPS

    def ws(self, at: int) -> int:
        m = _WS.match(self.raw, at)
        return m.end() if m else at

    def string(self, at: int) -> int:
        m = _STRING.match(self.raw, at)
        if m is None:
            raise ValueError("no string")
        return m.end()

    def value(self, at: int) -> int:
        """The end of the value at `at`."""
        head = self.raw[at : at + 1]
        if head == b'"':
            return self.string(at)
        if head not in (b"{", b"["):
            m = _SCALAR.match(self.raw, at)
            if m is None:
                raise ValueError("no value")
            return m.end()
        depth = 0
        while True:
            self.steps -= 1
            m = _STRUCTURAL.search(self.raw, at)
            if m is None or self.steps < 0:
                raise ValueError("no end, or too long a scan")
            at = m.start()
            c = self.raw[at]
            if c == 0x22:  # '"'
                at = self.string(at)
                continue
            depth += 1 if c in _OPENING else -1
            at += 1
            if depth == 0:
                return at

    def members(self, at: int, seen: dict[str, tuple[int, int]]) -> int:
        """The members of the object at `at`: the spans of the values of `_KEYS` into
        `seen` (the last of a repeated key, as json.loads keeps it); returns its end."""
        if self.raw[at : at + 1] != b"{":
            raise ValueError("no object")
        at = self.ws(at + 1)
        if self.raw[at : at + 1] == b"}":
            return at + 1
        while True:
            self.steps -= 1
            end = self.string(at)
            key = json.loads(self.raw[at:end]) if end - at <= _KEY_TOKEN_BYTES else None
            at = self.ws(end)
            if self.raw[at : at + 1] != b":":
                raise ValueError("no colon")
            start = self.ws(at + 1)
            at = self.value(start)
            if key in _KEYS:
                seen[key] = (start, at)
            at = self.ws(at)
            c = self.raw[at : at + 1]
            if c == b"}":
                return at + 1
            if c != b",":
                raise ValueError("no comma")
            at = self.ws(at + 1)

    def text(self, span: tuple[int, int] | None) -> str | None:
        """The string at `span`, decoded when it could be an id."""
        if span is None or span[1] - span[0] > _ID_TOKEN_BYTES:
            return None
        token = self.raw[span[0] : span[1]]
        if not token.startswith(b'"'):
            return None
        try:
            text = json.loads(token)
        except ValueError:  # an escape JSON does not have, or bytes that are not UTF-8
            return None
        return text if isinstance(text, str) else None


def _scan_ids(raw: Any) -> tuple[str | None, bool, str | None]:
    """(top-level `id`, whether `specversion` is there, `data.id`) of the JSON object the
    bytes start with, from the members read before the scan stopped: at the object's end,
    at bytes that do not continue it (a message cut short, or no JSON), or after
    _HINT_SCAN_STEPS. A repeated key counts its last value read, as json.loads keeps it."""
    scan = _Scan(raw if isinstance(raw, bytes) else bytes(raw))
    top: dict[str, tuple[int, int]] = {}
    with contextlib.suppress(ValueError):
        scan.members(scan.ws(0), top)
    data: dict[str, tuple[int, int]] = {}
    if "data" in top and scan.raw[top["data"][0] : top["data"][0] + 1] == b"{":
        with contextlib.suppress(ValueError):
            scan.members(top["data"][0], data)
    return scan.text(top.get("id")), "specversion" in top, scan.text(data.get("id"))


# --- JSON -----------------------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def surrogate_path(obj: Any) -> str | None:
    """The dotted path of the first string (key or value) holding a lone surrogate, or None.

    A JSON `\\ud800` escape without its pair decodes to a Python string that has no UTF-8
    form: every later encode (pydantic, the tokenizer, the producer) would raise. The path
    is "" for a top-level string. Iterative, so depth costs no recursion.
    """
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if has_surrogate(item):
                return path
        elif isinstance(item, dict):
            for key, value in reversed(item.items()):
                here = f"{path}.{printable(key)}" if path else printable(key)
                if has_surrogate(key):
                    return here
                stack.append((value, here))
        elif isinstance(item, list):
            for i in range(len(item) - 1, -1, -1):
                stack.append((item[i], f"{path}.{i}" if path else str(i)))
    return None


def _strict_json(text: str) -> Any:
    return json.loads(
        text, parse_constant=_no_constant, parse_float=_finite, object_pairs_hook=_unique_keys
    )


# --- pydantic errors to codes -------------------------------------------------------------------

_CODES = {code.value: code for code in ErrorCode}

# Pydantic error types that mean "a JSON value of the wrong type" (beyond every "*_type").
_TYPE_ERRORS = frozenset(
    {"int_from_float", "int_parsing", "float_parsing", "bool_parsing", "string_unicode"}
)

# (location with the question's tag, pydantic error types or None for any, code); "*" is any
# one element. The first match wins.
_Rule = tuple[tuple[str, ...], frozenset[str] | None, ErrorCode]
_HEAD: tuple[_Rule, ...] = (
    (("id",), frozenset({"string_too_long"}), ErrorCode.ID_TOO_LONG),
    (("id",), None, ErrorCode.INVALID_ID),
    (
        ("questions", "*", "*", "instructions"),
        frozenset({"string_too_long"}),
        ErrorCode.INSTRUCTIONS_TOO_LONG,
    ),
    (("questions", "*", "*", "instructions"), None, ErrorCode.EMPTY_INSTRUCTIONS),
)
_TAIL: tuple[_Rule, ...] = (
    (("questions",), frozenset({"too_long"}), ErrorCode.TOO_MANY_QUESTIONS),
    (("questions",), frozenset({"too_short"}), ErrorCode.NO_QUESTIONS),
    (("samples",), None, ErrorCode.INVALID_SAMPLES),
    (("auto_threshold",), None, ErrorCode.INVALID_AUTO_OPTIONS),
    (("auto_max",), None, ErrorCode.INVALID_AUTO_OPTIONS),
    (("reply_topic",), None, ErrorCode.INVALID_REPLY_TOPIC),
    (("instructions",), frozenset({"string_too_long"}), ErrorCode.INSTRUCTIONS_TOO_LONG),
    (("instructions",), None, ErrorCode.EMPTY_INSTRUCTIONS),
    (("images",), frozenset({"too_long"}), ErrorCode.TOO_MANY_IMAGES),
    (("assets",), frozenset({"too_short"}), ErrorCode.INVALID_IMAGE_SOURCE),
)


def _rules() -> tuple[_Rule, ...]:
    """The rules, each kind's codes for its criteria (a count of options, of levels) among
    them; read from the registry each time, as a kind may come later."""
    own = tuple(
        (("questions", "*", tag, "criteria"), frozenset({error}), code)
        for kind in kinds()
        for tag in kind.types
        for error, code in kind.criteria_codes.items()
    )
    return _HEAD + own + _TAIL


def _matches(pattern: tuple[str, ...], loc: tuple[int | str, ...]) -> bool:
    return len(pattern) == len(loc) and all(
        p in ("*", x) for p, x in zip(pattern, loc, strict=True)
    )


def _path(loc: tuple[int | str, ...]) -> str | None:
    """Dotted field path, without the tag pydantic inserts after a question's id."""
    parts = list(loc)
    if len(parts) >= 3 and parts[0] == "questions" and parts[2] in question_types():
        del parts[2]
    return ".".join(str(p) for p in parts) or None


def _classify(err: ErrorDetails) -> tuple[ErrorCode, str, str | None]:
    kind, loc = err["type"], tuple(err["loc"])
    ctx: dict[str, Any] = dict(err.get("ctx") or {})
    path = _path(loc)
    if kind in _CODES:
        if ctx.get(SUFFIX_CTX):
            path = f"{path}.{ctx[SUFFIX_CTX]}" if path else str(ctx[SUFFIX_CTX])
        return _CODES[kind], err["msg"], ctx.get(FIELD_CTX) or path
    if kind == "missing":
        return ErrorCode.MISSING_FIELD, "required field is missing", path
    if kind == "extra_forbidden":
        return ErrorCode.UNKNOWN_FIELD, "unknown field", path
    if kind == "union_tag_invalid" and loc[:1] == ("questions",):
        return (
            ErrorCode.UNKNOWN_QUESTION_KIND,
            f"unknown question type {ctx.get('tag')!r}; expected one of "
            + ", ".join(question_types()),
            f"{path}.type",
        )
    if kind == "union_tag_not_found":
        return ErrorCode.MISSING_FIELD, "required field is missing", f"{path}.type"
    if loc[:1] == ("metadata",):
        return ErrorCode.INVALID_METADATA, err["msg"], path
    if kind.endswith("_type") or kind in _TYPE_ERRORS:
        return ErrorCode.WRONG_TYPE, f"{err['msg']}, got {json_type(err['input'])}", path
    for pattern, errors, code in _rules():
        if _matches(pattern, loc) and (errors is None or kind in errors):
            return code, err["msg"], path
    return ErrorCode.INVALID_VALUE, err["msg"], path


def _from_validation_error(exc: ValidationError) -> RequestError:
    code, text, path = _classify(exc.errors(include_url=False)[0])
    return _error(code, text, path)


def _error(code: ErrorCode, text: str, field: str | None = None) -> RequestError:
    # Messages quote the input: keep them encodable whatever it held.
    text = printable(text)
    field = None if field is None else printable(field)
    return RequestError(code=code, message=f"{field}: {text}" if field else text, field=field)

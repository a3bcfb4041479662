"""The one way the worker turns message bytes into a request (or a reason to refuse them)."""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from schemas._common import FIELD_CTX, LIMITS_CTX, has_control, json_type
from schemas._version import SCHEMA_VERSION
from schemas.errors import ErrorCode, RequestError
from schemas.request import MAX_ID_CHARS, MAX_QUESTIONS, QUESTION_TYPES, ClassificationRequest


class ParseLimits(BaseModel):
    """Size limits the parser enforces (a worker setting, not part of the schema)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_message_bytes: int = Field(default=1 << 20, ge=1)
    max_state_chars: int = Field(default=32_000, ge=1)
    max_questions: int = Field(default=MAX_QUESTIONS, ge=1, le=MAX_QUESTIONS)


DEFAULT_LIMITS = ParseLimits()


def parse_request(
    raw: bytes | None, limits: ParseLimits = DEFAULT_LIMITS
) -> ClassificationRequest | RequestError:
    """Parse one message value. Returns the request, or the first reason to refuse it.

    Never raises for bad input. Checks, in order: empty, size, UTF-8, JSON (NaN, Infinity and
    duplicate keys refused), top-level object, schema_version, then the models.
    """
    if not raw:
        return _error(ErrorCode.EMPTY_MESSAGE, "the message is empty")
    if isinstance(raw, str):
        raw = raw.encode("utf-8")
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
    if "schema_version" in obj:
        version = obj["schema_version"]
        if type(version) is not int or version != SCHEMA_VERSION:
            return _error(
                ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
                f"version {version!r} is not supported (this worker reads {SCHEMA_VERSION})",
                "schema_version",
            )
    try:
        return ClassificationRequest.model_validate(obj, context={LIMITS_CTX: limits})
    except ValidationError as exc:
        return _from_validation_error(exc)
    except RecursionError:
        return _error(ErrorCode.INVALID_VALUE, "the request is nested too deeply")


def request_id_hint(raw: bytes | None) -> str | None:
    """Best effort: the `id` of a message that was refused, if it is JSON with a valid id."""
    if not raw:
        return None
    try:
        obj = json.loads(bytes(raw).decode("utf-8"))
    except (ValueError, RecursionError, TypeError):
        return None
    ident = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(ident, str) and 0 < len(ident) <= MAX_ID_CHARS and not has_control(ident):
        return ident
    return None


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
_RULES: tuple[_Rule, ...] = (
    (("id",), frozenset({"string_too_long"}), ErrorCode.ID_TOO_LONG),
    (("id",), None, ErrorCode.INVALID_ID),
    (
        ("questions", "*", "*", "instructions"),
        frozenset({"string_too_long"}),
        ErrorCode.INSTRUCTIONS_TOO_LONG,
    ),
    (("questions", "*", "*", "instructions"), None, ErrorCode.EMPTY_INSTRUCTIONS),
    (("questions", "*", "choice", "criteria"), frozenset({"too_long"}), ErrorCode.TOO_MANY_OPTIONS),
    (("questions", "*", "choice", "criteria"), frozenset({"too_short"}), ErrorCode.TOO_FEW_OPTIONS),
    (("questions", "*", "score", "criteria"), frozenset({"too_long"}), ErrorCode.TOO_MANY_LEVELS),
    (("questions", "*", "score", "criteria"), frozenset({"too_short"}), ErrorCode.TOO_FEW_LEVELS),
    (("questions",), frozenset({"too_long"}), ErrorCode.TOO_MANY_QUESTIONS),
    (("questions",), frozenset({"too_short"}), ErrorCode.NO_QUESTIONS),
    (("samples",), None, ErrorCode.INVALID_SAMPLES),
    (("auto_threshold",), None, ErrorCode.INVALID_AUTO_OPTIONS),
    (("auto_max",), None, ErrorCode.INVALID_AUTO_OPTIONS),
    (("reply_topic",), None, ErrorCode.INVALID_REPLY_TOPIC),
)


def _matches(pattern: tuple[str, ...], loc: tuple[int | str, ...]) -> bool:
    return len(pattern) == len(loc) and all(
        p in ("*", x) for p, x in zip(pattern, loc, strict=True)
    )


def _path(loc: tuple[int | str, ...]) -> str | None:
    """Dotted field path, without the tag pydantic inserts after a question's id."""
    parts = list(loc)
    if len(parts) >= 3 and parts[0] == "questions" and parts[2] in QUESTION_TYPES:
        del parts[2]
    return ".".join(str(p) for p in parts) or None


def _classify(err: ErrorDetails) -> tuple[ErrorCode, str, str | None]:
    kind, loc = err["type"], tuple(err["loc"])
    ctx: dict[str, Any] = dict(err.get("ctx") or {})
    path = _path(loc)
    if kind in _CODES:
        return _CODES[kind], err["msg"], ctx.get(FIELD_CTX) or path
    if kind == "missing":
        return ErrorCode.MISSING_FIELD, "required field is missing", path
    if kind == "extra_forbidden":
        return ErrorCode.UNKNOWN_FIELD, "unknown field", path
    if kind == "union_tag_invalid" and loc[:1] == ("questions",):
        return (
            ErrorCode.UNKNOWN_QUESTION_KIND,
            f"unknown question type {ctx.get('tag')!r}; expected one of "
            + ", ".join(QUESTION_TYPES),
            f"{path}.type",
        )
    if kind == "union_tag_not_found":
        return ErrorCode.MISSING_FIELD, "required field is missing", f"{path}.type"
    if loc[:1] == ("metadata",):
        return ErrorCode.INVALID_METADATA, err["msg"], path
    if kind.endswith("_type") or kind in _TYPE_ERRORS:
        return ErrorCode.WRONG_TYPE, f"{err['msg']}, got {json_type(err['input'])}", path
    for pattern, kinds, code in _RULES:
        if _matches(pattern, loc) and (kinds is None or kind in kinds):
            return code, err["msg"], path
    return ErrorCode.INVALID_VALUE, err["msg"], path


def _from_validation_error(exc: ValidationError) -> RequestError:
    code, text, path = _classify(exc.errors(include_url=False)[0])
    return _error(code, text, path)


def _error(code: ErrorCode, text: str, field: str | None = None) -> RequestError:
    return RequestError(code=code, message=f"{field}: {text}" if field else text, field=field)

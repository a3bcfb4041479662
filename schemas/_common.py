"""Private building blocks shared by the models."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

from dgstream.schemas.errors import ErrorCode

# Context key of a custom error that carries the full dotted path of the offending field
# (validators that run on the whole model have no location of their own).
FIELD_CTX = "dg_field"
# Context key of a custom error that carries a suffix for the path pydantic gives it (a
# model validator's location is its model; the suffix names the field inside it).
SUFFIX_CTX = "dg_suffix"
# Key in the validation context under which `parse_request` passes its `ParseLimits`.
LIMITS_CTX = "dgstream_limits"
_SURROGATES = re.compile(r"[\ud800-\udfff]")


def fail(
    code: ErrorCode, message: str, field: str | None = None, *, suffix: str | None = None
) -> PydanticCustomError:
    """A validation error whose type is the error code (so the parser maps it directly).

    `field` is the full dotted path; `suffix` is appended to the path pydantic reports."""
    ctx: dict[str, str] = {}
    if field is not None:
        ctx[FIELD_CTX] = field
    if suffix is not None:
        ctx[SUFFIX_CTX] = suffix
    return PydanticCustomError(code.value, message, ctx or None)


def has_control(text: str) -> bool:
    """Whether `text` holds a C0/C1 control character or DEL."""
    return any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text)


def has_surrogate(text: str) -> bool:
    """Whether `text` holds a UTF-16 surrogate code point (which has no UTF-8 form)."""
    return _SURROGATES.search(text) is not None


def printable(text: str) -> str:
    """`text` with any surrogate written as a backslash escape, so it always encodes."""
    if not has_surrogate(text):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


class WireModel(BaseModel):
    """Base of the outgoing models (results, dead letters): frozen, no extra fields."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        allow_inf_nan=False,
        # What we write always carries every field: say so in the published schema.
        json_schema_serialization_defaults_required=True,
    )


class RequestModel(BaseModel):
    """Base of the incoming models: frozen, no extra fields, and strict JSON types (no "5" -> 5)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

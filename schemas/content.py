"""Jev content: a text, or a JSON object or array that the model reads as its JSON text.

Jev's bodies may give the state, instructions and descriptions as JSON. Each is rendered
once, when the request is read, the way vLLM 0.33's decision reader renders a state: text as
it is, anything else as `json.dumps(value, ensure_ascii=False)`. Everything after parsing
(limits, the prompt, the results) sees text only.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema

from dgstream.schemas._common import fail
from dgstream.schemas.errors import ErrorCode

# Deeper JSON cannot be written back reliably (the same bound as metadata's).
MAX_CONTENT_DEPTH = 64
# How a score level given as null is named (in results, `ask_if` and routes): by its
# 0-based position, which is the level's score in Jev's numbering.
NULL_LEVEL_NAME = "level {}"


def json_depth(value: object, stop: int = MAX_CONTENT_DEPTH) -> int:
    """Nesting depth of JSON containers (a scalar is 0, {} is 1), without recursion; the
    count stops a little past `stop`."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level + 1)
        if deepest > stop:
            break
        stack.extend((child, level + 1) for child in children)
    return deepest


def render_content(value: object) -> str:
    """The text the model reads for a Jev content value (text as is, else its JSON)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def to_text(value: Any) -> Any:
    """A content value as text (a before-validator; other types pass to the str check)."""
    if not isinstance(value, dict | list):
        return value  # text, null, or a wrong type that the strict str check reports
    if json_depth(value) > MAX_CONTENT_DEPTH:
        raise fail(
            ErrorCode.INVALID_VALUE,
            f"JSON content is nested more than {MAX_CONTENT_DEPTH} levels deep",
        )
    try:
        return render_content(value)
    except (TypeError, ValueError, RecursionError) as exc:  # only from Python callers
        raise fail(ErrorCode.INVALID_VALUE, f"JSON content cannot be written: {exc}") from None


# Published schema of a content field: what a producer may send.
CONTENT_SCHEMA = WithJsonSchema(
    {"anyOf": [{"type": "string"}, {"type": "object"}, {"type": "array"}]}
)

# A text field that also takes a JSON object or array (stored as its rendered text). Length
# checks go between `str` and the validator (`Annotated[str, StringConstraints(...),
# BeforeValidator(to_text), CONTENT_SCHEMA]`), so they count the text's characters.
Content = Annotated[str, BeforeValidator(to_text), CONTENT_SCHEMA]

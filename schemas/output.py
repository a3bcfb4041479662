"""The formats a pipeline writes its results in (`output_format`), and reading either back.

- "dgstream" (the default): the `ClassificationResult` itself.
- "jev": `schemas.jev.JevResponse`, what Jev's clients read.
- "openai_moderation": `schemas.moderation.ModerationResponse`, OpenAI's moderation
  response shape, from the pipeline's yes/no questions (`ModerationOptions`).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import ValidationError

from schemas.jev import JevResponse, to_jev
from schemas.moderation import ModerationOptions, ModerationResponse, to_moderation
from schemas.result import ClassificationResult

OutputFormat = Literal["dgstream", "jev", "openai_moderation"]
OUTPUT_FORMATS: tuple[OutputFormat, ...] = ("dgstream", "jev", "openai_moderation")


def encode_output(
    result: ClassificationResult,
    fmt: OutputFormat = "dgstream",
    moderation: ModerationOptions | None = None,
) -> bytes:
    """The record value for `result` in format `fmt` (UTF-8 JSON); `moderation` shapes the
    openai_moderation format (its defaults otherwise)."""
    if fmt == "dgstream":
        return result.model_dump_json().encode()
    if fmt == "jev":
        return to_jev(result).model_dump_json().encode()
    if fmt == "openai_moderation":
        return to_moderation(result, moderation).model_dump_json().encode()
    raise ValueError(f"unknown output format {fmt!r}; expected one of {OUTPUT_FORMATS}")


def read_output(value: bytes | str) -> ClassificationResult | JevResponse | ModerationResponse:
    """A result record's value in any of the formats. Raises ValueError for anything else."""
    try:
        obj = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not a result: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a result: not a JSON object")
    # A dgstream result has an id and answers; Jev's shape has answers and usage but no id;
    # OpenAI's moderation shape has an id and results.
    model: type[ClassificationResult | JevResponse | ModerationResponse] = ClassificationResult
    if "results" in obj and "answers" not in obj:
        model = ModerationResponse
    elif "id" not in obj and "usage" in obj:
        model = JevResponse
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise ValueError(f"not a result ({model.__name__}): {exc.errors()[0]['msg']}") from None

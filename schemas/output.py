"""The formats a pipeline writes its results in (`output_format`), and reading either back.

- "dgstream" (the default): the `ClassificationResult` itself.
- "jev": `schemas.jev.JevResponse`, what Jev's clients read.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import ValidationError

from schemas.jev import JevResponse, to_jev
from schemas.result import ClassificationResult

OutputFormat = Literal["dgstream", "jev"]
OUTPUT_FORMATS: tuple[OutputFormat, ...] = ("dgstream", "jev")


def encode_output(result: ClassificationResult, fmt: OutputFormat = "dgstream") -> bytes:
    """The record value for `result` in format `fmt` (UTF-8 JSON)."""
    if fmt == "dgstream":
        return result.model_dump_json().encode()
    if fmt == "jev":
        return to_jev(result).model_dump_json().encode()
    raise ValueError(f"unknown output format {fmt!r}; expected one of {OUTPUT_FORMATS}")


def read_output(value: bytes | str) -> ClassificationResult | JevResponse:
    """A result record's value in either format. Raises ValueError for anything else."""
    try:
        obj = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not a result: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a result: not a JSON object")
    # A dgstream result has an id; Jev's shape has none but has usage.
    model = ClassificationResult if "id" in obj or "usage" not in obj else JevResponse
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise ValueError(f"not a result ({model.__name__}): {exc.errors()[0]['msg']}") from None

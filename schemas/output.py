"""Writing a result in a pipeline's format (`output_format`), and reading any format back.

The formats are the registry's (`schemas.formats`, one module each).
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ValidationError

from dgstream.schemas.formats import DEFAULT_FORMAT, formats, get_format
from dgstream.schemas.formats.jev import JevResponse
from dgstream.schemas.formats.openai_moderation import ModerationResponse
from dgstream.schemas.result import ClassificationResult

# A registered format's name (`schemas.formats.format_names()`).
OutputFormat = str


def encode_output(
    result: ClassificationResult,
    fmt: OutputFormat = DEFAULT_FORMAT,
    options: BaseModel | None = None,
) -> bytes:
    """The record value for `result` in format `fmt` (UTF-8 JSON); `options` are the
    format's (its defaults when None). ValueError for a format not registered."""
    f = get_format(fmt)
    return f.encode(result, f.defaults if options is None else options)


def read_output(value: bytes | str) -> ClassificationResult | JevResponse | ModerationResponse:
    """A result record's value in any of the formats. Raises ValueError for anything else."""
    try:
        obj = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not a result: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a result: not a JSON object")
    # The first format that recognises the object's keys; the default one otherwise.
    model: type[BaseModel] = get_format(DEFAULT_FORMAT).response
    for f in formats():
        if f.recognises(obj):
            model = f.response
            break
    try:
        read = model.model_validate(obj)
    except ValidationError as exc:
        raise ValueError(f"not a result ({model.__name__}): {exc.errors()[0]['msg']}") from None
    if not isinstance(read, ClassificationResult | JevResponse | ModerationResponse):
        # A format registered beside these (a test's): its readers are its own.
        raise ValueError(f"not a result this reader knows ({model.__name__})")
    return read

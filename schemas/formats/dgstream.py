"""The default output format: the `ClassificationResult` itself (`result.schema.json`)."""

from __future__ import annotations

from dgstream.schemas.formats import register
from dgstream.schemas.formats._base import Format, NoOptions
from dgstream.schemas.result import ClassificationResult


@register
class Dgstream(Format[NoOptions]):
    name = "dgstream"
    options = NoOptions
    response = ClassificationResult
    schema_file = "result.schema.json"

    def encode(self, result: ClassificationResult, options: NoOptions) -> bytes:
        return result.model_dump_json().encode()

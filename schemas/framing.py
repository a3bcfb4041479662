"""The Confluent wire format of a Schema Registry serializer: a 0x00 magic byte, the schema
id as a 4-byte big-endian integer, then the serialized value (JSON, for JSON Schema).

Pure functions on bytes: the registry itself (is the id known, of which type) is the
worker's (`workers.kafka.schema_registry`).
"""

from __future__ import annotations

import struct

from dgstream.schemas.errors import ErrorCode, RequestError

__all__ = ["MAGIC", "frame", "unframe"]

MAGIC = 0
_HEADER = struct.Struct(">bI")  # magic, schema id


def frame(schema_id: int, payload: bytes) -> bytes:
    """`payload` framed with `schema_id`."""
    return _HEADER.pack(MAGIC, schema_id) + payload


def unframe(value: bytes | None) -> tuple[int, bytes] | RequestError:
    """(schema id, payload) of a framed value, or why it is not one (NOT_FRAMED)."""
    if value is None or len(value) < _HEADER.size:
        size = "no value" if value is None else f"{len(value)} byte(s)"
        return RequestError(
            code=ErrorCode.NOT_FRAMED,
            message=f"value: {size}; a framed value has a magic byte and a 4-byte schema id",
        )
    magic, schema_id = _HEADER.unpack_from(value)
    if magic != MAGIC:
        return RequestError(
            code=ErrorCode.NOT_FRAMED,
            message=f"value: starts with byte 0x{value[0]:02x}, not the magic byte 0x00 of "
            "the Schema Registry wire format",
        )
    return schema_id, bytes(value[_HEADER.size :])

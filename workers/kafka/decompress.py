"""A record batch decompressed within a bound, and the values that stand in for bytes the
worker's consumer did not keep.

Kafka bounds a batch's *compressed* size (the broker's message.max.bytes, 1 MiB by
default), not what it decompresses to: 19 KB of zstd may hold 200 MB. kafka-python
decompresses a whole batch at once (`DefaultRecordBatch._maybe_uncompress` through
`kafka/codec.py`), then copies every value out of it. The worker's consumer reads batches
through `workers.kafka.quirks.bound_batches` instead, which uses `decompress` here: the
same codec libraries kafka-python uses (looked up in `kafka.codec` at each call, so a
process without one is refused as kafka-python refuses it), read in chunks, stopped one
chunk past the bound.

What the consumer then returns in place of what it did not keep (never bytes a producer
can send: values from the wire are plain `bytes`, these are subclasses):

* `UnreadBatch`: one per batch that decompresses past the bound, at the batch's last
  offset, empty; it says where the batch is (its offsets stay readable in the topic).
* `CutValue`: a value longer than the bound per value: its first bytes, and its size.

`workers.steps.inputs` refuses both with their codes (BATCH_TOO_LARGE, MESSAGE_TOO_LARGE).
"""

from __future__ import annotations

import io
import zlib
from typing import Any

import kafka.codec as codecs

__all__ = ["CODEC_NAMES", "CutValue", "OverBound", "Undecodable", "UnreadBatch", "decompress"]

# The codec ids of a batch's attributes (Kafka's record batch format, bits 0-2).
CODEC_NAMES = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}
# Decompressed bytes taken per step: small against any bound worth setting (the default
# is 32 MiB), large enough that a step's Python overhead is nothing against its copy.
_CHUNK = 1 << 20


class OverBound(Exception):
    """The batch decompresses to more than `limit` bytes; `read`: how far it got when
    decompression stopped (at most one chunk past the limit; snappy: what the next block
    states it holds)."""

    def __init__(self, limit: int, read: int) -> None:
        super().__init__(f"decompresses to more than {limit} bytes")
        self.limit, self.read = limit, read


class Undecodable(Exception):
    """The codec library refused the batch's bytes (the cause is chained):
    `workers.faults.poll_errors` names it UNDECODABLE_BATCH, as when kafka-python's own decoder
    raises."""


def decompress(codec: int, data: memoryview, limit: int) -> bytearray | None:
    """The batch's records section (`data`, compressed with `codec`) decompressed, or
    OverBound past `limit` bytes, or Undecodable. None: no bounded decoder for this codec
    or library (lz4 through lz4f or lz4framed rather than python-lz4): the caller lets
    kafka-python decompress it unbounded."""
    decoder = {1: _gunzip, 2: _snappy, 3: _lz4, 4: _zstd}.get(codec)
    if decoder is None:
        return None
    try:
        return decoder(data, limit)
    except OverBound:
        raise
    except Exception as exc:
        raise Undecodable(f"{CODEC_NAMES[codec]}: {type(exc).__name__}: {exc}") from exc


def _grow(out: bytearray, chunk: bytes, limit: int) -> None:
    out += chunk
    if len(out) > limit:
        raise OverBound(limit, len(out))


def _gunzip(data: memoryview, limit: int) -> bytearray | None:
    """As `gzip.GzipFile.read` (kafka-python's gzip_decode): members one after another,
    NUL padding between them skipped, a stream cut short refused."""
    out = bytearray()
    rest = bytes(data)
    while rest:
        member = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip header and trailer
        pending = rest
        while not member.eof:
            chunk = member.decompress(pending, min(_CHUNK, limit + 1 - len(out)))
            _grow(out, chunk, limit)
            if not chunk and not member.unconsumed_tail and not member.eof:
                raise EOFError("Compressed file ended before the end-of-stream marker was reached")
            pending = member.unconsumed_tail
        rest = member.unused_data.lstrip(b"\x00")
    return out


def _zstd(data: memoryview, limit: int) -> bytearray | None:
    """As kafka-python's zstd_decode: one stream reader across frames."""
    if codecs.zstd is None:
        return None
    out = bytearray()
    source = io.BytesIO(data)
    with codecs.zstd.ZstdDecompressor().stream_reader(source, read_across_frames=True) as reader:
        while chunk := reader.read(_CHUNK):
            _grow(out, chunk, limit)
    return out


def _lz4(data: memoryview, limit: int) -> bytearray | None:
    """As python-lz4's `lz4.frame.decompress` (kafka-python's lz4_decode when python-lz4
    is installed): the first frame; bytes after it are ignored; a frame cut short refused."""
    frame: Any = codecs.lz4
    if frame is None or not hasattr(frame, "LZ4FrameDecompressor"):
        return None
    out = bytearray()
    reader = frame.LZ4FrameDecompressor()
    pending = bytes(data)
    while not reader.eof:
        chunk = reader.decompress(pending, max_length=min(_CHUNK, limit + 1 - len(out)))
        _grow(out, chunk, limit)
        if not chunk and not reader.eof:
            raise RuntimeError("Frame incomplete")
        pending = b""
    return out


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """A little-endian base-128 varint (snappy's preamble) at `at`: (value, end)."""
    value = shift = 0
    for i in range(at, min(at + 5, len(data))):
        value |= (data[i] & 0x7F) << shift
        if not data[i] & 0x80:
            return value, i + 1
        shift += 7
    raise ValueError("snappy block without its length preamble")


def _snappy(data: memoryview, limit: int) -> bytearray | None:
    """As kafka-python's snappy_decode (Xerial's framing of blocks, or one raw block).
    Each block's preamble states its decompressed length, checked before it is
    decompressed (the decoder refuses a block whose output differs from it)."""
    snappy: Any = codecs.snappy
    if snappy is None:
        return None
    raw = data.tobytes()
    blocks = [raw]
    if codecs._detect_xerial_stream(raw):
        blocks, at = [], 16  # Xerial's 16-byte header, then (4-byte length, block) pairs
        while at < len(raw):
            size = int.from_bytes(raw[at : at + 4], "big", signed=True)
            if size < 0:
                raise ValueError(f"a snappy block of {size} bytes")
            blocks.append(raw[at + 4 : at + 4 + size])
            at += 4 + size
    out = bytearray()
    for block in blocks:
        stated, _ = _varint(block, 0)
        if len(out) + stated > limit:
            raise OverBound(limit, len(out) + stated)
        out += snappy.decompress(block)
    return out


class UnreadBatch(bytes):
    """The value of the one record that stands for a batch the consumer did not read
    (it decompresses past the bound): empty bytes, and where the batch is."""

    base_offset: int
    last_offset: int
    records: int  # as the batch's header counts them
    codec: str
    compressed_bytes: int
    limit: int

    @classmethod
    def of(cls, batch: Any, limit: int) -> UnreadBatch:
        value = cls()
        value.base_offset, value.last_offset = int(batch.base_offset), int(batch.last_offset)
        value.records = int(batch.records_count)
        value.codec = CODEC_NAMES.get(batch.compression_type, str(batch.compression_type))
        value.compressed_bytes, value.limit = int(batch.size_in_bytes), limit
        return value

    def describe(self) -> str:
        where = (
            f"offset {self.base_offset}"
            if self.base_offset == self.last_offset
            else f"offsets {self.base_offset}..{self.last_offset}"
        )
        return (
            f"the record batch at {where} ({self.records} record(s), {self.codec}, "
            f"{self.compressed_bytes} bytes compressed) decompresses to more than "
            f"{self.limit} bytes (consumer.max_batch_bytes); none of its records was read: "
            "they stay in the input topic at those offsets"
        )


class CutValue(bytes):
    """A value longer than the consumer keeps whole: its first bytes, and its `size`."""

    size: int

    @classmethod
    def of(cls, value: bytes, keep: int) -> CutValue:
        cut = cls(memoryview(value)[:keep])
        cut.size = len(value)
        return cut

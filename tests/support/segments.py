"""A Kafka log segment read as the broker stores it: the record batches (message format v2)
of one partition's `.log` files, with each batch's codec, and a way to corrupt one batch
in place. The broker serves a fetch from the file as it is (no check on the way out), so a
byte flipped here reaches the consumer as a batch that fails its CRC.

Batch layout (Kafka's DefaultRecordBatch): baseOffset int64, batchLength int32,
partitionLeaderEpoch int32, magic int8, crc uint32, attributes int16 (bits 0-2: the
codec), lastOffsetDelta int32, ...; the CRC covers everything from `attributes` on.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

CODECS = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}
_HEADER = struct.Struct(">qiibIhi")  # base, length, epoch, magic, crc, attributes, delta
_CONTROL_BIT = 0x20


@dataclass(frozen=True)
class Batch:
    file: Path
    position: int  # where the batch starts in `file`
    size: int  # bytes, header included
    base_offset: int
    last_offset: int
    codec: str
    control: bool  # a transaction marker (commit or abort), not data


def partition_dir(data_dir: str | Path, topic: str, partition: int) -> Path:
    return Path(data_dir) / f"{topic}-{partition}"


def batches(data_dir: str | Path, topic: str, partition: int) -> list[Batch]:
    """Every batch of the partition's segments, in offset order."""
    out: list[Batch] = []
    for seg in sorted(partition_dir(data_dir, topic, partition).glob("*.log")):
        data = seg.read_bytes()
        pos = 0
        while pos + _HEADER.size <= len(data):
            base, length, _epoch, magic, _crc, attrs, delta = _HEADER.unpack_from(data, pos)
            if length <= 0 or magic != 2:
                break  # the end of what is written (a preallocated tail reads as zeros)
            out.append(
                Batch(
                    seg,
                    pos,
                    12 + length,
                    base,
                    base + delta,
                    CODECS.get(attrs & 0x07, f"codec {attrs & 0x07}"),
                    bool(attrs & _CONTROL_BIT),
                )
            )
            pos += 12 + length
    return out


def corrupt(batch: Batch) -> None:
    """Flip the batch's last byte (inside its records, under its CRC)."""
    with open(batch.file, "r+b") as f:
        f.seek(batch.position + batch.size - 1)
        byte = f.read(1)
        f.seek(batch.position + batch.size - 1)
        f.write(bytes([byte[0] ^ 0xFF]))

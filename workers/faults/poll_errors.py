"""A record batch the consumer cannot read: which errors of a poll mean that, and where.

Such a batch (a codec whose library this process lacks, a batch that fails its CRC, one
whose compressed bytes do not decompress) has no record to dead-letter: kafka-python
raises before it yields any, and the partition's position stays at the batch. Polling
again gets the same batch (kafka-python 3.0 even spins inside poll() on the second try),
so the worker stops with an `UnreadableBatch` that says what and where; the actor reports
it, the controller backs its restarts off, and the operator decides (docs/operations.md,
"A batch that cannot be read": fix the cause, or skip the batch with `dgstream
skip-batch`). Nothing is skipped unless the operator asks.

A batch that decompresses past the worker's bound (`workers.steps.inputs.bound_consumer`) is
not one of these: it is readable as far as the bound, so the consumer returns one record
standing for it, which the worker dead-letters (BATCH_TOO_LARGE) and commits past like any
other; its partition moves on without an operator. The bounded reading decompresses with
the same libraries, and their refusals are still UNDECODABLE_BATCH (`Undecodable`).
"""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any

from kafka.errors import CorruptRecordError, UnsupportedCodecError

from dgstream.workers.faults.errors import WorkerFailed
from dgstream.workers.kafka.decompress import Undecodable
from dgstream.workers.kafka.quirks import fetching_partition

__all__ = ["CAUSES", "UnreadableBatch", "unreadable_batch"]

# The causes, as `dgstream status`, the metrics (tag `cause`) and the logs name them.
CAUSES = {
    "UNSUPPORTED_CODEC": "the batch's codec needs a library this worker's Python lacks",
    "CORRUPT_BATCH": "the batch fails its CRC check (damaged on disk or on the way)",
    "UNDECODABLE_BATCH": "the batch's compressed bytes do not decompress",
}
# kafka-python's CRC message names the partition and the batch's first offset.
_CRC_WHERE = re.compile(r"topic='(?P<topic>[^']*)', partition=(?P<partition>\d+)\) at offset (\d+)")
# A position lookup of the failing partition (known locally: no request) gives up fast.
_POSITION_TIMEOUT_MS = 1_000


class UnreadableBatch(WorkerFailed):
    """The worker stopped at a batch it cannot read; `cause` is one of `CAUSES`."""

    def __init__(
        self, cause: str, detail: str, topic: str | None, partition: int | None, offset: int | None
    ) -> None:
        self.cause, self.detail = cause, detail
        self.topic, self.partition, self.offset = topic, partition, offset
        super().__init__(self.describe())

    @property
    def where(self) -> str:
        if self.topic is None:
            return "an unknown partition"
        return f"{self.topic}/{self.partition}@{self.offset}"

    def describe(self) -> str:
        return f"unreadable batch at {self.where}: {self.cause}: {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "detail": self.detail,
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
        }


def _from_record_decoding(exc: BaseException) -> bool:
    """Whether the exception was raised while kafka-python unpacked a record batch (its
    codec or record modules), not by the network, the group or this project."""
    tb = exc.__traceback__
    while tb is not None:
        parts = PurePath(tb.tb_frame.f_code.co_filename).parts
        if "kafka" in parts and (parts[-1] == "codec.py" or "record" in parts):
            return True
        tb = tb.tb_next
    return False


def _cause(exc: BaseException) -> str | None:
    if isinstance(exc, UnsupportedCodecError):
        return "UNSUPPORTED_CODEC"
    if isinstance(exc, CorruptRecordError):
        return "CORRUPT_BATCH"
    if isinstance(exc, Undecodable) or _from_record_decoding(exc):
        return "UNDECODABLE_BATCH"
    return None


def _failing_partition(consumer: Any, exc: BaseException) -> tuple[str | None, int | None]:
    """The partition whose batch raised: the one kafka-python was unpacking
    (`workers.kafka.quirks.fetching_partition`), else the one the CRC message names."""
    found = fetching_partition(consumer)
    if found is not None:
        return found
    m = _CRC_WHERE.search(str(exc))
    if m:
        return m["topic"], int(m["partition"])
    return None, None


def unreadable_batch(exc: BaseException, consumer: Any) -> UnreadableBatch | None:
    """`exc` (from the consumer's poll) as an `UnreadableBatch`, or None when it is not one.
    The offset is the partition's position, which kafka-python left at the batch."""
    if isinstance(exc, UnreadableBatch):
        return exc
    cause = _cause(exc)
    if cause is None:
        return None
    topic, partition = _failing_partition(consumer, exc)
    offset = None
    if topic is not None and partition is not None and consumer is not None:
        from kafka import TopicPartition

        try:
            offset = int(consumer.position(TopicPartition(topic, partition), _POSITION_TIMEOUT_MS))
        except Exception:
            offset = None
    detail = f"{type(exc).__name__}: {exc}"
    return UnreadableBatch(cause, detail[:500], topic, partition, offset)

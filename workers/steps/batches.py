"""What travels between the worker's threads: input records (`Entry`), the micro-batches
that hold them (`Batch`) and the records a batch produces (`Output`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kafka import TopicPartition

from dgstream.schemas import ClassificationRequest, RequestError

__all__ = ["Batch", "Entry", "Output", "tp_name"]


def tp_name(tp: TopicPartition) -> str:
    """ "<topic>-<partition>", as status, metrics and logs show a partition."""
    return f"{tp.topic}-{tp.partition}"


@dataclass(slots=True)
class Entry:
    """One input record and what parsing made of it."""

    tp: TopicPartition
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)
    request: ClassificationRequest | None = None
    error: RequestError | None = None
    # The id a body without one is given (`schemas.record_id`: the key, else the place).
    fallback_id: str | None = None


@dataclass(eq=False)
class Batch:
    """One micro-batch: its records, and where it stands between poll and commit."""

    seq: int
    entries: list[Entry] = field(default_factory=list)
    last: dict[TopicPartition, int] = field(default_factory=dict)  # tp -> last offset here
    started: float = field(default_factory=time.monotonic)
    open: set[TopicPartition] = field(default_factory=set)  # tps not yet committed/dropped
    done: bool = False
    # at-least-once acknowledgement countdown (producer I/O thread)
    waiting: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    reported: bool = False
    # Abandoned (its work is read again from the committed offsets): it must produce
    # nothing more. Set under the exactly-once committer's lock, read under it.
    cancelled: bool = False
    # Its spans (`workers.results.tracing.BatchTrace`) while tracing is on: opened by the engine
    # stage, ended when its outputs are acknowledged or it fails.
    trace: Any = None

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)
        self.last[entry.tp] = entry.offset

    def drop(self, tps: set[TopicPartition]) -> None:
        self.entries = [e for e in self.entries if e.tp not in tps]
        for tp in tps:
            self.last.pop(tp, None)

    def __len__(self) -> int:
        return len(self.entries)


@dataclass(slots=True)
class Output:
    """One record to produce: a result or a dead letter, for one input record."""

    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes | None]]
    entry: Entry
    dead_code: str | None  # None for a result
    route: str | None = None  # the route that chose a result's topic (its counter)

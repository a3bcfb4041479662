"""Compression bombs as a hostile producer sends them: a value of hundreds of MB that its
codec makes a few KB, produced by librdkafka (confluent-kafka), which lets a producer raise
its message size to 1 GB; the broker takes the batch because it is small on the wire.

Each record goes in a batch of its own (the producer is flushed after each), in order, to
one partition, unless `together` asks for one batch of several.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The codecs whose ratio makes a bomb: snappy's is about 20x, so 1 MiB on the wire is
# about 20 MB at most, which the worker reads within its default bound.
BOMB_CODECS = ("gzip", "lz4", "zstd")
# librdkafka's ceiling for message.max.bytes (its configuration reference).
_LIBRDKAFKA_MAX_MESSAGE = 1_000_000_000


def json_bomb(size: int) -> bytes:
    """`[[],[],...]`: valid JSON of `size` bytes (give or take two) that costs Python some
    40 bytes of list objects per byte when parsed."""
    n = max(1, (size - 2) // 3)
    return b"[" + b"[]," * (n - 1) + b"[]]"


def byte_bomb(size: int) -> bytes:
    """`size` copies of one byte."""
    return b"a" * size


@dataclass(frozen=True)
class Send:
    value: bytes
    codec: str = "none"
    key: bytes | None = None


class Producers:
    """librdkafka producers, one per codec, kept between sends (a close() at the end)."""

    def __init__(self, bootstrap: str, *, together: bool = False) -> None:
        self._bootstrap, self._together = bootstrap, together
        self._producers: dict[str, Any] = {}

    def _producer(self, codec: str) -> Any:
        from confluent_kafka import Producer

        if codec not in self._producers:
            self._producers[codec] = Producer(
                {
                    "bootstrap.servers": self._bootstrap,
                    "compression.type": codec,
                    "message.max.bytes": _LIBRDKAFKA_MAX_MESSAGE,
                    "enable.idempotence": True,
                    "acks": "all",
                    "linger.ms": 2_000 if self._together else 0,
                    "batch.num.messages": 100_000,
                    "batch.size": _LIBRDKAFKA_MAX_MESSAGE,
                    "log_level": 3,
                }
            )
        return self._producers[codec]

    def send(self, topic: str, sends: Sequence[Send], *, partition: int = 0) -> list[int]:
        """Send each record to `partition` of `topic`, each in a batch of its own (or, for
        producers made `together`, all in one: they must share a codec); returns their
        offsets in order, once the broker has them all."""
        from confluent_kafka import KafkaException

        offsets: list[int] = []
        errors: list[str] = []

        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(str(err))
            else:
                offsets.append(msg.offset())

        try:
            for s in sends:
                p = self._producer(s.codec)
                p.produce(
                    topic, value=s.value, key=s.key, partition=partition, on_delivery=delivered
                )
                if not self._together:
                    p.flush(120)
            for p in self._producers.values():
                p.flush(120)
        except KafkaException as exc:
            raise AssertionError(f"librdkafka: {exc}") from exc
        assert not errors and len(offsets) == len(sends), errors or offsets
        return offsets

    def close(self) -> None:
        for p in self._producers.values():
            p.flush(60)
        self._producers.clear()


def produce(
    bootstrap: str, topic: str, sends: Sequence[Send], *, partition: int = 0, together: bool = False
) -> list[int]:
    """`Producers.send` with producers of its own."""
    producers = Producers(bootstrap, together=together)
    try:
        return producers.send(topic, sends, partition=partition)
    finally:
        producers.close()

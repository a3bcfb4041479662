"""`dgstream skip-batch GROUP TOPIC PARTITION OFFSET`: move a consumer group's offset past
one record batch that its workers cannot read (docs/operations.md, "A batch that cannot
be read"). The pipeline never skips by itself: such a batch has no record to dead-letter.

It refuses unless the group is empty (Kafka moves a group's offsets only then: stop the
deployment first) and the group's committed offset of the partition is OFFSET (nothing
else moved it meanwhile). The batch's extent is read from its header, as the broker sends
it (the header is never compressed, and the CRC does not cover its offsets). `--dry-run`
says what it would skip and changes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from typing import Any

from dgstream.topology.cli.commands import Refused, add_kafka_arguments, kafka_connection

# How long the one fetch of the batch may take (a loopback broker answers in milliseconds;
# a remote one under load in well under this).
_FETCH_TIMEOUT_S = 30.0
_POLL_MS = 500


@dataclass(frozen=True)
class BatchExtent:
    base_offset: int
    next_offset: int  # the first offset after the batch
    codec: str

    @property
    def records(self) -> int:
        return self.next_offset - self.base_offset


_CODECS = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}


def _extent_in(raw: bytes, offset: int) -> BatchExtent | None:
    """The batch holding `offset` among the raw record batches of a fetch response."""
    from kafka.record import MemoryRecords

    records = MemoryRecords(raw)
    while (batch := records.next_batch()) is not None:
        next_offset = int(batch.next_offset)
        if int(batch.base_offset) <= offset < next_offset:
            codec = _CODECS.get(int(batch.compression_type), str(batch.compression_type))
            return BatchExtent(int(batch.base_offset), next_offset, codec)
    return None


def batch_extent(conn: Any, tp: Any, offset: int) -> BatchExtent:
    """Fetch the partition at `offset` and read the header of the batch that holds it.

    The raw bytes are taken from the consumer's fetcher before it unpacks them (its
    `_parse_fetched_data`: private, so checked for), since unpacking is what fails."""
    import time

    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        enable_auto_commit=False, **conn.client_kwargs(client_id="dgstream-skip-batch")
    )
    raw: list[bytes] = []
    try:
        fetcher = getattr(consumer, "_fetcher", None)
        parse = getattr(fetcher, "_parse_fetched_data", None)
        if parse is None:
            raise Refused("this kafka-python has no fetcher to read a batch header from")

        def capture(completed: Any) -> Any:
            if completed.topic_partition == tp and completed.fetched_offset == offset:
                raw.append(bytes(completed.partition_data.records or b""))
            return parse(completed)

        fetcher._parse_fetched_data = capture  # type: ignore[union-attr]
        consumer.assign([tp])
        consumer.seek(tp, offset)
        deadline = time.monotonic() + _FETCH_TIMEOUT_S
        while not raw and time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # unpacking the batch fails: expected
                consumer.poll(timeout_ms=_POLL_MS, max_records=1)
    finally:
        consumer.close()
    if not raw:
        raise Refused(f"no batch at {tp.topic}/{tp.partition}@{offset} (past the end?)")
    extent = _extent_in(raw[0], offset)
    if extent is None:
        raise Refused(f"the fetch at {tp.topic}/{tp.partition}@{offset} held no batch header")
    return extent


def _check_group(admin: Any, group: str, tp: Any, offset: int) -> int | None:
    """Refuses unless `group` is empty and its committed offset of `tp` is `offset` (or
    it has none); returns the committed offset."""
    described = admin.describe_groups([group]).get(group, {})
    members = described.get("members") or []
    if members:
        raise Refused(
            f"group {group!r} has {len(members)} member(s): Kafka moves a group's offsets "
            "only while it is empty; stop the deployment first (dgstream stop)"
        )
    offsets = admin.list_group_offsets({group: [tp]}).get(group, {})
    meta = offsets.get(tp)
    committed = None if meta is None or meta.offset is None or meta.offset < 0 else meta.offset
    if committed is not None and committed != offset:
        raise Refused(
            f"group {group!r} has committed {tp.topic}/{tp.partition} at {committed}, not "
            f"{offset}: nothing skipped (the offset moved since the failure was reported)"
        )
    return committed


def _log_start(conn: Any, tp: Any) -> int:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        enable_auto_commit=False, **conn.client_kwargs(client_id="dgstream-skip-batch")
    )
    try:
        return int(consumer.beginning_offsets([tp])[tp])
    finally:
        consumer.close()


def skip_batch(args: argparse.Namespace) -> int:
    from kafka import KafkaAdminClient, OffsetAndMetadata, TopicPartition

    conn = kafka_connection(args)
    tp = TopicPartition(args.topic, args.partition)
    admin = KafkaAdminClient(**conn.client_kwargs(client_id="dgstream-skip-batch"))
    try:
        committed = _check_group(admin, args.group, tp, args.offset)
        if committed is None and args.offset != (start := _log_start(conn, tp)):
            # Reading starts at the log's start: the records before OFFSET are unanswered.
            raise Refused(
                f"group {args.group!r} has no committed offset of {tp.topic}/{tp.partition} "
                f"and its log starts at {start}, not {args.offset}: nothing skipped"
            )
        extent = batch_extent(conn, tp, args.offset)
        target = extent.next_offset
        where = f"{tp.topic}/{tp.partition}"
        print(
            f"the batch at {where}@{args.offset}: offsets {extent.base_offset}.."
            f"{extent.next_offset - 1} ({extent.records} record(s), codec {extent.codec})"
        )
        if extent.base_offset < args.offset:
            print(f"  (offsets {extent.base_offset}..{args.offset - 1} were read already)")
        lost = target - args.offset
        if args.dry_run:
            print(f"dry run: group {args.group!r} would move to {target}, skipping {lost}")
            return 0
        errors = admin.alter_group_offsets(args.group, {tp: OffsetAndMetadata(target, "", -1)})
        bad = {str(k): v.__name__ for k, v in errors.items() if v.__name__ != "NoError"}
        if bad:
            raise Refused(f"Kafka refused the new offset: {bad}")
    finally:
        admin.close()
    was = "no committed offset" if committed is None else f"committed {committed}"
    print(
        f"group {args.group!r}: {where} moved from {was} to {target}; {lost} record(s) "
        "skipped, never answered nor dead-lettered"
    )
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "skip-batch",
        help="move a group's offset past one record batch its workers cannot read "
        "(the group must be empty: stop the deployment first)",
    )
    p.add_argument("group", help="the pipeline's consumer group")
    p.add_argument("topic")
    p.add_argument("partition", type=int)
    p.add_argument("offset", type=int, help="where the failure says the batch is")
    p.add_argument("--dry-run", action="store_true", help="say what would be skipped, only")
    add_kafka_arguments(p)
    p.set_defaults(func=skip_batch)

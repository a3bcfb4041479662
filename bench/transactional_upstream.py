"""A transactional upstream's cost: the stream worker reading records that an exactly-once
producer (Kafka Streams, Flink, a transactional librdkafka client) wrote, against the same
records written plainly, in both delivery modes, on one local broker.

Behind a transactional upstream every transaction ends in a marker that takes an offset
and that no consumer is given, so a partition the worker has caught up on ends at its
position, past the last record it read. The commit step commits such an idle partition up
to that position (else the group's lag never reaches 0); under exactly-once those offsets
go in a transaction of their own. This measures what that costs, side by side:

- `plain`: the input written without transactions (no markers: the position is the last
  record + 1, so no idle commit is ever needed);
- `transactional`: the same records written by a transactional producer in transactions of
  `--txn-records` records each (every transaction leaves one marker per partition it wrote).

Each (upstream, delivery) pair runs `--repeat` times, alternating; the rate is results per
second across the span of the output records' timestamps (bench/worker_overhead.py's
`output_rate`), and a run ends when every answer is committed and the group's lag is 0.

    .venv/bin/python bench/transactional_upstream.py      # starts and stops its own broker

Prints the figures and the command; writes the "transactional-upstream" section of
docs/benchmarks.md (`--no-write` to skip).
"""

from __future__ import annotations

import os
import platform
import statistics
import struct
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from bench.report import write_section
from bench.worker_overhead import (
    PARTITIONS,
    broker_at,
    make_messages,
    measured,
    produce_input,
    run_worker,
    worker_run_parser,
)
from dgstream.workers.engine.factory import EngineSettings, build_classifier
from dgstream.workers.hosting.logs import configure_logging
from dgstream.workers.hosting.settings import Delivery
from dgstream.workers.kafka.admin import ensure_topics
from dgstream.workers.kafka.settings import KafkaConnection

# Records per upstream transaction. Kafka Streams under exactly-once commits every 100 ms
# (its commit.interval.ms default for that guarantee), so its transactions hold what one
# task reads in 100 ms: a few hundred records at this bench's rates. 100 is on the small
# side of that, which makes markers, and so idle commits, more frequent.
TXN_RECORDS = 100
# The live upstream's pace, records/s: about a third of what the worker answers here with
# the fake engine (the backlog rows), so that it keeps up and its partitions go idle
# between the upstream's transactions, as a worker that is not behind does.
LIVE_RATE = 400.0


def produce_upstream(
    conn: KafkaConnection,
    topic: str,
    messages: list[tuple[bytes, bytes]],
    per_txn: int,
    transactional: bool = True,
    rate: float | None = None,
) -> int:
    """`messages` in groups of `per_txn` records (keys spread them over the partitions, as
    `produce_input` does), each a transaction (`transactional`) or a flush: as fast as the
    broker takes them (a backlog), or one group every `per_txn / rate` seconds (a live
    upstream). Returns the number of groups."""
    extra: dict[str, Any] = (
        {"transactional_id": f"bench-upstream-{uuid.uuid4().hex[:8]}"} if transactional else {}
    )
    producer = KafkaProducer(
        **conn.client_kwargs(client_id="bench-upstream"),
        enable_idempotence=True,
        acks="all",
        linger_ms=5,
        **extra,
    )
    if transactional:
        producer.init_transactions()
    groups = 0
    try:
        start = time.monotonic()
        for i in range(0, len(messages), per_txn):
            if rate:
                time.sleep(max(0.0, start + groups * per_txn / rate - time.monotonic()))
            if transactional:
                producer.begin_transaction()
            for key, value in messages[i : i + per_txn]:
                producer.send(topic, key=key, value=value)
            if transactional:
                producer.commit_transaction()
            else:
                producer.flush(timeout=60)
            groups += 1
    finally:
        producer.close(timeout=10)
    return groups


OFFSETS_TOPIC = "__consumer_offsets"


def offsets_partition(group: str, partitions: int) -> int:
    """The partition of `__consumer_offsets` that holds `group`'s commits: Kafka's own
    choice, the group id's Java hashCode, its sign bit cleared, modulo the partitions."""
    raw = group.encode("utf-16-be", "surrogatepass")
    h = 0
    for unit in struct.unpack(f">{len(raw) // 2}H", raw):  # Java hashes UTF-16 code units
        h = (31 * h + unit) & 0xFFFFFFFF
    return (h & 0x7FFFFFFF) % partitions


def offset_records(conn: KafkaConnection, group: str, timeout_s: float = 60) -> int:
    """How many partition offsets `group` committed: the offset-commit records (key
    versions 0 and 1: group, topic, partition) for it in `__consumer_offsets`, read
    committed, tombstones left out. The broker's own record of every commit, so it counts
    the worker's commits whichever path made them."""
    consumer = KafkaConsumer(
        **conn.client_kwargs(client_id="bench-offsets-reader"),
        enable_auto_commit=False,
        exclude_internal_topics=False,
        isolation_level="read_committed",
    )
    try:
        parts = consumer.partitions_for_topic(OFFSETS_TOPIC) or set()
        tp = TopicPartition(OFFSETS_TOPIC, offsets_partition(group, len(parts)))
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        end = consumer.end_offsets([tp])[tp]
        count = 0
        deadline = time.monotonic() + timeout_s
        while consumer.position(tp) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{OFFSETS_TOPIC}: not read to {end} in {timeout_s:.0f} s")
            for recs in consumer.poll(timeout_ms=500).values():
                for r in recs:
                    if r.key is None or r.value is None or len(r.key) < 4:
                        continue
                    version, size = struct.unpack_from(">hh", r.key)
                    if version in (0, 1) and r.key[4 : 4 + size].decode() == group:
                        count += 1
    finally:
        consumer.close()
    return count


def main(argv: list[str] | None = None) -> int:
    ap = worker_run_parser(__doc__)
    ap.add_argument("--txn-records", type=int, default=TXN_RECORDS)
    ap.add_argument("--live-messages", type=int, default=3_000)
    ap.add_argument(
        "--live-rate", type=float, default=LIVE_RATE, help="records/s of the live upstream"
    )
    args = ap.parse_args(argv)
    configure_logging("WARNING")
    load = os.getloadavg()[0]  # other work on the machine skews every variant

    with broker_at(args.bootstrap) as bootstrap:
        conn = KafkaConnection(bootstrap_servers=bootstrap)
        messages = make_messages(args.messages)
        topics = {"plain": f"bench-plain-{uuid.uuid4().hex[:8]}"}
        topics["transactional"] = f"bench-txn-{uuid.uuid4().hex[:8]}"
        ensure_topics(conn, {t: PARTITIONS for t in topics.values()})
        produce_input(conn, topics["plain"], messages)
        txns = produce_upstream(conn, topics["transactional"], messages, args.txn_records)
        classifier = build_classifier(EngineSettings(backend="fake"), {}, "bench")

        rates: dict[tuple[str, str], list[float]] = {}
        commits: dict[tuple[str, str], list[int]] = {}
        modes: tuple[Delivery, ...] = ("at_least_once", "exactly_once")
        for rep in range(args.repeat):
            for delivery in modes:
                for upstream, topic in topics.items():
                    group = f"bench-txn-worker-{uuid.uuid4().hex[:8]}"

                    def run(
                        out: str,
                        topic: str = topic,
                        delivery: Delivery = delivery,
                        group: str = group,
                    ) -> Any:
                        return run_worker(
                            conn,
                            topic,
                            out,
                            args.messages,
                            classifier,
                            delivery=delivery,
                            group=group,
                        )

                    label = f"run {rep + 1} {delivery:>13} {upstream:>13}"
                    rate = measured(conn, args.messages, label, run)
                    rates.setdefault((delivery, upstream), []).append(rate)
                    written = offset_records(conn, group)
                    commits.setdefault((delivery, upstream), []).append(written)
                    print(f"{' ' * len(label)}  {written} partition offsets committed")

        # A live upstream: the worker keeps up, so its partitions go idle after every
        # upstream transaction (or flush), and the idle commits are as many as they get.
        live: dict[tuple[str, str], list[int]] = {}
        live_messages = make_messages(args.live_messages)
        for rep in range(args.repeat):
            for delivery in modes:
                for upstream in topics:
                    topic, out = (f"bench-live-{x}-{uuid.uuid4().hex[:8]}" for x in ("in", "out"))
                    ensure_topics(conn, {topic: PARTITIONS, out: PARTITIONS, f"{out}-dlq": 1})
                    group = f"bench-live-worker-{uuid.uuid4().hex[:8]}"
                    producer = threading.Thread(
                        target=produce_upstream,
                        args=(conn, topic, live_messages, args.txn_records),
                        kwargs={
                            "transactional": upstream == "transactional",
                            "rate": args.live_rate,
                        },
                        daemon=True,
                    )
                    run_worker(
                        conn,
                        topic,
                        out,
                        len(live_messages),
                        classifier,
                        delivery=delivery,
                        group=group,
                        on_assigned=producer.start,
                    )
                    producer.join(60)
                    written = offset_records(conn, group)
                    live.setdefault((delivery, upstream), []).append(written)
                    print(
                        f"live {rep + 1} {delivery:>13} {upstream:>13}: {written} partition "
                        "offsets committed"
                    )

    best = {k: max(v) for k, v in rates.items()}
    command = "python bench/transactional_upstream.py" + (
        f" --messages {args.messages}" if args.messages != 20_000 else ""
    )
    if args.txn_records != TXN_RECORDS:
        command += f" --txn-records {args.txn_records}"
    if args.live_messages != 3_000:
        command += f" --live-messages {args.live_messages}"
    if args.live_rate != LIVE_RATE:
        command += f" --live-rate {args.live_rate:g}"
    if args.repeat != 2:
        command += f" --repeat {args.repeat}"
    cpu = f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"
    lines = []
    for delivery in ("at_least_once", "exactly_once"):
        plain, txn = best[(delivery, "plain")], best[(delivery, "transactional")]
        counts = [
            " / ".join(str(c) for c in commits[(delivery, u)]) for u in ("plain", "transactional")
        ]
        lines.append(
            f"| {delivery.replace('_', '-')} | {plain:,.0f} | {txn:,.0f} | **{txn / plain:.2f}x** "
            f"| {counts[0]} | {counts[1]} |"
        )
    per_k = {k: [1000 * c / args.live_messages for c in v] for k, v in live.items()}
    live_lines = []
    for delivery in ("at_least_once", "exactly_once"):
        plain_k, txn_k = per_k[(delivery, "plain")], per_k[(delivery, "transactional")]
        live_lines.append(
            f"| {delivery.replace('_', '-')} | {' / '.join(f'{c:.0f}' for c in plain_k)} "
            f"| {' / '.join(f'{c:.0f}' for c in txn_k)} "
            f"| **{statistics.mean(txn_k) / statistics.mean(plain_k):.2f}x** |"
        )
    runs = "; ".join(
        f"{d.replace('_', '-')} {u}: {' / '.join(f'{r:,.0f}' for r in v)}"
        for (d, u), v in rates.items()
    )
    md = "\n".join(
        [
            "## A transactional upstream: its markers' cost in the stream worker",
            "",
            f"Local single-node Kafka broker (KRaft, loopback), {cpu}, Python "
            f"{platform.python_version()}, kafka-python 3. The worker overhead benchmark's "
            f"{args.messages:,} requests (two inline questions, the fake engine at zero cost "
            f"per read) on {PARTITIONS} partitions, written twice: plainly, and by a "
            f"transactional producer in {txns:,} transactions of {args.txn_records} records "
            "(each leaves a marker in every partition it wrote, which the worker is never "
            "given: a caught-up partition's offsets are committed up to the consumer's "
            "position, under exactly-once in a transaction of their own). The stream worker "
            "at its defaults reads each from the beginning; a run ends when every answer is "
            "committed and the group's lag is 0. Results/s across the span of the output "
            f"records' timestamps, best of {args.repeat} alternating runs (all runs: {runs}). "
            f"Load average {load:.1f} at the start. Offsets committed: the partition offsets "
            "the run's group wrote to `__consumer_offsets` (the broker's own record of every "
            "commit, read back after the run), one per partition a commit named.",
            "",
            "| delivery | plain upstream | transactional upstream | transactional / plain "
            "| offsets committed, plain (each run) | offsets committed, transactional |",
            "|---|---:|---:|---:|---:|---:|",
            *lines,
            "",
            f"Live: the upstream writes {args.live_messages:,} such records at "
            f"{args.live_rate:,.0f} records/s once the worker holds its partitions, "
            f"{args.txn_records} at a time (a transaction, or a flush for the plain one), "
            "so the worker keeps up and its partitions go idle between them. Partition "
            "offsets committed per 1,000 records (each run):",
            "",
            "| delivery | plain upstream | transactional upstream | transactional / plain |",
            "|---|---:|---:|---:|",
            *live_lines,
            "",
            f"Reproduce: `{command}` (starts and stops its own broker; `--bootstrap host:port` "
            "to use another).",
        ]
    )
    print()
    print(md)
    if not args.no_write:
        write_section("transactional-upstream", md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

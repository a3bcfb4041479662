"""A hostile producer's mix, on the real broker: good requests interleaved, on four
partitions, with every kind of record that stopped or crash-looped a worker before (a key
or headers larger than any output may carry, header keys that are not UTF-8, a value past
the size limit, compression bombs from librdkafka, a flood of tiny records on one
partition) and the bad input moderation sees every day (any bytes, any valid JSON: lone
surrogates, huge numbers, deep nesting; empty values, tombstones), while a second worker
joins the group mid-way and later drains and leaves (two rebalances under load). The
order, the partitions and the random bytes come from a seeded generator (the seed is
printed).

No worker restarts: every good request answered (exactly once under exactly-once, at
least once otherwise), every bad record dead-lettered (once under exactly-once) with its
code and its bytes intact (or, for what the worker never held whole, where it is),
nothing else on either topic, the first worker still running, the group's lag 0."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest

from bench.harness.bombs import Send, byte_bomb, json_bomb, produce
from bench.harness.faults import DELIVERIES
from bench.harness.pipeline import Pipeline, WorkerThread, request_bytes
from bench.harness.waiting import wait_for
from dgstream.schemas import DeadLetter, ErrorCode
from dgstream.schemas.headers import HeaderKey
from dgstream.workers.kafka.admin import ensure_topics

pytestmark = [pytest.mark.broker, pytest.mark.slow]

SESSION = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}
SEED = int(os.environ.get("DGSTREAM_SOAK_SEED", "20261207"))
PARTITIONS = 4
GOOD = 120
BIG = 2 << 20  # past the producer's 1 MiB limit for any output that copies it whole
BOUND = 4 << 20  # consumer.max_batch_bytes here: a bomb is four times as large
BOMB = 16 << 20
FLOOD = 3_000  # one-byte records on the last partition
E = ErrorCode
# The code each kind of bad record must get (random bytes may or may not be UTF-8).
CODES: dict[str, set[ErrorCode]] = {
    "bytes": {E.INVALID_UTF8, E.INVALID_JSON},
    "surrogate": {E.INVALID_UNICODE},
    "huge-number": {E.INVALID_JSON},
    "deep": {E.INVALID_JSON},
    "empty": {E.EMPTY_MESSAGE},
    "tombstone": {E.EMPTY_MESSAGE},
    "not-object": {E.NOT_AN_OBJECT},
    "too-large": {E.MESSAGE_TOO_LARGE},
    "bomb": {E.BATCH_TOO_LARGE},
    "flood": {E.INVALID_JSON},
}


def _hostile(rng: random.Random) -> list[tuple[str, bytes | None, bytes | None, list[Any]]]:
    """(kind, value, key, headers) of each bad record and each good one with hostile
    framing; a good one's kind starts with "good"."""
    deep = b"[" * 100_000 + b"]" * 100_000
    out: list[tuple[str, bytes | None, bytes | None, list[Any]]] = [
        ("bytes", rng.randbytes(rng.randint(1, 4096)), None, []),
        ("bytes", b"\xff\xfe" + rng.randbytes(64), None, []),
        ("surrogate", b'{"id": "s1", "state": "\\ud800", "question_set": "moderation"}', None, []),
        (
            "huge-number",
            b'{"id": "n1", "state": "x", "question_set": 1' + b"0" * 5000 + b"}",
            None,
            [],
        ),
        ("deep", deep, None, []),
        ("empty", b"", None, []),
        ("tombstone", None, b"tombstone", []),
        ("not-object", b"[1, 2, 3]", None, []),
        ("too-large", json.dumps({"id": "t1", "state": "s" * (BIG // 2)}).encode(), None, []),
    ]
    n = GOOD
    out += [
        ("good-big-key", request_bytes(f"g{n}", n), rng.randbytes(16) * (BIG // 16), []),
        (
            "good-big-headers",
            request_bytes(f"g{n + 1}", n + 1),
            None,
            [(f"h{i}", b"v" * (BIG // 3)) for i in range(3)],
        ),
        (
            "good-bad-key",
            request_bytes(f"g{n + 2}", n + 2),
            None,
            [(HeaderKey(b"x\xff\xc0y"), b"1")],
        ),
    ]
    return out


@pytest.mark.parametrize("delivery", DELIVERIES)
def test_a_hostile_mix_is_answered_or_dead_lettered_once_and_the_worker_lives(
    pipeline: Pipeline, worker_threads: list[WorkerThread], unique_name: Any, delivery: str
) -> None:
    from kafka import KafkaProducer

    print(f"seed {SEED}")
    rng = random.Random(SEED)
    p = pipeline
    p.input = unique_name("hostile-in")
    ensure_topics(p.conn, {p.input: PARTITIONS})
    sends = [("good", request_bytes(f"g{i}", i), f"g{i}".encode(), []) for i in range(GOOD)]
    sends += _hostile(rng)
    rng.shuffle(sends)
    producer = KafkaProducer(
        **p.conn.client_kwargs(client_id="dgstream-tests-hostile"),
        acks="all",
        compression_type="zstd",
        max_request_size=4 * BIG,
    )
    try:
        futures = [
            (
                kind,
                value,
                producer.send(
                    p.input,
                    value=value,
                    key=key,
                    headers=headers,
                    partition=rng.randrange(PARTITIONS),
                ),
            )
            for kind, value, key, headers in sends
        ]
        flood = [producer.send(p.input, value=b"x", partition=PARTITIONS - 1) for _ in range(FLOOD)]
        producer.flush(60)
        placed = {
            (f.get(60).partition, f.get(60).offset): (kind, value) for kind, value, f in futures
        }
        placed |= {(f.get(60).partition, f.get(60).offset): ("flood", b"x") for f in flood}
    finally:
        producer.close(timeout=10)
    boot = ",".join(p.conn.bootstrap_servers)
    bombs = [Send(json_bomb(BOMB), "zstd", b"bomb-1"), Send(byte_bomb(BOMB), "gzip", b"bomb-2")]
    for i, bomb in enumerate(bombs):
        (offset,) = produce(boot, p.input, [bomb], partition=i)
        placed[(i, offset)] = ("bomb", bomb.value)
    good_ids = {
        json.loads(value)["id"] for kind, value in placed.values() if kind.startswith("good")
    }
    bad = {at: kv for at, kv in placed.items() if not kv[0].startswith("good")}

    settings = {"delivery": delivery, "consumer": {"max_batch_bytes": BOUND, **SESSION}}
    w = WorkerThread(p.settings(**settings)).start()
    worker_threads.append(w)
    committed = delivery == "exactly_once"
    out = p.reader(read_committed=committed)
    dead = p.reader(p.dead, read_committed=committed)
    # A second member joins while the first works, and drains and leaves later.
    out.read_until(lambda r: len(r.records) >= GOOD // 6, 180, "the first results")
    second = WorkerThread(p.settings(replica=1, **settings)).start()
    worker_threads.append(second)
    wait_for(lambda: p.members() == 2, 60, "the second member in the group")
    out.read_until(lambda r: len(set(r.ids())) >= GOOD // 2, 180, "half of the results")
    second.worker.drain(60)
    second.join()
    assert second.error is None, repr(second.error)
    out.read_until(lambda r: good_ids <= set(r.ids()), 180, "every good request answered")
    dead.read_until(lambda r: len(r.records) >= len(bad), 120, "every bad record's letter")
    wait_for(lambda: p.lag() == 0, 60, "the group's lag at 0")
    out.read_to_end()
    dead.read_to_end()

    assert set(out.ids()) == good_ids
    if committed:
        assert sorted(out.ids()) == sorted(good_ids)
    letters = [DeadLetter.from_record(r.value, r.key, r.headers) for r in dead.records]
    by_place = {(x.source.partition, x.source.offset): x for x in letters}
    assert set(by_place) == set(bad), sorted(set(by_place) ^ set(bad))
    if committed:
        assert len(letters) == len(bad)
    for at, (kind, value) in bad.items():
        letter = by_place[at]
        assert letter.error.code in CODES[kind], (kind, letter.error)
        if kind == "tombstone":
            assert letter.original_null
        elif kind == "bomb":  # never held whole: where it is, and no bytes
            assert letter.original == "" and (letter.source.partition, letter.source.offset) == at
        elif not letter.truncated:
            assert letter.original_bytes() == value, kind
        else:
            assert value is not None and value.startswith(letter.original_bytes()), kind
    status = w.worker.status()
    assert status["state"] == "running" and w.error is None, status

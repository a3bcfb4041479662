"""Compression bombs against the real broker and a real worker (no Ray): a value that its
codec shrinks from megabytes to kilobytes, accepted by the broker, on the same partition
as good requests, a good request after each bad one.

With the bound set low (4 MiB a batch, so that 16 MB bombs exercise what 200 MB bombs do:
bench/bombs.py sends those and measures the worker's memory), each bomb is dead-lettered
once with its code: BATCH_TOO_LARGE for a batch past the bound (one letter for the whole
batch, at its last offset), MESSAGE_TOO_LARGE for a value within it but past what the
consumer keeps whole. Every good request is answered once (in both delivery modes), the
group's offset reaches the end, and the worker never stops: no operator, no `skip-batch`.
"""

from __future__ import annotations

import json

import pytest

from bench.harness.bombs import Send, byte_bomb, json_bomb, produce
from bench.harness.pipeline import Pipeline, WorkerThread, request_bytes
from bench.harness.waiting import wait_for
from dgstream.schemas import DeadLetter, ErrorCode
from dgstream.workers.kafka.settings import KafkaConnection

pytestmark = [pytest.mark.broker, pytest.mark.slow]

BOUND = 4 << 20  # consumer.max_batch_bytes for these tests
BOMB = 16 << 20  # four times the bound
SESSION = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}


def _good(i: int) -> Send:
    rid = f"good-{i}"
    return Send(request_bytes(rid, i), "zstd", rid.encode())


def _letters(p: Pipeline, n: int, read_committed: bool = False) -> list[DeadLetter]:
    dead = p.reader(p.dead, read_committed=read_committed)
    dead.read_until(lambda r: len(r.records) >= n, 120, f"{n} dead letters")
    dead.read_to_end()
    return [DeadLetter.from_record(r.value, r.key, r.headers) for r in dead.records]


def test_the_worker_reads_its_batches_within_the_bound(kafka_connection: KafkaConnection) -> None:
    """The worker's consumer (`make_consumer`) is bounded: every test below relies on it."""
    from dgstream.workers.stream.ownership import make_consumer

    p = Pipeline(kafka_connection, input="in-x", output="out-x", dead="dlq-x", group="g-x")
    consumer = make_consumer(p.settings(), "bound-check")
    try:
        bounded = consumer._fetcher.PartitionRecords
        assert getattr(bounded, "_dgstream_bounded", False), (
            "make_consumer must call workers.steps.inputs.bound_consumer(consumer, settings)"
        )
    finally:
        consumer.close()


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_each_bomb_is_dead_lettered_once_and_good_traffic_goes_on(
    one_partition: Pipeline, worker_threads: list[WorkerThread], delivery: str
) -> None:
    p = one_partition
    boot = ",".join(p.conn.bootstrap_servers)
    cut_value = json.dumps({"id": "big-1", "state": "s" * (2 << 20)}).encode()
    bad = [
        ("zstd", json_bomb(BOMB), ErrorCode.BATCH_TOO_LARGE),
        ("gzip", byte_bomb(BOMB), ErrorCode.BATCH_TOO_LARGE),
        ("lz4", json_bomb(BOMB), ErrorCode.BATCH_TOO_LARGE),
        ("zstd", byte_bomb(BOMB), ErrorCode.BATCH_TOO_LARGE),
        # Within the bound, past what the consumer keeps of one value (1 MiB + 1 byte).
        ("zstd", cut_value, ErrorCode.MESSAGE_TOO_LARGE),
    ]
    sends = [_good(0)]
    for i, (codec, value, _) in enumerate(bad, start=1):
        sends += [Send(value, codec, f"bad-{i}".encode()), _good(i)]
    offsets = produce(boot, p.input, sends)
    settings = p.settings(consumer={**SESSION, "max_batch_bytes": BOUND}, delivery=delivery)
    worker = WorkerThread(settings).start()
    worker_threads.append(worker)

    committed = delivery == "exactly_once"  # read what the transactions committed
    out = p.reader(read_committed=committed)
    good = {f"good-{i}" for i in range(len(bad) + 1)}
    out.read_until(lambda r: good <= set(r.keys()), 120, "every good request answered")
    letters = _letters(p, len(bad), committed)
    wait_for(lambda: p.committed() == {0: offsets[-1] + 1}, 60, "the offset at the end")

    out.read_to_end()
    assert sorted(out.keys()) == sorted(good)  # each once
    assert len(letters) == len(bad)  # each bomb once
    by_offset = {d.source.offset: d for d in letters}
    for (codec, value, code), offset in zip(bad, offsets[1::2], strict=True):
        letter = by_offset[offset]
        assert letter.error.code == code, (codec, letter.error)
        if code == ErrorCode.BATCH_TOO_LARGE:
            assert f"at offset {offset} (1 record(s), {codec}" in letter.error.message
            assert f"more than {BOUND} bytes" in letter.error.message
            assert letter.original == "" and letter.source.key_bytes() is None
        else:
            assert f"has {len(value)} bytes" in letter.error.message
            assert letter.truncated and letter.request_id == "big-1"
            assert letter.original_size == len(value)
            assert value.startswith(letter.original_bytes())
    assert worker.error is None and worker.worker.state == "running"


def test_a_bomb_batched_with_good_records_is_one_letter_naming_them_all(
    one_partition: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """The batch cannot be read, so neither can the records beside the bomb: one dead
    letter, at the batch's last offset, names the batch's offsets and record count."""
    p = one_partition
    boot = ",".join(p.conn.bootstrap_servers)
    first = produce(boot, p.input, [_good(0)])
    inside = [_good(1), Send(json_bomb(BOMB), "zstd", b"bomb"), _good(2)]
    batch = produce(boot, p.input, inside, together=True)
    after = produce(boot, p.input, [_good(3)])
    assert batch == [first[0] + 1, first[0] + 2, first[0] + 3]  # the premise: one batch
    worker = WorkerThread(p.settings(consumer={**SESSION, "max_batch_bytes": BOUND})).start()
    worker_threads.append(worker)

    out = p.reader()
    out.read_until(lambda r: {"good-0", "good-3"} <= set(r.keys()), 120, "the records around")
    (letter,) = _letters(p, 1)
    wait_for(lambda: p.committed() == {0: after[0] + 1}, 60, "the offset at the end")
    out.read_to_end()
    assert sorted(out.keys()) == ["good-0", "good-3"]
    assert letter.error.code == ErrorCode.BATCH_TOO_LARGE
    assert letter.source.offset == batch[-1]
    assert f"offsets {batch[0]}..{batch[-1]} (3 record(s), zstd" in letter.error.message
    assert worker.error is None


def test_the_bombs_benchmark_runs_and_writes_only_when_told(one_partition: Pipeline) -> None:
    """bench/bombs.py, shrunk (`--scale`: bombs and bound alike), against this broker: a
    worker process of its own, a bomb dead-lettered, docs/benchmarks.md untouched."""
    from support.bench_scripts import ROOT, run_bench

    boot = ",".join(one_partition.conn.bootstrap_servers)
    doc = ROOT / "docs" / "benchmarks.md"
    before = doc.read_bytes()
    args = ["--bootstrap", boot, "--scale", "0.02", "--cases", "zstd-json,lz4-byte"]
    stdout = run_bench("bench/bombs.py", *args)
    assert stdout.count("`BATCH_TOO_LARGE` x1") == 2, stdout
    assert doc.read_bytes() == before

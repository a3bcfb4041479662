"""The read path's "-inf at a slot" error (and its kin, the impossible-read checks) going
through the whole stream worker on the real broker.

vLLM's read path raises `RecoverableEngineError("every label logprob is -inf at a slot")`
from `parse_output` when a slot's logprobs are all non-finite; its impossible-read checks
raise the same type. On a compute-limited card it came three ways, and each is a fake
engine here (the fake engine inside, failing on purpose: these test the pipeline, not an
engine):

- `transient`: a whole batch fails once (a race between the host and a slow GPU);
- `large`: every call of more than 8 reads fails (a step shape only big batches form);
- `follows`: any call holding one request fails (the NaN follows that input).

What must hold in each: every request is answered or dead-lettered, never both, never
neither; no result is duplicated under exactly-once; a dead letter carries its original
record intact and says ENGINE_FAILED with the engine's message; the worker keeps running.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import pytest

from bench.harness.faults import DELIVERIES, classifier_with
from bench.harness.pipeline import (
    Pipeline,
    WorkerThread,
    check_results,
    count_duplicates,
    request_bytes,
)
from bench.harness.waiting import wait_for
from dgstream.schemas import DeadLetter, ErrorCode
from dgstream.workers.engine.types import Read, ReadResult, RecoverableEngineError

pytestmark = pytest.mark.broker

MESSAGE = "every label logprob is -inf at a slot"
# Calls of more reads than this fail in the `large` mode: the worker's batches (16 records,
# each a read or two) exceed it, and its halving gets under it.
LARGE = 8


class SlotInfEngine:
    """The fake engine, raising the read path's -inf error in one of three ways (module
    docstring). `calls` and `failures` count engine calls."""

    def __init__(self, inner: Any, mode: str) -> None:
        self.inner, self.mode = inner, mode
        self.calls = 0
        self.failures = 0
        self._failed_once: set[str] = set()

    @property
    def info(self) -> Any:
        return self.inner.info

    def _fails(self, reads: Sequence[Read]) -> bool:
        tags = {r.tag for r in reads}
        if self.mode == "transient":
            if tags & self._failed_once:
                return False
            self._failed_once |= tags
            return True
        if self.mode == "large":
            return len(reads) > LARGE
        return any(t.startswith("nan") for t in tags)  # "follows"

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
        self.calls += 1
        if self._fails(reads):
            self.failures += 1
            raise RecoverableEngineError(f"read {reads[0].tag!r}: {MESSAGE}")
        out: list[ReadResult] = await self.inner.read(reads)
        return out

    async def close(self) -> None:
        await self.inner.close()


def _run(
    pipeline: Pipeline, worker_threads: list[WorkerThread], mode: str, delivery: str
) -> tuple[SlotInfEngine, list[str], dict[str, bytes]]:
    settings = pipeline.settings(
        delivery=delivery,
        batching={"max_records": 16, "max_wait_ms": 50},
        engine_retry_backoff_s=0.0,
        # Short pauses: a test sees several tries in seconds (the engine answers others).
        outage={"initial_backoff_s": 0.1, "max_backoff_s": 0.4, "budget_s": 120},
    )
    classifier, engine = classifier_with(lambda inner: SlotInfEngine(inner, mode), settings)
    ids = [f"ok{i}" for i in range(40)]
    if mode == "follows":
        ids[7], ids[23] = "nan-7", "nan-23"
    values = {rid: request_bytes(rid, i) for i, rid in enumerate(ids)}
    # One partition: the failing requests share batches with good ones.
    pipeline.produce(list(values.values()), keys=[rid.encode() for rid in ids], partition=0)
    wt = WorkerThread(settings, classifier=classifier).start()
    worker_threads.append(wt)
    return engine, ids, values


@pytest.mark.parametrize("delivery", DELIVERIES)
@pytest.mark.parametrize("mode", ["transient", "large"])
def test_a_batch_that_reads_minus_inf_is_retried_and_every_request_answered_once(
    pipeline: Pipeline, worker_threads: list[WorkerThread], mode: str, delivery: str
) -> None:
    engine, ids, _ = _run(pipeline, worker_threads, mode, delivery)
    reader = pipeline.reader(read_committed=delivery == "exactly_once")
    reader.read_until(lambda r: set(r.keys()) >= set(ids), 90, "every result")
    wait_for(lambda: pipeline.lag() == 0, 60, "the group's lag to reach 0")
    reader.read_to_end()
    check_results(reader.records)
    keys = reader.keys()
    print(f"\n{mode}: {engine.calls} engine calls, {engine.failures} failed, {len(keys)} results")
    assert set(keys) == set(ids)
    if delivery == "exactly_once":
        assert len(keys) == len(ids), f"{count_duplicates(keys)} duplicates"
    assert engine.failures > 0  # the error did come through
    dead = pipeline.reader(pipeline.dead)
    dead.read_to_end()
    assert dead.records == []  # retried (and split), never dead-lettered
    status = worker_threads[-1].worker.status()
    assert status["state"] == "running"
    assert status["engine_calls"] > status["batches"]


@pytest.mark.parametrize("delivery", DELIVERIES)
def test_a_request_whose_reads_always_fail_is_dead_lettered_intact_and_the_rest_answered(
    pipeline: Pipeline, worker_threads: list[WorkerThread], delivery: str
) -> None:
    engine, ids, values = _run(pipeline, worker_threads, "follows", delivery)
    bad = {"nan-7", "nan-23"}
    good = [rid for rid in ids if rid not in bad]
    reader = pipeline.reader(read_committed=delivery == "exactly_once")
    dead = pipeline.reader(pipeline.dead, read_committed=delivery == "exactly_once")
    reader.read_until(lambda r: set(r.keys()) >= set(good), 90, "the good requests' results")
    dead.read_until(lambda r: len(r.records) >= len(bad), 90, "the failing requests' letters")
    wait_for(lambda: pipeline.lag() == 0, 60, "the group's lag to reach 0")
    reader.read_to_end()
    dead.read_to_end()
    check_results(reader.records)
    keys = reader.keys()
    assert set(keys) == set(good)  # answered: every good one, no failing one
    if delivery == "exactly_once":
        assert len(keys) == len(good)
    letters = [DeadLetter.model_validate_json(rec.value) for rec in dead.records]
    by_id = {letter.request_id: letter for letter in letters}
    assert set(by_id) == bad
    if delivery == "exactly_once":
        assert len(letters) == len(bad)
    for rid, letter in by_id.items():
        assert letter.error.code == ErrorCode.ENGINE_FAILED
        assert MESSAGE in letter.error.message
        assert base64.b64decode(letter.original) == values[rid]  # the record, intact
    status = worker_threads[-1].worker.status()
    print(f"\nfollows: {engine.calls} engine calls, {engine.failures} failed")
    assert status["state"] == "running"

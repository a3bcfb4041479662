"""A record that keeps killing the worker, on the real broker, under both delivery
guarantees: an engine crash on it (FatalEngineError: the worker fails) or the process dying
while it runs (os._exit in a worker process of its own). Each incarnation is restarted, as
Ray restarts the actor, until the record is dead-lettered POISON; the restarts are bounded
and every other record is answered (exactly-once: once)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kafka.errors import KafkaError

from bench.harness.faults import DELIVERIES, CrashOn, classifier_with
from bench.harness.pipeline import Pipeline, WorkerThread, count_duplicates, request_bytes
from bench.harness.waiting import wait_for
from dgstream.schemas import DeadLetter, ErrorCode
from dgstream.workers.hosting.worker import WorkerFailed

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
WORKER_PROCESS = ROOT / "bench" / "harness" / "worker_process.py"
# suspect_after + poison_after with the defaults (PoisonTuning), and two to spare: a
# crash of an incarnation that had not yet counted its start on the record's partition
# (the group still rebalancing away from the dead one) counts nothing.
MAX_RESTARTS = 6


def _produce(pipeline: Pipeline) -> list[str]:
    """Good records around the crashing one on partition 0, more on the others."""
    ids = [f"p{i}" for i in range(4)] + ["crash-1"] + [f"q{i}" for i in range(12)]
    values = [request_bytes(rid, i) for i, rid in enumerate(ids)]
    pipeline.produce(values, keys=[rid.encode() for rid in ids], partition=0)
    return ids + pipeline.produce_requests(30, prefix="o")


def _settings(pipeline: Pipeline, delivery: str) -> Any:
    return pipeline.settings(delivery=delivery, batching={"max_records": 8, "max_wait_ms": 20})


def _run_until_isolated(
    pipeline: Pipeline, ids: list[str], delivery: str, incarnation: Callable[[], int | None]
) -> int:
    """Start incarnations (each returns its exit status, None while still running) until
    every id is answered or dead-lettered; returns how many died."""
    results = pipeline.reader(read_committed=delivery == "exactly_once")
    dead = pipeline.reader(pipeline.dead, read_committed=True)
    good = set(ids) - {"crash-1"}

    def accounted() -> bool:
        results.poll(50)
        dead.poll(50)
        return set(results.keys()) >= good and dead.keys().count("crash-1") > 0

    died = 0
    while not accounted():
        status = incarnation()
        if status is not None:
            died += 1
            print(f"incarnation {died} died ({status})")
            assert died <= MAX_RESTARTS, "the poison record was not isolated"
    wait_for(lambda: pipeline.lag() == 0, 60, "the group's lag to reach 0")
    results.read_to_end()
    dead.read_to_end()
    keys = results.keys()
    print(f"{died} restarts, {len(keys)} results, {count_duplicates(keys)} duplicates")
    assert set(keys) == good
    if delivery == "exactly_once":
        assert len(keys) == len(good)
    (letter,) = [DeadLetter.model_validate_json(r.value) for r in dead.records]
    assert letter.error.code == ErrorCode.POISON and letter.request_id == "crash-1"
    assert json.loads(letter.original_bytes())["id"] == "crash-1"
    return died


def _thread_incarnations(
    settings: Any, worker_threads: list[WorkerThread]
) -> tuple[Callable[[], int | None], list[WorkerThread]]:
    """Worker threads whose engine crashes on the record, one restarted after each death."""
    current: list[WorkerThread] = []

    def incarnation() -> int | None:
        if not current or not current[-1].thread.is_alive():
            if current:
                assert isinstance(current[-1].error, WorkerFailed), current[-1].error
                assert "illegal memory access" in str(current[-1].error)
            classifier, _ = classifier_with(lambda inner: CrashOn(inner, "crash"), settings)
            wt = WorkerThread(settings, classifier=classifier).start()
            worker_threads.append(wt)
            current.append(wt)
            return 1 if len(current) > 1 else None
        return None

    return incarnation, current


@pytest.mark.parametrize("delivery", DELIVERIES)
def test_an_engine_crash_on_one_record_is_isolated_after_bounded_restarts(
    pipeline: Pipeline, worker_threads: list[WorkerThread], delivery: str
) -> None:
    settings = _settings(pipeline, delivery)
    ids = _produce(pipeline)
    incarnation, current = _thread_incarnations(settings, worker_threads)
    died = _run_until_isolated(pipeline, ids, delivery, incarnation)
    assert died >= settings.poison.suspect_after + settings.poison.poison_after - 1
    last = current[-1].worker
    assert last.status()["state"] == "running"
    assert last.status()["dead_letter_codes"] == {"POISON": 1}
    last.drain()
    current[-1].join()


@pytest.mark.parametrize("delivery", DELIVERIES)
def test_a_poison_record_met_after_progress_costs_the_documented_restarts(
    pipeline: Pipeline, worker_threads: list[WorkerThread], delivery: str
) -> None:
    """The record comes after work the first incarnation has committed (as in a running
    stream): that incarnation's death counts too, so the record is dead-lettered after
    suspect_after + poison_after restarts (PoisonTuning's "at most 4"), not one more."""
    settings = _settings(pipeline, delivery)
    before = [f"b{i}" for i in range(10)]
    values = [request_bytes(rid, i) for i, rid in enumerate(before)]
    pipeline.produce(values, keys=[rid.encode() for rid in before], partition=0)
    incarnation, current = _thread_incarnations(settings, worker_threads)
    incarnation()

    def progressed() -> bool:
        try:
            return pipeline.committed().get(0) == len(before)
        except KafkaError:  # no coordinator for the group yet
            return False

    wait_for(progressed, 60, "the first records committed")
    died = _run_until_isolated(pipeline, before + _produce(pipeline), delivery, incarnation)
    assert died == settings.poison.suspect_after + settings.poison.poison_after
    current[-1].worker.drain()
    current[-1].join()


@pytest.mark.slow
@pytest.mark.parametrize("delivery", DELIVERIES)
def test_a_process_that_dies_on_one_record_is_isolated_after_bounded_restarts(
    pipeline: Pipeline, delivery: str
) -> None:
    settings = _settings(pipeline, delivery)
    ids = _produce(pipeline)
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        cmd = [sys.executable, str(WORKER_PROCESS), settings.model_dump_json(), "exit-on:crash:137"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.DEVNULL))

    def incarnation() -> int | None:
        if not procs:
            start()
            return None
        status = procs[-1].poll()
        if status is None:
            return None
        assert status == 137  # killed on the record, as an engine segfault would
        start()
        return status

    try:
        died = _run_until_isolated(pipeline, ids, delivery, incarnation)
        assert died >= settings.poison.suspect_after + settings.poison.poison_after - 1
        assert procs[-1].poll() is None  # the last one is still running
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(30)

"""An outage is not bad input, on the real broker, under both delivery guarantees: the
engine out of reach (a remote server refusing connections, or a local engine failing
every call) and the output topic missing. The
worker holds the work, retries with backoff, shows the outage in status() and its
metrics, dead-letters nothing, and resumes by itself; past the budget it fails."""

from __future__ import annotations

from typing import Any

import pytest

from bench.harness.faults import DELIVERIES, DownEngine, classifier_with, delete_topic
from bench.harness.pipeline import Pipeline, WorkerThread, check_results, count_duplicates
from bench.harness.waiting import wait_for
from dgstream.workers.engine.types import RecoverableEngineError
from dgstream.workers.hosting.worker import WorkerFailed

pytestmark = pytest.mark.broker

# Short pauses so that a test sees several tries in seconds.
_OUTAGE = {"initial_backoff_s": 0.1, "max_backoff_s": 0.4, "budget_s": 120}
_ENGINE_ERRORS = {
    "unreachable": None,  # EngineUnavailable
    "failing": lambda: RecoverableEngineError("CUDA error: unspecified launch failure"),
}


def _settings(pipeline: Pipeline, delivery: str, **kw: Any) -> Any:
    return pipeline.settings(
        delivery=delivery,
        batching={"max_records": 16, "max_wait_ms": 20},
        engine_retry_backoff_s=0.0,
        outage=kw.pop("outage", _OUTAGE),
        **kw,
    )


def _all_answered_once(pipeline: Pipeline, ids: list[str], delivery: str) -> None:
    reader = pipeline.reader(read_committed=delivery == "exactly_once")
    reader.read_until(lambda r: set(r.keys()) >= set(ids), 90, "every result")
    wait_for(lambda: pipeline.lag() == 0, 60, "the group's lag to reach 0")
    reader.read_to_end()
    check_results(reader.records)
    keys = reader.keys()
    print(f"\n{len(keys)} results, {count_duplicates(keys)} duplicates")
    assert set(keys) == set(ids)
    if delivery == "exactly_once":
        assert len(keys) == len(ids)


def _no_dead_letters(pipeline: Pipeline) -> None:
    dead = pipeline.reader(pipeline.dead)
    dead.read_to_end()
    assert dead.records == []


@pytest.mark.parametrize("error", list(_ENGINE_ERRORS))
@pytest.mark.parametrize("delivery", DELIVERIES)
def test_engine_outage_holds_the_work_and_resumes(
    pipeline: Pipeline, worker_threads: list[WorkerThread], delivery: str, error: str
) -> None:
    settings = _settings(pipeline, delivery)
    classifier, engine = classifier_with(
        lambda inner: DownEngine(inner, _ENGINE_ERRORS[error]), settings
    )
    ids = pipeline.produce_requests(50)
    wt = WorkerThread(settings, classifier=classifier).start()
    worker_threads.append(wt)
    outage = wait_for(
        lambda: (o := wt.worker.status()["outage"]) and o["tries"] >= 3 and o,
        60,
        "an outage with three tries",
    )
    print("\noutage:", outage)
    assert outage["kind"] == "engine" and outage["budget_s"] == 120
    status = wt.worker.status()
    assert status["state"] == "running" and status["dead_lettered"] == 0
    assert status["answered"] == 0 and status["outage_tries"] >= 3
    assert not any(pipeline.committed().values())  # nothing was given up on
    engine.down.clear()  # the engine is back
    _all_answered_once(pipeline, ids, delivery)
    _no_dead_letters(pipeline)
    status = wt.worker.status()
    assert status["outage"] is None and status["dead_lettered"] == 0
    assert status["state"] == "running" and wt.error is None
    wt.worker.drain()
    wt.join()


@pytest.mark.parametrize("delivery", DELIVERIES)
def test_output_topic_missing_holds_the_work_and_resumes(
    pipeline: Pipeline, worker_threads: list[WorkerThread], delivery: str
) -> None:
    """The output topic is gone (deleted, or not created yet): every send waits for its
    metadata and times out. Once it is back, the worker answers everything."""
    from dgstream.workers.kafka.admin import ensure_topics

    delete_topic(pipeline.conn, pipeline.output)
    settings = _settings(pipeline, delivery, producer={"max_block_ms": 1000})
    ids = pipeline.produce_requests(40)
    wt = WorkerThread(settings).start()
    worker_threads.append(wt)
    outage = wait_for(
        lambda: (o := wt.worker.status()["outage"]) and o["tries"] >= 2 and o,
        60,
        "an outage with two tries",
    )
    print("\noutage:", outage)
    assert outage["kind"] == "output"
    assert wt.worker.status()["state"] == "running"
    assert not any(pipeline.committed().values())
    ensure_topics(pipeline.conn, {pipeline.output: 3})
    _all_answered_once(pipeline, ids, delivery)
    _no_dead_letters(pipeline)
    status = wt.worker.status()
    assert status["outage"] is None and status["state"] == "running" and wt.error is None
    wt.worker.drain()
    wt.join()


def test_an_outage_past_its_budget_fails_the_worker_and_dead_letters_nothing(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    settings = _settings(
        pipeline,
        "at_least_once",
        outage={"initial_backoff_s": 0.1, "max_backoff_s": 0.2, "budget_s": 1.5},
    )
    classifier, _ = classifier_with(DownEngine, settings)
    pipeline.produce_requests(10)
    wt = WorkerThread(settings, classifier=classifier).start()
    worker_threads.append(wt)
    wt.join(60)
    assert isinstance(wt.error, WorkerFailed)
    assert "outage budget" in str(wt.error)
    assert wt.worker.status()["dead_lettered"] == 0
    assert not any(pipeline.committed().values())  # the next incarnation reads them all
    _no_dead_letters(pipeline)

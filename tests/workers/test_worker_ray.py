"""Stream workers as Ray actors on the real broker: 2,000 requests over 6 partitions, a worker
killed mid-run, a worker joining while another drains, and the end-to-end accuracy check of
the trained demo model (the bar in tests/demo_model_bar.py).

Each test waits on conditions with deadlines: every id seen on the output topic, then the
group's lag at zero (every output was acknowledged before its offset was committed, so the
output topic is then complete), then the output read to its end to count duplicates.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import pytest
from demo_model_bar import assert_bar_met, assert_miswiring_caught

from bench.harness.pipeline import INPUT_PARTITIONS, Pipeline, check_results, count_duplicates
from bench.harness.waiting import wait_for
from dgstream.workers.engine.factory import EngineSettings

pytestmark = [pytest.mark.broker, pytest.mark.ray, pytest.mark.slow]

N_REQUESTS = 2000
# Actor start: a process, the imports (transformers' tokenizer), then the group join.
START_TIMEOUT_S = 120


def _status(handle: Any) -> dict[str, Any]:
    import ray

    out: dict[str, Any] = ray.get(handle.status.remote(), timeout=60)
    return out


def _start(pipeline: Pipeline, settings: list[Any]) -> list[Any]:
    from dgstream.workers.hosting.actor import create_worker

    return [create_worker(s, name=f"{pipeline.group}-{s.replica}") for s in settings]


def _wait_assigned(handles: list[Any], what: str) -> list[dict[str, Any]]:
    """Until the members together own every input partition, each at least one."""

    last: list[dict[str, Any]] = []

    def assigned() -> list[dict[str, Any]] | None:
        statuses = [_status(h) for h in handles]
        last[:] = statuses
        counts = [len(s["assignment"]) for s in statuses]
        return statuses if sum(counts) == INPUT_PARTITIONS and min(counts) >= 1 else None

    try:
        out: list[dict[str, Any]] = wait_for(assigned, START_TIMEOUT_S, what, every_s=0.25)
    except BaseException:
        # What each member said last (CI once saw this time out on a loaded machine).
        print("load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
        for s in last:
            keys = ("state", "assignment", "group", "error", "last_error", "restarts", "consumed")
            print({k: s.get(k) for k in keys})
        raise
    return out


def _kill_all(handles: list[Any]) -> None:
    import ray

    for h in handles:
        with contextlib.suppress(Exception):
            ray.kill(h, no_restart=True)


def _complete_output(pipeline: Pipeline, ids: list[str], *, read_committed: bool) -> list[str]:
    """Every id answered, the group caught up, the output read to its end: the keys."""
    reader = pipeline.reader(read_committed=read_committed)
    reader.read_until(lambda r: set(r.keys()) >= set(ids), 180, f"all {len(ids)} results")
    wait_for(lambda: pipeline.lag() == 0, 120, "the group's lag to reach 0", every_s=0.25)
    reader.read_to_end()
    check_results(reader.records)
    return reader.keys()


@pytest.mark.parametrize(
    ("delivery", "workers"),
    [("at_least_once", 1), ("at_least_once", 2), ("exactly_once", 2)],
    ids=["at-least-once-1-worker", "at-least-once-2-workers", "exactly-once-2-workers"],
)
def test_worker_2000_requests_all_answered(
    ray_cluster: Any, pipeline: Pipeline, delivery: str, workers: int
) -> None:
    from dgstream.workers.hosting.actor import retire

    settings = [pipeline.settings(replica=i, delivery=delivery) for i in range(workers)]
    handles = _start(pipeline, settings)
    try:
        _wait_assigned(handles, f"{workers} worker(s) to own the {INPUT_PARTITIONS} partitions")
        ids = pipeline.produce_requests(N_REQUESTS)
        keys = _complete_output(pipeline, ids, read_committed=delivery == "exactly_once")
        duplicates = count_duplicates(keys)
        print(f"\n{delivery}, {workers} worker(s): {len(keys)} results, {duplicates} duplicates")
        assert set(keys) == set(ids)
        assert duplicates == 0

        # Lag per assigned partition, from the worker itself: zero once all is committed.
        def caught_up() -> bool:
            statuses = [_status(h) for h in handles]
            lags = {p: lag for st in statuses for p, lag in st["lag"].items()}
            owned = {p for st in statuses for p in st["assignment"]}
            return set(lags) == owned and not any(lags.values())

        wait_for(caught_up, 30, "every worker to report zero lag", every_s=0.25)
        assert all(_status(h)["metrics_exported"] for h in handles)
        finals = [retire(h) for h in handles]
        handles = []
        assert sum(f["answered"] for f in finals) == N_REQUESTS
        assert sum(f["dead_lettered"] for f in finals) == 0
        assert all(f["state"] == "stopped" and f["last_error"] is None for f in finals)
    finally:
        _kill_all(handles)


def test_worker_killed_mid_run_loses_nothing(ray_cluster: Any, pipeline: Pipeline) -> None:
    import ray

    # A slower engine (3 ms a read) so the kill lands mid-run; static membership so the
    # restarted actor takes its partitions back without waiting for a session timeout.
    engine = EngineSettings(backend="fake", fake_cost_per_read_s=0.003)
    settings = [
        pipeline.settings(replica=i, static_membership=True, engine=engine) for i in range(2)
    ]
    window = settings[0].batching.max_in_flight * settings[0].batching.max_records
    handles = _start(pipeline, settings)
    try:
        _wait_assigned(handles, "both workers to own partitions")
        pid_before = _status(handles[0])["pid"]
        ids = pipeline.produce_requests(N_REQUESTS)
        watcher = pipeline.reader()
        watcher.read_until(lambda r: len(r.records) >= N_REQUESTS // 4, 120, "a quarter done")
        ray.kill(handles[0], no_restart=False)  # Ray restarts it (max_restarts=-1)

        def restarted() -> bool:
            try:
                st = _status(handles[0])
            except Exception:
                return False
            return bool(st["restarted"]) and st["pid"] != pid_before

        wait_for(restarted, START_TIMEOUT_S, "Ray to restart the killed worker", every_s=0.25)
        keys = _complete_output(pipeline, ids, read_committed=False)
        duplicates = count_duplicates(keys)
        print(f"\nkilled mid-run: {len(keys)} results, {duplicates} duplicates (window {window})")
        assert set(keys) == set(ids)
        assert duplicates <= window
    finally:
        _kill_all(handles)


def test_worker_joining_and_draining_mid_run_loses_nothing(
    ray_cluster: Any, pipeline: Pipeline
) -> None:
    import ray

    from dgstream.workers.hosting.actor import create_worker, retire

    # 10 ms a read: the first worker alone needs about 25 s, so the second joins mid-run
    # (with 5 ms, a loaded machine once let the first answer all 2,000 before the join).
    engine = EngineSettings(backend="fake", fake_cost_per_read_s=0.01)
    first, second = (pipeline.settings(replica=i, engine=engine) for i in range(2))
    window = first.batching.max_in_flight * first.batching.max_records
    [a] = _start(pipeline, [first])
    # The second actor's process is up but not consuming yet (autostart off).
    b = create_worker(second, name=f"{pipeline.group}-1", autostart=False)
    handles = [a, b]
    try:
        _wait_assigned([a], "the first worker to own every partition")
        ids = pipeline.produce_requests(N_REQUESTS)
        watcher = pipeline.reader()
        watcher.read_until(lambda r: len(r.records) >= 50, 120, "the first results")
        # Joining takes seconds (the engine is built before the group is joined).
        ray.get(b.start.remote(), timeout=60)
        _wait_assigned([a, b], "the second worker to join")
        final_a = retire(a)  # drain: finish in flight, commit, leave the group
        handles.remove(a)
        assert final_a["state"] == "stopped" and final_a["last_error"] is None
        wait_for(
            lambda: len(_status(b)["assignment"]) == INPUT_PARTITIONS,
            60,
            "the second worker to take every partition",
            every_s=0.25,
        )
        keys = _complete_output(pipeline, ids, read_committed=False)
        duplicates = count_duplicates(keys)
        print(
            f"\njoin + drain: {len(keys)} results, {duplicates} duplicates; the first worker "
            f"answered {final_a['answered']}"
        )
        assert set(keys) == set(ids)
        assert 0 < final_a["answered"] < N_REQUESTS + duplicates
        assert duplicates <= window
        retire(b)
        handles.remove(b)
    finally:
        _kill_all(handles)


@pytest.mark.model
def test_trained_model_end_to_end_accuracy(ray_cluster: Any, pipeline: Pipeline) -> None:
    """The demo-model check through Kafka -> Ray worker -> Kafka, results matched to their
    requests by id: every kind at the bar and the ECE within the ceiling, and mis-wired
    results (labels swapped, results shifted by one request) fail it."""
    from bench.harness.miswire import miswire_shift_results, miswire_swap_labels
    from dgstream.topology import demo_tasks

    examples = demo_tasks.held_out_examples(1, 200)
    values = [json.dumps(ex.request).encode() for ex in examples]
    ids = [ex.request["id"] for ex in examples]
    settings = pipeline.settings(engine=EngineSettings(model="demo", device="cpu"))
    handles = _start(pipeline, [settings])
    try:
        pipeline.produce(values, keys=[i.encode() for i in ids])
        reader = pipeline.reader()
        reader.read_until(lambda r: set(r.keys()) >= set(ids), 300, "every result")
        by_id = {json.loads(r.value)["id"]: json.loads(r.value) for r in reader.records}
        results = [by_id[i] for i in ids]
        report = demo_tasks.check(demo_tasks.score_results(examples, results))
        print(f"\nend to end: accuracy {report.accuracy}, ECE {report.ece:.4f}")
        assert_bar_met(report)
        for miswire in (miswire_swap_labels, miswire_shift_results):
            bad = demo_tasks.check(demo_tasks.score_results(examples, miswire(results)))
            assert_miswiring_caught(bad)
    finally:
        _kill_all(handles)

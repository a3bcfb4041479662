"""`dgstream status` tells the truth: a replica that holds records without
progress is STALLED, one that restarts in a loop is FAILING, whatever ends it. Both make
the command exit 1 naming the cause, and show on `dgstream_failing{cause}`; the worker's
own `dgstream_worker_state{state}` says "stalled", and a replica the controller takes out
of a restart loop is DEAD on the Ray dashboard with the loop as its exit detail.

On a fake clock: the restart-loop rule and the controller's list of unhealthy replicas. On
a real broker and a real Ray cluster with its dashboard: an engine slower than the stall
window (the worker holds its record, no commit moves), and a worker whose engine cannot
load (its process exits on every start: Ray restarts it at once, again and again).
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from cli_runner import run_cli

from bench.harness.ray_cluster import pipeline_status, ray_cluster, running_controller, timeline
from bench.harness.spike import pipeline_io, request_value, topology, unique
from bench.harness.waiting import wait_for
from dgstream.topology.cli.app import _failing_text
from dgstream.topology.controller import PipelineRunner, RestartLoops, _Replica
from dgstream.topology.spec import parse_topology
from dgstream.workers.hosting.actor import replica_prefix
from dgstream.workers.kafka.settings import KafkaConnection

# ------------------------------------------------------------------ unit: the rules


@pytest.mark.unit
def test_restarts_in_a_row_make_a_loop_until_the_replica_is_healthy_long_enough() -> None:
    loops = RestartLoops(threshold=3, healthy_after_s=100)
    assert not loops.restarted(0) and not loops.restarted(0, 1)
    assert loops.restarted(0)  # the third in a row
    assert not loops.looping(1)  # per replica
    # Healthy now and then, but never for the whole stretch: still looping.
    loops.healthy(0, 10.0)
    loops.healthy(0, 60.0)
    loops.unhealthy(0)
    loops.healthy(0, 70.0)
    assert loops.looping(0) and loops.restarts(0) == 3
    loops.healthy(0, 170.0)  # 100 s in a row
    assert not loops.looping(0) and loops.restarts(0) == 0


@pytest.mark.unit
def test_slow_restarts_still_count_as_a_loop() -> None:
    """A worker that loads vLLM takes minutes per start: restarts far apart, with no
    healthy stretch between them, are a loop all the same."""
    loops = RestartLoops(threshold=5, healthy_after_s=300)
    for k in range(5):
        loops.healthy(0, k * 600.0)  # it answered, serving, for a moment
        loops.unhealthy(0)  # then it crashed
        looping = loops.restarted(0)
    assert looping


@pytest.mark.unit
def test_a_restart_counts_against_an_earlier_healthy_stretch() -> None:
    loops = RestartLoops(threshold=2, healthy_after_s=100)
    loops.healthy(0, 0.0)
    loops.restarted(0)
    loops.healthy(0, 50.0)  # the stretch starts again after the restart
    assert loops.restarted(0)
    loops.forget(0)  # scaled in: removed on purpose
    assert loops.restarts(0) == 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def _runner(**pipeline: Any) -> tuple[PipelineRunner, FakeClock]:
    topo = parse_topology(
        {
            "kafka": {"bootstrap_servers": ["127.0.0.1:9"]},
            "pipelines": [
                {
                    "name": "p",
                    "input_topics": ["in"],
                    "output_topic": "out",
                    "dead_letter_topic": "dlq",
                    "consumer_group": "g",
                    "stall_after_s": 30,
                    "restarts": {"loop_restarts": 3, "reset_after_s": 100},
                    **pipeline,
                }
            ],
        }
    )
    clock = FakeClock()
    runner = PipelineRunner(topo, topo.pipelines[0], topo.kafka, "ns", clock=clock)
    return runner, clock


def _replica(runner: PipelineRunner, index: int, **kw: Any) -> _Replica:
    r = _Replica(index, runner.actor_name(index), None, 0.0, **kw)
    runner.replicas[index] = r
    return r


@pytest.mark.unit
def test_the_controller_lists_stalled_and_looping_replicas_with_their_cause() -> None:
    runner, clock = _runner()
    assert runner.spec.stall_after_s == 30
    assert runner.worker_settings(0).stall_after_s == 30
    _replica(runner, 0, state="running", ready=True, answered_at=clock.now)
    _replica(
        runner,
        1,
        state="stalled: no progress for 41 s on in-0 (lag 9)",
        stall="no progress for 41 s on in-0 (lag 9)",
        stalled_for_s=41.0,
        answered_at=clock.now,
    )
    # Answered once, then its status calls went unanswered for longer than the window.
    _replica(runner, 2, state="not answering", answered_at=clock.now - 31, pending=object())
    # Answered never (a constructor still loading): not stalled.
    _replica(runner, 3, state="not answering", pending=object())
    looping = _replica(runner, 4, state="restarting")
    for _ in range(3):
        runner.loops.restarted(4)
    failing = {f["replica"]: f for f in runner.failing()}
    assert set(failing) == {runner.actor_name(i) for i in (1, 2, 4)}
    stalled = failing[runner.actor_name(1)]
    assert (stalled["state"], stalled["cause"], stalled["stalled_for_s"]) == (
        "STALLED",
        "STALLED",
        41.0,
    )
    assert stalled["error"] == "STALLED: no progress for 41 s on in-0 (lag 9)"
    hung = failing[runner.actor_name(2)]
    assert hung["state"] == "STALLED" and "not answering its status calls for 31 s" in hung["error"]
    loop = failing[runner.actor_name(4)]
    assert (loop["state"], loop["cause"], loop["restarts_in_a_row"]) == ("FAILING", "CRASH_LOOP", 3)
    assert loop["error"].startswith("CRASH_LOOP: restarted 3 times")
    # The command's lines name the state and the cause.
    assert _failing_text([stalled]) == "STALLED: no progress for 41 s on in-0 (lag 9)"
    assert _failing_text([loop], with_state=True).startswith(
        f"FAILING {runner.actor_name(4)}: CRASH_LOOP: restarted 3 times"
    )
    # Healthy long enough, the loop is over.
    for t in (0.0, 100.0):
        runner.loops.healthy(4, clock.now + t)
    looping.state = "running"
    assert runner.actor_name(4) not in {f["replica"] for f in runner.failing()}


@pytest.mark.unit
def test_a_replica_with_its_own_error_keeps_its_cause_while_it_loops() -> None:
    """A batch it cannot read, restarted by the controller again and again: the cause stays
    the batch's, not a generic loop."""
    runner, _ = _runner()
    r = _replica(
        runner, 0, state="failed: CORRUPT_BATCH at in/0@3", error="CORRUPT_BATCH at in/0@3"
    )
    r.cause = "CORRUPT_BATCH"
    for _ in range(4):
        runner.loops.restarted(0)
    (f,) = runner.failing()
    assert (f["state"], f["cause"]) == ("FAILING", "CORRUPT_BATCH")
    assert _failing_text([f]) == "CORRUPT_BATCH at in/0@3"


# ------------------------------------------------------------------ a real cluster

STALL_AFTER_S = 2.0
# One request, one read: the fake engine holds it this long. The stall shows after
# STALL_AFTER_S; the checks (the command, the metrics Ray exports every few seconds) run
# while it lasts, and the worker recovers by itself when the read ends.
SLOW_READ_S = 75.0
BACKOFF = {"initial_backoff_s": 1, "max_backoff_s": 2, "reset_after_s": 60, "loop_restarts": 3}


@pytest.fixture(scope="module")
def dashboard_cluster() -> Iterator[Any]:
    with ray_cluster([{"num_cpus": 2}], dashboard=True) as c:
        yield c


def _metrics_text() -> str:
    import os

    import ray

    texts = []
    token = os.environ.get("RAY_AUTH_TOKEN", "")
    for node in ray.nodes():
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            texts.append(resp.read().decode())
    return "\n".join(texts)


def _series(name: str, **labels: str) -> list[float]:
    """The values of the series `name` whose labels include `labels`."""
    out = []
    for line in _metrics_text().splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            out.append(float(line.rsplit(" ", 1)[1]))
    return out


def _topology(c: Any, name: str, conn: KafkaConnection, **kw: Any) -> dict[str, Any]:
    topo = topology(
        list(conn.bootstrap_servers),
        name,
        partitions=1,
        min_replicas=1,
        max_replicas=1,
        gpus=0,
        cpus=0.5,
        poll_s=1.0,
        **kw,
    )
    topo["pipelines"][0]["restarts"] = BACKOFF
    topo["pipelines"][0]["stall_after_s"] = STALL_AFTER_S
    return topo


def _status_cli(c: Any, topo: dict[str, Any], name: str) -> Any:
    ray_args = ["--address", c.address, "--namespace", topo["ray"]["namespace"]]
    return run_cli("status", *ray_args, "--deployment", name, timeout=180)


def _entry(ctl: Any, name: str, cause: str) -> dict[str, Any] | None:
    st = pipeline_status(ctl, name)
    return next((f for f in st["failing"] if f["cause"] == cause), None)


@pytest.mark.broker
@pytest.mark.ray
@pytest.mark.slow
def test_a_worker_without_progress_is_stalled_then_ready_again(
    dashboard_cluster: Any, kafka_connection: KafkaConnection
) -> None:
    c = dashboard_cluster
    name = unique("stall")
    topo = _topology(c, name, kafka_connection, cost_per_read_s=SLOW_READ_S, max_records=1)
    io = pipeline_io(kafka_connection, topo)
    replica = f"{replica_prefix(topo['ray']['deployment'], name)}0"
    with running_controller(topo, drain=False) as ctl:
        wait_for(lambda: pipeline_status(ctl, name)["ready"] == 1, 180, "the replica ready")
        topic = topo["pipelines"][0]["input_topics"][0]
        io.produce([request_value("s0", 0)], keys=[b"s0"])
        t0 = time.monotonic()
        entry = wait_for(lambda: _entry(ctl, name, "STALLED"), 60, "the replica STALLED")
        st = pipeline_status(ctl, name)
        assert entry["replica"] == replica and entry["state"] == "STALLED", entry
        assert f"on {topic}-0" in entry["error"] and entry["stalled_for_s"] >= STALL_AFTER_S
        assert st["health"] == "stalled" and st["ready"] == 0 and st["replicas"] == 1
        # The command: exit 1, the STALLED line naming the replica and the partition.
        status = _status_cli(c, topo, name)
        assert status.returncode == 1, status.stdout + status.stderr[-2000:]
        assert f"STALLED {replica}: STALLED: no progress for" in status.stdout, status.stdout
        # The metrics: the controller's cause, the worker's own state.
        wait_for(
            lambda: _series("ray_dgstream_failing", pipeline=name, cause="STALLED") == [1.0],
            60,
            "dgstream_failing{cause=STALLED} at 1",
        )
        wait_for(
            lambda: _series("ray_dgstream_worker_state", pipeline=name, state="stalled") == [1.0],
            60,
            "dgstream_worker_state{state=stalled} at 1",
        )
        assert pipeline_status(ctl, name)["failing"], "the read ended before the checks"
        # How much of the slow read the checks used (the margin of this test's window).
        used = time.monotonic() - t0
        print(f"\nstalled: the checks took {used:.0f} s of a {SLOW_READ_S:.0f} s read")
        # The read ends: answered, committed, ready again, and every sign clears.
        out = io.reader()
        out.read_until(lambda r: "s0" in set(r.keys()), SLOW_READ_S + 60, "the slow answer")
        wait_for(lambda: io.committed() == {0: 1}, 60, "the offset committed")
        wait_for(
            lambda: (s := pipeline_status(ctl, name))["ready"] == 1 and not s["failing"],
            60,
            "the replica ready again",
        )
        assert pipeline_status(ctl, name)["health"] == "ok"
        status = _status_cli(c, topo, name)
        assert status.returncode == 0, status.stdout + status.stderr[-2000:]
        wait_for(
            lambda: _series("ray_dgstream_failing", pipeline=name, cause="STALLED") == [0.0],
            60,
            "dgstream_failing{cause=STALLED} back at 0",
        )
        assert pipeline_status(ctl, name)["restarts"] == 0  # nobody restarted it
        for r in io.readers:
            r.close()


def _dead_with_loop(c: Any, name: str) -> list[str]:
    from ray.util.state import list_actors

    actors = list_actors(address=c.address, filters=[("name", "=", name)], detail=True, timeout=30)
    out = []
    for a in actors:
        context = (a.death_cause or {}).get("actor_died_error_context") or {}
        message = str(context.get("error_message", ""))
        if a.state == "DEAD" and "CRASH_LOOP" in message:
            out.append(message)
    return out


@pytest.mark.broker
@pytest.mark.ray
@pytest.mark.slow
def test_a_worker_restarting_in_a_loop_fails_the_pool_with_the_cause(
    dashboard_cluster: Any, kafka_connection: KafkaConnection
) -> None:
    """Its engine cannot load: each incarnation exits (code 70) and Ray starts it again at
    once, which the controller never saw before (`dgstream status` said exit 0, ready 0)."""
    c = dashboard_cluster
    name = unique("loop")
    missing = "/nonexistent/dgstream-no-such-model"
    topo = _topology(
        c, name, kafka_connection, engine={"backend": "transformers", "model": missing}
    )
    replica = f"{replica_prefix(topo['ray']['deployment'], name)}0"
    with running_controller(topo, drain=False) as ctl:
        entry = wait_for(lambda: _entry(ctl, name, "CRASH_LOOP"), 240, "the pool FAILING")
        assert entry["replica"] == replica and entry["state"] == "FAILING", entry
        # The cause, and the error the incarnations exited with.
        assert "restarted" in entry["error"] and "in a row" in entry["error"], entry
        assert missing in entry["error"], entry
        st = pipeline_status(ctl, name)
        assert st["health"] == "failing" and st["ready"] == 0 and st["ray_restarts"] >= 1, st
        events = [e for d in timeline(ctl, name) for e in d["events"]]
        assert any(e.startswith(f"Ray restarted {replica}") for e in events), events
        # `dgstream status`: exit 1, the FAILING line with the cause and the error.
        status = _status_cli(c, topo, name)
        assert status.returncode == 1, status.stdout + status.stderr[-2000:]
        assert f"FAILING {replica}: CRASH_LOOP: restarted" in status.stdout, status.stdout
        assert missing in status.stdout, status.stdout
        # The metrics: the controller's gauge for that cause.
        wait_for(
            lambda: _series("ray_dgstream_failing", pipeline=name, cause="CRASH_LOOP") == [1.0],
            90,
            "dgstream_failing{cause=CRASH_LOOP} at 1",
        )
        # The dashboard's actor state: the controller took the replica out of Ray's
        # immediate restarts, DEAD with the loop as its exit detail, then restarted it
        # after its backoff.
        try:
            causes = wait_for(lambda: _dead_with_loop(c, replica), 120, "a DEAD replica")
        except BaseException:
            from ray.util.state import list_actors

            for a in list_actors(
                address=c.address, filters=[("name", "=", replica)], detail=True, timeout=30
            ):
                print("ACTOR", a.state, a.num_restarts, str(a.death_cause)[:800])
            raise
        assert missing in causes[0], causes
        wait_for(
            lambda: any("restarts in" in e for d in timeline(ctl, name) for e in d["events"]),
            120,
            "a restart on the controller's backoff",
        )

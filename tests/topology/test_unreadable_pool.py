"""A pool whose input holds a batch no worker can read (its bytes damaged in the log
segment: it fails its CRC), on a real broker and a real Ray cluster with its dashboard:
the controller restarts the replica with a backoff that doubles up to its cap (no crash
loop); `dgstream status` shows the pipeline failing with the cause and exits 1; the
controller's metrics carry the cause; the Ray dashboard's actor state shows the ended
replica DEAD with the cause. The offset stays at the batch and nothing is dead-lettered.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from cli_runner import run_cli
from support import segments

from bench.harness.ray_cluster import pipeline_status, ray_cluster, running_controller, timeline
from bench.harness.spike import pipeline_io, request_value, topology, unique
from bench.harness.waiting import wait_for
from dgstream.infra.kafka.broker import BrokerInfo
from dgstream.workers.hosting.actor import replica_prefix
from dgstream.workers.kafka.admin import ensure_topics
from dgstream.workers.kafka.settings import KafkaConnection

pytestmark = [pytest.mark.broker, pytest.mark.ray, pytest.mark.slow]

BEFORE, INSIDE = 3, 4
BACKOFF = {"initial_backoff_s": 1, "max_backoff_s": 2, "reset_after_s": 60}


@pytest.fixture(scope="module")
def dashboard_cluster() -> Iterator[Any]:
    with ray_cluster([{"num_cpus": 2}], dashboard=True) as c:
        yield c


def _produce_and_corrupt(conn: KafkaConnection, topo: dict[str, Any], data_dir: str) -> str:
    from kafka import KafkaProducer

    p = topo["pipelines"][0]
    topic = p["input_topics"][0]
    ensure_topics(conn, {topic: 1, p["output_topic"]: 1, p["dead_letter_topic"]: 1})
    single = KafkaProducer(**conn.client_kwargs(), acks="all", linger_ms=0)
    batched = KafkaProducer(**conn.client_kwargs(), acks="all", linger_ms=1000)
    try:
        for i in range(BEFORE):
            single.send(topic, key=f"b{i}".encode(), value=request_value(f"b{i}", i)).get(60)
        futures = [
            batched.send(topic, key=f"x{i}".encode(), value=request_value(f"x{i}", i))
            for i in range(INSIDE)
        ]
        batched.flush(60)
        for f in futures:
            f.get(60)
    finally:
        single.close()
        batched.close()
    (bad,) = [b for b in segments.batches(data_dir, topic, 0) if b.base_offset == BEFORE]
    assert bad.last_offset == BEFORE + INSIDE - 1
    segments.corrupt(bad)
    return topic


def _failing(ctl: Any, name: str, failures: int) -> dict[str, Any] | None:
    st = pipeline_status(ctl, name)
    f = st["failing"]
    return st if f and f[0]["cause"] == "CORRUPT_BATCH" and f[0]["failures"] >= failures else None


def _metrics_text(cluster: Any) -> str:
    import ray

    texts = []
    for node in ray.nodes():
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {cluster.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            texts.append(resp.read().decode())
    return "\n".join(texts)


def _failing_gauge(cluster: Any, name: str) -> float | None:
    for line in _metrics_text(cluster).splitlines():
        if (
            line.startswith("ray_dgstream_failing{")
            and f'pipeline="{name}"' in line
            and 'cause="CORRUPT_BATCH"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return None


def _dead_with_cause(cluster: Any, name: str) -> list[str]:
    from ray.util.state import list_actors

    actors = list_actors(
        address=cluster.address, filters=[("name", "=", name)], detail=True, timeout=30
    )
    out = []
    for a in actors:
        context = (a.death_cause or {}).get("actor_died_error_context") or {}
        if a.state == "DEAD" and "CORRUPT_BATCH" in str(context.get("error_message", "")):
            out.append(str(context["error_message"]))
    return out


def test_an_unreadable_batch_fails_the_pool_loudly_with_backoff(
    dashboard_cluster: Any, kafka_connection: KafkaConnection, kafka_broker: BrokerInfo
) -> None:
    c = dashboard_cluster
    name = unique("unread")
    topo = topology(
        list(kafka_connection.bootstrap_servers),
        name,
        partitions=1,
        min_replicas=1,
        max_replicas=1,
        gpus=0,
        cpus=0.5,
        poll_s=1.0,
        cost_per_read_s=0.0,
    )
    topo["pipelines"][0]["restarts"] = BACKOFF
    topic = _produce_and_corrupt(kafka_connection, topo, kafka_broker.nodes[0].data_dir)
    io = pipeline_io(kafka_connection, topo)
    replica = f"{replica_prefix(topo['ray']['deployment'], name)}0"
    with running_controller(topo, drain=False) as ctl:
        # Failure 4 in a row: its pause is the cap, as the 3rd's was.
        st = wait_for(lambda: _failing(ctl, name, 4), 180, "four failures in a row")
        f = st["failing"][0]
        assert f["replica"] == replica and f"{topic}/0@{BEFORE}" in f["error"], f
        pauses = [
            (int(m[2]), float(m[1]))
            for d in timeline(ctl, name)
            for e in d["events"]
            if (m := re.search(r"restarts in (\d+) s \(failure (\d+) in a row", e))
        ]
        # The first restart is at once (no event); then 1, 2, 2 s (the cap).
        assert [p for n, p in sorted(set(pauses)) if n <= 4] == [1, 2, 2], pauses
        # `dgstream status`: the pipeline failing, the cause, exit status 1.
        ray_args = ["--address", c.address, "--namespace", topo["ray"]["namespace"]]
        status = run_cli("status", *ray_args, "--deployment", name, timeout=180)
        assert status.returncode == 1, status.stdout + status.stderr[-2000:]
        assert "FAILING" in status.stdout and "CORRUPT_BATCH" in status.stdout, status.stdout
        # The metrics: the controller's gauge for that cause.
        wait_for(lambda: _failing_gauge(c, name) == 1.0, 90, "dgstream_failing at 1")
        # The dashboard's actor state: the replica ended DEAD, with the cause.
        causes = wait_for(lambda: _dead_with_cause(c, replica), 60, "a DEAD replica")
        assert f"{topic}/0@{BEFORE}" in causes[0], causes
        # Nothing skipped, nothing dead-lettered: the offset stays at the batch.
        assert io.committed() == {0: BEFORE}
        out, dead = io.reader(), io.reader(io.dead)
        out.read_to_end()
        dead.read_to_end()
        assert sorted(out.keys()) == [f"b{i}" for i in range(BEFORE)]
        assert dead.records == []
        for r in io.readers:
            r.close()

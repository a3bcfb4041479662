"""The controller on a three-node Ray cluster on this machine (`ray.cluster_utils.Cluster`,
each node declaring one fake GPU and a custom resource naming it; token authentication on):
one worker per GPU over all nodes; short of GPUs, it asks Ray's autoscaler for them; a
worker killed for good is replaced; `dgstream run --detach` starts the controller and
`dgstream status --json` reads it; its Ray metrics reach the metrics agent; a controller
that crashes comes back and adopts its workers.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_runner import run_cli

from bench.harness.ray_cluster import pipeline_status, running_controller, timeline
from bench.harness.spike import pipeline_io, request_value, topology, unique
from bench.harness.waiting import wait_for
from dgstream.workers.hosting.actor import replica_prefix
from dgstream.workers.kafka.settings import KafkaConnection

pytestmark = [pytest.mark.broker, pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _placement(cluster: Any, prefix: str) -> dict[str, str]:
    """Alive actors named `prefix*` -> the name of the node they run on (Ray's state API)."""
    from ray.util.state import list_actors

    actors = list_actors(
        address=cluster.address, filters=[("state", "=", "ALIVE")], limit=1000, timeout=30
    )
    return {
        a.name: cluster.node_names.get(a.node_id, a.node_id)
        for a in actors
        if a.name and a.name.startswith(prefix)
    }


def _placed(cluster: Any, prefix: str, n: int) -> dict[str, str] | None:
    p = _placement(cluster, prefix)
    return p if len(p) == n else None


def _ray_resource_request() -> list[dict[str, float]]:
    """What Ray's autoscaler was asked for (`request_resources`), read back from the GCS."""
    import ray
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2():
        from ray.autoscaler.v2.sdk import get_cluster_resource_state

        gcs = ray.experimental.internal_kv.internal_kv_get_gcs_client()
        state = get_cluster_resource_state(gcs)
        return [
            dict(b.resources_bundle)
            for c in state.cluster_resource_constraints
            for r in c.resource_requests
            for b in [r.request] * r.count
        ]
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    out: list[dict[str, float]] = json.loads(raw) if raw else []
    return out


def _controller_metrics(cluster: Any, deployment: str) -> str:
    """The Prometheus text of the metrics agent on the controller's node."""
    import ray
    from ray.util.state import list_actors

    from dgstream.topology.controller import controller_name

    (actor,) = list_actors(
        address=cluster.address,
        filters=[("name", "=", controller_name(deployment)), ("state", "=", "ALIVE")],
        timeout=30,
    )
    node = next(n for n in ray.nodes() if n["NodeID"] == actor.node_id)
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {cluster.token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.read().decode())


def _with_replicas_gauge(text: str) -> str | None:
    return text if "ray_dgstream_replicas{" in text else None


def _metric(text: str, metric: str, pipeline: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(metric + "{") and f'pipeline="{pipeline}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _adopted(ctl: Any, name: str) -> dict[str, Any] | None:
    try:
        st = pipeline_status(ctl, name)
        events = [e for d in timeline(ctl, name) for e in d["events"]]
    except Exception:  # the actor is restarting
        return None
    adopted = sum(1 for e in events if e.startswith("adopted"))
    return st if adopted == 3 and st["ready"] == 3 else None


def test_one_worker_per_gpu_over_three_nodes(
    three_node_cluster: Any, kafka_connection: KafkaConnection, tmp_path: Path
) -> None:
    import ray

    c = three_node_cluster
    name = unique("nodes")
    topo = topology(
        list(kafka_connection.bootstrap_servers),
        name,
        partitions=4,
        min_replicas=3,
        max_replicas=4,
        target_lag=50,
        cost_per_read_s=0.2,
    )
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    ns = topo["ray"]["namespace"]
    prefix = replica_prefix(topo["ray"]["deployment"], name)
    # `dgstream run --detach` starts the controller (deployment and namespace from the
    # file); `running_controller` finds it by name and removes it at the end.
    run = run_cli("run", str(path), "--detach", "--address", c.address, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    with running_controller(topo, drain=False) as ctl:
        # The topics, as the spec asks; one worker per GPU, over all three nodes.
        wait_for(lambda: pipeline_status(ctl, name)["ready"] == 3, 180, "3 workers running")
        assert pipeline_status(ctl, name)["partitions"] == 4
        placed = wait_for(lambda: _placed(c, prefix, 3), 60, "3 actors in the state API")
        assert sorted(placed.values()) == ["node-a", "node-b", "node-c"], placed

        # A backlog that wants 4 replicas on a cluster of 3 GPUs: capped, and Ray's
        # autoscaler is asked for the 4th.
        pipeline_io(kafka_connection, topo).produce([request_value(f"n{i}", i) for i in range(600)])
        st = wait_for(
            lambda: (s := pipeline_status(ctl, name))["resource_request"] and s,
            60,
            "a resource request",
        )
        assert len(st["resource_request"]) == 4, st["resource_request"]
        assert all(b["GPU"] == 1 for b in st["resource_request"])
        assert st["replicas"] == 3
        assert any("capped at 3 by gpus" in d["reason"] for d in timeline(ctl, name))
        asked = wait_for(lambda: _ray_resource_request(), 30, "the request in the GCS")
        assert sum(1 for b in asked if b.get("GPU") == 1) == 4, asked

        # A worker killed for good is replaced (same name), again one per node.
        victim = ray.get_actor(f"{prefix}1", namespace=ns)
        before = ray.get(victim.status.remote(), timeout=60)["actor_id"]
        ray.kill(victim, no_restart=True)
        st = wait_for(
            lambda: (s := pipeline_status(ctl, name))["restarts"] == 1 and s["ready"] == 3 and s,
            180,
            "the dead worker replaced",
            every_s=0.5,
        )
        after = ray.get(ray.get_actor(f"{prefix}1", namespace=ns).status.remote(), timeout=60)
        assert after["actor_id"] != before
        assert any("restarted" in e for d in timeline(ctl, name) for e in d["events"]), (
            "no restart event recorded"
        )
        placed = wait_for(lambda: _placed(c, prefix, 3), 60, "3 actors in the state API")
        assert sorted(placed.values()) == ["node-a", "node-b", "node-c"], placed

        # `dgstream status --json`: deployment and namespace from the topology file,
        # the address of this cluster.
        proc = run_cli(
            "status", "--json", "--topology", str(path), "--address", c.address, timeout=180
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout)
        p = report["pipelines"][name]
        assert p["replicas"] == 3 and p["restarts"] == 1, p
        assert p["lag"] is not None and p["decisions"], p
        assert {"time", "replicas", "lag", "throughput_per_s", "reason"} <= set(p["decisions"][-1])
        assert sorted(p["workers"]) == sorted(placed)
        print("\n[three-node] " + json.dumps({"placement": placed, "status": p["decisions"][-1]}))
        # Ray metrics: the controller's gauges, on its node's metrics agent.
        text = wait_for(
            lambda: _with_replicas_gauge(_controller_metrics(c, name)),
            60,
            "the controller's metrics",
            every_s=1.0,
        )
        assert _metric(text, "ray_dgstream_replicas", name) == 3, text[-2000:]
        assert _metric(text, "ray_dgstream_lag_known", name) == 1
        assert _metric(text, "ray_dgstream_group_lag", name) is not None
        # A controller that crashes comes back (Ray restarts it) and adopts the workers
        # running under its names, rather than failing on them or starting others.
        workers = sorted(pipeline_status(ctl, name)["workers"])
        ray.kill(ctl, no_restart=False)
        back = wait_for(lambda: _adopted(ctl, name), 120, "the controller back, adopting")
        assert sorted(back["workers"]) == workers and back["restarts"] == 0, back
        # A deployment that is not running: exit status 3.
        missing = run_cli(
            "status", "--address", c.address, "--namespace", ns, "--deployment", "nope", timeout=180
        )
        assert missing.returncode == 3, missing.stderr[-2000:]
        # Token authentication is on: a client with another token is refused.
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        assert is_token_auth_enabled()
        # RAY_AUTH_MODE and RAY_AUTH_TOKEN are the test cluster's; a wrong token here.
        refused = run_cli(
            "status", "--address", c.address, env={"RAY_AUTH_TOKEN": "0" * 64}, timeout=180
        )
        assert refused.returncode == 2 and "cannot connect" in refused.stderr, refused.stderr
        # Ray's request is withdrawn when the controller shuts down.
    assert _ray_resource_request() == []

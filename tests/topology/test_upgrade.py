"""The upgrade recipe of docs/operations.md, as written, with real `dgstream run`
subprocesses on a Ray cluster of our own and the session broker: the old deployment runs;
the same pipeline (same topics, group and Ray namespace) under a new `ray.deployment` is
started beside it; the old `dgstream run` is stopped with SIGTERM.

Each controller holds its own replicas only (`dgstream-<deployment>.<pipeline>-<n>`): both
pools run side by side, the old one drains and leaves, the new one keeps serving,
untouched. A crashed controller of the new deployment comes back and adopts its own
replicas, not the old one's. Under exactly-once, read committed, every request sent
before, during and after is answered exactly once, and after the stop only the new
deployment answers. At the end `dgstream stop` drains the new one, and the `dgstream run`
watching it exits by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_runner import run_cli

from bench.harness.pipeline import count_duplicates
from bench.harness.ray_cluster import kill_workers, pipeline_status, timeline
from bench.harness.spike import pipeline_io, request_value, topology, unique
from bench.harness.waiting import wait_for
from dgstream.workers.hosting.actor import replica_prefix
from dgstream.workers.kafka.settings import KafkaConnection

pytestmark = [pytest.mark.broker, pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
REPLICAS = 2
BATCH = 150


def _controller(topo: dict[str, Any]) -> Any:
    import ray

    from dgstream.topology.controller import controller_name

    try:
        return ray.get_actor(controller_name(topo["ray"]["deployment"]), topo["ray"]["namespace"])
    except ValueError:
        return None


def _run(path: Path, address: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "dgstream.topology.cli", "run", str(path), "--address", address]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [*cmd, "--interval", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _ready(topo: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The pipeline's status once its controller answers with the whole pool running."""
    ctl = _controller(topo)
    if ctl is None:
        return None
    try:
        st = pipeline_status(ctl, name)
    except Exception:  # starting, or restarting after a crash
        return None
    return st if st["ready"] == REPLICAS else None


def _adopting(topo: dict[str, Any], name: str) -> tuple[dict[str, Any], list[str]] | None:
    """A restarted controller's status and the replicas it adopted, once it has adopted
    some and its pool is running (a fresh incarnation's timeline starts empty)."""
    st = _ready(topo, name)
    if st is None:
        return None
    try:
        records = timeline(_controller(topo), name)
    except Exception:
        return None
    adopted = sorted(e.split()[1] for d in records for e in d["events"] if e.startswith("adopted"))
    return (st, adopted) if adopted else None


def _named(namespace: str, prefix: str) -> list[str]:
    import ray

    return sorted(
        e["name"]
        for e in ray.util.list_named_actors(all_namespaces=True)
        if e["namespace"] == namespace and e["name"].startswith(prefix)
    )


def _stop(proc: subprocess.Popen[bytes]) -> str:
    """SIGTERM, as Kubernetes, systemd and docker stop a process; its stderr."""
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return err.decode(errors="replace")


def test_new_deployment_beside_the_old_then_the_old_stopped(
    gpu_cluster: Any, kafka_connection: KafkaConnection, tmp_path: Path
) -> None:
    import ray

    name = unique("upgrade")
    topos: dict[str, dict[str, Any]] = {}
    for version in ("v1", "v2"):
        topo = topology(
            list(kafka_connection.bootstrap_servers),
            name,
            deployment=f"{name}-{version}",
            partitions=4,
            min_replicas=REPLICAS,
            max_replicas=REPLICAS,
            cost_per_read_s=0.01,
            target_lag=100_000,  # the size stays at min = max
        )
        topo["pipelines"][0]["delivery"] = "exactly_once"
        (tmp_path / f"{version}.yaml").write_text(yaml.safe_dump(topo))
        topos[version] = topo
    old, new = topos["v1"], topos["v2"]
    ns = old["ray"]["namespace"]
    assert new["ray"]["namespace"] == ns  # one namespace: the recipe needs no other
    old_prefix = replica_prefix(old["ray"]["deployment"], name)
    new_prefix = replica_prefix(new["ray"]["deployment"], name)
    io = pipeline_io(kafka_connection, old)
    reader = io.reader(read_committed=True)
    sent: list[str] = []

    def send(tag: str) -> list[str]:
        ids = [f"{tag}{i}" for i in range(BATCH)]
        io.produce(
            [request_value(rid, i) for i, rid in enumerate(ids)], keys=[r.encode() for r in ids]
        )
        sent.extend(ids)
        reader.read_until(lambda r: set(r.keys()) >= set(sent), 180, f"batch {tag} answered")
        return ids

    procs = {"v1": _run(tmp_path / "v1.yaml", gpu_cluster.address)}
    try:
        # 1. The old deployment serves.
        wait_for(lambda: _ready(old, name), 180, "the old pool", every_s=0.5)
        send("a")
        # 2. The new one beside it: its own replicas, the old pool untouched.
        procs["v2"] = _run(tmp_path / "v2.yaml", gpu_cluster.address)
        st_new = wait_for(lambda: _ready(new, name), 180, "the new pool", every_s=0.5)
        st_old = _ready(old, name)
        assert st_old is not None, pipeline_status(_controller(old), name)
        assert sorted(st_new["workers"]) == [f"{new_prefix}{i}" for i in range(REPLICAS)]
        assert sorted(st_old["workers"]) == [f"{old_prefix}{i}" for i in range(REPLICAS)]
        events = [e for d in timeline(_controller(new), name) for e in d["events"]]
        assert not [e for e in events if e.startswith("adopted")], events
        wait_for(lambda: io.members() == 2 * REPLICAS, 60, "both pools in the group")
        send("b")
        # 3. The new controller crashes: Ray restarts it; it adopts its own replicas only.
        ray.kill(_controller(new), no_restart=False)
        back = wait_for(lambda: _adopting(new, name), 120, "the new controller back, adopting")
        st_back, adopted = back
        assert adopted == st_new["workers"] and st_back["restarts"] == 0, back
        assert procs["v2"].poll() is None  # its `dgstream run` kept watching
        # 4. The old `dgstream run` stopped: its pool drains and leaves; the new one stays.
        err = _stop(procs.pop("v1"))
        assert "stopping: draining workers" in err and "Traceback" not in err, err[-3000:]
        assert _controller(old) is None
        assert _named(ns, old_prefix) == []
        wait_for(lambda: io.members() == REPLICAS, 60, "only the new pool in the group")
        after = _ready(new, name)
        assert after is not None and after["restarts"] == 0, after
        assert sorted(after["workers"]) == st_new["workers"]
        # 5. The new deployment serves alone.
        late = set(send("c"))
        # 6. `dgstream stop` (for a controller whose `dgstream run` is elsewhere, or
        # detached) drains it; the `dgstream run` watching it ends by itself.
        out = run_cli(
            "stop",
            "--topology",
            str(tmp_path / "v2.yaml"),
            "--address",
            gpu_cluster.address,
            timeout=400,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.startswith(f"stopped {new['ray']['deployment']} (")
        _, err = procs.pop("v2").communicate(timeout=120)
        assert b"stopped from elsewhere" in err and b"Traceback" not in err, err[-3000:]
        assert _controller(new) is None and _named(ns, new_prefix) == []
        assert io.members() == 0
    finally:
        stopped = {v: _stop(p) for v, p in procs.items()}
        for prefix in (old_prefix, new_prefix):
            kill_workers(ns, prefix)
    assert not stopped, {v: e[-2000:] for v, e in stopped.items()}
    # Every request answered exactly once (exactly-once, read committed), none dead-lettered.
    reader.read_to_end()
    keys = reader.keys()
    assert set(keys) == set(sent) and count_duplicates(keys) == 0, count_duplicates(keys)
    workers = {}
    for rec in reader.records:
        workers[rec.key.decode()] = dict(rec.headers)["worker"].decode()
    assert {workers[k] for k in late} <= {p.removeprefix("dgstream-") for p in st_new["workers"]}
    answered_by = {w.split(".")[0] for w in workers.values()}
    assert answered_by == {old["ray"]["deployment"], new["ray"]["deployment"]}, answered_by
    dead = io.reader(io.dead)
    dead.read_to_end()
    assert dead.records == [], [json.loads(r.value)["error"] for r in dead.records]
    for r in io.readers:
        r.close()

"""`dgstream run` stopped by a signal, as a real subprocess on a Ray cluster of our own and
the session broker: SIGTERM (how Kubernetes, systemd and docker stop a process) drains the
workers exactly as Ctrl-C (SIGINT) does, and the command exits 0 without a traceback. What
the group committed was answered; the group is empty; the controller is gone."""

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

from bench.harness.ray_cluster import pipeline_status
from bench.harness.spike import pipeline_io, request_value, topology, unique
from bench.harness.waiting import wait_for
from dgstream.workers.kafka.settings import KafkaConnection

pytestmark = [pytest.mark.broker, pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _controller(topo: dict[str, Any]) -> Any:
    import ray

    from dgstream.topology.controller import controller_name

    try:
        return ray.get_actor(controller_name(topo["ray"]["deployment"]), topo["ray"]["namespace"])
    except ValueError:
        return None


def _answered_below_committed(io: Any) -> tuple[int, int]:
    """(records below the group's committed offsets, how many of them were answered)."""
    from kafka import KafkaConsumer, TopicPartition

    committed = io.committed()
    reader = io.reader()
    reader.read_to_end()
    answered = set(reader.keys())
    c = KafkaConsumer(**io.conn.client_kwargs(client_id="check"), enable_auto_commit=False)
    try:
        below: list[str] = []
        for p, end in committed.items():
            tp = TopicPartition(io.input, p)
            c.assign([tp])
            c.seek_to_beginning(tp)
            while c.position(tp) < end:
                for recs in c.poll(timeout_ms=500).values():
                    below += [json.loads(r.value)["id"] for r in recs if r.offset < end]
        return len(below), len(set(below) & answered)
    finally:
        c.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_run_drains_and_exits_0_when_stopped(
    gpu_cluster: Any, kafka_connection: KafkaConnection, tmp_path: Path, sig: signal.Signals
) -> None:
    name = unique("signal")
    topo = topology(
        list(kafka_connection.bootstrap_servers),
        name,
        partitions=2,
        min_replicas=1,
        max_replicas=1,
        cost_per_read_s=0.02,
    )
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    cmd = [sys.executable, "-m", "dgstream.topology.cli", "run", str(path), "--address"]
    cmd += [gpu_cluster.address, "--interval", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Started as a shell starts a background job, SIGINT ignored: Ctrl-C must work anyway.
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        ctl = wait_for(lambda: _controller(topo), 120, "the controller", every_s=0.5)
        wait_for(lambda: pipeline_status(ctl, name)["ready"] == 1, 180, "a worker running")
        io = pipeline_io(kafka_connection, topo)
        io.produce([request_value(f"s{i}", i) for i in range(300)])
        io.reader().read_until(lambda r: len(r.records) >= 20, 120, "the first results")
        proc.send_signal(sig)  # mid-run: batches in flight
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    text = err.decode(errors="replace")
    print("\n" + text[-1500:])
    assert proc.returncode == 0, text[-3000:]
    assert "stopping: draining workers" in text and "stopped" in text
    assert "Traceback" not in text
    assert _controller(topo) is None  # removed
    assert io.members() == 0  # the worker left the group (drained, not killed)
    try:
        below, answered = _answered_below_committed(io)
    finally:
        for r in io.readers:
            r.close()
    print(f"committed {below} records, {answered} of them answered")
    assert below >= 20 and answered == below  # nothing committed unanswered

"""Operators' view: the Ray dashboard's HTTP API lists the worker actors by pipeline and
replica, and the metrics endpoint carries the project's metrics (real Ray, real broker)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dgstream.workers.kafka.settings import KafkaConnection

pytestmark = [pytest.mark.ray, pytest.mark.broker, pytest.mark.slow]

PROBE = Path(__file__).with_name("dashboard_probe.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dashboard_lists_workers_and_metrics(
    kafka_connection: KafkaConnection, unique_name: Callable[[str], str]
) -> None:
    from dgstream.workers.kafka.admin import ensure_topics

    inp, out, dead, group = (unique_name(x) for x in ("in", "out", "dlq", "g"))
    ensure_topics(kafka_connection, {inp: 2, out: 1, dead: 1})
    # A process of its own: Ray reads its authentication mode at import time.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    port = _free_port()
    proc = subprocess.run(
        [
            sys.executable,
            str(PROBE),
            kafka_connection.bootstrap_servers[0],
            inp,
            out,
            dead,
            group,
            str(port),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(line[len("REPORT ") :])
    assert report["dashboard"].startswith("127.0.0.1:")
    names = {a["name"] for a in report["actors"]}
    assert "dgstream-default.probe-0" in names, report["actors"]
    for metric in (
        "ray_dgstream_consumed_total",
        "ray_dgstream_answered_total",
        "ray_dgstream_batches_total",
        "ray_dgstream_engine_latency_seconds_bucket",
    ):
        assert metric in report["metrics"], report["metrics"]
    assert 'pipeline="probe"' in report["answered_line"]

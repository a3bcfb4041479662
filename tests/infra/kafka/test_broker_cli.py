"""`dgstream broker status --json` as a subprocess, through the installed console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dgstream.infra.kafka.broker import BrokerInfo

REPO = Path(__file__).resolve().parents[3]


def _dgstream() -> list[str]:
    script = Path(sys.executable).with_name("dgstream")
    if script.is_file():
        return [str(script)]
    found = shutil.which("dgstream")
    return [found] if found else [sys.executable, "-m", "dgstream.topology.cli"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DGSTREAM_KAFKA_HOME"}
    return subprocess.run(
        [*_dgstream(), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.broker
def test_status_json_of_running_broker(kafka_broker: BrokerInfo) -> None:
    out = _run("broker", "status", "--json", "--home", kafka_broker.home)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["running"] is True
    assert st["answers_metadata"] is True
    assert st["bootstrap"] == kafka_broker.bootstrap
    assert st["pid"] == kafka_broker.pid


@pytest.mark.unit
def test_status_json_when_not_running(tmp_path: Path) -> None:
    out = _run("broker", "status", "--json", "--home", str(tmp_path))
    assert out.returncode == 3, out.stderr
    assert json.loads(out.stdout) == {
        "running": False,
        "answers_metadata": False,
        "home": str(tmp_path.resolve()),
    }
    text = _run("broker", "status", "--home", str(tmp_path))
    assert text.returncode == 3
    assert "not running" in text.stdout
    stop = _run("broker", "stop", "--home", str(tmp_path))
    assert stop.returncode == 0
    assert "not running" in stop.stdout


@pytest.mark.broker
@pytest.mark.slow
def test_stop_keeps_the_data_and_start_resumes_it(tmp_path: Path) -> None:
    """`dgstream broker stop` keeps topics and records (and says so); `start` resumes them
    on the same port; `stop --delete-data` deletes them."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    from dgstream.workers.kafka.admin import ensure_topics

    home = str(tmp_path / "home")
    started = _run("broker", "start", "--port", "0", "--home", home, "--json")
    assert started.returncode == 0, started.stderr
    boot = json.loads(started.stdout)["bootstrap"]
    try:
        ensure_topics(boot, {"orders": 1})
        producer = KafkaProducer(bootstrap_servers=boot, acks="all")
        producer.send("orders", value=b"order 1").get(timeout=60)
        producer.close(timeout=10)
        stop = _run("broker", "stop", "--home", home)
        assert stop.returncode == 0 and "data is kept in" in stop.stdout, stop.stdout
        st = _run("broker", "status", "--home", home)
        assert st.returncode == 3 and "not running; its data is kept" in st.stdout, st.stdout
        again = _run("broker", "start", "--port", "0", "--home", home)
        assert again.returncode == 0, again.stderr
        assert f"started on its kept data ({home}): bootstrap servers {boot}" in again.stdout
        c = KafkaConsumer(bootstrap_servers=boot, enable_auto_commit=False)
        try:
            tp = TopicPartition("orders", 0)
            c.assign([tp])
            c.seek_to_beginning(tp)
            got: list[bytes] = []
            while c.position(tp) < 1:  # the one record kept
                got += [r.value for recs in c.poll(timeout_ms=500).values() for r in recs]
        finally:
            c.close()
        assert got == [b"order 1"]
    finally:
        gone = _run("broker", "stop", "--delete-data", "--home", home, "--json")
    assert gone.returncode == 0 and json.loads(gone.stdout)["data_kept"] is False, gone.stdout
    assert json.loads(_run("broker", "status", "--json", "--home", home).stdout) == {
        "running": False,
        "answers_metadata": False,
        "home": str(Path(home).resolve()),
    }

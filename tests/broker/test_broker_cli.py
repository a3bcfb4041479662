"""`dgstream broker status --json` as a subprocess, through the installed console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infra.kafka.broker import BrokerInfo

REPO = Path(__file__).resolve().parents[2]


def _dgstream() -> list[str]:
    script = Path(sys.executable).with_name("dgstream")
    if script.is_file():
        return [str(script)]
    found = shutil.which("dgstream")
    return [found] if found else [sys.executable, "-m", "topology.cli"]


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

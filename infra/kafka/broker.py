"""A real Apache Kafka broker (KRaft) on loopback, run from Maven Central jars.

Nothing here talks to anything but Maven Central (through `mvn`, only when the jar cache
is missing or stale) and 127.0.0.1.

* `fetch()` resolves `infra/kafka/pom.xml` (Kafka 4.x, its runtime dependencies and a
  log4j2 binding) into `<repo>/.cache/kafka/lib`. A marker file holding the pom's hash makes
  a second call a no-op that never runs Maven.
* `start()` writes a combined broker+controller `server.properties`, formats the storage with
  a fresh cluster id (`StorageTool format --standalone`), launches the JVM in its own session
  and waits until the broker answers a metadata request. `start_cluster(n)` does the same
  for `n` combined nodes with a static controller quorum, for fault tests.
* `stop()` / `status()` work from the state file `<home>/state.json`; `kill_node()` and
  `restart_node()` stop and bring back one node of a running cluster, `freeze_node()`
  SIGSTOPs (and thaws) one. `stop()` keeps the data (topics, offsets, the cluster id)
  unless told to delete it, and the next `start()` resumes it on the same ports; a start
  with `overrides` (or `start_secure`) formats afresh.

The state directory ("home") defaults to `<repo>/.cache/kafka/run`; `DGSTREAM_KAFKA_HOME`
or the `home` argument overrides it. `DGSTREAM_KAFKA_LIB` overrides the jar cache;
`DGSTREAM_KAFKA_HEAP_OPTS` (default "-Xms128m -Xmx512m") and `DGSTREAM_KAFKA_JVM_OPTS` tune
the broker JVM.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BrokerError",
    "BrokerInfo",
    "FetchResult",
    "NodeInfo",
    "add_arguments",
    "cli",
    "default_home",
    "default_lib_dir",
    "fetch",
    "freeze_node",
    "kill_node",
    "restart_node",
    "start",
    "start_cluster",
    "start_secure",
    "status",
    "stop",
]

POM_PATH = Path(__file__).resolve().with_name("pom.xml")
REPO_ROOT = Path(__file__).resolve().parents[2]
HOME_ENV = "DGSTREAM_KAFKA_HOME"
LIB_ENV = "DGSTREAM_KAFKA_LIB"
HEAP_ENV = "DGSTREAM_KAFKA_HEAP_OPTS"
JVM_OPTS_ENV = "DGSTREAM_KAFKA_JVM_OPTS"
MARKER_NAME = ".dgstream-fetch.json"
STATE_NAME = "state.json"
DEFAULT_CLIENT_PORT = 9092
LOOPBACK = "127.0.0.1"
KAFKA_MAIN = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"

_LOG4J2 = """\
# Written by dgstream (infra/kafka/broker.py); the JVM's stdout goes to the node's kafka.log.
status = warn
appender.stdout.type = Console
appender.stdout.name = STDOUT
appender.stdout.layout.type = PatternLayout
appender.stdout.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
logger.clients.name = org.apache.kafka.clients
logger.clients.level = WARN
"""

# Popen handles of the JVMs this process launched, so that they are reaped (not left as
# zombies that still answer `kill -0`) once they exit.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class BrokerError(RuntimeError):
    """The broker could not be fetched, started, stopped or reached."""


@dataclass(frozen=True)
class FetchResult:
    lib_dir: Path
    fetched: bool  # False: the cache was already complete and Maven was not run
    seconds: float
    jars: int


@dataclass
class NodeInfo:
    node_id: int
    client_port: int
    controller_port: int
    pid: int
    node_dir: str
    data_dir: str
    log_file: str
    properties: str
    # Listeners beside PLAINTEXT and CONTROLLER (`start_secure`): name -> port.
    listeners: dict[str, int] = field(default_factory=dict)

    @property
    def bootstrap(self) -> str:
        return f"{LOOPBACK}:{self.client_port}"


@dataclass
class BrokerInfo:
    """What `start()` returns and what the state file holds."""

    home: str
    cluster_id: str
    nodes: list[NodeInfo]
    started_at: float  # epoch seconds
    start_seconds: float  # JVM launch until the cluster answered a metadata request
    total_seconds: float  # including fetch check, storage format and port picking
    lib_dir: str
    standalone: bool  # single node with a dynamic (--standalone) controller quorum
    reused: bool = False  # True when `start()` found it already running
    resumed: bool = False  # True when `start()` relaunched it on its kept data
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def bootstrap_servers(self) -> list[str]:
        return [n.bootstrap for n in self.nodes]

    @property
    def bootstrap(self) -> str:
        return ",".join(self.bootstrap_servers)

    @property
    def pid(self) -> int:
        return self.nodes[0].pid

    def listener_bootstrap(self, name: str) -> str:
        """The bootstrap servers of one of the extra listeners (`SASL_SSL`, `SSL`)."""
        return ",".join(f"{LOOPBACK}:{n.listeners[name]}" for n in self.nodes)

    def node(self, node_id: int) -> NodeInfo:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise BrokerError(f"no node {node_id} in {self.home}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bootstrap"] = self.bootstrap
        d["bootstrap_servers"] = self.bootstrap_servers
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BrokerInfo:
        return cls(
            home=str(d["home"]),
            cluster_id=str(d["cluster_id"]),
            nodes=[NodeInfo(**n) for n in d["nodes"]],
            started_at=float(d["started_at"]),
            start_seconds=float(d["start_seconds"]),
            total_seconds=float(d.get("total_seconds", d["start_seconds"])),
            lib_dir=str(d["lib_dir"]),
            standalone=bool(d.get("standalone", len(d["nodes"]) == 1)),
            reused=bool(d.get("reused", False)),
            resumed=bool(d.get("resumed", False)),
            extra={str(k): str(v) for k, v in dict(d.get("extra", {})).items()},
        )


# --------------------------------------------------------------------------- paths


def default_home() -> Path:
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".cache" / "kafka" / "run"


def default_lib_dir() -> Path:
    env = os.environ.get(LIB_ENV)
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".cache" / "kafka" / "lib"


def _home(home: str | os.PathLike[str] | None) -> Path:
    return Path(home).expanduser().resolve() if home is not None else default_home()


def _lib(lib_dir: str | os.PathLike[str] | None) -> Path:
    return Path(lib_dir).expanduser().resolve() if lib_dir is not None else default_lib_dir()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock across processes (parallel test runs, two CLIs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------- fetch


def _pom_hash(pom: Path) -> str:
    return hashlib.sha256(pom.read_bytes()).hexdigest()


def marker_path(lib_dir: str | os.PathLike[str] | None = None) -> Path:
    return _lib(lib_dir) / MARKER_NAME


def _cache_complete(lib: Path, pom_hash: str) -> int:
    """The number of cached jars when the cache matches the pom, else 0."""
    try:
        marker = json.loads((lib / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return 0
    if not isinstance(marker, dict) or marker.get("pom_sha256") != pom_hash:
        return 0
    jars = marker.get("jars")
    if not isinstance(jars, list) or not jars:
        return 0
    if not all((lib / str(j)).is_file() for j in jars):
        return 0
    return len(jars)


def fetch(
    lib_dir: str | os.PathLike[str] | None = None,
    *,
    pom: str | os.PathLike[str] | None = None,
    force: bool = False,
    timeout_s: float = 1200.0,
) -> FetchResult:
    """Resolve the broker's jars into `lib_dir` with Maven, unless already there.

    When the marker file matches the pom's hash and every jar it lists exists, this returns
    at once without running Maven (no network).
    """
    t0 = time.monotonic()
    lib = _lib(lib_dir)
    pom_file = Path(pom).resolve() if pom is not None else POM_PATH
    digest = _pom_hash(pom_file)
    if not force and (n := _cache_complete(lib, digest)):
        return FetchResult(lib, False, time.monotonic() - t0, n)
    with _locked(lib.parent / ".fetch.lock"):
        if not force and (n := _cache_complete(lib, digest)):  # another process did it
            return FetchResult(lib, False, time.monotonic() - t0, n)
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerError(
                "Apache Maven (`mvn`) is needed once to fetch Kafka's jars from Maven Central "
                f"into {lib}; install it (and Java 17+) or point {LIB_ENV} at a filled cache"
            )
        staging = Path(tempfile.mkdtemp(prefix=".lib-staging-", dir=lib.parent))
        try:
            cmd = [
                mvn,
                "-q",
                "-B",
                "-f",
                str(pom_file),
                "dependency:copy-dependencies",
                f"-DoutputDirectory={staging}",
                "-DincludeScope=runtime",
            ]
            try:
                proc = subprocess.run(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                raise BrokerError(f"mvn did not finish within {timeout_s:.0f}s") from exc
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
                raise BrokerError(
                    f"mvn exited with {proc.returncode} fetching Kafka's jars:\n" + "\n".join(tail)
                )
            jars = sorted(p.name for p in staging.glob("*.jar"))
            if not any(j.startswith("kafka_2.13-") for j in jars):
                raise BrokerError(f"mvn ran but no kafka_2.13 jar appeared in {staging}")
            marker = {"pom_sha256": digest, "jars": jars, "fetched_at": time.time()}
            (staging / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
            if lib.exists():
                old = lib.with_name(f".lib-old-{os.getpid()}")
                os.replace(lib, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(staging, lib)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return FetchResult(lib, True, time.monotonic() - t0, len(jars))


# --------------------------------------------------------------------------- helpers


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file():
            return str(candidate)
    java = shutil.which("java")
    if java is None:
        raise BrokerError("a Java runtime (17+) is needed to run the Kafka broker")
    return java


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
    return port


def _pick_ports(count: int, taken: set[int]) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        p = _free_port()
        if p not in taken and p not in ports:
            ports.append(p)
    return ports


def _tcp_open(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout):
            return True
    except OSError:
        return False


def _new_cluster_id() -> str:
    """A Kafka Uuid string (URL-safe base64 of 16 random bytes, no padding)."""
    while True:
        s = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not s.startswith("-"):  # as Kafka's Uuid.randomUuid: never looks like an option
            return s


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


def _alive(pid: int) -> bool:
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


def _is_our_jvm(pid: int, node: NodeInfo) -> bool:
    """Guard against signalling a recycled pid: it must be a kafka.Kafka JVM on our config."""
    if not _alive(pid):
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


def _properties(
    node: NodeInfo,
    *,
    voters: list[NodeInfo],
    standalone: bool,
    replication: int,
    overrides: dict[str, str] | None,
) -> str:
    n = len(voters)
    min_isr = max(1, min(2, replication - 1)) if replication > 1 else 1
    ports = {"PLAINTEXT": node.client_port, "CONTROLLER": node.controller_port, **node.listeners}
    listeners = ",".join(f"{name}://{LOOPBACK}:{port}" for name, port in ports.items())
    protocols = {"PLAINTEXT": "PLAINTEXT", "CONTROLLER": "PLAINTEXT"} | {
        name: name
        for name in node.listeners  # extra listeners are named after their protocol
    }
    conf: dict[str, str] = {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "listeners": listeners,
        "advertised.listeners": listeners,
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": ",".join(f"{k}:{v}" for k, v in protocols.items()),
        "log.dirs": node.data_dir,
        "num.partitions": "1",
        "default.replication.factor": str(replication),
        "min.insync.replicas": str(min_isr),
        "auto.create.topics.enable": "true",
        "delete.topic.enable": "true",
        "offsets.topic.replication.factor": str(replication),
        "offsets.topic.num.partitions": str(max(1, n)),
        "transaction.state.log.replication.factor": str(replication),
        "transaction.state.log.min.isr": str(min_isr),
        "transaction.state.log.num.partitions": str(max(1, n)),
        "share.coordinator.state.topic.replication.factor": str(replication),
        "share.coordinator.state.topic.min.isr": str(min_isr),
        "group.initial.rebalance.delay.ms": "0",
        "num.network.threads": "2",
        "num.io.threads": "4",
        "log.retention.hours": "24",
    }
    if standalone:
        conf["controller.quorum.bootstrap.servers"] = f"{LOOPBACK}:{node.controller_port}"
    else:
        conf["controller.quorum.voters"] = ",".join(
            f"{v.node_id}@{LOOPBACK}:{v.controller_port}" for v in voters
        )
    if overrides:
        conf.update(overrides)
    lines = ["# Written by dgstream (infra/kafka/broker.py): a loopback-only KRaft test node."]
    lines += [f"{k}={v}" for k, v in conf.items()]
    return "\n".join(lines) + "\n"


def _format(
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


def _launch(
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


def _probe(bootstrap: list[str], timeout_s: float = 2.0) -> dict[str, Any] | None:
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


def _wait_ready(nodes: list[NodeInfo], deadline: float, expect_brokers: int) -> None:
    bootstrap = [n.bootstrap for n in nodes]
    while True:
        for n in nodes:
            if not _alive(n.pid):
                raise BrokerError(
                    f"Kafka node {n.node_id} (pid {n.pid}) exited during startup; "
                    f"last lines of {n.log_file}:\n{_log_tail(n.log_file)}"
                )
        if all(_tcp_open(n.client_port) for n in nodes):
            described = _probe(bootstrap)
            if described is not None and len(described.get("brokers", [])) >= expect_brokers:
                return
        if time.monotonic() > deadline:
            raise BrokerError(
                f"Kafka did not answer metadata requests on {','.join(bootstrap)} in time; "
                f"last lines of {nodes[0].log_file}:\n{_log_tail(nodes[0].log_file)}"
            )
        time.sleep(0.1)


def _signal_group(pid: int, sig: signal.Signals) -> None:
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


def _terminate(node: NodeInfo, timeout_s: float) -> None:
    if not _is_our_jvm(node.pid, node):
        return
    _signal_group(node.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(node.pid):
        if time.monotonic() > deadline:
            _signal_group(node.pid, signal.SIGKILL)
            kill_deadline = time.monotonic() + 10
            while _alive(node.pid) and time.monotonic() < kill_deadline:
                time.sleep(0.05)
            break
        time.sleep(0.05)


def _read_state(home: Path) -> BrokerInfo | None:
    try:
        return BrokerInfo.from_dict(json.loads((home / STATE_NAME).read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BrokerError(f"unreadable broker state file {home / STATE_NAME}: {exc}") from exc


def _write_state(info: BrokerInfo) -> None:
    d = info.to_dict()
    d.pop("reused", None)
    d.pop("resumed", None)
    _write_atomic(Path(info.home) / STATE_NAME, json.dumps(d, indent=2, sort_keys=True) + "\n")


def _running(info: BrokerInfo) -> bool:
    return all(_is_our_jvm(n.pid, n) for n in info.nodes)


# --------------------------------------------------------------------------- start / stop


def start(
    home: str | os.PathLike[str] | None = None,
    *,
    port: int | None = None,
    controller_port: int | None = None,
    lib_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 120.0,
    overrides: dict[str, str] | None = None,
    heap_opts: str | None = None,
) -> BrokerInfo:
    """Start one combined broker+controller on 127.0.0.1 (or return the running one).

    `port` is the client (PLAINTEXT) port: by default 9092 when free, else a free one; 0 is
    any free port (what tests use); an explicit port that is taken is an error. Data a
    `stop()` kept in `home` is resumed (same cluster, ports, topics and offsets; `resumed`
    is True); else, or with `overrides`, the storage is formatted afresh. `heap_opts`
    ("-Xms64m -Xmx256m") replaces $DGSTREAM_KAFKA_HEAP_OPTS for this broker, restarts
    included.
    """
    return _start(
        home,
        n=1,
        ports=[port] if port else None,
        controller_ports=[controller_port] if controller_port else None,
        prefer_default_port=port is None,
        lib_dir=lib_dir,
        timeout_s=timeout_s,
        overrides=overrides,
        standalone=True,
        replication=1,
        heap_opts=heap_opts,
    )


def start_cluster(
    n: int = 3,
    home: str | os.PathLike[str] | None = None,
    *,
    replication_factor: int | None = None,
    lib_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 180.0,
    overrides: dict[str, str] | None = None,
    heap_opts: str | None = None,
) -> BrokerInfo:
    """Start `n` combined broker+controller nodes (a controller quorum of `n`) on loopback.

    Internal topics and the default replication factor use `replication_factor` (default
    min(n, 3)), with min.insync.replicas = 2 when that is 3, so one node may die.
    `heap_opts` as for `start`, for every node.
    """
    if n < 1:
        raise ValueError("n must be at least 1")
    rf = replication_factor if replication_factor is not None else min(n, 3)
    if not 1 <= rf <= n:
        raise ValueError(f"replication_factor must be between 1 and {n}")
    return _start(
        home,
        n=n,
        ports=None,
        controller_ports=None,
        lib_dir=lib_dir,
        timeout_s=timeout_s,
        overrides=overrides,
        standalone=False,
        replication=rf,
        prefer_default_port=False,
        heap_opts=heap_opts,
    )


# The SCRAM mechanism of the secure test broker: the strongest Kafka offers.
SCRAM_MECHANISM = "SCRAM-SHA-512"
# What StorageTool's `--add-scram 'SCRAM-SHA-512=[name=...,password=...]'` parses safely
# (no quoting is needed for these characters; secrets.token_urlsafe() stays within them).
_SCRAM_SAFE = re.compile(r"^[A-Za-z0-9._~-]{1,128}$")


def start_secure(
    home: str | os.PathLike[str] | None = None,
    *,
    users: Mapping[str, str],
    lib_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 120.0,
) -> BrokerInfo:
    """One node, as `start(port=0)`, with two more listeners on 127.0.0.1 for clients:
    `SASL_SSL` (TLS, then SCRAM-SHA-512 for `users`, name -> password, stored at format
    time) and `SSL` (TLS only). Certificates come from keytool (`infra.kafka.tls`) in
    `<home>/tls`; `info.extra` holds `ca_file` and both listeners' bootstrap servers
    (`info.listener_bootstrap("SASL_SSL")`). The PLAINTEXT listener stays for the
    broker's own use (replication, the readiness probe, `status`). No password is kept in
    the state file. The storage is always formatted afresh (the users are stored then)."""
    from infra.kafka.tls import TlsError, make_certificates

    for name, password in users.items():
        if not _SCRAM_SAFE.match(name) or not _SCRAM_SAFE.match(password):
            raise ValueError(f"SCRAM user {name!r}: names and passwords must be [A-Za-z0-9._~-]+")
    h = _home(home)
    try:
        tls = make_certificates(h / "tls")
    except TlsError as exc:
        raise BrokerError(str(exc)) from exc
    pw = tls.store_password
    overrides = {
        "sasl.enabled.mechanisms": SCRAM_MECHANISM,
        f"listener.name.sasl_ssl.{SCRAM_MECHANISM.lower()}.sasl.jaas.config": (
            "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        ),
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": str(tls.keystore),
        "ssl.keystore.password": pw,
        "ssl.key.password": pw,
        "ssl.truststore.type": "PKCS12",
        "ssl.truststore.location": str(tls.truststore),
        "ssl.truststore.password": pw,
        "ssl.client.auth": "none",
    }
    scram = [
        arg
        for name, password in users.items()
        for arg in ("--add-scram", f"{SCRAM_MECHANISM}=[name={name},password={password}]")
    ]
    try:
        info = _start(
            h,
            n=1,
            ports=None,
            controller_ports=None,
            lib_dir=lib_dir,
            timeout_s=timeout_s,
            overrides=overrides,
            standalone=True,
            replication=1,
            prefer_default_port=False,
            extra_listeners=("SASL_SSL", "SSL"),
            format_args=scram,
        )
    except BrokerError as exc:  # a storage tool error may quote its arguments
        text = str(exc)
        for password in users.values():
            text = text.replace(password, "**********")
        raise BrokerError(text) from None
    info.extra.update(
        ca_file=str(tls.ca_pem),
        sasl_ssl_bootstrap=info.listener_bootstrap("SASL_SSL"),
        ssl_bootstrap=info.listener_bootstrap("SSL"),
    )
    _write_state(info)
    return info


def _start(
    home_arg: str | os.PathLike[str] | None,
    *,
    n: int,
    ports: list[int] | None,
    controller_ports: list[int] | None,
    lib_dir: str | os.PathLike[str] | None,
    timeout_s: float,
    overrides: dict[str, str] | None,
    standalone: bool,
    replication: int,
    prefer_default_port: bool,
    extra_listeners: Sequence[str] = (),
    format_args: Sequence[str] = (),
    heap_opts: str | None = None,
) -> BrokerInfo:
    t0 = time.monotonic()
    home = _home(home_arg)
    home.mkdir(parents=True, exist_ok=True)
    with _locked(home / ".lock"):
        existing = _read_state(home)
        if existing is not None:
            if _running(existing):
                if len(existing.nodes) != n:
                    raise BrokerError(
                        f"a {len(existing.nodes)}-node Kafka is already running from {home}; "
                        "stop it first"
                    )
                if ports and existing.nodes[0].client_port != ports[0]:
                    raise BrokerError(
                        f"Kafka is already running from {home} on port "
                        f"{existing.nodes[0].client_port}, not {ports[0]}; stop it first"
                    )
                existing.reused = True
                return existing
            # Stopped with its data kept (or crashed): resume it, unless this start asks
            # for settings the kept storage cannot take.
            if not (overrides or extra_listeners or format_args) and _has_data(existing):
                return _resume_locked(home, existing, n, ports, lib_dir, t0, timeout_s)
            _stop_locked(home, existing, timeout_s=15.0)  # clean up what is left

        lib = fetch(lib_dir).lib_dir
        java = _java()
        _write_atomic(home / "log4j2.properties", _LOG4J2)
        explicit = ports is not None or controller_ports is not None
        if ports is not None and not _port_free(ports[0]):
            raise BrokerError(f"port {ports[0]} on {LOOPBACK} is already in use")
        if controller_ports is not None and not _port_free(controller_ports[0]):
            raise BrokerError(f"port {controller_ports[0]} on {LOOPBACK} is already in use")

        last_error: BrokerError | None = None
        for _attempt in range(1 if explicit else 3):
            nodes = _plan_nodes(home, n, ports, controller_ports, prefer_default_port)
            for node, extra in zip(nodes, _extra_ports(nodes, extra_listeners), strict=True):
                node.listeners = extra
            try:
                info = _boot(
                    home,
                    lib,
                    java,
                    nodes,
                    standalone,
                    replication,
                    overrides,
                    t0,
                    timeout_s,
                    format_args,
                    heap_opts,
                )
            except BrokerError as exc:
                last_error = exc
                if "Address already in use" in str(exc) or "BindException" in str(exc):
                    continue  # a port picked as free was taken meanwhile: pick again
                raise
            _write_state(info)
            return info
        assert last_error is not None
        raise last_error


def _plan_nodes(
    home: Path,
    n: int,
    ports: list[int] | None,
    controller_ports: list[int] | None,
    prefer_default_port: bool,
) -> list[NodeInfo]:
    taken: set[int] = set()
    if ports is not None:
        client = list(ports)
    elif n == 1 and prefer_default_port and _port_free(DEFAULT_CLIENT_PORT):
        client = [DEFAULT_CLIENT_PORT]
    else:
        client = _pick_ports(n, taken)
    taken.update(client)
    ctrl = list(controller_ports) if controller_ports is not None else _pick_ports(n, taken)
    nodes: list[NodeInfo] = []
    for i in range(n):
        node_dir = home / f"node-{i + 1}"
        nodes.append(
            NodeInfo(
                node_id=i + 1,
                client_port=client[i],
                controller_port=ctrl[i],
                pid=0,
                node_dir=str(node_dir),
                data_dir=str(node_dir / "data"),
                log_file=str(node_dir / "kafka.log"),
                properties=str(node_dir / "server.properties"),
            )
        )
    return nodes


def _extra_ports(nodes: list[NodeInfo], names: Sequence[str]) -> list[dict[str, int]]:
    """Free ports for each node's extra listeners, distinct from the planned ones."""
    taken = {p for n in nodes for p in (n.client_port, n.controller_port)}
    out: list[dict[str, int]] = []
    for _ in nodes:
        picked = _pick_ports(len(names), taken)
        taken.update(picked)
        out.append(dict(zip(names, picked, strict=True)))
    return out


def _boot(
    home: Path,
    lib: Path,
    java: str,
    nodes: list[NodeInfo],
    standalone: bool,
    replication: int,
    overrides: dict[str, str] | None,
    t0: float,
    timeout_s: float,
    format_args: Sequence[str] = (),
    heap_opts: str | None = None,
) -> BrokerInfo:
    for old in home.glob("node-*"):
        shutil.rmtree(old, ignore_errors=True)
    for node in nodes:
        Path(node.data_dir).mkdir(parents=True)
        _write_atomic(
            Path(node.properties),
            _properties(
                node,
                voters=nodes,
                standalone=standalone,
                replication=replication,
                overrides=overrides,
            ),
        )
    cluster_id = _new_cluster_id()
    _format(java, lib, home, nodes, cluster_id, standalone, format_args)
    launched_at = time.monotonic()
    started_at = time.time()
    try:
        for node in nodes:
            node.pid = _launch(java, lib, home, node, append_log=False, heap=heap_opts)
        _wait_ready(nodes, launched_at + timeout_s, expect_brokers=len(nodes))
    except BaseException:
        for node in nodes:
            if node.pid:
                _terminate(node, timeout_s=10.0)
        raise
    now = time.monotonic()
    return BrokerInfo(
        home=str(home),
        cluster_id=cluster_id,
        nodes=nodes,
        started_at=started_at,
        start_seconds=round(now - launched_at, 3),
        total_seconds=round(now - t0, 3),
        lib_dir=str(lib),
        standalone=standalone,
        extra={"heap_opts": heap_opts} if heap_opts else {},
    )


def _has_data(info: BrokerInfo) -> bool:
    """Whether every node's formatted storage is still there."""
    return all((Path(n.data_dir) / "meta.properties").is_file() for n in info.nodes)


def _resume_locked(
    home: Path,
    info: BrokerInfo,
    n: int,
    ports: list[int] | None,
    lib_dir: str | os.PathLike[str] | None,
    t0: float,
    timeout_s: float,
) -> BrokerInfo:
    """Relaunch every node of a stopped broker on its kept data, properties and ports (a
    KRaft quorum knows its controllers by address: the ports cannot change)."""
    fresh = f"or `dgstream broker stop --delete-data --home {home}` to start afresh"
    if len(info.nodes) != n:
        raise BrokerError(
            f"{home} holds the data of a {len(info.nodes)}-node Kafka: start "
            f"{len(info.nodes)} nodes, {fresh}"
        )
    if ports and info.nodes[0].client_port != ports[0]:
        raise BrokerError(
            f"the Kafka data kept in {home} listens on port "
            f"{info.nodes[0].client_port}, not {ports[0]}: start without a port, {fresh}"
        )
    for node in info.nodes:  # a node left running alone (a half-stopped cluster)
        _terminate(node, 15.0)
    taken = [
        p
        for node in info.nodes
        for p in (node.client_port, node.controller_port, *node.listeners.values())
        if not _port_free(p)
    ]
    if taken:
        raise BrokerError(
            f"the Kafka data kept in {home} needs ports {taken} on {LOOPBACK}, "
            f"which are in use: free them, {fresh}"
        )
    lib = fetch(lib_dir).lib_dir
    java = _java()
    launched_at = time.monotonic()
    info.started_at = time.time()
    try:
        for node in info.nodes:
            node.pid = _launch(
                java, lib, home, node, append_log=True, heap=info.extra.get("heap_opts")
            )
        _wait_ready(info.nodes, launched_at + timeout_s, expect_brokers=len(info.nodes))
    except BaseException:
        for node in info.nodes:
            if node.pid:
                _terminate(node, timeout_s=10.0)
        raise
    now = time.monotonic()
    info.start_seconds = round(now - launched_at, 3)
    info.total_seconds = round(now - t0, 3)
    info.lib_dir = str(lib)
    info.resumed = True
    _write_state(info)
    return info


def _stop_locked(home: Path, info: BrokerInfo, timeout_s: float, delete_data: bool = True) -> None:
    for node in info.nodes:  # signal all first, so a cluster shuts down in parallel
        if _is_our_jvm(node.pid, node):
            _signal_group(node.pid, signal.SIGTERM)
            _signal_group(node.pid, signal.SIGCONT)  # a frozen node (freeze_node) too
    for node in info.nodes:
        _terminate(node, timeout_s)
    if not delete_data:
        return  # the state file names the data, ports and cluster id for the next start
    (home / STATE_NAME).unlink(missing_ok=True)
    for node in info.nodes:
        shutil.rmtree(node.data_dir, ignore_errors=True)


def stop(
    home: str | os.PathLike[str] | None = None,
    *,
    timeout_s: float = 30.0,
    delete_data: bool = False,
) -> bool:
    """SIGTERM every node, wait (bounded), SIGKILL what is left. The data (topics, records,
    offsets) and the state file stay for the next `start()` to resume, unless
    `delete_data`. Node logs are kept either way.

    Returns True when a node was stopped, or data deleted.
    """
    h = _home(home)
    if not h.exists():
        return False
    with _locked(h / ".lock"):
        info = _read_state(h)
        if info is None:
            return False
        was_running = any(_is_our_jvm(n.pid, n) for n in info.nodes)
        _stop_locked(h, info, timeout_s, delete_data=delete_data)
    return was_running or delete_data


def status(
    home: str | os.PathLike[str] | None = None, *, probe_timeout_s: float = 3.0
) -> dict[str, Any]:
    """Whether the broker from `home` runs and answers metadata requests, and where."""
    h = _home(home)
    info = _read_state(h) if h.exists() else None
    if info is None:
        return {"running": False, "answers_metadata": False, "home": str(h)}
    alive = {n.node_id: _is_our_jvm(n.pid, n) for n in info.nodes}
    running = any(alive.values())
    # A stopped broker whose data was kept: `start()` resumes it.
    data_kept = not running and _has_data(info)
    described = _probe(info.bootstrap_servers, probe_timeout_s) if running else None
    d = info.to_dict()
    d.pop("reused", None)
    d.pop("resumed", None)
    d.update(
        running=running,
        all_nodes_running=all(alive.values()),
        nodes_alive={str(k): v for k, v in alive.items()},
        answers_metadata=described is not None,
        data_kept=data_kept,
        brokers_answering=len(described.get("brokers", [])) if described else 0,
        pids=[n.pid for n in info.nodes],
        pid=info.pid,
    )
    return d


def kill_node(
    node_id: int,
    home: str | os.PathLike[str] | None = None,
    *,
    hard: bool = False,
    timeout_s: float = 30.0,
) -> None:
    """Stop one node of a running cluster (SIGKILL when `hard`); its data stays for restart."""
    h = _home(home)
    with _locked(h / ".lock"):
        info = _read_state(h)
        if info is None:
            raise BrokerError(f"no Kafka running from {h}")
        node = info.node(node_id)
        if hard:
            if _is_our_jvm(node.pid, node):
                _signal_group(node.pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while _alive(node.pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
        else:
            _terminate(node, timeout_s)


def freeze_node(
    node_id: int, home: str | os.PathLike[str] | None = None, *, thaw: bool = False
) -> None:
    """SIGSTOP one node (a broker frozen by a long GC pause or a stalled VM), or with
    `thaw`, SIGCONT it. `stop()` thaws a frozen node before stopping it."""
    h = _home(home)
    with _locked(h / ".lock"):
        info = _read_state(h)
        if info is None:
            raise BrokerError(f"no Kafka running from {h}")
        node = info.node(node_id)
        if not _is_our_jvm(node.pid, node):
            raise BrokerError(f"node {node_id} of {h} is not running")
        _signal_group(node.pid, signal.SIGCONT if thaw else signal.SIGSTOP)


def restart_node(
    node_id: int,
    home: str | os.PathLike[str] | None = None,
    *,
    timeout_s: float = 120.0,
) -> BrokerInfo:
    """Bring a stopped node of a running cluster back (same ports and data)."""
    h = _home(home)
    with _locked(h / ".lock"):
        info = _read_state(h)
        if info is None:
            raise BrokerError(f"no Kafka running from {h}")
        node = info.node(node_id)
        if _is_our_jvm(node.pid, node):
            return info
        lib = Path(info.lib_dir)
        java = _java()
        launched_at = time.monotonic()
        node.pid = _launch(java, lib, h, node, append_log=True, heap=info.extra.get("heap_opts"))
        _write_state(info)
        _wait_ready([node], launched_at + timeout_s, expect_brokers=1)
        deadline = time.monotonic() + timeout_s
        while True:  # and the whole cluster sees it again
            described = _probe(info.bootstrap_servers)
            brokers = {b.get("broker_id") for b in (described or {}).get("brokers", [])}
            if node_id in brokers:
                break
            if time.monotonic() > deadline:
                raise BrokerError(f"node {node_id} restarted but did not rejoin the cluster")
            time.sleep(0.1)
        return info


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dgstream broker start|stop|status|fetch [--json] [--port N] [--home DIR]`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--home",
        default=None,
        help=f"state directory (default: ${HOME_ENV} or <repo>/.cache/kafka/run)",
    )
    common.add_argument("--json", action="store_true", help="print a JSON object")
    sub = parser.add_subparsers(dest="broker_command", required=True, metavar="ACTION")
    p_start = sub.add_parser("start", parents=[common], help="start a loopback broker (KRaft)")
    p_start.add_argument(
        "--port", type=int, default=None, help="client port (default 9092 when free, else any)"
    )
    p_start.add_argument(
        "--nodes", type=int, default=1, help="combined broker+controller nodes (default 1)"
    )
    p_start.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for it")
    p_stop = sub.add_parser(
        "stop", parents=[common], help="stop it; its data stays for the next start"
    )
    p_stop.add_argument("--timeout", type=float, default=30.0, help="seconds before SIGKILL")
    p_stop.add_argument(
        "--delete-data",
        action="store_true",
        help="also delete its topics, records and offsets (the next start is a new cluster)",
    )
    sub.add_parser("status", parents=[common], help="is it running and answering?")
    sub.add_parser("fetch", parents=[common], help="fetch Kafka's jars (no-op when cached)")


def _emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(obj, sort_keys=True))
    else:
        print(text)


def cli(args: argparse.Namespace) -> int:
    """Run one broker action; returns the exit status (status: 0 running, 3 not running)."""
    action = args.broker_command
    home = getattr(args, "home", None)
    try:
        if action == "fetch":
            r = fetch()
            verb = "fetched" if r.fetched else "already cached"
            _emit(
                args,
                {
                    "lib_dir": str(r.lib_dir),
                    "fetched": r.fetched,
                    "jars": r.jars,
                    "seconds": r.seconds,
                },
                f"Kafka jars {verb}: {r.jars} in {r.lib_dir} ({r.seconds:.1f}s)",
            )
            return 0
        if action == "start":
            if args.nodes > 1:
                if args.port is not None:
                    raise BrokerError("--port applies to a single node only")
                info = start_cluster(args.nodes, home, timeout_s=args.timeout)
            else:
                info = start(home, port=args.port, timeout_s=args.timeout)
            if info.reused:
                text = f"Kafka already running: bootstrap servers {info.bootstrap}"
            elif info.resumed:
                text = (
                    f"Kafka started on its kept data ({info.home}): bootstrap servers "
                    f"{info.bootstrap} (ready {info.start_seconds:.1f}s after launch)"
                )
            else:
                text = (
                    f"Kafka started: bootstrap servers {info.bootstrap} "
                    f"(ready {info.start_seconds:.1f}s after launch, "
                    f"{info.total_seconds:.1f}s in all)"
                )
            _emit(args, info.to_dict(), text)
            return 0
        if action == "stop":
            return _cli_stop(args, home)
        if action == "status":
            st = status(home)
            if st["running"]:
                text = (
                    f"Kafka running: bootstrap servers {st['bootstrap']}, pids {st['pids']}, "
                    f"answers metadata: {'yes' if st['answers_metadata'] else 'no'}"
                )
            elif st.get("data_kept"):
                text = f"Kafka not running; its data is kept in {st['home']} ({_KEPT_HINT})"
            else:
                text = "Kafka not running"
            _emit(args, st, text)
            return 0 if st["running"] and st["answers_metadata"] else 3
    except BrokerError as exc:
        print(f"dgstream broker {action}: {exc}", file=sys.stderr)
        return 1
    print(f"unknown broker action {action!r}", file=sys.stderr)
    return 2


_KEPT_HINT = "`dgstream broker start` resumes it, `dgstream broker stop --delete-data` deletes it"


def _cli_stop(args: argparse.Namespace, home: str | None) -> int:
    h = _home(home)
    stopped = stop(home, timeout_s=args.timeout, delete_data=args.delete_data)
    kept = not args.delete_data and _read_state(h) is not None
    if args.delete_data:
        text = "Kafka stopped, its data deleted" if stopped else "Kafka was not running"
    elif stopped:
        text = f"Kafka stopped; its data is kept in {h} ({_KEPT_HINT})"
    else:
        text = "Kafka was not running" + (f"; its data is kept in {h}" if kept else "")
    _emit(args, {"stopped": stopped, "data_kept": kept, "home": str(h)}, text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.kafka.broker", description="The local Kafka broker."
    )
    add_arguments(parser)
    return cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""The broker's home and state file, and what they describe: the nodes, their ports and pids.

The state file (`<home>/state.json`) is the single record of a broker this package started:
every other module reads it under the home's lock, so two processes never race on one home.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]
HOME_ENV = "DGSTREAM_KAFKA_HOME"
STATE_NAME = "state.json"
LOOPBACK = "127.0.0.1"


class BrokerError(RuntimeError):
    """The broker could not be fetched, started, stopped or reached."""


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


def default_home() -> Path:
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".cache" / "kafka" / "run"


def resolve_home(home: str | os.PathLike[str] | None) -> Path:
    return Path(home).expanduser().resolve() if home is not None else default_home()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock across processes (parallel test runs, two CLIs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def write_atomic(path: Path, text: str) -> None:
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


def read_state(home: Path) -> BrokerInfo | None:
    try:
        return BrokerInfo.from_dict(json.loads((home / STATE_NAME).read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BrokerError(f"unreadable broker state file {home / STATE_NAME}: {exc}") from exc


def write_state(info: BrokerInfo) -> None:
    d = info.to_dict()
    d.pop("reused", None)
    d.pop("resumed", None)
    write_atomic(Path(info.home) / STATE_NAME, json.dumps(d, indent=2, sort_keys=True) + "\n")

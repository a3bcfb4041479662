"""What a node is configured with: its ports and directories, `server.properties`, log4j2.

Rendering only: nothing here starts a process. Every listener binds 127.0.0.1.
"""

from __future__ import annotations

import base64
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path

from dgstream.infra.kafka.broker.state import LOOPBACK, NodeInfo

DEFAULT_CLIENT_PORT = 9092
LOG4J2 = """\
# Written by dgstream (infra/kafka/broker); the JVM's stdout goes to the node's kafka.log.
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


def port_free(port: int) -> bool:
    """Whether Kafka could listen on `port`: bound as the JVM binds a server socket, with
    SO_REUSEADDR, so a port held only by TIME-WAIT sockets (for a minute after a broker on
    it stopped) is free, and one that something listens on is not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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


def new_cluster_id() -> str:
    """A Kafka Uuid string (URL-safe base64 of 16 random bytes, no padding)."""
    while True:
        s = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not s.startswith("-"):  # as Kafka's Uuid.randomUuid: never looks like an option
            return s


def render_properties(
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
    lines = ["# Written by dgstream (infra/kafka/broker): a loopback-only KRaft test node."]
    lines += [f"{k}={v}" for k, v in conf.items()]
    return "\n".join(lines) + "\n"


def plan_nodes(
    home: Path,
    n: int,
    ports: list[int] | None,
    controller_ports: list[int] | None,
    prefer_default_port: bool,
) -> list[NodeInfo]:
    taken: set[int] = set()
    if ports is not None:
        client = list(ports)
    elif n == 1 and prefer_default_port and port_free(DEFAULT_CLIENT_PORT):
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


def extra_ports(nodes: list[NodeInfo], names: Sequence[str]) -> list[dict[str, int]]:
    """Free ports for each node's extra listeners, distinct from the planned ones."""
    taken = {p for n in nodes for p in (n.client_port, n.controller_port)}
    out: list[dict[str, int]] = []
    for _ in nodes:
        picked = _pick_ports(len(names), taken)
        taken.update(picked)
        out.append(dict(zip(names, picked, strict=True)))
    return out

"""Start, resume, stop and report a broker of one node or a cluster of `n` combined nodes.

A `stop()` keeps the data (topics, offsets, the cluster id) unless told to delete it, and
the next start resumes it on the same ports; a start with `overrides` formats afresh.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dgstream.infra.kafka.broker.config import (
    LOG4J2,
    extra_ports,
    new_cluster_id,
    plan_nodes,
    port_free,
    render_properties,
)
from dgstream.infra.kafka.broker.jars import fetch
from dgstream.infra.kafka.broker.process import (
    find_java,
    format_storage,
    is_our_jvm,
    launch_all,
    probe,
    signal_group,
    terminate,
)
from dgstream.infra.kafka.broker.state import (
    LOOPBACK,
    STATE_NAME,
    BrokerError,
    BrokerInfo,
    NodeInfo,
    locked,
    read_state,
    resolve_home,
    write_atomic,
    write_state,
)


def _running(info: BrokerInfo) -> bool:
    return all(is_our_jvm(n.pid, n) for n in info.nodes)


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
    return start_nodes(
        home,
        ports=[port] if port else None,
        controller_ports=[controller_port] if controller_port else None,
        prefer_default_port=port is None,
        lib_dir=lib_dir,
        timeout_s=timeout_s,
        overrides=overrides,
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
    return start_nodes(
        home,
        n=n,
        lib_dir=lib_dir,
        timeout_s=timeout_s,
        overrides=overrides,
        standalone=False,
        replication=rf,
        heap_opts=heap_opts,
    )


def start_nodes(
    home_arg: str | os.PathLike[str] | None,
    *,
    lib_dir: str | os.PathLike[str] | None,
    timeout_s: float,
    overrides: dict[str, str] | None,
    n: int = 1,
    ports: list[int] | None = None,
    controller_ports: list[int] | None = None,
    standalone: bool = True,
    replication: int = 1,
    prefer_default_port: bool = False,
    extra_listeners: Sequence[str] = (),
    format_args: Sequence[str] = (),
    heap_opts: str | None = None,
) -> BrokerInfo:
    """Start `n` nodes (by default one, standalone, on free ports) from `home_arg`, or
    return the running broker, or resume the kept one."""
    t0 = time.monotonic()
    home = resolve_home(home_arg)
    home.mkdir(parents=True, exist_ok=True)
    with locked(home / ".lock"):
        existing = read_state(home)
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
        java = find_java()
        write_atomic(home / "log4j2.properties", LOG4J2)
        explicit = ports is not None or controller_ports is not None
        if ports is not None and not port_free(ports[0]):
            raise BrokerError(f"port {ports[0]} on {LOOPBACK} is already in use")
        if controller_ports is not None and not port_free(controller_ports[0]):
            raise BrokerError(f"port {controller_ports[0]} on {LOOPBACK} is already in use")

        last_error: BrokerError | None = None
        for _attempt in range(1 if explicit else 3):
            nodes = plan_nodes(home, n, ports, controller_ports, prefer_default_port)
            for node, extra in zip(nodes, extra_ports(nodes, extra_listeners), strict=True):
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
            write_state(info)
            return info
        assert last_error is not None
        raise last_error


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
        write_atomic(
            Path(node.properties),
            render_properties(
                node,
                voters=nodes,
                standalone=standalone,
                replication=replication,
                overrides=overrides,
            ),
        )
    cluster_id = new_cluster_id()
    format_storage(java, lib, home, nodes, cluster_id, standalone, format_args)
    launched_at = time.monotonic()
    started_at = time.time()
    launch_all(
        java,
        lib,
        home,
        nodes,
        append_log=False,
        heap=heap_opts,
        deadline=launched_at + timeout_s,
    )
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
        terminate(node, 15.0)
    taken = [
        p
        for node in info.nodes
        for p in (node.client_port, node.controller_port, *node.listeners.values())
        if not port_free(p)
    ]
    if taken:
        raise BrokerError(
            f"the Kafka data kept in {home} needs ports {taken} on {LOOPBACK}, "
            f"which are in use: free them, {fresh}"
        )
    lib = fetch(lib_dir).lib_dir
    java = find_java()
    launched_at = time.monotonic()
    info.started_at = time.time()
    launch_all(
        java,
        lib,
        home,
        info.nodes,
        append_log=True,
        heap=info.extra.get("heap_opts"),
        deadline=launched_at + timeout_s,
    )
    now = time.monotonic()
    info.start_seconds = round(now - launched_at, 3)
    info.total_seconds = round(now - t0, 3)
    info.lib_dir = str(lib)
    info.resumed = True
    write_state(info)
    return info


def _stop_locked(home: Path, info: BrokerInfo, timeout_s: float, delete_data: bool = True) -> None:
    for node in info.nodes:  # signal all first, so a cluster shuts down in parallel
        if is_our_jvm(node.pid, node):
            signal_group(node.pid, signal.SIGTERM)
            signal_group(node.pid, signal.SIGCONT)  # a frozen node (freeze_node) too
    for node in info.nodes:
        terminate(node, timeout_s)
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
    h = resolve_home(home)
    if not h.exists():
        return False
    with locked(h / ".lock"):
        info = read_state(h)
        if info is None:
            return False
        was_running = any(is_our_jvm(n.pid, n) for n in info.nodes)
        _stop_locked(h, info, timeout_s, delete_data=delete_data)
    return was_running or delete_data


def status(
    home: str | os.PathLike[str] | None = None, *, probe_timeout_s: float = 3.0
) -> dict[str, Any]:
    """Whether the broker from `home` runs and answers metadata requests, and where."""
    h = resolve_home(home)
    info = read_state(h) if h.exists() else None
    if info is None:
        return {"running": False, "answers_metadata": False, "home": str(h)}
    alive = {n.node_id: is_our_jvm(n.pid, n) for n in info.nodes}
    running = any(alive.values())
    # A stopped broker whose data was kept: `start()` resumes it.
    data_kept = not running and _has_data(info)
    described = probe(info.bootstrap_servers, probe_timeout_s) if running else None
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

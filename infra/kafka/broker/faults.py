"""Faults injected into one node of a running cluster: kill, freeze (SIGSTOP), restart."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dgstream.infra.kafka.broker.process import (
    find_java,
    is_our_jvm,
    kill_hard,
    launch,
    probe,
    signal_group,
    terminate,
    wait_ready,
)
from dgstream.infra.kafka.broker.state import (
    BrokerError,
    BrokerInfo,
    NodeInfo,
    locked,
    read_state,
    resolve_home,
    write_state,
)


@dataclass(frozen=True)
class _Located:
    home: Path
    info: BrokerInfo
    node: NodeInfo


@contextlib.contextmanager
def _node_of(node_id: int, home: str | os.PathLike[str] | None) -> Iterator[_Located]:
    """One node of the broker running from `home`, with its state, under the home's lock."""
    h = resolve_home(home)
    with locked(h / ".lock"):
        info = read_state(h)
        if info is None:
            raise BrokerError(f"no Kafka running from {h}")
        yield _Located(h, info, info.node(node_id))


def kill_node(
    node_id: int,
    home: str | os.PathLike[str] | None = None,
    *,
    hard: bool = False,
    timeout_s: float = 30.0,
) -> None:
    """Stop one node of a running cluster (SIGKILL when `hard`); its data stays for restart."""
    with _node_of(node_id, home) as at:
        if not hard:
            terminate(at.node, timeout_s)
        elif is_our_jvm(at.node.pid, at.node):
            kill_hard(at.node.pid)


def freeze_node(
    node_id: int, home: str | os.PathLike[str] | None = None, *, thaw: bool = False
) -> None:
    """SIGSTOP one node (a broker frozen by a long GC pause or a stalled VM), or with
    `thaw`, SIGCONT it. `stop()` thaws a frozen node before stopping it."""
    with _node_of(node_id, home) as at:
        if not is_our_jvm(at.node.pid, at.node):
            raise BrokerError(f"node {node_id} of {at.home} is not running")
        signal_group(at.node.pid, signal.SIGCONT if thaw else signal.SIGSTOP)


def restart_node(
    node_id: int,
    home: str | os.PathLike[str] | None = None,
    *,
    timeout_s: float = 120.0,
) -> BrokerInfo:
    """Bring a stopped node of a running cluster back (same ports and data)."""
    with _node_of(node_id, home) as at:
        info, node = at.info, at.node
        if is_our_jvm(node.pid, node):
            return info
        lib = Path(info.lib_dir)
        java = find_java()
        launched_at = time.monotonic()
        heap = info.extra.get("heap_opts")
        node.pid = launch(java, lib, at.home, node, append_log=True, heap=heap)
        write_state(info)
        wait_ready([node], launched_at + timeout_s, expect_brokers=1)
        deadline = time.monotonic() + timeout_s
        while True:  # and the whole cluster sees it again
            described = probe(info.bootstrap_servers)
            brokers = {b.get("broker_id") for b in (described or {}).get("brokers", [])}
            if node_id in brokers:
                break
            if time.monotonic() > deadline:
                raise BrokerError(f"node {node_id} restarted but did not rejoin the cluster")
            time.sleep(0.1)
        return info

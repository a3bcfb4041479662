"""Ray's metrics endpoints answer no one off the machine.

Ray serves Prometheus metrics without a token on three ports: each node's metrics export
port (the dashboard agent's), the dashboard's and the autoscaler's. The local Ray the project
starts (`topology.local_ray.start_local_ray`, the demo's) puts them, and every other server
of the cluster, on loopback: a scrape from the machine's own address is refused.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from bench.harness.waiting import wait_for
from dgstream.topology.local_ray import LOOPBACK_ONLY_ENV, loopback_only

ROOT = Path(__file__).resolve().parents[2]

# The child starts the cluster exactly as the demo does, prints what the test needs, and
# shuts it down when its stdin closes.
_CHILD = """
import json, sys
import ray
from dgstream.topology.local_ray import private_ray_tmp, start_local_ray
with private_ray_tmp("dgmet-") as tmp:
    ctx = start_local_ray(str(tmp), "dgstream-metrics-test")
    (node,) = ray.nodes()
    print(json.dumps({"node_ip": node["NodeManagerAddress"],
                      "metrics_export_port": node["MetricsExportPort"],
                      "gcs": ctx.address_info["gcs_address"]}), flush=True)
    sys.stdin.read()
    ray.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _machine_addresses() -> list[str]:
    """This machine's addresses that another machine could reach (not loopback or link-local)."""
    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = ipaddress.ip_address(a.address.split("%")[0])
            if not (ip.is_loopback or ip.is_link_local):
                out.append(str(ip))
    return out


def _cluster(root: psutil.Process) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return [root, *root.children(recursive=True)]
    return []


def _listeners(procs: list[psutil.Process]) -> dict[int, set[str]]:
    """Port -> the addresses it listens on (TCP), over `procs`."""
    found: dict[int, set[str]] = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.setdefault(c.laddr.port, set()).add(c.laddr.ip)
    return found


@contextlib.contextmanager
def _local_ray(env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """The child's cluster, running; stopped after, every process of it gone."""
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - read after the child ends
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    lines: list[str] = []
    assert proc.stdout is not None and proc.stdin is not None
    out = proc.stdout
    threading.Thread(target=lambda: lines.append(out.readline()), daemon=True).start()
    seen: list[psutil.Process] = []
    try:
        wait_for(lambda: lines or proc.poll() is not None, 180, "the local Ray to start")
        if not lines or not lines[0].strip():
            log.seek(0)
            pytest.fail(f"the local Ray did not start:\n{log.read()[-3000:]}")
        seen = _cluster(psutil.Process(proc.pid))
        yield proc, json.loads(lines[0])
    finally:
        if proc.poll() is None:  # what the cluster runs now, its workers included
            seen = list({p.pid: p for p in [*seen, *_cluster(psutil.Process(proc.pid))]}.values())
        with contextlib.suppress(BrokenPipeError, OSError):
            proc.stdin.close()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        _, alive = psutil.wait_procs(seen, timeout=60)
        for p in alive:  # only the processes this cluster started, by pid
            with contextlib.suppress(psutil.Error):
                p.kill()
        log.close()
        assert not alive, f"left running: {[p.pid for p in alive]}"


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_the_local_rays_metrics_endpoints_listen_on_loopback_only() -> None:
    ports = {"dashboard": _free_port(), "autoscaler": _free_port()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PYTHONPATH=str(ROOT),
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        # Ray's fixed defaults (44227, 44217) may be held by another cluster on this
        # machine: then ours would not listen at all, and the test would prove nothing.
        DASHBOARD_METRIC_PORT=str(ports["dashboard"]),
        AUTOSCALER_METRIC_PORT=str(ports["autoscaler"]),
    )
    assert LOOPBACK_ONLY_ENV[0] not in env  # the helper sets it, nothing else
    with _local_ray(env) as (proc, info):
        ports["export"] = int(info["metrics_export_port"])
        assert info["node_ip"] == "127.0.0.1"

        def listening() -> dict[int, set[str]] | None:
            found = _listeners(_cluster(psutil.Process(proc.pid)))
            return found if all(p in found for p in ports.values()) else None

        found = wait_for(listening, 120, f"Ray's metrics endpoints {ports} to listen")
        for name, port in ports.items():
            assert all(_is_loopback(ip) for ip in found[port]), (name, port, found[port])
        # Not only the metrics: no server of this cluster listens beyond loopback.
        wide = {port: ips for port, ips in found.items() if not all(map(_is_loopback, ips))}
        assert wide == {}

        for name, port in ports.items():
            # Each is the metrics endpoint, and answers on loopback...
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                assert r.status == 200, name
                assert b"# TYPE " in r.read(), name
            # ... and refuses a scrape through the machine's own addresses.
            for ip in _machine_addresses():
                with (
                    pytest.raises(ConnectionRefusedError),
                    socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s,
                ):
                    s.settimeout(10)
                    s.connect((ip, port))


@pytest.mark.unit
def test_loopback_only_turns_a_node_ip_into_loopback_after_ray_is_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray._private.ray_constants as constants
    from ray._private import services

    # Restored after, whatever the test does: other tests start clusters in this process.
    monkeypatch.setattr(constants, "ENABLE_RAY_CLUSTER", constants.ENABLE_RAY_CLUSTER)
    monkeypatch.delenv(LOOPBACK_ONLY_ENV[0], raising=False)
    loopback_only()
    assert os.environ[LOOPBACK_ONLY_ENV[0]] == LOOPBACK_ONLY_ENV[1]
    assert services.get_node_ip_address() == "127.0.0.1"

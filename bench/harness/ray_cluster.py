"""A Ray cluster of the tests' own (token authentication, a private temp dir) and a
running controller on it: used by the Ray-tier tests and the benchmarks that drive the
controller (test support: the product never imports it)."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# The namespace the spike scenario's controllers and workers run in.
NAMESPACE = "dgstream-autoscale"


def _refresh_ray_auth() -> None:
    """Ray caches the authentication mode (its config) and the token in each process:
    make this one read the environment again."""
    with contextlib.suppress(Exception):
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def ray_token_auth() -> Iterator[str]:
    """RAY_AUTH_MODE=token with a fresh random token for the clusters started inside
    (Ray's gRPC servers listen on every interface here); the environment is restored after."""
    keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    saved = {k: os.environ.get(k) for k in keys}
    token = secrets.token_hex(32)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = token
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    _refresh_ray_auth()
    try:
        yield token
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _refresh_ray_auth()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@dataclass
class RayCluster:
    cluster: Any
    address: str
    token: str
    node_names: dict[str, str] = field(default_factory=dict)  # node id -> custom resource
    dashboard: bool = False
    temp_dir: str = ""  # the head's Ray temp dir (sessions, logs); removed after


@contextlib.contextmanager
def ray_cluster(
    nodes: list[dict[str, Any]], *, dashboard: bool = False, namespace: str = NAMESPACE
) -> Iterator[RayCluster]:
    """A Ray cluster of our own on this machine (`ray.cluster_utils.Cluster`: one node
    per entry of `nodes`, the first the head), with token authentication, this process
    connected to it. Everything is stopped after; never `ray stop` (other clusters run here).

    Each node may name itself with a custom resource (`resources: {"node-a": 1}`)."""
    import ray
    from ray.cluster_utils import Cluster

    from dgstream.topology.local_ray import private_ray_tmp

    if ray.is_initialized():
        raise RuntimeError("this process is already connected to a Ray cluster")
    # Cluster() writes (and its shutdown deletes) the "current cluster" file in Ray's
    # default temp dir: a private one, so that no shared /tmp/ray is needed or touched.
    with private_ray_tmp("dgas-") as temp_dir, ray_token_auth() as token:
        head = {**nodes[0], "temp_dir": str(temp_dir), "include_dashboard": dashboard}
        if dashboard:
            head.update(dashboard_host="127.0.0.1", dashboard_port=_free_port())
        cluster = None
        try:
            cluster = Cluster(initialize_head=True, head_node_args=head)
            for node in nodes[1:]:
                cluster.add_node(**node)
            cluster.wait_for_nodes()
            ray.init(
                address=cluster.address,
                namespace=namespace,
                log_to_driver=False,
                logging_level="WARNING",
            )
            names = {}
            for n in ray.nodes():
                custom = [k for k in n["Resources"] if k.startswith("node-")]
                if custom:
                    names[n["NodeID"]] = custom[0]
            yield RayCluster(cluster, cluster.address, token, names, dashboard, str(temp_dir))
        finally:
            with contextlib.suppress(Exception):
                ray.shutdown()
            if cluster is not None:
                cluster.shutdown()


def kill_workers(namespace: str, prefix: str = "dgstream-") -> int:
    """Every named actor of `namespace` whose name starts with `prefix` (leftovers)."""
    import ray

    killed = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == namespace and entry["name"].startswith(prefix):
            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(entry["name"], namespace=namespace), no_restart=True)
                killed += 1
    return killed


def describe_workers(namespace: str, prefix: str, log_dir: str = "", lines: int = 40) -> str:
    """What each worker of `namespace` named `prefix*` says of itself (state, assignment,
    group, counters, last error) and the last lines of the Ray workers' stderr logs under
    `log_dir`: printed when a test times out waiting on them."""
    import ray

    out = ["load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())]
    keys = ("state", "assignment", "group", "committed", "consumed", "answered", "last_error")
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != namespace or not entry["name"].startswith(prefix):
            continue
        try:
            st = ray.get(
                ray.get_actor(entry["name"], namespace=namespace).status.remote(), timeout=30
            )
            out.append(f"{entry['name']}: { ({k: st.get(k) for k in keys}) }")
        except Exception as exc:  # the diagnosis must not hide the failure it explains
            out.append(f"{entry['name']}: status failed: {type(exc).__name__}: {exc}")
    if log_dir:
        from pathlib import Path

        for path in sorted(Path(log_dir).rglob("worker-*.err")):
            tail = [t[:600] for t in path.read_text(errors="replace").splitlines()[-lines:]]
            if any('"event"' in t or "kafka" in t for t in tail):  # a dgstream actor's log
                out.append(f"--- {path.name}\n" + "\n".join(tail))
    if len(out) == 1:
        out.append(f"no worker named {prefix}* in {namespace}")
    return "\n".join(out)


@contextlib.contextmanager
def running_controller(topo: dict[str, Any], *, drain: bool = True) -> Iterator[Any]:
    """The topology's controller, started; shut down (workers drained) and removed after,
    with any worker of its namespace left behind."""
    import ray

    from dgstream.topology.controller import start_controller, stop_controller
    from dgstream.workers.hosting.actor import replica_prefix

    ns, deployment = topo["ray"]["namespace"], topo["ray"]["deployment"]
    ctl = start_controller(topo, deployment, ns)
    try:
        ray.get(ctl.ping.remote(), timeout=120)
        yield ctl
    finally:
        stop_controller(ctl, drain=drain, timeout_s=150)
        kill_workers(ns, replica_prefix(deployment, topo["pipelines"][0]["name"]))


def pipeline_status(ctl: Any, name: str) -> dict[str, Any]:
    import ray

    st: dict[str, Any] = ray.get(ctl.status.remote(), timeout=60)
    out: dict[str, Any] = st["pipelines"][name]
    return out


def timeline(ctl: Any, name: str) -> list[dict[str, Any]]:
    import ray

    out: list[dict[str, Any]] = ray.get(ctl.history.remote(name), timeout=60)[name]
    return out

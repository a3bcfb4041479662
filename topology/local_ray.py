"""A temp dir of its own for every Ray this project starts on one machine (the demo, the
tests' clusters, the benchmarks).

Ray keeps a machine-wide default temp dir, `$RAY_TMPDIR/ray`, else `$TMPDIR/ray`, else
`/tmp/ray`, and its "current cluster" file there: `ray.cluster_utils.Cluster` writes that
file on start (without creating the directory, so it fails where Ray never ran) and
deletes it on shutdown (another cluster's, if another one wrote it last), and
`ray.init(address=None)` connects to whatever cluster the file names. `private_ray_tmp()`
points `RAY_TMPDIR` at a fresh directory for as long as the cluster lives, creates
`<it>/ray` for the node's files, and removes both after: nothing is read from, or left in,
any shared place.

A cluster it starts on one machine (`start_local_ray`: the demo's) is that machine's alone:
`loopback_only()` puts every server of it on 127.0.0.1, among them Ray's Prometheus
endpoints, which answer without a token (docs/operations.md, "Ray's metrics endpoints").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "LOOPBACK_ONLY_ENV",
    "loopback_only",
    "private_ray_tmp",
    "short_temp_dir",
    "start_local_ray",
]

# Ray puts its Unix sockets under its temp dir (`/session_<date>_<time>_<usec>_<pid>/
# sockets/plasma_store.<n>`: up to 67 characters after it) and refuses a socket path over
# 107 bytes (`validate_socket_filepath`: Linux's sun_path less one). A parent of at most 20
# characters (`mktemp -d`'s /tmp/tmp.XXXXXXXXXX is 19) leaves room for `/dgxx-XXXXXXXX/ray`.
_MAX_PARENT = 20


def short_temp_dir(prefix: str) -> Path:
    """A new empty directory under `$TMPDIR` (or `/tmp` when `$TMPDIR` is too long for
    Ray's socket paths)."""
    parent = tempfile.gettempdir()
    if len(parent) > _MAX_PARENT:
        parent = "/tmp"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


@contextlib.contextmanager
def private_ray_tmp(prefix: str = "dgray-") -> Iterator[Path]:
    """`RAY_TMPDIR` set to a fresh directory while inside; yields `<it>/ray`, Ray's default
    temp dir for this process and the processes it starts: pass it as the node's temp dir
    (`_temp_dir=` / `temp_dir=`). Restored and removed after."""
    base = short_temp_dir(prefix)
    ray_dir = base / "ray"
    ray_dir.mkdir()
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(base)
    try:
        yield ray_dir
    finally:
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        shutil.rmtree(base, ignore_errors=True)


# Ray 2.60 serves three Prometheus endpoints that token authentication does not cover: each
# node's metrics export port (its dashboard agent), the dashboard's (DASHBOARD_METRIC_PORT,
# 44227) and the autoscaler's (AUTOSCALER_METRIC_PORT, 44217). Each listens on loopback when
# the node's IP is a loopback address and on every interface otherwise (`is_localhost(ip)` in
# dashboard/head.py `_setup_metrics`, autoscaler/_private/monitor.py and
# dashboard/modules/reporter/reporter_agent.py). The node's IP is the source address of the
# route out (`services.get_node_ip_address`) unless this variable is off, when it is
# 127.0.0.1, as Ray makes it on macOS and Windows; then the GCS, raylet and agents listen on
# loopback too. `--node-ip-address 127.0.0.1` cannot do it: Ray turns a loopback address
# back into the route's (`services.resolve_ip_for_localhost`).
LOOPBACK_ONLY_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def loopback_only() -> None:
    """Make the Ray cluster this process starts next a one-machine cluster: node IP
    127.0.0.1, every server on loopback. Call it before `ray.init` starts one; the processes
    Ray starts inherit the setting. A cluster this process connects to is unchanged (a
    driver with it set still connects to a cluster on the machine's address), but a
    cluster started with it takes drivers from this machine only, and only those with it
    set: a driver without it resolves 127.0.0.1 to the machine's address and cannot reach
    the GCS."""
    name, value = LOOPBACK_ONLY_ENV
    os.environ[name] = value
    constants: Any = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        # Ray read the variable when it was imported; `get_node_ip_address` reads this.
        constants.ENABLE_RAY_CLUSTER = False


def start_local_ray(ray_tmp: str, namespace: str, **init_kwargs: Any) -> Any:
    """`ray.init` of a new cluster on this machine only (`loopback_only`), its dashboard on
    127.0.0.1, its files under `ray_tmp` (`private_ray_tmp`); returns Ray's context."""
    import ray

    loopback_only()
    init_kwargs.setdefault("log_to_driver", False)
    return ray.init(
        address="local",
        namespace=namespace,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        _temp_dir=ray_tmp,
        **init_kwargs,
    )

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
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["private_ray_tmp", "short_temp_dir"]

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

"""Every Ray this project starts on a machine has a temp dir of its own (`topology.local_ray`):
the tests' clusters start where Ray never ran (no `$TMPDIR/ray`, no `/tmp/ray`), write Ray's
"current cluster" file only in their own directory, and leave nothing behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dgstream.topology.local_ray import private_ray_tmp, short_temp_dir


@pytest.fixture
def bare_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh, short, empty TMPDIR (as on a machine where Ray never ran); RAY_TMPDIR unset."""
    path = Path(tempfile.mkdtemp(prefix="dgt-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))  # gettempdir() caches the first answer
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.unit
def test_private_ray_tmp_points_rays_default_at_a_fresh_dir_and_removes_it(
    bare_tmp: Path,
) -> None:
    from ray._common.utils import get_default_ray_temp_dir, get_ray_address_file

    assert get_default_ray_temp_dir() == str(bare_tmp / "ray")  # Ray's own default
    with private_ray_tmp("dgx-") as ray_dir:
        assert ray_dir.is_dir() and ray_dir.name == "ray"
        assert ray_dir.parent.parent == bare_tmp
        assert get_default_ray_temp_dir() == str(ray_dir)
        assert Path(get_ray_address_file(None)).parent == ray_dir
    assert "RAY_TMPDIR" not in os.environ
    assert list(bare_tmp.iterdir()) == []


@pytest.mark.unit
def test_private_ray_tmp_restores_an_outer_ray_tmpdir(
    bare_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_TMPDIR", "/somewhere/else")
    with private_ray_tmp() as ray_dir:
        assert os.environ["RAY_TMPDIR"] == str(ray_dir.parent)
    assert os.environ["RAY_TMPDIR"] == "/somewhere/else"


@pytest.mark.unit
def test_short_temp_dir_leaves_a_long_tmpdir_for_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray refuses socket paths over 107 bytes: a long $TMPDIR (macOS has ~50 characters)
    # would make every node fail to start.
    long = Path(tempfile.mkdtemp(prefix="dgt-", dir="/tmp")) / ("x" * 40)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    made = short_temp_dir("dgx-")
    try:
        assert made.parent == Path("/tmp") and made.is_dir()
    finally:
        made.rmdir()
        shutil.rmtree(long.parent)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_cluster_fixture_starts_where_ray_never_ran_and_leaves_nothing(bare_tmp: Path) -> None:
    """`ray.cluster_utils.Cluster` writes `<Ray's default temp dir>/ray_current_cluster`
    without creating that directory: with a bare TMPDIR it failed with FileNotFoundError.
    The fixture's own directory holds it now, and `ray.init(address=None)` in this process
    finds this cluster there, never a leftover."""
    import ray
    from ray._private.services import find_bootstrap_address

    from bench.harness.ray_cluster import ray_cluster

    assert not (bare_tmp / "ray").exists()
    with ray_cluster([{"num_cpus": 1}]) as c:
        (own,) = bare_tmp.iterdir()
        address_file = own / "ray" / "ray_current_cluster"
        assert address_file.read_text().strip() == c.address
        assert find_bootstrap_address(None) == c.address
        assert ray.cluster_resources().get("CPU") == 1
        assert not (bare_tmp / "ray").exists()  # Ray's machine-wide default: untouched
    assert list(bare_tmp.iterdir()) == []
    assert "RAY_TMPDIR" not in os.environ

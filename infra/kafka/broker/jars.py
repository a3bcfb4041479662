"""Kafka's jars from Maven Central, pinned, fetched once into a cache a marker file vouches for.

`infra/kafka/jars.lock.json` lists every jar the broker and the console tools need (the
runtime tree of `infra/kafka/pom.xml`: Kafka 4.x, its dependencies, a log4j2 binding,
`kafka-tools`), each with its coordinates and its SHA-1 and SHA-256. `fetch()` downloads
them straight from Maven Central with the standard library and checks both digests, so a
machine with Python alone fills the cache: no Maven, no Java needed for this step. It runs
only when the marker's pom hash or jar list does not match: a second call touches no
network.

`lock()` (`python -m dgstream.infra.kafka.broker lock`) writes the lock file again after a change to
the pom: Maven resolves the tree (its only use here, on a developer's machine), and each
jar's SHA-1 is checked against the `.sha1` file Maven Central publishes beside it before
it is pinned. A test fails while the lock does not match the pom.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgstream.infra.kafka.broker.state import REPO_ROOT, BrokerError, locked

POM_PATH = Path(__file__).resolve().parents[1] / "pom.xml"
LOCK_PATH = Path(__file__).resolve().parents[1] / "jars.lock.json"
LIB_ENV = "DGSTREAM_KAFKA_LIB"
MARKER_NAME = ".dgstream-fetch.json"
# Maven Central's repository layout root (the address Maven itself uses by default).
CENTRAL = "https://repo.maven.apache.org/maven2"
# One jar's download gives up after this long (the largest, Kafka's server jar, is a few
# MB; scala-library 6 MB).
_DOWNLOAD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class FetchResult:
    lib_dir: Path
    fetched: bool  # False: the cache was already complete and nothing was downloaded
    seconds: float
    jars: int


def default_lib_dir() -> Path:
    env = os.environ.get(LIB_ENV)
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".cache" / "kafka" / "lib"


def _lib(lib_dir: str | os.PathLike[str] | None) -> Path:
    return Path(lib_dir).expanduser().resolve() if lib_dir is not None else default_lib_dir()


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


def _url(entry: dict[str, Any]) -> str:
    group = str(entry["group"]).replace(".", "/")
    a, v = entry["artifact"], entry["version"]
    return f"{CENTRAL}/{group}/{a}/{v}/{a}-{v}.jar"


def read_lock(path: Path = LOCK_PATH) -> dict[str, Any]:
    try:
        lock: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BrokerError(f"cannot read the jar lock {path}: {exc}") from exc
    return lock


def _download(entry: dict[str, Any], dest: Path) -> None:
    """One jar into `dest`, its SHA-1 and SHA-256 checked against the lock."""
    url = _url(entry)
    try:
        with urllib.request.urlopen(url, timeout=_DOWNLOAD_TIMEOUT_S) as resp:
            data = resp.read()
    except OSError as exc:
        raise BrokerError(f"cannot download {url}: {exc}") from exc
    for algo in ("sha1", "sha256"):
        got = hashlib.new(algo, data).hexdigest()
        if got != entry[algo]:
            raise BrokerError(f"{url}: {algo} {got} is not the pinned {entry[algo]}")
    dest.write_bytes(data)


def fetch(
    lib_dir: str | os.PathLike[str] | None = None,
    *,
    pom: str | os.PathLike[str] | None = None,
    lock_file: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> FetchResult:
    """Download the pinned jars into `lib_dir`, unless already there.

    When the marker file matches the pom's hash and every jar it lists exists, this returns
    at once (no network)."""
    t0 = time.monotonic()
    lib = _lib(lib_dir)
    pom_file = Path(pom).resolve() if pom is not None else POM_PATH
    digest = _pom_hash(pom_file)
    if not force and (n := _cache_complete(lib, digest)):
        return FetchResult(lib, False, time.monotonic() - t0, n)
    with locked(lib.parent / ".fetch.lock"):
        if not force and (n := _cache_complete(lib, digest)):  # another process did it
            return FetchResult(lib, False, time.monotonic() - t0, n)
        lock = read_lock(Path(lock_file) if lock_file is not None else LOCK_PATH)
        if lock.get("pom_sha256") != digest:
            raise BrokerError(
                f"{LOCK_PATH.name} was made for another {pom_file.name}: run "
                "`python -m dgstream.infra.kafka.broker lock` (it needs Maven) after changing "
                "the pom"
            )
        staging = Path(tempfile.mkdtemp(prefix=".lib-staging-", dir=lib.parent))
        try:
            for entry in lock["jars"]:
                _download(entry, staging / entry["file"])
            jars = sorted(str(e["file"]) for e in lock["jars"])
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


# --------------------------------------------------------------------------- lock


def _resolve_with_maven(pom: Path, timeout_s: float) -> list[tuple[str, str, str, Path]]:
    """(group, artifact, version, local file) of every runtime jar of the pom's tree."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("`lock` resolves the pom's tree with Maven: install `mvn`")
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "deps.txt"
        cmd = [
            mvn,
            "-q",
            "-B",
            "-f",
            str(pom),
            "dependency:list",
            f"-DoutputFile={listing}",
            "-DincludeScope=runtime",
            "-DoutputAbsoluteArtifactFilename=true",
        ]
        proc = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s
        )
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
            raise BrokerError(f"mvn exited with {proc.returncode}:\n" + "\n".join(tail))
        out = []
        for line in listing.read_text().splitlines():
            parts = line.strip().split(":")
            # group:artifact:jar:version:scope:/path/to/file.jar (a module note may follow)
            if len(parts) >= 6 and parts[2] == "jar":
                path = Path(":".join(parts[5:]).split(" -- ")[0].strip())
                out.append((parts[0], parts[1], parts[3], path))
    return out


def lock(pom: Path = POM_PATH, path: Path = LOCK_PATH, timeout_s: float = 1200.0) -> int:
    """Write the lock file for `pom`; returns the number of jars pinned."""
    entries = []
    for group, artifact, version, file in sorted(_resolve_with_maven(pom, timeout_s)):
        data = file.read_bytes()
        entry = {"group": group, "artifact": artifact, "version": version}
        entry["file"] = f"{artifact}-{version}.jar"
        entry["sha1"] = hashlib.sha1(data).hexdigest()
        entry["sha256"] = hashlib.sha256(data).hexdigest()
        with urllib.request.urlopen(_url(entry) + ".sha1", timeout=60) as resp:
            published = resp.read().decode().split()[0].strip()
        if published != entry["sha1"]:
            raise BrokerError(f"{entry['file']}: Maven Central publishes SHA-1 {published}")
        entries.append(entry)
    doc = {
        "about": (
            "Written by `python -m dgstream.infra.kafka.broker lock` from pom.xml; do not edit."
        ),
        "pom_sha256": _pom_hash(pom),
        "jars": entries,
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return len(entries)

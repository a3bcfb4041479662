"""Kafka's jars from Maven Central, resolved once into a cache that a marker file vouches for.

`fetch()` runs Maven on `infra/kafka/pom.xml` (Kafka 4.x, its runtime dependencies and a
log4j2 binding) only when the marker's pom hash or its jar list does not match: a second
call never touches the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from infra.kafka.broker.state import REPO_ROOT, BrokerError, locked

POM_PATH = Path(__file__).resolve().parents[1] / "pom.xml"
LIB_ENV = "DGSTREAM_KAFKA_LIB"
MARKER_NAME = ".dgstream-fetch.json"


@dataclass(frozen=True)
class FetchResult:
    lib_dir: Path
    fetched: bool  # False: the cache was already complete and Maven was not run
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


def fetch(
    lib_dir: str | os.PathLike[str] | None = None,
    *,
    pom: str | os.PathLike[str] | None = None,
    force: bool = False,
    timeout_s: float = 1200.0,
) -> FetchResult:
    """Resolve the broker's jars into `lib_dir` with Maven, unless already there.

    When the marker file matches the pom's hash and every jar it lists exists, this returns
    at once without running Maven (no network).
    """
    t0 = time.monotonic()
    lib = _lib(lib_dir)
    pom_file = Path(pom).resolve() if pom is not None else POM_PATH
    digest = _pom_hash(pom_file)
    if not force and (n := _cache_complete(lib, digest)):
        return FetchResult(lib, False, time.monotonic() - t0, n)
    with locked(lib.parent / ".fetch.lock"):
        if not force and (n := _cache_complete(lib, digest)):  # another process did it
            return FetchResult(lib, False, time.monotonic() - t0, n)
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerError(
                "Apache Maven (`mvn`) is needed once to fetch Kafka's jars from Maven Central "
                f"into {lib}; install it (and Java 17+) or point {LIB_ENV} at a filled cache"
            )
        staging = Path(tempfile.mkdtemp(prefix=".lib-staging-", dir=lib.parent))
        try:
            cmd = [
                mvn,
                "-q",
                "-B",
                "-f",
                str(pom_file),
                "dependency:copy-dependencies",
                f"-DoutputDirectory={staging}",
                "-DincludeScope=runtime",
            ]
            try:
                proc = subprocess.run(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                raise BrokerError(f"mvn did not finish within {timeout_s:.0f}s") from exc
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
                raise BrokerError(
                    f"mvn exited with {proc.returncode} fetching Kafka's jars:\n" + "\n".join(tail)
                )
            jars = sorted(p.name for p in staging.glob("*.jar"))
            if not any(j.startswith("kafka_2.13-") for j in jars):
                raise BrokerError(f"mvn ran but no kafka_2.13 jar appeared in {staging}")
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

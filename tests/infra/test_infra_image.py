"""The image the manifests run (infra/docker/Dockerfile): no Docker engine here to build it,
so the test reads the Dockerfile's instructions and checks them against the project: the
Ray pin equals the base image's Ray, the Python tag satisfies `requires-python`, every
package the distribution ships is copied in (and not hidden by .dockerignore), the extra it
installs exists, it runs as a non-root user, and the tag the manifests pull is the
project's version."""

from __future__ import annotations

import fnmatch
import re
import tomllib

import pytest
from infra_helpers import COMPOSE_DIR, K8S, ROOT

pytestmark = pytest.mark.unit

DOCKERFILE = ROOT / "infra" / "docker" / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


@pytest.fixture(scope="module")
def steps() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def _one(steps: list[tuple[str, str]], word: str) -> str:
    found = [args for w, args in steps if w == word]
    assert len(found) == 1, f"{word}: {len(found)} instructions, expected 1"
    return found[0]


def test_parser_reads_continuations_and_skips_comments() -> None:
    got = instructions("# c\nFROM a:1\nRUN x \\\n    y\nuser ray\n")
    assert got == [("FROM", "a:1"), ("RUN", "x y"), ("USER", "ray")]


def test_ray_pin_equals_base_image_and_python_matches(steps: list[tuple[str, str]]) -> None:
    base = _one(steps, "FROM")
    m = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-cu\d+", base)
    assert m, f"FROM {base}: expected rayproject/ray:<version>-py<XY>-cu<N>"
    ray_version, major, minor = m.group(1), int(m.group(2)), int(m.group(3))
    run = " ".join(args for w, args in steps if w == "RUN")
    pins = re.findall(r"ray\[default\]==(\S+?)[\"' ]", run + " ")
    assert pins == [ray_version], f"the RUN must pin ray[default]=={ray_version}, has {pins}"
    # The pin is inside the project's own Ray range.
    ray_req = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("ray["))
    low, high = re.search(r">=([\d.]+),<([\d.]+)", ray_req).groups()  # type: ignore[union-attr]
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(low) <= as_tuple(ray_version) < as_tuple(high), ray_req
    need = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert (major, minor) >= as_tuple(need), f"py{major}{minor} < requires-python {need}"


def test_every_shipped_package_is_copied_and_not_ignored(steps: list[tuple[str, str]]) -> None:
    copied: set[str] = set()
    for word, args in steps:
        if word == "COPY":
            parts = [p for p in args.split() if not p.startswith("--")]
            copied.update(p.rstrip("/") for p in parts[:-1])
    for path in copied:
        assert (ROOT / path).exists(), f"COPY {path}: not in the repository"
    includes = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in includes}
    assert packages <= copied, f"not copied: {sorted(packages - copied)}"
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied
    ignored = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    hidden = {p for p in copied for pat in ignored if fnmatch.fnmatch(p, pat)}
    assert not hidden, f".dockerignore hides what the Dockerfile copies: {sorted(hidden)}"


def test_installs_the_gpu_extra_and_runs_unprivileged(steps: list[tuple[str, str]]) -> None:
    run = " ".join(args for w, args in steps if w == "RUN")
    extras = re.findall(r"\.\[(\w+)\]", run)
    assert extras == ["vllm"], extras
    assert "vllm" in PYPROJECT["project"]["optional-dependencies"]
    assert _one(steps, "USER") not in ("root", "0")


def test_manifests_pull_this_projects_version() -> None:
    version = PYPROJECT["project"]["version"]
    tag = f"ghcr.io/example/dgstream:{version}"
    assert f"-t {tag} " in DOCKERFILE.read_text(), "the build command in the header"
    files = [*K8S.glob("*.yaml"), COMPOSE_DIR / "docker-compose.yml"]
    images = {
        m.group(1)
        for f in files
        for m in re.finditer(r"(ghcr\.io/example/dgstream:\S+)", f.read_text())
    }
    assert images == {tag}, images

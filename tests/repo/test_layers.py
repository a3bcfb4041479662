"""The layers hold: every import in the source (module level and inside functions) is read
from the files, and none crosses a line the architecture draws.

- the contract (`schemas/`) imports neither the engine nor the worker (nothing of `workers/`);
- the engine (`workers/engine/`) imports neither Kafka nor the worker (only itself, the
  contract and libraries);
- the worker (`workers/`) imports neither `topology/` nor `bench/`;
- `infra/` imports neither `topology/` nor `bench/`;
- nothing the product ships imports `bench/` or `tests/`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "workers", "topology", "infra", "dgstream")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def _modules(package: str) -> dict[str, set[str]]:
    return {
        str(p.relative_to(ROOT)): _imports(p)
        for p in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


# (files under this folder, the imports they must not make, except these prefixes)
RULES: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("schemas", ("workers", "topology", "infra", "dgstream", "kafka", "ray"), ()),
    ("workers/engine", ("workers", "kafka", "ray", "topology", "infra"), ("workers.engine",)),
    ("workers", ("topology", "bench", "tests"), ()),
    ("infra", ("topology", "bench", "tests"), ()),
    ("topology", ("bench", "tests"), ()),
    ("dgstream", ("topology", "bench", "tests"), ()),
]


@pytest.mark.parametrize(("folder", "forbidden", "allowed"), RULES, ids=[r[0] for r in RULES])
def test_no_import_crosses_a_layer(
    folder: str, forbidden: tuple[str, ...], allowed: tuple[str, ...]
) -> None:
    package = folder.split("/")[0]
    crossings = []
    for path, names in _modules(package).items():
        if not path.startswith(folder + "/"):
            continue
        for name in sorted(names):
            if any(_under(name, a) for a in allowed):
                continue
            if any(_under(name, f) for f in forbidden):
                crossings.append(f"{path}: import {name}")
    assert not crossings, "\n".join(crossings)


def test_the_rules_see_imports_inside_functions(tmp_path: Path) -> None:
    """The check is not vacuous: a function-level import is found too."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from topology.spec import x\n    import kafka.admin\n")
    assert _imports(f) == {"topology.spec", "kafka.admin"}


# Tests that import `bench/`: none (the demo model's training is topology/demo_tasks/training).
_TESTS_OF_BENCH: set[str] = set()


def test_tests_stand_alone() -> None:
    """No test imports `bench/` (benchmarks import from the product or from tests/support,
    never the other way round); the product never imports tests/support."""
    crossings = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if "__pycache__" in path.parts or rel in _TESTS_OF_BENCH:
            continue
        crossings += [f"{rel}: import {n}" for n in sorted(_imports(path)) if _under(n, "bench")]
    for package in PACKAGES:
        for rel, names in _modules(package).items():
            crossings += [f"{rel}: import {n}" for n in sorted(names) if _under(n, "support")]
    assert not crossings, "\n".join(crossings)

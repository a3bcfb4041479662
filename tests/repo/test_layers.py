"""The layers hold: every import in the source (module level and inside functions) is read
from the files, and none crosses a line the architecture draws.

- the contract (`schemas/`) imports neither the engine nor the worker (nothing of `workers/`);
- the engine (`workers/engine/`) imports neither Kafka nor the worker (only itself, the
  contract and libraries);
- the read path inside vLLM (`workers/engine/vllm_reads/`, a vLLM plugin that runs in
  vLLM's processes) imports only itself: the engine's front end (`workers/engine/vllm/`)
  reads it, never the other way, and its modules import each other in one direction even
  counting imports for typing only (the sampler takes a protocol of the model state);
- the worker (`workers/`) imports neither `topology/` nor `bench/`;
- `infra/` imports neither `topology/` nor `bench/`;
- the control plane (`topology/` outside `topology/cli/`: the spec, the controller, the
  autoscaler, ...) does not import the command line (`topology/cli/`), even for typing;
- nothing the product ships imports `bench/` or `tests/`, and the wheel's packages leave
  `bench/` out (the demo model's training, `bench/training/`, included);
- benchmarks are a package: the scripts (`bench/*.py`) and their library code (the harness,
  `bench/harness/`, and the demo model's training, `bench/training/`) import the product
  and `bench`, never `tests/` (neither `tests/support/` nor the helpers beside it), with no
  `sys.path` edit to reach them; tests may import the library code (`bench.harness`,
  `bench.training`), never a script; the library code imports no script, and the training
  nothing first-party but the product and itself. Until they move, `bench/gpu/` and the
  named imports of `_BENCH_REACHES_TESTS` are the exceptions;
- no import circle inside `workers/` (through function-level imports and packages' __init__
  too), and the stream worker's roles (`workers/stream/`) import none of each other: only
  the consume loop and the facade (`workers/hosting/worker.py`) know them all.
"""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "workers", "topology", "infra", "dgstream")


# The folders that are the subpackages of `dgstream` (dgstream/workers -> ../workers, ...).
SUBPACKAGES = ("schemas", "workers", "topology", "infra")


def _local(name: str) -> str:
    """An import's name as the folders spell it: `dgstream.workers.x` is `workers.x` (the
    file workers/x.py), so the rules below read as the layout draws them. Any other name,
    a top-level `workers` included, is left as it is (`test_one_import_name` refuses those)."""
    head, _, rest = name.partition(".")
    if head == "dgstream" and rest.split(".")[0] in SUBPACKAGES:
        return rest
    return name


def _raw_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def _imports(path: Path) -> set[str]:
    return {_local(n) for n in _raw_imports(path)}


def _modules(package: str) -> dict[str, set[str]]:
    """The files of a folder and their imports; dgstream/'s own files only (its subpackages
    are the other folders: links here, real copies in mutmut's mutants/)."""
    return {
        str(p.relative_to(ROOT)): _imports(p)
        for p in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in p.parts
        and not (package == "dgstream" and p.relative_to(ROOT).parts[1] in SUBPACKAGES)
    }


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


# (files under this folder, the imports they must not make, except these prefixes)
RULES: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("schemas", ("workers", "topology", "infra", "dgstream", "kafka", "ray"), ()),
    (
        "workers/engine",
        ("workers", "kafka", "ray", "topology", "infra"),
        ("workers.engine",),
    ),
    ("workers/engine/vllm_reads", ("workers",), ("workers.engine.vllm_reads",)),
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
    f.write_text("def f():\n    from dgstream.topology.spec import x\n    import kafka.admin\n")
    assert _imports(f) == {"topology.spec", "kafka.admin"}


def _control_plane_reaches_cli(root: Path) -> list[str]:
    """The imports of the command line (`topology.cli`, `from dgstream.topology import cli`
    too, and imports for typing) by a module of `topology/` outside `topology/cli/`."""
    crossings = []
    for path in sorted((root / "topology").rglob("*.py")):
        rel = path.relative_to(root)
        if "__pycache__" in path.parts or rel.parts[:2] == ("topology", "cli"):
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(_local(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                module = _local(node.module)
                names.add(module)
                names.update(f"{module}.{alias.name}" for alias in node.names)
        crossings += [f"{rel}: import {n}" for n in sorted(names) if _under(n, "topology.cli")]
    return crossings


def test_the_control_plane_does_not_import_the_command_line() -> None:
    """The spec, the controller, the autoscaler and the rest of `topology/` run without the
    `dgstream` command: only `topology/cli/` imports it."""
    crossings = _control_plane_reaches_cli(ROOT)
    assert not crossings, "\n".join(crossings)


def test_the_control_plane_check_finds_a_crossing(tmp_path: Path) -> None:
    """The check is not vacuous: a function-level `from dgstream.topology import cli` and an
    import for typing are found; the command line importing itself is not a crossing."""
    (tmp_path / "topology" / "cli").mkdir(parents=True)
    (tmp_path / "topology" / "spec.py").write_text(
        "def f():\n    from dgstream.topology import cli\n"
    )
    (tmp_path / "topology" / "controller.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from dgstream.topology.cli.commands import Refused\n"
        "from dgstream.topology import clingy\n"
    )
    (tmp_path / "topology" / "cli" / "app.py").write_text(
        "from dgstream.topology.cli import commands\n"
    )
    assert _control_plane_reaches_cli(tmp_path) == [
        "topology/controller.py: import topology.cli.commands",
        "topology/controller.py: import topology.cli.commands.Refused",
        "topology/spec.py: import topology.cli",
    ]


# What may still reach tests/ from bench/: nothing (the GPU scripts' harness moved too).
_BENCH_REACHES_TESTS: dict[str, set[str]] = {}

# bench/'s library code: what the scripts and the tests import, which imports no script.
_BENCH_LIBRARIES = ("bench.harness", "bench.training")


def _library(name: str) -> bool:
    return any(_under(name, lib) for lib in _BENCH_LIBRARIES)


def _test_helper_names() -> set[str]:
    """The top-level names a module of tests/ is imported by (pytest puts tests/ and each
    folder with a conftest.py on the path): `support`, `tests`, and every helper module's
    stem (`kafka_fakes`, `secure_kafka`, `dashboard_probe`, ...)."""
    names = {"tests", "support"}
    for path in (ROOT / "tests").rglob("*.py"):
        if "__pycache__" in path.parts or path.name.startswith("test_"):
            continue
        if path.name not in ("conftest.py", "__init__.py"):
            names.add(path.stem)
    return names


def _bench_crossings(root: Path, helpers: set[str]) -> list[str]:
    """bench/'s imports of tests/ (outside the exceptions), the library code's imports of
    the scripts, and the tests' imports of a script."""
    crossings = []
    for path in sorted((root / "bench").rglob("*.py")):
        rel = str(path.relative_to(root))
        if "__pycache__" in path.parts:
            continue
        allowed = _BENCH_REACHES_TESTS.get(rel, set())
        for name in sorted(_imports(path)):
            if name in allowed:
                continue
            if name.split(".")[0] in helpers:
                crossings.append(f"{rel}: import {name} (tests/)")
            elif (
                _library(rel.removesuffix(".py").replace("/", "."))
                and _under(name, "bench")
                and not (_library(name) or name == "bench")
            ):
                crossings.append(f"{rel}: import {name} (a script)")
    for path in sorted((root / "tests").rglob("*.py")):
        rel = str(path.relative_to(root))
        if "__pycache__" in path.parts:
            continue
        crossings += [
            f"{rel}: import {n} (a script)"
            for n in sorted(_imports(path))
            if _under(n, "bench") and not _library(n)
        ]
    return crossings


def test_benchmarks_are_a_package() -> None:
    """bench/ reaches nothing of tests/ (bench/gpu/ included), the library code (harness,
    training) no script, and the tests only the library code."""
    crossings = _bench_crossings(ROOT, _test_helper_names())
    assert not crossings, "\n".join(crossings)
    # The exceptions are real: each still imports what it is excused for.
    for rel, names in _BENCH_REACHES_TESTS.items():
        assert names <= _imports(ROOT / rel), (
            f"{rel} no longer needs {names - _imports(ROOT / rel)}"
        )


def test_the_bench_check_finds_a_crossing(tmp_path: Path) -> None:
    """The check is not vacuous: bench/ importing tests/support or a test helper, the
    library code (harness, training) importing a script, and a test importing a script are
    each found; a test importing the training is not."""
    (tmp_path / "bench" / "harness").mkdir(parents=True)
    (tmp_path / "bench" / "training").mkdir()
    (tmp_path / "bench" / "gpu").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "bench" / "x.py").write_text("def f():\n    from support.fault_matrix import m\n")
    (tmp_path / "bench" / "y.py").write_text("import kafka_fakes\nfrom bench.harness import z\n")
    (tmp_path / "bench" / "harness" / "z.py").write_text("from bench.report import figure\n")
    (tmp_path / "bench" / "training" / "t.py").write_text(
        "from bench.training.u import v\nfrom bench.train_demo_model import main\n"
    )
    (tmp_path / "bench" / "gpu" / "w.py").write_text("from support.vllm_soak import SIZES\n")
    (tmp_path / "tests" / "test_a.py").write_text(
        "from bench.harness.z import q\nfrom bench.training.t import r\nimport bench.x\n"
    )
    assert _bench_crossings(tmp_path, {"support", "kafka_fakes"}) == [
        "bench/gpu/w.py: import support.vllm_soak (tests/)",
        "bench/harness/z.py: import bench.report (a script)",
        "bench/training/t.py: import bench.train_demo_model (a script)",
        "bench/x.py: import support.fault_matrix (tests/)",
        "bench/y.py: import kafka_fakes (tests/)",
        "tests/test_a.py: import bench.x (a script)",
    ]


def test_the_training_imports_only_the_product_and_itself() -> None:
    """The demo model's training (`bench/training/`) reaches nothing first-party but the
    shipped packages and its own modules: neither a script, the harness, nor tests/."""
    first_party = {*PACKAGES, "bench", *_test_helper_names()}
    crossings = []
    for path in sorted((ROOT / "bench" / "training").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        crossings += [
            f"{path.relative_to(ROOT)}: import {n}"
            for n in sorted(_imports(path))
            if n.split(".")[0] in first_party
            and not any(_under(n, p) for p in (*PACKAGES, "bench.training"))
        ]
    assert not crossings, "\n".join(crossings)
    assert (ROOT / "bench" / "training" / "loop.py").is_file()  # not vacuous


def test_the_wheel_leaves_bench_out() -> None:
    """The wheel's packages (pyproject's `[tool.setuptools]` find patterns) are the
    product's: neither bench/ nor the demo model's training (`bench.training`) matches."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert include == ["dgstream*"]
    for name in ("bench", "bench.training", "bench.training.loop", "bench.harness"):
        assert not any(fnmatch.fnmatchcase(name, p) for p in include), name


def test_the_product_never_imports_tests_or_bench() -> None:
    """What the product ships imports neither tests/ (its helpers, tests/support) nor bench/
    (the demo model's training, `bench.training`, included)."""
    helpers = _test_helper_names()
    crossings = []
    for package in PACKAGES:
        for rel, names in _modules(package).items():
            crossings += [
                f"{rel}: import {n}"
                for n in sorted(names)
                if n.split(".")[0] in helpers or _under(n, "bench")
            ]
    assert not crossings, "\n".join(crossings)


# ------------------------------------------------------------------ no circles in workers/


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _typing_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): a block that never runs."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` outside `if TYPE_CHECKING:` blocks (their `else` runs)."""
    out: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        if _typing_only(node):
            assert isinstance(node, ast.If)
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))
    return out


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports when it runs, at module level or inside a
    function (not under `if TYPE_CHECKING:`, which never runs): `from a.b import c` is a.b.c
    when that is a module, else a.b; importing a module runs its packages' __init__ first,
    so those count too."""
    tree = ast.parse(path.read_text(), str(path))
    named: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            named.update(_local(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                module = _local(node.module)
                sub = f"{module}.{alias.name}"
                named.add(sub if sub in known else module)
    out: set[str] = set()
    for name in named:
        parts = name.split(".")
        out.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in known)
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (itself and its own packages left out:
    a module does not import the package it is in)."""
    files = {_module_name(root, p): p for p in sorted((root / package).rglob("*.py"))}
    files = {m: p for m, p in files.items() if "__pycache__" not in p.parts}
    known = set(files)
    graph = {}
    for module, path in files.items():
        own = {module, *(module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1))}
        graph[module] = _imported_modules(path, known) - own
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in order, the first repeated at the end),
    or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_circle_inside_workers() -> None:
    """The worker's modules import each other in one direction only: the stream roles talk
    through what the facade hands them (`workers.stream.shared`, the error table), not by
    importing each other in a circle."""
    cycle = find_cycle(import_graph(ROOT, "workers"))
    assert cycle is None, "an import circle: " + " -> ".join(cycle or [])


def test_no_import_circle_inside_the_read_path_even_for_typing() -> None:
    """The read path's modules (`workers/engine/vllm_reads/`) import each other in one
    direction, `if TYPE_CHECKING:` imports included: the model state builds the sampler,
    and the sampler names what it needs of the state as a protocol of its own."""
    folder = ROOT / "workers" / "engine" / "vllm_reads"
    files = {_module_name(ROOT, p): p for p in sorted(folder.glob("*.py"))}
    graph = {}
    for module, path in files.items():
        names = _imports(path)
        graph[module] = {
            m for m in files if m != module and any(_under(n, m) for n in names) and "." in m
        } - {"workers.engine.vllm_reads"}
    assert {
        "workers.engine.vllm_reads.model",
        "workers.engine.vllm_reads.sampler",
    } <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "an import circle: " + " -> ".join(cycle or [])


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    """The check is not vacuous: a circle through a function-level import, a `from
    package import module` and a package's __init__ is found."""
    pkg = tmp_path / "workers"
    (pkg / "stream").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "stream" / "__init__.py").write_text("from dgstream.workers.stream.b import x\n")
    (pkg / "stream" / "a.py").write_text("def f():\n    from dgstream.workers import c\n")
    (pkg / "stream" / "b.py").write_text("x = 1\n")
    (pkg / "c.py").write_text("import dgstream.workers.stream.b\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dgstream.workers import c\n"
        "else:\n    import json\n"
    )
    (pkg / "e.py").write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    import dgstream.workers.d\n"
    )
    graph = import_graph(tmp_path, "workers")
    assert graph["workers.c"] == {"workers.stream", "workers.stream.b"}
    assert graph["workers.d"] == set() and graph["workers.e"] == set()  # typing only
    assert find_cycle(graph) is None  # b imports nothing back
    (pkg / "stream" / "b.py").write_text("from dgstream.workers.stream.a import f\n")
    cycle = find_cycle(import_graph(tmp_path, "workers"))
    assert cycle is not None and cycle[0] == cycle[-1]
    assert {"workers.stream.a", "workers.c", "workers.stream.b"} <= set(cycle)


# The roles of workers/stream/; each imports only the shared state and the error table of
# that package (the loop conducts them, the facade builds them).
_ROLES = ("intake", "ownership", "engine_stage", "recovery", "delivery")


def test_the_stream_roles_do_not_import_each_other() -> None:
    graph = import_graph(ROOT, "workers")
    roles = {f"workers.stream.{r}" for r in _ROLES}
    assert roles <= set(graph), sorted(roles - set(graph))
    crossings = [
        f"{m} imports {sorted(graph[m] & roles)}" for m in sorted(roles) if graph[m] & roles
    ]
    assert not crossings, "\n".join(crossings)
    knows_them = sorted(m for m, names in graph.items() if names & roles)
    assert knows_them == ["workers.hosting.worker", "workers.stream.loop"], knows_them


# ------------------------------------------------------------------ the worker's shape

# What a new engineer can hold in their head: the facade stays short (the roles are
# workers/stream/'s modules) and no class of the worker grows a crowd of methods.
_FACADE_LINES = 300
_METHODS_PER_CLASS = 20


def test_the_worker_facade_is_short_and_no_worker_class_is_crowded() -> None:
    lines = len((ROOT / "workers" / "hosting" / "worker.py").read_text().splitlines())
    assert lines <= _FACADE_LINES, f"workers/hosting/worker.py has {lines} lines"
    crowded = []
    for path in sorted((ROOT / "workers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                # (mutmut's copy of the source, mutants/, holds a method per mutant)
                defs = [
                    d
                    for d in node.body
                    if isinstance(d, ast.FunctionDef | ast.AsyncFunctionDef)
                    and "__mutmut_" not in d.name
                ]
                if len(defs) > _METHODS_PER_CLASS:
                    crowded.append(f"{path.relative_to(ROOT)}: {node.name} has {len(defs)} methods")
    assert not crowded, "\n".join(crowded)


# ------------------------------------------------------------------ one import name


def _top_level_imports(root: Path) -> list[str]:
    """Every import of a folder's name as a top-level package (`import workers`, `from
    schemas import x`) in the repository's Python files: each must go through `dgstream`."""
    found = []
    for folder in (*SUBPACKAGES, "dgstream", "bench", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            found += [
                f"{path.relative_to(root)}: import {n}"
                for n in sorted(_raw_imports(path))
                if n.split(".")[0] in SUBPACKAGES
            ]
    return found


def test_one_import_name() -> None:
    """The repository's folders are imported as `dgstream.<folder>` only, the links that
    make them subpackages point at them, and the wheel's packages are `dgstream*` alone."""
    found = _top_level_imports(ROOT)
    assert not found, "\n".join(found)
    if not (ROOT / ".git").exists():
        return  # mutmut's copy (mutants/) holds the folders as real copies, not links
    for name in SUBPACKAGES:
        link = ROOT / "dgstream" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), link


def test_the_import_name_check_finds_a_top_level_import(tmp_path: Path) -> None:
    """The check is not vacuous: a function-level `from schemas import x` and an `import
    workers.y` are found; `dgstream.schemas` and a library named like a folder's module
    (`kafka`) are not."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "a.py").write_text(
        "import kafka\nfrom dgstream.schemas import x\ndef f():\n    from schemas import x\n"
    )
    (tmp_path / "bench" / "b.py").write_text("import workers.y\n")
    assert _top_level_imports(tmp_path) == [
        "bench/a.py: import schemas",
        "bench/b.py: import workers.y",
    ]


@pytest.mark.slow
def test_the_wheel_installs_one_name(tmp_path: Path) -> None:
    """Built as a user's pip builds it, the wheel holds `dgstream/` (the linked folders as
    real files, the demo model's weights among them) and its metadata, no other top-level
    name; its command and vLLM plugin entry point name `dgstream.` modules."""
    import subprocess
    import sys
    import zipfile

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("dgstream-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"dgstream"}, tops
    for sub in SUBPACKAGES:
        assert f"dgstream/{sub}/__init__.py" in names, sub
    assert "dgstream/workers/engine/weights/demo/model.safetensors" in names
    assert "dgstream/schemas/json/request.schema.json" in names
    (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "dgstream = dgstream.topology.cli:main" in text
    assert "dgstream_reads = dgstream.workers.engine.vllm_reads:register" in text

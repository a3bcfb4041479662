"""`make mutation`'s report: mutmut's verdict on every mutant, per module.

Reads what `mutmut run` left in mutants/ for each module of pyproject's [tool.mutmut]
`only_mutate`, and counts each mutant as killed (a test failed or ran out of time), survived,
or not run by any test. A survivor listed in docs/mutation.md as equivalent (it cannot change
behaviour) is counted apart; every other one is printed with its line and change, to be
killed by a new test or explained there.

    python -m bench.mutation_score           # the table, and the survivors not yet explained
    python -m bench.mutation_score --write   # also rewrites its section of docs/benchmarks.md

A run of some modules only (`mutmut run "dgstream.workers.stream.recovery*"`) leaves the others'
mutants without a verdict: their rows are kept as docs/benchmarks.md shows them, with the
date they were measured, and only the modules this run reached get today's.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import tomllib
from collections import Counter
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from bench.report import DOC, write_section

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"
EQUIVALENTS = ROOT / "docs" / "mutation.md"
TARGET = 0.85  # the share of mutants each module's tests must kill
# mutmut's exit codes (mutmut.stats.status_by_exit_code): 1 and 3 are failed tests; 24, 36,
# 152, 255 and -24 are time-outs; 37 is refused by the type checker.
KILLED = {1, 3, 24, -24, 36, 37, 152, 255}
SURVIVED = {0}
NOT_RUN = {5, 33}  # no test reaches the mutated function
_NAME = re.compile(r"`([\w.]+\.x\S+?__mutmut_\d+)`")


@dataclass(frozen=True)
class Survivor:
    name: str
    module: str
    line: int
    before: str
    after: str


def modules() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return list(config["only_mutate"])


def shown_name(module: str) -> str:
    """A module as the page's table names it: its folder's path (`workers/stream/intake.py`),
    the import name less `dgstream.` (mutmut walks it as dgstream/workers/...)."""
    return module.removeprefix("dgstream/")


def verdicts(module: str) -> dict[str, int | None]:
    meta = json.loads((MUTANTS / f"{module}.meta").read_text())
    return dict(meta["exit_code_by_key"])


def measured(module: str) -> bool:
    """Whether this mutants/ holds a verdict for some mutant of `module`."""
    meta = MUTANTS / f"{module}.meta"
    return meta.exists() and any(code is not None for code in verdicts(module).values())


def equivalents() -> set[str]:
    return set(_NAME.findall(EQUIVALENTS.read_text())) if EQUIVALENTS.exists() else set()


def _def_line(source: str, mangled: str) -> int:
    """The line of `def` of the function mutmut calls `mangled` ("x_f" or "xǁClassǁf")."""
    parts = mangled.split("ǁ")
    cls, func = (parts[1], parts[2]) if len(parts) == 3 else (None, mangled[2:])
    for node in ast.walk(ast.parse(source)):
        body = node.body if isinstance(node, ast.ClassDef) and node.name == cls else None
        if cls is None and isinstance(node, ast.Module):
            body = node.body
        for item in body or []:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == func:
                return item.lineno
    raise LookupError(f"no function {mangled} in the source")


def _def_index(lines: list[str]) -> int:
    return next(i for i, t in enumerate(lines) if t.lstrip().startswith(("def ", "async def ")))


def survivor(module: str, name: str) -> Survivor:
    """Where mutant `name` changes `module`, from the copy mutmut made (mutants/...)."""
    spans = json.loads((MUTANTS / f"{module}.spans").read_text())["spans"]
    mangled = name.rsplit(".", 1)[1]
    orig_key = mangled.rsplit("__mutmut_", 1)[0] + "__mutmut_orig"
    text = (MUTANTS / module).read_text().split("\n")
    orig = text[spans[orig_key][0] - 1 : spans[orig_key][1]]
    mutant = text[spans[mangled][0] - 1 : spans[mangled][1]]
    orig, mutant = orig[_def_index(orig) + 1 :], mutant[_def_index(mutant) + 1 :]
    offset = next(
        (i for i, (a, b) in enumerate(zip(orig, mutant, strict=False)) if a != b),
        min(len(orig), len(mutant)),
    )
    start = _def_line((ROOT / module).read_text(), orig_key.removesuffix("__mutmut_orig"))
    before = orig[offset].strip() if offset < len(orig) else ""
    after = mutant[offset].strip() if offset < len(mutant) else "(line removed)"
    return Survivor(name, module, start + 1 + offset, before, after)


@dataclass(frozen=True)
class Score:
    module: str
    total: int
    killed: int
    survived: int
    equivalent: int
    not_run: int
    other: int
    when: str = ""  # the date it was measured (ISO)

    @property
    def score(self) -> float:
        return self.killed / self.total if self.total else 1.0

    @property
    def of_non_equivalent(self) -> float:
        live = self.total - self.equivalent
        return self.killed / live if live else 1.0


def score(module: str, equivalent: set[str]) -> tuple[Score, list[str]]:
    codes = verdicts(module)
    kinds: Counter[str] = Counter()
    unexplained = []
    for name, code in codes.items():
        if code in KILLED:
            kinds["killed"] += 1
        elif code in SURVIVED and name in equivalent:
            kinds["equivalent"] += 1
        elif code in SURVIVED:
            kinds["survived"] += 1
            unexplained.append(name)
        elif code in NOT_RUN:
            kinds["not_run"] += 1
            unexplained.append(name)
        else:
            kinds["other"] += 1
    s = Score(
        shown_name(module),
        len(codes),
        kinds["killed"],
        kinds["survived"],
        kinds["equivalent"],
        kinds["not_run"],
        kinds["other"],
        date.today().isoformat(),
    )
    return s, unexplained


_ROW = re.compile(r"^\| `(?P<module>[^`]+)` \|(?P<cells>.*)\|\s*$")
_HEADER_DATE = re.compile(r"^## Mutation score: mutmut [\d.]+ \((?P<date>[\d-]+)\)", re.M)


def shown(doc: Path = DOC) -> dict[str, Score]:
    """The rows the page's mutation table shows now, by module (a row without a date of
    its own was measured on the date of the section's heading)."""
    text = doc.read_text() if doc.exists() else ""
    start, end = text.find("<!-- mutation:start -->"), text.find("<!-- mutation:end -->")
    section = text[start:end] if start >= 0 else ""
    heading = _HEADER_DATE.search(section)
    out = {}
    for line in section.splitlines():
        m = _ROW.match(line)
        if m is None:
            continue
        cells = [c.strip() for c in m["cells"].split("|")]
        total, killed, equivalent, survived, not_run = (int(c) for c in cells[:5])
        when = cells[7] if len(cells) > 7 else (heading["date"] if heading else "")
        other = total - killed - equivalent - survived - not_run
        out[m["module"]] = Score(
            m["module"], total, killed, survived, equivalent, not_run, other, when
        )
    return out


def table(scores: list[Score]) -> str:
    rows = [
        "| module | mutants | killed | equivalent | survived | no test | score | of the rest "
        "| measured |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in scores:
        rows.append(
            f"| `{s.module}` | {s.total} | {s.killed} | {s.equivalent} | {s.survived} | "
            f"{s.not_run} | {s.score:.1%} | {s.of_non_equivalent:.1%} | {s.when} |"
        )
    return "\n".join(rows)


def section(scores: list[Score]) -> str:
    total = sum(s.total for s in scores)
    killed = sum(s.killed for s in scores)
    lines = [
        f"## Mutation score: mutmut 3.8.1 ({max(s.when for s in scores)})",
        "",
        "`make mutation` (not in CI: about an hour and a half on 2 cores, one mutmut worker at",
        "nice 10):",
        "mutmut changes one thing at a time in the modules below (an operator, a constant, a",
        "string, an argument) and runs the tests that reach the changed function (the",
        "broker-free tests, tests/workers/engine without the demo model's held-out run,",
        "tests/topology/test_autoscaler.py).",
        "A mutant is killed when a test fails. Equivalent mutants (no behaviour can tell them",
        "from the code) are listed, each with why, in `docs/mutation.md`. mutmut leaves",
        "decorated functions alone (pydantic validators, properties): the refusal tests in",
        "tests/schemas/test_schemas.py cover those. A module's row is from the run of the",
        "date it shows (a run of some modules keeps the other rows).",
        "",
        table(scores),
        "",
        f"All modules: {killed} of {total} killed ({killed / total:.1%}).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite docs/benchmarks.md's section")
    args = ap.parse_args(argv)
    equivalent = equivalents()
    before = shown()
    scores = []
    for module in modules():
        if not measured(module) and shown_name(module) in before:
            # not reached by this run: as the page shows it
            scores.append(before[shown_name(module)])
            continue
        if not (MUTANTS / f"{module}.meta").exists():
            print(f"not measured yet: {shown_name(module)} (mutmut run it)")
            continue
        s, unexplained = score(module, equivalent)
        scores.append(s)
        for name in unexplained:
            sv = survivor(module, name)
            print(f"unexplained: {module}:{sv.line} {name}: {sv.before!r} -> {sv.after!r}")
    print(table(scores))
    low = [s.module for s in scores if s.score < TARGET]
    if low:
        print(f"below {TARGET:.0%} killed: {', '.join(low)}")
    if args.write:
        write_section("mutation", section(scores))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

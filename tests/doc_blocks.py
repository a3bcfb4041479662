"""The fenced blocks of README.md and docs/*.md, and how each is checked (the docs' own tests:
tests/repo/test_doc_examples.py and tests/repo/test_doc_walkthrough.py).

Every fenced block is one example. Its kind is its info string (json, yaml, python, sh,
bash, console; text or none: a block of output), and an HTML comment on the line before the
fence (blank lines between allowed) may say more:

    <!-- not-run: REASON -->           not run; REASON is shown in the test report (a
                                       skip), after the checks that need no running
    <!-- output -->                    what the code block before it prints
    <!-- output-of: ask ARGS -->       what `dgstream ask ARGS` prints for the request
                                       block before it (ARGS e.g. `--json`, `--jev`)
    <!-- expect-error: CODE -->        a request (json) refused with CODE, or a topology
                                       (yaml) refused when it loads (CODE: `load`) with
                                       the message its `<!-- output -->` block shows
    <!-- walkthrough: NAME -->         one step of walk-through NAME, run in page order by
                                       its own test (one test for the whole walk-through)

Without a comment: a json block must be a request the worker accepts (or no request at
all), a yaml block a topology that loads (or a `kafka:` section alone; a fragment, such as a
section of the topology, a pipeline's fields or more pipelines, loads inside a minimal
topology, `...` standing for what it leaves out), a python block runs (and prints what an
`output` block after it shows). A sh block and an output block need a
comment: a command runs only inside a walk-through, or is marked not-run with its reason.
Every command of every sh block, run or not, is checked against the code: a `dgstream`
command parses with the CLI's own parser, a `python FILE` or `-m MODULE` exists and takes
each `--flag` it is given, a `bash FILE` exists and knows its first word, a `make` target
exists. docs/benchmarks.md's blocks are its benchmarks' commands (untagged: they are
rendered so): each is checked so and not run, since each is the benchmark itself.

How shown output is compared (`matches`): line by line after collapsing runs of spaces; a
line `...`, or `...` inside a line, stands for anything; numbers within `NUM_TOLERANCE` of
each other are equal (the canvas noise is seeded by the request's id, and ids differ from
run to run); record ids `<topic>-<partition>-<offset>` and places `[topic/p@o]` match any
partition and offset; rates `(N/s)` any N. JSON shown is compared as a subset of the JSON
printed (a doc may trim), numbers with the same tolerance.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
CODE_KINDS = {"json", "yaml", "python", "sh"}
_ALIASES = {"bash": "sh", "console": "sh", "shell": "sh", "yml": "yaml", "py": "python"}
_OUTPUT_KINDS = {"", "text", "output"}
# Probabilities move a little with the canvas noise, which the request id seeds: ids made
# by the worker (topic-partition-offset) or by the client (random) differ from run to run.
NUM_TOLERANCE = 0.02

_DIRECTIVE = re.compile(r"<!--\s*([a-z-]+)(?::\s*(.*?))?\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    kind: str  # json, yaml, python, sh, or output
    text: str
    directive: str = ""  # not-run, output, output-of, expect-error, walkthrough
    argument: str = ""
    index: int = 0  # position among the page's blocks

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def json(self) -> Any:
        return json.loads(self.text)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The page's fenced blocks, with the directive before each."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info = m.group(1), m.group(2).lower()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : end]]
        kind = _ALIASES.get(info, info)
        if kind in _OUTPUT_KINDS:
            kind = "output"
        block = Block(path, i + 1, kind, "\n".join(body) + "\n", index=len(out))
        block.directive, block.argument = _directive_before(lines, i)
        if path == BENCHMARKS and kind == "output" and not block.directive:
            block.kind = "sh"
            block.directive, block.argument = "not-run", "a benchmark: run it by hand, as shown"
        out.append(block)
        i = end + 1
    return out


def _directive_before(lines: list[str], fence: int) -> tuple[str, str]:
    j = fence - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j < 0:
        return "", ""
    m = _DIRECTIVE.search(lines[j])
    if not m or not lines[j].lstrip().startswith("<!--"):
        return "", ""
    return m.group(1), (m.group(2) or "").strip()


def every_block() -> list[Block]:
    return [b for p in pages() for b in blocks(p)]


# --------------------------------------------------------------------------- shell


@dataclass
class Command:
    """One command of a sh block: its words (a pipeline's and a `&&` list's parts, each a
    separate Command), and the output lines that follow it in a transcript."""

    line: str
    words: list[str]
    output: list[str] = field(default_factory=list)


def transcript(text: str) -> tuple[bool, list[Command]]:
    """(whether it is a transcript: `$ ` commands and their output, or a script), and its
    commands. Continuation lines (`\\`) are joined; comments dropped."""
    raw = text.splitlines()
    is_transcript = any(ln.startswith("$ ") for ln in raw)
    out: list[Command] = []
    i = 0
    while i < len(raw):
        ln = raw[i]
        if is_transcript and not ln.startswith("$ "):
            if out:
                out[-1].output.append(ln)
            i += 1
            continue
        line = ln[2:] if is_transcript else ln
        while line.rstrip().endswith("\\") and i + 1 < len(raw):
            i += 1
            line = line.rstrip()[:-1] + " " + raw[i].strip()
        i += 1
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(Command(line, _words(line)))
    return is_transcript, out


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split()


def simple_commands(words: list[str]) -> list[list[str]]:
    """The simple commands of a line: split at |, &&, ||, ;, without leading VAR=value."""
    out: list[list[str]] = [[]]
    for w in words:
        if w in ("|", "&&", "||", ";", "&"):
            out.append([])
        elif w.endswith(";"):  # `a; b` splits as "a;" "b"
            out[-1].append(w[:-1])
            out.append([])
        else:
            out[-1].append(w)
    cleaned = []
    for cmd in out:
        while cmd and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
            cmd = cmd[1:]
        if cmd:
            cleaned.append(cmd)
    return cleaned


# --------------------------------------------------------------------------- comparison

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")
_PLACE = re.compile(r"\b([A-Za-z0-9._]+?)-\d+-\d+\b")
_AT = re.compile(r"\[([A-Za-z0-9._-]+)/\d+@\d+\]")
_RATE = re.compile(r"\(\d+/s\)")


def _normal(line: str) -> str:
    line = _RATE.sub("(N/s)", line)
    line = _AT.sub(r"[\1/P@O]", line)
    line = _PLACE.sub(r"\1-P-O", line)
    return " ".join(line.split())


def _line_pattern(shown: str) -> re.Pattern[str]:
    """A shown line as a pattern: `...` anything, numbers any number (checked apart)."""
    parts = []
    for piece in re.split(r"(\.\.\.)", _normal(shown)):
        if piece == "...":
            parts.append(".*")
            continue
        pos = 0
        for m in _NUMBER.finditer(piece):
            parts.append(re.escape(piece[pos : m.start()]))
            parts.append(r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)")
            pos = m.end()
        parts.append(re.escape(piece[pos:]))
    return re.compile("^" + "".join(parts) + "$")


def _numbers_close(shown: str, got: re.Match[str]) -> bool:
    want = [float(x) for x in _NUMBER.findall(_normal(shown).replace("...", " "))]
    have = [float(x) for x in got.groups()]
    return len(want) == len(have) and all(close(a, b) for a, b in zip(want, have, strict=True))


def close(a: float, b: float) -> bool:
    """Probabilities and small figures within the tolerance; counts (10 and up) equal."""
    if abs(a) >= 10 or abs(b) >= 10:
        return a == b
    return abs(a - b) <= NUM_TOLERANCE


def matches(shown: str, printed: str, *, numbers: bool = True) -> str | None:
    """None when `printed` shows what `shown` does (the rules above), else why not.
    `numbers=False`: any number matches (a live status: throughput, lag)."""
    want = shown.strip("\n").splitlines()
    have = [_normal(ln) for ln in printed.strip("\n").splitlines() if ln.strip()]
    k = 0
    for w in want:
        if _normal(w) == "...":
            continue
        pattern = _line_pattern(w)
        while k < len(have):
            m = pattern.match(have[k])
            k += 1
            if m and (not numbers or _numbers_close(w, m)):
                break
        else:
            return f"no line like {w.strip()!r} (in order) in:\n{printed}"
    return None


def matches_any_order(shown: str, printed: str) -> str | None:
    """Each shown line matches a printed line of its own, in any order, and none is left
    over (lines starting with "(": a command's note on stderr, not its output)."""
    want = [ln for ln in shown.splitlines() if ln.strip()]
    have = [ln for ln in printed.splitlines() if ln.strip() and not ln.startswith("(")]
    if len(want) != len(have):
        return f"{len(want)} lines shown, {len(have)} printed:\n{printed}"
    left = list(have)
    for w in want:
        hit = next((h for h in left if matches(w, h) is None), None)
        if hit is None:
            return f"no line like {w!r} in:\n{printed}"
        left.remove(hit)
    return None


def json_subset(shown: Any, got: Any, where: str = "") -> str | None:
    """None when every key and value `shown` has is in `got` (numbers within the
    tolerance), else the first difference."""
    if isinstance(shown, dict):
        if not isinstance(got, dict):
            return f"{where or '.'}: an object shown, {type(got).__name__} printed"
        for k, v in shown.items():
            if k not in got:
                return f"{where}.{k}: shown, not printed"
            why = json_subset(v, got[k], f"{where}.{k}")
            if why:
                return why
        return None
    if isinstance(shown, list):
        if not isinstance(got, list) or len(got) != len(shown):
            return f"{where}: {shown!r} shown, {got!r} printed"
        for i, (a, b) in enumerate(zip(shown, got, strict=True)):
            why = json_subset(a, b, f"{where}[{i}]")
            if why:
                return why
        return None
    numeric = (int, float)
    if isinstance(shown, numeric) and isinstance(got, numeric) and not isinstance(shown, bool):
        return None if close(float(shown), float(got)) else f"{where}: {shown} shown, {got} printed"
    return None if shown == got else f"{where}: {shown!r} shown, {got!r} printed"


# --------------------------------------------------------------------------- commands

# Paths that exist elsewhere than in the repository: staged on the GPU machine, a user's.
_ELSEWHERE = (".gpu/", "/tmp/", "/etc/", "~")
_PROGRAMS_UNCHECKED = {
    "export", "echo", "cd", "grep", "cat", "ray", "kubectl", "sleep", "kill", "curl", "ls",
    "pip", "java", "mvn", "docker", "git",
}  # fmt: skip


def check_command(words: list[str]) -> str | None:
    """What is wrong with one simple command as the code stands, or None."""
    prog, args = words[0], words[1:]
    name = prog.rsplit("/", 1)[-1]
    if name == "dgstream":
        return _check_dgstream(args)
    if name in ("python", "python3"):
        return _check_python(args)
    if name == "bash":
        return _check_bash(args)
    if name == "make":
        return _check_make(args)
    if name == "mutmut" or name in _PROGRAMS_UNCHECKED:
        return None
    return f"{prog}: a program this checker does not know (teach tests/doc_blocks.py)"


def _check_dgstream(args: list[str]) -> str | None:
    import contextlib
    import io

    from dgstream.topology.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args([a for a in args if not a.startswith("$(")])
    except SystemExit as exc:
        if exc.code not in (0, None):
            return f"dgstream {' '.join(args)}: {err.getvalue().strip().splitlines()[-1]}"
    return None


def _flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2]


def _source_with_imports(path: Path) -> str:
    """A script's text, and that of the repository modules it imports (argparse options
    added elsewhere, as bench/engine_vllm.add_arguments)."""
    import ast

    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            name = node.module.replace(".", "/") + ".py"
            # the product and bench/ from the root, test support (`support.x`) from tests/
            for module in (ROOT / name, ROOT / "tests" / name):
                if module.exists():
                    text += module.read_text()
    return text


def _check_python(args: list[str]) -> str | None:
    if not args or args[0] == "-c":
        return None
    if args[0] == "-m":
        module = args[1]
        if module in ("pytest", "pip", "mutmut"):
            return None
        path = ROOT / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / module.replace(".", "/") / "__main__.py"
        if not path.exists():
            return f"python -m {module}: no such module in the repository"
        rest = args[2:]
    else:
        path = ROOT / args[0]
        if not path.exists():
            return f"python {args[0]}: no such file"
        rest = args[1:]
    source = _source_with_imports(path)

    def known(flag: str) -> bool:
        # --no-X: argparse.BooleanOptionalAction's negative of --X
        names = [flag] + ([f"--{flag[5:]}"] if flag.startswith("--no-") else [])
        return any(f'"{n}"' in source or f"'{n}'" in source for n in names)

    missing = [f for f in _flags(rest) if not known(f)]
    if missing:
        return f"{path.relative_to(ROOT)} takes no {', '.join(missing)}"
    return _check_paths(rest)


def _check_paths(args: list[str]) -> str | None:
    """Arguments that name files of the repository (docs/data/..., topology/...) exist."""
    import glob

    for a in args:
        top = a.split("/", 1)[0]
        if "/" in a and (ROOT / top).is_dir() and not a.startswith(_ELSEWHERE):
            if not glob.glob(str(ROOT / a)) and not (ROOT / a).parent.is_dir():
                return f"{a}: no such file"
            if "*" in a and not glob.glob(str(ROOT / a)):
                return f"{a}: matches no file"
    return None


def _check_bash(args: list[str]) -> str | None:
    if not args or args[0].startswith(_ELSEWHERE):
        return None
    path = ROOT / args[0]
    if not path.exists():
        return f"bash {args[0]}: no such file"
    if len(args) > 1 and not args[1].startswith("-") and args[1] not in path.read_text():
        return f"{args[0]} knows no {args[1]!r}"
    return None


def _check_make(args: list[str]) -> str | None:
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    for a in args:
        if "=" not in a and a not in targets:
            return f"make {a}: no such target"
    return None

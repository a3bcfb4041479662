"""Every fenced block of README.md and docs/*.md is an example that runs here and is
compared with what the page shows, or says why not (tests/doc_blocks.py has the rules and
the directives). One test a block; the walk-through's blocks run in order in
tests/repo/test_doc_walkthrough.py. A block this cannot place fails, so a new example is
checked from the day it is written."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from doc_blocks import (
    CODE_KINDS,
    ROOT,
    Block,
    blocks,
    check_command,
    every_block,
    json_subset,
    matches,
    matches_any_order,
    pages,
    simple_commands,
    transcript,
)

pytestmark = pytest.mark.unit

DIRECTIVES = {"not-run", "output", "output-of", "expect-error", "walkthrough"}
WALKTHROUGHS = {"readme", "readme-logs"}  # tests/repo/test_doc_walkthrough.py runs them
BLOCKS = every_block()


def _page(block: Block) -> list[Block]:
    return blocks(block.path)


def _before(block: Block, kinds: set[str]) -> Block | None:
    """The nearest block before this one (on its page) of one of `kinds`."""
    for b in reversed(_page(block)[: block.index]):
        if b.kind in kinds:
            return b
    return None


def _after(block: Block) -> Block | None:
    """The block right after this one, when it is marked as this one's output."""
    page = _page(block)
    nxt = page[block.index + 1] if block.index + 1 < len(page) else None
    return nxt if nxt is not None and nxt.directive == "output" else None


# --------------------------------------------------------------------------- placement


def _placement(b: Block) -> str | None:
    if b.kind not in CODE_KINDS | {"output"}:
        return f"{b.where}: a ```{b.kind} block: give it a kind this checker knows or mark it"
    if b.directive and b.directive not in DIRECTIVES:
        return f"{b.where}: unknown directive <!-- {b.directive} -->"
    if b.directive == "not-run" and not b.argument:
        return f"{b.where}: <!-- not-run: REASON --> needs its reason"
    if b.directive == "walkthrough" and b.argument not in WALKTHROUGHS:
        return f"{b.where}: no test runs walk-through {b.argument!r}"
    if b.kind in ("sh", "output") and not b.directive:
        what = "a command block" if b.kind == "sh" else "an output block"
        return (
            f"{b.where}: {what} needs a directive: <!-- walkthrough: NAME -->, "
            "<!-- output --> (of the block before), <!-- output-of: ask ... --> or "
            "<!-- not-run: REASON -->"
        )
    if b.directive == "output" and _before(b, CODE_KINDS) is None:
        return f"{b.where}: an output block with no code block before it"
    return None


def test_every_block_is_placed() -> None:
    assert len(pages()) > 10 and len(BLOCKS) > 25
    found = [p for p in map(_placement, BLOCKS) if p]
    assert not found, "\n".join(found)


# --------------------------------------------------------------------------- static checks


def _static(b: Block) -> None:
    """What needs no running: JSON and YAML parse, Python compiles, commands fit the code."""
    if b.kind == "json" and b.directive != "output":
        b.json  # noqa: B018 (parses, or raises)
    elif b.kind == "yaml":
        yaml.safe_load(b.text)
    elif b.kind == "python":
        compile(b.text, b.where, "exec")
    elif b.kind == "sh":
        _, commands = transcript(b.text)
        wrong = [
            why
            for c in commands
            for words in simple_commands(c.words)
            if (why := check_command(words))
        ]
        assert not wrong, f"{b.where}: " + "; ".join(wrong)


def _is_request(doc: Any) -> bool:
    return isinstance(doc, dict) and ("questions" in doc or "question_set" in doc)


def _check_json(b: Block) -> None:
    from dgstream.schemas import FallbackId, RequestError, parse_request

    doc = b.json
    if not _is_request(doc):
        assert b.directive != "expect-error", f"{b.where}: expect-error on no request"
        return
    parsed = parse_request(b.text.encode(), fallback_id=FallbackId("doc-example", "record"))
    if b.directive == "expect-error":
        assert isinstance(parsed, RequestError) and parsed.code == b.argument, parsed
    else:
        assert not isinstance(parsed, RequestError), f"{b.where}: {parsed.code}: {parsed.message}"


# A yaml fragment (a section of the topology, a pipeline's fields, another pipeline) is
# checked inside this whole topology; `...` in a fragment stands for what it leaves out.
BASE_PIPELINE: dict[str, Any] = {
    "name": "mod",
    "input_topics": ["mod.requests"],
    "output_topic": "mod.results",
    "dead_letter_topic": "mod.dead-letters",
    "consumer_group": "dgstream-mod",
}


def _elided(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _elided(v) for k, v in doc.items() if v not in ("...", ["..."])}
    if isinstance(doc, list):
        return [_elided(v) for v in doc if v not in ("...", ["..."])]
    return doc


def _whole(doc: Any) -> dict[str, Any]:
    """The topology a yaml block stands for."""
    from dgstream.topology.spec import PipelineSpec, Topology

    doc = _elided(doc)
    base: dict[str, Any] = {"kafka": {"bootstrap_servers": ["127.0.0.1:9092"]}}
    if isinstance(doc, list):  # pipelines beside the base one
        return {**base, "pipelines": [BASE_PIPELINE, *doc]}
    if set(doc) <= set(Topology.model_fields):
        pipelines = [{**BASE_PIPELINE, **p} for p in doc.get("pipelines", [{}])]
        return {**base, **doc, "pipelines": pipelines}
    unknown = set(doc) - set(PipelineSpec.model_fields)
    assert not unknown, f"neither a topology's nor a pipeline's fields: {sorted(unknown)}"
    return {**base, "pipelines": [{**BASE_PIPELINE, **doc}]}


def _check_yaml(b: Block, tmp_path: Path) -> None:
    from dgstream.topology.spec import parse_topology
    from dgstream.workers.kafka.settings import KafkaConnection

    doc = yaml.safe_load(b.text)
    if isinstance(doc, dict) and set(doc) == {"kafka"}:
        KafkaConnection.model_validate(doc["kafka"])
        return
    if b.directive != "expect-error":
        parse_topology(_whole(doc))
        return
    # `<!-- expect-error: dgstream run FILE -->`: that command on the block as FILE.
    words = b.argument.split()
    assert words[:2] == ["dgstream", "run"] and len(words) == 3, f"{b.where}: {b.argument!r}"
    (tmp_path / words[2]).write_text(b.text)
    run = subprocess.run(
        [sys.executable, "-m", "dgstream.topology.cli", *words[1:]],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, f"{b.where}: exit {run.returncode}\n{run.stderr[-2000:]}"
    shown = _after(b)
    assert shown is not None, f"{b.where}: expect-error wants the message in an output block"
    why = matches(shown.text, run.stdout + run.stderr)
    assert why is None, f"{shown.where}: {why}"


def _check_python(b: Block) -> None:
    run = subprocess.run(
        [sys.executable, "-c", b.text],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"{b.where}: exit {run.returncode}\n{run.stderr[-3000:]}"
    shown = _after(b)
    if shown is not None:
        why = matches(shown.text, run.stdout)
        assert why is None, f"{shown.where}: {why}"


def _ask(args: list[str], request: str) -> str:
    from dgstream.topology.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["ask", *args, request])
    assert rc == 0, out.getvalue()
    return out.getvalue()


def _check_output_of(b: Block) -> None:
    program, *args = b.argument.split()
    assert program == "ask", f"{b.where}: output-of knows `ask` only, not {program!r}"
    request = _before(b, {"json"})
    assert request is not None and _is_request(request.json), f"{b.where}: no request before it"
    printed = _ask(args, request.text)
    json_shown = b.kind == "json"
    why = json_subset(b.json, json.loads(printed)) if json_shown else matches(b.text, printed)
    assert why is None, f"{b.where}: {why}"


def _param(b: Block) -> Any:
    # `ask` runs the demo model on the CPU.
    marks = [pytest.mark.model] if b.directive == "output-of" else []
    return pytest.param(b, id=b.where, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_block(block: Block, tmp_path: Path) -> None:
    if _placement(block):
        pytest.fail(_placement(block))
    _static(block)
    if block.directive == "not-run":
        pytest.skip(f"not run: {block.argument}")
    if block.directive in ("walkthrough", "output"):
        return  # run in order by the walk-through's test / checked with the block before
    if block.directive == "output-of":
        _check_output_of(block)
    elif block.kind == "json":
        _check_json(block)
    elif block.kind == "yaml":
        _check_yaml(block, tmp_path)
    elif block.kind == "python":
        _check_python(block)


# --------------------------------------------------------------------------- the checker


def test_the_checker_sees_drift() -> None:
    """Not vacuous: a changed output, an unknown flag or subcommand, a request the worker
    refuses, an unmarked command block all fail."""
    assert (
        matches(
            "sent 8, refused 0 (19/s) to jev.requests", "sent 8, refused 0 (3/s) to jev.requests"
        )
        is None
    )
    assert matches("sent 8, refused 0 (19/s) to t", "sent 7, refused 0 (3/s) to t") is not None
    assert matches("a-1-0  p_yes=1.00\n...\nz", "a-0-7  p_yes=0.99\nb\nc\nz") is None
    assert matches("a-1-0  p_yes=1.00", "a-0-7  p_yes=0.90") is not None
    assert json_subset({"a": {"b": 0.5}}, {"a": {"b": 0.51, "c": 1}}) is None
    assert json_subset({"a": {"b": 0.5}}, {"a": {"b": 0.6}}) is not None
    assert json_subset({"a": "x"}, {"b": "x"}) is not None
    assert check_command(["dgstream", "tail", "t", "--from-beginning"]) is None
    assert check_command(["dgstream", "tail", "t", "--from-start"]) is not None
    assert check_command(["dgstream", "nosuch"]) is not None
    assert check_command(["python", "bench/engine_gpu.py", "--render-vllm", "x"]) is None
    assert check_command(["python", "bench/engine_gpu.py", "--no-such-flag"]) is not None
    assert check_command(["make", "nosuch"]) is not None
    assert check_command(["bash", "bench/gpu/vllm_session.sh", "nosuchmode"]) is not None
    tail = "t-1-1  insult: p_yes=1.00\nt-0-0  insult: p_yes=0.00"
    assert matches_any_order(tail, "t-0-5  insult: p_yes=0.00\nt-1-2  insult: p_yes=1.00") is None
    assert matches_any_order(tail, "t-0-5  insult: p_yes=0.00") is not None
    assert (
        matches_any_order(tail, "t-0-5  insult: p_yes=0.00\nt-1-2  insult: p_yes=0.5") is not None
    )
    fake = Block(ROOT / "README.md", 1, "sh", "$ dgstream ask '{}'\n")
    assert _placement(fake) is not None
    bad = Block(ROOT / "README.md", 1, "json", json.dumps({"state": "x", "questions": {}}))
    with pytest.raises(AssertionError, match="NO_QUESTIONS"):
        _check_json(bad)

"""The card benchmark's rows (bench/harness/card_rows.py, run by bench/card_rows.py on the
GPU machine) and their section, on the CPU against an engine that only counts: what a GPU
session cannot afford to find out.

- a row holds the batches in flight it names, never more, and reads what it reports;
- every batch's reads exist before the row's clock starts (making them is not the engine's
  time);
- the scheduling section puts two runs side by side with the ratio of their own figures,
  and marks the figures of the defaults' column (the ones README quotes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.harness import card_rows


class CountingEngine:
    """Reads nothing; records how many batches were at it at once and when reads were made."""

    def __init__(self) -> None:
        self.at_once = 0
        self.most = 0
        self.batches: list[int] = []

    async def read(self, reads: list[Any]) -> list[Any]:
        self.at_once += 1
        self.most = max(self.most, self.at_once)
        self.batches.append(len(reads))
        # Yield to the loop twice, so batches the row allows at once do overlap here.
        await asyncio.sleep(0)
        await asyncio.sleep(0.001)
        self.at_once -= 1
        return [SimpleNamespace(timings={"engine_s": 0.001}) for _ in reads]


def args_for(batches: str, in_flight: str) -> argparse.Namespace:
    """What bench/engine_gpu.py's parser gives `measure` (short prompts: the CPU)."""
    return argparse.Namespace(batches=batches, in_flight=in_flight, prompt=32, canvas=16, shared=24)


@pytest.mark.unit
@pytest.mark.parametrize("spec, depths", [("1", [1]), ("1,2,4", [1, 2, 4]), (3, [3])])
def test_in_flight_depths_parse(spec: Any, depths: list[int]) -> None:
    assert card_rows.in_flight_depths(spec) == depths


@pytest.mark.unit
@pytest.mark.parametrize("spec", ["", "0", "1,-2"])
def test_in_flight_depths_refuse_what_cannot_run(spec: str) -> None:
    with pytest.raises(ValueError, match="in-flight"):
        card_rows.in_flight_depths(spec)


@pytest.mark.unit
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_a_row_holds_its_batches_in_flight_and_counts_its_reads(depth: int) -> None:
    engine = CountingEngine()
    rows = asyncio.run(card_rows.measure(engine, args_for("8", str(depth)), 1000))
    assert [(r["variant"], r["in_flight"]) for r in rows] == [
        ("vllm/unique", depth),
        ("vllm/shared", depth),
    ]
    assert engine.most == depth
    for row in rows:
        assert row["reads"] == 8 * max(3 * depth, min(64, 256 // 8))
    # One warm-up batch a row, then the row's own; every batch the row's size.
    assert len(engine.batches) == sum(1 + r["reads"] // 8 for r in rows)
    assert set(engine.batches) == {8}


@pytest.mark.unit
def test_the_reads_are_made_before_the_clock_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row's reads/s counts only the engine: no read is made while a row's batches run."""
    import bench.harness.reads as reads_module

    made_while_reading: list[int] = []
    engine = CountingEngine()
    real = reads_module.make_reads

    def watched(*a: Any, **k: Any) -> Any:
        made_while_reading.append(engine.at_once)
        return real(*a, **k)

    monkeypatch.setattr(reads_module, "make_reads", watched)
    asyncio.run(card_rows.measure(engine, args_for("4", "2"), 1000))
    assert made_while_reading and set(made_while_reading) == {0}


def card_run(tmp: Path, name: str, asynchronous: bool, rate: float, **settings: Any) -> Path:
    rows = [
        {
            "variant": f"vllm/{kind}",
            "batch": b,
            "in_flight": depth,
            "reads_per_s": rate * b * depth * (2 if kind == "shared" else 1),
            "p50_ms": 30.0,
            "p99_ms": 40.0,
            "gpu_busy_pct": 50.0,
        }
        for b in (1, 256)
        for kind in ("unique", "shared")
        for depth in (1, 2)
    ]
    info = {
        "settings": {"async_scheduling": asynchronous, "canvas_length": 64, **settings},
        "kv_cache_tokens": 40298,
        "start_s": 240.0,
    }
    path = tmp / f"card_{name}.json"
    path.write_text(json.dumps({"info": info, "rows": rows}))
    return path


@pytest.mark.unit
def test_the_scheduling_section_sets_runs_side_by_side(tmp_path: Path) -> None:
    sync = card_run(tmp_path, "sync", False, 1.0)
    fast = card_run(tmp_path, "async", True, 1.5)
    md = card_rows.render_scheduling([sync, fast])
    header = next(line for line in md.splitlines() if line.startswith("| batch"))
    assert "sync, canvas 64" in header and "async, canvas 64 / sync, canvas 64" in header
    row = next(line for line in md.splitlines() if line.startswith("| 256 | shared | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "1024.0 (30 / 40; 50%)"
    # The column of the product's defaults (async scheduling, a 64-position canvas) marks
    # its figures for the pages that quote them; the other columns mark none.
    assert cells[4] == (
        "<!-- figure: defaults_shared_b256_x2 -->1536.0<!-- /figure --> "
        "(<!-- figure: defaults_shared_b256_x2_p50 -->30<!-- /figure --> / 40; 50%)"
    )
    assert cells[5] == "1.50x"
    # Unique rows come before shared ones at each batch, depths in order.
    order = [line.split("|")[1:4] for line in md.splitlines() if line.startswith("| 1 |")]
    assert [[c.strip() for c in o] for o in order] == [
        ["1", "unique", "1"],
        ["1", "unique", "2"],
        ["1", "shared", "1"],
        ["1", "shared", "2"],
    ]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kernels", "label"),
    [
        ({}, "async, canvas 64"),  # a run made before the kernel settings existed
        ({"moe_backend": None, "linear_backend": None}, "async, canvas 64"),
        ({"moe_backend": "marlin", "linear_backend": "marlin"}, "async, canvas 64, marlin kernels"),
        ({"moe_backend": "marlin", "linear_backend": None}, "async, canvas 64, marlin kernels"),
        (
            {"moe_backend": "marlin", "linear_backend": "cutlass"},
            "async, canvas 64, cutlass/marlin kernels",
        ),
    ],
)
def test_a_run_label_names_the_kernels_it_chose(kernels: dict[str, Any], label: str) -> None:
    settings = {"async_scheduling": True, "canvas_length": 64, **kernels}
    assert card_rows.run_label({"settings": settings}) == label


@pytest.mark.unit
def test_two_steps_are_named_where_auto_was_the_default(tmp_path: Path) -> None:
    two = card_run(tmp_path, "two_steps", True, 1.0, one_step_reads=False)
    auto = card_run(tmp_path, "auto", True, 1.1, one_step_reads="auto")
    stock = card_run(tmp_path, "stock", True, 0.5, one_step_reads="auto", read_path="stock")
    header = next(
        line
        for line in card_rows.render_scheduling([two, auto, stock]).splitlines()
        if line.startswith("| batch")
    )
    cols = [c.strip() for c in header.split("|")[4:-1]]
    # The chosen two steps say so; auto is the defaults' column; vLLM's own path has no
    # one-step reads to name, whatever its settings held.
    assert cols[:3] == [
        "async, canvas 64, two steps (one-step reads false)",
        "async, canvas 64, one-step reads auto",
        "vLLM's own read path, async, canvas 64",
    ]
    # Before auto was the default, false was it: such a session's label names nothing.
    before = card_rows.render_scheduling([two])
    assert "two steps" not in before and "| async, canvas 64 |" in before


@pytest.mark.unit
def test_a_run_with_chosen_kernels_is_not_the_defaults_column(tmp_path: Path) -> None:
    # Same scheduling and canvas as the defaults, but Marlin forced: its column must not
    # mark the figures the README quotes; the run with vLLM's own choice does.
    forced = card_run(tmp_path, "marlin", True, 1.0, moe_backend="marlin")
    auto = card_run(tmp_path, "auto", True, 1.5)
    md = card_rows.render_scheduling([forced, auto])
    row = next(line for line in md.splitlines() if line.startswith("| 256 | shared | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert "figure:" not in cells[3]
    assert cells[4].startswith("<!-- figure: defaults_shared_b256_x2 -->1536.0")


class AnsweringEngine:
    """Answers every slot with probabilities drawn from the read's own canvas ids, so the
    same reads give the same answers and other reads other ones."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    async def read(self, reads: list[Any]) -> list[Any]:
        self.batches.append(reads)
        out = []
        for r in reads:
            slots = []
            for s in r.slots:
                w = [
                    1.0 + (r.canvas_ids[s.position] * (i + 1)) % 7 for i in range(len(s.label_ids))
                ]
                slots.append(SimpleNamespace(probs=[x / sum(w) for x in w]))
            out.append(SimpleNamespace(slots=tuple(slots)))
        return out


@pytest.mark.unit
def test_the_probe_reads_the_same_mixed_batch_in_every_run() -> None:
    """One batch, half of it one question set: the same reads (and answers) every run."""
    first, second = AnsweringEngine(), AnsweringEngine()
    a = asyncio.run(card_rows.probe(first, args_for("1", "1"), 1000))
    b = asyncio.run(card_rows.probe(second, args_for("1", "1"), 1000))
    assert len(first.batches) == 1 and len(first.batches[0]) == card_rows.PROBE_READS
    shared = [r for r in first.batches[0] if r.shared_prefix_len]
    assert len(shared) == card_rows.PROBE_READS // 2
    assert len({r.prompt_ids[:24] for r in shared}) == 1
    assert first.batches[0] == second.batches[0]
    assert card_rows.probe_agreement(a, b) == {
        "slots": sum(len(r) for r in a),
        "answers_differ": 0,
        "max_probability_gap": 0.0,
    }


@pytest.mark.unit
def test_probe_agreement_counts_moved_answers_and_the_largest_gap() -> None:
    a = [[[0.7, 0.3], [0.2, 0.5, 0.3]], [[0.5, 0.5], [1.0, 0.0, 0.0]]]
    b = [[[0.4, 0.6], [0.2, 0.45, 0.35]], [[0.5, 0.5], [0.9, 0.05, 0.05]]]
    got = card_rows.probe_agreement(a, b)
    assert got["slots"] == 4 and got["answers_differ"] == 1
    assert got["max_probability_gap"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="same reads"):
        card_rows.probe_agreement(a, [a[0]])


@pytest.mark.unit
def test_a_run_with_a_graph_mode_says_so_and_is_not_the_defaults_column(tmp_path: Path) -> None:
    full = {"async_scheduling": True, "canvas_length": 64, "cudagraph_mode": "FULL"}
    assert card_rows.run_label({"settings": full}) == "async, canvas 64, FULL graphs"
    assert card_rows.run_label({"settings": {**full, "cudagraph_mode": None}}) == "async, canvas 64"
    # Their card needs a lower share than the default's: a run at another share says it.
    lower = {**full, "gpu_memory_utilization": 0.86}
    assert card_rows.run_label({"settings": lower}).endswith(", gpu_memory_utilization 0.86")
    assert card_rows.run_label({"settings": {**full, "gpu_memory_utilization": 0.9}}) == (
        "async, canvas 64, FULL graphs"
    )
    graphs = card_run(tmp_path, "full", True, 1.0, cudagraph_mode="FULL")
    auto = card_run(tmp_path, "auto", True, 1.5)
    md = card_rows.render_scheduling([graphs, auto])
    row = next(line for line in md.splitlines() if line.startswith("| 256 | shared | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert "figure:" not in cells[3]
    assert cells[4].startswith("<!-- figure: defaults_shared_b256_x2 -->1536.0")


@pytest.mark.unit
def test_a_session_section_names_the_read_path_and_holds_each_probe_against_the_first(
    tmp_path: Path,
) -> None:
    defaults = card_run(tmp_path, "defaults", True, 1.0)
    stock = card_run(tmp_path, "stock", True, 0.5, read_path="stock")
    lower = card_run(tmp_path, "lower", True, 1.2, cudagraph_mode="FULL")
    probe = [[[0.7, 0.3], [0.2, 0.5, 0.3]]]
    for path, answers in (
        (defaults, probe),
        (stock, [[[0.6, 0.4], [0.2, 0.5, 0.3]]]),
        (lower, [[[0.3, 0.7], [0.2, 0.5, 0.3]]]),
    ):
        body = json.loads(path.read_text())
        path.write_text(json.dumps({**body, "probe": answers}))
    md = card_rows.render_scheduling([defaults, stock, lower], "2026-12-05", "card24-side-by-side")
    assert md.startswith("## The 24 GB card side by side") and "(2026-12-05)" in md.splitlines()[0]
    header = next(line for line in md.splitlines() if line.startswith("| batch"))
    assert "vLLM's own read path, async, canvas 64" in header
    # vLLM's own read path is never the defaults' column, though its scheduling and canvas are.
    row = next(line for line in md.splitlines() if line.startswith("| 256 | shared | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3].startswith("<!-- figure: defaults_shared_b256_x2 -->")
    assert "figure:" not in cells[4] and "figure:" not in cells[5]
    assert cells[6:] == ["0.50x", "1.20x"]
    agree = next(line for line in md.splitlines() if line.startswith("The probe's answers"))
    assert "vLLM's own read path, async, canvas 64: 0 of 2 slots answer otherwise" in agree
    assert "FULL graphs: 1 of 2 slots answer otherwise, probabilities at most 0.4000" in agree
    assert "--date 2026-12-05" in md and "DATE" not in md


@pytest.mark.unit
def test_a_one_step_run_is_a_column_of_its_one_step_rows_not_the_defaults(
    tmp_path: Path,
) -> None:
    """The session that decides the default sets the defaults beside a one-step run that
    also holds its own two-step rows (`--beside-two-step`): its column is its one-step
    rows, and only the defaults' column carries the figures."""
    defaults = card_run(tmp_path, "osd_defaults", True, 1.0)
    one = card_run(tmp_path, "one_step_fix", True, 1.5, one_step_reads=True)
    body = json.loads(one.read_text())
    twos = [{**r, "steps": 2, "reads_per_s": r["reads_per_s"] / 7} for r in body["rows"]]
    body["rows"] = [{**r, "steps": 1} for r in body["rows"]] + twos
    one.write_text(json.dumps(body))
    md = card_rows.render_scheduling([defaults, one], "2026-12-06", "card24-one-step-default")
    header = next(line for line in md.splitlines() if line.startswith("| batch"))
    assert "async, canvas 64, one-step reads / async, canvas 64" in header
    row = next(line for line in md.splitlines() if line.startswith("| 256 | shared | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3].startswith("<!-- figure: defaults_shared_b256_x2 -->1024.0")
    assert cells[4] == "1536.0 (30 / 40; 50%)"
    assert cells[5] == "1.50x"
    assert "card one_step_fix --in-flight 1,2,4 --one-step-reads --beside-two-step" in md
    assert "card_osd_defaults.json docs/data/card24/one_step/card_one_step_fix.json" in md


@pytest.mark.unit
def test_a_run_of_the_auto_default_is_the_defaults_column_and_says_auto(tmp_path: Path) -> None:
    """one_step_reads defaults to "auto" since 2026-12-06 (false before: the runs of
    then are the defaults' columns too, unless an auto run stands beside them); `true` is
    a chosen setting, not the defaults."""
    auto = card_run(tmp_path, "auto", True, 1.0, one_step_reads="auto")
    always = card_run(tmp_path, "always", True, 1.5, one_step_reads=True)
    md = card_rows.render_scheduling([always, auto])
    header = next(line for line in md.splitlines() if line.startswith("| batch"))
    assert "| async, canvas 64, one-step reads | async, canvas 64, one-step reads auto |" in header
    row = next(line for line in md.splitlines() if line.startswith("| 256 | shared | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert "figure" not in cells[3]
    assert cells[4].startswith("<!-- figure: defaults_shared_b256_x2 -->1024.0")
    # Beside auto, a run with one_step_reads false (the default before) is a chosen one.
    off = card_run(tmp_path, "off", True, 2.0, one_step_reads=False)
    md = card_rows.render_scheduling([off, auto])
    row = next(line for line in md.splitlines() if line.startswith("| 256 | shared | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert "figure" not in cells[3]
    assert cells[4].startswith("<!-- figure: defaults_shared_b256_x2 -->1024.0")


@pytest.mark.unit
def test_small_full_graphs_are_the_defaults_column_where_they_are_the_default(
    tmp_path: Path,
) -> None:
    """full_graph_tokens defaults to 1,024 since its session (section card24-small-full):
    there the run with 1,024 is the defaults' column and the run with 0 says its mixed
    steps ran piecewise; in a section before it, a run with the setting is a chosen one."""
    piecewise = card_run(tmp_path, "piecewise", True, 1.0, full_graph_tokens=0)
    small = card_run(tmp_path, "small", True, 1.5, full_graph_tokens=1024)
    md = card_rows.render_scheduling([piecewise, small], section="card24-small-full")
    header = next(line for line in md.splitlines() if line.startswith("| batch"))
    assert (
        "| async, canvas 64, mixed steps piecewise (full_graph_tokens 0) "
        "| async, canvas 64, FULL graphs to 1024 tokens |"
    ) in header
    row = next(line for line in md.splitlines() if line.startswith("| 1 | shared | 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert "figure" not in cells[3]
    assert cells[4].startswith("<!-- figure: defaults_shared_b1_x1 -->3.0")
    assert cells[5] == "1.50x"
    before = card_rows.render_scheduling([piecewise, small])
    row = next(line for line in before.splitlines() if line.startswith("| 1 | shared | 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3].startswith("<!-- figure: defaults_shared_b1_x1 -->2.0")
    assert "figure" not in cells[4]
    assert "mixed steps piecewise" not in before


@pytest.mark.unit
def test_a_run_at_another_share_is_not_the_defaults_column(tmp_path: Path) -> None:
    lower = card_run(tmp_path, "lower", True, 1.0)
    body = json.loads(lower.read_text())
    body["info"]["settings"]["gpu_memory_utilization"] = 0.86
    lower.write_text(json.dumps(body))
    md = card_rows.render_scheduling([lower])
    assert "figure:" not in md


@pytest.mark.unit
@pytest.mark.parametrize("load_format", ["dummy", "auto"])
def test_a_probe_on_dummy_weights_is_said_to_hold_no_answers(
    tmp_path: Path, load_format: str
) -> None:
    """Dummy weights prefer no label: a probe whose every probability sits near an even
    split differs between any two engine starts, and the section must not read as if the
    settings changed the answers."""
    runs = []
    for name, probe in (
        ("a", [[[0.51, 0.49], [0.32, 0.34, 0.34]]]),
        ("b", [[[0.49, 0.51], [0.34, 0.32, 0.34]]]),
    ):
        path = card_run(tmp_path, name, True, 1.0, load_format=load_format)
        body = json.loads(path.read_text())
        body["info"]["gpu"] = "NVIDIA H100 80GB HBM3"
        path.write_text(json.dumps({**body, "probe": probe}))
        runs.append(path)
    md = card_rows.render_scheduling(runs, "2026-12-05", "card24-side-by-side")
    agree = next(line for line in md.splitlines() if line.startswith("The probe's answers"))
    assert "2 of 2 slots answer otherwise" in agree
    said = "says nothing of the answers: every slot's probabilities lie within 0.013"
    assert (said in agree) == (load_format == "dummy")
    assert "one device session on one NVIDIA H100 80GB HBM3." in md


@pytest.mark.unit
def test_runs_of_two_gpus_name_no_gpu(tmp_path: Path) -> None:
    """A session's figures are its GPU's; runs from two kinds of GPU are no one session's."""
    runs = []
    for name, gpu in (("a", "NVIDIA H200"), ("b", "NVIDIA H100 80GB HBM3")):
        path = card_run(tmp_path, name, True, 1.0)
        body = json.loads(path.read_text())
        body["info"]["gpu"] = gpu
        path.write_text(json.dumps(body))
        runs.append(path)
    md = card_rows.render_scheduling(runs)
    assert "one device session. A row" in md and "NVIDIA" not in md


@pytest.mark.unit
def test_uniform_spread_is_the_largest_stray_from_an_even_split() -> None:
    assert card_rows.uniform_spread([[[0.25, 0.25, 0.5]]]) == pytest.approx(1 / 6)
    assert card_rows.uniform_spread([[[0.5, 0.5]], [[0.4, 0.6]]]) == pytest.approx(0.1)
    assert card_rows.uniform_spread([]) == 0.0


@pytest.mark.unit
def test_the_one_step_section_sets_each_row_beside_its_two_steps(tmp_path: Path) -> None:
    """One run's rows, one- and two-step (`steps`), side by side with their ratio; the
    batch-1 p50s of one batch in flight are figures, the other rows' are not."""
    rows = [
        {
            "variant": f"vllm/{kind}",
            "batch": b,
            "in_flight": depth,
            "reads_per_s": 100.0 * b * (1.5 if steps == 1 else 1.0),
            "p50_ms": 20.0 if steps == 1 else 30.0,
            "p99_ms": 40.0,
            "gpu_busy_pct": 50.0,
            "steps": steps,
        }
        for steps in (1, 2)
        for b in (1, 256)
        for kind in ("shared", "unique")
        for depth in (1, 4)
    ]
    info = {"gpu": "NVIDIA H200", "card_gib": 23.6, "kv_cache_tokens": 25113, "start_s": 210.0}
    path = tmp_path / "card_one_step.json"
    path.write_text(json.dumps({"info": info, "rows": rows}))
    md = card_rows.render_steps(path, "2026-12-05")
    lines = md.splitlines()
    assert lines[0].endswith("(2026-12-05)")
    table = [line for line in lines if line.startswith("| 1 ") or line.startswith("| 256 ")]
    assert [line.split("|")[1:4] for line in table][:2] == [
        [" 1 ", " unique ", " 1 "],
        [" 1 ", " unique ", " 4 "],
    ]
    first = [c.strip() for c in table[0].strip("|").split("|")]
    assert (
        first[3] == "150.0 (<!-- figure: one_step_unique_b1_p50 -->20.0<!-- /figure --> / 40; 50%)"
    )
    assert (
        first[4] == "100.0 (<!-- figure: two_step_unique_b1_p50 -->30.0<!-- /figure --> / 40; 50%)"
    )
    assert first[5] == "1.50x"
    deep = [c.strip() for c in table[1].strip("|").split("|")]
    assert deep[3] == "150.0 (20.0 / 40; 50%)"
    assert "--render-steps docs/data/card24/one_step/card_one_step.json --date 2026-12-05" in md
    # A later session's run renders into a section of its own, with its own command.
    fix = card_rows.render_steps(path, "2026-12-06", "card24-one-step-fix")
    assert fix.splitlines()[0].endswith("(2026-12-06)")
    assert "card one_step_fix --in-flight 1,2,4 --one-step-reads --beside-two-step" in fix
    assert (
        "--section card24-one-step-fix --render-steps "
        "docs/data/card24/one_step/card_one_step_fix.json --date 2026-12-06" in fix
    )
    with pytest.raises(KeyError):
        card_rows.render_steps(path, "2026-12-06", "card24-no-such-session")

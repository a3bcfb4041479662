"""`dgstream calibrate` from files (labelled examples; results with labels in their metadata
or in a labels file), and `dgstream compare`'s tally, without a broker. The broker runs of
both are in tests/workers/test_decisions_pipeline.py."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from cli_runner import run_cli

from dgstream.topology.cli.decisions import _report, _tally
from dgstream.workers.results.calibration import Calibration, tempered

pytestmark = pytest.mark.unit


def _result(
    rid: str, p_yes: float, truth: str | None = None, route: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "status": "ok",
        "answers": {
            "insult": {
                "type": "yes_no",
                "p_yes": round(p_yes, 6),
                "label": "yes" if p_yes >= 0.5 else "no",
                "confidence": round(max(p_yes, 1 - p_yes), 6),
            }
        },
        "diagnostics": {
            "reads": 1,
            "entropy": {},
            "label_mass": {},
            "model": "demo",
            "engine": "t",
            "worker": "w",
        },
    }
    if truth is not None:
        body["metadata"] = {"truth": {"insult": truth}}
    if route is not None:
        body["audit"] = {"route": route}
    return body


def _overconfident(n: int, seed: int = 0) -> list[tuple[float, str]]:
    """A model that says 0.4 = 0.1 and 0.6 = 0.9: true probabilities tempered by 0.4."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.random()
        truth = "yes" if rng.random() < p else "no"
        out.append((tempered([p, 1 - p], 0.4)[0], truth))
    return out


def test_calibrate_from_labelled_examples(tmp_path: Path) -> None:
    examples = tmp_path / "examples.jsonl"
    lines = [
        json.dumps({"result": _result(f"r{i}", p), "labels": {"insult": t}})
        for i, (p, t) in enumerate(_overconfident(300))
    ]
    examples.write_text("\n".join(lines) + "\n")
    out = tmp_path / "cal.json"
    proc = run_cli("calibrate", "--examples", str(examples), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    cal = Calibration.model_validate_json(out.read_text())
    q = cal.questions["insult"]
    assert q.examples == 300 and q.temperature == pytest.approx(2.5, rel=0.3)
    assert q.ece_after < q.ece_before
    assert "insult" in proc.stdout and cal.hash in proc.stdout


def test_calibrate_from_results_with_labels_in_metadata_or_a_file(tmp_path: Path) -> None:
    data = _overconfident(200, seed=1)
    results = tmp_path / "results.jsonl"
    results.write_text(
        "\n".join(json.dumps(_result(f"r{i}", p, truth=t)) for i, (p, t) in enumerate(data))
    )
    out = tmp_path / "a.json"
    proc = run_cli(
        "calibrate", "--results", str(results), "--labels-in-metadata", "truth", "-o", str(out)
    )
    assert proc.returncode == 0, proc.stderr
    by_metadata = Calibration.model_validate_json(out.read_text()).questions["insult"]
    labels = tmp_path / "labels.jsonl"
    labels.write_text(
        "\n".join(
            json.dumps({"id": f"r{i}", "labels": {"insult": t}}) for i, (_, t) in enumerate(data)
        )
    )
    proc = run_cli("calibrate", "--results", str(results), "--labels", str(labels), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert Calibration.model_validate_json(out.read_text()).questions["insult"] == by_metadata


def test_calibrate_refuses_what_it_cannot_fit(tmp_path: Path) -> None:
    results = tmp_path / "few.jsonl"
    results.write_text(json.dumps(_result("r1", 0.9, truth="yes")) + "\n")
    out = tmp_path / "cal.json"
    proc = run_cli(
        "calibrate", "--results", str(results), "--labels-in-metadata", "truth", "-o", str(out)
    )
    assert proc.returncode == 1 and not out.exists()
    assert "1 labelled examples; at least 20 needed" in proc.stdout
    proc = run_cli("calibrate", "--results", str(results), "-o", str(out))
    assert proc.returncode == 2 and "--labels FILE or --labels-in-metadata" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"result": 1}\n')
    proc = run_cli("calibrate", "--examples", str(bad), "-o", str(out))
    assert proc.returncode == 2 and "bad.jsonl line 1" in proc.stderr


def test_compare_tallies_agreement_confusion_shifts_and_routes() -> None:
    a = {
        "r1": _result("r1", 0.9, route="block"),
        "r2": _result("r2", 0.2, route="default"),
        "r3": _result("r3", 0.6, route="review"),
        "only-a": _result("only-a", 0.5),
    }
    b = {
        "r1": _result("r1", 0.95, route="block"),
        "r2": _result("r2", 0.7, route="review"),
        "r3": _result("r3", 0.6, route="block"),
    }
    report = _report(_tally(a, b, top=2), {"both": 3, "only_a": 1, "only_b": 0})
    q = report["questions"]["insult"]
    assert q["compared"] == 3 and q["agreement"] == pytest.approx(2 / 3)
    assert {(c["a"], c["b"]): c["count"] for c in q["confusion"]} == {
        ("yes", "yes"): 2,
        ("no", "yes"): 1,
    }
    assert [s["id"] for s in q["largest_shifts"]] == ["r2", "r1"]
    assert q["largest_shifts"][0] == {"id": "r2", "label": "yes", "a": 0.2, "b": 0.7, "shift": 0.5}
    route = report["questions"]["(route)"]
    assert route["agreement"] == pytest.approx(1 / 3)
    assert {(c["a"], c["b"]) for c in route["confusion"]} == {
        ("block", "block"),
        ("default", "review"),
        ("review", "block"),
    }


def test_tail_shows_a_moderation_result_on_one_line() -> None:
    from dgstream.schemas import ClassificationResult, encode_output, read_output
    from dgstream.topology.cli.commands import _result_line

    res = ClassificationResult.model_validate(_result("r9", 0.93))
    line = _result_line(read_output(encode_output(res, "openai_moderation")), None)
    assert line == "r9  flagged=true  insult=0.93"

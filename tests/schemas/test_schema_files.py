"""The committed JSON Schema files are what the models generate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dgstream.schemas import ClassificationRequest, ErrorCode, parse_request
from dgstream.schemas.export import JSON_DIR, main, render

pytestmark = pytest.mark.unit

NAMES = (
    "request.schema.json",
    "result.schema.json",
    "dead_letter.schema.json",
    "jev_result.schema.json",
    "openai_moderation_result.schema.json",
)


@pytest.mark.parametrize("name", NAMES)
def test_committed_schema_matches_models(name: str) -> None:
    rendered = render()
    assert set(rendered) == set(NAMES)
    committed = (JSON_DIR / name).read_text(encoding="utf-8")
    assert committed == rendered[name], (
        f"schemas/json/{name} is stale: run `python -m dgstream.schemas.export`"
    )


def test_render_is_deterministic_and_canonical() -> None:
    first, second = render(), render()
    assert first == second
    for text in first.values():
        assert text.endswith("}\n") and not text.endswith("\n\n")
        obj = json.loads(text)
        assert text == json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        assert obj["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_check_mode_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dir", str(tmp_path), "--check"]) == 1  # nothing there yet
    assert main(["--dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(NAMES)
    assert main(["--dir", str(tmp_path), "--check"]) == 0
    stale = tmp_path / "result.schema.json"
    stale.write_text(stale.read_text(encoding="utf-8").replace('"reads"', '"readz"'))
    assert main(["--dir", str(tmp_path), "--check"]) == 1
    assert "result.schema.json" in capsys.readouterr().err


def test_module_check_passes_on_committed_files() -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "dgstream.schemas.export", "--check"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_error_codes_are_published_in_the_dead_letter_schema() -> None:
    schema = json.loads((JSON_DIR / "dead_letter.schema.json").read_text(encoding="utf-8"))
    assert schema["$defs"]["ErrorCode"]["enum"] == [c.value for c in ErrorCode]


def _request_schema() -> dict[str, Any]:
    return json.loads((JSON_DIR / "request.schema.json").read_text(encoding="utf-8"))


def test_published_request_schema_agrees_with_the_parser() -> None:
    import jsonschema

    validator = jsonschema.Draft202012Validator(_request_schema())
    good: dict[str, Any] = {
        "id": "r1",
        "state": "text",
        "questions": {
            "toxic": {"type": "noul", "instructions": "Toxic?", "criteria": {"true": "rude"}},
            "topic": {
                "type": "choice",
                "instructions": "Topic?",
                "criteria": {"a": None, "b": "bee"},
                "ask_if": {"toxic": ["no"]},
            },
            "sev": {"type": "score", "instructions": "How bad?", "criteria": ["lo", "hi"]},
        },
        "samples": "auto",
        "auto_max": 4,
        "metadata": {"x": [1, {"y": None}]},
    }
    assert isinstance(parse_request(json.dumps(good).encode()), ClassificationRequest)
    validator.validate(good)
    # Refusals the schema can express are refused by both.
    for bad in (
        good | {"samples": 17},
        good | {"id": ""},
        good | {"colour": 1},
        good | {"questions": {"1x": good["questions"]["toxic"]}},
        good
        | {"questions": {"t": {"type": "choice", "instructions": "?", "criteria": {"a": None}}}},
        good | {"questions": {"t": {"type": "maybe", "instructions": "?"}}},
        good | {"reply_topic": "a b"},
    ):
        assert not validator.is_valid(bad), bad
        assert not isinstance(parse_request(json.dumps(bad).encode()), ClassificationRequest), bad

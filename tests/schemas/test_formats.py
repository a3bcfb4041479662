"""The output-format registry: every format owns its options, its schema and a doc row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from dgstream.schemas import ClassificationResult, encode_output, format_names, get_format
from dgstream.schemas.export import JSON_DIR, render
from dgstream.schemas.formats import DEFAULT_FORMAT, NoOptions, OutputFields, formats
from dgstream.schemas.formats.openai_moderation import ModerationOptions

pytestmark = pytest.mark.unit

RESULTS_DOC = Path(__file__).resolve().parents[2] / "docs" / "results.md"


def _result(p_yes: float) -> ClassificationResult:
    return ClassificationResult.model_validate(
        {
            "id": "req-7",
            "status": "ok",
            "answers": {
                "insult": {
                    "type": "yes_no",
                    "p_yes": p_yes,
                    "label": "yes" if p_yes >= 0.5 else "no",
                    "confidence": max(p_yes, 1 - p_yes),
                }
            },
            "diagnostics": {
                "reads": 1,
                "entropy": {},
                "label_mass": {},
                "model": "demo",
                "engine": "e",
                "worker": "w",
            },
        }
    )


def test_the_registry_holds_the_three_formats_in_name_order() -> None:
    assert format_names() == ("dgstream", "jev", "openai_moderation")
    assert DEFAULT_FORMAT in format_names()
    with pytest.raises(ValueError, match=r"unknown output format 'xml'; expected one of"):
        get_format("xml")


@pytest.mark.parametrize("name", format_names())
def test_every_format_has_options_a_schema_and_a_doc_row(name: str) -> None:
    fmt = get_format(name)
    # Options: a validated, frozen model that refuses keys it does not know.
    config = fmt.options.model_config
    assert config.get("frozen") is True and config.get("extra") == "forbid"
    assert isinstance(fmt.defaults, fmt.options)
    with pytest.raises(ValidationError):
        fmt.options.model_validate({"no_such_option": 1})
    # Schema: the file `python -m dgstream.schemas.export` writes from the format's response model.
    assert fmt.schema_file in render()
    committed = json.loads((JSON_DIR / fmt.schema_file).read_text(encoding="utf-8"))
    assert committed == json.loads(render()[fmt.schema_file])
    # Doc row: docs/results.md's "Output formats" table names it (and its options key).
    rows = [line for line in RESULTS_DOC.read_text().splitlines() if line.startswith("| `")]
    row = next((r for r in rows if r.startswith(f"| `{name}` |")), None)
    assert row is not None, f"docs/results.md has no row for output format {name!r}"
    assert fmt.schema_file in row
    if fmt.options_key is not None:
        assert re.search(rf"`{re.escape(fmt.options_key)}`", row)
    else:
        assert fmt.options is NoOptions


def test_a_pipeline_has_each_formats_options_under_its_key() -> None:
    keyed = {f.options_key: f for f in formats() if f.options_key is not None}
    assert set(keyed) == {"moderation"}
    assert set(OutputFields.model_fields) == {"output_format", *keyed}
    fields = OutputFields.model_validate(
        {"output_format": "openai_moderation", "moderation": {"threshold": 0.8}}
    )
    assert fields.output_options() == ModerationOptions(threshold=0.8)
    # A format without a key writes with its defaults, whatever other formats' options say.
    jev = OutputFields.model_validate({"output_format": "jev", "moderation": {"threshold": 0.8}})
    assert jev.output_options() is get_format("jev").defaults
    with pytest.raises(ValidationError, match="unknown output format"):
        OutputFields.model_validate({"output_format": "xml"})


def test_encode_output_uses_the_formats_defaults_without_options() -> None:
    res = _result(p_yes=0.7)
    for name in format_names():
        fmt = get_format(name)
        assert encode_output(res, name) == fmt.encode(res, fmt.defaults)
    strict = ModerationOptions(threshold=0.9)
    value = json.loads(encode_output(res, "openai_moderation", strict))
    assert value["results"][0]["flagged"] is False

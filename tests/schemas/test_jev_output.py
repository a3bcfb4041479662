"""Results in Jev's response shape, and reading either format back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from dgstream.schemas import ClassificationResult, JevResponse, encode_output, read_output, to_jev
from dgstream.schemas.export import JSON_DIR
from dgstream.schemas.formats.jev import JevScoreAnswer

pytestmark = pytest.mark.unit


def result(**extra: Any) -> ClassificationResult:
    body: dict[str, Any] = {
        "id": "order-17",
        "id_source": "key",
        "requested_model": "jev-latest",
        "status": "ok",
        "answers": {
            "billing": {"type": "yes_no", "p_yes": 0.91, "label": "yes", "confidence": 0.91},
            "tone": {
                "type": "choice",
                "choice": "angry",
                "probabilities": {"calm": 0.25, "angry": 0.75},
                "confidence": 0.75,
            },
            "urgency": {
                "type": "score",
                "expected_score": 2.3,
                "level": "today",
                "legend": {"1": "can wait", "2": "this week", "3": "today"},
                "probabilities": {"can wait": 0.2, "this week": 0.3, "today": 0.5},
                "confidence": 0.5,
            },
            "refund": {"type": "skipped", "reason": "ask_if not met: billing=no"},
        },
        "diagnostics": {
            "reads": 2,
            "entropy": {},
            "label_mass": {},
            "model": "demo",
            "engine": "transformers",
            "worker": "w",
            "input_tokens": 812,
            "output_tokens": 64,
        },
        "metadata": {"trace": 1},
    }
    body.update(extra)
    return ClassificationResult.model_validate(body)


def test_jev_shape_of_each_answer() -> None:
    out = json.loads(encode_output(result(), "jev"))
    assert out == {
        "model": "demo",
        "answers": {
            "billing": {"type": "noul", "noul": 0.91},
            "tone": {
                "type": "choice",
                "choice": "angry",
                "confidence": 0.75,
                "probabilities": {"calm": 0.25, "angry": 0.75},
            },
            "urgency": {
                "type": "score",
                "score": pytest.approx(1.3),
                "confidence": 0.5,
                "probabilities": {"0": 0.2, "1": 0.3, "2": 0.5},
                "legend": {"0": "can wait", "1": "this week", "2": "today"},
            },
            # "refund" was skipped: Jev has no shape for it, so it is left out
        },
        "usage": {"input_tokens": 812, "output_tokens": 64},
    }
    # The score is the probability-weighted 0-based index.
    urgency = out["answers"]["urgency"]
    weighted = sum(int(k) * p for k, p in urgency["probabilities"].items())
    assert urgency["score"] == pytest.approx(weighted)


def test_score_at_the_ends_stays_inside_the_scale() -> None:
    for expected, probs, want in ((1.0, (1.0, 0.0), 0.0), (2.0000004, (0.0, 1.0), 1.0)):
        res = result(
            answers={
                "s": {
                    "type": "score",
                    "expected_score": expected,
                    "level": "a" if want == 0 else "b",
                    "legend": {"1": "a", "2": "b"},
                    "probabilities": {"a": probs[0], "b": probs[1]},
                    "confidence": 1.0,
                }
            }
        )
        score = to_jev(res).answers["s"]
        assert isinstance(score, JevScoreAnswer) and score.score == want


def test_formats_encode_and_read_back() -> None:
    res = result()
    ours = read_output(encode_output(res))
    assert ours == res
    theirs = read_output(encode_output(res, "jev"))
    assert isinstance(theirs, JevResponse) and theirs == to_jev(res)
    with pytest.raises(ValueError, match="unknown output format"):
        encode_output(res, "xml")  # type: ignore[arg-type]
    for bad in (b"", b"[1]", b'{"usage": 1}', b'{"id": "x"}', b"\xff"):
        with pytest.raises(ValueError, match="not a result"):
            read_output(bad)


@pytest.mark.parametrize(
    "answer",
    [
        {
            "type": "score",
            "score": 3.0,
            "confidence": 1,
            "probabilities": {"0": 1, "1": 0},
            "legend": {"0": "a", "1": "b"},
        },
        {
            "type": "score",
            "score": 0.5,
            "confidence": 1,
            "probabilities": {"1": 1, "0": 0},
            "legend": {"0": "a", "1": "b"},
        },
        {"type": "noul", "noul": 1.5},
        {"type": "choice", "choice": "a", "confidence": 1},
        {"type": "skipped", "reason": "not asked"},
    ],
)
def test_inconsistent_jev_answers_are_refused(answer: dict[str, Any]) -> None:
    body = {
        "model": "m",
        "answers": {"q": answer},
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }
    with pytest.raises(ValidationError):
        JevResponse.model_validate(body)


def test_published_jev_schema_accepts_what_we_write() -> None:
    import jsonschema

    schema = json.loads((JSON_DIR / "jev_result.schema.json").read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate(json.loads(encode_output(result(), "jev")))
    ours = json.loads((JSON_DIR / "result.schema.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(ours).validate(json.loads(encode_output(result())))
    assert not validator.is_valid({"model": "m", "answers": {}})

"""`output_format: openai_moderation`: the bytes a pipeline writes are read by the `openai`
SDK's own moderation response model, and say what the pipeline's questions, thresholds and
routes say."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dgstream.schemas import (
    Audit,
    ClassificationResult,
    Diagnostics,
    ModerationOptions,
    ModerationResponse,
    YesNoAnswer,
    encode_output,
    read_output,
)
from dgstream.schemas.formats.openai_moderation import OPENAI_CATEGORIES
from dgstream.schemas.result import ChoiceAnswer, SkippedAnswer

pytestmark = pytest.mark.unit


def yes_no(p: float) -> YesNoAnswer:
    return YesNoAnswer(p_yes=p, label="yes" if p >= 0.5 else "no", confidence=max(p, 1 - p))


def result(route: str = "default", **answers: Any) -> ClassificationResult:
    return ClassificationResult(
        id="req-7",
        status="ok",
        answers=answers,
        diagnostics=Diagnostics(
            reads=1, entropy={}, label_mass={}, model="demo", engine="transformers", worker="w"
        ),
        audit=audit(route),
    )


def audit(route: str) -> Audit:
    return Audit(
        model="demo",
        checkpoint="sha256:00",
        checkpoint_source="content_hash",
        prompt_template="1",
        question_set=None,
        questions_hash="sha256:01",
        engine={"backend": "transformers"},
        engine_hash="sha256:02",
        route=route,
        route_rule=None,
        routes_hash="sha256:03",
        route_acted=True,
        calibration=None,
        pipeline="p",
        deployment="default",
        worker="w",
        dgstream_version="0.1.0",
    )


def sdk_parse(value: bytes) -> Any:
    from openai.types import ModerationCreateResponse

    return ModerationCreateResponse.model_validate_json(value)


def test_the_openai_sdk_reads_the_bytes_with_mapped_and_own_categories() -> None:
    res = result(
        insult=yes_no(0.93),
        has_link=yes_no(0.2),
        language=ChoiceAnswer(
            choice="english", probabilities={"english": 0.9, "french": 0.1}, confidence=0.9
        ),
    )
    opts = ModerationOptions(categories={"harassment": "insult", "spam": "has_link"})
    parsed = sdk_parse(encode_output(res, "openai_moderation", opts))
    assert parsed.id == "req-7" and parsed.model == "demo"
    (m,) = parsed.results
    assert m.flagged is True
    assert m.categories.harassment is True and m.category_scores.harassment == 0.93
    assert m.category_applied_input_types.harassment == ["text"]
    # Not asked: not flagged, score 0, applies to no input.
    assert m.categories.violence is False and m.category_scores.violence == 0.0
    assert m.category_applied_input_types.violence == []
    assert m.categories.harassment_threatening is False  # the SDK's alias "harassment/..."
    # A category of our own travels as an extra field the SDK keeps.
    assert m.categories.model_extra == {"spam": False}
    assert m.category_scores.model_extra == {"spam": 0.2}


def test_by_default_every_yes_no_question_is_a_category_of_its_own() -> None:
    res = result(insult=yes_no(0.3), shouting=yes_no(0.6), skipped=SkippedAnswer(reason="x"))
    (m,) = sdk_parse(encode_output(res, "openai_moderation")).results
    assert m.categories.model_extra == {"insult": False, "shouting": True}
    assert m.flagged is True
    scores = m.category_scores.model_dump(by_alias=True)
    assert all(scores[c] == 0.0 for c in OPENAI_CATEGORIES)


def test_thresholds_per_category() -> None:
    opts = ModerationOptions(
        categories={"harassment": "insult", "violence": "threat"},
        threshold=0.9,
        thresholds={"violence": 0.2},
    )
    res = result(insult=yes_no(0.8), threat=yes_no(0.25))
    (m,) = sdk_parse(encode_output(res, "openai_moderation", opts)).results
    assert (m.categories.harassment, m.categories.violence, m.flagged) == (False, True, True)
    res = result(insult=yes_no(0.8), threat=yes_no(0.1))
    (m,) = sdk_parse(encode_output(res, "openai_moderation", opts)).results
    assert m.flagged is False


def test_flagged_by_routes_reads_the_route_in_the_audit() -> None:
    opts = ModerationOptions(flagged_by="routes")
    flagged = [
        sdk_parse(encode_output(result(r, a=yes_no(0.99)), "openai_moderation", opts)).results[0]
        for r in ("block", "review", "default", "reply")
    ]
    assert [m.flagged for m in flagged] == [True, True, False, False]
    only = ModerationOptions(flagged_by="routes", flag_routes=["block"])
    flagged = [
        sdk_parse(encode_output(result(r, a=yes_no(0.0)), "openai_moderation", only)).results[0]
        for r in ("block", "review")
    ]
    assert [m.flagged for m in flagged] == [True, False]


def test_options_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="flag_routes"):
        ModerationOptions(flag_routes=["block"])
    with pytest.raises(ValueError, match="not in categories"):
        ModerationOptions(categories={"hate": "q"}, thresholds={"violence": 0.5})
    with pytest.raises(ValueError):
        ModerationOptions(thresholds={"x": 1.5})


def test_our_reader_and_the_published_schema_take_it_too() -> None:
    import jsonschema

    from dgstream.schemas.export import JSON_DIR

    value = encode_output(result(insult=yes_no(0.7)), "openai_moderation")
    assert isinstance(read_output(value), ModerationResponse)
    schema = json.loads((JSON_DIR / "openai_moderation_result.schema.json").read_text())
    jsonschema.validate(json.loads(value), schema)


@settings(max_examples=100, deadline=None)
@given(
    scores=st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True),
        st.floats(0, 1),
        min_size=0,
        max_size=6,
    ),
    threshold=st.floats(0, 1),
)
def test_any_result_is_read_by_the_sdk_and_flagged_iff_a_score_reaches_it(
    scores: dict[str, float], threshold: float
) -> None:
    res = result(**{q: yes_no(p) for q, p in scores.items()})
    opts = ModerationOptions(threshold=threshold)
    (m,) = sdk_parse(encode_output(res, "openai_moderation", opts)).results
    assert m.flagged == any(p >= threshold for p in scores.values())
    assert set(m.categories.model_extra or {}) == set(scores) - set(OPENAI_CATEGORIES)

"""Adding a question kind is one module: a toy one, registered here only, goes through the
parser, the prompt and its template, the fake engine, its answer, the result's and Jev's
shapes, the routes and calibration without any other file knowing it; gone again, the
parser refuses it and the published schemas are the built-in kinds' alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal

import pytest
from pydantic import Field

from dgstream.schemas import ClassificationRequest, ClassificationResult, ErrorCode, parse_request
from dgstream.schemas._common import WireModel
from dgstream.schemas.export import render
from dgstream.schemas.formats.jev import to_jev
from dgstream.schemas.kinds import (
    Aggregated,
    Answered,
    Kind,
    Probability,
    QuestionBase,
    RouteField,
    clean,
    get_kind,
    kind_names,
    register,
    unregister,
)
from dgstream.schemas.kinds._base import heading
from dgstream.workers.engine.factory import EngineSettings, build_classifier
from dgstream.workers.engine.template import labels_and_answers, system_text
from dgstream.workers.results.calibration import (
    Calibration,
    Calibrator,
    QuestionCalibration,
    distribution,
)
from dgstream.workers.routes import Route, Router, check_routes

pytestmark = pytest.mark.unit

_MOODS = ("sad", "flat", "glad")


class MoodQuestion(QuestionBase):
    """How the state feels: sad, flat or glad (nothing like the real kinds)."""

    type: Literal["mood"]

    @property
    def answers(self) -> tuple[str, ...]:
        return _MOODS


class MoodAnswer(Answered):
    type: Literal["mood"] = "mood"
    mood: str
    lean: float = Field(ge=-1.0, le=1.0, description="p(glad) - p(sad).")
    probabilities: dict[str, Probability]
    raw_probabilities: dict[str, Probability] | None = None


class JevMoodAnswer(WireModel):
    type: Literal["feeling"] = "feeling"
    feeling: str


class Mood(Kind):
    name = "mood"
    types = ("mood",)
    question = MoodQuestion
    answer = MoodAnswer
    jev = JevMoodAnswer
    fields: ClassVar[Mapping[str, RouteField]] = {
        "lean": RouteField("number", -1.0, 1.0),
        "mood": RouteField("text"),
    }
    answer_field = "mood"

    def labels(self, question: Any) -> tuple[str, ...]:
        return ("X", "Y", "Z")

    def prompt(self, qid: str, question: Any, labels: Sequence[str]) -> list[str]:
        lines = [heading(qid, "mood", question.instructions)]
        return lines + [f"  {lab}: {m}" for lab, m in zip(labels, _MOODS, strict=True)]

    def answer_fields(self, agg: Aggregated, answers: Sequence[str]) -> dict[str, Any]:
        probs = {m: clean(p) for m, p in zip(answers, agg.mean, strict=True)}
        return {
            "mood": answers[agg.argmax],
            "lean": clean(probs["glad"] - probs["sad"]),
            "probabilities": probs,
        }

    def to_jev(self, answer: Any) -> JevMoodAnswer:
        return JevMoodAnswer(feeling=answer.mood)


@pytest.fixture
def mood() -> Iterator[None]:
    before = render()
    register(Mood)
    try:
        yield
    finally:
        unregister("mood")
    assert "mood" not in kind_names()
    assert render() == before  # the published schemas: the built-in kinds' again


_BODY = {
    "id": "t1",
    "state": "What a lovely day!",
    "questions": {
        "feel": {"type": "mood", "instructions": "How does it feel?"},
        "shout": {"type": "noul", "instructions": "Is it shouting?"},
    },
}


def _request() -> ClassificationRequest:
    request = parse_request(json.dumps(_BODY).encode())
    assert isinstance(request, ClassificationRequest), request
    return request


def test_a_toy_kind_goes_from_parse_through_the_template_to_its_answer(mood: None) -> None:
    request = _request()
    assert request.questions is not None
    q = request.questions["feel"]
    assert isinstance(q, MoodQuestion) and q.kind == "mood" and get_kind("mood").name == "mood"
    assert labels_and_answers(q) == (("X", "Y", "Z"), _MOODS)
    text = system_text(request.questions)
    assert "Question feel (mood): How does it feel?\n  X: sad\n  Y: flat\n  Z: glad" in text
    assert "  Labels: X, Y, Z" in text

    # The fake engine reads its slot like any other; the answer is the toy's own.
    classifier = build_classifier(EngineSettings(backend="fake", seed=1))
    (result,) = asyncio.run(classifier.classify([request]))
    assert isinstance(result, ClassificationResult), result
    answer = result.answers["feel"]
    assert isinstance(answer, MoodAnswer) and answer.mood in _MOODS
    assert set(answer.probabilities) == set(_MOODS)
    assert result.answers["shout"].type == "yes_no"
    # The result's shape holds it both ways, and Jev's shape is the toy's.
    again = ClassificationResult.model_validate_json(result.model_dump_json())
    assert again.answers["feel"] == answer
    assert to_jev(result).answers["feel"] == JevMoodAnswer(feeling=answer.mood)

    # Its route fields are checked against the pipeline's questions and evaluated.
    glad = Route(name="glad", when='feel.lean > 0 or feel.label == "glad"', topic="glad")
    check_routes([glad], [request.questions])
    with pytest.raises(ValueError, match="lean is a field of mood questions"):
        check_routes([Route(name="bad", when="shout.lean > 0", topic="x")], [request.questions])
    leaning = answer.lean > 0 or answer.mood == "glad"
    assert Router([glad], "out").route(result).name == ("glad" if leaning else "default")

    # Calibration keys it by its name and tempers it with its own hook.
    d = distribution(json.loads(result.model_dump_json())["answers"]["feel"])
    assert d is not None and (d.kind, d.labels) == ("mood", _MOODS)
    cal = QuestionCalibration(
        kind="mood",
        labels=list(_MOODS),
        temperature=2.0,
        examples=1,
        nll_before=1.0,
        nll_after=1.0,
        ece_before=0.0,
        ece_after=0.0,
    )
    calibrated = Calibrator(Calibration(questions={"feel": cal})).apply(result)
    assert calibrated.answers["feel"].raw_probabilities == answer.probabilities  # type: ignore[union-attr]


def test_without_the_toy_the_parser_refuses_its_type() -> None:
    got = parse_request(json.dumps(_BODY).encode())
    assert not isinstance(got, ClassificationRequest)
    assert got.code == ErrorCode.UNKNOWN_QUESTION_KIND
    assert got.field == "questions.feel.type"
    assert got.message.endswith("expected one of noul, yes_no, choice, score")


def test_a_kind_whose_name_or_type_is_taken_is_refused(mood: None) -> None:
    class Again(Mood):
        name = "again"
        types = ("noul",)

    with pytest.raises(ValueError, match="type 'noul' is taken"):
        register(Again)
    with pytest.raises(ValueError, match="question kind 'mood' is registered twice"):
        register(Mood)

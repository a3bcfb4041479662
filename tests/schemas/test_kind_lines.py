"""Each question kind's one-line answer (what `dgstream tail` and `dgstream ask` print),
for the project's answer shape and Jev's: the kind is found by the answer's `type`, and the
line names the answer and its leading number to two places."""

from __future__ import annotations

from typing import Any

import pytest

from dgstream.schemas.kinds import kind_of_type

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("answer", "line"),
    [
        ({"type": "yes_no", "label": "yes", "p_yes": 0.8149}, "yes p_yes=0.81"),
        ({"type": "yes_no", "label": "no", "p_yes": 0.005}, "no p_yes=0.01"),
        ({"type": "noul", "noul": 0.3333}, "p_yes=0.33"),
        ({"type": "choice", "choice": "spam", "confidence": 0.546}, "spam (0.55)"),
        (
            {"type": "score", "level": "serious", "expected_score": 2.998},
            "serious E=3.00",
        ),
        (
            {
                "type": "score",
                "score": 1.25,
                "probabilities": {"0": 0.1, "1": 0.7, "2": 0.2},
                "legend": {"0": "none", "1": "mild", "2": "serious"},
            },
            "mild score=1.25",
        ),
    ],
)
def test_each_kind_writes_its_answer_line(answer: dict[str, Any], line: str) -> None:
    kind = kind_of_type(answer["type"])
    assert kind is not None, answer["type"]
    assert kind.line(answer) == line


def test_an_unknown_type_has_no_kind() -> None:
    assert kind_of_type("nope") is None
    assert kind_of_type(None) is None

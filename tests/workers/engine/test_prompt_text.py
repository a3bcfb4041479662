"""The system text the model reads. The demo model was trained on it, so a request that
could be written before Jev's forms were accepted (instructions and level names all text)
must get the same bytes; Jev's forms (no instructions, JSON texts, null levels) get theirs."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from dgstream.schemas import ClassificationRequest, parse_request
from dgstream.topology import demo_tasks
from dgstream.workers.engine.template import labels_and_answers, system_text, user_text

pytestmark = pytest.mark.unit


def _questions(body: dict[str, Any]) -> dict[str, Any]:
    parsed = parse_request(json.dumps(body).encode())
    assert isinstance(parsed, ClassificationRequest), parsed
    assert parsed.questions is not None
    return dict(parsed.questions)


def test_demo_prompts_are_byte_identical_to_the_trained_ones() -> None:
    """sha256 over the system texts of the first 300 demo requests, as written by the code
    the demo model was trained with (before null instructions and levels existed)."""
    texts = [system_text(_questions(demo_tasks.example(s).request)) for s in range(300)]
    digest = hashlib.sha256("\n\x00".join(texts).encode()).hexdigest()
    assert digest == "612be06cf496b824ea16db0337889044739cf4a82039d0bcaa33096b069900f5"


def test_every_kind_in_its_written_form() -> None:
    body = {
        "id": "r",
        "state": "s",
        "questions": {
            "toxic": {
                "type": "noul",
                "instructions": "Is it toxic?",
                "criteria": {"true": "insults", "false": None},
            },
            "topic": {
                "type": "choice",
                "instructions": "Which topic?",
                "criteria": {"sport": "games", "other": None},
            },
            "sev": {"type": "score", "instructions": "How bad?", "criteria": ["none", "bad"]},
        },
    }
    assert system_text(_questions(body)) == (
        "You answer questions about the user's message.\n"
        "Answer every question on its own line as `id: label`, using only the labels given.\n"
        "\n"
        "Question toxic (yes/no): Is it toxic?\n"
        "  yes: insults\n"
        "  Labels: yes, no\n"
        "Question topic (choice): Which topic?\n"
        "  A: sport - games\n"
        "  B: other\n"
        "  Labels: A, B\n"
        "Question sev (score, 1 = lowest): How bad?\n"
        "  1: none\n"
        "  2: bad\n"
        "  Labels: 1, 2"
    )


def test_jev_forms_in_the_prompt() -> None:
    body = {
        "id": "r",
        "state": {"message": "héllo"},
        "questions": {
            "spam": {"type": "noul", "criteria": {"true": {"means": "ads"}}},
            "tone": {"type": "choice", "criteria": {"calm": None, "angry": ["hostile"]}},
            "urg": {
                "type": "score",
                "instructions": {"task": "urgency"},
                "criteria": ["Can wait", None, "Now"],
            },
        },
    }
    text = system_text(_questions(body))
    assert text.splitlines()[3:] == [
        "Question spam (yes/no)",
        '  yes: {"means": "ads"}',
        "  Labels: yes, no",
        "Question tone (choice)",
        "  A: calm",
        '  B: angry - ["hostile"]',
        "  Labels: A, B",
        'Question urg (score, 1 = lowest): {"task": "urgency"}',
        "  1: Can wait",
        "  2",
        "  3: Now",
        "  Labels: 1, 2, 3",
    ]
    parsed = parse_request(json.dumps(body).encode())
    assert isinstance(parsed, ClassificationRequest)
    assert user_text(parsed.state, {}) == '{"message": "héllo"}'


def test_the_engine_names_null_levels_as_the_schema_does() -> None:
    questions = _questions(
        {
            "id": "r",
            "state": "s",
            "questions": {"q": {"type": "score", "criteria": [None, "mid", None, None]}},
        }
    )
    labels, answers = labels_and_answers(questions["q"])
    assert labels == ("1", "2", "3", "4")
    assert answers == questions["q"].answers == ("level 0", "mid", "level 2", "level 3")

"""The moderation sample `dgstream demo` sends: events with their truth in metadata."""

from __future__ import annotations

import random
from typing import Any

from dgstream.topology.demo_tasks.generate import _plan, _state
from dgstream.topology.demo_tasks.truth import TaskQuestion, truth_of
from dgstream.topology.demo_tasks.words import LANGUAGES

# The demo's moderation question set: fixed ids and wordings, every kind.
MODERATION_QUESTIONS: dict[str, dict[str, Any]] = {
    "has_link": {"type": "noul", "instructions": "Does the message contain a link?"},
    "insult": {"type": "noul", "instructions": "Does the message contain an insult?"},
    "shouting": {"type": "yes_no", "instructions": "Is the message shouting in capitals?"},
    "language": {
        "type": "choice",
        "instructions": "Which language is the message in?",
        "criteria": dict.fromkeys(LANGUAGES),
    },
    "excitement": {
        "type": "score",
        "instructions": "How many exclamation marks does the message have?",
        "criteria": ["none", "one", "a few", "many"],
    },
}
_MODERATION_TASKS = {
    "has_link": TaskQuestion("has_link"),
    "insult": TaskQuestion("insult"),
    "shouting": TaskQuestion("shouting"),
    "language": TaskQuestion("language"),
    "excitement": TaskQuestion("exclamations", bounds=(0, 1, 3)),
}


def sample_events(n: int, seed: int = 0, *, with_truth: bool = True) -> list[dict[str, Any]]:
    """`n` moderation-flavoured events (wire requests) with the moderation question set.

    With `with_truth`, each event's `metadata` holds `{"truth": {qid: answer}}` (metadata
    is echoed in the result, so a consumer can check answers; the model never sees it)."""
    rng = random.Random(seed)
    events = []
    for i in range(n):
        tqs = list(_MODERATION_TASKS.values())
        wires = list(MODERATION_QUESTIONS.values())
        # Mostly English (insults, topics), some messages in the other four languages.
        lang = "english" if rng.random() < 0.6 else rng.choice(LANGUAGES[1:])
        plan = _plan(rng, tqs, wires, language=lang)
        state = _state(rng, plan)
        event: dict[str, Any] = {
            "id": f"event-{seed}-{i:05d}",
            "state": state,
            "questions": {qid: dict(q) for qid, q in MODERATION_QUESTIONS.items()},
        }
        if with_truth:
            event["metadata"] = {
                "truth": {
                    qid: truth_of(state, _MODERATION_TASKS[qid], MODERATION_QUESTIONS[qid])
                    for qid in MODERATION_QUESTIONS
                }
            }
        events.append(event)
    return events

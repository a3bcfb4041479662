"""The host benchmarks' questions (`bench/worker_overhead.py`, `bench/images_host.py`): two
inline questions, one yes/no and one choice, so each request takes one read of each kind."""

from __future__ import annotations

from typing import Any

QUESTIONS: dict[str, Any] = {
    "urgent": {"type": "yes_no", "instructions": "Does it need an answer today?"},
    "language": {
        "type": "choice",
        "instructions": "Which language is it in?",
        "criteria": {"en": None, "de": None},
    },
}

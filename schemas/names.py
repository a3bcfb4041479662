"""The names the contract shares with the worker and the topology, each written once.

- A Kafka topic name: Kafka's own rule (letters, digits, `.`, `_`, `-`; at most 249
  characters; not `.` or `..`).
- A question id: a letter, then letters, digits or `_`, 64 characters at most; it appears
  in the answer template the model reads (`id: label`), so it must be one plain word.
"""

from __future__ import annotations

import re

__all__ = ["QUESTION_ID_PATTERN", "TOPIC_CHARS", "TOPIC_PATTERN", "is_question_id", "is_topic_name"]

TOPIC_CHARS = "a-zA-Z0-9._-"  # a regex character class's body
TOPIC_PATTERN = rf"^[{TOPIC_CHARS}]{{1,249}}$"
QUESTION_ID_PATTERN = r"^[A-Za-z][A-Za-z0-9_]{0,63}$"

_TOPIC = re.compile(TOPIC_PATTERN)
_QUESTION_ID = re.compile(QUESTION_ID_PATTERN)


def is_topic_name(name: str) -> bool:
    return _TOPIC.fullmatch(name) is not None and name not in (".", "..")


def is_question_id(qid: str) -> bool:
    return _QUESTION_ID.fullmatch(qid) is not None

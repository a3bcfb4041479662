"""The truth of each question type, computed from the state by code."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dgstream.topology.demo_tasks.words import (
    _TLDS,
    ENGLISH,
    INSULTS,
    LANGUAGE_WORDS,
    LANGUAGES,
    TOPIC_WORDS,
    TOPICS,
    WORD_LISTS,
)

_LINK_RE = re.compile(
    r"(https?://\S+|www\.\S+|\b[a-z0-9]+\.(?:" + "|".join(_TLDS) + r")\b\S*)", re.IGNORECASE
)
_WORD_RE = re.compile(r"[A-Za-z]+")
_NUMBER_RE = re.compile(r"\d+")

_ENGLISH_SET = frozenset(ENGLISH) | frozenset(INSULTS)
_ENGLISH_SET |= frozenset(w for ws in TOPIC_WORDS.values() for w in ws)
_LANGUAGE_SETS = {"english": _ENGLISH_SET} | {
    lang: frozenset(ws) for lang, ws in LANGUAGE_WORDS.items()
}


def _without_links(state: str) -> str:
    return _LINK_RE.sub(" ", state)


def words_of(state: str) -> list[str]:
    """The alphabetic words of the state, links left out, in their original case."""
    return _WORD_RE.findall(_without_links(state))


def has_link(state: str) -> bool:
    return _LINK_RE.search(state) is not None


def is_shouting(state: str) -> bool:
    """At least half of the words of two letters or more are all capitals."""
    long = [w for w in words_of(state) if len(w) >= 2]
    return bool(long) and sum(w.isupper() for w in long) * 2 >= len(long)


def numbers_in(state: str) -> list[int]:
    return [int(n) for n in _NUMBER_RE.findall(_without_links(state))]


def count_listed(state: str, words: Sequence[str]) -> int:
    """Occurrences (case-insensitive) of the words of `words`."""
    wanted = {w.lower() for w in words}
    return sum(w.lower() in wanted for w in words_of(state))


def language_of(state: str) -> str:
    """The language with the most words in the state (ties: `LANGUAGES` order)."""
    lower = [w.lower() for w in words_of(state)]
    counts = {lang: sum(w in _LANGUAGE_SETS[lang] for w in lower) for lang in LANGUAGES}
    return max(LANGUAGES, key=lambda lang: counts[lang])


def topic_of(state: str) -> str | None:
    """The topic with the most keywords, or None without any (ties: `TOPICS` order)."""
    counts = {t: count_listed(state, ws) for t, ws in TOPIC_WORDS.items()}
    best = max(TOPICS, key=lambda t: counts[t])
    return best if counts[best] else None


def bucket(count: int, bounds: Sequence[int]) -> int:
    """Index of the level `count` falls in: the first whose upper bound it does not pass."""
    for i, upper in enumerate(bounds):
        if count <= upper:
            return i
    return len(bounds)


@dataclass(frozen=True)
class TaskQuestion:
    """What the generator knows about a question besides its wire form."""

    task: str  # one of QUESTION_TYPES
    threshold: int | None = None  # number_above
    word_list: str | None = None  # listed_words: a key of WORD_LISTS
    bounds: tuple[int, ...] = ()  # score: upper bounds of the levels
    colour: str | None = None  # image_colour_present (topology/demo_tasks/images.py)


def truth_of(state: str, q: TaskQuestion, question: Mapping[str, Any]) -> str:
    """The answer name for `question` (its wire dict), computed from `state` alone."""
    if q.task == "has_link":
        return "yes" if has_link(state) else "no"
    if q.task == "shouting":
        return "yes" if is_shouting(state) else "no"
    if q.task == "number_above":
        assert q.threshold is not None
        return "yes" if any(n > q.threshold for n in numbers_in(state)) else "no"
    if q.task == "insult":
        return "yes" if count_listed(state, INSULTS) else "no"
    if q.task == "language":
        return language_of(state)
    if q.task == "topic":
        found = topic_of(state)
        if found is None:
            raise ValueError("a topic question needs a state with a topic")
        return found
    levels = question["criteria"]
    if q.task == "exclamations":
        return str(levels[bucket(state.count("!"), q.bounds)])
    if q.task == "listed_words":
        assert q.word_list is not None
        return str(levels[bucket(count_listed(state, WORD_LISTS[q.word_list]), q.bounds)])
    raise ValueError(f"unknown task {q.task!r}")

"""Requests generated from a seed: questions, a planned state, the wire request and its
truth; the training and held-out seed ranges; the contract's view of a request."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dgstream.schemas.names import is_question_id
from dgstream.topology.demo_tasks.truth import TaskQuestion, is_shouting, truth_of
from dgstream.topology.demo_tasks.words import (
    _DOMAINS,
    _IDS,
    _TLDS,
    _WORDINGS,
    _YES_NO_CRITERIA,
    ENGLISH,
    HELD_OUT_BASE,
    INSULTS,
    LANGUAGE_WORDS,
    LANGUAGES,
    QUESTION_TYPES,
    SCORE_SCHEMES,
    THRESHOLDS,
    TOPIC_WORDS,
    TOPICS,
    WORD_LISTS,
)

# --------------------------------------------------------------------------- questions


def _question(rng: random.Random, task: str) -> tuple[TaskQuestion, dict]:
    """A question of `task` in wire form (its options always hold any possible truth)."""
    wording = rng.choice(_WORDINGS[task])
    if task in ("has_link", "shouting", "number_above", "insult"):
        t = rng.choice(THRESHOLDS) if task == "number_above" else None
        wire: dict[str, Any] = {
            "type": rng.choice(("noul", "yes_no")),
            "instructions": wording.format(t=t),
        }
        if rng.random() < 0.3:
            yes, no = _YES_NO_CRITERIA[task]
            wire["criteria"] = {"true": yes.format(t=t), "false": no.format(t=t)}
        return TaskQuestion(task, threshold=t), wire
    if task in ("language", "topic"):
        universe = LANGUAGES if task == "language" else TOPICS
        # The options are drawn first; the state's language or topic is then picked among
        # them (`_plan`), so the truth is always an option.
        options = rng.sample(universe, rng.randint(2, 5))
        wire = {"type": "choice", "instructions": wording, "criteria": dict.fromkeys(options)}
        return TaskQuestion(task), wire
    levels, bounds = rng.choice(SCORE_SCHEMES[task])
    word_list = rng.choice(tuple(WORD_LISTS)) if task == "listed_words" else None
    wire = {
        "type": "score",
        "instructions": wording.format(l=word_list),
        "criteria": list(levels),
    }
    return TaskQuestion(task, word_list=word_list, bounds=bounds), wire


def _question_id(rng: random.Random, task: str, q: TaskQuestion, taken: set[str]) -> str:
    for _ in range(20):
        if rng.random() < 0.3:
            qid = f"q{rng.randint(1, 9)}"
        else:
            qid = rng.choice(_IDS[task]).format(t=q.threshold, l=q.word_list)
        if qid not in taken and is_question_id(qid):
            return qid
    n = 1
    while f"q{n}" in taken:
        n += 1
    return f"q{n}"


# --------------------------------------------------------------------------- states


@dataclass
class _Plan:
    """What the state will hold; the text is built from it, the truth from the text."""

    language: str
    topic: str | None = None
    topic_count: int = 0
    insults: int = 0
    link: bool = False
    shouting: bool = False
    numbers: list[int] = field(default_factory=list)
    exclamations: int = 0
    extra: list[str] = field(default_factory=list)  # listed words of a non-topic list


def _number(rng: random.Random, low: int, high: int) -> int:
    """A number in [low, high], spread over digit counts, never exactly a threshold."""
    while True:
        digits = rng.randint(len(str(max(low, 0))), len(str(high)))
        lo, hi = max(low, 10 ** (digits - 1) if digits > 1 else 0), min(high, 10**digits - 1)
        if lo > hi:
            continue
        n = rng.randint(lo, hi)
        if n not in THRESHOLDS:
            return n


def _count_for_level(rng: random.Random, bounds: Sequence[int], top: int) -> int:
    """A count whose level (see `bucket`) is drawn uniformly; the last level spans up to
    `top`."""
    level = rng.randrange(len(bounds) + 1)
    low = bounds[level - 1] + 1 if level else 0
    high = bounds[level] if level < len(bounds) else max(top, low)
    return rng.randint(low, high)


_Tasks = dict[str, tuple[TaskQuestion, dict]]


def _plan(
    rng: random.Random,
    questions: Sequence[TaskQuestion],
    wires: Sequence[dict],
    language: str | None = None,
) -> _Plan:
    # The draws from `rng` come in a fixed order (language, topic, link, shouting,
    # insults, numbers, exclamations, listed words): the demo model's training and
    # held-out sets are these draws, seed by seed.
    tasks = {q.task: (q, w) for q, w in zip(questions, wires, strict=True)}
    plan = _Plan(language=language if language is not None else _language(rng, tasks))
    if plan.language == "english":
        _plan_topic(rng, plan, tasks)
    _plan_marks(rng, plan, tasks)
    _plan_numbers(rng, plan, tasks)
    if "exclamations" in tasks:
        plan.exclamations = _count_for_level(rng, tasks["exclamations"][0].bounds, top=7)
    elif rng.random() < 0.3:
        plan.exclamations = rng.choice((1, 1, 2, 3))
    if "listed_words" in tasks:
        _plan_listed(rng, plan, tasks)
    return plan


def _language(rng: random.Random, tasks: _Tasks) -> str:
    if "topic" in tasks:  # topics exist only in English (the language options hold it)
        return "english"
    if "language" in tasks:
        return str(rng.choice(list(tasks["language"][1]["criteria"])))
    return "english" if rng.random() < 0.65 else rng.choice(LANGUAGES[1:])


def _plan_topic(rng: random.Random, plan: _Plan, tasks: _Tasks) -> None:
    if "topic" in tasks:
        plan.topic = rng.choice(list(tasks["topic"][1]["criteria"]))
    elif rng.random() < 0.8:
        plan.topic = rng.choice(TOPICS)
    if plan.topic:
        plan.topic_count = rng.choice((1, 1, 2, 2, 3, 4))


def _plan_marks(rng: random.Random, plan: _Plan, tasks: _Tasks) -> None:
    """A link, shouting, insults: likelier when asked about."""
    plan.link = rng.random() < (0.5 if "has_link" in tasks else 0.15)
    plan.shouting = rng.random() < (0.5 if "shouting" in tasks else 0.12)
    if "insult" in tasks:
        plan.insults = rng.choice((0, 0, 0, 1, 1, 2))
    elif rng.random() < 0.2:
        plan.insults = rng.choice((1, 1, 2))
    if plan.language != "english":
        plan.insults = min(plan.insults, 1)


def _plan_numbers(rng: random.Random, plan: _Plan, tasks: _Tasks) -> None:
    if "number_above" in tasks:
        t = tasks["number_above"][0].threshold
        assert t is not None
        small = [_number(rng, 0, t - 1) for _ in range(rng.choice((0, 1, 1, 2)))]
        plan.numbers = small + ([_number(rng, t + 1, 9999)] if rng.random() < 0.5 else [])
    elif rng.random() < 0.35:
        plan.numbers = [_number(rng, 0, 9999) for _ in range(rng.choice((1, 1, 2)))]


def _plan_listed(rng: random.Random, plan: _Plan, tasks: _Tasks) -> None:
    """Words of the asked list, as many as a level drawn uniformly."""
    q, _ = tasks["listed_words"]
    name = q.word_list
    assert name is not None
    want = _count_for_level(rng, q.bounds, top=4)
    english = plan.language == "english"
    if name == "insult":
        plan.insults = want if english else min(want, 1)
    elif not english:
        plan.extra = [rng.choice(WORD_LISTS[name]) for _ in range(min(want, 2))]
    elif name == plan.topic:
        plan.topic_count = max(want, 1)  # the topic's own words: one at least
    elif want and "topic" not in tasks:
        plan.topic, plan.topic_count = name, want
    elif want:
        # Words of another list next to the main topic, which keeps the majority.
        plan.extra = [rng.choice(WORD_LISTS[name]) for _ in range(want)]
        plan.topic_count = max(plan.topic_count, want + 1)


def _link(rng: random.Random) -> str:
    dom, tld = rng.choice(_DOMAINS), rng.choice(_TLDS)
    path = rng.choice(("", "", f"/{rng.choice(_DOMAINS)}", f"/{rng.randint(1, 99)}"))
    return (
        rng.choice(
            (
                f"https://www.{dom}.{tld}{path}",
                f"http://{dom}.{tld}{path}",
                f"www.{dom}.{tld}{path}",
            )
        )
        if rng.random() < 0.8
        else f"{dom}.{tld}{path}"
    )


def _state(rng: random.Random, plan: _Plan) -> str:
    english = plan.language == "english"
    pool = ENGLISH if english else LANGUAGE_WORDS[plan.language]
    content: list[str] = []
    if plan.topic:
        content += [rng.choice(TOPIC_WORDS[plan.topic]) for _ in range(plan.topic_count)]
    content += [rng.choice(INSULTS) for _ in range(plan.insults)]
    content += plan.extra
    # Enough words of the state's own language that it wins the count clearly.
    n_fill = rng.randint(4, 16) if english else rng.randint(max(4, 2 * len(content) + 2), 14)
    words = [rng.choice(pool) for _ in range(n_fill)] + content
    rng.shuffle(words)
    if plan.shouting:
        words = [w.upper() if rng.random() < 0.9 else w for w in words]
        if not is_shouting(" ".join(words)):
            words = [w.upper() for w in words]
    else:
        words = [w.capitalize() if rng.random() < 0.08 else w for w in words]
        if len(words) >= 6 and rng.random() < 0.2:
            i = rng.randrange(len(words))
            words[i] = words[i].upper()
    if words:
        words[0] = words[0][:1].upper() + words[0][1:]
    tokens: list[str] = list(words)
    for n in plan.numbers:
        tokens.insert(rng.randint(0, len(tokens)), str(n))
    if plan.link:
        tokens.insert(rng.randint(0, len(tokens)), _link(rng))
    # Punctuation: exclamation marks in groups of 1..3 after random tokens, a few other marks.
    marks = [""] * len(tokens)
    left = plan.exclamations
    while left:
        k = min(left, rng.randint(1, 3))
        i = rng.randrange(len(tokens))
        marks[i] += "!" * k
        left -= k
    for i in range(len(tokens)):
        if not marks[i] and rng.random() < 0.1:
            marks[i] = rng.choice((",", ".", "?", ":"))
    return " ".join(t + m for t, m in zip(tokens, marks, strict=True)).strip()


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Example:
    """A generated request, its truth, and the generator's view of each question."""

    request: dict[str, Any]
    truth: dict[str, str]  # question id -> answer name
    tasks: dict[str, TaskQuestion]  # question id -> what the question asks


def example(seed: int) -> Example:
    """One request with its truth and tasks, from `random.Random(seed)` alone."""
    rng = random.Random(seed)
    n = rng.choice((1, 2, 2, 3, 3, 4, 4))
    tasks = rng.sample(QUESTION_TYPES, n)
    built = [_question(rng, task) for task in tasks]
    if "language" in tasks and "topic" in tasks:
        # Topics exist only in English states: English must be a language option.
        wire = built[tasks.index("language")][1]
        options = list(wire["criteria"])
        if "english" not in options:
            options[rng.randrange(len(options))] = "english"
            wire["criteria"] = dict.fromkeys(options)
    plan = _plan(rng, [q for q, _ in built], [w for _, w in built])
    state = _state(rng, plan)
    questions: dict[str, dict[str, Any]] = {}
    truth: dict[str, str] = {}
    views: dict[str, TaskQuestion] = {}
    for q, wire in built:
        qid = _question_id(rng, q.task, q, set(questions))
        questions[qid] = wire
        truth[qid] = truth_of(state, q, wire)
        views[qid] = q
    request = {"id": f"demo-{seed}", "state": state, "questions": questions}
    return Example(request, truth, views)


def generate(seed: int) -> tuple[dict[str, Any], dict[str, str]]:
    """One request (a valid wire request) and its truth (question id -> answer name)."""
    ex = example(seed)
    return ex.request, ex.truth


def training_seeds(seed: int, count: int, start: int = 0) -> range:
    """Seeds of the training stream `seed` (each below HELD_OUT_BASE)."""
    base = seed * (1 << 32)
    if base + start + count > HELD_OUT_BASE:
        raise ValueError("training seeds would reach the held-out range")
    return range(base + start, base + start + count)


def held_out_seeds(seed: int, count: int) -> range:
    """Seeds of held-out split `seed`: at or above HELD_OUT_BASE, never a training seed."""
    base = HELD_OUT_BASE + seed * (1 << 32)
    return range(base, base + count)


def held_out(seed: int = 0, count: int = 300) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """The held-out split `seed`: `count` requests and their truths."""
    return [generate(s) for s in held_out_seeds(seed, count)]


def held_out_examples(seed: int = 0, count: int = 300) -> list[Example]:
    """The held-out split `seed` with the generator's view of each question."""
    return [example(s) for s in held_out_seeds(seed, count)]


def iter_training(seed: int, count: int, start: int = 0) -> Iterator[Example]:
    for s in training_seeds(seed, count, start):
        yield example(s)


def validate(request: Mapping[str, Any]) -> Any:
    """`schemas.parse_request` on the request's JSON; raises ValueError if refused."""
    import json

    from dgstream.schemas import RequestError, parse_request

    parsed = parse_request(json.dumps(request).encode())
    if isinstance(parsed, RequestError):
        raise ValueError(f"invalid demo request {request.get('id')!r}: {parsed}")
    return parsed


def questions_of(request: Mapping[str, Any]) -> dict[str, Any]:
    """The request's questions as the contract's models (`schemas.Question`), the way the
    engine takes them."""
    return dict(validate(request).questions)

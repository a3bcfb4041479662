"""Training-only questions: a share of the training requests gets one more question that
gives the choice questions' word -> category -> option chain a direct signal; they are
logged as kinds of their own and never reach the held-out check."""

from __future__ import annotations

import functools
import random

from dgstream.topology import demo_tasks
from dgstream.workers.engine.template import ChatFormat

# The held-out kinds, then the training-only questions' own (logged apart so that their
# learning can be watched; the held-out check never sees them), then the image family's
# (`--image-share`), logged apart from the text family's kinds.
IMAGE_KINDS = tuple(f"image_{k}" for k in demo_tasks.KINDS)
KINDS = (*demo_tasks.KINDS, "category", "name", "mention", *IMAGE_KINDS)

# Yes/no questions that name ONE category ("Is the message about food?", "Is the text in
# french?"), added to training requests with `--category-share`. Their truth is the family's
# own (`topic_of`, `language_of`); they give the word -> topic/language link a direct signal,
# which the choice questions need (docs/benchmarks.md: the committed checkpoint finds
# "english" but not the other languages or the topics). The held-out family is unchanged.
_CATEGORY_WORDINGS = {
    "about_topic": (
        "Is the message about {c}?",
        "Does the text talk about {c}?",
        "Is {c} the topic of the message?",
    ),
    "in_language": (
        "Is the message written in {c}?",
        "Is the text in {c}?",
        "Does the user write in {c}?",
    ),
}
# Questions that ask for the NAME of the state's topic or language, added with
# `--name-share`: wired as a choice over the whole universe, but the slot's target is the
# name's own token (" french", " food"), not its letter. With tied embeddings the slot must
# then carry the name's embedding: a bag-of-words classifier from state words to the name
# token, which is the feature a choice question needs to find its option by name.
_NAME_WORDINGS = {
    "name_topic": (
        "Name the topic of the message.",
        "Write the topic of the text by its name.",
    ),
    "name_language": (
        "Name the language of the message.",
        "Write the language of the text by its name.",
    ),
}
# Choice questions over category names where the state names one of them ("... french
# ..."), added with `--mention-share`: the letter is found by matching a state token to an
# option's name token. That pointer is what the choice questions lack: round 5's checkpoint
# knows each state's category (name questions 0.98) yet points only at "english" vs the
# rest (docs/benchmarks.md).
_MENTION_WORDINGS = (
    "Which of these words does the message mention?",
    "Which word of the list is in the text?",
    "Which of the options does the user name?",
)
_KIND_OF = {
    **demo_tasks.KIND_OF,
    **dict.fromkeys(_CATEGORY_WORDINGS, "category"),
    **dict.fromkeys(_NAME_WORDINGS, "name"),
    "mention": "mention",
    **{task: f"image_{kind}" for task, kind in demo_tasks.IMAGE_KIND_OF.items()},
}


def _room(name: str, ex: demo_tasks.Example, s: int, share: float) -> random.Random | None:
    """The generator of training-only question `name` for request seed `s`, or None when
    this request gets none: it is outside the `share`, or already has the most questions."""
    rng = random.Random(f"{name}/{s}")
    if rng.random() >= share or len(ex.request["questions"]) >= demo_tasks.MAX_QUESTIONS:
        return None
    return rng


def with_category_question(ex: demo_tasks.Example, s: int, share: float) -> demo_tasks.Example:
    """`ex` with one category yes/no question inserted at a random place, for a `share` of
    the requests that have room for it (decided by the request seed `s` alone); about half
    of the answers are yes."""
    rng = _room("category", ex, s, share)
    if rng is None:
        return ex
    questions = ex.request["questions"]
    state = ex.request["state"]
    task = rng.choice(tuple(_CATEGORY_WORDINGS))
    if task == "about_topic":
        universe: tuple[str, ...] = demo_tasks.TOPICS
        actual: str | None = demo_tasks.topic_of(state)
    else:
        universe, actual = demo_tasks.LANGUAGES, demo_tasks.language_of(state)
    if actual is not None and rng.random() < 0.5:
        category = actual
    else:
        category = rng.choice([c for c in universe if c != actual])
    qid = next(
        q
        for q in (rng.choice((f"is_{category}", f"about_{category}", "category")), "aux_q")
        if q not in questions
    )
    wire = {
        "type": rng.choice(("noul", "yes_no")),
        "instructions": rng.choice(_CATEGORY_WORDINGS[task]).format(c=category),
    }
    return _insert_question(ex, rng, qid, wire, "yes" if category == actual else "no", task)


def _insert_question(
    ex: demo_tasks.Example, rng: random.Random, qid: str, wire: dict, truth: str, task: str
) -> demo_tasks.Example:
    items = list(ex.request["questions"].items())
    items.insert(rng.randint(0, len(items)), (qid, wire))
    request = {**ex.request, "questions": dict(items)}
    return demo_tasks.Example(
        request, {**ex.truth, qid: truth}, {**ex.tasks, qid: demo_tasks.TaskQuestion(task)}
    )


def with_name_question(ex: demo_tasks.Example, s: int, share: float) -> demo_tasks.Example:
    """`ex` with one name question (see `_NAME_WORDINGS`) inserted at a random place, for a
    `share` of the requests that have room for it (decided by the request seed alone).
    Topic names are asked only of states that have a topic."""
    rng = _room("name", ex, s, share)
    if rng is None:
        return ex
    questions = ex.request["questions"]
    state = ex.request["state"]
    topic = demo_tasks.topic_of(state)
    task = "name_topic" if topic is not None and rng.random() < 0.5 else "name_language"
    if task == "name_topic":
        universe, actual = demo_tasks.TOPICS, topic
    else:
        universe, actual = demo_tasks.LANGUAGES, demo_tasks.language_of(state)
    assert actual is not None
    options = rng.sample(universe, len(universe))
    qid = next(q for q in (rng.choice(("name", "which", task)), "aux_n") if q not in questions)
    wire = {
        "type": "choice",
        "instructions": rng.choice(_NAME_WORDINGS[task]),
        "criteria": dict.fromkeys(options),
    }
    return _insert_question(ex, rng, qid, wire, actual, task)


def with_mention_question(ex: demo_tasks.Example, s: int, share: float) -> demo_tasks.Example:
    """`ex` with one category name inserted in its state and a choice question asking which
    of 2..5 names (topics and languages mixed) it mentions, for a `share` of the requests
    that have room (decided by the request seed alone). The other questions' truths are
    computed again from the new state (a name is in no word list, so they rarely change)."""
    rng = _room("mention", ex, s, share)
    if rng is None:
        return ex
    questions = ex.request["questions"]
    options = rng.sample(demo_tasks.LANGUAGES + demo_tasks.TOPICS, rng.randint(2, 5))
    named = rng.choice(options)
    words = ex.request["state"].split(" ")
    # Never first: the name then has its leading-space token, the one the options use.
    words.insert(rng.randint(1, len(words)), named)
    state = " ".join(words)
    truth = {
        qid: demo_tasks.truth_of(state, ex.tasks[qid], wire) for qid, wire in questions.items()
    }
    ex = demo_tasks.Example({**ex.request, "state": state}, truth, ex.tasks)
    qid = next(q for q in (rng.choice(("mention", "named", "word")), "aux_m") if q not in questions)
    wire = {
        "type": "choice",
        "instructions": rng.choice(_MENTION_WORDINGS),
        "criteria": dict.fromkeys(options),
    }
    return _insert_question(ex, rng, qid, wire, named, "mention")


def _aux_questions_only(ex: demo_tasks.Example) -> demo_tasks.Example:
    """`ex` with only its training-only questions (`--aux-only`: a diagnostic mix)."""
    keep = [q for q, t in ex.tasks.items() if t.task not in demo_tasks.KIND_OF]
    questions = {q: ex.request["questions"][q] for q in keep}
    return demo_tasks.Example(
        {**ex.request, "questions": questions},
        {q: ex.truth[q] for q in keep},
        {q: ex.tasks[q] for q in keep},
    )


@functools.cache  # called for every name slot of every read; one tokenizer per process
def name_token(chat: ChatFormat, name: str) -> int:
    """The one token `name` is after `id: ` on the canvas (checked to be one token)."""
    head, full = chat.encode("x:"), chat.encode(f"x: {name}")
    if len(full) != len(head) + 1 or full[: len(head)] != head:
        raise ValueError(f"{name!r} is not one token after 'x: '")
    return full[-1]

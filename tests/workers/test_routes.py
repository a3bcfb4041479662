"""Routes: the condition language (tokenizer, parser, types, load-time checks), its
evaluation against results (three-valued where answers are missing), and the router."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from dgstream.schemas import ClassificationResult, Question
from dgstream.workers.routes import (
    DEFAULT_ROUTE,
    FIELDS,
    REPLY_ROUTE,
    Condition,
    Route,
    RouteError,
    Router,
    check_condition,
    check_routes,
    parse_condition,
    question_info,
)

pytestmark = pytest.mark.unit

PROPERTY = settings(
    database=None,
    deadline=None,
    max_examples=400,
    suppress_health_check=[HealthCheck.too_slow],
)


def result(
    p_yes: float = 0.95,
    choice: str = "spam",
    probs: dict[str, float] | None = None,
    levels: tuple[float, float, float] = (0.1, 0.2, 0.7),
    skipped: bool = False,
    reads: int = 1,
) -> ClassificationResult:
    probs = probs or {"spam": 0.8, "abuse": 0.15, "normal": 0.05}
    expected = sum((i + 1) * p for i, p in enumerate(levels))
    top = max(range(3), key=lambda i: levels[i])
    spread = {"stderr": 0.02, "agreement": 1.0} if reads > 1 else {}
    answers: dict[str, Any] = {
        "toxic": {
            "type": "yes_no",
            "p_yes": p_yes,
            "label": "yes" if p_yes >= 0.5 else "no",
            "confidence": max(p_yes, 1 - p_yes),
            **spread,
        },
        "cat": {
            "type": "choice",
            "choice": choice,
            "probabilities": probs,
            "confidence": probs[choice],
            **spread,
        },
        "sev": (
            {"type": "skipped", "reason": "ask_if not met: toxic=no"}
            if skipped
            else {
                "type": "score",
                "expected_score": expected,
                "level": ["none", "mild", "bad"][top],
                "legend": {"1": "none", "2": "mild", "3": "bad"},
                "probabilities": dict(zip(["none", "mild", "bad"], levels, strict=True)),
                "confidence": levels[top],
                **spread,
            }
        ),
    }
    return ClassificationResult.model_validate(
        {
            "id": "r",
            "status": "ok",
            "answers": answers,
            "diagnostics": {
                "reads": reads,
                "entropy": {"toxic": 0.2, "cat": 0.7},
                "label_mass": {"toxic": 0.9, "cat": None},
                "model": "m",
                "engine": "e",
                "worker": "w",
            },
        }
    )


QUESTIONS = {
    qid: TypeAdapter(Question).validate_python(q)
    for qid, q in {
        "toxic": {"type": "noul", "instructions": "Toxic?"},
        "cat": {
            "type": "choice",
            "instructions": "Kind?",
            "criteria": {"spam": None, "abuse": None, "normal": None},
        },
        "sev": {"type": "score", "instructions": "How bad?", "criteria": ["none", "mild", "bad"]},
    }.items()
}
KNOWN = question_info(QUESTIONS)


def holds(text: str, res: ClassificationResult | None = None) -> bool:
    cond = parse_condition(text)
    check_condition(cond, KNOWN)
    return cond.evaluate(res or result())


# --------------------------------------------------------------------------- evaluation

EVALUATED = [
    ("toxic.p_yes >= 0.9", {}, True),
    ("toxic.p_yes >= 0.9", {"p_yes": 0.5}, False),
    ("0.4 <= toxic.p_yes < 0.9", {"p_yes": 0.5}, True),
    ("0.4 <= toxic.p_yes < 0.9", {"p_yes": 0.9}, False),
    ("0.4 <= toxic.p_yes < 0.9", {"p_yes": 0.4}, True),
    ("0.9 > toxic.p_yes >= 0.4", {"p_yes": 0.39}, False),
    ('cat.choice == "spam" and cat.confidence > 0.7', {}, True),
    ("cat.choice == 'spam' and cat.confidence > 0.9", {}, False),
    ('cat.choice != "spam" or toxic.label == "yes"', {}, True),
    ('not cat.choice == "spam"', {}, False),
    ("not not toxic.p_yes > 0.5", {}, True),
    # and binds tighter than or
    ('toxic.p_yes < 0.1 and cat.choice == "abuse" or sev.level == "bad"', {}, True),
    ('toxic.p_yes < 0.1 and (cat.choice == "abuse" or sev.level == "bad")', {}, False),
    ("sev.score > 1.5", {}, True),  # 0-based: 0*0.1 + 1*0.2 + 2*0.7 = 1.6
    ("sev.expected_score > 2.5", {}, True),  # 1-based: 2.6
    ("sev.score > 1.65", {}, False),
    ('sev.label == "bad" and sev.level == "bad"', {}, True),
    ("sev.skipped == false and not sev.skipped", {}, True),
    ("toxic.entropy < 0.3 and toxic.label_mass >= 0.9", {}, True),
    ("cat.label_mass >= 0.5", {}, False),  # unknown (a constrained read): no match
    ("cat.stderr < 0.05", {"reads": 4}, True),
    ("cat.stderr < 0.05", {}, False),  # one read: unknown
    ("cat.agreement == 1", {"reads": 4}, True),
    ("toxic.p_yes > 1e-3 and toxic.p_yes <= .96", {}, True),
    ("toxic.p_yes > .5e0", {}, True),
    ("toxic.confidence > cat.confidence", {}, True),  # two fields
    # A question not asked: its fields are unknown, and so is what depends on them ...
    ('sev.level == "bad"', {"skipped": True}, False),
    ('not sev.level == "bad"', {"skipped": True}, False),
    ("sev.skipped", {"skipped": True}, True),
    # ... unless the rest decides: false and unknown = false, true or unknown = true.
    ('sev.level == "bad" or toxic.p_yes > 0.9', {"skipped": True}, True),
    ('not (sev.level == "bad" and toxic.p_yes < 0.1)', {"skipped": True}, True),
    ("(((toxic.p_yes > 0.9)))", {}, True),
    ("(toxic.p_yes > 0.9) == (cat.confidence > 0.5)", {}, True),
]


@pytest.mark.parametrize(("text", "args", "expected"), EVALUATED)
def test_condition_against_a_result(text: str, args: dict[str, Any], expected: bool) -> None:
    assert holds(text, result(**args)) is expected


def test_a_question_missing_from_the_result_is_unknown() -> None:
    cond = parse_condition("other.p_yes > 0.5 or other.skipped")
    assert cond.evaluate(result()) is False
    assert parse_condition("not other.skipped").evaluate(result()) is False
    assert parse_condition("not other.skipped or toxic.p_yes > 0.5").evaluate(result()) is True


def test_a_field_of_another_kind_is_unknown_at_run_time() -> None:
    # Inline questions may reuse an id with another kind: no value, no match, no error.
    assert parse_condition("cat.p_yes > 0.5 or cat.p_yes <= 0.5").evaluate(result()) is False


def test_keywords_may_be_question_ids() -> None:
    cond = parse_condition("not.p_yes > 0.5 and and.skipped or or.label == 'x'")
    assert [str(f) for f in cond.fields()] == ["not.p_yes", "and.skipped", "or.label"]


# --------------------------------------------------------------------------- refusals

REFUSED = [
    ("", "empty", None),
    ("   ", "empty", None),
    ("toxic.p_yes", "is a number, not a condition", 0),
    ("toxic.p_yes >= ", "expected a value or a field, got the end", 15),
    ("toxic.p_yes = 0.9", "compare with ==", 12),
    ("toxic.p_yes >= 0.9 0.8", "after a complete condition", 19),
    ("toxic >= 0.9", "'toxic' is not a field", 0),
    ("toxic.", "expected a field name", 6),
    ("toxic.p_no > 0.5", "unknown field 'p_no'", 6),
    ("_x.p_yes > 0.5", "not a question id", 0),
    ("toxic.p_yes > 'high'", "cannot compare toxic.p_yes (number) with 'high' (text)", 0),
    ('cat.choice > "spam"', "> compares numbers", 0),
    ("toxic.skipped < true", "< compares numbers", 0),
    ("1 < 2", "constants only", 0),
    ("'a' == 'a'", "constants only", 0),
    ("toxic.p_yes > 1e999", "out of range", 14),
    ("(toxic.p_yes > 0.5", "expected ')'", 18),
    ("toxic.p_yes > 0.5)", "after a complete condition", 17),
    ('cat.choice == "spam', "unterminated string", 14),
    ('cat.choice == "sp\\am"', "unknown escape", 17),
    ("toxic.p_yes > 0.5 and 0.3", "is a number, not a condition", 22),
    ("not 'x'", "is a text, not a condition", 4),
    ("toxic.p_yes ≥ 0.5", "unexpected character '≥'", 12),
    ("(" * 33 + "toxic.skipped" + ")" * 33, "nested more than 32", 32),
    ("not " * 33 + "toxic.skipped", "nested more than 32", 128),
    ("x" * 2001, "at most 2000", None),
]


@pytest.mark.parametrize(("text", "says", "position"), REFUSED)
def test_bad_conditions_are_refused_saying_where(
    text: str, says: str, position: int | None
) -> None:
    with pytest.raises(RouteError) as caught:
        parse_condition(text)
    assert says in caught.value.message
    assert caught.value.position == position
    if position is not None:
        assert f"at character {position + 1}" in str(caught.value)


CHECKED = [
    # impossible or pointless thresholds
    ("toxic.p_yes >= 1.5", "is false whatever the answer: toxic.p_yes lies in 0..1"),
    ("toxic.p_yes > 1", "is false whatever the answer"),
    ("toxic.p_yes < 0", "is false whatever the answer"),
    ("-0.5 > toxic.p_yes", "is false whatever the answer"),
    ("toxic.confidence < 90", "is true whatever the answer"),
    ("toxic.p_yes >= 0", "is true whatever the answer"),
    ("toxic.p_yes != 2", "is true whatever the answer"),
    ("toxic.entropy >= 0", "is true whatever the answer"),
    ("0.9 <= toxic.p_yes < 0.4", "never true: no value of toxic.p_yes makes it hold"),
    ("0.5 < toxic.p_yes < 0.5", "no value of toxic.p_yes"),
    ("toxic.p_yes > 0.9 and toxic.p_yes < 0.3", "no value of toxic.p_yes"),
    ("toxic.p_yes > 0.9 and (cat.skipped or (toxic.p_yes < 0.3 and toxic.p_yes > 0.1))", None),
    ("toxic.p_yes > 0.9 and (toxic.label == 'yes' and toxic.p_yes <= 0.9)", "no value"),
    # scores: the known question has 3 levels
    ("sev.score >= 3", "is false whatever the answer: sev.score lies in 0..2"),
    ("sev.expected_score > 3", "is false whatever the answer: sev.expected_score lies in 1..3"),
    ("sev.expected_score >= 1", "is true whatever the answer"),
    # names and kinds the question sets know
    ("spam.p_yes > 0.5", "unknown question 'spam'"),
    ("cat.p_yes > 0.5", "p_yes is a field of yes_no questions and cat is choice"),
    ("toxic.choice == 'spam'", "choice is a field of choice questions and toxic is yes_no"),
    (
        "sev.level == 'extreme'",
        "is false whatever the answer: sev's answers are 'bad', 'mild', 'none'",
    ),
    ('"Spam" == cat.choice', "is false whatever the answer"),
    ("cat.choice != 'ham'", "is true whatever the answer"),
    ("toxic.label == 'maybe'", "false whatever the answer"),
]


@pytest.mark.parametrize(("text", "says"), CHECKED)
def test_load_time_checks(text: str, says: str | None) -> None:
    cond = parse_condition(text)
    if says is None:  # cat.skipped makes it true
        check_condition(cond, KNOWN)
        return
    with pytest.raises(RouteError) as caught:
        check_condition(cond, KNOWN)
    assert says in caught.value.message


# Whole conditions: refused as never true only when no answer makes the whole condition
# true, through `or` and `not` too; a contradiction inside one branch is no refusal.
WHOLE = [
    ("toxic.p_yes > 0.5 or (toxic.p_yes > 0.9 and toxic.p_yes < 0.3)", None),
    ("not (toxic.p_yes > 0.9 and toxic.p_yes < 0.3)", None),
    ("not (0.9 <= toxic.p_yes < 0.4)", None),
    ("(toxic.p_yes > 0.9 and toxic.p_yes < 0.3) or cat.choice == 'spam'", None),
    (
        "(toxic.p_yes > 0.9 or toxic.p_yes < 0.1) and 0.2 < toxic.p_yes < 0.8",
        "never true",
    ),
    ("not (toxic.p_yes > 0.5 or toxic.p_yes <= 0.5)", "never true"),
    ("not (toxic.p_yes >= 0.5) and not (toxic.p_yes < 0.5)", "never true"),
    (
        "(cat.choice == 'spam' or cat.choice == 'abuse') and cat.choice == 'normal'",
        "never true",
    ),
    ("(cat.choice == 'spam' or cat.choice == 'abuse') and cat.choice != 'spam'", None),
    ("sev.skipped and not sev.skipped", "never true"),
    ("sev.skipped == true and sev.skipped == false", "never true"),
    # two fields compared: values between the thresholds, and between each other
    ("toxic.confidence > cat.confidence and toxic.confidence < 0.5 and cat.confidence > 0.4", None),
    (
        "toxic.confidence > cat.confidence and toxic.confidence < 0.4 and cat.confidence > 0.5",
        "never",
    ),
    ("cat.label == sev.label and cat.choice == 'spam'", "never true"),
    ("cat.label != toxic.label and toxic.label == 'yes'", None),
    ("false", "never true"),
    ("true or toxic.p_yes > 0.5", None),
]


@pytest.mark.parametrize(("text", "says"), WHOLE)
def test_the_check_judges_the_whole_condition(text: str, says: str | None) -> None:
    cond = parse_condition(text)
    if says is None:
        check_condition(cond, KNOWN)
        return
    with pytest.raises(RouteError) as caught:
        check_condition(cond, KNOWN)
    assert caught.value.message.startswith("never true"), caught.value.message
    assert says in caught.value.message


def test_without_known_questions_only_names_and_kinds_go_unchecked() -> None:
    check_condition(parse_condition("spam.p_yes > 0.5 and cat.level == 'x'"))
    with pytest.raises(RouteError, match="false whatever the answer"):
        check_condition(parse_condition("spam.p_yes >= 1.5"))
    with pytest.raises(RouteError, match=r"0\.\.9"):  # 10 levels at most: score is 0..9
        check_condition(parse_condition("q.score > 9"))


# --------------------------------------------------------------------------- routes


def routes(*specs: tuple[str, str, str]) -> list[Route]:
    return [Route(name=n, when=w, topic=t) for n, w, t in specs]


MODERATION = routes(
    ("block", "toxic.p_yes >= 0.9", "moderation.block"),
    ("review", "0.4 <= toxic.p_yes < 0.9", "moderation.review"),
    ("spam", 'cat.choice == "spam" and cat.confidence >= 0.8', "moderation.spam"),
)


@pytest.mark.parametrize(
    ("p_yes", "choice", "expected"),
    [
        (0.95, "spam", ("block", "moderation.block")),  # first match wins
        (0.5, "spam", ("review", "moderation.review")),
        (0.1, "spam", ("spam", "moderation.spam")),
        (0.1, "normal", (DEFAULT_ROUTE, "moderation.results")),
    ],
)
def test_router_takes_the_first_route_that_holds(
    p_yes: float, choice: str, expected: tuple[str, str]
) -> None:
    router = Router(MODERATION, "moderation.results")
    probs = {"spam": 0.1, "abuse": 0.1, "normal": 0.1, choice: 0.8}
    assert tuple(router.route(result(p_yes=p_yes, choice=choice, probs=probs))) == expected
    reply = router.route(result(p_yes=p_yes), reply_topic="client.replies")
    assert tuple(reply) == (REPLY_ROUTE, "client.replies")
    assert router.topics == [
        "moderation.results",
        "moderation.block",
        "moderation.review",
        "moderation.spam",
    ]


def test_route_models_refuse_bad_routes_naming_them() -> None:
    with pytest.raises(ValidationError, match=r"route 'block': when: .*never|expected"):
        Route(name="block", when="toxic.p_yes >=", topic="t")
    for reserved in (DEFAULT_ROUTE, REPLY_ROUTE):
        with pytest.raises(ValidationError, match="reserved"):
            Route(name=reserved, when="toxic.skipped", topic="t")
    with pytest.raises(ValidationError):
        Route(name="Block!", when="toxic.skipped", topic="t")
    with pytest.raises(ValidationError):
        Route(name="b", when="toxic.skipped", topic="a/b")
    again = Route.model_validate(MODERATION[0].model_dump())
    assert again.condition.evaluate(result()) is True


def test_check_routes_names_the_route() -> None:
    check_routes(MODERATION, [QUESTIONS], forbidden_topics=["moderation.in"])
    bad = [*MODERATION, *routes(("never", "toxic.p_yes >= 1.5", "x"))]
    with pytest.raises(
        ValueError, match=r"routes\[3\] \(never\): when: toxic.p_yes >= 1.5 is false whatever"
    ):
        check_routes(bad, [QUESTIONS])
    with pytest.raises(ValueError, match="unique"):
        check_routes([*MODERATION, MODERATION[0]], [QUESTIONS])
    with pytest.raises(ValueError, match=r"routes\[1\] \(review\): topic 'moderation.review'"):
        check_routes(MODERATION, [QUESTIONS], forbidden_topics=["moderation.review"])
    with pytest.raises(ValueError, match="unknown question 'toxic'"):
        check_routes(MODERATION, [{"other": QUESTIONS["toxic"]}])
    check_routes(MODERATION, None)  # inline questions: ids cannot be known
    # An id in two sets: a field of either kind, any of their answers.
    other = {"cat": TypeAdapter(Question).validate_python({"type": "noul", "instructions": "?"})}
    both = [*MODERATION, *routes(("b", 'cat.p_yes > 0.5 or cat.choice == "abuse"', "t"))]
    check_routes(both, [QUESTIONS, other])
    with pytest.raises(ValueError, match="p_yes is a field of yes_no"):
        check_routes(both, [QUESTIONS])


# --------------------------------------------------------------------------- properties

ALPHABET = st.sampled_from(
    [
        "toxic",
        ".",
        "p_yes",
        "confidence",
        "score",
        "label",
        "skipped",
        "sev",
        " and ",
        " or ",
        "not ",
        "(",
        ")",
        " < ",
        "<=",
        ">=",
        "==",
        "!=",
        "=",
        "0.5",
        "-",
        "1e3",
        ".5",
        '"spam"',
        "'x",
        "\\",
        "true",
        "false",
        " ",
        "\n",
        "≥",
        "\x00",
    ]
)


def _outcome(text: str) -> Condition | None:
    try:
        cond = parse_condition(text)
    except RouteError as exc:
        assert exc.message and (exc.position is None or 0 <= exc.position <= len(text))
        return None
    for known in (KNOWN, None):
        try:
            check_condition(cond, known)
        except RouteError as exc:
            assert exc.message
    for res in (result(), result(skipped=True, p_yes=0.2), result(reads=3)):
        assert cond.evaluate(res) in (True, False)
    return cond


@PROPERTY
@given(st.text(st.characters(exclude_categories=()), max_size=80))
def test_any_text_parses_or_is_refused_clearly(text: str) -> None:
    _outcome(text)


@PROPERTY
@given(st.lists(ALPHABET, max_size=30).map("".join))
def test_any_token_soup_parses_or_is_refused_clearly(text: str) -> None:
    _outcome(text)


# Generated conditions with their meaning computed alongside (Python's own operators on the
# same values): the parser's precedence, chaining and `not` must agree with it.
SAMPLE = result(p_yes=0.7, probs={"spam": 0.8, "abuse": 0.1, "normal": 0.1}, levels=(0.1, 0.2, 0.7))
VALUES = {
    "toxic.p_yes": 0.7,
    "toxic.confidence": 0.7,
    "cat.confidence": 0.8,
    "sev.score": SAMPLE.answers["sev"].expected_score - 1,  # type: ignore[union-attr]
}
# (text, meaning, precedence: 3 a comparison or `not`, 2 an `and`, 1 an `or`)
Gen = tuple[str, Callable[[], bool], int]
_OPS: dict[str, Callable[[float, float], bool]] = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}


def _compare(field: str, op: str, number: float, flipped: bool) -> Gen:
    v = VALUES[field]
    if flipped:
        return f"{number!r} {op} {field}", lambda: _OPS[op](number, v), 3
    return f"{field} {op} {number!r}", lambda: _OPS[op](v, number), 3


def _chain(lo: float, op1: str, field: str, op2: str, hi: float) -> Gen:
    v = VALUES[field]
    return (
        f"{lo!r} {op1} {field} {op2} {hi!r}",
        lambda: _OPS[op1](lo, v) and _OPS[op2](v, hi),
        3,
    )


_NUMBERS = st.sampled_from([0.1, 0.5, 0.7, 0.8, 0.75, VALUES["sev.score"]])
_ORDER = st.sampled_from(["<", "<=", ">", ">="])
LEAVES = st.builds(
    _compare,
    st.sampled_from(sorted(VALUES)),
    st.sampled_from(sorted(_OPS)),
    _NUMBERS,
    st.booleans(),
) | st.builds(_chain, _NUMBERS, _ORDER, st.sampled_from(sorted(VALUES)), _ORDER, _NUMBERS)


def _wrap(child: Gen, prec: int, extra: bool) -> str:
    """The child's text, in parentheses where precedence needs them (or `extra` asks)."""
    return f"({child[0]})" if child[2] < prec or extra else child[0]


def _combine(inner: st.SearchStrategy[Gen]) -> st.SearchStrategy[Gen]:
    def both(word: str, a: Gen, b: Gen, extra: bool) -> Gen:
        prec = 2 if word == "and" else 1
        text = f"{_wrap(a, prec, extra)} {word} {_wrap(b, prec, False)}"
        if word == "and":
            return text, lambda: a[1]() and b[1](), prec
        return text, lambda: a[1]() or b[1](), prec

    def negate(a: Gen) -> Gen:
        return f"not {_wrap(a, 3, False)}", lambda: not a[1](), 3

    return st.builds(both, st.sampled_from(["and", "or"]), inner, inner, st.booleans()) | st.builds(
        negate, inner
    )


@PROPERTY
@given(st.recursive(LEAVES, _combine, max_leaves=8))
def test_meaning_agrees_with_pythons_operators(gen: Gen) -> None:
    text, value, _ = gen
    cond = parse_condition(text)
    assert cond.evaluate(SAMPLE) is value(), text


def _random_result(draw: st.DrawFn) -> ClassificationResult:
    unit = st.floats(0.0, 1.0)
    weights = [draw(unit) + 1e-6 for _ in range(3)]
    probs = dict(zip(["spam", "abuse", "normal"], [w / sum(weights) for w in weights], strict=True))
    raw = [draw(unit) + 1e-6 for _ in range(3)]
    levels = tuple(w / sum(raw) for w in raw)
    return result(
        p_yes=draw(unit),
        choice=max(probs, key=probs.__getitem__),
        probs=probs,
        levels=levels,  # type: ignore[arg-type]
    )


@PROPERTY
@given(
    st.recursive(LEAVES, _combine, max_leaves=6),
    st.lists(st.composite(_random_result)(), min_size=1, max_size=4),
)
def test_a_condition_some_answer_makes_true_is_never_refused_as_never_true(
    gen: Gen, results: list[ClassificationResult]
) -> None:
    cond = parse_condition(gen[0])
    if not any(cond.evaluate(res) for res in results):
        return
    try:
        check_condition(cond, KNOWN)
    except RouteError as exc:
        assert not exc.message.startswith("never true"), (gen[0], exc.message)


def test_every_field_has_a_value_for_its_kind() -> None:
    res = result(reads=3)
    kinds = {"toxic": "yes_no", "cat": "choice", "sev": "score"}
    for name, spec in FIELDS.items():
        for qid, kind in kinds.items():
            if kind not in spec.kinds or name in ("label_mass", "entropy"):
                continue
            cond = parse_condition(f"{qid}.{name} == {qid}.{name}")
            assert cond.evaluate(res) is True, f"{qid}.{name}"

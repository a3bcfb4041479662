"""The demo model answers for real, and the demo task family's truth is right.

Model tests: the committed demo model (`workers/engine/weights/demo/`) answers a held-out
split of the demo task family through the engine (parse_request -> Classifier ->
TransformersEngine, CPU) with at least 95% accuracy per kind and an expected calibration
error of at most 0.05 (the bar in `tests/demo_model_bar.py`); the same check FAILS when the
results are mis-wired (labels swapped, results shifted by one request), each kind falling far
below the floor.
Unit tests: truths on hand-written states, determinism, validity, and the seed split.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from demo_model_bar import (
    KINDS,
    MIN_QUESTIONS,
    assert_bar_met,
    assert_miswiring_caught,
)

from bench.harness.miswire import MISWIRINGS, miswire_swap_labels
from dgstream.topology import demo_tasks as dt
from dgstream.workers.engine import models

# Held-out size: ~300 requests run in well under a minute on 2 CPU cores.
HELD_OUT_REQUESTS = 300


# --------------------------------------------------------------------------- model


@pytest.fixture(scope="module")
def held_out_results() -> tuple[list[dt.Example], list[dict[str, Any]]]:
    from dgstream.schemas import ClassificationResult, RequestError
    from dgstream.workers.engine.factory import EngineSettings, build_classifier

    examples = dt.held_out_examples(0, HELD_OUT_REQUESTS)
    requests = [dt.validate(ex.request) for ex in examples]
    # Every held-out request has its own question set, so there is no shared prefix to
    # reuse: whole-prompt batches are 4x faster here, and give the same reads (the engine's
    # parity tests cover both paths).
    classifier = build_classifier(EngineSettings(model="demo", device="cpu", reuse_prefix=False))

    async def run() -> list[Any]:
        out: list[Any] = []
        for i in range(0, len(requests), 64):
            out.extend(await classifier.classify(requests[i : i + 64]))
        return out

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, RequestError)]
    assert not errors, errors[:3]
    assert all(isinstance(r, ClassificationResult) for r in results)
    # Every result answers its own request (ids in order, one answer per question).
    for ex, res in zip(examples, results, strict=True):
        assert res.id == ex.request["id"]
        assert set(res.answers) == set(ex.request["questions"])
    return examples, [r.model_dump(mode="json") for r in results]


@pytest.mark.model
@pytest.mark.parametrize("kind", KINDS)
def test_demo_model_is_accurate(held_out_results: Any, kind: str) -> None:
    """Accuracy >= 0.95 for each kind."""
    examples, results = held_out_results
    report = dt.check(dt.score_results(examples, results))
    assert report.counts[kind] >= MIN_QUESTIONS, report.counts
    assert report.accuracy[kind] >= dt.ACCURACY_FLOOR, report.summary()


@pytest.mark.model
def test_demo_model_is_calibrated_and_passes_the_check(held_out_results: Any) -> None:
    examples, results = held_out_results
    report = dt.check(dt.score_results(examples, results))
    assert report.ece <= dt.ECE_CEILING, report.summary()
    assert_bar_met(report)


@pytest.mark.model
@pytest.mark.parametrize("miswiring", sorted(MISWIRINGS))
def test_the_check_fails_on_miswired_results(held_out_results: Any, miswiring: str) -> None:
    examples, results = held_out_results
    bad = MISWIRINGS[miswiring](results)
    assert_miswiring_caught(dt.check(dt.score_results(examples, bad)))


@pytest.mark.model
def test_demo_model_ships_with_its_tokenizer() -> None:
    from transformers import AutoTokenizer

    from dgstream.workers.engine.tokenizer import build_tokenizer

    directory = models.ensure_tiny_model("demo")
    assert directory == models.TRAINED_DIRS["demo"]
    assert (directory / "model.safetensors").stat().st_size <= 8_000_000
    shipped = AutoTokenizer.from_pretrained(str(directory))
    # The committed tokenizer is the one trained on; it still equals today's build.
    assert shipped.get_vocab() == build_tokenizer().get_vocab()


# --------------------------------------------------------------------------- task family


def _q(task: str, **kw: Any) -> dt.TaskQuestion:
    return dt.TaskQuestion(task, **kw)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("state", "task", "extra", "wire", "want"),
    [
        ("see https://www.example.com/page now", "has_link", {}, {}, "yes"),
        ("go to www.shop.org today", "has_link", {}, {}, "yes"),
        ("visit news.io please", "has_link", {}, {}, "yes"),
        ("no link here. com is not one", "has_link", {}, {}, "no"),
        ("WHY ARE YOU SO LATE today", "shouting", {}, {}, "yes"),
        ("Why are you SO late today", "shouting", {}, {}, "no"),
        ("I A", "shouting", {}, {}, "no"),  # one-letter words do not count
        ("it costs 250 now", "number_above", {"threshold": 100}, {}, "yes"),
        ("it costs 100 now", "number_above", {"threshold": 100}, {}, "no"),
        ("9 or 99", "number_above", {"threshold": 10}, {}, "yes"),
        ("9 or 10", "number_above", {"threshold": 10}, {}, "no"),
        ("see www.site.com/5000 soon", "number_above", {"threshold": 1000}, {}, "no"),
        ("you are an IDIOT", "insult", {}, {}, "yes"),
        ("you are a friend", "insult", {}, {}, "no"),
        ("bonjour merci monsieur pizza", "language", {}, {}, "french"),
        ("hallo danke heute", "language", {}, {}, "german"),
        ("hola amigo muy bueno", "language", {}, {}, "spanish"),
        ("ciao amico grazie", "language", {}, {}, "italian"),
        ("hello friend, what is new", "language", {}, {}, "english"),
        ("the pizza and the soup, then the team", "topic", {}, {}, "food"),
        ("GUITAR and piano tonight", "topic", {}, {}, "music"),
    ],
)
def test_truth_on_hand_written_states(
    state: str, task: str, extra: dict[str, Any], wire: dict[str, Any], want: str
) -> None:
    assert dt.truth_of(state, _q(task, **extra), wire) == want


@pytest.mark.unit
def test_score_truths_use_the_fixed_buckets() -> None:
    four = {"criteria": ["none", "one", "a few", "many"]}
    q4 = _q("exclamations", bounds=(0, 1, 3))
    assert dt.truth_of("calm down", q4, four) == "none"
    assert dt.truth_of("wow!", q4, four) == "one"
    assert dt.truth_of("wow!! great!", q4, four) == "a few"
    assert dt.truth_of("wow!!! great!", q4, four) == "many"
    three = {"criteria": ["none", "one", "two or more"]}
    qf = _q("listed_words", word_list="food", bounds=(0, 1))
    assert dt.truth_of("nothing to eat", qf, three) == "none"
    assert dt.truth_of("PIZZA tonight", qf, three) == "one"
    assert dt.truth_of("pizza, pasta and pizza", qf, three) == "two or more"
    qi = _q("listed_words", word_list="insult", bounds=(0, 2))
    lots = {"criteria": ["no words", "a few", "lots"]}
    assert dt.truth_of("idiot fool loser", qi, lots) == "lots"
    assert dt.truth_of("idiot fool", qi, lots) == "a few"


@pytest.mark.unit
def test_generation_is_deterministic_and_valid() -> None:
    first = [dt.generate(s) for s in dt.training_seeds(3, 200)]
    again = [dt.generate(s) for s in dt.training_seeds(3, 200)]
    assert first == again
    assert dt.sample_events(20, seed=5) == dt.sample_events(20, seed=5)
    kinds: set[str] = set()
    sizes: set[int] = set()
    for request, truth in first:
        parsed = dt.validate(request)  # raises when refused
        assert set(truth) == set(request["questions"])
        assert 1 <= len(truth) <= dt.MAX_QUESTIONS
        assert len(request["state"].split()) <= 40
        sizes.add(len(truth))
        for qid, q in request["questions"].items():
            kinds.add(parsed.questions[qid].kind)
            if q["type"] == "choice" or q["type"] == "score":
                assert truth[qid] in q["criteria"]
            else:
                assert truth[qid] in ("yes", "no")
    assert kinds == {"yes_no", "choice", "score"}
    assert sizes == {1, 2, 3, 4}
    for event in dt.sample_events(20, seed=5):
        dt.validate(event)


@pytest.mark.unit
def test_truth_is_recomputed_from_the_state_alone() -> None:
    for seed in dt.training_seeds(4, 300):
        ex = dt.example(seed)
        for qid, task in ex.tasks.items():
            wire = ex.request["questions"][qid]
            assert dt.truth_of(ex.request["state"], task, wire) == ex.truth[qid]


@pytest.mark.unit
def test_held_out_never_meets_training() -> None:
    held = dt.held_out_seeds(0, 10_000)
    assert min(held) >= dt.HELD_OUT_BASE
    assert max(dt.training_seeds(0, 10_000_000)) < dt.HELD_OUT_BASE
    with pytest.raises(ValueError):
        dt.training_seeds(1 << 8, 1 << 33)
    assert dt.held_out(0, 5) == [dt.generate(s) for s in dt.held_out_seeds(0, 5)]


@pytest.mark.unit
def test_word_lists_are_in_the_tokenizer_and_disjoint() -> None:
    from dgstream.workers.engine.tokenizer import _WORDS

    vocab = set(_WORDS)
    groups = {
        "english": set(dt.ENGLISH),
        "insult": set(dt.INSULTS),
        **{k: set(v) for k, v in dt.LANGUAGE_WORDS.items()},
        **{k: set(v) for k, v in dt.TOPIC_WORDS.items()},
    }
    names = sorted(groups)
    for i, a in enumerate(names):
        assert groups[a] <= vocab, (a, groups[a] - vocab)
        for b in names[i + 1 :]:
            assert not groups[a] & groups[b], (a, b, groups[a] & groups[b])


@pytest.mark.unit
def test_check_detects_miswiring_on_perfect_results() -> None:
    """The check itself, without a model: perfect answers pass, mis-wired ones fail."""
    examples = dt.held_out_examples(1, 60)
    results = []
    for ex in examples:
        answers = {}
        questions = dt.questions_of(ex.request)
        for qid, want in ex.truth.items():
            q = ex.request["questions"][qid]
            kind = questions[qid].kind
            if kind == "yes_no":
                answers[qid] = {
                    "type": "yes_no",
                    "label": want,
                    "p_yes": 1.0 if want == "yes" else 0.0,
                    "confidence": 1.0,
                }
            else:
                names = list(q["criteria"])
                probs = {n: 1.0 if n == want else 0.0 for n in names}
                key = "choice" if kind == "choice" else "level"
                answers[qid] = {"type": kind, key: want, "probabilities": probs, "confidence": 1.0}
        results.append({"id": ex.request["id"], "answers": answers})
    assert dt.check(dt.score_results(examples, results)).passed
    for name, fn in MISWIRINGS.items():
        report = dt.check(dt.score_results(examples, fn(results)))
        assert not report.passed
        assert max(report.accuracy.values()) < 0.6, (name, report.summary())
    # Swapped labels keep their (full) confidence: far from calibrated.
    assert dt.check(dt.score_results(examples, miswire_swap_labels(results))).ece > 0.9

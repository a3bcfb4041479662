"""The transformers backend and the classifier on a real tiny DiffusionGemma (CPU, fp32)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import TypeAdapter
from support.oracles import label_logits_reference

from dgstream.schemas import ClassificationRequest, ErrorCode, Question, RequestError, parse_request
from dgstream.workers.engine.classifier import Classifier, ClassifierSettings
from dgstream.workers.engine.hf_backend import TransformersEngine
from dgstream.workers.engine.template import (
    LayoutCache,
    labels_and_answers,
    make_read,
    system_text,
    user_text,
)
from dgstream.workers.engine.types import Read

pytestmark = pytest.mark.model

# fp32 on the CPU: batched and single reads differ only by summation order in the matmuls.
BATCH_TOLERANCE = 1e-5

QUESTION_SETS: dict[str, dict[str, Any]] = {
    "moderation": {
        "toxic": {"type": "noul", "instructions": "Is the message toxic?"},
        "category": {
            "type": "choice",
            "instructions": "Which category fits best?",
            "criteria": {"spam": "advertising", "abuse": None, "other": None},
        },
        "severity": {
            "type": "score",
            "instructions": "How severe is it?",
            "criteria": ["none", "mild", "moderate", "severe"],
        },
    },
    "language": {
        "lang": {
            "type": "choice",
            "instructions": "Which language is it in?",
            "criteria": {n: None for n in ["english", "french", "german", "spanish", "italian"]},
        },
    },
    "shouting": {"caps": {"type": "yes_no", "instructions": "Is it shouting in capitals?"}},
}


def _request(rid: str, state: str, qset: str, **extra: Any) -> ClassificationRequest:
    body = {"id": rid, "state": state, "questions": QUESTION_SETS[qset], **extra}
    parsed = parse_request(json.dumps(body).encode())
    assert isinstance(parsed, ClassificationRequest), parsed
    return parsed


def _reads(chat: Any, engine: TransformersEngine, n: int, seed: int = 0) -> list[Read]:
    rng = random.Random(seed)
    words = ["the", "you", "idiot", "free", "money", "now", "hello", "bonjour"]
    words += ["merci", "LOUD", "!!!", "http://x.com"]
    cache = LayoutCache(chat.encode, engine.info.canvas_length)
    out = []
    for i in range(n):
        qs = QUESTION_SETS[list(QUESTION_SETS)[i % 3]]
        from pydantic import TypeAdapter

        from dgstream.schemas import Question

        parsed = {k: TypeAdapter(Question).validate_python(v) for k, v in qs.items()}
        layout = cache.get([(k, labels_and_answers(q)[0]) for k, q in parsed.items()])
        state = " ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))
        out.append(
            make_read(chat, layout, system_text(parsed), user_text(state, {}), seed=1000 + i)
        )
    return out


def test_distributions_sum_to_one_and_are_deterministic(tiny_engine: Any, tiny_chat: Any) -> None:
    reads = _reads(tiny_chat, tiny_engine, 6)
    a = tiny_engine.read_sync(reads)
    b = tiny_engine.read_sync(reads)
    for ra, rb in zip(a, b, strict=True):
        for sa, sb in zip(ra.slots, rb.slots, strict=True):
            assert sa.probs.sum() == pytest.approx(1.0, abs=1e-9)
            assert np.all(sa.probs >= 0)
            assert np.array_equal(sa.probs, sb.probs)
            assert 0.0 <= sa.entropy <= np.log(len(sa.probs)) + 1e-9
            assert sa.label_mass is not None and 0.0 < sa.label_mass <= 1.0


def test_batch_invariance_16_mixed_requests(tiny_engine: Any, tiny_chat: Any) -> None:
    reads = _reads(tiny_chat, tiny_engine, 16)
    assert len({len(r.prompt_ids) for r in reads}) > 8  # mixed lengths
    assert len({r.slots for r in reads}) == 3  # mixed question sets
    batched = tiny_engine.read_sync(reads)
    for read, together in zip(reads, batched, strict=True):
        (alone,) = tiny_engine.read_sync([read])
        for s1, s2 in zip(alone.slots, together.slots, strict=True):
            np.testing.assert_allclose(s1.probs, s2.probs, atol=BATCH_TOLERANCE, rtol=0)
            assert s1.label_mass == pytest.approx(s2.label_mass, abs=BATCH_TOLERANCE)


def test_reference_parity_with_a_direct_forward(tiny_engine: Any, tiny_chat: Any) -> None:
    reads = _reads(tiny_chat, tiny_engine, 5, seed=3)
    for read, result in zip(reads, tiny_engine.read_sync(reads), strict=True):
        logits = label_logits_reference(tiny_engine.model, read.prompt_ids, read.canvas_ids)
        for slot, got in zip(read.slots, result.slots, strict=True):
            row = logits[slot.position].double()
            want = torch.softmax(row[list(slot.label_ids)], 0).numpy()
            np.testing.assert_allclose(got.probs, want, atol=1e-6, rtol=0)
            mass = torch.softmax(row, 0)[list(slot.label_ids)].sum().item()
            assert got.label_mass == pytest.approx(mass, abs=1e-6)
            assert got.argmax_is_label == (int(row.argmax()) in slot.label_ids)


def test_label_rows_only_matches_full_projection(tiny_model_dir: Any, tiny_chat: Any) -> None:
    engine = TransformersEngine.from_pretrained(tiny_model_dir, device="cpu", label_rows_only=True)
    full = TransformersEngine.from_pretrained(tiny_model_dir, device="cpu")
    reads = _reads(tiny_chat, full, 4, seed=5)
    for a, b in zip(engine.read_sync(reads), full.read_sync(reads), strict=True):
        for sa, sb in zip(a.slots, b.slots, strict=True):
            np.testing.assert_allclose(sa.probs, sb.probs, atol=1e-6, rtol=0)
            assert sa.label_mass is None


def test_prefix_reuse_encodes_the_system_text_once(tiny_model_dir: Any, tiny_chat: Any) -> None:
    engine = TransformersEngine.from_pretrained(tiny_model_dir, device="cpu")
    plain = TransformersEngine.from_pretrained(tiny_model_dir, device="cpu", reuse_prefix=False)
    reads = [
        r for r in _reads(tiny_chat, engine, 12) if r.slots == _reads(tiny_chat, engine, 1)[0].slots
    ]
    a = engine.read_sync(reads)
    b = plain.read_sync(reads)
    assert engine.stats["prefix_misses"] == 1
    assert engine.stats["encoded_tokens"] < plain.stats["encoded_tokens"]
    for ra, rb in zip(a, b, strict=True):
        for sa, sb in zip(ra.slots, rb.slots, strict=True):
            np.testing.assert_allclose(sa.probs, sb.probs, atol=BATCH_TOLERANCE, rtol=0)


def _classify(engine: Any, chat: Any, reqs: list[ClassificationRequest], **kw: Any) -> list[Any]:
    clf = Classifier(engine, chat, ClassifierSettings(**kw))
    return asyncio.run(clf.classify(reqs))


def test_seed_changes_only_the_noise(tiny_engine: Any, tiny_chat: Any) -> None:
    req = _request("r", "you idiot!!! free money http://x.com", "moderation")
    (a,) = _classify(tiny_engine, tiny_chat, [req], seed=1)
    (b,) = _classify(tiny_engine, tiny_chat, [req], seed=1)
    (c,) = _classify(tiny_engine, tiny_chat, [req], seed=2)
    assert a.answers == b.answers
    assert a.answers != c.answers  # other noise, slightly other distributions
    assert a.answers.keys() == c.answers.keys()


def test_result_shapes_and_sample_counts(tiny_engine: Any, tiny_chat: Any) -> None:
    reqs = [
        _request("one", "hello", "moderation"),
        _request("three", "hello", "moderation", samples=3),
        _request(
            "auto-low", "hello", "moderation", samples="auto", auto_threshold=1e-3, auto_max=5
        ),
        _request("auto-high", "hello", "moderation", samples="auto", auto_threshold=50.0),
    ]
    results = _classify(tiny_engine, tiny_chat, reqs)
    assert [r.id for r in results] == ["one", "three", "auto-low", "auto-high"]
    assert [r.diagnostics.reads for r in results] == [1, 3, 5, 1]
    one, three = results[0], results[1]
    assert one.answers["toxic"].stderr is None and three.answers["toxic"].stderr is not None
    assert 0 < three.answers["toxic"].agreement <= 1
    tox = one.answers["toxic"]
    assert tox.label == ("yes" if tox.p_yes >= 0.5 else "no")
    cat = one.answers["category"]
    assert set(cat.probabilities) == {"spam", "abuse", "other"}
    assert sum(cat.probabilities.values()) == pytest.approx(1, abs=1e-5)
    assert cat.choice == max(cat.probabilities, key=cat.probabilities.get)
    sev = one.answers["severity"]
    assert sev.legend == {"1": "none", "2": "mild", "3": "moderate", "4": "severe"}
    expected = sum((i + 1) * sev.probabilities[lv] for i, lv in enumerate(sev.legend.values()))
    assert sev.expected_score == pytest.approx(expected, abs=1e-4)


def test_depends_on_and_ask_if(tiny_engine: Any, tiny_chat: Any) -> None:
    qs = {
        "toxic": {"type": "noul", "instructions": "Is it toxic?"},
        "why": {"type": "noul", "instructions": "Insult?", "depends_on": ["toxic"]},
        "if_yes": {"type": "noul", "instructions": "x", "ask_if": {"toxic": ["yes"]}},
        "if_no": {"type": "noul", "instructions": "y", "ask_if": {"toxic": ["no"]}},
    }
    req = parse_request(json.dumps({"id": "d", "state": "hi", "questions": qs}).encode())
    assert isinstance(req, ClassificationRequest)
    (res,) = _classify(tiny_engine, tiny_chat, [req])
    toxic = res.answers["toxic"].label
    asked, skipped = ("if_yes", "if_no") if toxic == "yes" else ("if_no", "if_yes")
    assert res.answers[asked].type == "yes_no"
    assert res.answers[skipped].type == "skipped"
    assert res.answers["why"].type == "yes_no"
    assert res.diagnostics.reads == 2  # stage 1: toxic; stage 2: why + the asked one


def test_unknown_question_set_and_template_errors_are_typed(
    tiny_engine: Any, tiny_chat: Any
) -> None:
    named = parse_request(b'{"id": "n", "state": "s", "question_set": "nope"}')
    assert isinstance(named, ClassificationRequest)
    good = _request("g", "s", "shouting")
    results = _classify(tiny_engine, tiny_chat, [named, good])
    assert isinstance(results[0], RequestError)
    assert results[0].code == ErrorCode.UNKNOWN_QUESTION_SET
    assert results[0].field == "question_set"
    assert results[1].id == "g"


def test_question_sets_by_name(tiny_engine: Any, tiny_chat: Any) -> None:
    sets = {
        name: {k: TypeAdapter(Question).validate_python(v) for k, v in qs.items()}
        for name, qs in QUESTION_SETS.items()
    }
    clf = Classifier(tiny_engine, tiny_chat, question_sets=sets)
    req = parse_request(b'{"id": "n", "state": "bonjour merci", "question_set": "language"}')
    assert isinstance(req, ClassificationRequest)
    (res,) = asyncio.run(clf.classify([req]))
    assert res.answers["lang"].choice in QUESTION_SETS["language"]["lang"]["criteria"]


def test_engine_leaves_the_callers_autograd_alone(tiny_model_dir: Any) -> None:
    """Building an engine and reading through it leaves gradients on in the calling thread
    (it once switched them off globally, which broke a training run after a parity check)."""
    assert torch.is_grad_enabled()
    engine = TransformersEngine.from_pretrained(tiny_model_dir, device="cpu")
    assert torch.is_grad_enabled()
    w = torch.ones(2, requires_grad=True)
    (w * 3).sum().backward()
    assert w.grad is not None and w.grad.tolist() == [3.0, 3.0]
    asyncio.run(engine.close())


class _Watching:
    """The real engine, with the reads it is given kept (to count their tokens)."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine = engine
        self.reads: list[Read] = []

    @property
    def info(self) -> Any:
        return self.engine.info

    async def read(self, reads: Any) -> Any:
        self.reads.extend(reads)
        return await self.engine.read(reads)

    async def close(self) -> None:
        return None


def test_a_jev_body_is_answered_with_its_usage_counted(tiny_engine: Any, tiny_chat: Any) -> None:
    from dgstream.schemas import record_id, to_jev

    body = {
        "state": {"message": "FREE MONEY now", "links": ["http://x.com"]},
        "model": "jev-latest",
        "questions": {
            "spam": {"type": "noul", "criteria": {"true": "advertising", "false": None}},
            "tone": {"type": "choice", "criteria": {"calm": None, "angry": {"means": "hostile"}}},
            "urgency": {"type": "score", "criteria": ["Can wait", None, "Now"]},
        },
        "samples": "auto",
        "auto_threshold": 1e-3,
        "auto_max": 3,
    }
    jev = parse_request(json.dumps(body).encode(), fallback_id=record_id(None, "in", 2, 7))
    ours = _request("ours", "hello", "moderation", samples=2)
    assert isinstance(jev, ClassificationRequest)
    watching = _Watching(tiny_engine)
    res, res2 = asyncio.run(Classifier(watching, tiny_chat).classify([jev, ours]))
    assert not isinstance(res, RequestError) and not isinstance(res2, RequestError)
    assert (res.id, res.id_source, res.requested_model) == ("in-2-7", "record", "jev-latest")
    assert (res2.id_source, res2.requested_model) == ("request", None)
    for result in (res, res2):
        mine = [r for r in watching.reads if r.tag.startswith(f"{result.id}#")]
        assert result.diagnostics.reads == len(mine) > 0
        assert result.diagnostics.input_tokens == sum(len(r.prompt_ids) for r in mine)
        assert result.diagnostics.output_tokens == sum(len(r.canvas_ids) for r in mine)
    assert res.diagnostics.reads == 3  # auto with a tiny threshold reads up to auto_max
    urgency = res.answers["urgency"]
    assert urgency.legend == {"1": "Can wait", "2": "level 1", "3": "Now"}
    out = to_jev(res)
    assert out.usage.input_tokens == res.diagnostics.input_tokens
    assert out.answers["urgency"].score == pytest.approx(urgency.expected_score - 1, abs=1e-6)
    assert out.answers["spam"].noul == res.answers["spam"].p_yes


def test_the_tiny_model_is_built_by_this_session(
    tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Not a copy an earlier run left under $HOME: the session's own cache (tests/conftest.py)
    unless a shared one is named on purpose."""
    import os
    from pathlib import Path

    root = Path(os.environ["DGSTREAM_CACHE_DIR"])
    assert Path(tiny_model_dir).is_relative_to(root)
    if not os.environ.get("DGSTREAM_TEST_CACHE_DIR"):
        assert root.is_relative_to(tmp_path_factory.getbasetemp())
        assert not root.is_relative_to(Path.home() / ".cache")

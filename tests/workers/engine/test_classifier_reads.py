"""What the classifier asks the engine for, and what it makes of the answers: pinned with a
scripted engine that records every read and answers each slot with a distribution the test
chose. Multi-read gives every sample its own canvas; the standard error is that of the
chosen label over the reads; `auto` reads more exactly when some question of a chunk is above
the threshold; `depends_on` and `ask_if` put the earlier answers in the later prompt; a batch
answers each request from its own reads.

The tokenizer and chat format are the committed demo model's (nothing is built or cached).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from dgstream.schemas import ClassificationRequest, RequestError, parse_request
from dgstream.workers.engine.classifier import DEFAULT_AUTO_MAX, Classifier, ClassifierSettings
from dgstream.workers.engine.reading import slot_read_from_label_logits
from dgstream.workers.engine.template import ChatFormat, system_text, user_text
from dgstream.workers.engine.types import EngineInfo, Read, ReadResult, Slot, SlotRead

pytestmark = pytest.mark.unit

# A slot's distribution, from the read it is in and the slot (labels in order).
Script = Callable[[Read, Slot], Sequence[float]]


class ScriptedEngine:
    """Records every call's reads; each slot's probabilities are `script(read, slot)`."""

    def __init__(self, script: Script, canvas_length: int = 64) -> None:
        self.script = script
        self.calls: list[list[Read]] = []
        self._info = EngineInfo("scripted", "scripted", canvas_length, 2048)

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def reads(self) -> list[Read]:
        return [r for call in self.calls for r in call]

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
        self.calls.append(list(reads))
        return [ReadResult(tuple(self._slot(r, s) for s in r.slots)) for r in reads]

    def _slot(self, read: Read, slot: Slot) -> SlotRead:
        logits = np.log(np.asarray(self.script(read, slot), dtype=np.float64))
        return slot_read_from_label_logits(slot.question_id, logits)

    async def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    from transformers import AutoTokenizer

    from dgstream.workers.engine.models import TRAINED_DIRS

    return ChatFormat(AutoTokenizer.from_pretrained(str(TRAINED_DIRS["demo"])))


def _request(questions: dict[str, Any], rid: str = "r", **extra: Any) -> ClassificationRequest:
    body = {"id": rid, "state": "hello there", "questions": questions, **extra}
    parsed = parse_request(json.dumps(body).encode())
    assert isinstance(parsed, ClassificationRequest), parsed
    return parsed


def _classify(
    engine: ScriptedEngine, chat: ChatFormat, requests: list[ClassificationRequest], **kw: Any
) -> list[Any]:
    return asyncio.run(Classifier(engine, chat, ClassifierSettings(**kw)).classify(requests))


def _read_index(read: Read) -> int:
    return int(read.tag.rpartition("#")[2])


def _slot_entropy(probs: Sequence[float]) -> float:
    """The entropy the classifier sees for `probs` (through the same softmax)."""
    return slot_read_from_label_logits("q", np.log(np.asarray(probs))).entropy


YES_NO = {"type": "noul", "instructions": "Is it rude?"}
CHOICE = {
    "type": "choice",
    "instructions": "Which topic?",
    "criteria": {"sport": None, "music": None, "food": None},
}


# --------------------------------------------------------------------------- multi-read


def test_every_sample_reads_its_own_canvas(chat: ChatFormat) -> None:
    engine = ScriptedEngine(lambda r, s: [1 / len(s.labels)] * len(s.labels))
    req = _request({"rude": YES_NO, "topic": CHOICE}, samples=4)
    (res,) = _classify(engine, chat, [req])
    assert res.diagnostics.reads == 4
    (call,) = engine.calls  # all samples go to the engine together
    assert sorted(_read_index(r) for r in call) == [0, 1, 2, 3]
    assert len({r.prompt_ids for r in call}) == 1  # one prompt ...
    assert len({r.canvas_ids for r in call}) == 4  # ... and four different noises
    slots = {s.position for s in call[0].slots}
    for read in call[1:]:
        pairs = enumerate(zip(call[0].canvas_ids, read.canvas_ids, strict=True))
        differ = {i for i, (a, b) in pairs if a != b}
        assert differ and differ <= slots  # the template itself never changes


def test_noise_depends_on_the_request_and_the_seed_and_repeats(chat: ChatFormat) -> None:
    def canvases(rid: str, seed: int) -> list[tuple[int, ...]]:
        engine = ScriptedEngine(lambda r, s: [0.5, 0.5])
        _classify(engine, chat, [_request({"rude": YES_NO}, rid=rid, samples=2)], seed=seed)
        return [r.canvas_ids for r in engine.reads]

    first = canvases("a", 0)
    assert canvases("a", 0) == first  # reproducible for a given seed
    assert canvases("b", 0) != first  # another request, other noise
    assert canvases("a", 1) != first  # another base seed, other noise


def test_stderr_is_the_sample_standard_error_of_the_chosen_label(chat: ChatFormat) -> None:
    # The chosen option is "music" (column 1); column 0 varies differently, so a standard
    # error taken from the wrong column, or with another ddof, shows.
    per_read = [
        [0.2, 0.5, 0.3],
        [0.1, 0.7, 0.2],
        [0.3, 0.6, 0.1],
        [0.45, 0.4, 0.15],
    ]
    engine = ScriptedEngine(lambda r, s: per_read[_read_index(r)])
    (res,) = _classify(engine, chat, [_request({"topic": CHOICE}, samples=4)])
    got = res.answers["topic"]
    stack = np.array(per_read)
    mean = stack.mean(axis=0)
    assert got.choice == "music"
    want = float(np.std(stack[:, 1], ddof=1) / math.sqrt(4))
    assert got.stderr == pytest.approx(want, abs=1e-6)
    assert got.stderr != pytest.approx(float(np.std(stack[:, 0], ddof=1) / 2), abs=1e-4)
    assert got.agreement == pytest.approx(0.75)  # the last read's argmax is "sport"
    assert got.probabilities == pytest.approx(
        dict(zip(CHOICE["criteria"], mean, strict=True)), abs=1e-6
    )
    assert got.confidence == pytest.approx(mean[1], abs=1e-6)
    assert res.diagnostics.entropy["topic"] == pytest.approx(
        np.mean([_slot_entropy(p) for p in per_read]), abs=1e-6
    )


def test_one_read_has_no_stderr_or_agreement(chat: ChatFormat) -> None:
    engine = ScriptedEngine(lambda r, s: [0.3, 0.7])
    (res,) = _classify(engine, chat, [_request({"rude": YES_NO})])
    assert res.diagnostics.reads == 1
    rude = res.answers["rude"]
    assert (rude.label, rude.p_yes, rude.stderr, rude.agreement) == ("no", 0.3, None, None)


# --------------------------------------------------------------------------- auto


SURE = [0.99, 0.01]
UNSURE = [0.6, 0.4]


def _auto(
    chat: ChatFormat,
    unsure: set[str],
    threshold: float | None,
    *,
    canvas_length: int = 64,
    request_max: int | None = 3,
    ids: tuple[str, str] = ("a", "b"),
    **settings: Any,
) -> tuple[ScriptedEngine, Any]:
    engine = ScriptedEngine(
        lambda r, s: UNSURE if s.question_id in unsure else SURE, canvas_length=canvas_length
    )
    extra: dict[str, Any] = {"samples": "auto"}
    if threshold is not None:
        extra["auto_threshold"] = threshold
    if request_max is not None:
        extra["auto_max"] = request_max
    req = _request({qid: YES_NO for qid in ids}, **extra)
    (res,) = _classify(engine, chat, [req], **settings)
    assert not isinstance(res, RequestError), res
    return engine, res


def test_auto_reads_more_when_one_question_is_uncertain(chat: ChatFormat) -> None:
    engine, res = _auto(chat, {"b"}, 0.5)
    assert _slot_entropy(SURE) < 0.5 < _slot_entropy(UNSURE)
    assert res.diagnostics.reads == 3  # up to auto_max
    assert len(engine.calls) == 2  # the first read, then one call for the extra ones
    assert [_read_index(r) for r in engine.calls[1]] == [1, 2]
    assert len({r.canvas_ids for r in engine.reads}) == 3
    assert res.answers["a"].agreement == 1.0  # answers average all three reads


def test_auto_stops_at_one_read_when_every_question_is_certain(chat: ChatFormat) -> None:
    engine, res = _auto(chat, set(), 0.5)
    assert res.diagnostics.reads == 1 and len(engine.calls) == 1
    assert res.answers["a"].stderr is None


def test_auto_threshold_is_strict(chat: ChatFormat) -> None:
    """An entropy exactly at the threshold is not above it: one read."""
    _, res = _auto(chat, {"b"}, _slot_entropy(UNSURE))
    assert res.diagnostics.reads == 1
    _, res = _auto(chat, {"b"}, math.nextafter(_slot_entropy(UNSURE), 0.0))
    assert res.diagnostics.reads == 3


def test_auto_defaults_come_from_the_settings(chat: ChatFormat) -> None:
    # No auto_threshold or auto_max in the request: the settings' own apply.
    _, res = _auto(chat, {"b"}, None, request_max=None, auto_threshold=0.5)
    assert res.diagnostics.reads == DEFAULT_AUTO_MAX == 4
    _, res = _auto(chat, {"b"}, None, request_max=None, auto_threshold=0.5, auto_max=5)
    assert res.diagnostics.reads == 5
    _, res = _auto(chat, {"b"}, None, request_max=None, auto_threshold=0.7)
    assert res.diagnostics.reads == 1  # 0.67 nats is below the setting's 0.7


def test_auto_reads_more_only_for_the_uncertain_chunk(chat: ChatFormat) -> None:
    # Each line is 9 tokens: a 16-slot canvas holds one, so the questions are two chunks.
    a, b = "qzxvk_a", "qzxvk_b"
    engine, res = _auto(chat, {b}, 0.5, canvas_length=16, ids=(a, b))
    by_chunk: dict[tuple[str, ...], int] = {}
    for read in engine.reads:
        key = tuple(s.question_id for s in read.slots)
        by_chunk[key] = by_chunk.get(key, 0) + 1
    assert by_chunk == {(a,): 1, (b,): 3}
    assert res.diagnostics.reads == 4
    assert res.answers[a].stderr is None and res.answers[b].stderr == 0.0


# --------------------------------------------------------------------------- stages


def _state_of(read: Read, chat: ChatFormat) -> str:
    return str(chat.tokenizer.decode(list(read.prompt_ids)))


def test_depends_on_puts_the_earlier_answers_in_the_later_prompt(chat: ChatFormat) -> None:
    questions = {
        "rude": YES_NO,
        "topic": CHOICE,
        "why": {"type": "noul", "instructions": "Insult?", "depends_on": ["rude", "topic"]},
        "other": {"type": "noul", "instructions": "Spam?", "depends_on": ["rude"]},
    }
    script = {"rude": [0.9, 0.1], "topic": [0.1, 0.2, 0.7]}
    engine = ScriptedEngine(lambda r, s: script.get(s.question_id, [0.5, 0.5]))
    req = _request(questions)
    (res,) = _classify(engine, chat, [req])
    assert (res.answers["rude"].label, res.answers["topic"].choice) == ("yes", "food")
    first, second = engine.calls
    assert "Earlier answers" not in _state_of(first[0], chat)
    (later,) = second  # "why" and "other" share one chunk, so one prompt with both
    assert [s.question_id for s in later.slots] == ["why", "other"]
    assert req.questions is not None
    stage2 = {q: req.questions[q] for q in ("why", "other")}
    want, _ = chat.prompt_ids(
        system_text(stage2), user_text("hello there", {"rude": "yes", "topic": "food"})
    )
    assert later.prompt_ids == want  # option names, not label letters, in dependency order
    assert "Earlier answers:\nrude: yes\ntopic: food" in _state_of(later, chat)


def test_ask_if_asks_only_when_met_and_names_what_was_not(chat: ChatFormat) -> None:
    questions = {
        "rude": YES_NO,
        "if_yes": {"type": "noul", "instructions": "x", "ask_if": {"rude": ["yes"]}},
        "if_no": {"type": "noul", "instructions": "y", "ask_if": {"rude": ["no"]}},
    }
    engine = ScriptedEngine(lambda r, s: [0.2, 0.8] if s.question_id == "rude" else [0.5, 0.5])
    (res,) = _classify(engine, chat, [_request(questions)])
    assert res.answers["rude"].label == "no"
    assert res.answers["if_yes"].type == "skipped"
    assert res.answers["if_yes"].reason == "ask_if not met: rude=no"
    assert res.answers["if_no"].type == "yes_no"
    asked = [s.question_id for r in engine.reads for s in r.slots]
    assert asked == ["rude", "if_no"]  # the skipped question is never read
    assert "Earlier answers:\nrude: no" in _state_of(engine.calls[1][0], chat)
    assert res.diagnostics.reads == 2


def test_a_skipped_answer_names_every_unmet_condition(chat: ChatFormat) -> None:
    questions = {
        "rude": YES_NO,
        "spam": YES_NO,
        "both": {"type": "noul", "instructions": "z", "ask_if": {"rude": ["yes"], "spam": ["yes"]}},
    }
    engine = ScriptedEngine(lambda r, s: [0.2, 0.8])
    (res,) = _classify(engine, chat, [_request(questions)])
    assert res.answers["both"].reason == "ask_if not met: rude=no, spam=no"


# --------------------------------------------------------------------------- batches


def _hashed(read: Read, slot: Slot) -> list[float]:
    """A distribution that is a function of the prompt and canvas (as FakeEngine's)."""
    digest = hashlib.blake2b(repr((read.prompt_ids, read.canvas_ids, slot.position)).encode())
    raw = np.frombuffer(digest.digest()[: len(slot.labels)], dtype=np.uint8) + 1.0
    return list(raw / raw.sum())


def test_a_batch_answers_each_request_from_its_own_reads(chat: ChatFormat) -> None:
    requests = [
        _request({"rude": YES_NO, "topic": CHOICE}, rid=f"r{i}", samples=1 + i % 3)
        for i in range(5)
    ]
    requests = [r.model_copy(update={"state": f"text number {i}"}) for i, r in enumerate(requests)]
    together = _classify(ScriptedEngine(_hashed), chat, requests)
    for req, res in zip(requests, together, strict=True):
        (alone,) = _classify(ScriptedEngine(_hashed), chat, [req])
        assert res.id == req.id
        assert res.answers == alone.answers
        assert res.diagnostics.reads == alone.diagnostics.reads == req.samples
        assert res.diagnostics.entropy == alone.diagnostics.entropy
    assert len({json.dumps(r.model_dump(mode="json")["answers"]) for r in together}) == 5


def test_each_chunk_of_a_request_has_its_own_noise(chat: ChatFormat) -> None:
    a, b = "qzxvk_a", "qzxvk_b"  # 9 tokens a line: two chunks on a 16-slot canvas
    engine = ScriptedEngine(lambda r, s: [0.5, 0.5], canvas_length=16)
    _classify(engine, chat, [_request({a: YES_NO, b: YES_NO})])
    first, second = engine.reads
    (slot_a,), (slot_b,) = first.slots, second.slots
    assert first.canvas_ids[slot_a.position] != second.canvas_ids[slot_b.position]


def test_batches_of_different_depths(chat: ChatFormat) -> None:
    deep = {"rude": YES_NO, "why": {**YES_NO, "depends_on": ["rude"]}}
    engine = ScriptedEngine(lambda r, s: [0.7, 0.3])
    flat, two, none = _classify(
        engine,
        chat,
        [_request({"rude": YES_NO}, rid="flat"), _request(deep, rid="deep"), _named("nope")],
    )
    assert set(flat.answers) == {"rude"} and flat.diagnostics.reads == 1
    assert set(two.answers) == {"rude", "why"} and two.diagnostics.reads == 2
    assert isinstance(none, RequestError)
    assert [len(call) for call in engine.calls] == [2, 1]  # stage 0 together, then stage 1


def _named(name: str) -> ClassificationRequest:
    parsed = parse_request(json.dumps({"id": "n", "state": "s", "question_set": name}).encode())
    assert isinstance(parsed, ClassificationRequest)
    return parsed


def test_a_batch_of_refused_requests_reads_nothing(chat: ChatFormat) -> None:
    engine = ScriptedEngine(lambda r, s: [0.5, 0.5])
    (err,) = _classify(engine, chat, [_named("nope")])
    assert isinstance(err, RequestError)
    assert err.message == "question_set: no question set named 'nope' in this pipeline"
    assert _classify(engine, chat, []) == []
    assert engine.calls == []


def test_a_template_too_long_refuses_that_request_only(chat: ChatFormat) -> None:
    long_id = "qzxvkqzxvkqzxvk"  # "<id>: yes" is 17 tokens: no 16-slot canvas holds it
    later = "qzxvk_qzxvk_qzxvk_q"  # a later stage that would not fit either
    engine = ScriptedEngine(lambda r, s: [0.5, 0.5], canvas_length=16)
    bad = _request({long_id: YES_NO, later: {**YES_NO, "depends_on": [long_id]}}, rid="bad")
    good = _request({"rude": YES_NO}, rid="good")
    err, ok = _classify(engine, chat, [bad, good])
    assert isinstance(err, RequestError)
    # The first stage's problem, not a later stage's: the refused request stops there.
    assert (err.code, err.field) == ("TEMPLATE_TOO_LONG", f"questions.{long_id}")
    assert ok.answers["rude"].type == "yes_no"
    assert [s.question_id for r in engine.reads for s in r.slots] == ["rude"]


class _Clock:
    """perf_counter stand-in: each call is `step` seconds after the previous one."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def test_timings_are_milliseconds_of_engine_and_batch(
    chat: ChatFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dgstream.workers.engine.classifier as classifier_module

    monkeypatch.setattr(classifier_module, "time", _Clock(0.00123456))
    engine = ScriptedEngine(lambda r, s: UNSURE)
    reqs = [_request({"a": YES_NO}, rid="x"), _request({"a": YES_NO}, rid="y", samples="auto")]
    x, y = _classify(engine, chat, reqs)
    # Clock reads: batch start; round 1 start, end; round 2 (y's extra reads) start, end;
    # batch end. Each is 1.23456 ms after the previous one.
    assert x.diagnostics.timings == {"engine_ms": 1.235, "batch_ms": 6.173}
    assert y.diagnostics.timings == {"engine_ms": 2.469, "batch_ms": 6.173}


def test_entropy_label_mass_and_metadata_in_the_result(chat: ChatFormat) -> None:
    class WithMass(ScriptedEngine):
        def _slot(self, read: Read, slot: Slot) -> SlotRead:
            p = np.array([0.123456789, 0.876543211])
            # Two other tokens each as likely as the first label: the labels hold 1/(1+2p0).
            lse = float(np.log(1.0 + 2 * p[0]))
            return slot_read_from_label_logits(slot.question_id, np.log(p), logsumexp_all=lse)

    engine = WithMass(lambda r, s: [])
    (res,) = _classify(engine, chat, [_request({"a": YES_NO}, metadata={"trace": [1, "x"]})])
    p = np.array([0.123456789, 0.876543211])
    assert res.diagnostics.entropy == {"a": round(float(-(p * np.log(p)).sum()), 6)}
    assert res.diagnostics.label_mass == {"a": round(1 / (1 + 2 * 0.123456789), 6)}
    assert res.metadata == {"trace": [1, "x"]}
    (plain,) = _classify(ScriptedEngine(lambda r, s: [0.5, 0.5]), chat, [_request({"a": YES_NO})])
    assert plain.diagnostics.label_mass == {"a": None}  # not known to the engine


def test_an_engine_that_drops_a_result_is_an_error(chat: ChatFormat) -> None:
    class Dropping(ScriptedEngine):
        async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
            return (await super().read(reads))[:-1]

    engine = Dropping(lambda r, s: [0.5, 0.5])
    with pytest.raises(ValueError, match="shorter than argument 1"):
        _classify(engine, chat, [_request({"a": YES_NO}, samples=2)])

"""Slot resolution: good templates pass; bad ones are refused with a code naming the
question and label. Real `tokenizers` tokenizers throughout: the tiny model's own, and a
hand-made BPE whose merges produce each failure on purpose."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, models, normalizers

from dgstream.schemas import ErrorCode, RequestRejected
from dgstream.workers.engine.template import (
    LayoutCache,
    build_canvas,
    canvas_width,
    labels_and_answers,
    resolve_layout,
)

pytestmark = pytest.mark.unit

YES_NO = ("yes", "no")
LETTERS = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
SCORE10 = ("1", "2", "3", "4", "5", "6", "7", "8", "9", "A")


def _crafted() -> Tokenizer:
    """No pre-tokenizer, so merges may cross the label's edges; lower-cased input."""
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789: \n")
    merges = [(" ", "x"), (" ", "y"), (" ", "v"), ("w", "\n")]
    vocab = {c: i for i, c in enumerate(chars)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.Lowercase()
    return tok


@pytest.fixture(scope="module")
def crafted_encode() -> Any:
    tok = _crafted()
    return lambda text: tok.encode(text).ids


def test_tiny_tokenizer_accepts_every_kind(tiny_chat: Any) -> None:
    spec = [("toxic", YES_NO), ("topic", LETTERS), ("severity", SCORE10)]
    layout = resolve_layout(tiny_chat.encode, spec, max_width=64)
    assert [s.question_id for s in layout.slots] == ["toxic", "topic", "severity"]
    for slot, (_, labels) in zip(layout.slots, spec, strict=True):
        assert len(set(slot.label_ids)) == len(labels)
        # Writing any label at the slot reproduces the template's tokenization.
        for label, tid in zip(labels, slot.label_ids, strict=True):
            text = "\n".join(f"{q}: {label if q == slot.question_id else ls[0]}" for q, ls in spec)
            ids = tiny_chat.encode(text)
            assert ids[slot.position] == tid
            assert len(ids) == len(layout.template_ids)
    assert layout.width % 16 == 0 and layout.width >= len(layout.template_ids) + 1


def test_crafted_tokenizer_accepts_good_labels(crafted_encode: Any) -> None:
    layout = resolve_layout(crafted_encode, [("a", ("x", "y"))], max_width=16)
    assert layout.slots[0].position == 2
    assert layout.slots[0].label_ids == (crafted_encode(" x")[0], crafted_encode(" y")[0])


@pytest.mark.parametrize(
    ("labels", "code", "named"),
    [
        # "zz" is two tokens where "x" is one.
        (("x", "zz"), ErrorCode.LABEL_NOT_SINGLE_TOKEN, "zz"),
        # The first label itself is two tokens.
        (("zz", "x"), ErrorCode.LABEL_NOT_SINGLE_TOKEN, "zz"),
        # "w" merges with the following newline: same length, two positions differ.
        (("x", "w"), ErrorCode.LABEL_POSITION_MISMATCH, "w"),
        # Each label is one token at one position, but "xw" lands one position later than
        # "y" ("w" merges with the newline after it): not the same slot.
        (("x", "y", "xw"), ErrorCode.LABEL_POSITION_MISMATCH, "xw"),
        (("x", "xw", "y"), ErrorCode.LABEL_POSITION_MISMATCH, "y"),
        # Lower-casing makes "X" the same token as "x".
        (("x", "X"), ErrorCode.DUPLICATE_LABEL_TOKEN, "X"),
        (("x", "y", "Y"), ErrorCode.DUPLICATE_LABEL_TOKEN, "y"),
    ],
)
def test_bad_labels_are_refused(
    crafted_encode: Any, labels: tuple[str, ...], code: ErrorCode, named: str
) -> None:
    spec = [("a", labels), ("b", ("x", "y"))]
    with pytest.raises(RequestRejected) as info:
        resolve_layout(crafted_encode, spec, max_width=64)
    err = info.value.error
    assert err.code == code
    assert err.field == "questions.a"
    assert "questions.a" in err.message and repr(named) in err.message


@pytest.mark.parametrize(
    ("template_len", "width"),
    [(0, 16), (14, 16), (15, 16), (16, 32), (31, 32), (32, 48), (47, 48), (48, 64)],
)
def test_canvas_width_counts_the_end_of_turn(template_len: int, width: int) -> None:
    """Template plus end-of-turn, rounded up to a multiple of 16: 15 template tokens fill a
    16-slot canvas, 16 need the next size up."""
    assert canvas_width(template_len) == width


@pytest.mark.parametrize(("qid_chars", "fits"), [(13, True), (14, False)])
def test_template_at_the_edge_of_the_canvas(
    crafted_encode: Any, qid_chars: int, fits: bool
) -> None:
    qid = "abcdefghijklmn"[:qid_chars]  # "<qid>: x" is qid_chars + 2 tokens
    spec = [(qid, ("x", "y"))]
    assert len(crafted_encode(f"{qid}: x")) == qid_chars + 2
    if fits:
        layout = resolve_layout(crafted_encode, spec, max_width=16)
        assert layout.width == 16 and len(layout.template_ids) == 15
        return
    assert resolve_layout(crafted_encode, spec, max_width=32).width == 32
    with pytest.raises(RequestRejected) as info:
        resolve_layout(crafted_encode, spec, max_width=16)
    err = info.value.error
    assert (err.code, err.field) == (ErrorCode.TEMPLATE_TOO_LONG, f"questions.{qid}")
    assert "needs 17 canvas positions, more than the served canvas of 16" in err.message


@pytest.mark.parametrize(("second", "chunks"), [("ghij", [("abcdef", "ghij")]), ("ghijk", None)])
def test_chunks_split_exactly_when_the_joint_template_overflows(
    crafted_encode: Any, second: str, chunks: list[tuple[str, ...]] | None
) -> None:
    """8 + 1 + 6 = 15 template tokens share a 16-slot canvas; 8 + 1 + 7 = 16 do not."""
    spec = [("abcdef", ("x", "y")), (second, ("x", "y"))]
    got = [c.qids for c in LayoutCache(crafted_encode, max_width=16).chunks(spec)]
    assert got == (chunks or [("abcdef",), (second,)])
    if chunks is None:
        with pytest.raises(RequestRejected) as info:
            resolve_layout(crafted_encode, spec, max_width=16)
        assert info.value.error.field == "questions"  # several questions: no single culprit


def test_template_longer_than_canvas_for_a_lone_question(tiny_chat: Any) -> None:
    qid = "q" + "zq" * 30  # one question whose own line needs more than 16 positions
    cache = LayoutCache(tiny_chat.encode, max_width=16)
    with pytest.raises(RequestRejected) as info:
        cache.chunks([(qid, YES_NO)])
    assert info.value.error.code == ErrorCode.TEMPLATE_TOO_LONG
    assert info.value.error.field == f"questions.{qid}"


def test_chunking_packs_questions_that_fit(tiny_chat: Any) -> None:
    spec = [(f"question_{i}", YES_NO) for i in range(12)]
    cache = LayoutCache(tiny_chat.encode, max_width=16)
    chunks = cache.chunks(spec)
    assert len(chunks) > 1
    assert [q for c in chunks for q in c.qids] == [q for q, _ in spec]
    assert all(c.width <= 16 for c in chunks)
    joint = LayoutCache(tiny_chat.encode, max_width=256).chunks(spec)
    assert len(joint) == 1


def test_canvas_noise_only_at_slots(tiny_chat: Any) -> None:
    layout = resolve_layout(
        tiny_chat.encode,
        [("toxic", YES_NO), ("topic", LETTERS)],
        max_width=64,
    )
    kw = {"eot_id": tiny_chat.eot_id, "pad_id": tiny_chat.pad_id, "vocab_size": 2048}
    a = build_canvas(layout, seed=1, **kw)
    b = build_canvas(layout, seed=1, **kw)
    c = build_canvas(layout, seed=2, **kw)
    assert a == b
    slots = {s.position for s in layout.slots}
    assert {i for i, (x, y) in enumerate(zip(a, c, strict=True)) if x != y} <= slots
    assert a != c
    n = len(layout.template_ids)
    assert a[n] == tiny_chat.eot_id and set(a[n + 1 :]) <= {tiny_chat.pad_id}
    assert len(a) == layout.width == canvas_width(n)


@pytest.mark.parametrize(
    ("question", "labels", "answers"),
    [
        ({"type": "noul", "instructions": "x"}, ("yes", "no"), ("yes", "no")),
        (
            {"type": "choice", "instructions": "x", "criteria": {"en": None, "fr": "French"}},
            ("A", "B"),
            ("en", "fr"),
        ),
        (
            {"type": "score", "instructions": "x", "criteria": [str(i) for i in range(10)]},
            SCORE10,
            tuple(str(i) for i in range(10)),
        ),
    ],
)
def test_labels_by_kind(question: dict[str, Any], labels: tuple[str, ...], answers: Any) -> None:
    from pydantic import TypeAdapter

    from dgstream.schemas import Question

    q = TypeAdapter(Question).validate_python(question)
    assert labels_and_answers(q) == (labels, answers)


def test_canvas_noise_is_any_id_of_the_vocabulary(tiny_chat: Any) -> None:
    # Uniform-state noise draws from the whole vocabulary, id 0 included: over 64 seeds of a
    # two-id vocabulary both ids turn up at both slots (the chance that one never does is
    # about 2**-60).
    layout = resolve_layout(
        tiny_chat.encode,
        [("toxic", YES_NO), ("topic", LETTERS)],
        max_width=64,
    )
    kw = {"eot_id": tiny_chat.eot_id, "pad_id": tiny_chat.pad_id, "vocab_size": 2}
    canvases = [build_canvas(layout, seed=s, **kw) for s in range(64)]
    for slot in layout.slots:
        assert {c[slot.position] for c in canvases} == {0, 1}


@pytest.mark.parametrize(
    ("labels", "code", "message"),
    [
        (
            ("x", "w"),
            ErrorCode.LABEL_POSITION_MISMATCH,
            "label 'w' lands at template position(s) [2, 3], not at the one slot ? the other "
            "labels use",
        ),
        (
            ("x", "y", "xw"),
            ErrorCode.LABEL_POSITION_MISMATCH,
            "label 'xw' lands at template position(s) [3], not at the one slot 2 the other "
            "labels use",
        ),
        (
            ("x", "X"),
            ErrorCode.DUPLICATE_LABEL_TOKEN,
            "label 'X' has the same token id as label 'x'",
        ),
        (
            ("x", "y", "Y"),
            ErrorCode.DUPLICATE_LABEL_TOKEN,
            "label 'y' has the same token id as another label",
        ),
        # The schema asks for two labels; called directly with one, the layout refuses too.
        (("x",), ErrorCode.INVALID_VALUE, "needs two labels"),
    ],
)
def test_each_refusal_says_what_the_label_did(
    crafted_encode: Any, labels: tuple[str, ...], code: ErrorCode, message: str
) -> None:
    with pytest.raises(RequestRejected) as info:
        resolve_layout(crafted_encode, [("a", labels), ("b", YES_NO)], max_width=64)
    err = info.value.error
    assert (err.code, err.field, err.message) == (code, "questions.a", f"questions.a: {message}")


def test_a_slot_keeps_its_labels_in_order(crafted_encode: Any) -> None:
    layout = resolve_layout(crafted_encode, [("a", ("y", "x"))], max_width=16)
    (slot,) = layout.slots
    assert (slot.question_id, slot.labels) == ("a", ("y", "x"))
    assert slot.label_ids == (crafted_encode(" y")[0], crafted_encode(" x")[0])

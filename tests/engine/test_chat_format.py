"""The chat format around a tokenizer (its end-of-turn and padding ids, with the fallbacks a
tokenizer without them gets), the label ids every template shares, the seeds of the noise,
and what the layout cache does with errors that are not about length."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from schemas import ErrorCode, RequestRejected
from workers.engine.template import (
    ChatFormat,
    LayoutCache,
    make_read,
    noise_seed,
    resolve_layout,
    standard_label_ids,
)

pytestmark = pytest.mark.unit

# A chat template without Gemma's turn markers, so nothing in the vocabulary ends a turn.
PLAIN_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}[model] {% endif %}"
)


def _word_level(words: list[str], **special: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *words])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", **special)
    tok.chat_template = PLAIN_TEMPLATE
    return tok


def test_without_end_of_turn_or_pad_tokens_both_fall_back_to_eos() -> None:
    tok = _word_level(["[system]", "[user]", "[model]", "hello"], eos_token="</s>")
    chat = ChatFormat(tok)
    assert (chat.eot_id, chat.pad_id, chat.thought_ids) == (1, 1, ())
    prompt, shared = chat.prompt_ids("hello", "hello hello")
    assert prompt == tuple(tok("[system] hello [user] hello hello [model]")["input_ids"])
    assert shared == 3  # "[system] hello [user]"


def test_a_known_end_of_turn_and_pad_are_used() -> None:
    words = ["[system]", "[user]", "[model]", "<end_of_turn>", "<pad>"]
    chat = ChatFormat(_word_level(words, eos_token="</s>", pad_token="<pad>"))
    assert (chat.eot_id, chat.pad_id) == (5, 6)
    named = ChatFormat(_word_level(words, eos_token="</s>"), eot_token="[model]")
    assert named.eot_id == 4


def test_thought_tokens_follow_the_prompt_when_asked() -> None:
    words = ["[system]", "[user]", "[model]", "<|channel>thought", "<channel|>"]
    tok = _word_level(words, eos_token="</s>")
    assert ChatFormat(tok, thought=False).thought_ids == ()
    chat = ChatFormat(tok, thought=True)
    assert chat.thought_ids == tuple(tok("<|channel>thought\n<channel|>")["input_ids"]) == (5, 6)
    prompt, _ = chat.prompt_ids("a", "b")
    assert prompt[-2:] == (5, 6)


def test_standard_label_ids_are_the_labels_every_template_writes(demo_chat: ChatFormat) -> None:
    labels = ["yes", "no", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *"123456789"]
    want = sorted({demo_chat.encode(f"q: {label}")[-1] for label in labels})
    assert len(want) == len(labels)
    assert standard_label_ids(demo_chat.encode, demo_chat.eot_id) == tuple(want)


def test_standard_label_ids_leave_out_a_group_that_is_not_one_token() -> None:
    # Characters are tokens, but "B" is two: yes/no (3 and 2 characters) and the letters
    # are left out, the digits stay.
    def encode(text: str) -> list[int]:
        return [t for c in text for t in ([ord(c), 1] if c == "B" else [ord(c)])]

    assert standard_label_ids(encode, 0) == tuple(ord(d) for d in "123456789")


def test_noise_seeds_are_64_bit_and_differ_by_each_part() -> None:
    base = noise_seed(0, "r", ("a",), 0)
    assert 0 <= base < 1 << 64
    assert noise_seed(0, "r", ("a",), 0) == base
    others = [
        noise_seed(1, "r", ("a",), 0),
        noise_seed(0, "s", ("a",), 0),
        noise_seed(0, "r", ("b",), 0),
        noise_seed(0, "r", ("a",), 1),
    ]
    assert len({base, *others}) == 5
    assert all(0 <= s < 1 << 64 for s in others)


def test_a_read_without_a_tag_has_none(demo_chat: ChatFormat) -> None:
    layout = resolve_layout(demo_chat.encode, [("q", ("yes", "no"))], eot_id=0, max_width=64)
    read = make_read(demo_chat, layout, "system", "user", seed=1)
    assert read.tag == ""
    assert make_read(demo_chat, layout, "system", "user", seed=1, tag="r#0").tag == "r#0"


def test_chunks_pass_on_errors_other_than_length() -> None:
    def encode(text: str) -> list[int]:
        if "\n" in text:  # the joint template of two questions
            raise ValueError("tokenizer broke")
        return [ord(c) for c in text]

    cache = LayoutCache(encode, 0, max_width=64)
    with pytest.raises(ValueError, match="tokenizer broke"):
        cache.chunks([("a", ("x", "y")), ("b", ("x", "y"))])
    # A label problem in the second question is that question's, not a reason to split.
    chars = LayoutCache(lambda text: [ord(c) for c in text], 0, max_width=64)
    with pytest.raises(RequestRejected) as info:
        chars.chunks([("a", ("x", "y")), ("b", ("x", "yy"))])
    assert (info.value.error.code, info.value.error.field) == (
        ErrorCode.LABEL_NOT_SINGLE_TOKEN,
        "questions.b",
    )


@pytest.fixture(scope="module")
def demo_chat() -> ChatFormat:
    from transformers import AutoTokenizer

    from workers.engine.models import TRAINED_DIRS

    return ChatFormat(AutoTokenizer.from_pretrained(str(TRAINED_DIRS["demo"])))

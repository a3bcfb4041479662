"""The chat format around a tokenizer (its end-of-turn and padding ids, with the fallbacks a
tokenizer without them gets), the label ids every template shares, the seeds of the noise,
and what the layout cache does with errors that are not about length."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from dgstream.schemas import ErrorCode, RequestRejected
from dgstream.workers.engine.template import (
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
    assert standard_label_ids(demo_chat.encode) == tuple(want)


def test_standard_label_ids_leave_out_a_group_that_is_not_one_token() -> None:
    # Characters are tokens, but "B" is two: yes/no (3 and 2 characters) and the letters
    # are left out, the digits stay.
    def encode(text: str) -> list[int]:
        return [t for c in text for t in ([ord(c), 1] if c == "B" else [ord(c)])]

    assert standard_label_ids(encode) == tuple(ord(d) for d in "123456789")


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
    layout = resolve_layout(demo_chat.encode, [("q", ("yes", "no"))], max_width=64)
    read = make_read(demo_chat, layout, "system", "user", seed=1)
    assert read.tag == ""
    assert make_read(demo_chat, layout, "system", "user", seed=1, tag="r#0").tag == "r#0"


def test_chunks_pass_on_errors_other_than_length() -> None:
    def encode(text: str) -> list[int]:
        if "\n" in text:  # the joint template of two questions
            raise ValueError("tokenizer broke")
        return [ord(c) for c in text]

    cache = LayoutCache(encode, max_width=64)
    with pytest.raises(ValueError, match="tokenizer broke"):
        cache.chunks([("a", ("x", "y")), ("b", ("x", "y"))])
    # A label problem in the second question is that question's, not a reason to split.
    chars = LayoutCache(lambda text: [ord(c) for c in text], max_width=64)
    with pytest.raises(RequestRejected) as info:
        chars.chunks([("a", ("x", "y")), ("b", ("x", "yy"))])
    assert (info.value.error.code, info.value.error.field) == (
        ErrorCode.LABEL_NOT_SINGLE_TOKEN,
        "questions.b",
    )


@pytest.fixture(scope="module")
def demo_chat() -> ChatFormat:
    from transformers import AutoTokenizer

    from dgstream.workers.engine.models import TRAINED_DIRS

    return ChatFormat(AutoTokenizer.from_pretrained(str(TRAINED_DIRS["demo"])))


# --------------------------------------------------------------------------- caches
# Both caches answer a repeat without tokenizing again, keep at most their size, and drop
# the least recently used entry first: counted by the tokenizer calls they save.


class _Counting:
    """A character-level encoder that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, text: str) -> list[int]:
        self.calls += 1
        return [ord(c) for c in text]


class _CountingTokenizer:
    """A tokenizer that counts the texts it is asked to tokenize."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    def __call__(self, text: str, **kw: Any) -> Any:
        self.calls += 1
        return self.tokenizer(text, **kw)


def test_the_prefix_cache_keeps_the_256_most_recently_used_system_texts() -> None:
    chat = ChatFormat(_word_level(["[system]", "[user]", "[model]"], eos_token="</s>"))
    tok = chat.tokenizer = _CountingTokenizer(chat.tokenizer)
    first = chat.prefix_ids("s0")
    assert (chat.prefix_ids("s0"), tok.calls) == (first, 1)  # a repeat: no tokenizing
    for i in range(1, 256):
        chat.prefix_ids(f"s{i}")
    assert tok.calls == 256
    chat.prefix_ids("s0")  # used again: now the most recent
    chat.prefix_ids("s256")  # the 257th: the least recently used (s1) goes
    assert tok.calls == 257
    chat.prefix_ids("s0")
    chat.prefix_ids("s256")
    assert tok.calls == 257  # both still cached
    chat.prefix_ids("s1")
    assert tok.calls == 258  # tokenized again


def test_a_tokenizer_that_adds_its_own_bos_does_not_get_a_second_one() -> None:
    # The chat template writes <bos>; Gemma's tokenizer would add one more by itself.
    from tokenizers import processors

    tok = _word_level(["<bos>", "[system]", "[user]", "[model]", "a"], eos_token="</s>")
    tok.bos_token = "<bos>"
    bos = tok.convert_tokens_to_ids("<bos>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", bos)]
    )
    tok.chat_template = "<bos> " + PLAIN_TEMPLATE
    assert tok("a")["input_ids"] == [bos, tok.convert_tokens_to_ids("a")]
    chat = ChatFormat(tok)
    assert chat.encode("a") == [tok.convert_tokens_to_ids("a")]
    prompt, _ = chat.prompt_ids("a", "a")
    assert prompt.count(bos) == 1 and prompt[0] == bos


def test_the_layout_cache_keeps_its_size_of_most_recently_used_layouts() -> None:
    encode = _Counting()
    cache = LayoutCache(encode, max_width=64, size=2)
    a, b, c = ([(q, ("x", "y"))] for q in "abc")
    layout = cache.get(a)
    per_layout = encode.calls
    assert cache.get(a) is layout and encode.calls == per_layout  # a repeat: the same one
    cache.get(b)
    cache.get(a)  # used again: now the most recent
    cache.get(c)  # the third: the least recently used (b) goes
    assert encode.calls == 3 * per_layout
    assert cache.get(a) is layout and encode.calls == 3 * per_layout
    cache.get(c)
    assert encode.calls == 3 * per_layout
    cache.get(b)
    assert encode.calls == 4 * per_layout  # resolved again


def test_the_shared_prefix_ends_where_the_user_text_joins_its_last_token() -> None:
    # A template that glues the user's text to "[user]": the prefix's last token is not
    # the whole prompt's, so only "[system]hi" is shared.
    words = ["[system]hi", "[user]", "[user]there", "[model]"]
    tok = _word_level(words, eos_token="</s>")
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}[model] {% endif %}"
    )
    chat = ChatFormat(tok)
    assert chat.prefix_ids("hi") == (2, 3)  # "[system]hi", "[user]"
    prompt, shared = chat.prompt_ids("hi", "there")
    assert (prompt, shared) == ((2, 4, 5), 1)


def test_the_layout_cache_keeps_1024_layouts_unless_told() -> None:
    encode = _Counting()
    cache = LayoutCache(encode, max_width=64)
    for i in range(1024):
        cache.get([(f"q{i}", ("x", "y"))])
    calls = encode.calls
    cache.get([("q0", ("x", "y"))])
    assert encode.calls == calls  # all 1024 kept
    cache.get([("q1024", ("x", "y"))])  # one more: the least recently used (q1) goes
    calls = encode.calls
    cache.get([("q0", ("x", "y"))])
    assert encode.calls == calls
    cache.get([("q1", ("x", "y"))])
    assert encode.calls > calls

"""Prompt, answer template, slot resolution and canvas building (steps 1, 2 and 4 of the
single-step read, docs/model.md).

- The *system text* lists each question, its instructions and its labels, and asks for one
  `id: label` line per question. It is the same for every request of a question set, so
  its tokens form a prefix a backend can cache.
- The *user turn* is the state, followed by the answers of the questions this chunk
  depends on. A request's own `instructions` (vLLM's request-level instructions) open the
  user turn as a quoted context block, ahead of the state (`context_text`): after the
  system text, so the question set's shared prefix stays first and shared, and out of the
  system turn, since they are the producer's text and not the pipeline's.
- The *answer template* is `id: <label>` lines; slot resolution tokenizes it with every
  label and checks that each label is ONE token at ONE position.
- The *canvas* is the template, end-of-turn, then padding to a multiple of 16, with seeded
  uniform noise at the slots.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dgstream.schemas._common import printable
from dgstream.schemas.kinds import get_kind, kinds
from dgstream.workers.engine.types import Read, Slot

if TYPE_CHECKING:
    from dgstream.schemas import Question, RequestRejected

# Canvas widths are multiples of 16, the project's choice from its first layout: few widths
# keep batch shapes (and a backend's compiled graphs) few, and the demo model was trained so.
CANVAS_QUANTUM = 16
# The version of what this module writes for the model (system text, user turn, answer
# template, canvas layout), named in every result's audit. Bump it with any change to the
# text or layout that could move an answer: tests/workers/test_audit.py pins the rendered
# prompt and canvas of a fixed request to this version.
# Each kind's lines of the system text are its module's (`schemas/kinds/`, `Kind.prompt`):
# a change there that could move an answer bumps this version too.
PROMPT_TEMPLATE_VERSION = "dgstream-prompt-1"


def labels_and_answers(question: Question) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The label tokens the model writes, and the answer each stands for, in order. The
    answers are the contract's (`Question.answers`); the labels are the question's kind's
    (`Kind.labels`: yes/no as themselves, options A..Z, levels 1..9 then letters)."""
    return get_kind(question.kind).labels(question), question.answers


# --------------------------------------------------------------------------- texts


def system_text(questions: Mapping[str, Question]) -> str:
    """The questions as the model reads them. The demo model was trained on this text: a
    request that could be written before (instructions and level names all text) must keep
    getting the same bytes."""
    lines = [
        "You answer questions about the user's message.",
        "Answer every question on its own line as `id: label`, using only the labels given.",
        "",
    ]
    for qid, q in questions.items():
        labels, _ = labels_and_answers(q)
        lines += get_kind(q.kind).prompt(qid, q, labels)
        lines.append(f"  Labels: {', '.join(labels)}")
    return "\n".join(lines)


# The heading of a request's instructions in the user turn, and of the state after them.
CONTEXT_HEADING = "Context given with the request (quoted):"
MESSAGE_HEADING = "Message:"


def context_text(instructions: str) -> str:
    """A request's `instructions` as the user turn opens with them: the heading, then every
    line of the text quoted with "> " (">" alone for an empty one). Every line boundary
    Python knows (`str.splitlines`: CR, LF, VT, FF, NEL, U+2028, ...) becomes a quoted
    line's end, so no line of the text can stand outside the block: it cannot end it,
    write the message's heading or "Earlier answers:". A lone surrogate (the schema refuses
    them; should one come all the same) is written as its backslash escape, which encodes. The
    tokenizer's own markers are a tokenizer's business: `ChatFormat.inert` breaks them."""
    lines = printable(instructions).splitlines() or [""]
    quoted = "\n".join(f"> {line}" if line else ">" for line in lines)
    return f"{CONTEXT_HEADING}\n{quoted}"


def user_text(state: str, known: Mapping[str, str], context: str | None = None) -> str:
    """The user turn: the state and the earlier answers; with `context` (a request's
    instructions as `context_text` and `ChatFormat.inert` make them) first, and the state
    under its heading. Without it the text is the state's alone, byte for byte as it has
    always been (the demo model was trained on it)."""
    text = state
    if known:
        earlier = "\n".join(f"{qid}: {answer}" for qid, answer in known.items())
        text = f"{state}\n\nEarlier answers:\n{earlier}"
    if context is None:
        return text
    return f"{context}\n\n{MESSAGE_HEADING}\n{text}"


def template_text(qids: Sequence[str], labels: Mapping[str, str]) -> str:
    return "\n".join(f"{qid}: {labels[qid]}" for qid in qids)


# --------------------------------------------------------------------------- tokenizer


class Encoder(Protocol):
    def __call__(self, text: str) -> list[int]: ...


class ChatFormat:
    """The model's chat template and special ids, from a Hugging Face tokenizer.

    Prompts are rendered as vLLM 0.33's own DiffusionGemma label reads render them: the
    chat template with the generation prompt and thinking off, tokenized whole without
    added special tokens, then (for a tokenizer that has Gemma 4's channel tokens) the
    empty thought block after it, outside the canvas: vLLM's reader says results are far
    worse without it. A tokenizer without those tokens (the demo model's) keeps the format
    it was trained on.
    """

    # Gemma 4 (DiffusionGemma) ends a turn with "<turn|>"; older formats after it.
    _EOT_CANDIDATES = ("<turn|>", "<end_of_turn>", "<|im_end|>", "<|eot_id|>")
    # vLLM's `DiffusionGemmaCanvasStrategy.THOUGHT`: an empty thought channel.
    THOUGHT = "<|channel>thought\n<channel|>"
    _THOUGHT_TOKENS = ("<|channel>", "<channel|>")
    # The chat-template switch vLLM's reads set (`ReadPromptRequest.build_chat_params`).
    TEMPLATE_KWARGS: Mapping[str, Any] = {"enable_thinking": False}
    _SENTINEL = "\u0001DGSTREAM-USER\u0001"
    # What `inert` writes inside a marker's text to break it: a zero-width space.
    BREAK = "\u200b"
    # Passes of `inert` before it gives up (one suffices for every tokenizer seen).
    _INERT_PASSES = 4

    def __init__(
        self, tokenizer: Any, eot_token: str | None = None, *, thought: bool | None = None
    ) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        if eot_token is None:
            eot_token = next((t for t in self._EOT_CANDIDATES if t in vocab), None)
        self.eot_id: int = vocab[eot_token] if eot_token else int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_id: int = int(pad if pad is not None else tokenizer.eos_token_id)
        self.vocab_size: int = len(tokenizer)
        if thought is None:
            thought = all(t in vocab for t in self._THOUGHT_TOKENS)
        self.thought_ids: tuple[int, ...] = tuple(self.encode(self.THOUGHT)) if thought else ()
        self._prefix_cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._inert_cache: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        # The ids of the tokenizer's special tokens (turn markers, channel markers, BOS,
        # EOS, padding, image tokens ...): text from a request must never become one.
        self.special_ids: frozenset[int] = frozenset(
            int(i)
            for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if getattr(tok, "special", True)
        ) | frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()))
        # Their text, for `inert`'s quick look: a text holding none of them cannot hold one
        # when the tokenizer matches them on the raw text (added tokens not `normalized`);
        # otherwise every text is tokenized to find them.
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._marker_texts: tuple[str, ...] = tuple(
            sorted(
                {str(tok.content) for i, tok in added.items() if int(i) in self.special_ids}
                | {str(s) for s in getattr(tokenizer, "all_special_tokens", ())}
            )
        )
        # A Python ("slow") tokenizer gives no offsets: its markers are found by their
        # text. In reverse order a marker sorts before any marker that is a prefix of it,
        # so the alternation tries the longer first.
        self._fast: bool = bool(getattr(tokenizer, "is_fast", False))
        # (With no marker at all, a pattern that matches nothing.)
        self._marker_re: re.Pattern[str] = re.compile(
            "|".join(re.escape(m) for m in sorted(filter(None, self._marker_texts), reverse=True))
            or "(?!)"
        )
        self._markers_raw: bool = (
            bool(self._marker_texts)
            and not any(
                getattr(tok, "normalized", True)
                for i, tok in added.items()
                if int(i) in self.special_ids
            )
            and all(int(i) in added for i in self.special_ids)
        )
        # Render once with a sentinel user turn: everything before it is the shared prefix.
        rendered = tokenizer.apply_chat_template(
            [
                {"role": "system", "content": "\u0002SYS\u0002"},
                {"role": "user", "content": self._SENTINEL},
            ],
            add_generation_prompt=True,
            tokenize=False,
            **self.TEMPLATE_KWARGS,
        )
        head, _, self._after_user = rendered.partition(self._SENTINEL)
        self._before_sys, _, self._between = head.partition("\u0002SYS\u0002")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def inert(self, text: str, field: str = "instructions", cache: bool = True) -> str:
        """`text` with every piece the tokenizer would read as one of its special tokens
        broken by a zero-width space after its first character (a one-character marker is
        replaced by U+FFFD), until none is left: a request's text can then not open or end
        a turn, a channel or an image, whatever the chat format's markers are. Every piece of
        a request's text the prompt carries goes through it (its state, its instructions,
        its inline questions); text without markers comes back as it is, so their prompts
        are what they always were. Raises `RequestRejected` (INVALID_VALUE, naming `field`)
        if markers are still read after a few passes (a tokenizer that drops the zero-width
        space before it matches its markers). `cache`: remember the answer (text that
        repeats: instructions, question sets; not states)."""
        if self._markers_raw and not any(m in text for m in self._marker_texts):
            return text  # no marker's text in it, and markers match raw text only
        with self._lock:
            hit = self._inert_cache.get(text)
            if hit is not None:
                self._inert_cache.move_to_end(text)
                return hit
        out = text
        for _ in range(self._INERT_PASSES):
            spans = self._special_spans(out)
            if not spans:
                break
            for start, end in reversed(spans):
                if end - start <= 1:
                    out = f"{out[:start]}\ufffd{out[end:]}"
                else:
                    out = f"{out[: start + 1]}{self.BREAK}{out[start + 1 :]}"
        else:
            if self._special_spans(out):
                raise self._still_marked(field)
        # A Python tokenizer's spans were found by the markers' text: its tokens have the
        # last word (a fast one's spans are its tokens already).
        if not self._fast and any(t in self.special_ids for t in self.encode(out)):
            raise self._still_marked(field)
        if cache:
            with self._lock:
                self._inert_cache[text] = out
                if len(self._inert_cache) > 256:
                    self._inert_cache.popitem(last=False)
        return out

    @staticmethod
    def _still_marked(field: str) -> RequestRejected:
        return _reject(
            "INVALID_VALUE",
            f"{field}: the model's tokenizer still reads its own markers in it after they "
            "were broken; send it without the markers",
            field,
        )

    def _special_spans(self, text: str) -> list[tuple[int, int]]:
        """Where in `text` the tokenizer reads a special token (character offsets). A fast
        tokenizer says so itself (its offsets); a Python ("slow") one gives no offsets, and
        it matches its added tokens on the raw text, so the markers' text is searched."""
        if not self.special_ids:
            return []
        if not self._fast:
            return self._marker_spans(text)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return sorted(
            {
                (int(a), int(b))
                for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
                if t in self.special_ids
            }
        )

    def _marker_spans(self, text: str) -> list[tuple[int, int]]:
        """Each marker text's occurrences, left to right, the longest where two start at
        one place (as a tokenizer's added-token trie matches them)."""
        return [m.span() for m in self._marker_re.finditer(text)]

    def prefix_ids(self, system: str) -> tuple[int, ...]:
        """Tokens of the chat up to the start of the user's text (cached: it repeats)."""
        with self._lock:
            hit = self._prefix_cache.get(system)
            if hit is not None:
                self._prefix_cache.move_to_end(system)
                return hit
        ids = tuple(self.encode(self._before_sys + system + self._between))
        with self._lock:
            self._prefix_cache[system] = ids
            if len(self._prefix_cache) > 256:
                self._prefix_cache.popitem(last=False)
        return ids

    def prompt_ids(self, system: str, user: str) -> tuple[tuple[int, ...], int]:
        """The whole prompt's ids, and how many leading ones every prompt with this system
        text shares (a backend may cache their KV).

        The chat is tokenized whole, as vLLM tokenizes it, so no token can differ at the
        seam between the shared part and the user's text; the shared count is where the
        whole prompt and the cached prefix part ways (their full length in practice)."""
        prefix = self.prefix_ids(system)
        ids = self.encode(self._before_sys + system + self._between + user + self._after_user)
        shared = 0
        for a, b in zip(prefix, ids, strict=False):
            if a != b:
                break
            shared += 1
        return (*ids, *self.thought_ids), shared


# --------------------------------------------------------------------------- slots


@dataclass(frozen=True)
class Layout:
    """A resolved answer template for an ordered group of questions."""

    qids: tuple[str, ...]
    template_ids: tuple[int, ...]  # with each question's first label at its slot
    slots: tuple[Slot, ...]
    width: int  # canvas width: template + end-of-turn, rounded up to 16


def _reject(code: str, message: str, field: str) -> RequestRejected:
    from dgstream.schemas import ErrorCode, RequestError, RequestRejected

    return RequestRejected(RequestError(code=ErrorCode(code), message=message, field=field))


def _label_token_count(encode: Encoder, qid: str, label: str) -> int:
    return len(encode(f"{qid}: {label}")) - len(encode(f"{qid}:"))


def resolve_layout(
    encode: Encoder,
    questions: Sequence[tuple[str, tuple[str, ...]]],
    *,
    max_width: int,
) -> Layout:
    """Tokenize the template with every label and find each question's slot.

    `questions` is `(question id, labels)` in template order. Raises `RequestRejected`
    naming the question and label when a label is not one token, labels land at different
    positions, two labels share a token, or the template does not fit `max_width`.
    """
    first = {qid: labels[0] for qid, labels in questions}
    qids = tuple(qid for qid, _ in questions)
    base = encode(template_text(qids, first))
    slots: list[Slot] = []
    for qid, labels in questions:
        field = f"questions.{qid}"
        position: int | None = None
        ids: list[int] = []
        for j, label in enumerate(labels):
            if j == 0:
                ids.append(-1)  # filled below from the position the other labels agree on
                continue
            toks = encode(template_text(qids, {**first, qid: label}))
            if len(toks) != len(base):
                culprit = label
                if _label_token_count(encode, qid, labels[0]) != 1:
                    culprit = labels[0]
                raise _reject(
                    "LABEL_NOT_SINGLE_TOKEN",
                    f"{field}: label {culprit!r} is not one token in the answer template "
                    f"(every label of a question must be ONE token at the same position)",
                    field,
                )
            diff = [i for i, (a, b) in enumerate(zip(base, toks, strict=True)) if a != b]
            if not diff:
                raise _reject(
                    "DUPLICATE_LABEL_TOKEN",
                    f"{field}: label {label!r} has the same token id as label {labels[0]!r}",
                    field,
                )
            if len(diff) != 1 or (position is not None and diff[0] != position):
                raise _reject(
                    "LABEL_POSITION_MISMATCH",
                    f"{field}: label {label!r} lands at template position(s) {diff}, "
                    f"not at the one slot {position if position is not None else '?'} "
                    f"the other labels use",
                    field,
                )
            position = diff[0]
            ids.append(toks[position])
        if position is None:  # a single label cannot happen (the schema needs two)
            raise _reject("INVALID_VALUE", f"{field}: needs two labels", field)
        ids[0] = base[position]
        if len(set(ids)) != len(ids):
            dup = next(lab for lab, t in zip(labels, ids, strict=True) if ids.count(t) > 1)
            raise _reject(
                "DUPLICATE_LABEL_TOKEN",
                f"{field}: label {dup!r} has the same token id as another label",
                field,
            )
        slots.append(Slot(qid, position, tuple(ids), tuple(labels)))
    width = canvas_width(len(base))
    if width > max_width:
        field = f"questions.{qids[0]}" if len(qids) == 1 else "questions"
        raise _reject(
            "TEMPLATE_TOO_LONG",
            f"{field}: the answer template needs {len(base) + 1} canvas positions, "
            f"more than the served canvas of {max_width}",
            field,
        )
    return Layout(qids, tuple(base), tuple(slots), width)


def standard_label_ids(encode: Encoder) -> tuple[int, ...]:
    """The token ids of every label the templates write (each kind's `shared_labels`: yes/no,
    A..Z, 1..9) at a slot, sorted; labels that are not one token there are left out (a read
    that needs them asks for its own)."""
    ids: set[int] = set()
    groups = [k.shared_labels for k in kinds() if k.shared_labels]
    for labels in groups:
        try:
            layout = resolve_layout(encode, [("q", labels)], max_width=1 << 16)
        except Exception:
            continue
        ids.update(layout.slots[0].label_ids)
    return tuple(sorted(ids))


def canvas_width(template_len: int) -> int:
    need = template_len + 1  # + end-of-turn
    return -(-need // CANVAS_QUANTUM) * CANVAS_QUANTUM


class LayoutCache:
    """Resolved layouts by (question ids, labels): resolution tokenizes every label."""

    def __init__(self, encode: Encoder, max_width: int, size: int = 1024) -> None:
        self._encode = encode
        self.max_width = max_width
        self._size = size
        self._hits: OrderedDict[tuple[tuple[str, tuple[str, ...]], ...], Layout] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, questions: Sequence[tuple[str, tuple[str, ...]]]) -> Layout:
        key = tuple(questions)
        with self._lock:
            hit = self._hits.get(key)
            if hit is not None:
                self._hits.move_to_end(key)
                return hit
        layout = resolve_layout(self._encode, questions, max_width=self.max_width)
        with self._lock:
            self._hits[key] = layout
            if len(self._hits) > self._size:
                self._hits.popitem(last=False)
        return layout

    def chunks(self, questions: Sequence[tuple[str, tuple[str, ...]]]) -> list[Layout]:
        """Greedy packing in order: one joint read while the template fits the canvas,
        otherwise consecutive chunks that each fit (they read in parallel)."""
        out: list[Layout] = []
        current: list[tuple[str, tuple[str, ...]]] = []
        for q in questions:
            if not current:
                current = [q]
                continue
            try:
                self.get([*current, q])
                current.append(q)
            except Exception as exc:
                if getattr(getattr(exc, "error", None), "code", None) != "TEMPLATE_TOO_LONG":
                    raise
                out.append(self.get(current))
                current = [q]
        if current:
            out.append(self.get(current))  # a lone question that does not fit raises here
        return out


# --------------------------------------------------------------------------- canvas


def noise_seed(*parts: object) -> int:
    """A stable 64-bit seed from the request id, chunk, read index and the base seed."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def build_canvas(
    layout: Layout, *, eot_id: int, pad_id: int, vocab_size: int, seed: int
) -> tuple[int, ...]:
    """Template, end-of-turn, padding; every slot holds a uniformly random vocabulary id
    (DiffusionGemma is a uniform-state diffusion model: its noise is random ids)."""
    canvas = [*layout.template_ids, eot_id]
    canvas += [pad_id] * (layout.width - len(canvas))
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, vocab_size, size=len(layout.slots))
    for slot, tok in zip(layout.slots, noise, strict=True):
        canvas[slot.position] = int(tok)
    return tuple(canvas)


def make_read(
    chat: ChatFormat,
    layout: Layout,
    system: str,
    user: str,
    *,
    seed: int,
    tag: str = "",
) -> Read:
    prompt, shared = chat.prompt_ids(system, user)
    canvas = build_canvas(
        layout, eot_id=chat.eot_id, pad_id=chat.pad_id, vocab_size=chat.vocab_size, seed=seed
    )
    return Read(
        prompt_ids=prompt,
        canvas_ids=canvas,
        slots=layout.slots,
        shared_prefix_len=shared,
        tag=tag,
    )

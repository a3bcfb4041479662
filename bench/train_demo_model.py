"""Train the demo DiffusionGemma (`SPECS["demo"]`) on the demo task family with the
single-step-read objective.

Every training example is a read built exactly as the engine builds it
(`workers.engine.template`: the tiny tokenizer's `ChatFormat`, `LayoutCache.chunks`,
`system_text`, `user_text`, `make_read` with a fresh noise seed per read): the prompt is
encoded, the canvas (answer template, end-of-turn, padding, uniform random ids at the slots)
goes through ONE decoder pass, and the loss is the cross-entropy over the FULL vocabulary at
each slot toward the true label's token id. The forward is the model's own
(`model(input_ids, attention_mask, position_ids, decoder_input_ids, decoder_attention_mask,
decoder_position_ids)`): prompts right-padded with masked pads, canvases of a narrower width
padded with masked positions, positions as in the engine (prompt from 0, canvas right after
the prompt), so the real tokens see exactly what the engine shows them (`--smoke` checks it
against `TransformersEngine`).

Determinism: requests come from `random.Random(seed)` per request seed
(`topology.demo_tasks.training_seeds`), noise from `noise_seed`, batches in a fixed order
(the worker pool's results are consumed in submission order), the weights from
`torch.manual_seed(spec.seed)`. On the CPU a run is bit-for-bit repeatable. On CUDA
`torch.use_deterministic_algorithms(True, warn_only=True)` with a fixed cuBLAS workspace
makes the matmuls and `index_add_` deterministic; the attention backward (memory-efficient
SDPA) has no deterministic kernel and only warns, so two GPU runs may differ in the last
bits. `--steps auto` picks the step count from the speed measured over steps 20-70 (before
the warmup ends, so it changes nothing before it is chosen); the log records it, and
`--steps N` replays that schedule.

Training-only questions (`--category-share`, `--name-share`, `--mention-share`; see their
functions below) can be added to a share of the training requests; they give the choice
questions' word -> category -> option chain direct signals, are logged as kinds of their own,
and never reach the held-out check.

The pointer loss (`--point-weight`, `--point-layer`) is an auxiliary term added to that
cross-entropy: at each choice (and mention) slot, -log of the attention weight that the best
head of one decoder layer puts on the true option's NAME in the prompt. It teaches the
lookup "the letter of the option whose name is the category", which the cross-entropy alone
did not find in thousands of steps (docs/benchmarks.md, rounds 9-12). The model and the
read are unchanged: the loss only shapes training.

Weights are saved in fp16 (7.3 MB; fp32 would be 14.5) and the held-out check runs on the
saved file. Needs torch, transformers, tokenizers, numpy and pydantic (the engine reads the
contract's question model; no `Classifier`: the held-out check here drives
`TransformersEngine` directly).

    python -m bench.train_demo_model --smoke                      # 20 CPU steps, < 1 min
    python -m bench.train_demo_model --device cuda --steps auto --budget-s 200 --out DIR
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from topology import demo_tasks
from workers.engine.template import (
    ChatFormat,
    LayoutCache,
    labels_and_answers,
    make_read,
    noise_seed,
    system_text,
    user_text,
)
from workers.engine.types import Read

# The held-out kinds, then the training-only questions' own (logged apart so that their
# learning can be watched; the held-out check never sees them).
KINDS = (*demo_tasks.KINDS, "category", "name", "mention")

# ------------------------------------------------------------------ training-only questions

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


# --------------------------------------------------------------------------- reads


def request_reads(
    chat: ChatFormat, layouts: LayoutCache, ex: demo_tasks.Example, seed: int
) -> list[tuple[Read, list[int], list[str]]]:
    """The reads the engine makes for `ex` (its `Classifier`, one sample, stage 0 only: the
    demo questions have no dependencies), with each slot's target token id and kind.

    `seed` plays the part of the classifier's base seed: the noise seed is
    `noise_seed(seed, request id, chunk question ids, 0)` as in `Classifier._run`."""
    questions = demo_tasks.questions_of(ex.request)
    spec = [(qid, labels_and_answers(q)[0]) for qid, q in questions.items()]
    out = []
    for layout in layouts.chunks(spec):
        qs = {qid: questions[qid] for qid in layout.qids}
        read = make_read(
            chat,
            layout,
            system_text(qs),
            user_text(ex.request["state"], {}),
            seed=noise_seed(seed, ex.request["id"], layout.qids, 0),
            tag=ex.request["id"],
        )
        targets, kinds, slots = [], [], []
        for slot in layout.slots:
            _, answers = labels_and_answers(qs[slot.question_id])
            truth = ex.truth[slot.question_id]
            kind = _KIND_OF[ex.tasks[slot.question_id].task]
            if kind == "name":
                # The target is the name's token; the "labels" (for the logged accuracy)
                # are the names of the universe, in option order.
                slot = dataclasses.replace(
                    slot, label_ids=tuple(name_token(chat, a) for a in answers), labels=answers
                )
            targets.append(slot.label_ids[answers.index(truth)])
            kinds.append(kind)
            slots.append(slot)
        out.append((dataclasses.replace(read, slots=tuple(slots)), targets, kinds))
    return out


class PointerMarks(NamedTuple):
    """Token ids that find an option line in a prompt (`--point-weight`): a question block
    starts with `question` (the tokens of "Question" at a line start) and an option line
    reads `  <letter>: <name>`, so the name is two tokens after the letter."""

    question: tuple[int, ...]
    colon: int

    @classmethod
    def of(cls, chat: ChatFormat) -> PointerMarks:
        head = chat.encode("x\nQuestion")[2:]  # at a line start, as in `system_text`
        colon = chat.encode("  A:")[-1]
        return cls(tuple(head), colon)


def pointer_targets(
    marks: PointerMarks, read: Read, targets: list[int], kinds: list[str]
) -> list[int]:
    """For each slot of `read`: the prompt position of the option NAME whose letter is the
    slot's target (choice and mention slots), else -1. Questions appear in the system text in
    slot order, so slot i's options are in the i-th question block; -1 also when the line is
    not found exactly once there."""
    ids = list(read.prompt_ids)
    n = len(marks.question)
    heads = [i for i in range(len(ids) - n + 1) if tuple(ids[i : i + n]) == marks.question]
    out = []
    for i, (t, k) in enumerate(zip(targets, kinds, strict=True)):
        if k not in ("choice", "mention") or len(heads) != len(targets):
            out.append(-1)
            continue
        end = heads[i + 1] if i + 1 < len(heads) else len(ids)
        hits = [j for j in range(heads[i], end - 2) if ids[j] == t and ids[j + 1] == marks.colon]
        out.append(hits[0] + 2 if len(hits) == 1 else -1)
    return out


def collate(
    items: Sequence[tuple[Read, list[int], list[str]]],
    pad_id: int,
    marks: PointerMarks | None = None,
) -> dict[str, Any]:
    """Numpy arrays for one batch: prompts right-padded, canvases padded to the widest,
    masks, positions, and the slots' (row, canvas position, target id, kind, label ids, and
    with `marks` the prompt position the pointer should find, see `pointer_targets`)."""
    b = len(items)
    plen = np.array([len(r.prompt_ids) for r, _, _ in items], dtype=np.int64)
    cwid = np.array([len(r.canvas_ids) for r, _, _ in items], dtype=np.int64)
    length, width = int(plen.max()), int(cwid.max())
    ids = np.full((b, length), pad_id, dtype=np.int64)
    amask = np.zeros((b, length), dtype=np.int64)
    canvas = np.full((b, width), pad_id, dtype=np.int64)
    cmask = np.zeros((b, width), dtype=np.int64)
    rows, cols, targets, kinds, label_sets, points = [], [], [], [], [], []
    for i, (read, tgt, knd) in enumerate(items):
        points += pointer_targets(marks, read, tgt, knd) if marks else [-1] * len(tgt)
        ids[i, : plen[i]] = read.prompt_ids
        amask[i, : plen[i]] = 1
        canvas[i, : cwid[i]] = read.canvas_ids
        cmask[i, : cwid[i]] = 1
        for slot, t, k in zip(read.slots, tgt, knd, strict=True):
            rows.append(i)
            cols.append(slot.position)
            targets.append(t)
            kinds.append(KINDS.index(k))
            label_sets.append(slot.label_ids)
    k_max = max(len(s) for s in label_sets)
    labels = np.array([list(s) + [-1] * (k_max - len(s)) for s in label_sets], dtype=np.int64)
    return {
        "input_ids": ids,
        "attention_mask": amask,
        "position_ids": np.broadcast_to(np.arange(length), (b, length)).copy(),
        "decoder_input_ids": canvas,
        "decoder_attention_mask": np.concatenate([amask, cmask], axis=1),
        "decoder_position_ids": plen[:, None] + np.arange(width)[None, :],
        "rows": np.array(rows, dtype=np.int64),
        "cols": np.array(cols, dtype=np.int64),
        "targets": np.array(targets, dtype=np.int64),
        "kinds": np.array(kinds, dtype=np.int64),
        "label_ids": labels,
        "points": np.array(points, dtype=np.int64),
    }


# --------------------------------------------------------------------------- data workers

_W: dict[str, Any] = {}


def _init_worker(tokenizer_dir: str, max_width: int) -> None:
    # One thread per data process: the pool is the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from transformers import AutoTokenizer

    chat = ChatFormat(AutoTokenizer.from_pretrained(tokenizer_dir))
    _W["chat"] = chat
    _W["layouts"] = LayoutCache(chat.encode, chat.eot_id, max_width, size=4096)
    _W["marks"] = PointerMarks.of(chat)


CHOICE_TASKS = frozenset(("language", "topic"))
# With --keep-other 0.3 about 70% of the drawn requests are kept (42% of the family's
# requests hold no choice question); 8 draws per kept request leave a wide margin.
_DRAWS_PER_REQUEST = 8


def _kept(ex: demo_tasks.Example, s: int, keep_other: float) -> bool:
    """Every request with a choice question; the others with probability `keep_other`,
    decided by the request seed alone (deterministic)."""
    if keep_other >= 1.0 or any(t.task in CHOICE_TASKS for t in ex.tasks.values()):
        return True
    return random.Random(f"keep/{s}").random() < keep_other


class GroupJob(NamedTuple):
    """One unit of work for a data process (picklable for the spawn pool)."""

    seed: int  # training stream
    index: int  # group number in the stream
    size: int  # requests per batch
    group: int  # batches per group
    keep_other: float = 1.0  # --keep-other
    category_share: float = 0.0  # --category-share
    name_share: float = 0.0  # --name-share
    mention_share: float = 0.0  # --mention-share
    aux_only: bool = False  # --aux-only


# The training mix: GroupJob's fields after `group`, each a command-line flag of its own name.
MIX_FIELDS = GroupJob._fields[4:]


def mix_flags(mix: dict[str, Any]) -> str:
    """The command-line flags that give `mix` (for the log's replay line)."""
    flags = []
    for name, value in mix.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags.append(f"{flag} {value}")
    return " ".join(flags)


def make_group(job: GroupJob) -> list[dict[str, Any]]:
    """Group `index` of stream `seed`: `group * size` requests (training seeds only), their
    reads sorted by prompt length and cut into `group` batches of `size` requests' reads
    (less padding), in an order shuffled by the group's own seed. The mix (`MIX_FIELDS`):
    `keep_other` < 1 keeps only that share of the requests without a choice question; the
    `*_share` fields add training-only questions; `aux_only` keeps only those."""
    chat, layouts = _W["chat"], _W["layouts"]
    want = job.size * job.group
    sparse = job.keep_other < 1.0 or job.aux_only  # some drawn requests are left out
    draws = want * _DRAWS_PER_REQUEST if sparse else want
    per_request = []
    for s in demo_tasks.training_seeds(job.seed, draws, start=job.index * draws):
        ex = demo_tasks.example(s)
        if not _kept(ex, s, job.keep_other):
            continue
        if job.mention_share > 0:  # first: it changes the state the others read
            ex = with_mention_question(ex, s, job.mention_share)
        if job.category_share > 0:
            ex = with_category_question(ex, s, job.category_share)
        if job.name_share > 0:
            ex = with_name_question(ex, s, job.name_share)
        if job.aux_only:
            ex = _aux_questions_only(ex)
            if not ex.request["questions"]:
                continue
        # The noise seed's base differs per request (the request seed), so every read of
        # the stream gets fresh slot noise.
        per_request.append(request_reads(chat, layouts, ex, seed=s))
        if len(per_request) == want:
            break
    if len(per_request) < want:
        raise RuntimeError(f"group {job.index}: only {len(per_request)} of {want} kept")
    per_request.sort(key=lambda reads: max(len(r.prompt_ids) for r, _, _ in reads))
    batches = [
        collate(
            [item for reads in per_request[i : i + job.size] for item in reads],
            chat.pad_id,
            _W["marks"],
        )
        for i in range(0, len(per_request), job.size)
    ]
    random.Random(f"{job.seed}/{job.index}").shuffle(batches)
    return batches


class Batches:
    """Batches in order, built by a spawn pool a bounded number of groups ahead."""

    def __init__(self, tok_dir: Path, max_width: int, first: GroupJob, workers: int):
        self.first = first  # the stream's settings; each group gets its own `index`
        self.pool = None
        if workers > 0:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")  # safe next to CUDA
            self.pool = ctx.Pool(workers, _init_worker, (str(tok_dir), max_width))
        else:
            _init_worker(str(tok_dir), max_width)
        self.ahead: collections.deque[Any] = collections.deque()
        self.window = max(1, 2 * workers)
        self.next_index = 0
        self.ready: collections.deque[dict[str, Any]] = collections.deque()

    def _submit(self) -> None:
        job = self.first._replace(index=self.next_index)
        self.next_index += 1
        if self.pool is not None:
            self.ahead.append(self.pool.apply_async(make_group, (job,)))
        else:
            self.ahead.append(job)

    def get(self) -> dict[str, Any]:
        if not self.ready:
            while len(self.ahead) < self.window:
                self._submit()
            head = self.ahead.popleft()
            self.ready.extend(make_group(head) if self.pool is None else head.get())
        return self.ready.popleft()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


# --------------------------------------------------------------------------- model


def to_tensors(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in batch.items()}


def forward_slots(model: Any, t: dict[str, Any]) -> Any:
    """Full-vocabulary logits (softcapped, fp32) at every slot of the batch: (slots, V)."""
    out = model(
        input_ids=t["input_ids"],
        attention_mask=t["attention_mask"],
        position_ids=t["position_ids"],
        decoder_input_ids=t["decoder_input_ids"],
        decoder_attention_mask=t["decoder_attention_mask"],
        decoder_position_ids=t["decoder_position_ids"],
    )
    return out.logits[t["rows"], t["cols"]]


def label_hits(logits: Any, t: dict[str, Any]) -> Any:
    """Whether the argmax over each slot's labels is the target (the engine's decision)."""
    import torch

    ids = t["label_ids"]
    lab = logits.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, -torch.inf)
    return ids.gather(1, lab.argmax(1, keepdim=True))[:, 0] == t["targets"]


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


# --------------------------------------------------------------------------- held-out check


def engine_check(
    model_dir: Path, device: str, count: int, split: int, batch: int = 256
) -> tuple[demo_tasks.CheckReport, dict[str, Any]]:
    """Held-out split `split` through `TransformersEngine` (the engine, without the
    classifier's pydantic front): per-kind accuracy and ECE of the saved model."""
    from transformers import AutoTokenizer

    from workers.engine.hf_backend import TransformersEngine

    # No prefix reuse: every demo request has its own system text, so batching the whole
    # prompts is faster here; the engine's results are the same either way.
    engine = TransformersEngine.from_pretrained(
        model_dir, device=device, max_batch_reads=batch, reuse_prefix=False
    )
    chat = ChatFormat(AutoTokenizer.from_pretrained(str(model_dir)))
    layouts = LayoutCache(chat.encode, chat.eot_id, engine.info.canvas_length)
    examples = demo_tasks.held_out_examples(split, count)
    reads, owners = [], []
    for ex in examples:
        for read, _, _ in request_reads(chat, layouts, ex, seed=0):
            reads.append(read)
            owners.append(ex)
    t0 = time.perf_counter()
    results = engine.read_sync(reads)
    seconds = time.perf_counter() - t0
    scored, masses = [], []
    for ex, read, res in zip(owners, reads, results, strict=True):
        questions = demo_tasks.questions_of(ex.request)
        for slot, sr in zip(read.slots, res.slots, strict=True):
            _, answers = labels_and_answers(questions[slot.question_id])
            top = int(np.argmax(sr.probs))
            task = ex.tasks[slot.question_id].task
            scored.append(
                demo_tasks.ScoredRead(
                    demo_tasks.KIND_OF[task],
                    task,
                    answers[top] == ex.truth[slot.question_id],
                    float(sr.probs[top]),
                )
            )
            if sr.label_mass is not None:
                masses.append(sr.label_mass)
    report = demo_tasks.check(scored)
    extra = {
        "reads": len(reads),
        "questions": len(scored),
        "seconds": round(seconds, 2),
        "engine": f"TransformersEngine on {engine.info.device}, {engine.dtype}",
        "mean_label_mass": round(float(np.mean(masses)), 4) if masses else None,
    }
    return report, extra


def held_out_batch(
    chat: ChatFormat, layouts: LayoutCache, split: int, count: int
) -> tuple[list[tuple[Read, list[int], list[str]]], dict[str, Any]]:
    """The reads of `count` held-out requests of `split` (noise seed base 0) and their
    batch as CPU tensors."""
    items = []
    for ex in demo_tasks.held_out_examples(split, count):
        items.extend(request_reads(chat, layouts, ex, seed=0))
    return items, to_tensors(collate(items, chat.pad_id), "cpu")


def parity_check(model: Any, chat: ChatFormat, model_dir: Path, n: int = 6) -> float:
    """Max |p_train - p_engine| over the label distributions of `n` held-out requests:
    the training forward (batched, padded) against `TransformersEngine` on the saved file."""
    import torch

    from workers.engine.hf_backend import TransformersEngine

    layouts = LayoutCache(chat.encode, chat.eot_id, model.config.canvas_length)
    items, t = held_out_batch(chat, layouts, split=7, count=n)
    ref = DemoModel.load(model_dir)
    with torch.inference_mode():
        logits = forward_slots(ref, t)
    engine = TransformersEngine(ref, model_name="parity")
    res = engine.read_sync([r for r, _, _ in items])
    worst, k = 0.0, 0
    for r in res:
        for sr in r.slots:
            ids = t["label_ids"][k]
            lab = logits[k, ids[ids >= 0]]
            p = torch.softmax(lab.double(), 0).numpy()
            worst = max(worst, float(np.abs(p - sr.probs).max()))
            k += 1
    return worst


def capture_pointer(model: Any, layer: int) -> tuple[dict[str, Any], Any]:
    """Make decoder layer `layer` return its attention weights (eager attention; every other
    attention keeps SDPA) and keep them, differentiable, in the returned dict under "w"
    (batch x heads x canvas x keys) after each forward. The second value undoes it all."""
    import copy

    target = model.model.decoder.layers[layer].self_attn
    shared = target.config
    # Masks are built once per forward from the shared config; the eager form (additive
    # floats) is one SDPA also takes, the SDPA form (booleans) is not one eager takes.
    model.set_attn_implementation("eager")
    for name, module in model.named_modules():
        if name.endswith("self_attn") and "vision" not in name and module is not target:
            module.config = copy.copy(shared)
            module.config._attn_implementation = "sdpa"
    seen: dict[str, Any] = {}
    hook = target.register_forward_hook(lambda mod, args, out: seen.__setitem__("w", out[1]))

    def undo() -> None:
        hook.remove()
        for name, module in model.named_modules():
            if name.endswith("self_attn") and "vision" not in name:
                module.config = shared
        model.set_attn_implementation("sdpa")

    return seen, undo


def pointer_loss(weights: Any, t: dict[str, Any]) -> tuple[Any, Any]:
    """(-mean log of the best head's attention weight on the right option's name, the mean
    of that weight) over the slots that have a pointer target (`t["points"]`)."""
    sel = (t["points"] >= 0).float()
    w = weights[t["rows"], :, t["cols"], t["points"].clamp(min=0)]  # slots x heads
    best = w.float().max(1).values
    n = sel.sum().clamp(min=1)
    return -(best.clamp_min(1e-6).log() * sel).sum() / n, (best * sel).sum() / n


def dense_experts_forward(
    self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any
) -> Any:
    """The MoE block with every expert run on every token, weighted by the router (zero
    where an expert was not chosen): the same sum as transformers' eager loop, without its
    per-expert gathers, `index_add_` and their backward (most of the step's small kernels:
    docs/data/train_step_profile.txt). 4 experts of width 48 cost little to run densely."""
    import torch

    weights = torch.zeros(
        hidden_states.shape[0],
        self.num_experts,
        dtype=top_k_weights.dtype,
        device=hidden_states.device,
    ).scatter(1, top_k_index, top_k_weights)
    gate, up = torch.einsum("th,eih->eti", hidden_states, self.gate_up_proj).chunk(2, dim=-1)
    out = torch.einsum("eti,ehi->eth", self.act_fn(gate) * up, self.down_proj)
    return (out * weights.t().unsqueeze(-1).to(out.dtype)).sum(0).to(hidden_states.dtype)


def use_experts(model: Any, name: str) -> None:
    """`eager` (transformers' loop) or `dense` (`dense_experts_forward`) for training."""
    if name == "dense":
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        ALL_EXPERTS_FUNCTIONS.register("dense", dense_experts_forward)
    model.set_experts_implementation(name)


def scale_qk_norms(model: Any, factor: float) -> None:
    """Multiply the text layers' `q_norm`/`k_norm` weights by `factor`.

    Gemma 4 attention (hence DiffusionGemma's) RMS-normalizes queries and keys and then uses
    `scaling = 1.0`, so an attention logit is `head_dim * g_q * g_k * cos(q, k)`. With the
    norms' weights at their default 1.0 and head_dim 64 the logits of a fresh model have a
    standard deviation of about 8: every head attends almost one-hot to an arbitrary
    position (mean attention entropy 0.7 nats over ~300 keys, measured on the demo spec), the
    softmax is saturated and attention patterns barely learn. That is why runs 1-5 never
    learned the lookups (a question id to its question, an option to its letter).
    `head_dim ** -0.25` (0.354) on both weights gives logits of standard deviation ~1, the
    usual 1/sqrt(d) regime, and the weights stay trainable; trained checkpoints settle near
    it by themselves (0.345 on average in the committed one: `bench.attention_entropy`)."""
    import torch

    with torch.no_grad():
        for weight in text_qk_norm_weights(model):
            weight.mul_(factor)


def text_qk_norm_weights(model: Any) -> list[Any]:
    """The text layers' `q_norm`/`k_norm` weights, each parameter once: the encoder's and
    the decoder's layers are distinct modules holding the SAME parameters (tied weights)."""
    seen: dict[int, Any] = {}
    for name, module in model.named_modules():
        if name.endswith(("q_norm", "k_norm")) and "vision" not in name:
            seen.setdefault(id(module.weight), module.weight)
    return list(seen.values())


class DemoModel:
    @staticmethod
    def load(path: Path) -> Any:
        import torch
        from transformers import DiffusionGemmaForBlockDiffusion

        return DiffusionGemmaForBlockDiffusion.from_pretrained(
            str(path), dtype=torch.float32
        ).eval()


# --------------------------------------------------------------------------- training


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

    from workers.engine.models import SPECS, tiny_config, write_generation_config
    from workers.engine.tokenizer import save_pretrained_tokenizer

    t_start = time.perf_counter()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # Deterministic kernels on the CPU; on CUDA they made the step several times slower
    # (index_add_/scatter in the MoE), and the committed weights are the artifact anyway.
    torch.use_deterministic_algorithms(not cuda or args.deterministic, warn_only=True)
    if args.threads:
        torch.set_num_threads(args.threads)

    spec = SPECS["demo"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The tokenizer the model is trained with is the one saved next to it (the same path
    # `ensure_tiny_model` uses).
    save_pretrained_tokenizer(out)
    chat = ChatFormat(AutoTokenizer.from_pretrained(str(out)))

    torch.manual_seed(spec.seed)
    config = tiny_config(spec)
    model = DiffusionGemmaForBlockDiffusion(config)
    if args.init:
        # Continue from saved weights (fp16 on disk -> fp32 master weights here).
        init = DiffusionGemmaForBlockDiffusion.from_pretrained(args.init, dtype=torch.float32)
        model.load_state_dict(init.state_dict())
        print(f"continuing from {args.init}", flush=True)
    if args.qk_norm_scale is None:
        # A fresh model gets logits of unit spread (see scale_qk_norms); saved weights
        # already carry their learned scale.
        args.qk_norm_scale = 1.0 if args.init else round(spec.head_dim**-0.25, 4)
    if args.qk_norm_scale != 1.0:
        scale_qk_norms(model, args.qk_norm_scale)
        print(f"q_norm/k_norm weights scaled by {args.qk_norm_scale}", flush=True)
    model = model.to(device)
    # The experts: `grouped_mm` (the default) wants bf16 weights on CUDA, and the master
    # weights here are fp32 under bf16 autocast; `dense` computes the same sum with fewer
    # kernels. The saved config keeps the default.
    use_experts(model, args.experts)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay}],
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        fused=cuda,
    )
    auto_steps = args.steps == "auto"
    total = args.max_steps if auto_steps else int(args.steps)
    warmup = min(args.warmup, max(1, total // 10)) if not auto_steps else args.warmup
    mix = {name: getattr(args, name) for name in MIX_FIELDS}
    batches = Batches(
        out, spec.canvas_length, GroupJob(args.seed, 0, args.batch, args.group, **mix), args.workers
    )
    print(
        f"demo model: {n_params / 1e6:.2f} M parameters on {device}; batch {args.batch} "
        f"requests; steps {args.steps}; workers {args.workers}",
        flush=True,
    )
    pointer: dict[str, Any] | None = None
    if args.point_weight > 0:
        pointer, undo_pointer = capture_pointer(model, args.point_layer)
    log: dict[str, Any] = {"loss": [], "slot_accuracy": [], "pointer_weight": []}
    window_point: list[Any] = []
    t_train = time.perf_counter()
    t_calib = t_train
    window_loss, window_hits = [], collections.defaultdict(list)
    step = 0
    stopped_early = False
    data_wait = 0.0
    while step < total:
        t_wait = time.perf_counter()
        batch = batches.get()
        data_wait += time.perf_counter() - t_wait
        t = to_tensors(batch, device)
        lr = lr_at(step, total, args.lr, warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = forward_slots(model, t)
        loss = torch.nn.functional.cross_entropy(logits.float(), t["targets"])
        total_loss = loss
        if pointer is not None:
            p_loss, p_weight = pointer_loss(pointer.pop("w"), t)
            total_loss = loss + args.point_weight * p_loss
            window_point.append(p_weight.detach())
        opt.zero_grad(set_to_none=True)
        total_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        window_loss.append(loss.detach())
        hits = label_hits(logits.detach(), t)
        for k in range(len(KINDS)):
            sel = t["kinds"] == k  # no boolean indexing: it would sync with the GPU
            window_hits[k].append(torch.stack([(hits & sel).sum(), sel.sum()]))
        if auto_steps and step == 20:
            if cuda:
                torch.cuda.synchronize()
            t_calib = time.perf_counter()
        if auto_steps and step == 70:
            if cuda:
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - t_calib) / 50
            left = args.budget_s - (time.perf_counter() - t_train)
            total = max(args.warmup + 100, min(args.max_steps, 70 + int(left / per_step)))
            total = total // 50 * 50
            print(f"--steps auto: {per_step * 1e3:.1f} ms/step -> {total} steps", flush=True)
        if step % args.log_every == 0 or step == total:
            mean_loss = float(torch.stack(window_loss).mean())
            acc = {}
            for k, kind in enumerate(KINDS):
                h = torch.stack(window_hits[k]).sum(0)
                acc[kind] = round(float(h[0]) / max(1, float(h[1])), 4)
            elapsed = time.perf_counter() - t_train
            log["loss"].append([step, round(mean_loss, 5)])
            log["slot_accuracy"].append([step, acc])
            point = ""
            if window_point:
                mean_point = round(float(torch.stack(window_point).mean()), 4)
                log["pointer_weight"].append([step, mean_point])
                point = f" pointer {mean_point:.3f}"
            print(
                f"step {step:5d}/{total} loss {mean_loss:.4f} acc {acc}{point} lr {lr:.2e} "
                f"{elapsed:6.1f}s (waiting for data {data_wait:.1f}s)",
                flush=True,
            )
            window_loss, window_hits, window_point = [], collections.defaultdict(list), []
        if args.time_limit_s and time.perf_counter() - t_train > args.time_limit_s:
            print(f"time limit {args.time_limit_s}s reached at step {step}", flush=True)
            stopped_early = True
            break
    batches.close()
    if pointer is not None:
        undo_pointer()
    if cuda:
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - t_train

    # Save in fp16 (the size budget; 3 more mantissa bits than bf16), with the tokenizer
    # already there; bf16 only if a weight left fp16's range.
    model.eval()
    model.to("cpu")
    biggest = max(float(p.detach().abs().max()) for p in model.parameters())
    save_dtype = torch.float16 if biggest < 6e4 else torch.bfloat16
    model.to(save_dtype).save_pretrained(str(out))
    write_generation_config(out, model.config)  # vLLM needs real values, not nulls
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    log.update(
        {
            "spec": dataclasses.asdict(spec),
            "parameters": n_params,
            "device": device,
            "torch": torch.__version__,
            "steps": step,
            "steps_arg": args.steps,
            "stopped_early": stopped_early,
            "batch_requests": args.batch,
            "lr": args.lr,
            "warmup": warmup,
            "weight_decay": args.weight_decay,
            "seed": args.seed,
            "train_seconds": round(train_seconds, 1),
            "weights_dtype": str(save_dtype).removeprefix("torch."),
            "largest_weight": round(biggest, 3),
            "safetensors_mb": round(size_mb, 3),
            "experts": args.experts,
            "qk_norm_scale": args.qk_norm_scale,
            "point_layer": args.point_layer,
            "point_weight": args.point_weight,
            **mix,
            "replay": f"--steps {step} --batch {args.batch} --group {args.group} "
            f"--lr {args.lr} --warmup {warmup} --seed {args.seed} --experts {args.experts}"
            + f" --qk-norm-scale {args.qk_norm_scale} {mix_flags(mix)}"
            + (
                f" --point-layer {args.point_layer} --point-weight {args.point_weight}"
                if args.point_weight > 0
                else ""
            )
            + (f" --init {args.init}" if args.init else ""),
        }
    )
    print(f"saved {out} ({size_mb:.2f} MB, {step} steps in {train_seconds:.1f}s)", flush=True)

    if args.smoke:
        worst = parity_check(model.float(), chat, out)
        log["parity_max_abs_diff"] = worst
        print(f"parity, training forward vs TransformersEngine: max |dp| = {worst:.2e}")
        if worst > 1e-4:
            raise SystemExit("the training forward does not match the engine")

    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    if args.eval_count:
        # The engine as it runs on this device: bf16 on CUDA (its default), fp32 on the CPU.
        try:
            report, extra = engine_check(out, device, args.eval_count, split=0)
        except Exception as exc:  # the weights are saved; fall back to the CPU
            print(f"engine check on {device} failed ({exc!r}); retrying on the CPU", flush=True)
            report, extra = engine_check(out, "cpu", args.eval_count, split=0)
        log["held_out"] = {
            "split": 0,
            "requests": args.eval_count,
            "accuracy": report.accuracy,
            "task_accuracy": report.task_accuracy,
            "counts": report.counts,
            "ece": round(report.ece, 5),
            "passed": report.passed,
            **extra,
        }
        print(f"held-out (engine, {args.eval_count} requests): {report.summary()}")
        print(f"  per task: { {k: round(v, 4) for k, v in report.task_accuracy.items()} }")
    log["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"wall {log['wall_seconds']}s", flush=True)
    return log


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--steps", default="3000", help='a number, or "auto" (see --budget-s)')
    p.add_argument("--max-steps", type=int, default=20000, help="cap for --steps auto")
    p.add_argument("--budget-s", type=float, default=200.0, help="training time for auto")
    p.add_argument("--time-limit-s", type=float, default=0.0, help="hard stop (0 = none)")
    p.add_argument("--batch", type=int, default=256, help="requests per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="training stream")
    p.add_argument("--group", type=int, default=4, help="batches bucketed by prompt length")
    p.add_argument("--workers", type=int, default=-1, help="data processes (-1: cores - 2)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--eval-count", type=int, default=2000, help="held-out requests at the end")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--out", default="build/demo-model")
    p.add_argument("--smoke", action="store_true", help="20 CPU steps, parity + tiny eval")
    p.add_argument("--init", default="", help="continue from a saved model directory")
    p.add_argument(
        "--experts",
        choices=("eager", "dense"),
        default="dense",
        help="MoE implementation while training (the same sums; dense has fewer kernels)",
    )
    p.add_argument(
        "--qk-norm-scale",
        type=float,
        default=None,
        help="multiply the q_norm/k_norm weights after init or --init (default: "
        "head_dim ** -0.25 for a fresh model, 1.0 with --init; see scale_qk_norms)",
    )
    p.add_argument(
        "--keep-other",
        type=float,
        default=1.0,
        help="share of the requests WITHOUT a choice question kept in training (1.0: the "
        "family as it comes; 0.3: about 4 in 5 training requests hold a choice question)",
    )
    p.add_argument(
        "--category-share",
        type=float,
        default=0.0,
        help="share of the training requests (with fewer than 4 questions) that get one more "
        "yes/no question naming a topic or language (see with_category_question)",
    )
    p.add_argument(
        "--name-share",
        type=float,
        default=0.0,
        help="share of the training requests (with fewer than 4 questions) that get one more "
        "question whose answer is the NAME of their topic or language (see with_name_question)",
    )
    p.add_argument(
        "--mention-share",
        type=float,
        default=0.0,
        help="share of the training requests (with fewer than 4 questions) whose state gets a "
        "category name and a choice question asking which (see with_mention_question)",
    )
    p.add_argument(
        "--aux-only",
        action="store_true",
        help="train on the training-only questions alone (a diagnostic: can the model learn "
        "them by themselves?)",
    )
    p.add_argument(
        "--point-weight",
        type=float,
        default=0.0,
        help="weight of an auxiliary loss that teaches the choice pointer: at each choice "
        "and mention slot, -log of the attention weight that the best head of decoder layer "
        "--point-layer puts on the right option's name (see pointer_loss; 0: off)",
    )
    # 3: the layer whose head already pointed at "english" before the loss existed; from
    # there choice reached 0.95 in 200 steps, from layer 5 in 400 (round 9, docs/benchmarks.md).
    p.add_argument("--point-layer", type=int, default=3, help="decoder layer for --point-weight")
    p.add_argument(
        "--deterministic", action="store_true", help="deterministic kernels on CUDA too (slow)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.steps, args.batch, args.log_every = "cpu", "20", 4, 5
        args.group = 1
        args.eval_count = min(args.eval_count, 16)
        args.warmup = 5
        if args.workers < 0:
            args.workers = 0
    if args.workers < 0:
        args.workers = max(1, min(14, (os.cpu_count() or 4) - 2))
    if args.steps != "auto" and not args.steps.isdigit():
        p.error('--steps takes a number or "auto"')
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

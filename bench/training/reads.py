"""Each training example as the engine reads it: its reads, each slot's target, the
pointer marks, and batches collated for one forward."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from bench.training.questions import _KIND_OF, KINDS, name_token
from dgstream.topology import demo_tasks
from dgstream.workers.engine.template import (
    ChatFormat,
    LayoutCache,
    labels_and_answers,
    make_read,
    noise_seed,
    system_text,
    user_text,
)
from dgstream.workers.engine.types import Read, ReadImage
from dgstream.workers.engine.vision import VisionInput


def request_reads(
    chat: ChatFormat, layouts: LayoutCache, ex: demo_tasks.Example, seed: int
) -> list[tuple[Read, list[int], list[str]]]:
    """The reads the engine makes for `ex` (its `Classifier`, one sample, stage 0 only: the
    demo questions have no dependencies), with each slot's target token id and kind.

    `seed` plays the part of the classifier's base seed: the noise seed is
    `noise_seed(seed, request id, chunk question ids, 0)` as in `Classifier._run`."""
    questions = demo_tasks.questions_of(ex.request)
    images = request_images(ex.request)
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
        if images:  # as the classifier hands them on: every read of the request
            read = dataclasses.replace(read, images=images)
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


def request_images(request: dict[str, Any]) -> tuple[ReadImage, ...]:
    """The request's images (data URLs in `images`) decoded as the worker's gate decodes
    them (`workers.images.decode`: format check, RGB, transparency over white), so that
    training sees the pixels the engine is handed."""
    from dgstream.workers.images.decode import decode_image
    from dgstream.workers.images.settings import ImageSettings

    max_pixels = ImageSettings().max_pixels
    out = []
    for url in request.get("images") or ():
        decoded = decode_image(_inline_bytes(url), max_pixels, keep=True)
        out.append(ReadImage(decoded.sha256, decoded.image))
    return tuple(out)


def _inline_bytes(url: str) -> bytes:
    from dgstream.schemas.images import check_reference

    ref = check_reference(url, "images")
    if ref.source != "inline":
        raise ValueError("training reads inline images only (data URLs)")
    return ref.data()


def demo_vision() -> VisionInput:
    """The demo model's image layout (`VisionInput.for_model` without a model: the data
    workers build batches without one)."""
    from dgstream.workers.engine.models import SPECS, tiny_config

    config = tiny_config(SPECS["demo"])
    vision = config.vision_config
    return VisionInput(
        patch=int(vision.patch_size),
        pooling=int(getattr(vision, "pooling_kernel_size", 1) or 1),
        boi_id=int(config.boi_token_id),
        eoi_id=int(config.eoi_token_id),
        image_id=int(config.image_token_id),
    )


def lay_images(read: Read, vision: VisionInput) -> tuple[Read, list[int]]:
    """`read` with its images' blocks laid into its prompt as the transformers engine lays
    them (at the shared prefix's end), and the positions of its image tokens there."""
    if not read.images:
        return read, []
    at, n = read.shared_prefix_len, len(read.images)
    laid = dataclasses.replace(read, prompt_ids=vision.expand(read.prompt_ids, at, n))
    return laid, vision.image_positions(at, n)


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
        if k not in ("choice", "mention", "image_choice") or len(heads) != len(targets):
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
    vision: VisionInput | None = None,
) -> dict[str, Any]:
    """Numpy arrays for one batch: prompts right-padded, canvases padded to the widest,
    masks, positions, and the slots' (row, canvas position, target id, kind, label ids, and
    with `marks` the prompt position the pointer should find, see `pointer_targets`).

    Reads with images (`vision` given) have their blocks laid in the prompt (`lay_images`)
    and add the tower's input: `pixel_values` and `pixel_positions` (one row per image, in
    read order) and `image_rows`/`image_cols`, where each image token sits. A batch without
    images has none of these keys: a text-only batch is what it always was."""
    image_at: list[list[int]] = [[] for _ in items]
    if any(r.images for r, _, _ in items):
        if vision is None:
            raise ValueError("a batch with images needs the model's VisionInput")
        laid = [(lay_images(r, vision), t, k) for r, t, k in items]
        image_at = [at for (_, at), _, _ in laid]
        items = [(r, t, k) for (r, _), t, k in laid]
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
    extra: dict[str, Any] = {}
    if any(image_at):
        assert vision is not None
        images = [im for r, _, _ in items for im in r.images]
        pixels, positions = vision.pixels(images)
        extra = {
            "pixel_values": pixels,
            "pixel_positions": positions,
            "image_rows": np.array(
                [i for i, at in enumerate(image_at) for _ in at], dtype=np.int64
            ),
            "image_cols": np.array([c for at in image_at for c in at], dtype=np.int64),
        }
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
        **extra,
    }

"""The held-out check of a trained model through `TransformersEngine`, and the parity of
the training forward with the engine's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.training.model import DemoModel, forward_slots, to_tensors
from bench.training.reads import collate, demo_vision, request_reads
from dgstream.topology import demo_tasks
from dgstream.workers.engine.template import ChatFormat, LayoutCache, labels_and_answers
from dgstream.workers.engine.types import Read


def engine_check(
    model_dir: Path, device: str, count: int, split: int, batch: int = 256, images: bool = False
) -> tuple[demo_tasks.CheckReport, dict[str, Any]]:
    """Held-out split `split` through `TransformersEngine` (the engine, without the
    classifier's pydantic front): per-kind accuracy and ECE of the saved model. With
    `images`: the image family's split, checked on its image questions alone."""
    from transformers import AutoTokenizer

    from dgstream.workers.engine.hf_backend import TransformersEngine

    # No prefix reuse: every demo request has its own system text, so batching the whole
    # prompts is faster here; the engine's results are the same either way.
    engine = TransformersEngine.from_pretrained(
        model_dir, device=device, max_batch_reads=batch, reuse_prefix=False
    )
    chat = ChatFormat(AutoTokenizer.from_pretrained(str(model_dir)))
    layouts = LayoutCache(chat.encode, engine.info.canvas_length)
    examples = (
        demo_tasks.held_out_image_examples(split, count)
        if images
        else demo_tasks.held_out_examples(split, count)
    )
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
                    {**demo_tasks.KIND_OF, **demo_tasks.IMAGE_KIND_OF}[task],
                    task,
                    answers[top] == ex.truth[slot.question_id],
                    float(sr.probs[top]),
                )
            )
            if sr.label_mass is not None:
                masses.append(sr.label_mass)
    if images:
        scored = [r for r in scored if r.task in demo_tasks.IMAGE_KIND_OF]
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
    chat: ChatFormat, layouts: LayoutCache, split: int, count: int, images: bool = False
) -> tuple[list[tuple[Read, list[int], list[str]]], dict[str, Any]]:
    """The reads of `count` held-out requests of `split` (noise seed base 0) and their
    batch as CPU tensors; with `images`, the image family's requests of those seeds."""
    items = []
    examples: list[demo_tasks.Example] = (
        [demo_tasks.image_example(s) for s in demo_tasks.held_out_seeds(split, count)]
        if images
        else demo_tasks.held_out_examples(split, count)
    )
    for ex in examples:
        items.extend(request_reads(chat, layouts, ex, seed=0))
    vision = demo_vision() if images else None
    return items, to_tensors(collate(items, chat.pad_id, vision=vision), "cpu")


def parity_check(
    model: Any, chat: ChatFormat, model_dir: Path, n: int = 6, images: bool = False
) -> float:
    """Max |p_train - p_engine| over the label distributions of `n` held-out requests:
    the training forward (batched, padded) against `TransformersEngine` on the saved file;
    with `images`, image requests (the tower's soft tokens in both)."""
    import torch

    from dgstream.workers.engine.hf_backend import TransformersEngine

    layouts = LayoutCache(chat.encode, model.config.canvas_length)
    items, t = held_out_batch(chat, layouts, split=7, count=n, images=images)
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

"""The transformers engine reads images in its one step, on the committed demo model and its
vision tower (CPU, fp32): an image moves the read, the read is the model's own forward with
the same pixel values, batching does not change it, text-only prompts are the template's
byte for byte."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import TypeAdapter

from dgstream.schemas import Question
from dgstream.workers.engine.hf_backend import TransformersEngine
from dgstream.workers.engine.template import (
    ChatFormat,
    LayoutCache,
    labels_and_answers,
    make_read,
    system_text,
    user_text,
)
from dgstream.workers.engine.types import Read, ReadImage
from dgstream.workers.engine.vision import IMAGE_GRID, image_patches

pytestmark = pytest.mark.model

# fp32 on the CPU, as tests/workers/engine/test_hf_engine.py's text reads: a batch changes
# only the summation order of the matmuls (wider batches, left padding masked out; the
# tower's batch has no padding), an error of a few ulps of the logits (~1e-7 relative),
# far below 1e-5 on probabilities, and far below what an image changes (`_differ`).
BATCH_TOLERANCE = 1e-5
# The demo tower's weights are untrained: an image moves the label logits by a little but
# far more than float error. Compared in log-probability, which a saturated answer
# (p = 0.9999) does not squash.
MOVES = 1e-3
BLOCK = IMAGE_GRID**2 + 2  # <boi>, the soft tokens, <eoi>

QUESTIONS = {
    "toxic": {"type": "yes_no", "instructions": "Is the message toxic?"},
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
}
OTHER = {"caps": {"type": "yes_no", "instructions": "Is it shouting in capitals?"}}


def image(kind: str, size: tuple[int, int] = (48, 36)) -> ReadImage:
    """A small deterministic RGB image of a few kinds, named by the hash of its pixels."""
    if kind == "noise":
        rng = np.random.default_rng(7)
        im = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    elif kind == "gradient":
        ramp = np.linspace(0, 255, size[0], dtype=np.float32)
        rgb = np.stack([np.tile(ramp, (size[1], 1))] * 3, axis=-1).astype(np.uint8)
        rgb[..., 2] = 255 - rgb[..., 2]
        im = Image.fromarray(rgb)
    else:
        im = Image.new("RGB", size, kind)
    return ReadImage(hashlib.sha256(im.tobytes() + repr(size).encode()).hexdigest(), im)


def read(
    chat: ChatFormat,
    engine: TransformersEngine,
    state: str,
    *images: ReadImage,
    questions: dict[str, Any] = QUESTIONS,
    seed: int = 1,
) -> Read:
    qs = {k: TypeAdapter(Question).validate_python(v) for k, v in questions.items()}
    layouts = LayoutCache(chat.encode, engine.info.canvas_length)
    layout = layouts.get([(k, labels_and_answers(q)[0]) for k, q in qs.items()])
    r = make_read(chat, layout, system_text(qs), user_text(state, {}), seed=seed)
    return dataclasses.replace(r, images=images)


def log_probs(result: Any) -> np.ndarray:
    return np.concatenate([np.log(s.probs) for s in result.slots])


def _differ(a: Any, b: Any) -> float:
    return float(np.abs(log_probs(a) - log_probs(b)).max())


def reference(engine: TransformersEngine, r: Read) -> list[np.ndarray]:
    """The model's own forward over the whole prompt with the engine's pixel values: its
    image features put in by its own placeholder mask, no cache, no batch."""
    assert engine._vision is not None
    ids = engine.prompt_ids(r)
    with torch.inference_mode():
        kwargs: dict[str, Any] = {}
        if r.images:
            pixels, positions = engine._vision.pixels(r.images)
            kwargs = {
                "pixel_values": torch.from_numpy(pixels),
                "image_position_ids": torch.from_numpy(positions),
            }
        logits = engine.model(
            input_ids=torch.tensor([list(ids)]),
            decoder_input_ids=torch.tensor([list(r.canvas_ids)]),
            **kwargs,
        ).logits[0]
    return [
        torch.softmax(logits[s.position].double()[list(s.label_ids)], 0).numpy() for s in r.slots
    ]


def test_the_demo_engine_reads_images(demo_engine: TransformersEngine) -> None:
    assert demo_engine.info.reads_images
    assert demo_engine._vision is not None and demo_engine._vision.tokens_per_image == IMAGE_GRID**2


def test_text_only_prompts_are_the_templates_byte_for_byte(
    demo_engine: TransformersEngine, demo_chat: ChatFormat
) -> None:
    states = ["hello there", "FREE MONEY NOW!!! click https://win.example/prize", "a nice Day"]
    for state in states:
        plain = read(demo_chat, demo_engine, state)
        qs = {k: TypeAdapter(Question).validate_python(v) for k, v in QUESTIONS.items()}
        want, shared = demo_chat.prompt_ids(system_text(qs), user_text(state, {}))
        assert plain.prompt_ids == want and plain.shared_prefix_len == shared
        assert demo_engine.prompt_ids(plain) == want  # what the encoder reads: nothing added
        # With images: the same tokens around one block per image, laid before the text.
        seen = demo_engine.prompt_ids(
            dataclasses.replace(plain, images=(image("red"), image("blue")))
        )
        assert seen[:shared] == want[:shared] and seen[shared + 2 * BLOCK :] == want[shared:]
        assert demo_engine._vision is not None
        assert seen[shared : shared + 2 * BLOCK] == demo_engine._vision.block * 2
        decoded = demo_chat.tokenizer.decode(list(want[shared:]))
        assert decoded.startswith(state)  # the blocks sit right before the user's text


def test_an_image_moves_the_read_and_another_image_moves_it_elsewhere(
    demo_engine: TransformersEngine, demo_chat: ChatFormat
) -> None:
    text = read(demo_chat, demo_engine, "look at this picture")
    noise = dataclasses.replace(text, images=(image("noise"),))
    gradient = dataclasses.replace(text, images=(image("gradient"),))
    a, b, c = demo_engine.read_sync([text, noise, gradient])
    assert _differ(a, b) > MOVES and _differ(a, c) > MOVES and _differ(b, c) > MOVES
    # The same batch again reads the same, bit for bit (deterministic preprocessing and
    # forward; alone against batched is the batching test's).
    _, again, _ = demo_engine.read_sync([text, noise, gradient])
    assert np.array_equal(log_probs(again), log_probs(b))


@pytest.mark.parametrize("count", [1, 3])
def test_the_read_is_the_models_own_forward_with_the_same_pixels(
    demo_engine: TransformersEngine, demo_chat: ChatFormat, count: int
) -> None:
    kinds = ["noise", "gradient", "orange"][:count]
    r = read(demo_chat, demo_engine, "what is in the picture", *(image(k) for k in kinds), seed=5)
    assert demo_engine.model.config.image_token_id not in r.prompt_ids  # the model's own mask
    (got,) = demo_engine.read_sync([r])
    for slot, want in zip(got.slots, reference(demo_engine, r), strict=True):
        np.testing.assert_allclose(slot.probs, want, atol=1e-6, rtol=0)


def test_the_image_token_as_text_does_not_move_the_images(
    demo_engine: TransformersEngine, demo_chat: ChatFormat
) -> None:
    # In the demo vocabulary the image token's id is also the word " Day": the model's own
    # forward miscounts its placeholders on such a prompt; the engine places the soft
    # tokens where it laid the blocks, and the word stays a word.
    r = read(demo_chat, demo_engine, "a nice Day out", image("noise"))
    assert demo_engine.model.config.image_token_id in r.prompt_ids
    (got,) = demo_engine.read_sync([r])
    with pytest.raises(ValueError, match="do not match"):
        reference(demo_engine, r)
    (plain,) = demo_engine.read_sync([dataclasses.replace(r, images=())])
    assert _differ(got, plain) > MOVES


def test_several_images_are_read_in_order(
    demo_engine: TransformersEngine, demo_chat: ChatFormat
) -> None:
    a, b = image("noise"), image("gradient")
    base = read(demo_chat, demo_engine, "two pictures")
    ab, ba, only_a = demo_engine.read_sync(
        [
            dataclasses.replace(base, images=(a, b)),
            dataclasses.replace(base, images=(b, a)),
            dataclasses.replace(base, images=(a,)),
        ]
    )
    assert _differ(ab, ba) > MOVES and _differ(ab, only_a) > MOVES
    assert len(demo_engine.prompt_ids(dataclasses.replace(base, images=(a, b)))) == (
        len(base.prompt_ids) + 2 * BLOCK
    )


def test_a_batch_with_and_without_images_reads_as_one_at_a_time(
    demo_engine: TransformersEngine, demo_chat: ChatFormat
) -> None:
    noise, gradient, red = image("noise"), image("gradient"), image("red", (5, 90))
    reads = [
        read(demo_chat, demo_engine, "plain text, no picture", seed=1),
        read(demo_chat, demo_engine, "one picture", noise, seed=2),
        read(demo_chat, demo_engine, "one picture", gradient, seed=3),  # same text, other image
        read(demo_chat, demo_engine, "one picture", noise, seed=4),  # same prompt: one encoder pass
        read(
            demo_chat, demo_engine, "two pictures and a much longer text " * 3, noise, red, seed=5
        ),
        read(demo_chat, demo_engine, "SHOUTING WITH A PICTURE", red, questions=OTHER, seed=6),
        read(demo_chat, demo_engine, "shouting without one", questions=OTHER, seed=7),
    ]
    together = demo_engine.read_sync(reads)
    for r, got in zip(reads, together, strict=True):
        (alone,) = demo_engine.read_sync([r])
        for s1, s2 in zip(alone.slots, got.slots, strict=True):
            np.testing.assert_allclose(s1.probs, s2.probs, atol=BATCH_TOLERANCE, rtol=0)
            assert s1.label_mass == pytest.approx(s2.label_mass, abs=BATCH_TOLERANCE)
    # Same text, same seed, other image: a different read, batched as alone.
    alone = demo_engine.read_sync([dataclasses.replace(reads[1], images=())])[0]
    assert _differ(together[1], alone) > MOVES


def test_without_prefix_reuse_the_reads_are_the_same(demo_dir: Any, demo_chat: ChatFormat) -> None:
    plain = TransformersEngine.from_pretrained(demo_dir, device="cpu", reuse_prefix=False)
    cached = TransformersEngine.from_pretrained(demo_dir, device="cpu")
    reads = [read(demo_chat, cached, f"picture {i}", image("noise"), seed=i) for i in range(3)]
    for a, b in zip(plain.read_sync(reads), cached.read_sync(reads), strict=True):
        np.testing.assert_allclose(log_probs(a), log_probs(b), atol=BATCH_TOLERANCE, rtol=0)
    assert cached.stats["prefix_hits"] + cached.stats["prefix_misses"] > 0


# --- preprocessing ------------------------------------------------------------------------


@pytest.mark.unit
def test_patches_are_cut_as_gemma4s_processor_cuts_them() -> None:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    im = image("noise", (32, 32)).image  # already the demo's size: neither side resizes
    pixels, positions = image_patches(im, 4, IMAGE_GRID)
    theirs = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=1, max_soft_tokens=70)(
        [im], return_tensors="np"
    )
    n = IMAGE_GRID**2
    assert theirs["num_soft_tokens_per_image"][0] == n
    np.testing.assert_allclose(pixels, theirs["pixel_values"][0, :n], atol=1e-6, rtol=0)
    assert np.array_equal(positions, theirs["image_position_ids"][0, :n])


@pytest.mark.unit
@pytest.mark.parametrize("size", [(1, 1), (32, 32), (640, 480), (1000, 10), (10, 1000)])
def test_any_image_is_the_same_square_of_tokens(size: tuple[int, int]) -> None:
    im = image("noise", size).image
    pixels, positions = image_patches(im, 4, IMAGE_GRID)
    assert pixels.shape == (IMAGE_GRID**2, 48) and pixels.dtype == np.float32
    assert pixels.min() >= 0.0 and pixels.max() <= 1.0
    assert positions.min() == 0 and positions.max() == IMAGE_GRID - 1
    again, _ = image_patches(im.copy(), 4, IMAGE_GRID)
    assert np.array_equal(pixels, again)  # deterministic

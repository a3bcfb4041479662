"""vLLM reads images on a GPU: the demo checkpoint (its untrained vision tower) through
`VllmEngine` with the tower on, read by read against the transformers engine on the same
requests, and the question set's shared prefix served from vLLM's prefix cache to requests
with different images.

Skipped where there is no CUDA GPU or no vLLM; run on the GPU machine:

    DGSTREAM_GPU_OUT=$OUT python3 -m pytest tests/workers/engine/test_vllm_images_gpu.py -m gpu -v

The demo checkpoint has no processor files; `write_processor_files` writes them beside a
copy of it (vLLM builds Gemma 4's processor from them, as the CPU test
`test_vllm_images.py` does with vLLM's own processor code).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from PIL import Image  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from dgstream.schemas import Question  # noqa: E402
from dgstream.workers.engine.hf_backend import TransformersEngine  # noqa: E402
from dgstream.workers.engine.template import (  # noqa: E402
    ChatFormat,
    LayoutCache,
    labels_and_answers,
    make_read,
    standard_label_ids,
    system_text,
    user_text,
)
from dgstream.workers.engine.types import Read, ReadImage  # noqa: E402
from dgstream.workers.engine.vllm.codec import build_prompt, build_sampling_params  # noqa: E402
from dgstream.workers.engine.vllm.engine import VllmEngine  # noqa: E402
from dgstream.workers.engine.vllm.images import write_processor_files  # noqa: E402
from dgstream.workers.engine.vllm.settings import VllmSettings  # noqa: E402
from dgstream.workers.engine.vllm.sizing import check_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

# The text reads' tolerance (test_vllm_gpu.py: fp32 on both engines, every probability
# within 0.01; measured 0.007 on 300 requests): the image path adds the tower, which vLLM
# runs as transformers' own module in the same dtype, over the same patches (the CPU test
# checks them equal) with the processor's padding to 70 patches masked out. Its soft tokens
# differ from the transformers engine's only in kernel rounding, far below what an image
# moves a read (`MOVES`, checked here so the comparison is not of two text reads).
MAX_GAP = 0.01
MOVES = 1e-3
GPU_SHARE = 0.12  # as test_vllm_gpu.py: the demo model needs far less
REPORT: dict[str, Any] = {}

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
STATES = [
    "hello there",
    "FREE MONEY NOW!!! click https://win.example/prize",
    "you are an idiot and everyone knows it",
    "the meeting moved to thursday",
]


def picture(seed: int, size: tuple[int, int]) -> ReadImage:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    return ReadImage(hashlib.sha256(im.tobytes()).hexdigest(), im)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def vllm_engine(
    loop: asyncio.AbstractEventLoop,
    demo_dir: Path,
    demo_chat: ChatFormat,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmEngine]:
    model = write_processor_files(demo_dir, tmp_path_factory.mktemp("vllm-images") / "demo")
    settings = check_model(
        VllmSettings(
            model=str(model),
            gpu_memory_utilization=GPU_SHARE,
            enforce_eager=True,
            max_num_seqs=127,
            max_num_batched_tokens=16_384,
            dtype="float32",
            images_per_request=8,
        )
    )
    engine = VllmEngine(settings, shared_labels=standard_label_ids(demo_chat.encode))
    loop.run_until_complete(engine.start())
    assert engine.read_path == "dgstream", engine.read_path
    assert engine.info.reads_images and engine.image_layout is not None
    yield engine
    loop.run_until_complete(engine.close())
    out = os.environ.get("DGSTREAM_GPU_OUT")
    if out:
        Path(out, "vllm_images.json").write_text(json.dumps(REPORT, indent=2, default=str))


@pytest.fixture(scope="module")
def hf_engine(demo_dir: Path) -> TransformersEngine:
    # The demo model on the GPU, in vLLM's dtype (the CPU one is `demo_engine`).
    return TransformersEngine.from_pretrained(demo_dir, device="cuda", dtype="float32")


def reads(chat: ChatFormat, width: int, images: list[tuple[ReadImage, ...]]) -> list[Read]:
    qs = {k: TypeAdapter(Question).validate_python(v) for k, v in QUESTIONS.items()}
    layouts = LayoutCache(chat.encode, width)
    layout = layouts.get([(k, labels_and_answers(q)[0]) for k, q in qs.items()])
    out = []
    for i, ims in enumerate(images):
        r = make_read(chat, layout, system_text(qs), user_text(STATES[i % len(STATES)], {}), seed=i)
        out.append(dataclasses.replace(r, images=ims, tag=f"img-{i}"))
    return out


def gaps(a: Any, b: Any) -> float:
    pairs = zip(a.slots, b.slots, strict=True)
    return max(float(np.abs(x.probs - y.probs).max()) for x, y in pairs)


def log_gap(a: Any, b: Any) -> float:
    pairs = zip(a.slots, b.slots, strict=True)
    return max(float(np.abs(np.log(x.probs) - np.log(y.probs)).max()) for x, y in pairs)


def test_vllm_reads_images_as_the_transformers_engine_does(
    loop: asyncio.AbstractEventLoop,
    demo_chat: ChatFormat,
    vllm_engine: VllmEngine,
    hf_engine: TransformersEngine,
) -> None:
    sizes = [(48, 36), (1000, 10), (7, 300), (1, 1), (640, 480), (33, 95), (2, 9), (64, 64)]
    sets: list[tuple[ReadImage, ...]] = [()]  # a text-only read in the same batch
    sets += [(picture(i, sizes[i % 8]),) for i in range(8)]
    sets += [tuple(picture(10 + k, sizes[k]) for k in range(n)) for n in (2, 3, 8)]
    batch = reads(demo_chat, hf_engine.info.canvas_length, sets)
    ours = loop.run_until_complete(vllm_engine.read(batch))
    theirs = hf_engine.read_sync(batch)
    plain = hf_engine.read_sync([dataclasses.replace(r, images=()) for r in batch])
    worst = max(gaps(a, b) for a, b in zip(ours, theirs, strict=True))
    moved = min(log_gap(a, b) for a, b, r in zip(theirs, plain, batch, strict=True) if r.images)
    REPORT["parity"] = {"reads": len(batch), "max_probability_gap": worst, "min_moved": moved}
    assert moved > MOVES, "the images did not reach the reads"
    assert worst <= MAX_GAP, worst


def test_the_shared_prefix_is_served_from_cache_with_other_images(
    loop: asyncio.AbstractEventLoop, demo_chat: ChatFormat, vllm_engine: VllmEngine
) -> None:
    """vLLM's own count of prompt tokens served from its prefix cache
    (`RequestOutput.num_cached_tokens`): a request of the same question set and text with
    another image gets the system prefix's blocks from the cache and nothing from its image
    on (a block is keyed by the uuids of the images in it, and every block after it by
    that block), though all its text after the image is the same; the same request again
    gets its image's blocks too. A hit is a whole number of blocks (of the hybrid cache's
    common block size, which may be a multiple of `block_size`)."""
    engine = vllm_engine._engine
    block = engine.vllm_config.cache_config.block_size
    assert engine.vllm_config.cache_config.enable_prefix_caching
    a, b = reads(
        demo_chat,
        vllm_engine.info.canvas_length,
        [(picture(40, (48, 36)),), (picture(41, (30, 90)),)],
    )
    a = dataclasses.replace(a, prompt_ids=b.prompt_ids, canvas_ids=b.canvas_ids)

    async def cached(r: Read) -> int:
        prompt = build_prompt(r, vllm_engine.image_layout, most_images=8)
        params = build_sampling_params(r, vllm_engine.settings, vllm_engine.shared_labels)
        final = None
        async for out in engine.generate(prompt, params, f"cache-{uuid.uuid4().hex[:8]}"):
            final = out
        assert final is not None and final.num_cached_tokens is not None
        return int(final.num_cached_tokens)

    at = b.shared_prefix_len
    first = loop.run_until_complete(cached(a))
    other_image = loop.run_until_complete(cached(b))
    again = loop.run_until_complete(cached(b))
    REPORT["prefix_cache"] = {
        "shared_prefix_len": at,
        "block_size": block,
        "first": first,
        "other_image": other_image,
        "same_again": again,
    }
    assert 0 < other_image <= at  # the blocks from the image on are the image's own
    assert at - other_image < max(4 * block, 64), (at, other_image)
    assert again > at + 66  # the image's blocks, keyed by its uuid, serve the repeat

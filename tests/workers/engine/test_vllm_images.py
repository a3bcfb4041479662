"""The vLLM engine's images, on the CPU: the setting that turns the vision tower on and its
refusals, the memory arithmetic of the tower on the 24 GB card, and the prompt the codec
builds, expanded by vLLM 0.33's own Gemma 4 processor on the demo model's config to the
prompt the transformers engine reads (no GPU: vLLM's processor runs on the host)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from dgstream.workers.engine.models import TRAINED_DIRS
from dgstream.workers.engine.types import EngineConfigError, Read, ReadImage, ReadRejected, Slot
from dgstream.workers.engine.vision import IMAGE_GRID, VisionInput, image_patches
from dgstream.workers.engine.vllm import sizing
from dgstream.workers.engine.vllm.args import engine_args, serve_command
from dgstream.workers.engine.vllm.codec import build_prompt
from dgstream.workers.engine.vllm.images import (
    ImageLayout,
    multimodal_prompt,
    write_processor_files,
)
from dgstream.workers.engine.vllm.settings import VllmSettings

DEMO = Path(TRAINED_DIRS["demo"])
# The demo config's ids (config.json): <boi>, <eoi>, <image>.
BOI, EOI, IMAGE = 2045, 2046, 2047
LAYOUT = ImageLayout(image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI, patch=4, pooling=1)


def picture(seed: int, size: tuple[int, int] = (48, 36)) -> ReadImage:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    return ReadImage(hashlib.sha256(im.tobytes()).hexdigest(), im)


def a_read(*images: ReadImage, prompt: tuple[int, ...] = (2, 100, 101, 102, 103, 104, 105)) -> Read:
    slot = Slot(question_id="q", position=3, label_ids=(7, 8), labels=("yes", "no"))
    return Read(
        prompt_ids=prompt,
        canvas_ids=tuple(range(16)),
        slots=(slot,),
        shared_prefix_len=4,
        tag="r",
        images=images,
    )


@pytest.fixture
def card(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sizing.CARD_ENV, "23.6")


# --- the setting ---


def test_images_are_off_by_default_and_text_args_do_not_change() -> None:
    s = VllmSettings()
    assert s.images_per_request == 0 and not s.reads_images
    args = engine_args(s)
    assert args["language_model_only"] is True
    assert "limit_mm_per_prompt" not in args and "mm_processor_kwargs" not in args
    assert "--limit-mm-per-prompt" not in serve_command(s)


def test_images_turn_the_tower_on(card: None) -> None:
    s = VllmSettings(images_per_request=3, max_model_len=8192)
    assert s.reads_images
    args = engine_args(s)
    assert args["language_model_only"] is False
    assert args["limit_mm_per_prompt"] == {"image": 3, "video": 0}
    assert args["mm_processor_kwargs"] == {"max_soft_tokens": 70}
    cmd = serve_command(s)
    assert cmd[cmd.index("--limit-mm-per-prompt") + 1] == '{"image": 3, "video": 0}'
    assert "--language-model-only" not in cmd


def test_the_settings_refuse_what_cannot_read_images() -> None:
    with pytest.raises(ValueError, match="images_per_request"):
        VllmSettings(images_per_request=9)  # the request limit is 8
    with pytest.raises(ValueError, match="language_model_only"):
        VllmSettings(images_per_request=1, language_model_only=True)


# --- the arithmetic ---


@pytest.mark.parametrize("which", ["demo", "reference"])
def test_the_tower_count_is_transformers(which: str) -> None:
    torch = pytest.importorskip("torch")
    import json

    from transformers import AutoModel
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig

    if which == "demo":
        config = json.loads((DEMO / "config.json").read_text())
        vision, hidden = config["vision_config"], config["text_config"]["hidden_size"]
    else:
        vision, hidden = sizing.REFERENCE_VISION, sizing.REFERENCE_TEXT["hidden_size"]
    kw = {k: v for k, v in vision.items() if k != "model_type"}
    with torch.device("meta"):
        tower = AutoModel.from_config(Gemma4VisionConfig(**kw))
    count = sum(p.numel() for p in tower.parameters())
    assert sizing.vision_params(vision, hidden) == count + vision["hidden_size"] * hidden


def test_what_the_tower_costs_on_the_card(card: None) -> None:
    cost = sizing.image_cost(VllmSettings(images_per_request=8))
    # 572.8 M parameters in bf16; 4,096 soft tokens of 2,816 in bf16; 12 images of 630
    # patches a chunk (2.36 GiB // 0.192 GiB) in vLLM's profile, above the text stack's
    # 1.34 GiB by 0.97.
    assert cost["tower_gib"] == pytest.approx(1.067, abs=1e-3)
    assert cost["encoder_cache_gib"] == pytest.approx(0.0215, abs=1e-4)
    assert cost["encoder_peak_gib"] == pytest.approx(12 * 630 * 4 * 10240 * 8 / 2**30)
    assert cost["total_gib"] == pytest.approx(2.056, abs=1e-3)
    assert 3_360 < cost["kv_blocks"] < 3_375  # of the defaults' 5,229 blocks
    assert (
        pytest.approx(sizing.REFERENCE_KV_GIB * 2**30, rel=0.005)
        == sizing.KV_BLOCK_BYTES * sizing.REFERENCE_KV_BLOCKS
    )


def test_the_defaults_with_images_are_refused_by_name(card: None) -> None:
    with pytest.raises(EngineConfigError) as err:
        engine_args(VllmSettings(images_per_request=8))
    text = str(err.value)
    assert "images_per_request: 8" in text and "max_model_len to at most 8192" in text
    assert "16384-token request" in text and "gpu_memory_utilization to at least 0.94" in text
    # What fits: shorter requests, or more of the card.
    engine_args(VllmSettings(images_per_request=8, max_model_len=8192))
    engine_args(VllmSettings(images_per_request=8, gpu_memory_utilization=0.94))
    engine_args(VllmSettings())  # text only: unchanged


def test_the_arithmetic_leaves_other_models_and_unknown_cards_to_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(sizing.CARD_ENV, "23.6")
    sizing.check_images(VllmSettings(model=str(DEMO), images_per_request=8), 0.9)
    monkeypatch.delenv(sizing.CARD_ENV)
    monkeypatch.setattr(sizing, "card_bytes", lambda: None)
    sizing.check_images(VllmSettings(images_per_request=8), 0.9)


# --- the prompt ---


def test_a_text_only_read_is_its_token_ids() -> None:
    pytest.importorskip("vllm")
    r = a_read()
    prompt = build_prompt(r, LAYOUT, most_images=8)
    assert prompt == {"type": "token", "prompt_token_ids": list(r.prompt_ids)}
    assert build_prompt(r, None) == prompt  # a text-only engine too


@pytest.mark.parametrize("count", [1, 3])
def test_images_go_after_the_shared_prefix_as_one_token_each(count: int) -> None:
    images = tuple(picture(i, (40 + 10 * i, 30)) for i in range(count))
    r = a_read(*images)
    prompt = build_prompt(r, LAYOUT, most_images=8)
    assert prompt["prompt_token_ids"] == [2, 100, 101, 102, *[IMAGE] * count, 103, 104, 105]
    squares = prompt["multi_modal_data"]["image"]
    assert [im.size for im in squares] == [(32, 32)] * count  # 8 x 8 patches of 4
    assert prompt["multi_modal_uuids"]["image"] == [f"sha256:{im.sha256}@32px" for im in images]
    # The same pixels the transformers engine cuts into patches.
    for im, sq in zip(images, squares, strict=True):
        ours, _ = image_patches(sq, 4, IMAGE_GRID)
        theirs, _ = image_patches(im.image, 4, IMAGE_GRID)
        np.testing.assert_array_equal(ours, theirs)


def test_reads_the_engine_cannot_take_are_refused() -> None:
    r = a_read(picture(0), picture(1))
    with pytest.raises(ReadRejected, match="images_per_request"):
        build_prompt(r, LAYOUT, most_images=1, index=5)
    with pytest.raises(ReadRejected, match="does not read images"):
        build_prompt(r, None, most_images=8)
    # The image id in the shared prefix: vLLM would put the first image there.
    clash = a_read(picture(0), prompt=(2, 100, IMAGE, 102, 103))
    with pytest.raises(ReadRejected, match="before the images"):
        build_prompt(clash, LAYOUT, most_images=8)
    # After the images (the state's own " Day" in the demo vocabulary) it is only text.
    ok = a_read(picture(0), prompt=(2, 100, 101, 102, IMAGE, 104))
    assert build_prompt(ok, LAYOUT, most_images=8)["prompt_token_ids"][4:6] == [IMAGE, IMAGE]


def test_the_layout_comes_from_the_config() -> None:
    import json

    config = json.loads((DEMO / "config.json").read_text())
    assert ImageLayout.from_config(config) == LAYOUT
    assert ImageLayout.from_config({"text_config": {}}) is None
    reference = {
        "vision_config": sizing.REFERENCE_VISION,
        **dict(zip(("image_token_id", "boi_token_id", "eoi_token_id"), (1, 2, 3), strict=True)),
    }
    full = ImageLayout.from_config(reference)
    assert full is not None and full.pixels == 384 and full.tokens_per_image == 66


# --- vLLM's own processor on the demo model's config ---


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if os.environ.get("DGSTREAM_SKIP_VLLM") == "1":
        pytest.skip("DGSTREAM_SKIP_VLLM=1")
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig

    model = write_processor_files(DEMO, tmp_path_factory.mktemp("vllm") / "demo")
    config = ModelConfig(
        model=str(model),
        dtype="float32",
        limit_mm_per_prompt={"image": 8, "video": 0},
        mm_processor_kwargs={"max_soft_tokens": sizing.MAX_SOFT_TOKENS},
    )
    return config


@pytest.fixture(scope="module")
def processor(model_config: Any) -> Any:
    from vllm.multimodal import MULTIMODAL_REGISTRY

    return MULTIMODAL_REGISTRY.create_processor(model_config)


@pytest.mark.vllm
def test_vllm_budgets_the_encoder_as_the_arithmetic_does(model_config: Any) -> None:
    """vLLM's own encoder budget (`MultiModalBudget`, what its memory profile runs) at the
    defaults' token budget and reads in flight: 70 soft tokens an image, an encoder cache of
    4,096 tokens, 58 images in the profile, the counts `sizing.image_cost` uses."""
    from types import SimpleNamespace

    from vllm.config import SchedulerConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    settings = VllmSettings(images_per_request=8)
    scheduler = SchedulerConfig(
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.reads_in_flight(),
        max_model_len=model_config.max_model_len,
        is_encoder_decoder=False,
    )
    config = SimpleNamespace(model_config=model_config, scheduler_config=scheduler)
    budget = MultiModalBudget(config, MULTIMODAL_REGISTRY, enable_cache=False)
    cost = sizing.image_cost(settings)
    assert dict(budget.mm_max_toks_per_item) == {"image": sizing.MAX_SOFT_TOKENS}  # no video
    assert budget.encoder_cache_size == settings.max_num_batched_tokens
    assert dict(budget.mm_max_items_per_prompt) == {"image": 8}
    assert budget.mm_max_items_per_batch["image"] == cost["profile_images"] == 58


def expand(processor: Any, prompt: dict[str, Any]) -> Any:
    """What vLLM's renderer does with a token prompt that carries images
    (`BaseRenderer._process_multimodal`)."""
    from vllm.multimodal.parse import parse_mm_uuids
    from vllm.multimodal.processing import ProcessorInputs
    from vllm.multimodal.processing.context import TimingContext

    items = processor.info.parse_mm_data(prompt["multi_modal_data"])
    inputs = ProcessorInputs(
        prompt["prompt_token_ids"], items, parse_mm_uuids(prompt["multi_modal_uuids"])
    )
    return processor.apply(inputs, TimingContext(enabled=False))


@pytest.mark.vllm
@pytest.mark.parametrize("count", [1, 2, 8])
def test_vllm_expands_the_prompt_the_transformers_engine_reads(processor: Any, count: int) -> None:
    sizes = [(48, 36), (1000, 10), (7, 300), (1, 1), (64, 64), (33, 95), (500, 400), (2, 9)]
    images = tuple(picture(i, sizes[i]) for i in range(count))
    r = a_read(*images)
    out = expand(processor, multimodal_prompt(r, LAYOUT))
    hf = VisionInput(patch=4, pooling=1, boi_id=BOI, eoi_id=EOI, image_id=IMAGE)
    want = list(hf.expand(r.prompt_ids, r.shared_prefix_len, count))
    assert out["prompt_token_ids"] == want == LAYOUT.expanded(r)
    assert len(want) == len(r.prompt_ids) + count * LAYOUT.tokens_per_image
    # Each image's placeholder: its block, the soft tokens the embeddings go to.
    ranges = out["mm_placeholders"]["image"]
    starts = [rg.offset for rg in ranges]
    assert starts == [r.shared_prefix_len + k * 66 for k in range(count)]
    assert all(rg.length == 66 and int(rg.is_embed.sum()) == 64 for rg in ranges)
    embed_at = [rg.offset + j for rg in ranges for j in range(66) if bool(rg.is_embed[j])]
    assert embed_at == hf.image_positions(r.shared_prefix_len, count)
    # vLLM's caches key each image by its uuid.
    assert out["mm_hashes"]["image"] == [LAYOUT.uuid(im) for im in images]
    # The tower's input: the transformers engine's patches (padded to the processor's 70,
    # position -1), to the float32 processor's rounding.
    for im, item in zip(images, out["mm_kwargs"]["image"], strict=True):
        pixels = item["pixel_values"].data.numpy()
        positions = item["pixel_position_ids"].data.numpy()
        ours, where = image_patches(im.image, 4, IMAGE_GRID)
        np.testing.assert_allclose(pixels[:64], ours, atol=1e-6)
        np.testing.assert_array_equal(positions[:64], where)
        assert (positions[64:] == -1).all()


def test_the_demo_tower_keeps_its_soft_tokens_in_vllm() -> None:
    """vLLM's image path (gemma4_mm.py `_process_image_input`): the processor's 70 padded
    patches through the tower, then `pooler(...)` and the rows its mask keeps. The read
    path's model fixes transformers 5.20's unpooled mask so the 64 soft tokens are kept."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    import json

    from transformers import AutoModel
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig

    from dgstream.workers.engine.vllm_reads.model import fix_unpooled_tower

    vision = json.loads((DEMO / "config.json").read_text())["vision_config"]
    tower = AutoModel.from_config(
        Gemma4VisionConfig(**{k: v for k, v in vision.items() if k != "model_type"})
    )
    hidden = torch.randn(1, 70, vision["hidden_size"])
    _, where = image_patches(picture(0).image, 4, IMAGE_GRID)
    positions = torch.cat([torch.from_numpy(where), torch.full((6, 2), -1)]).unsqueeze(0)
    padding = (positions == -1).all(dim=-1)

    def kept() -> int:
        pooled, mask = tower.pooler(
            hidden_states=hidden,
            pixel_position_ids=positions,
            padding_positions=padding,
            output_length=70,
        )
        return int(pooled[mask].shape[0])

    assert kept() == 6  # transformers 5.20: the padding rows
    fix_unpooled_tower(tower)
    fix_unpooled_tower(tower)  # once is enough
    assert kept() == 64


@pytest.mark.vllm
def test_vllm_admits_a_read_with_images(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The request as vLLM admits it (`InputProcessor.process_inputs`, what AsyncLLM runs
    on the renderer's thread: the diffusion params' checks, the multimodal processing) from
    the engine's arguments with the tower on: the prompt expanded, each image's feature at
    its block, named by its uuid (vLLM's encoder and prefix caches key on it)."""
    if os.environ.get("DGSTREAM_SKIP_VLLM") == "1":
        pytest.skip("DGSTREAM_SKIP_VLLM=1")
    pytest.importorskip("vllm")
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.input_processor import InputProcessor

    from dgstream.workers.engine.vllm.codec import build_sampling_params

    model = write_processor_files(DEMO, tmp_path_factory.mktemp("admit") / "demo")
    settings = VllmSettings(model=str(model), images_per_request=8, dtype="float32")
    args = AsyncEngineArgs(**engine_args(settings))
    model_config = args.create_model_config()
    processor = InputProcessor(
        VllmConfig(
            model_config=model_config,
            diffusion_config=args.create_diffusion_config(),
            device_config=DeviceConfig(device="cpu"),
        )
    )
    layout = ImageLayout.from_config(model_config.hf_config)
    assert layout == LAYOUT
    same = picture(3)
    r = a_read(same, picture(4, (90, 20)), same)
    request = processor.process_inputs(
        "r",
        build_prompt(r, layout, most_images=8),
        build_sampling_params(r, settings),
        ("generate",),
    )
    assert list(request.prompt_token_ids) == LAYOUT.expanded(r)
    features = request.mm_features
    assert [f.identifier for f in features] == [LAYOUT.uuid(im) for im in r.images]
    assert [(f.mm_position.offset, f.mm_position.length) for f in features] == [
        (4, 66),
        (70, 66),
        (136, 66),
    ]


class _Recording:
    """A stand-in for AsyncLLM that records each prompt it is given and refuses it."""

    errored = False

    def __init__(self) -> None:
        self.prompts: list[Any] = []

    async def generate(self, prompt: Any, params: Any, request_id: str) -> Any:
        self.prompts.append(prompt)
        raise ValueError("recorded")
        yield  # an async generator, as AsyncLLM.generate is


def test_the_engine_sends_images_and_refuses_what_it_cannot_read() -> None:
    pytest.importorskip("vllm")
    import asyncio

    from dgstream.workers.engine.vllm.engine import VllmEngine

    assert not VllmEngine(VllmSettings()).info.reads_images  # IMAGES_NOT_READ stays
    engine = VllmEngine(VllmSettings(images_per_request=2))
    assert engine.info.reads_images
    stand_in = _Recording()
    assert engine.info.image_tokens == 0  # not known before vLLM expands an image
    engine._engine, engine.image_layout = stand_in, LAYOUT  # no GPU: no AsyncLLM
    # `<boi>`, 64 image tokens, `<eoi>`: what diagnostics.input_tokens counts per image.
    assert engine.info.image_tokens == 66
    batch = [a_read(), a_read(picture(1)), a_read(picture(1), picture(2), picture(3))]
    with pytest.raises(ReadRejected) as err:
        asyncio.run(engine.read(batch))
    assert "images_per_request (2)" in err.value.rejected[2]
    text, image = sorted(stand_in.prompts, key=lambda p: "multi_modal_data" in p)
    assert text == {"type": "token", "prompt_token_ids": list(batch[0].prompt_ids)}
    assert image["prompt_token_ids"].count(IMAGE) == 1
    # Started on a model without a tower: nothing to read images with.
    engine.image_layout = None
    assert not engine.info.reads_images

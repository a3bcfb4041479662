"""What the in-process engine's settings come to on a model and a card: the model's limits
(`check_model`), the CUDA graph sizes, and the card's memory (the stock path's reserve,
FULL graphs' headroom)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from dgstream.workers.engine.types import EngineConfigError
from dgstream.workers.engine.vllm.settings import VllmSettings

__all__ = [
    "CARD_ENV",
    "FULL_GRAPHS_HEADROOM_GIB",
    "GRAPH_SIZES",
    "KV_BLOCK_BYTES",
    "MAX_SOFT_TOKENS",
    "MIN_STOCK_UTILIZATION",
    "REFERENCE_MAX_MODEL_LEN",
    "card_bytes",
    "check_full_graphs",
    "check_images",
    "check_model",
    "graph_sizes",
    "image_cost",
    "stock_utilization",
    "vision_params",
]

# The reported run's max_model_len (DESIGN: RTX 3090, NVFP4, 16,384 tokens).
REFERENCE_MAX_MODEL_LEN = 16_384


def _local_model_config(model: str) -> dict[str, Any] | None:
    path = Path(model).expanduser()
    try:
        body = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def check_model(settings: VllmSettings) -> VllmSettings:
    """The settings resolved against a local model directory, or `EngineConfigError`
    naming the setting that cannot work (vLLM's own refusal is a long stack trace).

    A model that is not a local directory (a hub id) is left to vLLM."""
    config = _local_model_config(settings.model)
    if config is None:
        if settings.max_model_len is None:
            return settings.model_copy(update={"max_model_len": REFERENCE_MAX_MODEL_LEN})
        return settings
    from dgstream.workers.engine.models import missing_generation_fields

    text = config.get("text_config") or config
    limit = text.get("max_position_embeddings")
    length = settings.max_model_len
    if length is None:
        length = min(REFERENCE_MAX_MODEL_LEN, limit) if limit else REFERENCE_MAX_MODEL_LEN
    elif limit and length > limit:
        raise EngineConfigError(
            f"engine.vllm.max_model_len: {length} is above the model's "
            f"max_position_embeddings ({limit}) in {settings.model}/config.json; set it to "
            f"{limit} or less (or leave it unset)"
        )
    missing = missing_generation_fields(Path(settings.model).expanduser())
    if missing:
        raise EngineConfigError(
            f"engine.vllm.model: {settings.model}/generation_config.json lacks real values "
            f"for {', '.join(missing)} (vLLM reads them raw and fails on null); write them "
            "with dgstream.workers.engine.models.write_generation_config"
        )
    vocab = text.get("vocab_size") or settings.vocab_size
    return settings.model_copy(update={"max_model_len": length, "vocab_size": int(vocab)})


# Scheduled-token sizes for CUDA graphs: steps of 8 to 32 tokens up to 256 (single-read
# and small steps), then about 25% apart up to 16,384 (the largest max_num_batched_tokens
# measured), so a graphed step pads at most a quarter of its tokens.
GRAPH_SIZES = (
    *(1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256),
    *(320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584),
    *(4096, 5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384),
)


def graph_sizes(settings: VllmSettings) -> tuple[int, ...] | None:
    """The CUDA graph sizes to capture, or None for vLLM's own list."""
    sizes = settings.cudagraph_capture_sizes
    if sizes == "to_budget":
        return tuple(s for s in GRAPH_SIZES if s <= settings.max_num_batched_tokens)
    return sizes


# every process of a run; see bench/gpu/card/), else what NVML reports for the first
# visible GPU. Only the stock path's reserve needs it.
CARD_ENV = "DGSTREAM_CARD_GIB"


def card_bytes() -> int | None:
    """The GPU's memory in bytes, read without opening a CUDA context (NVML), or None."""
    if env := os.environ.get(CARD_ENV):
        return int(float(env) * 2**30)
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        if visible.startswith("GPU-"):
            handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible or 0))
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception:  # no NVML, no GPU (CI), an odd CUDA_VISIBLE_DEVICES
        return None


def stock_utilization(settings: VllmSettings, max_num_seqs: int) -> float:
    """gpu_memory_utilization for vLLM's own read path: the settings' share of the card less
    the first denoise step that vLLM's memory profile never runs (it would take the memory
    from the KV cache's side otherwise, and fail in the warmup on a 24 GB card), or
    `EngineConfigError` naming the settings when that step leaves nothing."""
    from dgstream.workers.engine.vllm_reads.options import GIB, stock_denoise_bytes

    card = card_bytes()
    if card is None:
        return settings.gpu_memory_utilization
    step = stock_denoise_bytes(
        max_num_seqs, settings.max_num_batched_tokens, settings.canvas_length, settings.vocab_size
    )
    utilization = settings.gpu_memory_utilization - step / card
    if utilization < MIN_STOCK_UTILIZATION:
        raise EngineConfigError(
            f"engine.vllm: vLLM's own read path needs {step / GIB:.2f} GiB for its first "
            f"denoise step (max_num_seqs {max_num_seqs}, max_num_batched_tokens "
            f"{settings.max_num_batched_tokens}, canvas_length {settings.canvas_length}, "
            f"{settings.vocab_size} ids) beyond gpu_memory_utilization "
            f"{settings.gpu_memory_utilization} of this {card / GIB:.1f} GiB card; lower "
            "them, or use read_path 'dgstream'"
        )
    return round(utilization, 4)


# Below this share of the card there is no room for weights and a KV cache at all: the
# settings are wrong, not tight.
MIN_STOCK_UTILIZATION = 0.05

# What a card needs outside gpu_memory_utilization when every step is one CUDA graph
# (cudagraph_mode "FULL"): vLLM's budget does not bound their capture. Measured on the
# emulated 24 GB card (23.6 GiB, 1.0 GiB of it the CUDA context outside PyTorch's
# allocator), 2026-12-04, the read path's defaults (256 reads, graphs to 4,096 tokens): at
# 0.86 the engine process's allocator peaked at 21.88 GiB, 1.59 past the 20.29 budget; at
# 0.9 the capture ran out of memory. 1.0 + 1.6 GiB, and 0.4 of margin (0.86 left 0.72
# spare), so that the advice on a 24 GB card (0.87) is a measured start.
FULL_GRAPHS_HEADROOM_GIB = 3.0


def check_full_graphs(settings: VllmSettings, utilization: float) -> None:
    """`EngineConfigError` naming the settings when FULL CUDA graphs would leave the card
    too little outside vLLM's budget to be captured (vLLM fails late, in its warmup, with
    an allocator trace). Other modes, or no known card, pass."""
    if settings.cudagraph_mode != "FULL":
        return
    card = card_bytes()
    if card is None:
        return
    need = FULL_GRAPHS_HEADROOM_GIB * 2**30
    if card * (1 - utilization) >= need:
        return
    most = math.floor((1 - need / card) * 100) / 100
    raise EngineConfigError(
        f"engine.vllm: cudagraph_mode 'FULL' needs about {FULL_GRAPHS_HEADROOM_GIB} GiB of "
        f"this {card / 2**30:.1f} GiB card outside gpu_memory_utilization (its graphs are "
        f"captured past vLLM's budget); gpu_memory_utilization {utilization} leaves "
        f"{card * (1 - utilization) / 2**30:.2f} GiB: set it to at most {most}, or leave "
        "cudagraph_mode unset"
    )


# --- Images: what the vision tower costs on the card (docs/vllm.md, "Images") ---
#
# The reference deployment these constants come from: the NVFP4 full-size checkpoint at
# the defaults (gpu_memory_utilization 0.9, max_num_batched_tokens 4096, max_model_len
# 16,384) on the emulated 23.6 GiB card, language model only (docs/data/card24/small_full/
# card_defaults.log, 2026-12-06): "Available KV cache memory: 3.19 GiB", 5,229 blocks,
# "GPU KV cache size: 25,219 tokens", "1.34 GiB for peak activation".
REFERENCE_CARD_GIB = 23.6
REFERENCE_UTILIZATION = 0.9
REFERENCE_KV_GIB = 3.19
REFERENCE_KV_BLOCKS = 5_229
REFERENCE_KV_TOKENS = 25_219
REFERENCE_PEAK_ACTIVATION_GIB = 1.34
# Everything else under the budget there (weights, activation peak, graphs, non-torch).
REFERENCE_OTHER_GIB = REFERENCE_CARD_GIB * REFERENCE_UTILIZATION - REFERENCE_KV_GIB
# One KV block of the full-size shape: 3.19 GiB / 5,229 blocks = 0.625 MiB (5 KV tensors
# of vLLM's hybrid layout, 16 tokens x 8 heads x 256 x K and V x 2 bytes each).
KV_BLOCK_BYTES = 5 * 16 * 2 * 8 * 256 * 2
# What one request of max_model_len tokens takes of that cache, as vLLM counts it
# (its "tokens" are requests of max_model_len times max_model_len): 132.6 KiB a token,
# 2.07 GiB for 16,384 tokens.
KV_BYTES_PER_TOKEN = REFERENCE_KV_GIB * 2**30 / REFERENCE_KV_TOKENS
# The shape of the reference checkpoint's text stack (`workers.engine.models.full_size_config`).
REFERENCE_TEXT = {"hidden_size": 2816, "num_hidden_layers": 30}
# Gemma 4's vision tower as the 26B-A4B ships it (no config.json of it here offline; the
# published GGUF metadata of gemma4:26b-a4b: 27 blocks, width 1152, feed-forward 4304,
# 16 heads, patch 16, projection to 2816; and the 31B's extracted tower, the same shape,
# 569,550,384 parameters), with transformers' Gemma4VisionConfig defaults for the rest.
REFERENCE_VISION = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 72,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "position_embedding_size": 10240,
}
# The soft-token budget the engine asks of Gemma 4's processor (`mm_processor_kwargs`
# max_soft_tokens): its smallest supported value (vLLM 0.33, gemma4_mm.py,
# `_SUPPORTED_SOFT_TOKENS` = 70, 140, 280, 560, 1120), which keeps the engine's square of
# IMAGE_GRID x IMAGE_GRID = 64 soft tokens at that size (dgstream.workers.engine.vllm.images).
MAX_SOFT_TOKENS = 70


def vision_params(vision: dict[str, Any], text_hidden: int) -> int:
    """Parameters of a Gemma 4 vision tower and its projection into the text stack, from
    its config (transformers 5.20's Gemma4VisionModel, counted on the meta device by a
    test; a key left out takes Gemma4VisionConfig's default): per layer q, k, v, o and a
    gated MLP, four norms and the q/k norms; the patch
    projection and the (x, y) position table; `embed_vision`'s projection."""
    h = int(vision.get("hidden_size", 768))
    ff = int(vision.get("intermediate_size", 3072))
    heads = int(vision.get("num_attention_heads", 12))
    kv_heads = int(vision.get("num_key_value_heads", 12))
    hd = int(vision.get("head_dim", 64))
    patch = int(vision.get("patch_size", 16))
    table = int(vision.get("position_embedding_size", 10240))
    layers = int(vision.get("num_hidden_layers", 16))
    attn = h * heads * hd * 2 + h * kv_heads * hd * 2
    layer = attn + 3 * h * ff + 4 * h + 2 * hd
    return layers * layer + patch * patch * 3 * h + 2 * table * h + h * text_hidden


def image_cost(settings: VllmSettings, config: dict[str, Any] | None = None) -> dict[str, float]:
    """What reading images costs an engine of these settings, in GiB and KV blocks, for the
    model of `config` (its config.json; None: the reference checkpoint's published shape).

    - tower: the vision tower's weights in bf16 (the NVFP4 checkpoint leaves the tower
      unquantized: its `ignore` list, as `weights/demo-nvfp4` copies it, docs/model.md);
    - encoder_cache: vLLM's encoder cache, `max_num_batched_tokens` soft tokens
      (`compute_mm_encoder_budget`: the scheduler's encoder_cache_size) at the text width
      in bf16;
    - encoder_peak: the tower's transient in vLLM's memory profile, by vLLM's own estimate
      (gemma4_mm.py `_encoder_chunk`: images go through in chunks whose position one-hot,
      patches x 2 x position table int64, with its cast, stays under a tenth of the card);
    - activation: what of that peak lies above the language model's own profile peak
      (1.34 GiB at the reference; the profile keeps the larger of the two);
    - total and blocks: what comes off the KV cache."""
    text = (config or {}).get("text_config") or config or REFERENCE_TEXT
    vision = (config or {}).get("vision_config") or REFERENCE_VISION
    text_hidden = int(text.get("hidden_size", REFERENCE_TEXT["hidden_size"]))
    gib = 2**30
    tower = vision_params(vision, text_hidden) * 2 / gib
    cache = settings.max_num_batched_tokens * text_hidden * 2 / gib
    pool = int(vision.get("pooling_kernel_size", 3))
    patches = MAX_SOFT_TOKENS * pool * pool
    per_image = patches * 4 * int(vision.get("position_embedding_size", 10240)) * 8
    card = card_bytes() or int(REFERENCE_CARD_GIB * gib)
    # vLLM profiles the most images a step's encoder budget holds (`MultiModalBudget`).
    items = max(
        1,
        min(
            settings.max_num_batched_tokens // MAX_SOFT_TOKENS,
            settings.reads_in_flight() * max(1, settings.images_per_request),
        ),
    )
    chunk = max(1, min(items, (card // 10) // per_image))
    peak = chunk * per_image / gib
    activation = max(0.0, peak - REFERENCE_PEAK_ACTIVATION_GIB)
    total = tower + cache + activation
    return {
        "tower_gib": tower,
        "encoder_cache_gib": cache,
        "encoder_peak_gib": peak,
        "activation_gib": activation,
        "total_gib": total,
        "kv_blocks": total * gib / KV_BLOCK_BYTES,
        "profile_images": items,
        "chunk_images": chunk,
    }


def _is_reference_shape(config: dict[str, Any] | None) -> bool:
    if config is None:
        return True  # a hub id: the reference checkpoint (or vLLM's own refusal)
    text = config.get("text_config") or config
    return all(text.get(k) == v for k, v in REFERENCE_TEXT.items())


def check_images(settings: VllmSettings, utilization: float) -> None:
    """`EngineConfigError` naming the settings when the vision tower (`images_per_request`
    > 0) would leave the KV cache too little for one request of max_model_len on this
    card. The arithmetic is calibrated on the reference checkpoint at the default token
    budget (the measured 3.19 GiB KV cache of the defaults); another model (the demo's), an
    unknown card, or text-only settings pass, and vLLM's own check stands."""
    if not settings.reads_images:
        return
    card = card_bytes()
    config = _local_model_config(settings.model)
    if card is None or not _is_reference_shape(config):
        return
    gib = 2**30
    cost = image_cost(settings, config)
    kv = card / gib * utilization - REFERENCE_OTHER_GIB - cost["total_gib"]
    length = settings.max_model_len or REFERENCE_MAX_MODEL_LEN
    need = length * KV_BYTES_PER_TOKEN / gib
    if kv >= need:
        return
    longest = max(0, int(kv * gib / KV_BYTES_PER_TOKEN) // 1024 * 1024)
    util = math.ceil((REFERENCE_OTHER_GIB + cost["total_gib"] + need) / (card / gib) * 100) / 100
    raise EngineConfigError(
        f"engine.vllm.images_per_request: {settings.images_per_request} loads the vision "
        f"tower, which costs {cost['total_gib']:.2f} GiB of this {card / gib:.1f} GiB card "
        f"(weights {cost['tower_gib']:.2f}, encoder cache {cost['encoder_cache_gib']:.2f}, "
        f"encoder activations {cost['activation_gib']:.2f} above the text stack's): about "
        f"{cost['kv_blocks']:.0f} KV blocks, leaving {max(kv, 0):.2f} GiB of KV cache where "
        f"one {length}-token request (max_model_len) needs {need:.2f}; set max_model_len to "
        f"at most {longest}, or gpu_memory_utilization to at least {util} if the card has "
        "the room outside it, or images_per_request 0"
    )

"""What the in-process engine's settings come to on a model and a card: the model's limits
(`check_model`), the CUDA graph sizes, and the card's memory (the stock path's reserve,
FULL graphs' headroom)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from workers.engine.types import EngineConfigError
from workers.engine.vllm.settings import VllmSettings

__all__ = [
    "CARD_ENV",
    "FULL_GRAPHS_HEADROOM_GIB",
    "GRAPH_SIZES",
    "MIN_STOCK_UTILIZATION",
    "REFERENCE_MAX_MODEL_LEN",
    "card_bytes",
    "check_full_graphs",
    "check_model",
    "graph_sizes",
    "stock_utilization",
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
    from workers.engine.models import missing_generation_fields

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
            "with workers.engine.models.write_generation_config"
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
    from workers.engine.vllm_reads.options import GIB, stock_denoise_bytes

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

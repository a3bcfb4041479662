"""A DiffusionGemma model directory that vLLM's config classes accept on the CPU: the
checkpoint's `config.json` and `generation_config.json`, no weights (nothing loads them)."""

from __future__ import annotations

import json
from pathlib import Path

from dgstream.workers.engine.models import DIFFUSION_GENERATION


def write_model_dir(d: Path, vocab: int) -> Path:
    """`d`, holding a DiffusionGemma config of `vocab` ids (the checkpoint's 256-position
    canvas; the served one comes from vLLM's diffusion_config)."""
    config = {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": 256,
        "torch_dtype": "bfloat16",
        "text_config": {"model_type": "diffusion_gemma_text", "vocab_size": vocab},
    }
    (d / "config.json").write_text(json.dumps(config))
    (d / "generation_config.json").write_text(json.dumps(DIFFUSION_GENERATION))
    return d


__all__ = ["write_model_dir"]

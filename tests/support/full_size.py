"""The published DiffusionGemma shape as a model directory vLLM can start with dummy weights
(config and generation config only, no download), bf16 or NVFP4: for the vLLM benchmarks and
the opt-in GPU tests alike."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["NVFP4", "full_size_dir"]

# vLLM's "compressed-tensors" NVFP4 weight-only layout (llm-compressor's nvfp4-pack-quantized):
# 4-bit float weights in groups of 16 with a per-group scale, activations unquantized; the
# router, vision tower and lm_head stay in bf16, as in RedHatAI's NVFP4 checkpoints.
NVFP4 = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "strategy": "tensor_group",
                "group_size": 16,
                "symmetric": True,
                "dynamic": False,
            },
            "input_activations": None,
        }
    },
    "ignore": ["lm_head", "re:.*router.*", "re:.*vision.*"],
}


def full_size_dir(quant: str, root: Path) -> Path:
    """A model directory of the published shape (config and generation config only)."""
    from workers.engine.models import full_size_config, write_generation_config

    config = full_size_config()
    body = config.to_dict()
    body["architectures"] = ["DiffusionGemmaForBlockDiffusion"]
    body["torch_dtype"] = "bfloat16"
    if quant == "nvfp4":
        body["quantization_config"] = NVFP4
    path = root / f"diffusiongemma-full-{quant}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(body, indent=1))
    config.text_config.bos_token_id, config.text_config.eos_token_id = 2, 1
    config.text_config.pad_token_id = 0
    write_generation_config(path, config)
    return path

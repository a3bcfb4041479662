"""The published DiffusionGemma shape as a model directory vLLM can start with dummy weights
(config and generation config only, no download), bf16 or NVFP4: for the vLLM benchmarks and
the opt-in GPU tests alike."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["NVFP4", "full_size_dir", "stable_root"]

# Where the full-size model directories live from one start to the next. vLLM's compile
# cache is keyed by a hash of the model config, and the model's path is one of its factors
# (`ModelConfig.compute_hash` ignores only the tokenizer's and a few others): a directory
# made fresh for each start (mkdtemp) missed the cache on every start.
STABLE_ROOT_ENV = "DGSTREAM_FULL_SIZE_ROOT"


def stable_root() -> Path:
    """The same folder on every start on this machine (DGSTREAM_FULL_SIZE_ROOT to move it)."""
    return Path(os.environ.get(STABLE_ROOT_ENV) or Path(tempfile.gettempdir()) / "dg-full-size")


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
    from dgstream.workers.engine.models import full_size_config, write_generation_config

    config = full_size_config()
    body = config.to_dict()
    body["architectures"] = ["DiffusionGemmaForBlockDiffusion"]
    body["torch_dtype"] = "bfloat16"
    if quant == "nvfp4":
        body["quantization_config"] = NVFP4
    path = root / f"diffusiongemma-full-{quant}"
    path.mkdir(parents=True, exist_ok=True)
    # Atomically: engines started side by side write the same directory.
    tmp = path / f".config.json.{os.getpid()}"
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path / "config.json")
    config.text_config.bos_token_id, config.text_config.eos_token_id = 2, 1
    config.text_config.pad_token_id = 0
    write_generation_config(path, config)
    return path

"""DiffusionGemma-architecture models built here: tiny ones for tests and the embedded
default, and the published full-size shape for GPU benchmarks (random weights).

Nothing is downloaded. A tiny model is built from a fixed seed, written once to the local
cache (`$DGSTREAM_CACHE_DIR`, default `~/.cache/dgstream`) with its tokenizer, and loaded
from there afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dgstream.workers.engine.tokenizer import VOCAB_SIZE, save_pretrained_tokenizer

_BUILD_LOCK = threading.Lock()


@dataclass(frozen=True)
class TinySpec:
    """Shape of a small DiffusionGemma text stack (the vision tower is always minimal)."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    # The published model's window is 1024; prompts here stay shorter than that too, so
    # left-padded batches keep every attention distance (see hf_backend).
    sliding_window: int = 1024
    canvas_length: int = 64
    seed: int = 20261130


# Random weights, for tests that need speed only: ~0.4 M parameters.
TINY_RANDOM = TinySpec(
    name="tiny-random",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    intermediate_size=128,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
)

# --- demo model: trained on the demo task family (topology/demo_tasks/) by
# bench/train_demo_model.py; its weights (fp16, ~7.3 MB, ~3.6 M parameters) and the tokenizer
# it was trained with are committed in workers/engine/weights/demo/ (see TRAINED_DIRS).
DEMO = TinySpec(
    name="demo",
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=192,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=48,
    seed=20261201,
)

SPECS = {TINY_RANDOM.name: TINY_RANDOM, DEMO.name: DEMO}

# Built-in models whose weights are trained and committed (package data): never built here.
TRAINED_DIRS = {DEMO.name: Path(__file__).resolve().parent / "weights" / "demo"}
# --- end demo model


def cache_root() -> Path:
    return Path(os.environ.get("DGSTREAM_CACHE_DIR", Path.home() / ".cache" / "dgstream"))


def _tiny_vision_config() -> dict[str, Any]:
    # Left unset, the config builds Gemma 4's full vision tower (hundreds of MB); this one is
    # a few thousand parameters, untrained: the transformers engine reads images through it
    # (docs/images.md), which proves the path, not an understanding of pictures.
    return {
        "model_type": "gemma4_vision",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "position_embedding_size": 64,
        "patch_size": 4,
        "pooling_kernel_size": 1,
    }


def tiny_config(spec: TinySpec) -> Any:
    from transformers import DiffusionGemmaConfig

    layer_types = ["sliding_attention"] * (spec.num_hidden_layers - 1) + ["full_attention"]
    text = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "global_head_dim": spec.head_dim,
        "num_global_key_value_heads": spec.num_key_value_heads,
        "max_position_embeddings": 4096,
        "sliding_window": spec.sliding_window,
        "layer_types": layer_types,
        "num_experts": spec.num_experts,
        "top_k_experts": spec.top_k_experts,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "enable_moe_block": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    return DiffusionGemmaConfig(
        text_config=text,
        vision_config=_tiny_vision_config(),
        canvas_length=spec.canvas_length,
        # No image tokens exist in the tiny vocabulary; keep the ids inside it anyway.
        boi_token_id=VOCAB_SIZE - 3,
        eoi_token_id=VOCAB_SIZE - 2,
        image_token_id=VOCAB_SIZE - 1,
    )


def full_size_config() -> Any:
    """The published shape of google/diffusiongemma-26B-A4B-it (its config.json, as quoted
    in docs/model.md): 25.25 B parameters, 3.84 B active, ~51 GB in bf16."""
    from transformers import DiffusionGemmaConfig

    layers = 30
    text = {
        "vocab_size": 262_144,
        "hidden_size": 2816,
        "intermediate_size": 2112,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 2,
        "sliding_window": 1024,
        "layer_types": [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
        ],
        "num_experts": 128,
        "top_k_experts": 8,
        "moe_intermediate_size": 704,
        "enable_moe_block": True,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    }
    return DiffusionGemmaConfig(
        text_config=text, vision_config=_tiny_vision_config(), canvas_length=256
    )


# The diffusion fields of generation_config.json, as transformers' own defaults give them
# (`DiffusionGemmaGenerationConfig._get_default_generation_params`). vLLM 0.33 reads the
# file raw and fails to start on a null in any of them (`stability_threshold + 1`, then
# "DiffusionGemma requires an EntropyBound sampler_config"); `save_pretrained` writes
# nulls. A single-step read uses none of them (one read-only step); full denoising does.
DIFFUSION_GENERATION: dict[str, Any] = {
    "max_denoising_steps": 48,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}


def write_generation_config(directory: Path, config: Any) -> Path:
    """Write `directory/generation_config.json` with real diffusion values and the text
    config's special ids (replacing the nulls `save_pretrained` leaves)."""
    import transformers

    text = config.text_config
    body = {
        **DIFFUSION_GENERATION,
        "bos_token_id": text.bos_token_id,
        "eos_token_id": text.eos_token_id,
        "pad_token_id": text.pad_token_id,
        "return_dict_in_generate": True,
        "transformers_version": transformers.__version__,
    }
    path = Path(directory) / "generation_config.json"
    path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return path


def missing_generation_fields(directory: Path) -> list[str]:
    """The diffusion fields vLLM needs that `directory/generation_config.json` lacks or
    holds as null (all of them when the file is missing)."""
    path = Path(directory) / "generation_config.json"
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return list(DIFFUSION_GENERATION)
    return [k for k in DIFFUSION_GENERATION if body.get(k) is None]


def _fingerprint(spec: TinySpec) -> str:
    import tokenizers
    import transformers

    from dgstream.workers.engine import tokenizer

    blob = json.dumps(
        {
            "spec": asdict(spec),
            "tf": transformers.__version__,
            "tk": tokenizers.__version__,
            # The tokenizer is trained on a corpus from these lists: new words, new merges.
            "corpus": [tokenizer._WORDS, tokenizer.VOCAB_SIZE, tokenizer.SPECIAL_TOKENS],
            "generation": DIFFUSION_GENERATION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_tiny_model(name: str = TINY_RANDOM.name, root: Path | None = None) -> Path:
    """Directory holding `name` (config, safetensors, tokenizer); built on first use."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    # --- demo model: trained weights ship with the package; nothing to build.
    if name in TRAINED_DIRS:
        trained = TRAINED_DIRS[name]
        if not (trained / "model.safetensors").exists():
            raise FileNotFoundError(
                f"the {name!r} model's weights are missing from {trained}: train them with "
                f"`python -m bench.train_demo_model --out {trained}`"
            )
        return trained
    # --- end demo model
    spec = SPECS[name]
    directory = (root or cache_root()) / "models" / f"{name}-{_fingerprint(spec)}"
    marker = directory / ".complete"
    if marker.exists():
        return directory
    with _BUILD_LOCK:
        if marker.exists():
            return directory
        tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(spec.seed)
        model = DiffusionGemmaForBlockDiffusion(tiny_config(spec)).eval()
        model.save_pretrained(str(tmp))
        write_generation_config(tmp, model.config)
        save_pretrained_tokenizer(tmp)
        (tmp / ".complete").write_text("ok\n")
        try:
            tmp.rename(directory)
        except OSError:
            # Another process finished first; its copy is identical (same seed and spec).
            if not marker.exists():
                raise
        return directory

"""Images for the vLLM engine: where a read's images go in its vLLM prompt and what vLLM is
given for them, so that vLLM reads the same prompt as the transformers engine.

A read's images reach vLLM as the `multi_modal_data` of a token prompt. The codec lays ONE
image token per image at the read's `shared_prefix_len` (after the question set's system
text, before the user's text: where the transformers engine lays its blocks); Gemma 4's
processor in vLLM (gemma4_mm.py, `_get_prompt_updates`) replaces each with `<boi>`, the
image's soft tokens and `<eoi>`, the same block `workers.engine.vision` lays. Each image is
first resized here to the transformers engine's square (IMAGE_GRID x IMAGE_GRID soft tokens,
bicubic, as `vision.image_patches` resizes), which the processor at `max_soft_tokens` 70
keeps at that size: 64 soft tokens, the same patches. Its uuid for vLLM's caches (processor,
encoder and prefix cache) is the SHA-256 of the bytes received and that size.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from dgstream.workers.engine.types import Read, ReadImage, ReadRejected
from dgstream.workers.engine.vision import IMAGE_GRID
from dgstream.workers.engine.vllm.sizing import MAX_SOFT_TOKENS

__all__ = ["ImageLayout", "multimodal_prompt", "write_processor_files"]


@dataclass(frozen=True)
class ImageLayout:
    """What a model's config says of its images, as the codec needs it."""

    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    patch: int
    pooling: int
    grid: int = IMAGE_GRID

    @classmethod
    def from_config(cls, config: Any) -> ImageLayout | None:
        """From a model's config (a transformers config or its config.json as a dict);
        None for a model without a vision tower."""

        def get(obj: Any, key: str) -> Any:
            return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)

        vision = get(config, "vision_config")
        ids = [get(config, k) for k in ("image_token_id", "boi_token_id", "eoi_token_id")]
        if vision is None or None in ids:
            return None
        return cls(
            image_token_id=int(ids[0]),
            boi_token_id=int(ids[1]),
            eoi_token_id=int(ids[2]),
            patch=int(get(vision, "patch_size")),
            pooling=int(get(vision, "pooling_kernel_size") or 1),
        )

    @property
    def pixels(self) -> int:
        """The side of the square every image is resized to."""
        return self.grid * self.pooling * self.patch

    @property
    def tokens_per_image(self) -> int:
        """Prompt tokens an image takes once vLLM expands it: `<boi>`, grid^2, `<eoi>`."""
        return self.grid * self.grid + 2

    def square(self, image: Any) -> Image.Image:
        """`image` (RGB) as the transformers engine sees it: the square of `pixels`."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        side = self.pixels
        if rgb.size != (side, side):
            rgb = rgb.resize((side, side), Image.Resampling.BICUBIC)
        return rgb

    def uuid(self, image: ReadImage) -> str:
        # The bytes received and the size they were read at: equal uuids are equal inputs.
        return f"sha256:{image.sha256}@{self.pixels}px"

    def prompt_ids(self, read: Read, index: int = 0) -> list[int]:
        """The read's token prompt with one image token per image at its shared prefix's
        end; `ReadRejected` when an image token id already stands before that point (vLLM
        expands the first matches of the id, in order: in the demo vocabulary the id is the
        word " Day", which a question may hold)."""
        at = read.shared_prefix_len
        ids = [int(t) for t in read.prompt_ids]
        if self.image_token_id in ids[:at]:
            raise ReadRejected(
                index,
                f"read {read.tag!r}: the image token id {self.image_token_id} appears in the "
                "prompt before the images (vLLM would put an image there)",
            )
        return [*ids[:at], *[self.image_token_id] * len(read.images), *ids[at:]]

    def expanded(self, read: Read) -> list[int]:
        """The prompt vLLM reads once it has expanded the images (the transformers
        engine's `VisionInput.expand` of the same read)."""
        at = read.shared_prefix_len
        block = [self.boi_token_id, *[self.image_token_id] * self.grid**2, self.eoi_token_id]
        ids = [int(t) for t in read.prompt_ids]
        return [*ids[:at], *block * len(read.images), *ids[at:]]


def multimodal_prompt(read: Read, layout: ImageLayout, index: int = 0) -> dict[str, Any]:
    """vLLM's `TokensPrompt` (a dict) of a read with images."""
    return {
        "prompt_token_ids": layout.prompt_ids(read, index),
        "multi_modal_data": {"image": [layout.square(im.image) for im in read.images]},
        "multi_modal_uuids": {"image": [layout.uuid(im) for im in read.images]},
    }


# What Gemma 4's processor needs beside a checkpoint that lacks its processor files (the
# demo model): transformers 5.20's Gemma4Processor builds from `processor_config.json`, an
# image processor and an (unused) audio feature extractor from `preprocessor_config.json`,
# a video processor, and a tokenizer naming its image tokens; its input check reads
# `boa_token`/`eoa_token` even with no audio (`validate_inputs`), so they are named too.
def write_processor_files(model_dir: str | Path, out_dir: str | Path) -> Path:
    """A copy of `model_dir` with the processor files vLLM's multimodal path reads, for a
    checkpoint that has none (the demo model); the image tokens named are the config's ids,
    and the tower's config gets the default budget vLLM reads. Returns `out_dir`."""
    src, out = Path(model_dir), Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    layout = ImageLayout.from_config(config)
    if layout is None:
        raise ValueError(f"{model_dir}: no vision tower in config.json")
    # vLLM reads the tower's default budget unconditionally (gemma4_mm.py,
    # `get_mm_max_tokens_per_item`), and transformers 5.20's Gemma4VisionConfig has no such
    # field: Gemma 4's checkpoints write 280 (its processor's default image budget). The
    # engine's `max_soft_tokens` 70 overrides it for every image.
    vision = config["vision_config"]
    if "default_output_length" not in vision:
        vision["default_output_length"] = 280
        (out / "config.json").write_text(json.dumps(config, indent=2))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src))
    names = tokenizer.convert_ids_to_tokens(
        [layout.image_token_id, layout.boi_token_id, layout.eoi_token_id]
    )
    tok_path = out / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    extra = tok.get("extra_special_tokens") or {}
    if isinstance(extra, list):  # transformers takes a list or named tokens, not both
        extra = {}
    unk = tok.get("unk_token") or "<unk>"
    extra.update(
        {
            "image_token": names[0],
            "boi_token": names[1],
            "eoi_token": names[2],
            "audio_token": unk,
            "boa_token": unk,
            "eoa_token": unk,
        }
    )
    tok["extra_special_tokens"] = extra
    tok_path.write_text(json.dumps(tok, indent=2))
    sizes = {"patch_size": layout.patch, "pooling_kernel_size": layout.pooling}
    processor = {"processor_class": "Gemma4Processor"}
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Gemma4ImageProcessor",
                "feature_extractor_type": "Gemma4AudioFeatureExtractor",
                "max_soft_tokens": MAX_SOFT_TOKENS,
                **sizes,
                **processor,
            },
            indent=2,
        )
    )
    (out / "video_preprocessor_config.json").write_text(
        json.dumps({"video_processor_type": "Gemma4VideoProcessor", **sizes, **processor})
    )
    (out / "processor_config.json").write_text(
        json.dumps({**processor, "image_seq_length": layout.grid**2})
    )
    return out

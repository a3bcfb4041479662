"""Images for the transformers engine: pixels to the vision tower's patches, the placeholder
tokens a prompt carries for them, and a fix to the tower for checkpoints that do not pool.

Preprocessing is fixed and deterministic: every image is resized (Pillow, bicubic, as Gemma
4's own processor resamples) to a square of `IMAGE_GRID` x `IMAGE_GRID` soft tokens, that is
`IMAGE_GRID * pooling_kernel_size` patches a side, scaled to [0, 1] (the patch embedder
maps that to [-1, 1] itself) and cut into patches the way Gemma 4's processor cuts them:
patches row by row, each patch its rows of pixels, each pixel R, G, B; its (x, y) position
beside it. A square of one size, whatever the image, keeps every image at the same number
of tokens: a prompt's length follows from its count of images, the tower's batch has no
padding, and no side can outgrow the tower's table of patch positions (Gemma 4's
aspect-preserving resize at its smallest budget, 70 tokens, makes a 1000 x 10 image 70
patches wide: past the demo tower's 64 positions). The price is the aspect ratio, which a
square stretches.

In a prompt, image `i` is `<boi>` + `IMAGE_GRID**2` x `<image>` + `<eoi>` (Gemma 4's
processor writes the same block for an image), the images in order, laid just before the
user's text (`Read.images`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from dgstream.workers.engine.types import ReadImage

# The read path inside vLLM imports only itself, so the fix both engines need lives there.
from dgstream.workers.engine.vllm_reads.tower import fix_unpooled_mask

__all__ = ["IMAGE_GRID", "VisionInput", "image_patches"]

# Soft tokens a side: 8 x 8 = 64 tokens an image. From the demo tower (patch 4, no pooling:
# a 32 x 32 pixel image) and the demo model's text stack: 8 images, the request limit, take
# 8 x 66 = 528 prompt tokens, which beside the demo family's prompts (91 to 293 tokens in
# 100 held-out requests) and its 64-wide canvas (885 at most) stays inside the 1024-token
# sliding window, so a batch keeps its exact left-padded encoding
# (`TransformersEngine._exact_groups`). It is just under Gemma 4's smallest processor
# budget (70 soft tokens) and far inside the tower's 64 positions a side.
IMAGE_GRID = 8


def image_patches(image: Image.Image, patch: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """`image` (RGB) resized to `side` x `side` patches of `patch` pixels: the patches
    (side*side, patch*patch*3) in [0, 1], row by row, and each one's (x, y)."""
    px = side * patch
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    if rgb.size != (px, px):
        rgb = rgb.resize((px, px), Image.Resampling.BICUBIC)
    a = np.asarray(rgb, dtype=np.float32) / 255.0  # (px, px, 3): rows, columns, channel
    # (row, y in patch, column, x in patch, channel) -> (row, column, y, x, channel)
    cut = a.reshape(side, patch, side, patch, 3).transpose(0, 2, 1, 3, 4)
    pixels = cut.reshape(side * side, patch * patch * 3)
    ys, xs = np.divmod(np.arange(side * side), side)
    return pixels, np.stack([xs, ys], axis=-1).astype(np.int64)


class VisionInput:
    """What a model with a vision tower needs of a read's images (None from `for_model`
    when the model has none)."""

    def __init__(
        self,
        *,
        patch: int,
        pooling: int,
        boi_id: int,
        eoi_id: int,
        image_id: int,
        grid: int = IMAGE_GRID,
        cache_entries: int = 256,
    ) -> None:
        self.patch = patch
        self.pooling = pooling
        self.grid = grid
        self.side = grid * pooling  # patches a side
        self.tokens_per_image = grid * grid
        self.block: tuple[int, ...] = (boi_id, *[image_id] * self.tokens_per_image, eoi_id)
        # Preprocessed pixels by SHA-256: a request's later stages and extra reads send the
        # same images again, and resizing a large photo costs tens of milliseconds.
        self._cache: OrderedDict[str, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._entries = cache_entries
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model: Any) -> VisionInput | None:
        config = model.config
        vision = getattr(config, "vision_config", None)
        tower = getattr(getattr(model.model, "encoder", None), "vision_tower", None)
        ids: list[Any] = [
            getattr(config, k, None) for k in ("boi_token_id", "eoi_token_id", "image_token_id")
        ]
        if vision is None or tower is None or None in ids:
            return None
        pooling = int(getattr(vision, "pooling_kernel_size", 1) or 1)
        out = cls(
            patch=int(vision.patch_size),
            pooling=pooling,
            boi_id=int(ids[0]),
            eoi_id=int(ids[1]),
            image_id=int(ids[2]),
        )
        table = int(getattr(vision, "position_embedding_size", out.side))
        if out.side > table:
            return None  # the tower cannot place that many patches a side
        fix_unpooled_mask(tower)
        return out

    def image_positions(self, at: int, count: int) -> list[int]:
        """Where the `<image>` tokens of `count` images laid at `at` sit in the prompt."""
        step = len(self.block)
        return [at + k * step + 1 + j for k in range(count) for j in range(self.tokens_per_image)]

    def expand(self, prompt: Sequence[int], at: int, count: int) -> tuple[int, ...]:
        """`prompt` with the blocks of `count` images laid at `at`."""
        return (*prompt[:at], *self.block * count, *prompt[at:])

    def pixels(self, images: Sequence[ReadImage]) -> tuple[np.ndarray, np.ndarray]:
        """The tower's input for `images`: patches (n, side*side, patch*patch*3) and
        positions (n, side*side, 2)."""
        got = [self._one(im) for im in images]
        return np.stack([g[0] for g in got]), np.stack([g[1] for g in got])

    def _one(self, image: ReadImage) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            hit = self._cache.get(image.sha256)
            if hit is not None:
                self._cache.move_to_end(image.sha256)
                return hit
        out = image_patches(image.image, self.patch, self.side)
        with self._lock:
            self._cache[image.sha256] = out
            if len(self._cache) > self._entries:
                self._cache.popitem(last=False)
        return out

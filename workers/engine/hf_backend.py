"""The transformers backend: `DiffusionGemmaForBlockDiffusion`, one decoder pass per read.

How a batch of reads runs (numbered as in `_read_sync`):
1. Reads with the same prompt and images share one encoder pass (several samples of a
   request). A read's images (`Read.images`, when the model has a vision tower) become
   placeholder blocks laid into its prompt just before the user's text
   (`workers.engine.vision`); the tower's soft tokens replace the placeholders' embeddings
   in the same encoder pass, at the positions the engine laid them (not wherever the
   image token's id appears: in the demo vocabulary that id is also the word " Day").
2. Prompts with the same shared prefix (chat header + system text of a question set) reuse
   that prefix's KV cache, computed once and kept in a small LRU; only the suffixes (the
   user turns) are encoded, batched and LEFT-padded. Left padding keeps every distance
   between real tokens and between tokens and the canvas as in an unbatched read, so
   sliding windows cut the same; explicit position ids keep rotary positions the same; the
   padded cache entries are masked for the encoder and the decoder.
3. Canvases go through ONE decoder pass with bidirectional attention over the cache and the
   canvas, no self-conditioning (the first step), grouped by canvas width.
4. Only the slot rows of the final hidden states go through the output projection. By
   default the full vocabulary at those rows (gives the label mass and whether the argmax
   is a label); with `label_rows_only` just the labels' rows (exact for the label
   distribution: softcapping is per logit, the softmax is over the labels only).

The decoder reads the cache without writing it (`append_to_cache` concatenates), so one
cache serves any number of canvases.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgstream.workers.engine.reading import slot_read_from_label_logits
from dgstream.workers.engine.types import (
    EngineInfo,
    FatalEngineError,
    Read,
    ReadImage,
    ReadRejected,
    ReadResult,
    RecoverableEngineError,
    SlotRead,
)
from dgstream.workers.engine.vision import VisionInput

# A prompt as the encoder sees it is named by its text prompt and its images' hashes: two
# requests with the same text and different images must not share an encoder pass.
_Key = tuple[tuple[int, ...], tuple[str, ...]]


def _torch() -> Any:
    import torch

    return torch


@dataclass(frozen=True)
class _Prompt:
    """One distinct prompt of a batch, as the encoder sees it."""

    ids: tuple[int, ...]  # the text prompt with the images' blocks laid in
    shared: int  # the read's shared_prefix_len (the images come after it)
    images: tuple[ReadImage, ...] = ()
    image_at: tuple[int, ...] = ()  # positions in `ids` of the image tokens, in order


class TransformersEngine:
    """In-process engine over a `DiffusionGemmaForBlockDiffusion` (CPU or CUDA)."""

    def __init__(
        self,
        model: Any,
        *,
        model_name: str,
        max_batch_reads: int = 64,
        prefix_cache_entries: int = 16,
        reuse_prefix: bool = True,
        label_rows_only: bool = False,
    ) -> None:
        self.model = model.eval()
        self.text_config = model.config.text_config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_batch_reads = max_batch_reads
        self.reuse_prefix = reuse_prefix
        self.label_rows_only = label_rows_only
        self._prefix_cache: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._prefix_entries = prefix_cache_entries
        self._softcap = float(self.text_config.final_logit_softcapping or 0.0)
        self._window = int(self.text_config.sliding_window or 0)
        self._vision = VisionInput.for_model(model)
        # One forward at a time: the model is not re-entrant and owns the device.
        self._lock = threading.Lock()
        self._info = EngineInfo(
            backend="transformers",
            model=model_name,
            canvas_length=int(model.config.canvas_length or 256),
            vocab_size=int(self.text_config.vocab_size),
            device=str(self.device),
            reads_images=self._vision is not None,
            image_tokens=0 if self._vision is None else len(self._vision.block),
        )
        self.stats: dict[str, int] = defaultdict(int)
        # No `torch.set_grad_enabled(False)` here: it would switch autograd off for the
        # caller's thread (a training script that checks parity, then trains on). Reads run
        # under `inference_mode` in `read_sync`.

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, device: str = "auto", dtype: str | None = None, **kwargs: Any
    ) -> TransformersEngine:
        torch = _torch()
        from transformers import DiffusionGemmaForBlockDiffusion

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype is None:
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        model: Any = DiffusionGemmaForBlockDiffusion.from_pretrained(
            str(path), dtype=getattr(torch, dtype)
        )
        model = model.to(device)
        return cls(model, model_name=Path(path).name, **kwargs)

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
        if not reads:
            return []
        return await asyncio.to_thread(self.read_sync, reads)

    async def close(self) -> None:
        self._prefix_cache.clear()

    # ------------------------------------------------------------------ sync core

    def read_sync(self, reads: Sequence[Read]) -> list[ReadResult]:
        torch = _torch()
        try:
            with self._lock, torch.inference_mode():
                out: list[ReadResult] = []
                for start in range(0, len(reads), self.max_batch_reads):
                    out.extend(self._read_batch(reads[start : start + self.max_batch_reads]))
                return out
        except torch.OutOfMemoryError as exc:
            self._prefix_cache.clear()
            raise RecoverableEngineError(f"out of device memory: {exc}") from exc
        except (RuntimeError, ValueError, IndexError) as exc:
            raise FatalEngineError(f"{type(exc).__name__}: {exc}") from exc

    def _read_batch(self, reads: Sequence[Read]) -> list[ReadResult]:
        torch = _torch()
        t0 = time.perf_counter()
        # 1. unique prompts (text and images)
        keys: list[_Key] = [(r.prompt_ids, tuple(im.sha256 for im in r.images)) for r in reads]
        prompts: dict[_Key, _Prompt] = {}
        for i, (r, key) in enumerate(zip(reads, keys, strict=True)):
            if key not in prompts:
                prompts[key] = self._prompt(i, r)
        # 2. encode, grouped by shared prefix
        by_prefix: dict[tuple[int, ...], list[_Key]] = defaultdict(list)
        for key, p in prompts.items():
            n = p.shared if self.reuse_prefix else 0
            by_prefix[p.ids[:n]].append(key)
        # A prefix seen once in this batch and not cached saves nothing: encoding it alone
        # would cost an extra pass. Such prompts are encoded whole, batched together.
        lone = [
            pre
            for pre, group in by_prefix.items()
            if pre and len(group) == 1 and pre not in self._prefix_cache
        ]
        for pre in lone:
            by_prefix[()].extend(by_prefix.pop(pre))
        encoded: dict[_Key, tuple[Any, int, Any, int]] = {}
        for prefix, group in by_prefix.items():
            for sub in self._exact_groups(group, prompts, reads):
                cache, mask, lengths = self._encode(prefix, [prompts[k] for k in sub])
                for row, key in enumerate(sub):
                    encoded[key] = (cache, row, mask, lengths[row])
        t1 = time.perf_counter()
        # 3. decode: group reads by (encoder batch, canvas width)
        results: list[ReadResult | None] = [None] * len(reads)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, r in enumerate(reads):
            cache = encoded[keys[i]][0]
            groups[(id(cache), len(r.canvas_ids))].append(i)
        for (_, width), idxs in groups.items():
            cache, _, mask, _ = encoded[keys[idxs[0]]]
            rows = torch.tensor([encoded[keys[i]][1] for i in idxs], device=self.device)
            lengths = torch.tensor([encoded[keys[i]][3] for i in idxs], device=self.device)
            canvas = torch.tensor([reads[i].canvas_ids for i in idxs], device=self.device)
            identity = len(idxs) == mask.shape[0] and all(
                encoded[keys[i]][1] == k for k, i in enumerate(idxs)
            )
            # The decoder only reads the cache, so the encoder's batch serves as is.
            sel = cache if identity else _select_rows(cache, rows)
            key_mask = mask[rows]
            dec_mask = None
            if not bool(key_mask.all()):  # an all-ones mask lets attention skip masking
                ones = torch.ones(len(idxs), width, dtype=mask.dtype, device=self.device)
                dec_mask = torch.cat([key_mask, ones], dim=1)
            positions = lengths[:, None] + torch.arange(width, device=self.device)[None, :]
            hidden = self.model.model.decoder(
                decoder_input_ids=canvas,
                past_key_values=sel,
                decoder_attention_mask=dec_mask,
                decoder_position_ids=positions,
            ).last_hidden_state
            # 4. slot rows only
            slot_rows = [(b, s) for b, i in enumerate(idxs) for s in reads[i].slots]
            h = hidden[
                torch.tensor([b for b, _ in slot_rows], device=self.device),
                torch.tensor([s.position for _, s in slot_rows], device=self.device),
            ]
            per_slot = self._slot_reads(h, [s for _, s in slot_rows])
            k = 0
            for i in idxs:
                n = len(reads[i].slots)
                results[i] = ReadResult(tuple(per_slot[k : k + n]))
                k += n
            self.stats["decoder_rows"] += len(idxs)
        t2 = time.perf_counter()
        self.stats["batches"] += 1
        self.stats["encoded_prompts"] += len(prompts)
        timings = {"encode_ms": (t1 - t0) * 1e3, "decode_ms": (t2 - t1) * 1e3}
        return [ReadResult(r.slots, timings) for r in results if r is not None]

    def _prompt(self, index: int, read: Read) -> _Prompt:
        """The read's prompt as the encoder sees it: its text prompt, and its images' blocks
        laid at its shared prefix's end (`Read.images`)."""
        if not read.images:
            return _Prompt(read.prompt_ids, read.shared_prefix_len)
        if self._vision is None:  # the worker's gate refuses these first; never guess
            raise ReadRejected(index, f"{self._info.model} has no vision tower to read images")
        at, n = read.shared_prefix_len, len(read.images)
        return _Prompt(
            self._vision.expand(read.prompt_ids, at, n),
            at,
            read.images,
            tuple(self._vision.image_positions(at, n)),
        )

    def prompt_ids(self, read: Read) -> tuple[int, ...]:
        """The ids the encoder reads for `read` (its image tokens included)."""
        return self._prompt(0, read).ids

    def _exact_groups(
        self, group: list[_Key], prompts: dict[_Key, _Prompt], reads: Sequence[Read]
    ) -> list[list[_Key]]:
        """Split prompts so that left padding cannot move a token out of a sliding window:
        exact while prompt + canvas fits the window, else batch equal lengths only."""
        widest = max(len(r.canvas_ids) for r in reads)
        longest = max(len(prompts[k].ids) for k in group)
        if not self._window or longest + widest < self._window:
            return [group]
        by_len: dict[int, list[_Key]] = defaultdict(list)
        for k in group:
            by_len[len(prompts[k].ids)].append(k)
        return list(by_len.values())

    def _encode(
        self, prefix: tuple[int, ...], prompts: list[_Prompt]
    ) -> tuple[Any, Any, list[int]]:
        """Encode `prompts` (all starting with `prefix`) into one batched cache.

        Returns the cache, the key mask over the cached positions (batch, cached) and each
        prompt's true length."""
        torch = _torch()
        from transformers import DynamicCache

        encoder = self.model.model.encoder
        b = len(prompts)
        base: Any
        if prefix:
            base = self._prefix_kv(prefix)
            cache = _broadcast(base, b)
        else:
            cache = DynamicCache(config=self.text_config)
        suffixes = [p.ids[len(prefix) :] for p in prompts]
        width = max(len(s) for s in suffixes)
        ids = torch.full((b, width), 0, dtype=torch.long, device=self.device)
        mask = torch.zeros(b, len(prefix) + width, dtype=torch.long, device=self.device)
        pos = torch.zeros(b, width, dtype=torch.long, device=self.device)
        mask[:, : len(prefix)] = 1
        for row, s in enumerate(suffixes):
            pad = width - len(s)
            ids[row, pad:] = torch.tensor(s, device=self.device)
            mask[row, len(prefix) + pad :] = 1
            pos[row, pad:] = torch.arange(len(prefix), len(prefix) + len(s), device=self.device)
        if width:
            padded = not bool(mask.all())
            # Text only: the ids, as always. With images: the ids' embeddings with the
            # tower's soft tokens put in place of the image tokens (the encoder embeds ids
            # the same way itself, so nothing else changes).
            text: dict[str, Any] = {"input_ids": ids}
            if any(p.images for p in prompts):
                text = {"inputs_embeds": self._embed_with_images(ids, prompts, len(prefix))}
            encoder(
                **text,
                # Without padding the default (causal, positions after the cache) is exact
                # and lets attention use its unmasked kernels.
                attention_mask=mask if padded else None,
                position_ids=pos if padded else None,
                past_key_values=cache,
            )
        self.stats["encoded_tokens"] += int(mask[:, len(prefix) :].sum())
        return cache, mask, [len(p.ids) for p in prompts]

    def _embed_with_images(self, ids: Any, prompts: list[_Prompt], skip: int) -> Any:
        """The embeddings of the left-padded `ids` (the prompts less their first `skip`
        tokens), each image token's row replaced by its image's soft token, in order."""
        torch = _torch()
        assert self._vision is not None  # _prompt refuses images without a tower
        encoder = self.model.model.encoder
        embeds = encoder.get_input_embeddings()(ids)
        rows: list[int] = []
        cols: list[int] = []
        images: list[ReadImage] = []
        width = ids.shape[1]
        for row, p in enumerate(prompts):
            pad = width - (len(p.ids) - skip)
            rows += [row] * len(p.image_at)
            cols += [pad + at - skip for at in p.image_at]
            images += p.images
        pixels, positions = self._vision.pixels(images)
        features = encoder.get_image_features(
            torch.from_numpy(pixels).to(self.device),
            torch.from_numpy(positions).to(self.device),
            return_dict=True,
        ).pooler_output
        if features.shape[0] != len(rows):  # a tower that drops or adds soft tokens
            raise ValueError(f"{features.shape[0]} soft tokens for {len(rows)} image tokens")
        embeds[torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)] = (
            features.to(embeds.dtype)
        )
        self.stats["encoded_images"] += len(images)
        return embeds

    def _prefix_kv(self, prefix: tuple[int, ...]) -> Any:
        torch = _torch()
        from transformers import DynamicCache

        hit = self._prefix_cache.get(prefix)
        if hit is not None:
            self._prefix_cache.move_to_end(prefix)
            self.stats["prefix_hits"] += 1
            return hit
        cache = DynamicCache(config=self.text_config)
        ids = torch.tensor([prefix], device=self.device)
        self.model.model.encoder(input_ids=ids, past_key_values=cache)
        self.stats["prefix_misses"] += 1
        self.stats["encoded_tokens"] += len(prefix)
        self._prefix_cache[prefix] = cache
        if len(self._prefix_cache) > self._prefix_entries:
            self._prefix_cache.popitem(last=False)
        return cache

    def _slot_reads(self, h: Any, slots: Sequence[Any]) -> list[SlotRead]:
        """Label logits (and, unless label rows only, the full log-sum-exp and max) at the
        slot rows; only small arrays leave the device."""
        torch = _torch()
        k_max = max(len(s.label_ids) for s in slots)
        ids = torch.tensor(
            [list(s.label_ids) + [0] * (k_max - len(s.label_ids)) for s in slots],
            device=self.device,
        )
        cap = self._softcap

        def softcap(x: Any) -> Any:
            x = x.to(torch.float32)
            return torch.tanh(x / cap) * cap if cap else x

        lse = mx = None
        if self.label_rows_only:
            # Each slot against its own label rows only: (n, k) from (n, d) x (n, k, d).
            weight = self.model.lm_head.weight
            labels = softcap(torch.einsum("nd,nkd->nk", h, weight[ids]))
        else:
            full = softcap(self.model.lm_head(h))
            labels = full.gather(1, ids)
            lse = torch.logsumexp(full, dim=-1).cpu().numpy()
            mx = full.max(dim=-1).values.cpu().numpy()
        label_np = labels.cpu().numpy()
        out: list[SlotRead] = []
        for i, s in enumerate(slots):
            out.append(
                slot_read_from_label_logits(
                    s.question_id,
                    label_np[i, : len(s.label_ids)],
                    None if lse is None else float(lse[i]),
                    None if mx is None else float(mx[i]),
                )
            )
        return out


def _remap(cache: Any, fn: Callable[[Any], Any]) -> Any:
    """A new cache whose key and value tensors are `fn` of `cache`'s (the source is left
    unchanged: the decoder and later batches may still read it)."""
    new = copy.copy(cache)
    layers = []
    for layer in cache.layers:
        nl = copy.copy(layer)
        ready = getattr(layer, "is_initialized", False) and layer.keys is not None
        if ready and layer.keys.numel():
            nl.keys, nl.values = fn(layer.keys), fn(layer.values)
        layers.append(nl)
    new.layers = layers
    return new


def _select_rows(cache: Any, rows: Any) -> Any:
    """The cache's batch rows `rows` (a copy)."""
    return _remap(cache, lambda t: t.index_select(0, rows))


def _broadcast(cache: Any, batch: int) -> Any:
    """A batch-`batch` view of a batch-1 cache (no copy until the encoder appends)."""
    return _remap(cache, lambda t: t.expand(batch, *t.shape[1:]))


__all__ = ["TransformersEngine"]

"""What a vLLM engine is told about the project's read path, and the arithmetic around it.

The in-process engine (`workers.engine.vllm.args`) turns the read path on per engine
through vLLM's free-form `additional_config` (`--additional-config` for `vllm serve`), under
one key; nothing else in a vLLM deployment changes. This module imports neither vLLM nor
torch, so the settings side (and CI) can use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# The key under vLLM's `additional_config` (a dict vLLM carries to every process untouched).
CONFIG_KEY = "dgstream_read_path"
# The plugin's entry point: group and name (pyproject's [project.entry-points]).
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "dgstream_reads"
# The vLLM release the read path was written against and checked on (its model, model
# state and sampler internals are not a public API).
SUPPORTED_VLLM = "0.33"
# A request's opt-out of one-step reads (`VllmSettings.one_step_reads`), in its sampling
# params' `extra_args`: vLLM passes keys it does not know to the engine untouched; the
# engine's codec writes it, the plugin's scheduler reads it.
TWO_STEP_KEY = "dgstream_two_step"

GIB = 2**30
MIB = 2**20
# Bytes a full-vocabulary logit row costs while it is being read: the unembedding's bf16
# output (2), the fp32 softcapped copy (4) and logsumexp's fp32 exponentials (4), plus the
# 1-byte comparison mask of the rank: 11 bytes per vocabulary entry.
VOCAB_ROW_BYTES_PER_ID = 11


class ReadPathOptions(BaseModel):
    """The read path's settings, as the engine passes them in `additional_config`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = False
    # The most memory one tile of full-vocabulary reads may hold (unconstrained reads, and
    # vLLM's own warmup requests). 256 MiB is about 1% of a 24 GB card; at 262,144 ids it is
    # 93 canvas rows a tile (`vocab_tile_rows`), more than one 64-position canvas, so a tile
    # is never smaller than one read. Constrained reads never reach it.
    logits_tile_mib: int = Field(default=256, ge=16, le=16_384)
    # The user's max_num_seqs, kept over vLLM's DiffusionGemma hook (which lowers any value
    # >= 128 to 8 because its own sampler holds [reads x canvas x vocabulary] fp32 copies;
    # the read path holds one bounded tile). None: leave vLLM's value.
    max_num_seqs: int | None = Field(default=None, gt=0)
    # One-step reads: a seeded single-step read's canvas runs in the step that finishes its
    # prompt (`scheduler.DgOneStepScheduler`), one forward pass instead of two. Needs async
    # scheduling and vLLM's TRITON_ATTN backend (its bidirectional-range mask); under FULL
    # CUDA graphs the ranges go through one persistent buffer (`DgModelState.prepare_attn`).
    one_step: bool = False
    # With one_step: fuse only in steps that leave no request waiting (one_step_reads
    # "auto"): a backlog reads at least as fast in vLLM's two steps, a lone read faster in
    # one (the figures: VllmSettings.one_step_reads).
    one_step_idle_only: bool = False
    # Steps of at most this many tokens that mix prompts and canvases replay one FULL CUDA
    # graph under vLLM's FULL_AND_PIECEWISE mode instead of running piecewise (`graphs`);
    # 0: vLLM's own graphs. Where it comes from: VllmSettings.full_graph_tokens.
    full_graph_tokens: int = Field(default=0, ge=0)

    @classmethod
    def from_additional_config(cls, additional: Mapping[str, Any] | None) -> ReadPathOptions:
        """The options under `CONFIG_KEY`, or the defaults (read path off) when absent.

        A malformed entry is an error naming the key: vLLM would otherwise start a stock
        engine the user did not ask for."""
        body = (additional or {}).get(CONFIG_KEY)
        if body is None:
            return cls()
        if not isinstance(body, Mapping):
            raise ValueError(f"additional_config.{CONFIG_KEY} must be a mapping, got {body!r}")
        try:
            return cls.model_validate(dict(body))
        except ValidationError as exc:
            raise ValueError(f"additional_config.{CONFIG_KEY}: {exc}") from None

    def as_additional_config(self) -> dict[str, Any]:
        return {CONFIG_KEY: self.model_dump()}


def vocab_tile_rows(tile_mib: int, vocab_size: int) -> int:
    """Canvas rows a full-vocabulary tile holds within `tile_mib` (at least one)."""
    return max(1, (tile_mib * MIB) // (vocab_size * VOCAB_ROW_BYTES_PER_ID))


def warmup_denoise_rows(max_num_seqs: int, max_num_batched_tokens: int, canvas: int) -> int:
    """Canvas rows of the denoise step vLLM 0.33's kernel warmup runs after sizing the KV
    cache: `min(max_num_seqs, max_num_batched_tokens // (canvas + 1))` requests
    (`vllm/v1/worker/gpu/warmup.py`: a request's decode query is canvas + 1 tokens) of one
    served canvas each."""
    requests = min(max_num_seqs, max_num_batched_tokens // (canvas + 1))
    return max(1, requests) * canvas


# What one stock denoise row holds at the warmup's peak, read from vLLM 0.33's
# DiffusionGemma: the bf16 unembedding output (2 bytes) and its fp32 softcapped copy (4),
# both [rows, vocabulary], live together in `compute_logits`. Measured on an emulated 24 GB
# card (2026-12-02): 127 reads x 16 positions failed to allocate exactly that fp32 copy,
# 1.98 GiB, at gpu_memory_utilization 0.9.
STOCK_ROW_BYTES_PER_ID = 6


def stock_denoise_bytes(
    max_num_seqs: int, max_num_batched_tokens: int, canvas: int, vocab_size: int
) -> int:
    """What stock vLLM's first denoise step allocates beyond its memory profile (which runs
    no canvas): the settings must leave it free when the read path is off."""
    rows = warmup_denoise_rows(max_num_seqs, max_num_batched_tokens, canvas)
    return rows * vocab_size * STOCK_ROW_BYTES_PER_ID

"""vLLM 0.33 as the engine: DiffusionGemma single-step reads, in-process or over HTTP.

A `Read` becomes one ordinary vLLM request: the prompt is the token ids, and the sampling
params carry the label union as `logprob_token_ids` and the canvas in `extra_args`. vLLM
validates those keys at admission, before anything reaches the GPU; a refusal is a
`ReadRejected`. Each slot's distribution is the softmax over its own label logprobs, exact
in constrained and unconstrained mode alike. What vLLM's logprobs hold for such a read, as
read from its code, is in docs/vllm.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.engine.types import (
    EngineConfigError,
    EngineInfo,
    EngineUnavailable,
    FatalEngineError,
    Read,
    ReadRejected,
    ReadResult,
    RecoverableEngineError,
    Slot,
    SlotRead,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from vllm import SamplingParams

log = logging.getLogger(__name__)

# vllm/sampling_params.py: MAX_LOGPROB_TOKEN_IDS = 128 ("Upper bound on
# `SamplingParams.logprob_token_ids` list length"); `_validate_logprobs` refuses more.
MAX_LOGPROB_TOKEN_IDS = 128
# The vocabulary of google/diffusiongemma-26B-A4B-it (its config.json, text_config.vocab_size).
DIFFUSION_GEMMA_VOCAB = 262_144
# vLLM 0.33 resets DiffusionGemma's max_num_seqs to 8 from 128 up (see VllmSettings):
# the most its own read path keeps.
MAX_NUM_SEQS = 127
# With the project's read path: reads in flight by default, and a bound (vLLM's scheduler
# keeps a few tensors of max_num_seqs x canvas; 1024 is four times the default).
READ_PATH_SEQS = 256
MAX_READ_PATH_SEQS = 1024


class VllmSettings(BaseModel):
    """Engine settings for ONE 24 GB card hosting the NVFP4 DiffusionGemma checkpoint.

    The reference run (docs/model.md): an RTX 3090, max_model_len 16384,
    the TRITON_ATTN backend, canvas_length 64, about 21.5 of 24 GB in use.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The quantized checkpoint reported to fit one 24 GB card (docs/model.md).
    model: str = "RedHatAI/diffusiongemma-26B-A4B-it-NVFP4"
    tokenizer: str | None = None
    revision: str | None = None
    # The reported run's canvas_length. 64 positions hold the answer template of a few
    # questions; vLLM schedules this many tokens per running request per step
    # (`VllmConfig.num_speculative_tokens` returns it).
    canvas_length: int = Field(default=64, gt=0)
    # The reported run's max_model_len (16,384) when None; with a local model directory it
    # is capped at the model's max_position_embeddings, and an explicit value above that is
    # refused at start (`check_model`).
    max_model_len: int | None = Field(default=None, gt=0)
    # The reported run's backend; in 0.33 it is the engine arg `attention_backend`
    # (`--attention-backend`, vllm/engine/arg_utils.py, validated by
    # `AttentionConfig.validate_backend_before`). 0.33 has no VLLM_ATTENTION_BACKEND env var.
    attention_backend: str = "TRITON_ATTN"
    # The system text (questions, instructions, labels) repeats across requests.
    enable_prefix_caching: bool = True
    # vLLM checks `logprob_token_ids` against MAX_LOGPROB_TOKEN_IDS (128), not max_logprobs
    # (`SamplingParams._validate_logprobs`); max_logprobs bounds a top-k `logprobs=n`, which a
    # client of the remote mode may send as len(label union): allow the same 128.
    max_logprobs: int = Field(default=MAX_LOGPROB_TOKEN_IDS, ge=1)
    # Reads in flight per step. None = 256 with the project's read path (the benchmark's
    # largest batch; the KV cache and the token budget bound what runs in one step below
    # it), 127 with vLLM's own (it lowers any max_num_seqs >= 128, its generic default, to
    # 8 for DiffusionGemma without a word: `DiffusionGemmaConfig.verify_and_update_config`;
    # the read path keeps the value). Measured on one H200 at a 23 GiB budget, NVFP4,
    # 256-token prompts (docs/benchmarks.md#vllm-tuning): 127 against the 8 that ran before
    # lifted batch-256 reads/s 53 -> 147 unique and 124 -> 274 on one question set.
    max_num_seqs: int | None = Field(default=None, gt=0, le=MAX_READ_PATH_SEQS)
    # Tokens a step may schedule. Measured at 23 GiB (same run): 4096 gave the most reads/s
    # on one question set (355 at batch 256, against 304 at 8192) and 7% fewer on unique
    # prompts (141 against 151); 16384 left too little KV cache for one 16,384-token request
    # and vLLM refused to start (3.44 GiB needed). At 0.90 of a 24 GiB card 8192 would leave
    # about 3.4 GiB, under that 3.44: 4096 is the largest measured budget that starts there.
    max_num_batched_tokens: int = Field(default=4096, gt=0)
    # The reported run used about 21.5 of 24 GB, i.e. 0.9 x 24 = 21.6: vLLM's default.
    gpu_memory_utilization: float = Field(default=0.90, gt=0.0, le=1.0)
    # None = detect from the checkpoint, as vLLM expects: `ModelConfig._verify_quantization`
    # reads `quantization_config.quant_method` from its config.json. RedHatAI's NVFP4
    # checkpoints are llm-compressor output ("compressed-tensors"; not checked against this
    # one offline), which `CompressedTensorsConfig._get_scheme_from_parts` maps to
    # `CompressedTensorsW4A4Fp4` (min capability 7.5; `init_nvfp4_linear_kernel` has a Marlin
    # NVFP4 kernel for pre-Blackwell cards such as the 3090). A forced name that disagrees
    # with the checkpoint is an error in vLLM.
    quantization: str | None = None
    # Gemma activations overflow in fp16; the checkpoint's dtype is bf16 and Ampere has it.
    dtype: str = "bfloat16"
    # Engine RNG seed (vLLM's default, 0). A read's noise comes from its seeded canvas, and
    # per-request `seed` is refused for diffusion models (`SamplingParams._validate_diffusion`).
    seed: int = 0
    # One card per actor; `diffusion_constrained` also needs TP 1
    # (`DiffusionGemmaSampler.add_request` raises otherwise).
    tensor_parallel_size: int = Field(default=1, ge=1)
    # CUDA graphs on (vLLM's default); True for debugging or a faster start.
    enforce_eager: bool = False
    # Reads are text only: skip the vision tower's weights and its dummy-image memory
    # profiling (`MultiModalConfig.language_model_only`), memory a 24 GB card lacks.
    language_model_only: bool = True
    # Prompts arrive as token ids and outputs are not detokenized, so the engine's tokenizer
    # is only needed for the generation config's EOS; keep it unless startup time matters.
    skip_tokenizer_init: bool = False
    # The step runs its unembedding and softmax over the label union only (faster; the label
    # mass and the full-vocabulary argmax become unknowable).
    diffusion_constrained: bool = True
    # A guard, not a tuning: a single-step read takes well under a second (about 30 req/s
    # at 8-way concurrency upstream); a read still pending after this is stuck.
    read_timeout_s: float = Field(default=120.0, gt=0)
    # Reported in EngineInfo until the engine is built (then read from its model config).
    vocab_size: int = DIFFUSION_GEMMA_VOCAB
    # vLLM's `load_format`: "auto" reads the checkpoint; "dummy" gives random weights of the
    # model's shape (benchmarks of the full-size shape without a download).
    load_format: str = "auto"
    # CUDA graph sizes (in scheduled tokens) to capture: "to_budget" = every size of
    # `GRAPH_SIZES` up to max_num_batched_tokens; None = vLLM's own list, which stops at
    # min(2 x max_num_seqs x (canvas + 1), 512) tokens, so steps of prompts ran eager (the
    # first H200 profile: 848- and 1280-token steps at ~145 ms). Capturing to the budget
    # took 30 s of the engine's start on the H200.
    cudagraph_capture_sizes: tuple[int, ...] | Literal["to_budget"] | None = "to_budget"
    # vLLM's async scheduling (the next step is scheduled while this one runs); None = vLLM's
    # default (on). With the read path (whose step has no GPU-to-CPU sync) on the emulated
    # 24 GB card, on measured faster than off in 11 of 12 rows and level in the 12th
    # (2026-12-03, one device session, batch 256: 605 against 447 reads/s on one question
    # set, 187 against 154 unique, 826 against 599 at the best batches in flight; batch-1
    # p50 31 against 41 ms shared): the engine core's Python then runs while the GPU does,
    # where off had them take turns. vLLM's own path measured slightly the other way on the
    # full-size shape (2026-12-01), and took 1.7 s for the gpu tests' 300 demo-model
    # requests with it on (2026-12-03) against 9.8 s off (2026-12-02): one default for both.
    async_scheduling: bool | None = True
    # vLLM's CUDA graph mode (`compilation_config.cudagraph_mode`); None = vLLM's default,
    # FULL_AND_PIECEWISE: a step that mixes new prompts with canvases (most steps of a
    # busy worker) then runs piecewise, its attention ops in Python between graph pieces.
    # "FULL" graphs mixed steps whole too (vLLM's TRITON_ATTN backend, the default here,
    # supports that). Beside the defaults on one H100 as a 24 GB card (2026-12-05, one
    # session, docs/benchmarks.md "side by side"), FULL at gpu_memory_utilization 0.86
    # read batch 1 at 1.23-1.69x (p50 29 ms unique / 22 shared against 38 / 39), batch 256
    # at 0.98-1.03x and batch 32 at 0.90-1.04x, but its graphs need the card's room
    # outside gpu_memory_utilization (`check_full_graphs`: at most 0.87 of a 24 GB card),
    # which leaves the KV cache 23% fewer blocks (4,049 against 5,229) for long prompts
    # under a backlog. With one-step reads (their ranges through one persistent buffer),
    # on an H100 as the card (2026-12-06, section card24-full-one-step), FULL took a lone
    # read in 22.9 ms p50 unique / 15.9 shared against the defaults' 25.4 / 22.9 and
    # read batch 256 at 0.96-1.00x. So it stays a choice for latency-bound deployments,
    # not the default.
    cudagraph_mode: Literal["FULL_AND_PIECEWISE", "FULL", "PIECEWISE", "NONE"] | None = None
    # Steps of at most this many tokens that mix prompts and canvases (a one-step read's
    # step always does) replay one FULL CUDA graph under vLLM's default graph mode, which
    # runs them piecewise, their attention ops in Python between graph pieces
    # (`workers.engine.vllm_reads.graphs`); larger steps stay piecewise, so the graphs'
    # memory stays small, unlike cudagraph_mode "FULL". 0: vLLM's own graphs. Needs
    # read_path "dgstream", CUDA graphs, cudagraph_mode unset or FULL_AND_PIECEWISE,
    # TRITON_ATTN and tensor_parallel_size 1: set against them it is refused by name; the
    # default steps aside for them (the engine's start log says so). 1,024 holds one or
    # two lone reads' steps (a 256-token prompt and the 64-position canvas: 320 tokens).
    # Beside 0 on an H100 as the 24 GB card (2026-12-06, fourth session, an engine start
    # each, docs/benchmarks.md section card24-small-full): a lone read 18.1 ms p50 on one
    # question set and 24.2 unique against 32.7 and 25.7 (1.73x / 1.07x the reads/s; two
    # in flight 1.75x / 1.18x), batch 32 1.02-1.10x, batch 256 1.01-1.05x; 5,186 KV blocks
    # against 5,229 (0.8% fewer), 0.06 GiB more graph memory, 8 s more capture.
    full_graph_tokens: int = Field(default=1024, ge=0, le=16_384)
    # vLLM's kernel choice for the MoE experts and the quantized linear layers (its
    # `--moe-backend` / `--linear-backend`); None = vLLM's own ("auto"). vLLM 0.33 picks
    # its Humming kernels for NVFP4 on compute capability 9.0 (an H100/H200) and Marlin on
    # every other pre-Blackwell card (`humming.priority._HUMMING_PREFERRED_CAPABILITIES`):
    # a 24 GB board (RTX 3090/4090, A10, L4: 8.6/8.9) runs Marlin, so "marlin" on an H200
    # runs the kernels the target card would (not on dummy weights: their random scales
    # are negative, which Marlin's format cannot hold, and every read came back -inf on
    # 2026-12-03). vLLM refuses a name it does not know.
    moe_backend: str | None = None
    # The linear layers' kernels (`--linear-backend`), as `moe_backend` is the experts'.
    linear_backend: str | None = None
    # An absolute directory where the engine keeps what its first start builds, so that a
    # restart reuses it: vLLM's torch.compile and AOT artifacts (VLLM_CACHE_ROOT), Inductor's
    # and Triton's kernels, and Humming's JIT kernels (NVFP4 on Hopper). A first start on a
    # machine spent 53 s in torch.compile and 94 s in a profiling run that built kernels
    # (2026-12-07, an H100, docs/vllm.md "A start that does not cost minutes"). None: each
    # library's default under $HOME/.cache, which a container loses when it restarts (on
    # KubeRay, mount a volume here). Variables the operator set already are kept.
    cache_dir: str | None = None
    # An absolute directory: turns on vLLM's torch profiler (`AsyncLLM.start_profile` then
    # writes traces there). For profiling runs only.
    profiler_dir: str | None = None
    # How reads run inside vLLM: "dgstream", the project's read path (the vLLM plugin in
    # `workers.engine.vllm_reads`: label-only unembedding, a sync-free batched step, batched
    # self-conditioning and admission); "stock", vLLM 0.33's own. The read path needs the
    # plugin's entry point installed and vLLM 0.33.x; without them the engine says so and
    # runs "stock".
    read_path: Literal["dgstream", "stock"] = "dgstream"
    # The read path's bound on one tile of full-vocabulary rows (unconstrained reads and
    # vLLM's warmup); see `workers.engine.vllm_reads.options.ReadPathOptions`.
    logits_tile_mib: int = Field(default=256, ge=16, le=16_384)
    # One-step reads: a read's canvas runs in the step that finishes its prompt, one forward pass
    # instead of vLLM's two (`workers.engine.vllm_reads.scheduler`). They need read_path "dgstream",
    # async_scheduling on, attention_backend TRITON_ATTN and tensor_parallel_size 1 (any
    # cudagraph_mode). true: every read that can takes one step, and settings without them are
    # refused, by name. "auto" (the default): one step where the settings allow it (two where not,
    # and the engine's start log says why) and only in steps that leave no request waiting, so a
    # backlogged engine reads in two steps. On an H200 as the 24 GB card (2026-12-06, an engine
    # start each, docs/benchmarks.md section card24-auto), auto took a lone read in 21.6 ms p50 on a
    # unique prompt and 17.7 on one question set against 26.3 and 21.6 with false, and read batch
    # 256 on one question set at 0.93x / 1.00x / 0.99x false's rate with 1 / 2 / 4 batches in flight
    # (1,030 reads/s at two, as the worker keeps them); unique prompts read alike; the demo model
    # answers as in two steps. true: fuses under a backlog too (at batch 256 on one question set,
    # 0.86-0.96x two steps). false: vLLM's two steps always.
    one_step_reads: bool | Literal["auto"] = "auto"

    @model_validator(mode="after")
    def _cache_dir_is_absolute(self) -> VllmSettings:
        if self.cache_dir is not None and not Path(self.cache_dir).is_absolute():
            raise ValueError(f"cache_dir must be an absolute path, got {self.cache_dir!r}")
        return self

    @model_validator(mode="after")
    def _seqs_fit_the_path(self) -> VllmSettings:
        if self.read_path == "stock" and (self.max_num_seqs or 0) > MAX_NUM_SEQS:
            raise ValueError(
                f"max_num_seqs: {self.max_num_seqs} with read_path 'stock' would be lowered "
                f"to 8 by vLLM 0.33; use at most {MAX_NUM_SEQS} (or read_path 'dgstream')"
            )
        return self

    @model_validator(mode="after")
    def _one_step_fits(self) -> VllmSettings:
        if self.one_step_reads is not True:
            return self
        clashes = self.one_step_clashes()
        if clashes:
            raise ValueError("one_step_reads: cannot run with " + "; ".join(clashes))
        return self

    def _read_path_clashes(self, read_path: str | None) -> list[str]:
        """What every read-path feature inside vLLM needs, unmet on `read_path` (default:
        the settings' own): the plugin's path, TRITON_ATTN (the backend they run on) and
        one GPU."""
        path = read_path or self.read_path
        clashes = []
        if path != "dgstream":
            clashes.append(f"read_path {path!r} (needs 'dgstream')")
        if self.attention_backend != "TRITON_ATTN":
            clashes.append(f"attention_backend {self.attention_backend!r} (needs TRITON_ATTN)")
        if self.tensor_parallel_size != 1:
            clashes.append(
                f"tensor_parallel_size {self.tensor_parallel_size} (the read path serves one GPU)"
            )
        return clashes

    def one_step_clashes(self, read_path: str | None = None) -> list[str]:
        """The settings that keep one-step reads off an engine on `read_path` (default:
        the settings' own), each named with what it would need."""
        clashes = self._read_path_clashes(read_path)
        if self.async_scheduling is not True:
            clashes.append(f"async_scheduling {self.async_scheduling} (needs true)")
        return clashes

    @model_validator(mode="after")
    def _full_graphs_fit(self) -> VllmSettings:
        if "full_graph_tokens" not in self.model_fields_set or not self.full_graph_tokens:
            return self
        clashes = self.full_graph_clashes()
        if clashes:
            raise ValueError("full_graph_tokens: cannot run with " + "; ".join(clashes))
        return self

    def full_graph_clashes(self, read_path: str | None = None) -> list[str]:
        """The settings that keep small mixed steps out of FULL graphs on `read_path`
        (default: the settings' own), each named with what it would need."""
        clashes = self._read_path_clashes(read_path)
        if self.enforce_eager:
            clashes.append("enforce_eager true (no CUDA graphs)")
        if self.cudagraph_mode not in (None, "FULL_AND_PIECEWISE"):
            clashes.append(
                f"cudagraph_mode {self.cudagraph_mode!r} (needs FULL_AND_PIECEWISE, vLLM's "
                "default; FULL graphs every step already)"
            )
        return clashes

    def full_graphs_resolved(self, read_path: str | None = None) -> tuple[int, str]:
        """(the mixed steps' FULL-graph bound an engine on `read_path` gets, 0 for none;
        why)."""
        tokens = self.full_graph_tokens
        if not tokens:
            return 0, "full_graph_tokens 0"
        clashes = self.full_graph_clashes(read_path)
        if clashes:
            return 0, f"full_graph_tokens {tokens}, but " + "; ".join(clashes)
        return tokens, f"full_graph_tokens {tokens}"

    def one_step_resolved(self, read_path: str | None = None) -> tuple[bool, str]:
        """(whether an engine on `read_path` takes reads in one step, why)."""
        if self.one_step_reads is False:
            return False, "one_step_reads is false"
        clashes = self.one_step_clashes(read_path)
        if clashes:
            # Only "auto" gets here with clashes on the settings' own path; true can get
            # here when the engine falls back to the stock path (no plugin).
            return False, f"one_step_reads {self.one_step_reads}, but " + "; ".join(clashes)
        if self.one_step_reads == "auto":
            return True, "one_step_reads auto: two steps while requests wait"
        return True, f"one_step_reads {self.one_step_reads}"

    def reads_in_flight(self, read_path: str | None = None) -> int:
        """max_num_seqs as resolved for a read path (the settings' own by default)."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return READ_PATH_SEQS if (read_path or self.read_path) == "dgstream" else MAX_NUM_SEQS


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


def read_path_available() -> str | None:
    """None when the project's read path can serve in vLLM here, else why not: it needs
    vLLM 0.33.x and the plugin's entry point installed (vLLM finds plugins only through
    package metadata, in every process it starts)."""
    from importlib import metadata

    from workers.engine import vllm_reads

    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "vLLM is not installed"
    if not vllm_reads.supported(version):
        return f"vLLM {version} is not {vllm_reads.SUPPORTED_VLLM}.x"
    found = metadata.entry_points(
        group=vllm_reads.ENTRY_POINT_GROUP, name=vllm_reads.ENTRY_POINT_NAME
    )
    if not list(found):
        return (
            f"the plugin's entry point ({vllm_reads.ENTRY_POINT_GROUP}: "
            f"{vllm_reads.ENTRY_POINT_NAME}) is not installed: install the project "
            "(pip install .) where vLLM runs"
        )
    return None


def resolve_read_path(settings: VllmSettings) -> tuple[str, str]:
    """(the read path an engine of these settings runs, why)."""
    if settings.read_path == "stock":
        return "stock", "read_path is 'stock'"
    missing = read_path_available()
    if missing is not None:
        return "stock", f"the dgstream read path cannot load: {missing}"
    return "dgstream", "the dgstream read path (vLLM plugin)"


# The card an engine may use: DGSTREAM_CARD_GIB when set (the 24 GB emulation sets it for
# every process of a run; see bench/gpu/card/), else what NVML reports for the first
# visible GPU. Only the stock path's reserve needs it.
CARD_ENV = "DGSTREAM_CARD_GIB"
# Diagnostics (never set in service): Inductor options for vLLM's compilation config, as
# `name=value[+name=value]` with JSON values, e.g. `split_reductions=false`.
DEBUG_INDUCTOR_ENV = "DGSTREAM_DEBUG_INDUCTOR"


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


def engine_args(settings: VllmSettings, read_path: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `vllm.engine.arg_utils.AsyncEngineArgs` (settings checked and
    resolved by `check_model` first) for an engine on `read_path` (default: the settings'
    own)."""
    from workers.engine.vllm_reads.options import ReadPathOptions

    settings = check_model(settings)
    path = read_path or settings.read_path
    seqs = min(settings.reads_in_flight(path), MAX_NUM_SEQS if path == "stock" else 10**9)
    utilization = (
        stock_utilization(settings, seqs) if path == "stock" else settings.gpu_memory_utilization
    )
    check_full_graphs(settings, utilization)
    one_step = settings.one_step_resolved(path)[0]
    options = ReadPathOptions(
        enabled=path == "dgstream",
        logits_tile_mib=settings.logits_tile_mib,
        max_num_seqs=seqs,
        one_step=one_step,
        one_step_idle_only=one_step and settings.one_step_reads == "auto",
        full_graph_tokens=settings.full_graphs_resolved(path)[0],
    )
    args: dict[str, Any] = {
        "model": settings.model,
        "tokenizer": settings.tokenizer,
        "revision": settings.revision,
        # `EngineArgs.diffusion_config: dict | None` -> `create_diffusion_config` ->
        # `DiffusionConfig(**cfg)`; the CLI form is `--diffusion-config '{"canvas_length":64}'`.
        # Setting it also selects vLLM's DiffusionScheduler (`VllmConfig.__post_init__`).
        "diffusion_config": {"canvas_length": settings.canvas_length},
        "max_model_len": settings.max_model_len,
        "attention_backend": settings.attention_backend,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "max_logprobs": settings.max_logprobs,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "gpu_memory_utilization": utilization,
        "quantization": settings.quantization,
        "dtype": settings.dtype,
        "seed": settings.seed,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "enforce_eager": settings.enforce_eager,
        "language_model_only": settings.language_model_only,
        "skip_tokenizer_init": settings.skip_tokenizer_init,
        "load_format": settings.load_format,
        "additional_config": options.as_additional_config(),
    }
    sizes = graph_sizes(settings)
    if sizes is not None:
        args["cudagraph_capture_sizes"] = list(sizes)
    if settings.async_scheduling is not None:
        args["async_scheduling"] = settings.async_scheduling
    if settings.cudagraph_mode is not None:
        args["compilation_config"] = {"cudagraph_mode": settings.cudagraph_mode}
    inductor = debug_inductor_options(os.environ.get(DEBUG_INDUCTOR_ENV, ""))
    if inductor:
        # The compute-limited card's bisection; vLLM adds its own defaults beside these.
        args.setdefault("compilation_config", {})["inductor_compile_config"] = inductor
    for kernel in ("moe_backend", "linear_backend"):
        if getattr(settings, kernel) is not None:
            args[kernel] = getattr(settings, kernel)
    if settings.profiler_dir:
        args["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": settings.profiler_dir,
            "torch_profiler_with_stack": False,
        }
    return args


# The variable each library reads its cache folder from, and the subfolder it gets.
CACHE_ENV = {
    "VLLM_CACHE_ROOT": "vllm",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "HUMMING_CACHE_DIR": "humming",
}


def apply_cache_dir(cache_dir: str | None, environ: Any = None) -> dict[str, str]:
    """Point the engine's caches under `cache_dir` (`VllmSettings.cache_dir`) in `environ`
    (this process's, which vLLM's engine core inherits); what is set already stays. Returns
    the variables it set."""
    env = os.environ if environ is None else environ
    if not cache_dir:
        return {}
    root = Path(cache_dir)
    if not root.is_absolute():
        raise ValueError(f"cache_dir must be an absolute path, got {cache_dir!r}")
    added = {}
    for name, sub in CACHE_ENV.items():
        if not env.get(name):
            added[name] = str(root / sub)
            env[name] = added[name]
    return added


def debug_inductor_options(text: str) -> dict[str, Any]:
    """`split_reductions=false+combo_kernels=false` -> {"split_reductions": False, ...}."""
    out: dict[str, Any] = {}
    for part in filter(None, text.split("+")):
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise ValueError(f"{DEBUG_INDUCTOR_ENV}: want name=value, got {part!r}")
        out[name] = json.loads(value)
    return out


def serve_command(
    settings: VllmSettings, *, host: str = "127.0.0.1", port: int = 8000, name: str | None = None
) -> list[str]:
    """`vllm serve` arguments for a server the remote mode can read from, with the same
    engine settings as the in-process engine (run it with the vLLM environment's Python:
    `python -m vllm.entrypoints.cli.main serve ...`)."""
    a = engine_args(settings)
    cmd = ["serve", str(a["model"]), "--host", host, "--port", str(port)]
    if name:
        cmd += ["--served-model-name", name]
    flags = {
        "tokenizer": a["tokenizer"],
        "revision": a["revision"],
        "diffusion-config": json.dumps(a["diffusion_config"]),
        "max-model-len": a["max_model_len"],
        "attention-backend": a["attention_backend"],
        "max-logprobs": a["max_logprobs"],
        "max-num-seqs": a["max_num_seqs"],
        "max-num-batched-tokens": a["max_num_batched_tokens"],
        "gpu-memory-utilization": a["gpu_memory_utilization"],
        "quantization": a["quantization"],
        "dtype": a["dtype"],
        "seed": a["seed"],
        "tensor-parallel-size": a["tensor_parallel_size"],
        "load-format": a["load_format"],
        "additional-config": json.dumps(a["additional_config"]),
        "moe-backend": a.get("moe_backend"),
        "linear-backend": a.get("linear_backend"),
    }
    for flag, value in flags.items():
        if value is not None:
            cmd += [f"--{flag}", str(value)]
    if "cudagraph_capture_sizes" in a:
        cmd += ["--cudagraph-capture-sizes", *(str(n) for n in a["cudagraph_capture_sizes"])]
    if "compilation_config" in a:
        cmd += ["--compilation-config", json.dumps(a["compilation_config"])]
    if "async_scheduling" in a:
        cmd.append("--async-scheduling" if a["async_scheduling"] else "--no-async-scheduling")
    switches = {
        "enable-prefix-caching": a["enable_prefix_caching"],
        "enforce-eager": a["enforce_eager"],
        "language-model-only": a["language_model_only"],
        "skip-tokenizer-init": a["skip_tokenizer_init"],
    }
    for flag, on in switches.items():
        if on:
            cmd.append(f"--{flag}")
        elif flag == "enable-prefix-caching":
            cmd.append("--no-enable-prefix-caching")
    return cmd


# A request's opt-out of one-step reads (`VllmSettings.one_step_reads`): vLLM passes
# extra_args keys it does not know to the engine untouched; the plugin's scheduler reads it.
TWO_STEP_KEY = "dgstream_two_step"


def _extra_args(
    read: Read, constrained: bool, *, as_ints: bool, two_step: bool = False
) -> dict[str, Any]:
    one = (lambda b: int(b)) if as_ints else (lambda b: bool(b))
    args = {
        "diffusion_canvas_length": len(read.canvas_ids),
        "diffusion_seed_canvas": [int(t) for t in read.canvas_ids],
        "diffusion_max_steps": 1,
        "diffusion_read_only": one(True),
        "diffusion_constrained": one(constrained),
    }
    if two_step:
        args[TWO_STEP_KEY] = one(True)
    return args


def logprob_ids(read: Read, shared: frozenset[int] | tuple[int, ...] = ()) -> list[int]:
    """The ids a read asks logprobs for: the engine's shared label set when it holds the
    read's labels, else the read's own union.

    One set for every read lets vLLM run a step's constrained unembedding over one set of
    columns (`batch_allowed`) instead of masking the full vocabulary per read; each slot's
    distribution is the softmax over its own labels either way (the normalizer cancels)."""
    union = read.label_union
    if shared and set(union) <= set(shared):
        return sorted(shared)
    return list(union)


def build_sampling_params(
    read: Read,
    settings: VllmSettings,
    shared: frozenset[int] | tuple[int, ...] = (),
    *,
    two_step: bool = False,
) -> SamplingParams:
    """The vLLM request of one read (in-process mode); `two_step`: the read opts out of
    one-step reads (see `VllmEngine.sibling`)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    width = len(read.canvas_ids)
    return SamplingParams(
        # Diffusion models take only temperature 1.0 and no per-request seed
        # (`SamplingParams._validate_diffusion`); top_k/top_p would filter the logits the
        # logprobs are read from, so they stay off.
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=width,
        logprob_token_ids=logprob_ids(read, shared),
        extra_args=_extra_args(
            read, settings.diffusion_constrained, as_ints=False, two_step=two_step
        ),
        # validate_diffusion_sampling_params sets this for read-only requests; set it here
        # too so an EOS drawn into a slot can never end the canvas early.
        ignore_eos=True,
        # Nothing reads the text; without a tokenizer the logprobs skip detokenizing too.
        detokenize=False,
        # One flat container instead of canvas_width dicts of Logprob objects.
        flat_logprobs=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
        # Built fresh per request: the input processor may take a shallow copy.
        skip_clone=True,
    )


def build_xargs(read: Read, *, constrained: bool = True) -> dict[str, Any]:
    """The same `extra_args` as JSON for `vllm_xargs` (remote OpenAI mode).

    `CompletionRequest.vllm_xargs` is `dict[str, str | int | float | list[str | int | float]]`
    (vllm/entrypoints/openai/completion/protocol.py): pydantic narrows a JSON boolean to 1/0
    there, ints and lists of ints survive. validate_diffusion_sampling_params accepts 0/1 for
    the boolean keys, so send them as ints outright.
    """
    return _extra_args(read, constrained, as_ints=True)


def _softmax(logprobs: np.ndarray) -> np.ndarray:
    if np.isnan(logprobs).any():
        raise RecoverableEngineError("a label logprob is NaN at a slot")
    finite = np.isfinite(logprobs)
    if not finite.any():
        raise RecoverableEngineError("every label logprob is -inf at a slot")
    shifted = np.where(finite, logprobs - logprobs[finite].max(), -np.inf)
    e = np.exp(shifted)
    return e / e.sum()


# The checks of a slot's row (`check_row`). A logprob vLLM computed is a float32
# log-softmax value: above 0 by float32 rounding at most (~1e-7), and a constrained row
# (the log-softmax over the allowed ids, every one of them reported) normalises to within
# ~1e-6 for 128 ids. 1e-3 is far above that rounding and far below what a row that mixes
# two rows' values, or holds garbage, gives (measured on the GPU: docs/vllm.md).
LOGPROB_ABOVE_ZERO_TOL = 1e-4
NORMALIZER_TOL = 1e-3


def check_row(where: str, ids: Sequence[int], values: Sequence[float], constrained: bool) -> None:
    """Refuse a canvas position's logprobs that no correct step can give (as a
    RecoverableEngineError naming `where`): a NaN; +inf or a logprob above 0; column 0 (the
    argmax) below another column; a constrained row that does not normalise over its ids;
    an unconstrained row whose ids hold more than all the probability. Cheap (a position's
    dozen values); a row that is a valid distribution but another read's or another step's
    passes them all, which only a comparison with a reference run can see."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return
    if np.isnan(v).any():
        raise RecoverableEngineError(f"{where}: impossible read: a logprob is NaN")
    if (v > LOGPROB_ABOVE_ZERO_TOL).any():
        raise RecoverableEngineError(f"{where}: impossible read: a logprob above 0 ({v.max()})")
    finite = v[np.isfinite(v)]
    if finite.size == 0:
        return  # every value -inf: the slot's own check names it
    if np.isfinite(v[0]) and v[0] < finite.max() - NORMALIZER_TOL:
        raise RecoverableEngineError(
            f"{where}: impossible read: the argmax's logprob {v[0]} is below {finite.max()}"
        )
    # Column 0 repeats one of the ids: count each id once.
    seen: dict[int, float] = {}
    for t, x in zip(ids, v, strict=True):
        seen.setdefault(int(t), float(x))
    lse = float(np.logaddexp.reduce(np.fromiter(seen.values(), dtype=np.float64)))
    if constrained and abs(lse) > NORMALIZER_TOL:
        raise RecoverableEngineError(
            f"{where}: impossible read: the allowed ids' probabilities sum to {math.exp(lse):.6f}"
        )
    if not constrained and lse > NORMALIZER_TOL:
        raise RecoverableEngineError(
            f"{where}: impossible read: the reported ids' probabilities sum to {math.exp(lse):.6f}"
        )


def _slot_read(
    slot: Slot, row: Mapping[int, float], argmax_id: int | None, constrained: bool
) -> SlotRead:
    missing = [t for t in slot.label_ids if t not in row]
    if missing:
        raise RecoverableEngineError(
            f"slot {slot.question_id!r} at position {slot.position}: no logprob for label "
            f"ids {missing}"
        )
    lps = np.array([row[t] for t in slot.label_ids], dtype=np.float64)
    probs = _softmax(lps)
    nz = probs[probs > 0]
    entropy = float(-(nz * np.log(nz)).sum())
    if constrained:
        label_mass: float | None = None
        argmax_is_label: bool | None = None
    else:
        label_mass = float(np.exp(lps).sum())
        argmax_is_label = None if argmax_id is None else argmax_id in slot.label_ids
    return SlotRead(
        question_id=slot.question_id,
        probs=probs,
        entropy=entropy,
        label_mass=label_mass,
        argmax_is_label=argmax_is_label,
    )


def _position_columns(logprobs: Any, pos: int) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) at one canvas position, in vLLM's column order (column 0 the
    sampled, argmax, token), of a FlatLogprobs or a list of dicts."""
    if hasattr(logprobs, "start_indices"):  # vllm.logprobs.FlatLogprobs
        lo, hi = logprobs.start_indices[pos], logprobs.end_indices[pos]
        return (
            [int(t) for t in logprobs.token_ids[lo:hi]],
            [float(v) for v in logprobs.logprobs[lo:hi]],
        )
    entry = logprobs[pos]
    if entry is None:
        return [], []
    return [int(t) for t in entry], [float(lp.logprob) for lp in entry.values()]


def _position_row(logprobs: Any, pos: int) -> dict[int, float]:
    """{token_id: logprob} at one canvas position of a FlatLogprobs or list of dicts."""
    ids, values = _position_columns(logprobs, pos)
    return dict(zip(ids, values, strict=True))


def parse_output(read: Read, request_output: Any, *, constrained: bool = True) -> ReadResult:
    """A vLLM `RequestOutput` of a read-only diffusion request -> the read's slot reads."""
    if not request_output.outputs:
        raise RecoverableEngineError(f"read {read.tag!r}: vLLM returned no output")
    out = request_output.outputs[0]
    if out.finish_reason == "error":
        raise RecoverableEngineError(f"read {read.tag!r}: vLLM finished with an error")
    logprobs = out.logprobs
    if logprobs is None:
        raise RecoverableEngineError(f"read {read.tag!r}: vLLM returned no logprobs")
    n = len(logprobs)
    token_ids = list(out.token_ids or ())
    slots = []
    for slot in read.slots:
        if not 0 <= slot.position < n:
            raise RecoverableEngineError(
                f"read {read.tag!r}: slot {slot.question_id!r} at {slot.position} but the "
                f"output has {n} positions"
            )
        ids, values = _position_columns(logprobs, slot.position)
        row = dict(zip(ids, values, strict=True))
        if slot.position < len(token_ids):
            argmax_id: int | None = int(token_ids[slot.position])
        else:  # column 0 of a position is the sampled (argmax) token
            argmax_id = next(iter(row), None)
        slots.append(_slot_read(slot, row, argmax_id, constrained))
        # The slot's own checks first (a missing label, all -inf), then the row's.
        check_row(
            f"read {read.tag!r}: slot {slot.question_id!r} at {slot.position}",
            ids,
            values,
            constrained,
        )
    return ReadResult(slots=tuple(slots))


def _request_id(read: Read) -> str:
    return f"dg-{read.tag or 'read'}-{uuid.uuid4().hex[:12]}"


class VllmEngine:
    """The in-process engine: one vLLM `AsyncLLM` on the actor's GPU, built on first use."""

    def __init__(
        self, settings: VllmSettings | None = None, *, shared_labels: Sequence[int] = ()
    ) -> None:
        """`shared_labels`: the token ids of every label the templates write (see
        `logprob_ids`); empty = each read asks for its own labels."""
        self.settings = settings or VllmSettings()
        self.shared_labels = frozenset(shared_labels)
        self._engine: Any = None
        self._lock = asyncio.Lock()
        self._vocab_size = self.settings.vocab_size
        # The read path the running engine uses ("dgstream" or "stock"); None until start.
        self.read_path: str | None = None
        # This engine's reads opt out of one-step reads (a sibling's, for side-by-side runs).
        self.two_step = False

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            backend="vllm",
            model=self.settings.model,
            canvas_length=self.settings.canvas_length,
            vocab_size=self._vocab_size,
            device="cuda",
        )

    def sibling(
        self, *, diffusion_constrained: bool | None = None, two_step: bool = False
    ) -> VllmEngine:
        """An engine over the same vLLM instance whose reads differ only per request: in
        `diffusion_constrained`, or (`two_step`) opting out of one-step reads, so both
        modes or both paths run on one GPU allocation; start this one first."""
        constrained = (
            self.settings.diffusion_constrained
            if diffusion_constrained is None
            else diffusion_constrained
        )
        other = VllmEngine(self.settings.model_copy(update={"diffusion_constrained": constrained}))
        other._engine, other._vocab_size, other._lock = self._engine, self._vocab_size, self._lock
        other.read_path = self.read_path
        other.two_step = two_step
        return other

    async def start(self) -> None:
        """Build the engine (loads the weights: minutes). `read` calls it when needed.

        Built on the event loop's thread: vLLM starts its engine-core process from here and
        its output handler on the first request.
        """
        async with self._lock:
            if self._engine is not None:
                return
            from vllm.v1.engine.async_llm import AsyncLLM

            engine_kwargs = self._engine_kwargs()  # EngineConfigError names a bad setting
            # vLLM forks its engine-core process by default, and a fork cannot use CUDA once
            # this process has touched it (torch.cuda.is_available() is enough): spawn.
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
            if added := apply_cache_dir(self.settings.cache_dir):
                log.info("vLLM engine caches under %s (%s)", self.settings.cache_dir, sorted(added))
            try:
                engine = AsyncLLM.from_engine_args(engine_kwargs)
            except Exception as exc:
                raise FatalEngineError(f"vLLM engine failed to start: {exc}") from exc
            self._engine = engine
            self._vocab_size = int(engine.model_config.get_vocab_size())

    def _engine_kwargs(self) -> Any:
        """vLLM's engine arguments on the read path that can run here (it says which)."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        from workers.engine import vllm_reads

        path, why = resolve_read_path(self.settings)
        kwargs = AsyncEngineArgs(**engine_args(self.settings, path))
        # Building the arguments loaded vLLM's plugins in this process: the read path is
        # only on if its plugin registered (vLLM loads it the same way in its engine core).
        if path == "dgstream" and not (vllm_reads.status() or "").startswith("registered"):
            path, why = "stock", f"the dgstream plugin did not register: {vllm_reads.status()}"
            kwargs = AsyncEngineArgs(**engine_args(self.settings, path))
        self.read_path = path
        (log.info if path == self.settings.read_path else log.warning)(
            "vLLM reads: %s (%s)", path, why
        )
        one_step, one_step_why = self.settings.one_step_resolved(path)
        (log.info if one_step or self.settings.one_step_reads is not True else log.warning)(
            "vLLM reads in %s (%s)", "one step" if one_step else "two steps", one_step_why
        )
        tokens, graphs_why = self.settings.full_graphs_resolved(path)
        asked = "full_graph_tokens" in self.settings.model_fields_set
        (log.warning if asked and self.settings.full_graph_tokens and not tokens else log.info)(
            "vLLM mixed steps: %s (%s)",
            f"FULL CUDA graphs up to {tokens} tokens" if tokens else "vLLM's own graphs",
            graphs_why,
        )
        return kwargs

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
        await self.start()
        engine = self._engine
        if engine.errored:
            raise FatalEngineError("vLLM engine is dead")
        outcomes = await asyncio.gather(
            *(self._read_one(engine, r) for r in reads), return_exceptions=True
        )
        return _settle(outcomes, _classify_vllm_error)

    async def _read_one(self, engine: Any, read: Read) -> ReadResult:
        from vllm.inputs import tokens_input

        params = build_sampling_params(
            read, self.settings, self.shared_labels, two_step=self.two_step
        )
        started = time.perf_counter()

        async def consume() -> Any:
            final = None
            async for out in engine.generate(
                tokens_input(list(read.prompt_ids)), params, _request_id(read)
            ):
                final = out
            return final

        # Cancelling the consumer makes vLLM's generate() abort the request.
        final = await asyncio.wait_for(consume(), self.settings.read_timeout_s)
        if final is None:
            raise RecoverableEngineError(f"read {read.tag!r}: vLLM returned nothing")
        result = parse_output(read, final, constrained=self.settings.diffusion_constrained)
        return ReadResult(slots=result.slots, timings={"engine_s": time.perf_counter() - started})

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        # vLLM's shutdown stops its engine core before it cancels its output handler, and
        # run off the loop (it blocks for seconds) it lets the handler see the core go:
        # the handler then logs "AsyncLLM output_handler failed" with an EngineDeadError
        # traceback at ERROR on a clean close (in the GPU card runs' logs). That
        # error is how vLLM fails reads still in flight, so the handler goes first only
        # when none is.
        handler = getattr(engine, "output_handler", None)
        if (
            handler is not None
            and not handler.done()
            and not engine.output_processor.has_unfinished_requests()
        ):
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
        await asyncio.to_thread(engine.shutdown)


def _classify_vllm_error(exc: BaseException) -> tuple[str, str]:
    """('fatal' | 'rejected' | 'retry', message) for an exception of one in-process read."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, EngineDeadError | FatalEngineError):
        return "fatal", str(exc) or type(exc).__name__
    if isinstance(exc, VLLMClientError | ValueError | TypeError):
        return "rejected", str(exc)
    if isinstance(exc, TimeoutError):
        return "retry", "read timed out"
    return "retry", f"{type(exc).__name__}: {exc}"


def _settle(outcomes: Sequence[Any], classify: Any) -> list[ReadResult]:
    """All reads succeeded -> their results; otherwise the worst error, most severe first
    (fatal, rejected, unavailable, retry)."""
    results: list[ReadResult | None] = []
    rejected: dict[int, str] = {}
    fatal: str | None = None
    retry: tuple[str, BaseException] | None = None
    unavailable: tuple[str, BaseException] | None = None
    for i, out in enumerate(outcomes):
        if isinstance(out, ReadResult):
            results.append(out)
            continue
        results.append(None)
        if not isinstance(out, Exception):  # CancelledError, KeyboardInterrupt
            raise out
        kind, message = classify(out)
        if kind == "fatal":
            fatal = fatal or message
        elif kind == "rejected":
            rejected[i] = message
        elif kind == "unavailable":
            unavailable = unavailable or (f"read {i}: {message}", out)
        elif retry is None:
            retry = (f"read {i}: {message}", out)
    if fatal is not None:
        raise FatalEngineError(fatal)
    if rejected:
        first = min(rejected)
        raise ReadRejected(first, rejected[first], rejected=rejected, results=results)
    if unavailable is not None:
        raise EngineUnavailable(unavailable[0]) from unavailable[1]
    if retry is not None:
        raise RecoverableEngineError(retry[0]) from retry[1]
    return [r for r in results if r is not None]


# --- remote mode: an external `vllm serve` over its OpenAI completions API -----------------


class VllmRemoteSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str = "http://127.0.0.1:8000"
    # The served model name (`vllm serve ... --served-model-name`).
    model: str = "RedHatAI/diffusiongemma-26B-A4B-it-NVFP4"
    # The server's --diffusion-config canvas_length (reported in EngineInfo only).
    canvas_length: int = 64
    vocab_size: int = DIFFUSION_GEMMA_VOCAB
    diffusion_constrained: bool = True
    # Name of the environment variable holding the API key (`vllm serve --api-key`); the key
    # itself is read per request and never stored in settings or logged.
    api_key_env: str = "DGSTREAM_VLLM_API_KEY"
    # Same guard as VllmSettings.read_timeout_s.
    timeout_s: float = 120.0


def build_completion_body(
    read: Read, settings: VllmRemoteSettings, shared: frozenset[int] | tuple[int, ...] = ()
) -> dict[str, Any]:
    """The /v1/completions request of one read."""
    union = logprob_ids(read, shared)
    return {
        "model": settings.model,
        "prompt": [int(t) for t in read.prompt_ids],
        "max_tokens": len(read.canvas_ids),
        # Must be set with logprob_token_ids (`CompletionRequest.check_logprobs`), but its
        # value is then unused: `to_sampling_params` drops it and the response carries every
        # requested id (`completion_top_logprobs_limit(..., return_all=True)`).
        "logprobs": 1,
        "logprob_token_ids": union,
        "vllm_xargs": build_xargs(read, constrained=settings.diffusion_constrained),
        # The server's generation-config defaults (Gemma: top_k 64, top_p 0.95) would filter
        # the logits the logprobs come from, and diffusion takes only temperature 1.0.
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        # Keys of top_logprobs as "token_id:<id>" and the argmax canvas as ids.
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stream": False,
    }


def _token_key_id(key: str) -> int:
    if not key.startswith("token_id:"):
        raise RecoverableEngineError(f"unexpected logprob key {key!r} (want 'token_id:<id>')")
    return int(key[len("token_id:") :])


def parse_completion(
    read: Read, body: Mapping[str, Any], *, constrained: bool = True
) -> ReadResult:
    """A /v1/completions response (with return_tokens_as_token_ids) -> the read's slot reads.

    -inf logprobs arrive clamped to -9999.0 (`OpenAIServingCompletion.
    _create_completion_logprobs`), which exp() turns into 0 all the same.
    """
    try:
        choice = body["choices"][0]
        top = choice["logprobs"]["top_logprobs"]
        tokens = choice["logprobs"].get("tokens") or []
    except (KeyError, IndexError, TypeError) as exc:
        raise RecoverableEngineError(f"malformed completion response: {exc!r}") from exc
    token_ids = choice.get("token_ids") or [_token_key_id(t) for t in tokens]
    slots = []
    for slot in read.slots:
        if not 0 <= slot.position < len(top) or top[slot.position] is None:
            raise RecoverableEngineError(
                f"read {read.tag!r}: no logprobs at canvas position {slot.position}"
            )
        row = {_token_key_id(k): float(v) for k, v in top[slot.position].items()}
        argmax_id = int(token_ids[slot.position]) if slot.position < len(token_ids) else None
        slots.append(_slot_read(slot, row, argmax_id, constrained))
    return ReadResult(slots=tuple(slots))


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class VllmRemoteEngine:
    """The same reads against an external `vllm serve` (stdlib HTTP in worker threads)."""

    def __init__(
        self, settings: VllmRemoteSettings | None = None, *, shared_labels: Sequence[int] = ()
    ) -> None:
        self.settings = settings or VllmRemoteSettings()
        self.shared_labels = frozenset(shared_labels)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            backend="vllm-remote",
            model=self.settings.model,
            canvas_length=self.settings.canvas_length,
            vocab_size=self.settings.vocab_size,
            device="remote",
        )

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        url = self.settings.base_url.rstrip("/") + "/v1/completions"
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = os.environ.get(self.settings.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=self.settings.timeout_s) as resp:
                parsed: dict[str, Any] = json.loads(resp.read())
                return parsed
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                message = json.loads(raw)["error"]["message"]
            except Exception:
                message = raw[:500].decode(errors="replace")
            raise _HttpError(exc.code, str(message)) from None

    async def _read_one(self, read: Read) -> ReadResult:
        started = time.perf_counter()
        body = await asyncio.to_thread(
            self._post, build_completion_body(read, self.settings, self.shared_labels)
        )
        result = parse_completion(read, body, constrained=self.settings.diffusion_constrained)
        return ReadResult(slots=result.slots, timings={"engine_s": time.perf_counter() - started})

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
        outcomes = await asyncio.gather(*(self._read_one(r) for r in reads), return_exceptions=True)
        return _settle(outcomes, _classify_http_error)

    async def close(self) -> None:
        return None


# A server that is down, restarting or overloaded: 429 Too Many Requests, 502/503/504 from
# it or a proxy in front of it. Other 5xx are errors of one request (retried, then split).
_UNAVAILABLE_STATUS = (429, 502, 503, 504)


def _classify_http_error(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, _HttpError):
        if exc.status in (400, 422):  # vLLM's VLLMValidationError -> 400 Bad Request
            return "rejected", str(exc)
        if exc.status in (401, 403, 404):  # wrong key, URL or model: fix the config
            return "fatal", str(exc)
        if exc.status in _UNAVAILABLE_STATUS:
            return "unavailable", str(exc)
        return "retry", str(exc)
    if isinstance(exc, FatalEngineError):
        return "fatal", str(exc)
    # Connection refused or reset, DNS, a timeout: the server is out of reach
    # (urllib.error.URLError wraps them; TimeoutError and ConnectionError are OSErrors).
    if isinstance(exc, urllib.error.URLError | OSError):
        return "unavailable", f"{type(exc).__name__}: {exc}"
    return "retry", f"{type(exc).__name__}: {exc}"


__all__ = [
    "MAX_LOGPROB_TOKEN_IDS",
    "TWO_STEP_KEY",
    "VllmEngine",
    "VllmRemoteEngine",
    "VllmRemoteSettings",
    "VllmSettings",
    "build_completion_body",
    "build_sampling_params",
    "build_xargs",
    "check_model",
    "engine_args",
    "logprob_ids",
    "parse_completion",
    "parse_output",
    "serve_command",
]

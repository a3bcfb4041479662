"""The vLLM engines' settings: the in-process engine's (`VllmSettings`, one 24 GB card) and
the remote one's (`VllmRemoteSettings`, an external `vllm serve`).

What the read path's features need of the settings is not written here: the settings ask
`workers.engine.vllm_reads.rules`, which vLLM's config hook and graph manager ask too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dgstream.schemas.images import MAX_IMAGES
from dgstream.workers.engine.vllm_reads import rules

__all__ = [
    "DIFFUSION_GEMMA_VOCAB",
    "MAX_LOGPROB_TOKEN_IDS",
    "MAX_NUM_SEQS",
    "MAX_READ_PATH_SEQS",
    "READ_PATH_SEQS",
    "VllmRemoteSettings",
    "VllmSettings",
]

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
    # `images_per_request` > 0 turns the tower on (with this set true explicitly: refused).
    language_model_only: bool = True
    # Images a request may carry to the vision tower; 0 (the default): the tower stays off
    # and a request with images is dead-lettered IMAGES_NOT_READ. N > 0 loads the tower
    # (`language_model_only` False, vLLM's `limit_mm_per_prompt` image N, video 0) and the
    # engine reads images (`EngineInfo.reads_images`). Off by default because the tower does
    # not fit the 23.6 GiB card beside the defaults' 16,384-token requests: its weights,
    # encoder cache and encoder activations take about 2.06 GiB of the 3.19 GiB KV cache
    # (`sizing.image_cost`, docs/vllm.md "Images"), and `check_images` refuses, by name,
    # settings that leave too little. At most MAX_IMAGES (8), the request limit.
    images_per_request: int = Field(default=0, ge=0, le=MAX_IMAGES)
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
    def _images_need_the_tower(self) -> VllmSettings:
        if (
            self.images_per_request
            and self.language_model_only
            and "language_model_only" in self.model_fields_set
        ):
            raise ValueError(
                f"images_per_request: {self.images_per_request} needs the vision tower, which "
                "language_model_only true leaves out; unset language_model_only (or set "
                "images_per_request 0)"
            )
        return self

    @property
    def reads_images(self) -> bool:
        """Whether an engine of these settings loads the vision tower and reads images."""
        return self.images_per_request > 0

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

    def shape(self, read_path: str | None = None) -> rules.Shape:
        """What the read path's rules (`workers.engine.vllm_reads.rules`) read of these
        settings, for an engine on `read_path` (default: the settings' own)."""
        return rules.Shape(
            read_path=read_path or self.read_path,
            attention_backend=self.attention_backend,
            tensor_parallel_size=self.tensor_parallel_size,
            async_scheduling=self.async_scheduling,
            enforce_eager=self.enforce_eager,
            cudagraph_mode=self.cudagraph_mode,
        )

    def one_step_clashes(self, read_path: str | None = None) -> list[str]:
        """The settings that keep one-step reads off an engine on `read_path` (default:
        the settings' own), each named with what it would need."""
        return rules.clashes(rules.ONE_STEP, self.shape(read_path))

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
        return rules.clashes(rules.FULL_GRAPHS, self.shape(read_path))

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


class VllmRemoteSettings(BaseModel):
    # The remote engine's settings: an external `vllm serve` over its OpenAI completions API.
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

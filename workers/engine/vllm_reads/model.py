"""The read path's model and model state: vLLM 0.33's DiffusionGemma, subclassed.

Registered under vLLM's own architecture name (`DiffusionGemmaForBlockDiffusion`), so a
checkpoint needs no change. With the read path off for an engine (no `additional_config`
entry) every method here is vLLM's own. With it on:

- `compute_logits` hands the step's canvas rows to the read sampler instead of unembedding
  them (`defer_next`): the sampler computes, per label set, only the columns a read reports,
  and full-vocabulary rows one bounded tile at a time, so no [rows x vocabulary] tensor of
  the whole step is ever materialised. Prompt-only steps skip their (unused) logits too.
- self-conditioning runs as one batched call over every denoising row of the step (vLLM
  runs its MLP once per request); for fresh single-step reads, whose soft embeddings are
  zero by construction, that call is the MLP's final norm alone, which is what the MLP
  gives for a zero input, exactly.
- arrivals are staged and written once per step (`admission.Admissions`).

Only single-step reads (read-only, one step, no pins, no top-k/top-p, no top-k logprobs)
and vLLM's own warmup requests take the read path; a step holding anything else runs
vLLM's own code for the whole step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from vllm.model_executor.models import diffusion_gemma as dg

from dgstream.workers.engine.vllm_reads import debug
from dgstream.workers.engine.vllm_reads.admission import Admissions
from dgstream.workers.engine.vllm_reads.loggers import reads_logger
from dgstream.workers.engine.vllm_reads.options import ReadPathOptions
from dgstream.workers.engine.vllm_reads.plan import fused_ranges, fused_requests, spans
from dgstream.workers.engine.vllm_reads.rows import fill_device, to_device

logger = reads_logger("model")

# vLLM's own warmup requests (`vllm/v1/worker/gpu/warmup.py` names them `_warmup_<i>_`):
# the read path serves them as full-vocabulary reads, so the warmup runs the read path's
# kernels at the served canvas, inside the tile the memory profile counted.
WARMUP_PREFIX = "_warmup_"
# Label sets whose unembedding rows are kept gathered (a worker uses one shared set; a
# bound keeps a client that sends many sets from growing the cache).
MAX_CACHED_LABEL_SETS = 64


def fix_unpooled_tower(tower: Any) -> None:
    """vLLM builds DiffusionGemma's vision tower as transformers' own module and keeps the
    rows its pooler's mask marks (gemma4_mm.py, `_process_image_input`); transformers 5.20's
    pooler returns its mask of PADDING rows when it does not pool (pooling_kernel_size 1,
    the demo tower's), so an image would come out as its padding rows, not its 64 soft
    tokens. The transformers engine's fix (`vllm_reads.tower`) applies here too;
    pooling towers (the full-size one) are left as they are."""
    if tower is None or int(getattr(tower.config, "pooling_kernel_size", 1) or 1) != 1:
        return
    from dgstream.workers.engine.vllm_reads.tower import fix_unpooled_mask

    fix_unpooled_mask(tower)


class DgDiffusionGemma(dg.DiffusionGemmaForConditionalGeneration):
    """vLLM's DiffusionGemma, with the read path's unembedding."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        fix_unpooled_tower(getattr(self, "vision_tower", None))
        self.read_options = ReadPathOptions.from_additional_config(vllm_config.additional_config)
        self.defer_next = False
        self._deferred: torch.Tensor | None = None
        self._label_weights: dict[tuple[int, ...], torch.Tensor] = {}

    @staticmethod
    def get_model_state_cls() -> type[DgModelState]:
        return DgModelState

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        watch = debug.watch()
        # The diagnostics' per-token check (off unless asked); never inside a graph capture,
        # whose replay would not run it.
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if watch is not None and isinstance(out, torch.Tensor) and not capturing:
            watch.tokens(out)
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if self.defer_next:
            # The sampler's call of this step: it unembeds the rows itself.
            self.defer_next = False
            self._deferred = hidden_states
            return hidden_states
        return super().compute_logits(hidden_states)

    def take_deferred(self) -> torch.Tensor | None:
        rows, self._deferred = self._deferred, None
        return rows

    def label_logits(self, rows: torch.Tensor, allowed: tuple[int, ...]) -> torch.Tensor:
        """[rows, K] float32 softcapped logits of the allowed ids, as vLLM's constrained
        step computes them (a GEMM over the tied embedding's gathered rows)."""
        weight = self._label_weights.get(allowed)
        if weight is None:
            states: Any = self.diffusion_states  # set by the model state (vLLM's own)
            head: Any = self.lm_head
            weight = head.weight[states.allowed_tensor(allowed)]
            if len(self._label_weights) >= MAX_CACHED_LABEL_SETS:
                self._label_weights.clear()
            self._label_weights[allowed] = weight
        return self._softcap(F.linear(rows, weight).float())

    def vocab_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """[rows, vocabulary] float32 softcapped logits, as vLLM's full-vocabulary step."""
        logits = self.logits_processor(self.lm_head, rows)
        return self._softcap(logits.float())

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.final_logit_softcapping
        return dg._softcap_logits(logits, cap) if cap is not None else logits


class DgModelState(dg.DiffusionGemmaModelState):
    """vLLM's DiffusionGemma model state, with batched self-conditioning and admission."""

    model: DgDiffusionGemma

    def __init__(self, vllm_config: Any, model: Any, encoder_cache: Any, device: Any) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        options = ReadPathOptions.from_additional_config(vllm_config.additional_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.read_path = options.enabled and tp == 1
        if options.enabled and tp != 1:
            logger.warning("dgstream read path: tensor parallel %d; vLLM's own path serves", tp)
        self.options = options
        # One-step reads (`scheduler.DgOneStepScheduler`): this side lays their canvas
        # (admission), masks it (`prepare_attn`) and self-conditions only its rows.
        self.one_step = self.read_path and options.one_step
        # FULL graphs' ranges (`prepare_attn`), made at the first FULL step or capture.
        self._graph_ranges: torch.Tensor | None = None
        # Whether the log has said that a fused read ran in a FULL graph (once).
        self._said_fused_full = False
        if self.read_path and options.full_graph_tokens:
            # Before the runner builds its graph manager (it loads the model first).
            from dgstream.workers.engine.vllm_reads import graphs

            graphs.install()
        # Logit rows per request of the step being prepared (`prepare_inputs`).
        self._logit_rows = np.zeros(0, dtype=np.int64)
        self.admissions = Admissions(self.diffusion_states)
        # Slots whose request may take the read path (see the module docstring).
        self.read_slots: set[int] = set()
        self.warmup_slots: set[int] = set()
        if self.read_path:
            logger.info(
                "dgstream read path on: max_num_seqs %d, full-vocabulary tile %d MiB",
                self.max_num_reqs,
                options.logits_tile_mib,
            )

    def custom_sampler(self, sampler: Any) -> tuple[Any, Any] | None:
        stock = super().custom_sampler(sampler)
        if not self.read_path or stock is None:
            return stock
        from dgstream.workers.engine.vllm_reads.sampler import DgReadSampler

        return DgReadSampler(stock[0], self), stock[1]

    def add_request(self, req_index: int, new_req_data: Any) -> None:
        if not self.read_path:
            super().add_request(req_index, new_req_data)
            return
        req_id = new_req_data.req_id
        self._req_id_to_index[req_id] = req_index
        warmup = req_id.startswith(WARMUP_PREFIX)
        prompt = 0 if warmup else len(new_req_data.prompt_token_ids or ())
        self.admissions.reset(req_index, prompt)
        self.read_slots.discard(req_index)
        (self.warmup_slots.add if warmup else self.warmup_slots.discard)(req_index)

    def remove_request(self, req_id: str) -> None:
        if not self.read_path:
            super().remove_request(req_id)
            return
        idx = self._req_id_to_index.pop(req_id, None)
        if idx is not None:
            self.admissions.release(idx)
            self.read_slots.discard(idx)
            self.warmup_slots.discard(idx)

    def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
        if self.read_path:
            n = input_batch.num_reqs
            self._logit_rows = np.diff(input_batch.cu_num_logits_np[: n + 1]).astype(np.int64)
        out = super().prepare_inputs(input_batch, req_states)
        watch = debug.watch()
        if watch is not None:
            n = input_batch.num_reqs
            watch.starts = np.array(input_batch.query_start_loc_np[: n + 1], dtype=np.int64)
        if self.read_path:
            self.model.defer_next = self._reads_only(input_batch)
        return out

    def prepare_attn(
        self,
        input_batch: Any,
        cudagraph_mode: Any,
        block_tables: Any,
        slot_mappings: Any,
        attn_groups: Any,
        kv_cache_config: Any,
        for_capture: bool = False,
        ubatch_idx: int = 0,
    ) -> dict[str, Any]:
        metadata: dict[str, Any] = super().prepare_attn(
            input_batch,
            cudagraph_mode,
            block_tables,
            slot_mappings,
            attn_groups,
            kv_cache_config,
            for_capture=for_capture,
            ubatch_idx=ubatch_idx,
        )
        if not self.one_step:
            return metadata
        n = input_batch.num_reqs
        device = input_batch.query_start_loc.device
        # Every step gets the ranges, zeros where no read is fused (inert: the mask takes a
        # range only where start < end). The attention kernel is a variant of its own with
        # ranges, and Triton compiles a variant the first time it runs: given on every
        # step, vLLM's warmup compiles it. Given on fused steps only, the variants compiled
        # while serving (vLLM's JIT monitor warned of kernel_unified_attention), and the
        # rows with four batches in flight stalled: p99 2.3 s at batch 1 and 3.4 s at
        # batch 256 on one question set (2026-12-05, H200). A capture's batch is vLLM's
        # dummy: all zeros.
        ranges = (
            np.zeros((n, 1, 2), dtype=np.int32)
            if for_capture
            else fused_ranges(
                fused_requests(input_batch),
                input_batch.cu_num_logits_np,
                input_batch.prefill_len_np,
                n,
            )
        )
        if for_capture or cudagraph_mode == dg.CUDAGraphMode.FULL:
            # A FULL graph (vLLM prepares its capture with for_capture, its replays with
            # mode FULL): the kernel it holds reads the ranges through the pointer it was
            # captured with, so every FULL step writes them into one persistent buffer,
            # one row per request the graph was captured for (vLLM pads a FULL step's
            # requests up to max_num_seqs), zeros past this step's.
            tensor = self._graph_buffer(device)
            host = np.zeros(tuple(tensor.shape), dtype=np.int32)
            host[:n] = ranges
            fill_device(tensor, host)
            if not for_capture and not self._said_fused_full and ranges.any():
                self._said_fused_full = True
                logger.info("dgstream one-step reads: a fused step ran as one FULL CUDA graph")
        else:
            # A tensor of the step's own: async scheduling prepares a step while the one
            # before it runs.
            tensor = to_device(ranges, device)
        for md in {id(m): m for m in metadata.values()}.values():
            if not hasattr(md, "mm_prefix_range_tensor"):
                raise RuntimeError(
                    f"dgstream one-step reads need TRITON_ATTN; this step's attention "
                    f"metadata is {type(md).__name__}"
                )
            md.mm_prefix_range_tensor = tensor
        return metadata

    def _graph_buffer(self, device: torch.device) -> torch.Tensor:
        """The FULL graphs' [max_num_seqs, 1, 2] range buffer, made at the first FULL step
        or capture (vLLM's profile and warmup run before its captures) and kept for the
        engine's life: every FULL graph holds its address."""
        if self._graph_ranges is None:
            self._graph_ranges = torch.zeros(
                (self.max_num_reqs, 1, 2), dtype=torch.int32, device=device
            )
        return self._graph_ranges

    def _reads_only(self, input_batch: Any) -> bool:
        """Whether every request that denoises this step is a single-step read (a step
        with none, prompts only, skips its logits). Reads `_logit_rows`, which
        `prepare_inputs` set for this step."""
        if input_batch.num_draft_tokens == 0:
            return True
        n = input_batch.num_reqs
        slots = input_batch.idx_mapping_np[:n][self._logit_rows > 0].tolist()
        return all(s in self.read_slots or s in self.warmup_slots for s in slots)

    def _apply_self_conditioning(
        self,
        decode_slots_np: np.ndarray,
        decode_idx_np: np.ndarray,
        query_start_loc_np: np.ndarray,
        inputs_embeds: torch.Tensor,
        sc_embeds: torch.Tensor,
    ) -> None:
        if not self.read_path or len(decode_idx_np) == 0:
            super()._apply_self_conditioning(
                decode_slots_np, decode_idx_np, query_start_loc_np, inputs_embeds, sc_embeds
            )
            return
        ends = query_start_loc_np[decode_idx_np + 1].astype(np.int64)
        # A request's canvas is its last rows: all of them in a canvas step, the tail
        # after its prompt for a one-step read.
        starts = ends - self._logit_rows[decode_idx_np]
        where = spans(starts, ends)
        rows: slice | torch.Tensor = (
            slice(*where) if isinstance(where, tuple) else to_device(where, inputs_embeds.device)
        )
        sc = self.model.self_conditioning
        x = inputs_embeds[rows]
        if self.diffusion_states.single_step_slots.issuperset(decode_slots_np.tolist()):
            # First and only step: the soft embeddings are zero, and the MLP of zero is
            # zero, so the call reduces to its final norm over the rows.
            inputs_embeds[rows] = sc.post_norm(x)
            return
        counts = ends - starts
        slot_rows = np.repeat(decode_slots_np.astype(np.int64), counts)
        positions = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
            np.concatenate(([0], np.cumsum(counts)[:-1])), counts
        )
        index = to_device(np.stack((slot_rows, positions)), inputs_embeds.device)
        soft = sc_embeds[index[0], index[1]]
        inputs_embeds[rows] = sc(x, soft.to(inputs_embeds.dtype))


__all__ = ["WARMUP_PREFIX", "DgDiffusionGemma", "DgModelState"]

"""FULL CUDA graphs for small steps that mix prompts and canvases, under vLLM's default mode.

vLLM 0.33's default graph mode (FULL_AND_PIECEWISE) replays one FULL graph only for a
uniform canvas step; any step with a prompt in it runs piecewise: its attention ops run in
Python between graph pieces, one per layer. A one-step read's step always holds a prompt,
so a lone read paid that Python on every layer: on an H100 as the 24 GB card the GPU was
busy 39-52% of a lone read, and FULL graphs for every step took it from 22.9 to 15.9 ms
p50 on one question set (2026-12-06, docs/benchmarks.md section card24-full-one-step).
FULL for every step costs a quarter of the KV cache, though: its graphs up to the token
budget are captured past vLLM's budget.

This module keeps vLLM's mode and adds FULL graphs for mixed steps of at most
`ReadPathOptions.full_graph_tokens` tokens, where the host's share of a step is largest
and a graph's memory is smallest. Larger mixed steps stay piecewise. vLLM's v2 runner
builds its `ModelCudaGraphManager` from a module-level name, so `install` (called by the
read path's model state, in the worker process, before the runner builds its manager)
binds that name to a subclass; the subclass adds the graphs only for an engine whose
options ask for them, and vLLM's profile of graph memory (which captures the manager's
graphs before sizing the KV cache) counts them. With 1,024 tokens (27 graph sizes) a lone
read took 18.1 ms p50 on one question set against 32.7 piecewise, batches read level or
faster, and the KV cache kept 99.2% of its blocks (docs/benchmarks.md section
card24-small-full).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu import model_runner as runner_module
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor as Desc

from dgstream.workers.engine.vllm_reads import rules
from dgstream.workers.engine.vllm_reads.loggers import reads_logger
from dgstream.workers.engine.vllm_reads.options import ReadPathOptions

logger = reads_logger("graphs")


def mixed_full_descs(
    capture_sizes: Iterable[int], limit: int, max_num_reqs: int, lora_cases: Iterable[int]
) -> list[Desc]:
    """The FULL descriptors for mixed steps of up to `limit` tokens, largest first: one per
    capture size and LoRA case, its requests padded as vLLM pads a FULL mode's mixed step
    (`min(tokens, max_num_reqs)`), any query lengths."""
    sizes = sorted({s for s in capture_sizes if 0 < s <= limit}, reverse=True)
    return [
        Desc(
            cg_mode=CUDAGraphMode.FULL,
            num_tokens=s,
            num_reqs=min(s, max_num_reqs),
            num_active_loras=loras,
        )
        for s in sizes
        for loras in lora_cases
    ]


def add_mixed_full_graphs(manager: Any, limit: int) -> list[Desc]:
    """Add FULL graphs for mixed steps of up to `limit` tokens to a manager whose
    candidates vLLM has built: to its captures (FULL, after the piecewise ones, as vLLM
    captures) and to each token count's candidates, ahead of the piecewise graph and after
    vLLM's own FULL graphs (a uniform canvas step keeps the graph vLLM made for it).
    Returns the descriptors added."""
    sizes = manager.compilation_config.cudagraph_capture_sizes or []
    added = [
        d
        for d in mixed_full_descs(sizes, limit, manager.max_num_reqs, manager.lora_capture_cases)
        if d not in manager._capture_descs.get(CUDAGraphMode.FULL, [])
    ]
    if not added:
        return []
    full = manager._capture_descs.get(CUDAGraphMode.FULL, []) + added
    full.sort(key=lambda d: d.num_tokens, reverse=True)
    manager._capture_descs[CUDAGraphMode.FULL] = full
    # A step of n tokens pads to the smallest size >= n (vLLM's candidate ranges).
    for loras in manager.lora_capture_cases:
        start = 0
        for desc in sorted(
            (d for d in added if d.num_active_loras == loras), key=lambda d: d.num_tokens
        ):
            for n in range(start, desc.num_tokens + 1):
                candidates = manager._candidates.setdefault((n, loras), [])
                at = next(
                    (i for i, d in enumerate(candidates) if d.cg_mode != CUDAGraphMode.FULL),
                    len(candidates),
                )
                candidates.insert(at, desc)
            start = desc.num_tokens + 1
    return added


def refusal(vllm_config: Any, cudagraph_mode: Any, ubatch_runner: Any) -> str | None:
    """Why an engine's mixed steps cannot run as FULL graphs (None: they can), against
    `rules.FULL_GRAPHS` on the mode and micro-batching the manager resolved."""
    shape = rules.shape_of_vllm_config(
        vllm_config, cudagraph_mode=cudagraph_mode, micro_batching=ubatch_runner is not None
    )
    return "; ".join(rules.clashes(rules.FULL_GRAPHS, shape)) or None


class _Manager(runner_module.ModelCudaGraphManager):
    """vLLM's manager, plus FULL graphs for small mixed steps where the engine asks."""

    def _init_candidates(self) -> None:
        super()._init_candidates()
        options = ReadPathOptions.from_additional_config(self.vllm_config.additional_config)
        limit = options.full_graph_tokens if options.enabled else 0
        if not limit or not self.cudagraph_mode:
            return
        why = refusal(self.vllm_config, self.cudagraph_mode, self.ubatch_runner)
        if why is not None:
            logger.warning("dgstream: mixed steps stay piecewise: %s", why)
            return
        added = add_mixed_full_graphs(self, limit)
        if added:
            logger.info(
                "dgstream: steps of up to %d tokens that mix prompts and canvases run as "
                "FULL CUDA graphs (%d sizes)",
                max(d.num_tokens for d in added),
                len(added),
            )


_Manager.__name__ = _Manager.__qualname__ = "DgModelCudaGraphManager"


def install() -> None:
    """Bind vLLM's runner to the manager above (idempotent). The runner looks the name up
    when it builds a manager (once to profile graph memory, once to serve), so this must
    run first: the model state calls it when the runner loads the model."""
    current = runner_module.ModelCudaGraphManager
    if current is _Manager:
        return
    if current is not _Manager.__mro__[1]:
        # Someone else replaced it: stacking on theirs would drop their change or ours.
        raise RuntimeError(
            f"dgstream: vLLM's ModelCudaGraphManager is already replaced ({current!r}); "
            "set full_graph_tokens 0"
        )
    runner_module.ModelCudaGraphManager = _Manager


def uninstall() -> None:
    """vLLM's own manager back (tests)."""
    runner_module.ModelCudaGraphManager = _Manager.__mro__[1]


__all__ = [
    "add_mixed_full_graphs",
    "install",
    "mixed_full_descs",
    "refusal",
    "uninstall",
]

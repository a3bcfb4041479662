"""The read path's rules: what each of its features needs from an engine, in one place.

Two sides read them. The engine's settings (`workers.engine.vllm.settings.VllmSettings`)
refuse a feature asked for against them, or step it aside, naming the settings, before
anything starts. Inside vLLM's processes the config hook (`one_step_refusal`) and the graph
manager (`graphs.refusal`) check the config vLLM resolved, which may differ from the
settings (a scheduler class or micro-batching set some other way). Both describe what they
know as a `Shape`, and each feature's rules read it. This module imports neither vLLM nor
torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FULL_GRAPHS",
    "ONE_STEP",
    "READ_PATH",
    "Shape",
    "clashes",
    "shape_of_vllm_config",
]


@dataclass(frozen=True)
class Shape:
    """What the rules read about an engine (each field named as the setting that sets it)."""

    read_path: str = "dgstream"
    attention_backend: str | None = "TRITON_ATTN"
    tensor_parallel_size: int = 1
    # None: vLLM's default, which the rules do not count on.
    async_scheduling: bool | None = True
    enforce_eager: bool = False
    # None: vLLM's default, FULL_AND_PIECEWISE.
    cudagraph_mode: str | None = None
    # A scheduler class configured in vLLM (none of the settings set one).
    scheduler_cls: str | None = None
    # vLLM's micro-batching (enable_dbo / ubatch_size; none of the settings set it).
    micro_batching: bool = False


Rule = Callable[[Shape], "str | None"]


def _dgstream_path(s: Shape) -> str | None:
    if s.read_path == "dgstream":
        return None
    return f"read_path {s.read_path!r} (needs 'dgstream')"


def _triton(s: Shape) -> str | None:
    if s.attention_backend == "TRITON_ATTN":
        return None
    return f"attention_backend {s.attention_backend!r} (needs TRITON_ATTN)"


def _one_gpu(s: Shape) -> str | None:
    if s.tensor_parallel_size == 1:
        return None
    return f"tensor_parallel_size {s.tensor_parallel_size} (the read path serves one GPU)"


def _async(s: Shape) -> str | None:
    if s.async_scheduling is True:
        return None
    return f"async_scheduling {s.async_scheduling} (needs true)"


def _own_scheduler(s: Shape) -> str | None:
    if s.scheduler_cls is None:
        return None
    return f"scheduler_cls {s.scheduler_cls!r} (another scheduler class is configured)"


def _no_micro_batching(s: Shape) -> str | None:
    if not s.micro_batching:
        return None
    # Each micro-batch gets attention metadata and graphs of its own; the read path's ranges
    # and graphs are laid out for the whole step.
    return "micro-batching (enable_dbo / ubatch_size: the read path lays out the whole step)"


def _cuda_graphs(s: Shape) -> str | None:
    if not s.enforce_eager:
        return None
    return "enforce_eager true (no CUDA graphs)"


def _piecewise_default(s: Shape) -> str | None:
    if s.cudagraph_mode in (None, "FULL_AND_PIECEWISE"):
        return None
    return (
        f"cudagraph_mode {s.cudagraph_mode!r} (needs FULL_AND_PIECEWISE, vLLM's default; "
        "FULL graphs every step already)"
    )


# What every read-path feature inside vLLM needs: the plugin's path, TRITON_ATTN (the
# backend they run on) and one GPU.
READ_PATH: tuple[Rule, ...] = (_dgstream_path, _triton, _one_gpu)
# One-step reads (`scheduler.py`): async scheduling (the canvas is counted in flight as in
# vLLM's async bookkeeping) and the plugin's own scheduler class. Any cudagraph_mode: FULL
# graphs read the ranges from one persistent buffer.
ONE_STEP: tuple[Rule, ...] = (*READ_PATH, _async, _own_scheduler, _no_micro_batching)
# FULL graphs for small mixed steps (`graphs.py`): CUDA graphs, under vLLM's default mode.
FULL_GRAPHS: tuple[Rule, ...] = (*READ_PATH, _cuda_graphs, _piecewise_default, _no_micro_batching)


def clashes(rules: tuple[Rule, ...], shape: Shape) -> list[str]:
    """The rules `shape` breaks, each naming the setting and what it would need."""
    return [why for rule in rules if (why := rule(shape)) is not None]


def _name(value: Any) -> str | None:
    """An enum's name (vLLM's backends and graph modes), a string as it is, None as None."""
    if value is None:
        return None
    return str(getattr(value, "name", value))


def shape_of_vllm_config(
    vllm_config: Any, *, cudagraph_mode: Any = None, micro_batching: bool | None = None
) -> Shape:
    """The `Shape` of a config vLLM resolved (the plugin is on wherever this is asked).
    `cudagraph_mode` and `micro_batching`: what the graph manager resolved, where it knows
    better than the config."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    attention = getattr(vllm_config, "attention_config", None)
    if micro_batching is None:
        micro_batching = bool(getattr(parallel, "use_ubatching", False))
    return Shape(
        read_path="dgstream",
        attention_backend=_name(getattr(attention, "backend", None)),
        tensor_parallel_size=int(getattr(parallel, "tensor_parallel_size", 1)),
        async_scheduling=getattr(scheduler, "async_scheduling", None),
        cudagraph_mode=_name(cudagraph_mode),
        scheduler_cls=_name(getattr(scheduler, "scheduler_cls", None)),
        micro_batching=micro_batching,
    )

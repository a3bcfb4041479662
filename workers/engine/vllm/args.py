"""What the in-process engine hands vLLM: which read path runs here, vLLM's engine
arguments (`engine_args`), the same as a `vllm serve` command line (`serve_command`), and
the environment (the caches' folder, diagnostics)."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dgstream.workers.engine.vllm.settings import MAX_NUM_SEQS, VllmSettings
from dgstream.workers.engine.vllm.sizing import (
    MAX_SOFT_TOKENS,
    card_bytes,
    check_full_graphs,
    check_images,
    check_model,
    graph_sizes,
    stock_utilization,
)

__all__ = [
    "CACHE_ENV",
    "DEBUG_INDUCTOR_ENV",
    "GRAPHS_RESERVE_GIB",
    "MPS_SHARE_ENV",
    "apply_cache_dir",
    "debug_inductor_options",
    "engine_args",
    "graphs_for_the_share",
    "graphs_memory_kept",
    "mps_share",
    "read_path_available",
    "resolve_read_path",
    "serve_command",
]


def read_path_available() -> str | None:
    """None when the project's read path can serve in vLLM here, else why not: it needs
    vLLM 0.33.x and the plugin's entry point installed (vLLM finds plugins only through
    package metadata, in every process it starts)."""
    from importlib import metadata

    from dgstream.workers.engine import vllm_reads

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


log = logging.getLogger(__name__)

# What limits a process to a share of the GPU's SMs under MPS (the engine core inherits it).
MPS_SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
# Why an engine under an MPS share runs without CUDA graphs (docs/vllm.md, "A slower GPU").
GRAPHS_UNDER_MPS = (
    "CUDA graphs replayed in a process held to a share of the SMs by MPS computed NaN "
    "hidden states for whole blocks of a step's tokens (an H100 at 15%, 2026-12-07: 20 of "
    "40 batches of 32 failed with the defaults, 14 with piecewise graphs only, 0 without "
    "graphs, compiled or eager)"
)


def mps_share(environ: Mapping[str, str] | None = None) -> float | None:
    """The SM share (percent, below 100) MPS holds this process to, else None."""
    value = (os.environ if environ is None else environ).get(MPS_SHARE_ENV, "").strip()
    try:
        share = float(value)
    except ValueError:
        return None
    return share if 0 < share < 100 else None


# What vLLM sets aside inside gpu_memory_utilization for the CUDA graphs it will capture
# (its memory profile counts them since 0.21): on the full-size NVFP4 engine at the defaults
# on the emulated 23.6 GiB card, "--gpu-memory-utilization=0.9000 is equivalent to
# --gpu-memory-utilization=0.8657 without CUDA graph memory profiling" (an H100 at 15% of its
# SMs, 2026-12-07): 0.0343 x 23.6 = 0.81 GiB. An engine without graphs hands that to its KV
# cache instead, and vLLM's warmup, whose prompt-logprob pass (1,024 rows of the 262,144-id
# vocabulary: a 1.0 GiB float32 tile) its profile never runs, then found no room: both
# slow-GPU engines of 2026-12-07 at 0.9 ran out of memory there, 22.2 and 22.8 GiB held of
# the 22.6 the card leaves PyTorch (docs/data/card24/slow_gpu_2026-12-07). Keeping the KV
# cache where the graphs left it keeps the memory layout of the engines that started at 0.9
# with graphs (2026-12-06, docs/data/card24/small_full).
GRAPHS_RESERVE_GIB = 0.81


def graphs_memory_kept(settings: VllmSettings) -> float | None:
    """gpu_memory_utilization less what vLLM would have set aside for CUDA graphs, when the
    operator left it at its default and the card is known; None otherwise (an explicit value
    is the operator's, and an unknown card has nothing to scale by)."""
    if "gpu_memory_utilization" in settings.model_fields_set:
        return None
    card = card_bytes()
    if card is None:
        return None
    return (
        math.floor((settings.gpu_memory_utilization - GRAPHS_RESERVE_GIB * 2**30 / card) * 1e4)
        / 1e4
    )


def graphs_for_the_share(
    settings: VllmSettings, environ: Mapping[str, str] | None = None
) -> tuple[VllmSettings, str | None]:
    """The settings an engine runs with under an MPS share, and why they changed (None:
    unchanged). Unset `cudagraph_mode` becomes "NONE" there: the reads that came back NaN
    on a compute-limited card did so only from CUDA graphs (GRAPHS_UNDER_MPS), and without
    them the same reads ran as fast (49.0 reads/s against 50.0 at batch 32, the GPU being
    the bound). An operator's explicit mode is kept, with a warning."""
    share = mps_share(environ)
    if share is None or settings.enforce_eager or settings.cudagraph_mode == "NONE":
        return settings, None
    if settings.cudagraph_mode is not None:
        log.warning(
            "engine.vllm: cudagraph_mode %r under an MPS share of %g%% of the SMs: %s",
            settings.cudagraph_mode,
            share,
            GRAPHS_UNDER_MPS,
        )
        return settings, None
    why = f"cudagraph_mode 'NONE' under an MPS share of {share:g}% of the SMs: {GRAPHS_UNDER_MPS}"
    update: dict[str, Any] = {"cudagraph_mode": "NONE"}
    kept = graphs_memory_kept(settings)
    if kept is not None:
        update["gpu_memory_utilization"] = kept
        why += (
            f"; gpu_memory_utilization {settings.gpu_memory_utilization} -> {kept}, so the "
            f"{GRAPHS_RESERVE_GIB} GiB vLLM would have set aside for graphs stays free "
            "instead of going to the KV cache (vLLM's warmup needs it outside its budget)"
        )
    return settings.model_copy(update=update), why


# Diagnostics (never set in service): Inductor options for vLLM's compilation config, as
# `name=value[+name=value]` with JSON values, e.g. `split_reductions=false`.
DEBUG_INDUCTOR_ENV = "DGSTREAM_DEBUG_INDUCTOR"


def engine_args(settings: VllmSettings, read_path: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `vllm.engine.arg_utils.AsyncEngineArgs` (settings checked and
    resolved by `check_model` first) for an engine on `read_path` (default: the settings'
    own)."""
    from dgstream.workers.engine.vllm_reads.options import ReadPathOptions

    settings, why = graphs_for_the_share(check_model(settings))
    if why:
        log.warning("engine.vllm: %s", why)
    path = read_path or settings.read_path
    seqs = min(settings.reads_in_flight(path), MAX_NUM_SEQS if path == "stock" else 10**9)
    utilization = (
        stock_utilization(settings, seqs) if path == "stock" else settings.gpu_memory_utilization
    )
    check_full_graphs(settings, utilization)
    check_images(settings, utilization)
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
        "language_model_only": settings.language_model_only and not settings.reads_images,
        "skip_tokenizer_init": settings.skip_tokenizer_init,
        "load_format": settings.load_format,
        "additional_config": options.as_additional_config(),
    }
    if settings.reads_images:
        # Images only (DiffusionGemma has no audio tower; a video's 32 frames of 78 tokens
        # would make vLLM profile videos, the modality with the most tokens an item), at the
        # processor's smallest budget, which holds the engine's 64-token square
        # (`workers.engine.vllm.images`).
        args["limit_mm_per_prompt"] = {"image": settings.images_per_request, "video": 0}
        args["mm_processor_kwargs"] = {"max_soft_tokens": MAX_SOFT_TOKENS}
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
    for key in ("limit_mm_per_prompt", "mm_processor_kwargs"):
        if key in a:
            cmd += [f"--{key.replace('_', '-')}", json.dumps(a[key])]
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

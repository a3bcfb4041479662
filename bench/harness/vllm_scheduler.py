"""vLLM 0.33's diffusion scheduler on the CPU, as the engine core drives it: its real
scheduler class (the plugin's `DgOneStepScheduler` by default), requests, KV block pool and
prefix cache, with the runner's output made up (a canvas per read). The one-step tests use
it to check the scheduler's bookkeeping; `bench/engine_host.py` uses it to time the
scheduler's host work per read, the Python an engine core runs for every read it serves."""

from __future__ import annotations

import statistics
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dgstream.workers.engine.vllm.args import engine_args
from dgstream.workers.engine.vllm.codec import TWO_STEP_KEY
from dgstream.workers.engine.vllm.settings import READ_PATH_SEQS, VllmSettings

WIDTH = 16  # the served canvas (the card runs' 16 positions)
BLOCK = 16  # vLLM's default KV block size


def read_extra(**over: Any) -> dict[str, Any]:
    """A seeded single-step constrained read's `extra_args`, as the engine builds them;
    None in `over` drops a key."""
    extra: dict[str, Any] = {
        "diffusion_canvas_length": WIDTH,
        "diffusion_seed_canvas": list(range(1, WIDTH + 1)),
        "diffusion_max_steps": 1,
        "diffusion_read_only": True,
        "diffusion_constrained": True,
    }
    extra.update(over)
    return {k: v for k, v in extra.items() if v is not None}


def read_params(extra: dict[str, Any] | None = None, **kw: Any) -> Any:
    from vllm.sampling_params import SamplingParams

    base: dict[str, Any] = {"temperature": 1.0, "max_tokens": WIDTH, "ignore_eos": True}
    return SamplingParams(**{**base, **kw}, extra_args=read_extra() if extra is None else extra)


def two_step_params() -> Any:
    """A read that opts out of one step (vLLM's prompt step, then its canvas step)."""
    return read_params(read_extra(**{TWO_STEP_KEY: True}))


def vllm_config(
    model_dir: Path,
    *,
    budget: int = 256,
    seqs: int = 8,
    blocks: int = 64,
    one_step: bool | str = True,
) -> Any:
    """The engine's own settings (`one_step`: its one_step_reads, on by default) turned
    into vLLM's config, on the CPU: a token budget per step, reads in flight, KV blocks of
    BLOCK tokens, and the read path's options as the engine hands them over."""
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    settings = VllmSettings(
        model=str(model_dir),
        skip_tokenizer_init=True,
        canvas_length=WIDTH,
        one_step_reads=one_step,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=512,
    )
    kwargs = engine_args(settings)
    args = AsyncEngineArgs(**kwargs)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = blocks
    scheduler = SchedulerConfig(
        runner_type="generate",
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=512,
        async_scheduling=True,
        is_encoder_decoder=False,
    )
    return VllmConfig(
        model_config=args.create_model_config(),
        cache_config=cache,
        scheduler_config=scheduler,
        diffusion_config=args.create_diffusion_config(),
        device_config=DeviceConfig(device="cpu"),
        additional_config=kwargs["additional_config"],
    )


def scheduler(
    model_dir: Path,
    *,
    budget: int = 256,
    seqs: int = 8,
    blocks: int = 64,
    stock: bool = False,
    sha256: bool = False,
    one_step: bool | str = True,
) -> Any:
    """SimpleNamespace(sched, hasher): the plugin's scheduler (`stock`: vLLM's own
    `DiffusionAsyncScheduler`) over a KV pool of `blocks` blocks. The block hasher is a
    cheap `repr` for the tests, or vLLM's default (`sha256`: pickle, then SHA-256) to time
    what an engine core pays."""
    import torch
    from vllm.utils.hashing import sha256 as sha256_hash
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.diffusion_scheduler import DiffusionAsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from dgstream.workers.engine.vllm_reads.scheduler import DgOneStepScheduler

    config = vllm_config(model_dir, budget=budget, seqs=seqs, blocks=blocks, one_step=one_step)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    cls = DiffusionAsyncScheduler if stock else DgOneStepScheduler
    sched = cls(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )
    # vLLM's DiffusionGemma config hook lowers max_num_seqs >= 128 to 8 and the plugin's
    # hook gives the user's value back; this config is built past both, so the scheduler
    # takes `seqs` here (for the stock class too: the same reads in flight, to compare
    # the classes' work per read).
    sched.max_num_running_reqs = sched.max_num_active_reqs = seqs
    if sha256:
        init_none_hash(sha256_hash)
        hasher = get_request_block_hasher(BLOCK, sha256_hash)
    else:
        init_none_hash(lambda b: b)
        hasher = get_request_block_hasher(BLOCK, lambda b: repr(b).encode())
    return SimpleNamespace(sched=sched, hasher=hasher)


def request(s: Any, rid: str, prompt: list[int], params: Any | None = None) -> Any:
    from vllm.v1.request import Request

    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=params or read_params(),
        pooling_params=None,
        arrival_time=0.0,
        block_hasher=s.hasher,
    )


def finish(sched: Any, out: Any, canvases: dict[str, list[int]]) -> dict[str, Any]:
    """The runner's output for a step (each read's canvas), through update_from_output:
    {request id: its EngineCoreOutput}."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    result = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[canvases.get(r, []) for r in ids],
    )
    done = sched.update_from_output(out, result)
    return {o.request_id: o for outs in done.values() for o in outs.outputs}


def drain(sched: Any) -> tuple[int, float, float]:
    """Serve every request the scheduler holds as the engine core does under async
    scheduling (the next step scheduled while the last runs, two in flight), the runner's
    output made up (a canvas for each read whose canvas ran): (steps, seconds in
    `schedule()`, seconds in `update_from_output()`). Raises if requests are left."""
    in_flight: deque[Any] = deque()
    steps = 0
    t_sched = t_update = 0.0
    while True:
        if len(in_flight) < 2 and sched.has_requests():
            t0 = time.perf_counter()
            out = sched.schedule()
            t_sched += time.perf_counter() - t0
            if out.total_num_scheduled_tokens:
                in_flight.append(out)
                steps += 1
                continue
        if not in_flight:
            if sched.has_requests():
                raise RuntimeError("reads left unscheduled")
            return steps, t_sched, t_update
        out = in_flight.popleft()
        made = {rid: [7] * WIDTH for rid in out.scheduled_spec_decode_tokens}
        t0 = time.perf_counter()
        finish(sched, out, made)
        t_update += time.perf_counter() - t0


# --- the scheduler's host work per read ---------------------------------------------------

PROMPT = 256  # the card runs' prompts (tokens)
# The product's token budget per step (its default max_num_batched_tokens).
BUDGET: int = VllmSettings.model_fields["max_num_batched_tokens"].default


def host_cost(
    model_dir: Path,
    *,
    batch: int,
    kind: str,
    mode: str,
    rounds: int,
    warm: int = 2,
) -> dict[str, float]:
    """The scheduler's host time per read over `rounds` batches of `batch` reads of
    `PROMPT`-token prompts (`kind` "shared": one prompt, as one question set over one
    state; "unique": each its own), driven as async scheduling drives it (two steps in
    flight). `mode`: "one_step" (the plugin's scheduler, reads fused), "two_step" (the
    plugin's scheduler, each read opting out) or "stock" (vLLM's own scheduler, no
    plugin). Returns µs per read: `admit` (the request, its prompt's block hashes, and
    add_request), `schedule`, `update` (update_from_output) and `total` (medians over the
    rounds after `warm`), and `steps` (engine steps per batch)."""
    import random

    # Room for every read's prompt and canvas, so nothing is preempted: the KV cache of
    # the card at 256 reads in flight holds them (about 5,000 blocks of 16 on the
    # emulated 24 GB card, docs/benchmarks.md).
    per_read = -(-(PROMPT + WIDTH) // BLOCK)
    s = scheduler(
        model_dir,
        budget=BUDGET,
        seqs=batch,
        blocks=per_read * batch + 64,
        stock=mode == "stock",
        sha256=True,
    )
    sched = s.sched
    params = two_step_params() if mode == "two_step" else read_params()
    rng = random.Random(0)
    shared = list(range(1, PROMPT + 1))
    admit_us: list[float] = []
    sched_us: list[float] = []
    update_us: list[float] = []
    steps: list[int] = []
    for r in range(warm + rounds):
        prompts = [
            shared if kind == "shared" else rng.choices(range(1, 900), k=PROMPT)
            for _ in range(batch)
        ]
        # Admission as the engine core does it: the request (its prompt's block hashes
        # with it), then into the scheduler's queue.
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            sched.add_request(request(s, f"{r}-{i}", prompt, params))
        t_admit = time.perf_counter() - t0
        n, t_sched, t_update = drain(sched)
        if r >= warm:
            admit_us.append(t_admit / batch * 1e6)
            sched_us.append(t_sched / batch * 1e6)
            update_us.append(t_update / batch * 1e6)
            steps.append(n)
    totals = [sum(t) for t in zip(admit_us, sched_us, update_us, strict=True)]
    return {
        "admit": statistics.median(admit_us),
        "schedule": statistics.median(sched_us),
        "update": statistics.median(update_us),
        "total": statistics.median(totals),
        "steps": statistics.median(steps),
    }


def burst(
    model_dir: Path, *, one_step: bool | str, batches: int, batch: int = 256, prefix: int = 224
) -> dict[str, int]:
    """`batches` batches of `batch` reads of the card runs' one-question-set shape
    (`PROMPT`-token prompts over a `prefix`-token shared prefix), all at the scheduler at
    once, served at the product's budget and reads in flight, as async scheduling drives
    it (two steps in flight): {"steps", "fused"} (reads that took one step). `one_step`:
    the engine's one_step_reads (false: every read opting out)."""
    import random

    seqs = READ_PATH_SEQS
    s = scheduler(
        model_dir,
        budget=BUDGET,
        seqs=seqs,
        blocks=-(-(PROMPT + WIDTH) // BLOCK) * seqs * 2 + 64,
        one_step=one_step if one_step is not False else True,
    )
    sched = s.sched
    params = read_params() if one_step is not False else two_step_params()
    rng = random.Random(0)
    shared = list(range(1, prefix + 1))
    for i in range(batches * batch):
        tail = rng.choices(range(300, 900), k=PROMPT - prefix)
        sched.add_request(request(s, f"r{i}", shared + tail, params))
    steps = drain(sched)[0]
    return {"steps": steps, "fused": sched.fused_reads}


__all__ = [
    "BLOCK",
    "BUDGET",
    "PROMPT",
    "WIDTH",
    "burst",
    "drain",
    "finish",
    "host_cost",
    "read_extra",
    "read_params",
    "request",
    "scheduler",
    "two_step_params",
    "vllm_config",
]

"""One-step reads on the CPU: vLLM 0.33's real diffusion scheduler under the plugin's
subclass, its requests and its KV block pool; the settings and config checks; the
attention ranges. The forward pass itself (one step against two, the same answers) is the
gpu tier's (`test_vllm_gpu.py::test_one_step_reads_answer_as_two_steps`)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from bench.harness.vllm_model import write_model_dir
from bench.harness.vllm_scheduler import (
    BLOCK,
    WIDTH,
    burst,
    finish,
    read_extra,
    read_params,
    request,
    scheduler,
    vllm_config,
)
from dgstream.workers.engine.vllm.codec import TWO_STEP_KEY, build_sampling_params
from dgstream.workers.engine.vllm.settings import VllmSettings
from dgstream.workers.engine.vllm_reads.plan import fused_indices, fused_ranges

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")


# --- which requests take one step ------------------------------------------------------


def test_a_read_built_by_the_engine_takes_one_step_unless_its_sibling_opts_out() -> None:
    from dgstream.workers.engine.types import Read, Slot
    from dgstream.workers.engine.vllm_reads.scheduler import one_step_width

    read = Read((5, 6, 7), tuple(range(WIDTH)), (Slot("q", 1, (3, 4), ("yes", "no")),))
    settings = VllmSettings(one_step_reads=True)
    assert one_step_width(build_sampling_params(read, settings)) == WIDTH
    two = build_sampling_params(read, settings, two_step=True)
    assert two.extra_args[TWO_STEP_KEY] is True
    assert one_step_width(two) is None


@pytest.mark.parametrize(
    ("extra", "kw", "why"),
    [
        (read_extra(diffusion_read_only=None), {}, "not read-only: it may commit"),
        (read_extra(diffusion_max_steps=2), {}, "more than one step"),
        (read_extra(diffusion_max_steps=None), {}, "vLLM's own step count"),
        (read_extra(diffusion_seed_canvas=None), {}, "no seed: vLLM draws the canvas later"),
        (read_extra(diffusion_pinned=[0]), {}, "pinned positions"),
        (read_extra(diffusion_canvas_length=None), {}, "the served canvas, not its own"),
        (read_extra(**{TWO_STEP_KEY: True}), {}, "opted out"),
        (read_extra(), {"top_k": 5}, "top-k filters the logits"),
        (read_extra(), {"top_p": 0.9}, "top-p filters the logits"),
        (read_extra(), {"logprobs": 2}, "top-k logprobs"),
    ],
)
def test_requests_that_are_not_seeded_single_step_reads_take_two_steps(
    extra: dict[str, Any], kw: dict[str, Any], why: str
) -> None:
    from dgstream.workers.engine.vllm_reads.scheduler import one_step_width

    assert one_step_width(read_params()) == WIDTH
    assert one_step_width(read_params(extra, **kw)) is None, why


# --- the scheduler ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("diffusiongemma"), 1000)


def test_a_read_runs_prompt_and_canvas_in_one_step_and_ends_there(model_dir: Path) -> None:
    """vLLM's scheduler with the plugin's subclass: a seeded single-step read is scheduled
    once, for its prompt and its canvas (KV slots for both, the canvas as drafts), and
    ends when that step's output arrives; a read that opts out takes vLLM's two steps.
    Every block goes back to the pool."""
    s = scheduler(model_dir)
    sched = s.sched
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    one = request(s, "one", list(range(100, 120)))
    two = request(s, "two", list(range(200, 220)), read_params(read_extra(**{TWO_STEP_KEY: True})))
    sched.add_request(one)
    sched.add_request(two)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"one": 20 + WIDTH, "two": 20}
    assert first.total_num_scheduled_tokens == 40 + WIDTH
    assert first.scheduled_spec_decode_tokens == {"one": [-1] * WIDTH}
    blocks = {d.req_id: d.block_ids[0] for d in first.scheduled_new_reqs}
    assert len(blocks["one"]) == -(-(20 + WIDTH) // BLOCK)  # prompt and canvas
    assert len(blocks["two"]) == -(-20 // BLOCK)
    assert sched.fused_reads == 1
    # Async scheduling: the next step is scheduled while the first runs. The one-step read
    # has its canvas in flight and is not scheduled again; the other gets its canvas.
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"two": WIDTH}
    canvas = list(range(500, 500 + WIDTH))
    outputs = finish(sched, first, {"one": canvas})
    assert outputs["one"].new_token_ids == canvas
    assert outputs["one"].finish_reason is not None
    assert "two" not in outputs or not outputs["two"].new_token_ids
    outputs = finish(sched, second, {"two": canvas})
    assert outputs["two"].new_token_ids == canvas
    assert not sched.requests
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_a_cached_prompt_prefix_is_not_read_again(model_dir: Path) -> None:
    """A second read of the same 40-token prompt hits the prefix cache: its step holds
    the uncached tail and the canvas, and the hit's blocks are shared."""
    s = scheduler(model_dir)
    sched = s.sched
    prompt = list(range(300, 340))
    sched.add_request(request(s, "a", prompt))
    first = sched.schedule()
    finish(sched, first, {"a": list(range(WIDTH))})
    sched.add_request(request(s, "b", prompt))
    out = sched.schedule()
    cached = 32  # two full blocks of the prompt (vLLM recomputes at least the last token)
    assert out.num_scheduled_tokens == {"b": 40 - cached + WIDTH}
    assert out.scheduled_new_reqs[0].num_computed_tokens == cached
    assert len(out.scheduled_new_reqs[0].block_ids[0]) == -(-(40 + WIDTH) // BLOCK)


def test_reads_that_do_not_fit_the_step_take_two_steps(model_dir: Path) -> None:
    """A budget of 64 tokens: the first read's prompt (40) and canvas (16) fit; the second
    read's prompt takes the rest of the budget, so its canvas waits for the next step."""
    s = scheduler(model_dir, budget=64)
    sched = s.sched
    sched.add_request(request(s, "a", list(range(100, 140))))
    sched.add_request(request(s, "b", list(range(200, 208))))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 40 + WIDTH, "b": 8}
    assert out.scheduled_spec_decode_tokens == {"a": [-1] * WIDTH}
    assert sched.fused_reads == 1


@pytest.mark.parametrize("one_step", [True, "auto"])
def test_auto_reads_in_two_steps_while_requests_wait_and_in_one_when_none_do(
    model_dir: Path, one_step: bool | str
) -> None:
    """Two seats, three reads: the third waits for a seat. true fuses the two seated reads
    anyway; auto leaves them to vLLM's two steps (a backlog reads faster that way), then
    fuses the third, which leaves nothing waiting. Every read ends once."""
    s = scheduler(model_dir, seqs=2, one_step=one_step)
    sched = s.sched
    assert sched.idle_only is (one_step == "auto")
    for rid, base in (("a", 100), ("b", 200), ("c", 300)):
        sched.add_request(request(s, rid, list(range(base, base + 20))))
    first = sched.schedule()
    assert sched.waiting_requests() == 1
    canvas = list(range(500, 500 + WIDTH))
    if one_step is True:
        assert first.num_scheduled_tokens == {"a": 20 + WIDTH, "b": 20 + WIDTH}
        assert (sched.fused_reads, sched.backlogged_steps) == (2, 0)
        ended = finish(sched, first, {"a": canvas, "b": canvas})
    else:
        assert first.num_scheduled_tokens == {"a": 20, "b": 20}
        assert not first.scheduled_spec_decode_tokens
        assert (sched.fused_reads, sched.backlogged_steps) == (0, 1)
        second = sched.schedule()  # async: the canvases while the prompts run
        assert second.num_scheduled_tokens == {"a": WIDTH, "b": WIDTH}
        finish(sched, first, {})
        ended = finish(sched, second, {"a": canvas, "b": canvas})
    assert {r for r, o in ended.items() if o.finish_reason is not None} == {"a", "b"}
    last = sched.schedule()
    assert last.num_scheduled_tokens == {"c": 20 + WIDTH}
    assert sched.waiting_requests() == 0
    assert sched.fused_reads == (3 if one_step is True else 1)
    assert finish(sched, last, {"c": canvas})["c"].new_token_ids == canvas
    assert not sched.requests


def test_at_the_cards_shapes_auto_fuses_a_bursts_tail_and_little_under_two_batches(
    model_dir: Path,
) -> None:
    """The card runs' one-question-set batches of 256 at the product's budget: auto fuses
    what true fuses of a lone batch (its tail, once nothing waits) and an eighth of it
    with two batches in flight, where true keeps fusing; every mode takes the same steps."""
    seen = {
        (mode, n): burst(model_dir, one_step=mode, batches=n)
        for mode in (False, True, "auto")
        for n in (1, 2)
    }
    for n in (1, 2):
        assert len({seen[m, n]["steps"] for m in (False, True, "auto")}) == 1
        assert seen[False, n]["fused"] == 0
    assert seen["auto", 1]["fused"] == seen[True, 1]["fused"] > 0
    assert 0 < seen["auto", 2]["fused"] * 8 <= seen[True, 2]["fused"]


def test_a_prompt_longer_than_the_budget_takes_two_steps(model_dir: Path) -> None:
    s = scheduler(model_dir, budget=64)
    sched = s.sched
    sched.add_request(request(s, "long", list(range(1, 101))))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"long": 64}  # a chunk of the prompt
    assert not out.scheduled_spec_decode_tokens
    assert sched.fused_reads == 0


# --- settings and vLLM's config --------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"read_path": "stock", "max_num_seqs": 64}, "read_path 'stock'"),
        ({"async_scheduling": False}, "async_scheduling False"),
        ({"async_scheduling": None}, "async_scheduling None"),
        ({"attention_backend": "FLASH_ATTN"}, "attention_backend 'FLASH_ATTN'"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size 2"),
    ],
)
def test_one_step_reads_refuse_settings_they_cannot_run_with(
    over: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match="one_step_reads") as err:
        VllmSettings(one_step_reads=True, **over)
    assert named in str(err.value)
    VllmSettings(one_step_reads=False, **over)  # each is fine without one-step reads
    # "auto" takes these settings, and reads in two steps under them, saying why.
    auto = VllmSettings(one_step_reads="auto", **over)
    on, why = auto.one_step_resolved()
    assert on is False
    assert named in why


@pytest.mark.parametrize(
    ("one_step_reads", "read_path", "on", "idle_only"),
    [
        ("auto", None, True, True),
        (True, None, True, False),
        (False, None, False, False),
        ("auto", "stock", False, False),  # the engine fell back to vLLM's own path (no plugin)
        (True, "stock", False, False),
    ],
)
def test_what_the_engine_hands_vllm_follows_the_resolved_setting(
    one_step_reads: bool | str, read_path: str | None, on: bool, idle_only: bool
) -> None:
    from dgstream.workers.engine.vllm.args import engine_args
    from dgstream.workers.engine.vllm_reads.options import ReadPathOptions

    settings = VllmSettings(one_step_reads=one_step_reads, max_num_seqs=64)
    assert settings.one_step_resolved(read_path)[0] is on
    args = engine_args(settings, read_path)
    options = ReadPathOptions.from_additional_config(args["additional_config"])
    assert options.one_step is on
    assert options.one_step_idle_only is idle_only


def test_auto_is_the_default() -> None:
    assert VllmSettings().one_step_reads == "auto"
    assert VllmSettings().one_step_resolved() == (
        True,
        "one_step_reads auto: two steps while requests wait",
    )


@pytest.mark.parametrize("value", ["automatic", "yes please", 2, None])
def test_one_step_reads_takes_only_true_false_or_auto(value: Any) -> None:
    with pytest.raises(ValueError, match="one_step_reads"):
        VllmSettings(one_step_reads=value)


def test_the_config_hook_installs_the_scheduler_only_where_it_can_run(model_dir: Path) -> None:
    from vllm.config.compilation import CUDAGraphMode

    from dgstream.workers.engine.vllm_reads import one_step_refusal
    from dgstream.workers.engine.vllm_reads.scheduler import SCHEDULER_CLASS

    def config(**sched: Any) -> Any:
        c = vllm_config(model_dir)
        c.scheduler_config.scheduler_cls = None  # as at the hook: before vLLM picks one
        c.attention_config.backend = type("B", (), {"name": "TRITON_ATTN"})()
        for k, v in sched.items():
            setattr(c.scheduler_config, k, v)
        return c

    assert one_step_refusal(config()) is None
    assert "async" in str(one_step_refusal(config(async_scheduling=None)))
    assert "scheduler class" in str(one_step_refusal(config(scheduler_cls="x.Y")))
    full = config()
    full.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    assert one_step_refusal(full) is None  # FULL graphs read the ranges from one buffer
    dbo = config()
    dbo.parallel_config.enable_dbo = True
    assert "micro-batching" in str(one_step_refusal(dbo))
    other = config()
    other.attention_config.backend = type("B", (), {"name": "FLASH_ATTN"})()
    assert "FLASH_ATTN" in str(one_step_refusal(other))
    assert SCHEDULER_CLASS.rsplit(".", 1)[1] == "DgOneStepScheduler"


# --- the attention ranges --------------------------------------------------------------


def test_the_canvas_range_of_each_one_step_read() -> None:
    # Request 0: a canvas step; 1: a one-step read (prompt 20, canvas 12); 2: a prompt
    # chunk; 3: a one-step read (prompt 7, canvas 16).
    prefilling = np.array([False, True, True, True])
    cu = np.array([0, 16, 28, 28, 44])
    fused = fused_indices(prefilling, cu)
    assert fused.tolist() == [1, 3]
    ranges = fused_ranges(fused, cu, np.array([30, 20, 500, 7]), 4)
    assert ranges.dtype == np.int32 and ranges.shape == (4, 1, 2)
    assert ranges[:, 0].tolist() == [[0, 0], [20, 31], [0, 0], [7, 22]]
    assert not fused_ranges(fused[:0], cu, np.array([30, 20, 500, 7]), 4).any()


class _Metadata:
    """What the model state touches of vLLM's TritonAttentionMetadata."""

    mm_prefix_range_tensor: Any = None


def _attn_state(monkeypatch: pytest.MonkeyPatch, metadata: dict[str, Any]) -> Any:
    from vllm.model_executor.models import diffusion_gemma as dg

    from dgstream.workers.engine.vllm_reads.model import DgModelState

    # vLLM's own prepare_attn needs the runner's attention groups and KV cache: it stands
    # for them here, returning per-layer metadata (two layers share one object, as in vLLM).
    monkeypatch.setattr(dg.DiffusionGemmaModelState, "prepare_attn", lambda *a, **k: metadata)
    state = object.__new__(DgModelState)
    state.one_step = True
    state._graph_ranges = None  # what __init__ sets, which needs a vLLM config
    state._said_fused_full = False
    return state


def _attn_batch(prefilling: list[bool], rows: list[int], prompts: list[int]) -> Any:
    import torch

    n = len(rows)
    return SimpleNamespace(
        num_reqs=n,
        num_draft_tokens=sum(rows),
        is_prefilling_np=np.array(prefilling),
        cu_num_logits_np=np.concatenate(([0], np.cumsum(rows))).astype(np.int32),
        prefill_len_np=np.array(prompts, dtype=np.int32),
        query_start_loc=torch.zeros(n + 1, dtype=torch.int32),
    )


def test_every_piecewise_step_gets_the_ranges_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.config.compilation import CUDAGraphMode

    shared = _Metadata()
    state = _attn_state(monkeypatch, {"l0": shared, "l1": shared, "l2": _Metadata()})
    fused = _attn_batch([False, True], [WIDTH, WIDTH], [40, 30])
    out = state.prepare_attn(fused, CUDAGraphMode.PIECEWISE, None, None, None, None)
    for md in out.values():
        assert md.mm_prefix_range_tensor.tolist() == [[[0, 0]], [[30, 30 + WIDTH - 1]]]
    first = out["l0"].mm_prefix_range_tensor
    # No read fused: the ranges all zero (the kernel's variant with ranges, compiled at
    # vLLM's warmup, and inert).
    plain = _attn_batch([False, True], [WIDTH, 0], [40, 30])
    out = state.prepare_attn(plain, CUDAGraphMode.NONE, None, None, None, None)
    assert not out["l2"].mm_prefix_range_tensor.any()
    # A step's tensor is its own: the step before keeps its ranges (async scheduling
    # prepares a step while the one before it runs).
    assert first.tolist() == [[[0, 0]], [[30, 30 + WIDTH - 1]]]


def test_full_graphs_read_the_ranges_from_one_buffer_written_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A FULL graph holds the address its kernel was captured with: the capture and every
    replay get the same buffer, one row per seat (vLLM pads a FULL step's requests), the
    capture's all zeros, each replay's this step's ranges and zeros past them."""
    import torch
    from vllm.config.compilation import CUDAGraphMode

    seats = 6
    state = _attn_state(monkeypatch, {"l0": _Metadata(), "l1": _Metadata()})
    state.max_num_reqs = seats
    fused = _attn_batch([False, True, True], [WIDTH, WIDTH, WIDTH], [40, 30, 9])
    # vLLM prepares a FULL capture with mode NONE and for_capture (its dummy batch).
    captured = state.prepare_attn(fused, CUDAGraphMode.NONE, None, None, None, None, True)
    buffer = captured["l0"].mm_prefix_range_tensor
    assert buffer.shape == (seats, 1, 2) and buffer.dtype == torch.int32
    assert captured["l1"].mm_prefix_range_tensor is buffer
    assert not buffer.any()
    address = buffer.data_ptr()
    out = state.prepare_attn(fused, CUDAGraphMode.FULL, None, None, None, None)
    assert out["l0"].mm_prefix_range_tensor.data_ptr() == address
    want = [[[0, 0]], [[30, 30 + WIDTH - 1]], [[9, 9 + WIDTH - 1]]] + [[[0, 0]]] * 3
    assert buffer.tolist() == want
    # A uniform canvas step after it: the same buffer, its old ranges gone.
    plain = _attn_batch([False], [WIDTH], [40])
    state.prepare_attn(plain, CUDAGraphMode.FULL, None, None, None, None)
    assert buffer.data_ptr() == address and not buffer.any()
    # A piecewise step in between leaves the graphs' buffer alone.
    out = state.prepare_attn(fused, CUDAGraphMode.PIECEWISE, None, None, None, None)
    assert out["l0"].mm_prefix_range_tensor.data_ptr() != address
    assert not buffer.any()


def test_one_step_reads_refuse_an_attention_backend_without_ranges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.config.compilation import CUDAGraphMode

    state = _attn_state(monkeypatch, {"l0": object()})
    with pytest.raises(RuntimeError, match="TRITON_ATTN"):
        state.prepare_attn(
            _attn_batch([True], [WIDTH], [9]), CUDAGraphMode.NONE, None, None, None, None
        )


def test_the_engine_says_at_start_how_many_steps_its_reads_take(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dgstream.workers.engine.vllm.engine import VllmEngine

    def said(**over: Any) -> list[str]:
        caplog.clear()
        with caplog.at_level("INFO", logger="dgstream.workers.engine.vllm.engine"):
            VllmEngine(VllmSettings(model=str(model_dir), **over))._engine_kwargs()
        return [r.getMessage() for r in caplog.records if "reads in" in r.getMessage()]

    auto = ["vLLM reads in one step (one_step_reads auto: two steps while requests wait)"]
    assert said(one_step_reads="auto") == auto
    assert said() == auto
    assert said(one_step_reads=True) == ["vLLM reads in one step (one_step_reads True)"]
    assert said(one_step_reads="auto", async_scheduling=False) == [
        "vLLM reads in two steps (one_step_reads auto, but async_scheduling False (needs true))"
    ]
    assert said(one_step_reads=False) == ["vLLM reads in two steps (one_step_reads is false)"]


def _drive(
    model_dir: Path, rng: random.Random, reads: int, one_step: bool | str = True
) -> tuple[int, int, int]:
    """vLLM's engine core over the scheduler, as async scheduling runs it (two steps in
    flight: the next is scheduled before the last's output is back), under a stream of
    reads that arrive a few at a time: prompts of 5 to 300 tokens (longer than the step's
    budget too), half of them over one shared prefix, a third opting out of one step, in
    a KV pool of 1,024 tokens that a few long prompts fill. Checks that every read ends
    exactly once with the canvas its step produced, that each step's positions have KV
    slots, and that every block goes back; returns (reads fused, requests preempted,
    steps left to two steps for a backlog)."""
    import collections

    s = scheduler(model_dir, one_step=one_step)
    sched = s.sched
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    arriving = []
    for i in range(reads):
        size = rng.choice([5, 20, 40, 100, 200, 300])
        shared = rng.random() < 0.5
        prompt = list(range(1, size + 1)) if shared else rng.choices(range(1, 900), k=size)
        opted = rng.random() < 0.3
        params = read_params(read_extra(**{TWO_STEP_KEY: True})) if opted else None
        arriving.append(request(s, f"r{i}", prompt, params))
    ended: collections.Counter[str] = collections.Counter()
    in_flight: collections.deque[Any] = collections.deque()
    preempted = 0
    for _ in range(20 * reads):
        for _ in range(rng.randrange(6)):
            if arriving:
                sched.add_request(arriving.pop(0))
        if len(in_flight) < 2 and sched.has_requests():
            out = sched.schedule()
            preempted += len(out.preempted_req_ids or ())
            # Every position the step computes has its KV slot (the prompt's and, fused,
            # the canvas's): vLLM has advanced num_computed_tokens past the step.
            for rid in out.num_scheduled_tokens:
                blocks = sched.kv_cache_manager.get_block_ids(rid)[0]
                assert len(blocks) * BLOCK >= sched.requests[rid].num_computed_tokens, rid
            if out.total_num_scheduled_tokens:
                in_flight.append(out)
                continue
        if not in_flight:
            if not arriving and not sched.has_requests():
                break
            continue
        out = in_flight.popleft()
        # The runner's output: a canvas for each request whose canvas ran in the step.
        made = {
            r: [hash((r, k)) % 900 for k in range(WIDTH)] for r in out.scheduled_spec_decode_tokens
        }
        for rid, o in finish(sched, out, made).items():
            if o.new_token_ids:
                assert o.finish_reason is not None, rid
                assert list(o.new_token_ids) == made[rid]
                ended[rid] += 1
    assert not arriving and not sched.has_requests() and not in_flight
    assert sorted(ended) == sorted(f"r{i}" for i in range(reads))
    assert set(ended.values()) == {1}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free
    return sched.fused_reads, preempted, sched.backlogged_steps


@pytest.mark.parametrize("one_step", [True, "auto"])
def test_every_read_ends_once_under_kv_pressure_with_two_steps_in_flight(
    model_dir: Path, one_step: bool | str
) -> None:
    """A table of random streams (seeded): one-step and two-step reads side by side, with
    preemption, prefix hits and chunked prompts, end exactly once each and return every
    block, with every read fused that can be (true) or only in steps that leave nothing
    waiting (auto). The streams must exercise what they guard: some reads fused, some
    preempted, and under auto some steps backlogged."""
    fused = preempted = backlogged = 0
    for seed in range(12):
        f, p, b = _drive(model_dir, random.Random(seed), 60, one_step)
        fused, preempted, backlogged = fused + f, preempted + p, backlogged + b
    assert fused > (100 if one_step is True else 20)
    assert preempted > 0
    assert (backlogged > 0) is (one_step == "auto")


@pytest.mark.parametrize(("reqs", "tokens"), [(1, 1), (1, 272), (16, 272), (37, 4096)])
def test_vllms_warmup_batches_get_the_ranges(
    monkeypatch: pytest.MonkeyPatch, reqs: int, tokens: int
) -> None:
    """vLLM's own dummy batches (its memory profile, kernel warmup and piecewise graph
    captures) go through `prepare_attn` too: each gets the zero ranges, one per request,
    so the attention kernel's variant with ranges is compiled before serving."""
    import torch
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    state = _attn_state(monkeypatch, {"l0": _Metadata()})
    buffers = InputBuffers(max_num_reqs=64, max_num_tokens=4096, device=torch.device("cpu"))
    dummy = InputBatch.make_dummy(reqs, tokens, buffers)
    out = state.prepare_attn(dummy, CUDAGraphMode.NONE, None, None, None, None)
    ranges = out["l0"].mm_prefix_range_tensor
    assert ranges.shape == (reqs, 1, 2) and ranges.dtype == torch.int32
    assert not ranges.any()

"""The read path's vLLM plugin, on the CPU: its arithmetic against float64 oracles, its
admission against vLLM 0.33's own per-request writes, its batched self-conditioning against
vLLM's own per-request loop, its registration and its settings.

What needs a GPU (a whole engine, the step against vLLM's own sampler, CUDA graphs) is the
gpu tier's (`test_vllm_gpu.py`): every answer of the demo model the same as stock vLLM's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgstream.workers.engine.vllm_reads.options import (
    CONFIG_KEY,
    ReadPathOptions,
    stock_denoise_bytes,
    vocab_tile_rows,
    warmup_denoise_rows,
)
from dgstream.workers.engine.vllm_reads.plan import plan_step, spans
from dgstream.workers.engine.vllm_reads.rows import label_rows, scatter_groups, vocab_rows

# --- options: the additional_config entry and the memory arithmetic ---------------------


@pytest.mark.unit
def test_options_are_off_without_an_entry_and_refuse_a_malformed_one() -> None:
    assert ReadPathOptions.from_additional_config(None).enabled is False
    assert ReadPathOptions.from_additional_config({"other": 1}).enabled is False
    on = ReadPathOptions(enabled=True, max_num_seqs=256)
    assert ReadPathOptions.from_additional_config(on.as_additional_config()) == on
    for bad in ([1], {"enabled": "maybe"}, {"logits_tile_mib": 1}, {"typo": True}):
        with pytest.raises(ValueError, match=CONFIG_KEY):
            ReadPathOptions.from_additional_config({CONFIG_KEY: bad})


@pytest.mark.unit
def test_the_stock_warmup_step_is_the_one_that_failed_on_the_emulated_card() -> None:
    """127 reads x a 16-position canvas, as vLLM's warmup schedules them under a 4096-token
    budget; its fp32 softcapped copy alone is the 1.98 GiB the emulated card refused."""
    rows = warmup_denoise_rows(127, 4096, 16)
    assert rows == 127 * 16
    assert round(rows * 262_144 * 4 / 2**30, 2) == 1.98
    # The budget caps the requests: 4096 // 65 = 63 reads of a 64-position canvas.
    assert warmup_denoise_rows(127, 4096, 64) == 63 * 64
    assert stock_denoise_bytes(127, 4096, 16, 262_144) == rows * 262_144 * 6


@pytest.mark.unit
@pytest.mark.parametrize(
    ("mib", "vocab", "rows"), [(256, 262_144, 93), (16, 262_144, 5), (16, 2**40, 1)]
)
def test_a_vocabulary_tile_holds_what_its_budget_allows(mib: int, vocab: int, rows: int) -> None:
    assert vocab_tile_rows(mib, vocab) == rows
    assert rows == 1 or rows * vocab * 11 <= mib * 2**20 < (rows + 1) * vocab * 11


# --- plan: a step's rows, worked out on the host ------------------------------------------


@pytest.mark.unit
def test_a_step_plan_groups_rows_by_how_they_read() -> None:
    # Requests 0 and 2 read (16 and 8 rows), 1 is still reading its prompt, 3 reads 16.
    slots = np.array([5, 0, 3, 7])
    counts = np.array([16, 0, 8, 16])
    labels = (10, 11)
    plan = plan_step(slots, counts, {5: labels, 7: labels}, {5: labels, 3: (4, 9), 7: labels})
    assert plan.decode.tolist() == [0, 2, 3] and plan.prefill.tolist() == [1]
    assert plan.total_rows == 40
    assert [g.key for g in plan.groups] == [(True, labels), (False, (4, 9))]
    assert plan.groups[0].rows is not None and plan.groups[1].rows is not None
    assert plan.groups[0].rows.tolist() == [*range(16), *range(24, 40)]
    assert plan.groups[1].rows.tolist() == list(range(16, 24))
    assert plan.row_request.tolist() == [0] * 16 + [2] * 8 + [3] * 16
    assert plan.row_position.tolist() == [*range(16), *range(8), *range(16)]
    assert plan.offsets == [0, 16, 16, 24]  # request 1 has no rows: never sliced
    assert plan.wants_logprobs


@pytest.mark.unit
def test_one_label_set_is_one_group_of_every_row() -> None:
    plan = plan_step(np.array([1, 2]), np.array([16, 16]), {1: (3,), 2: (3,)}, {})
    assert len(plan.groups) == 1 and plan.groups[0].rows is None
    prompts = plan_step(np.array([1, 2]), np.array([0, 0]), {}, {})
    assert prompts.total_rows == 0 and prompts.groups == () and not prompts.wants_logprobs


@pytest.mark.unit
def test_spans_are_one_slice_when_contiguous() -> None:
    assert spans(np.array([4, 20]), np.array([20, 36])) == (4, 36)
    rows = spans(np.array([0, 20]), np.array([4, 22]))
    assert isinstance(rows, np.ndarray) and rows.tolist() == [0, 1, 2, 3, 20, 21]
    assert spans(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == (0, 0)


# --- rows: what a row reports, against float64 ------------------------------------------


def _oracle(logits: np.ndarray, ids: list[int]) -> tuple[int, list[float]]:
    z = logits.astype(np.float64)
    lp = z - (z.max() + math.log(np.exp(z - z.max()).sum()))
    best = int(np.argmax(z))
    return best, [float(lp[best]), *(float(lp[i]) for i in ids)]


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(2, 40),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.1, 3.0, 30.0]),
)
def test_vocab_rows_report_the_full_vocabulary_log_softmax(
    rows: int, vocab: int, seed: int, scale: float
) -> None:
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(rows, vocab)) * scale).astype(np.float32)
    ids = sorted(set(rng.integers(0, vocab, size=min(vocab, 5)).tolist()))
    got = vocab_rows(torch.from_numpy(logits), torch.tensor(ids, dtype=torch.int64))
    for r in range(rows):
        best, want = _oracle(logits[r], ids)
        assert int(got.token_ids[r]) == best
        assert got.columns[r].tolist() == [best, *ids]
        np.testing.assert_allclose(got.logprobs[r].numpy(), want, rtol=1e-5, atol=1e-5)
        assert int(got.ranks[r]) == int((logits[r] >= logits[r].max()).sum())


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), k=st.integers(2, 12), seed=st.integers(0, 2**31 - 1))
def test_label_rows_renormalise_over_the_allowed_ids(rows: int, k: int, seed: int) -> None:
    """vLLM's constrained step: the columns are the allowed ids, the argmax one of them."""
    rng = np.random.default_rng(seed)
    allowed = sorted(rng.choice(10_000, size=k, replace=False).tolist())
    logits = (rng.normal(size=(rows, k)) * 4).astype(np.float32)
    got = label_rows(torch.from_numpy(logits), torch.tensor(allowed, dtype=torch.int64))
    for r in range(rows):
        best, want = _oracle(logits[r], list(range(k)))
        assert int(got.token_ids[r]) == allowed[best]
        assert got.columns[r].tolist() == [allowed[best], *allowed]
        np.testing.assert_allclose(got.logprobs[r].numpy(), want, rtol=1e-5, atol=1e-5)
        assert math.isclose(float(torch.logsumexp(got.logprobs[r, 1:], 0)), 0.0, abs_tol=1e-5)


@pytest.mark.unit
def test_groups_of_different_widths_go_back_in_row_order_padded_as_vllm_pads() -> None:
    a = label_rows(torch.tensor([[2.0, 0.0]]), torch.tensor([7, 8]))  # width 3
    b = vocab_rows(torch.tensor([[0.0, 1.0, 5.0], [3.0, 0.0, 0.0]]), torch.tensor([1]))  # 2
    out = scatter_groups(3, [(torch.tensor([1]), a), (torch.tensor([0, 2]), b)])
    assert out.token_ids.tolist() == [2, 7, 0]
    assert out.columns.tolist() == [[2, 1, 0], [7, 7, 8], [0, 1, 0]]
    assert out.logprobs[0, 2] == float("-inf") and out.logprobs[2, 2] == float("-inf")
    assert torch.equal(out.logprobs[1], a.logprobs[0])
    only = scatter_groups(1, [(None, a)])
    assert only is a


# --- against vLLM 0.33's own code (CPU) -----------------------------------------------------

vllm = pytest.importorskip("vllm")


@pytest.fixture
def cpu_vllm(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's DiffusionGemma module, with host copies unpinned (no CUDA driver here)."""
    from vllm.utils import torch_utils
    from vllm.v1.worker.gpu import buffer_utils

    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)
    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cpu", raising=False)
    # vLLM's sampler sizes its tiles from the accelerator's free memory: say 8 GiB.
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda *a: (2**33, 2**33))
    from vllm.model_executor.models import diffusion_gemma

    return diffusion_gemma


@pytest.fixture
def eager_vllm(cpu_vllm: Any) -> Iterator[Any]:
    """As `cpu_vllm`, with vLLM's compiled sampler steps run eagerly (no compiler run)."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        yield cpu_vllm


def _states(dg: Any) -> Any:
    return dg.DiffusionGemmaRequestStates(
        max_num_reqs=6,
        canvas_length=16,
        vocab_size=500,
        max_denoising_steps=48,
        device=torch.device("cpu"),
        hidden_size=8,
        stability_threshold=2,
    )


# (slot, prompt length, max steps, seed, pins, read only)
ARRIVALS = [
    (0, 40, 1, list(range(100, 116)), None, True),
    (3, 12, None, None, None, False),
    (5, 7, 4, list(range(200, 216)), [1, 2, 9], False),
    (2, 99, 1, list(range(300, 316)), None, True),
]


@pytest.mark.vllm
def test_staged_admission_leaves_the_state_vllm_leaves(cpu_vllm: Any) -> None:
    from dgstream.workers.engine.vllm_reads.admission import Admissions

    theirs, ours = _states(cpu_vllm), _states(cpu_vllm)
    for s in (theirs, ours):  # a slot that served before: its leftovers must be reset
        s.step[3] = 9
        s.accepted_canvas_history_len[3] = 2
        s.self_conditioning_embeds[3] = 1.5
        s.pin_mask[3, 4] = True
        s.read_only[3] = True
    staged = Admissions(ours)
    for slot, prompt, steps, seed, pins, ro in ARRIVALS:
        # vLLM: the model state's reset, then its sampler's extra_args, per request.
        theirs.add_request(slot)
        theirs.prompt_len[slot].fill_(prompt)
        if steps is not None:
            theirs.max_steps[slot].fill_(steps)
        if seed is not None:
            theirs.set_seed_canvas(slot, seed)
            if pins:
                theirs.set_pins(slot, pins)
        if ro:
            theirs.set_read_only(slot)
        staged.reset(slot, prompt)
        staged.read(slot, max_steps=steps, seed=seed, pins=pins, read_only=ro)
    staged.flush()
    for name in (
        "is_encoder_phase",
        "step",
        "accepted_canvas_history_len",
        "self_conditioning_embeds",
        "prompt_len",
        "max_steps",
        "has_seed",
        "read_only",
        "pin_mask",
    ):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    seeded = [a[0] for a in ARRIVALS if a[3] is not None]
    assert torch.equal(ours.seed_canvas[seeded], theirs.seed_canvas[seeded])
    assert ours.seeded_slots == theirs.seeded_slots == set(seeded)
    assert ours.read_only_slots == theirs.read_only_slots == {0, 2}
    staged.release(0)
    assert 0 not in ours.seeded_slots and 0 not in ours.read_only_slots


def _sc_state(dg: Any, seed: int) -> tuple[Any, Any]:
    """The read path's model state over vLLM's request states and a self-conditioning
    block of random weights (hidden 8, canvas 16): only what self-conditioning reads."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    from dgstream.workers.engine.vllm_reads.model import DgModelState

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        sc = dg.DiffusionGemmaSelfConditioning(8, 16)
    torch.manual_seed(seed)
    for p in sc.parameters():
        p.data.normal_()
    state = object.__new__(DgModelState)
    states = _states(dg)
    state.diffusion_states = states
    state.read_path = True
    vars(state)["model"] = type("M", (), {"self_conditioning": sc})()
    return state, states


@pytest.mark.vllm
def test_batched_self_conditioning_is_vllms_per_request_loop(cpu_vllm: Any) -> None:
    """One call over every denoising row against vLLM's call per request: the same rows,
    for fresh single-step reads (zero soft embeddings: the MLP's norm alone) and for reads
    with soft embeddings of an earlier step."""
    state, states = _sc_state(cpu_vllm, seed=0)
    qsl = np.array([0, 16, 40, 56, 64])  # request 1 reads its prompt (24 tokens)
    slots = np.array([4, 1, 2])
    idx = np.array([0, 2, 3])
    state._logit_rows = np.array([16, 0, 16, 8])
    soft = torch.randn(6, 16, 8)
    for fresh in (True, False):
        states.single_step_slots.clear()
        if fresh:
            states.single_step_slots.update(slots.tolist())
            soft_now = torch.zeros_like(soft)
        else:
            soft_now = soft
        embeds = torch.randn(64, 8)
        want = embeds.clone()
        with torch.no_grad():
            cpu_vllm.DiffusionGemmaModelState._apply_self_conditioning(
                state, slots, idx, qsl, want, soft_now
            )
            got = embeds.clone()
            state._apply_self_conditioning(slots, idx, qsl, got, soft_now)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(got[16:40], embeds[16:40])  # the prompt's rows untouched


@pytest.mark.vllm
def test_one_step_reads_self_condition_only_their_canvas(cpu_vllm: Any) -> None:
    """A one-step read's span holds its prompt, then its canvas: self-conditioning (the
    batched call) touches only the canvas rows, and gives them what vLLM's per-request
    call gives a canvas step of the same rows."""
    state, states = _sc_state(cpu_vllm, seed=1)
    # Request 0: a canvas step (16 rows); request 1: a one-step read, 20 prompt tokens then
    # a 12-position canvas; request 2: a prompt only; request 3: a one-step read, 5 + 16.
    qsl = np.array([0, 16, 48, 60, 81])
    state._logit_rows = np.array([16, 12, 0, 16])
    idx = np.array([0, 1, 3])
    slots = np.array([3, 0, 5])
    canvases = [(0, 16), (36, 48), (65, 81)]
    for fresh in (True, False):
        states.single_step_slots.clear()
        soft = torch.zeros(6, 16, 8) if fresh else torch.randn(6, 16, 8)
        if fresh:
            states.single_step_slots.update(slots.tolist())
        embeds = torch.randn(81, 8)
        want = embeds.clone()
        with torch.no_grad():
            for slot, (start, end) in zip(slots.tolist(), canvases, strict=True):
                cpu_vllm.DiffusionGemmaModelState._apply_self_conditioning(
                    state, np.array([slot]), np.array([0]), np.array([start, end]), want, soft
                )
            got = embeds.clone()
            state._apply_self_conditioning(slots, idx, qsl, got, soft)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for start, end in ((16, 36), (48, 65)):  # the prompts' rows untouched
            assert torch.equal(got[start:end], embeds[start:end])


@pytest.mark.vllm
def test_the_plugin_registers_on_vllm_033_and_keeps_max_num_seqs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models import config as model_configs

    from dgstream.workers.engine import vllm_reads

    monkeypatch.setattr(vllm_reads, "_status", None)
    hook = model_configs.MODELS_CONFIG_MAP[vllm_reads.ARCHITECTURE]
    monkeypatch.setitem(model_configs.MODELS_CONFIG_MAP, vllm_reads.ARCHITECTURE, hook)
    vllm_reads.register()
    assert (vllm_reads.status() or "").startswith("registered for vLLM 0.33")
    assert ModelRegistry.models[vllm_reads.ARCHITECTURE].class_name == "DgDiffusionGemma"
    wrapped = model_configs.MODELS_CONFIG_MAP[vllm_reads.ARCHITECTURE]
    assert issubclass(wrapped, hook) and wrapped is not hook
    vllm_reads.register()  # vLLM may call it again: nothing wraps twice
    assert model_configs.MODELS_CONFIG_MAP[vllm_reads.ARCHITECTURE] is wrapped


@pytest.mark.vllm
def test_the_plugin_refuses_another_vllm_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.models import config as model_configs

    from dgstream.workers.engine import vllm_reads

    monkeypatch.setattr(vllm_reads, "_status", None)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    before = dict(model_configs.MODELS_CONFIG_MAP)
    vllm_reads.register()
    assert "vLLM 0.34.0 is not 0.33.x" in (vllm_reads.status() or "")
    assert before == model_configs.MODELS_CONFIG_MAP
    assert [vllm_reads.supported(v) for v in ("0.33.0", "0.33.7", "0.34.0", "0.3.3")] == [
        True,
        True,
        False,
        False,
    ]


@pytest.mark.vllm
def test_the_entry_point_is_installed_where_vllm_is() -> None:
    """vLLM finds the plugin only through package metadata, in every process: `make setup`
    installs it (pyproject's [project.entry-points."vllm.general_plugins"])."""
    from dgstream.workers.engine.vllm.args import read_path_available

    assert read_path_available() is None


# --- the settings side: which read path an engine runs, and what it is given -------------


@pytest.mark.vllm
def test_the_read_path_rides_in_additional_config_with_256_reads_in_flight() -> None:
    from dgstream.workers.engine.vllm.args import engine_args, resolve_read_path
    from dgstream.workers.engine.vllm.settings import VllmSettings

    settings = VllmSettings(load_format="dummy")
    assert resolve_read_path(settings)[0] == "dgstream"
    args = engine_args(settings, "dgstream")
    options = ReadPathOptions.from_additional_config(args["additional_config"])
    assert options == ReadPathOptions(
        enabled=True,
        logits_tile_mib=256,
        max_num_seqs=256,
        one_step=True,  # one_step_reads' default, auto
        one_step_idle_only=True,
        full_graph_tokens=1024,  # full_graph_tokens' default
    )
    assert args["max_num_seqs"] == 256
    assert args["gpu_memory_utilization"] == settings.gpu_memory_utilization
    stock = engine_args(settings, "stock")  # a fallback: vLLM's own ceiling
    assert stock["max_num_seqs"] == 127
    assert ReadPathOptions.from_additional_config(stock["additional_config"]).enabled is False
    assert resolve_read_path(VllmSettings(read_path="stock")) == ("stock", "read_path is 'stock'")


@pytest.mark.vllm
def test_the_stock_path_leaves_its_unprofiled_denoise_step_free_on_the_card(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On vLLM's own path the first denoise step is not in vLLM's memory profile: the
    settings take it off gpu_memory_utilization, and refuse settings it does not fit."""
    from dgstream.workers.engine.types import EngineConfigError
    from dgstream.workers.engine.vllm.args import engine_args
    from dgstream.workers.engine.vllm.settings import VllmSettings
    from dgstream.workers.engine.vllm.sizing import CARD_ENV

    monkeypatch.setenv(CARD_ENV, "23.6")  # what torch reports of a 24 GB board
    settings = VllmSettings(load_format="dummy", canvas_length=16, read_path="stock")
    step = stock_denoise_bytes(127, 4096, 16, 262_144)
    got = engine_args(settings)["gpu_memory_utilization"]
    assert got == round(0.9 - step / (23.6 * 2**30), 4) and 0.77 < got < 0.78
    # The defaults' 64-position canvas makes the warmup step 5.9 GiB: no room is left.
    with pytest.raises(EngineConfigError, match=r"canvas_length 64.*read_path 'dgstream'"):
        engine_args(
            VllmSettings(load_format="dummy", read_path="stock", gpu_memory_utilization=0.25)
        )
    monkeypatch.delenv(CARD_ENV)
    # The project's read path needs no reserve: its step is inside vLLM's profile.
    assert engine_args(VllmSettings(load_format="dummy"))["gpu_memory_utilization"] == 0.9


# --- one step of reads: the read sampler against vLLM's own DiffusionSampler (CPU) ---------

CL, V, H, SLOTS = 16, 64, 8, 6
LABELS = (3, 9, 17, 40)  # one shared constrained set
ASKED = (5, 6)  # what the full-vocabulary read reports


class _Unembed:
    """The unembedding a DgDiffusionGemma gives the sampler (a GEMM over the tied weight
    and the 30.0 softcap), over this test's weight; and vLLM's `compute_logits` for the
    stock sampler's step, over the same weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.lm_head = type("Head", (), {"weight": weight})()
        self.deferred: torch.Tensor | None = None

    def take_deferred(self) -> torch.Tensor | None:
        rows, self.deferred = self.deferred, None
        return rows

    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits.float() / 30.0) * 30.0

    def label_logits(self, rows: torch.Tensor, allowed: tuple[int, ...]) -> torch.Tensor:
        return self._cap(rows @ self.lm_head.weight[list(allowed)].T)

    def vocab_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self._cap(rows @ self.lm_head.weight.T)


class _TokenIdCounts:
    """vLLM's per-request logprob_token_ids bookkeeping, host side only: its device copy is
    a Triton kernel (no CPU), and the constrained step reads only the counts."""

    def __init__(self) -> None:
        self.counts = np.zeros(SLOTS, dtype=np.int32)

    def add_request(self, req_idx: int, params: Any) -> None:
        self.counts[req_idx] = len(params.logprob_token_ids or ())

    def apply_staged_writes(self) -> None:
        return None

    def max_num_token_ids(self, idx_mapping_np: np.ndarray) -> int:
        return int(self.counts[idx_mapping_np].max(initial=0))


def _stock_sampler(dg: Any, weight: torch.Tensor) -> Any:
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.sample.states import SamplingStates

    inner = SimpleNamespace(
        sampling_states=SamplingStates(SLOTS, V),
        logprob_token_ids_state=_TokenIdCounts(),
        req_states=SimpleNamespace(draft_tokens=torch.zeros(SLOTS, CL + 1, dtype=torch.int64)),
        logprobs_mode="raw_logprobs",
    )
    return dg.DiffusionSampler(
        sampler=inner,
        diffusion_config=SimpleNamespace(canvas_length=CL),
        vocab_size=V,
        diffusion_states=dg.DiffusionGemmaRequestStates(
            max_num_reqs=SLOTS,
            canvas_length=CL,
            vocab_size=V,
            max_denoising_steps=48,
            device=torch.device("cpu"),
            hidden_size=H,
            stability_threshold=2,
        ),
        confidence_threshold=0.005,
        t_min=0.4,
        t_max=0.8,
        entropy_bound=0.1,
        embed_weight=weight,
        normalizer=torch.tensor(1.0),
    )


def _batch(slots: list[int], rows: list[int], prompts: list[int]) -> Any:
    from types import SimpleNamespace

    n = len(slots)
    qlen = [r + 1 if r else p for r, p in zip(rows, prompts, strict=True)]
    qsl = np.concatenate(([0], np.cumsum(qlen))).astype(np.int32)
    return SimpleNamespace(
        num_reqs=n,
        idx_mapping_np=np.array(slots, dtype=np.int32),
        idx_mapping=torch.tensor(slots, dtype=torch.int32),
        num_draft_tokens=sum(rows),
        cu_num_logits_np=np.concatenate(([0], np.cumsum(rows))).astype(np.int32),
        query_start_loc_np=qsl,
        query_start_loc=torch.from_numpy(qsl),
        num_computed_prefill_tokens_np=np.zeros(n, dtype=np.int32),
        num_scheduled_tokens=np.array(qlen, dtype=np.int32),
        prefill_len_np=np.array(prompts, dtype=np.int32),
    )


def _params(ids: tuple[int, ...], *, constrained: bool, seed: int) -> Any:
    from vllm.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    return SamplingParams(
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=CL,
        logprob_token_ids=list(ids),
        extra_args={
            "diffusion_canvas_length": CL,
            "diffusion_seed_canvas": rng.integers(0, V, size=CL).tolist(),
            "diffusion_max_steps": 1,
            "diffusion_read_only": True,
            "diffusion_constrained": constrained,
        },
        ignore_eos=True,
    )


def _pair(dg: Any) -> tuple[Any, Any, Any, _Unembed]:
    """vLLM's sampler, and the read sampler over a vLLM sampler of its own, same weight."""
    from types import SimpleNamespace

    from dgstream.workers.engine.vllm_reads.admission import Admissions
    from dgstream.workers.engine.vllm_reads.options import ReadPathOptions
    from dgstream.workers.engine.vllm_reads.sampler import DgReadSampler

    torch.manual_seed(1)
    weight = torch.randn(V, H)
    model = _Unembed(weight)
    theirs = _stock_sampler(dg, weight)
    stock_for_ours = _stock_sampler(dg, weight)
    state = SimpleNamespace(
        model=model,
        options=ReadPathOptions(enabled=True),
        admissions=Admissions(stock_for_ours.diffusion_states),
        read_slots=set(),
        warmup_slots=set(),
        one_step=False,
    )
    return theirs, DgReadSampler(stock_for_ours, state), state, model  # type: ignore[arg-type]


def _arrive(theirs: Any, ours: Any, state: Any, arrivals: dict[int, Any]) -> None:
    for slot, params in arrivals.items():
        theirs.diffusion_states.add_request(slot)
        theirs.add_request(slot, params)
        state.admissions.reset(slot, 10)
        ours.add_request(slot, params)
    theirs.apply_staged_writes()
    ours.apply_staged_writes()


@pytest.mark.vllm
def test_a_step_of_reads_reports_what_vllms_own_sampler_reports(eager_vllm: Any) -> None:
    """Three constrained reads of one label set and a request still reading its prompt, in
    one step: the same canvas, counts, offsets and logprobs from both samplers; the
    request whose prompt finished gets the same seeded canvas."""
    theirs, ours, state, model = _pair(eager_vllm)
    _arrive(
        theirs,
        ours,
        state,
        {s: _params(LABELS, constrained=True, seed=s) for s in (4, 1, 2, 0)},
    )
    assert state.read_slots == {0, 1, 2, 4}
    # The prompts of 4, 1 and 2 are read (a prompt-only step), then they denoise while 0's
    # prompt is read.
    first = _batch([4, 1, 2], [0, 0, 0], [10, 10, 10])
    for sampler in (theirs, ours):
        sampler(torch.zeros(0, V), first)
    step = _batch([4, 1, 0, 2], [CL, CL, 0, CL], [10, 10, 10, 10])
    hidden = torch.randn(3 * CL, H)
    # vLLM's step over the shared set gets logits over those K columns; the read path, rows.
    want = theirs(model.label_logits(hidden, LABELS), _with_allowed(theirs, step))
    model.deferred = hidden
    got = ours(torch.zeros(0), step)
    assert got.num_sampled.tolist() == want.num_sampled.tolist() == [CL, CL, 0, CL]
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert torch.equal(got.num_rejected, want.num_rejected)
    a, b = got.logprobs_tensors, want.logprobs_tensors
    assert a is not None and b is not None
    assert a.cu_num_generated_tokens == b.cu_num_generated_tokens == [0, CL, 2 * CL, 2 * CL]
    assert torch.equal(a.logprob_token_ids, b.logprob_token_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)
    assert torch.equal(a.selected_token_ranks, b.selected_token_ranks)
    for s in (theirs, ours.stock):  # 0's canvas is its seed: ready for its denoise step
        assert (
            s.req_states.draft_tokens[0, :CL].tolist()
            == _params(LABELS, constrained=True, seed=0).extra_args["diffusion_seed_canvas"]
        )


def _fused_batch(slots: list[int], prompts: list[int]) -> Any:
    """A step of one-step reads: each request's whole prompt, then its CL canvas rows."""
    from types import SimpleNamespace

    n = len(slots)
    qlen = [p + CL for p in prompts]
    qsl = np.concatenate(([0], np.cumsum(qlen))).astype(np.int32)
    return SimpleNamespace(
        num_reqs=n,
        idx_mapping_np=np.array(slots, dtype=np.int32),
        idx_mapping=torch.tensor(slots, dtype=torch.int32),
        num_draft_tokens=n * CL,
        cu_num_logits_np=np.arange(n + 1, dtype=np.int32) * CL,
        query_start_loc_np=qsl,
        query_start_loc=torch.from_numpy(qsl),
        num_computed_prefill_tokens_np=np.zeros(n, dtype=np.int32),
        num_scheduled_tokens=np.array(qlen, dtype=np.int32),
        prefill_len_np=np.array(prompts, dtype=np.int32),
        is_prefilling_np=np.ones(n, dtype=bool),
    )


@pytest.mark.vllm
@pytest.mark.parametrize("path", ["read path", "vllm sampler"])
def test_a_one_step_read_reports_what_the_two_step_canvas_step_does(
    eager_vllm: Any, path: str
) -> None:
    """vLLM's sampler over the two steps (the prompts, then their canvases) against the
    read sampler over one step of the same reads (prompt and canvas): the same canvas,
    counts and logprobs from the same hidden rows; the seed comes from the draft row that
    admission wrote. "vllm sampler": a step the read path hands to vLLM's own sampler,
    which gets the one-step reads' prompt state first (`_finish_prefills`)."""
    theirs, ours, state, model = _pair(eager_vllm)
    state.one_step = True
    drafts = ours.stock.req_states.draft_tokens
    drafts.fill_(7)
    arrivals = {s: _params(LABELS, constrained=True, seed=s) for s in (4, 1)}
    _arrive(theirs, ours, state, arrivals)
    for slot, params in arrivals.items():  # admission laid each seed on its draft row
        assert drafts[slot, :CL].tolist() == params.extra_args["diffusion_seed_canvas"]
    assert (drafts[[0, 2, 3, 5], :CL] == 7).all()  # rows of no arrival untouched
    theirs(torch.zeros(0, V), _batch([4, 1], [0, 0], [10, 10]))
    step = _batch([4, 1], [CL, CL], [10, 10])
    hidden = torch.randn(2 * CL, H)
    want = theirs(model.label_logits(hidden, LABELS), _with_allowed(theirs, step))
    fused = _fused_batch([4, 1], [10, 10])
    if path == "read path":
        model.deferred = hidden
        got = ours(torch.zeros(0), fused)
    else:
        got = ours(model.label_logits(hidden, LABELS), _with_allowed(ours.stock, fused))
    assert got.num_sampled.tolist() == want.num_sampled.tolist() == [CL, CL]
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert got.num_rejected.tolist() == [0, 0]
    a, b = got.logprobs_tensors, want.logprobs_tensors
    assert a is not None and b is not None
    assert a.cu_num_generated_tokens == b.cu_num_generated_tokens
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)


def _with_allowed(sampler: Any, batch: Any) -> Any:
    """What vLLM's model state sets before a step whose reads share one allowed set."""
    states = sampler.diffusion_states
    rows = np.diff(batch.cu_num_logits_np)
    states.step_allowed = states.batch_allowed(batch.idx_mapping_np[rows > 0].tolist())
    assert states.step_allowed is not None
    return batch


@pytest.mark.vllm
def test_a_mixed_step_reads_each_group_its_own_way(eager_vllm: Any) -> None:
    """Constrained reads beside a full-vocabulary one: each row as its group reads it
    (float64 oracles), in row order, padded to one width."""
    theirs, ours, state, model = _pair(eager_vllm)
    _arrive(
        theirs,
        ours,
        state,
        {
            3: _params(LABELS, constrained=True, seed=1),
            5: _params(ASKED, constrained=False, seed=2),
        },
    )
    ours(torch.zeros(0, V), _batch([3, 5], [0, 0], [10, 10]))
    hidden = torch.randn(2 * CL, H)
    model.deferred = hidden
    got = ours(torch.zeros(0), _batch([5, 3], [CL, CL], [10, 10]))
    lp = got.logprobs_tensors
    assert lp is not None and lp.cu_num_generated_tokens == [0, CL]
    logits = model.vocab_logits(hidden).double().numpy()
    for row in range(2 * CL):
        if row < CL:  # request 5: the full vocabulary, reporting ASKED
            best, want = _oracle(logits[row], list(ASKED))
            ids = [best, *ASKED]
        else:  # request 3: renormalised over LABELS
            sub = logits[row, list(LABELS)]
            k, want = _oracle(sub, list(range(len(LABELS))))
            best, ids = LABELS[k], [LABELS[k], *LABELS]
        width = len(ids)
        assert lp.logprob_token_ids[row, :width].tolist() == ids
        np.testing.assert_allclose(lp.logprobs[row, :width].numpy(), want, atol=1e-4)
        assert (lp.logprobs[row, width:] == float("-inf")).all()
        assert int(got.sampled_token_ids[row // CL, row % CL]) == best


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops a block of code runs, with their arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append((str(func), args))
        return func(*args, **(kwargs or {}))


@pytest.mark.vllm
def test_admission_writes_its_constants_as_kernel_arguments(cpu_vllm: Any) -> None:
    """`t[idx] = 0` makes a 0-dim host tensor (`lift_fresh`) and an `index_put_` of it: on
    CUDA a copy from pageable memory, which waits for every step queued on the stream, so
    under async scheduling the engine core waited for the step in flight (the torch
    profile of 2026-12-03 counted four such copies per step with arrivals). The flush
    writes constants with `index_fill_` and tensors from its one staged copy."""
    from dgstream.workers.engine.vllm_reads.admission import Admissions

    staged = Admissions(_states(cpu_vllm))
    for slot, prompt, steps, seed, pins, ro in ARRIVALS:
        staged.reset(slot, prompt)
        staged.read(slot, max_steps=steps, seed=seed, pins=pins, read_only=ro)
    with _Recorder() as seen:
        staged.flush()
    names = [name for name, _ in seen.ops]
    for name, args in seen.ops:
        if name == "aten.lift_fresh.default":  # the staged host matrix is the one lifted
            assert args[0].dim() > 0, "a constant lifted to a 0-dim tensor"
        if name.startswith("aten.index_put"):
            assert args[2].dim() > 0, f"{name} of a 0-dim value"
    assert names.count("aten.index_fill_.int_Scalar") == 4


class _StagedRows:
    """The parts of vLLM's staged buffers that `RequestState.add_request` writes."""

    def __init__(self, n: int) -> None:
        self.np = np.zeros(n, dtype=np.int64)
        self.writes: list[tuple[Any, ...]] = []

    def stage_write_elem(self, *args: Any) -> None:
        self.writes.append(args)

    def stage_write(self, *args: Any) -> None:
        self.writes.append(args)


def _request_state(slots: int, width: int) -> Any:
    """An object with what vLLM's own `RequestState.add_request` touches, on the CPU (the
    real class pins host memory, which needs a GPU)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        free_indices=list(range(slots)),
        req_id_to_index={},
        index_to_req_id={},
        max_seq_len=np.zeros(slots, dtype=np.int64),
        prompt_len=_StagedRows(slots),
        prefill_len=_StagedRows(slots),
        total_len=_StagedRows(slots),
        all_token_ids=_StagedRows(slots),
        num_computed_prefill_tokens=np.zeros(slots, dtype=np.int64),
        num_computed_tokens_np=np.zeros(slots, dtype=np.int64),
        num_computed_tokens=_StagedRows(slots),
        num_speculative_steps=width,
        draft_tokens=torch.full((slots, width), 7, dtype=torch.int64),
    )


@pytest.mark.vllm
@pytest.mark.parametrize("drafts", [4, 0])
def test_draft_rows_of_arrivals_are_zeroed_together(drafts: int) -> None:
    """vLLM's own `RequestState.add_request`, through the read sampler's wrapper: the same
    state as without it once the step's staged writes are applied, with the draft rows
    zeroed in one write instead of one launch per request (none when the model drafts
    nothing)."""
    from vllm.v1.worker.gpu.states import RequestState

    from dgstream.workers.engine.vllm_reads.sampler import stage_draft_resets

    theirs, ours = _request_state(5, drafts), _request_state(5, drafts)
    for s in (theirs, ours):
        s.add_request = RequestState.add_request.__get__(s)
    fresh: list[int] = []
    stage_draft_resets(ours, fresh)
    for i, prompt in enumerate(([1, 2, 3], [4, 5], [6, 7, 8, 9])):
        kwargs = {"prompt_len": len(prompt), "all_token_ids": prompt, "max_tokens": 4}
        theirs.add_request(f"r{i}", num_computed_tokens=0, **kwargs)
        ours.add_request(req_id=f"r{i}", num_computed_tokens=0, **kwargs)
    assert ours.num_speculative_steps == drafts
    assert fresh == ([ours.req_id_to_index[f"r{i}"] for i in range(3)] if drafts else [])
    if drafts:  # vLLM zeroed each row at once; the wrapper left them to the batched write
        assert not torch.equal(ours.draft_tokens, theirs.draft_tokens)
    ours.draft_tokens.index_fill_(0, torch.tensor(fresh, dtype=torch.int64), 0)
    assert torch.equal(ours.draft_tokens, theirs.draft_tokens)
    assert ours.req_id_to_index == theirs.req_id_to_index
    for name in ("max_seq_len", "num_computed_prefill_tokens", "num_computed_tokens_np"):
        assert np.array_equal(getattr(ours, name), getattr(theirs, name)), name
    for name in ("prompt_len", "prefill_len"):
        assert np.array_equal(getattr(ours, name).np, getattr(theirs, name).np), name
    for name in ("total_len", "all_token_ids", "num_computed_tokens"):
        assert getattr(ours, name).writes == getattr(theirs, name).writes, name


def test_the_model_state_is_what_the_sampler_asks_for() -> None:
    """The sampler names what it needs of the model state as protocols (`ReadState`,
    `ReadModel`) instead of importing model.py; the model state and the model give each
    member (the state's are set in its __init__)."""
    import ast
    import inspect

    from dgstream.workers.engine.vllm_reads import model as model_module
    from dgstream.workers.engine.vllm_reads.sampler import ReadModel, ReadState

    def members(protocol: type) -> set[str]:
        return {n for n in vars(protocol) if not n.startswith("_")}

    init = ast.parse(inspect.getsource(model_module.DgModelState.__init__).strip())
    assigned = {
        t.attr
        for node in ast.walk(init)
        for t in (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    # `model` is vLLM's own (its model state keeps the model it was built with).
    assert members(ReadState) - {"model"} <= assigned, members(ReadState) - assigned
    # `lm_head` is vLLM's own (the model's output projection).
    methods = members(ReadModel) - {"lm_head"}
    assert methods and all(callable(getattr(model_module.DgDiffusionGemma, n)) for n in methods)

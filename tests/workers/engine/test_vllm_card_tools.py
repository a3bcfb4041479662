"""The compute-limited card's tools on the CPU (docs/vllm.md, a slower GPU): the card
profiles and their SM share, the soak's workload and comparison, the bisection's second round,
the read path's step
watch. The GPU runs use them as checked here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench" / "gpu" / "card"))
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

import card_profiles as cp  # noqa: E402
import next_round  # noqa: E402
import soak_compare  # noqa: E402

from bench.harness.vllm_soak import SIZES, parse_phases, workload  # noqa: E402

pytestmark = pytest.mark.unit

# The first measurement on an H100 (2026-12-07): 805 TFLOP/s plain, 231 at 25%, 102 at 12%.
ISSUE_POINTS = {12: 102.0, 25: 231.0, 100: 805.0}


def test_profiles_carry_the_vendors_dense_rates() -> None:
    assert cp.profile("L4").bf16_tflops == 121.0
    assert cp.profile("a10g") is cp.PROFILES["a10"]
    assert cp.profile("4090").bf16_tflops == pytest.approx(165.2)
    with pytest.raises(KeyError, match="known"):
        cp.profile("t4")


@pytest.mark.parametrize(("card", "share"), [("l4", 14), ("a10", 14), ("rtx4090", 18)])
def test_the_share_is_the_percentage_nearest_the_rate(card: str, share: int) -> None:
    assert cp.share_for(ISSUE_POINTS, cp.profile(card).bf16_tflops) == share


def test_interpolation_is_linear_between_points_and_through_zero_below() -> None:
    assert cp.interpolate(ISSUE_POINTS, 6) == pytest.approx(51.0)
    assert cp.interpolate(ISSUE_POINTS, 18.5) == pytest.approx((102 + 231) / 2)
    assert cp.interpolate(ISSUE_POINTS, 100) == 805.0


def test_a_lone_read_is_bandwidth_bound_on_an_l4_and_batch_256_compute_bound() -> None:
    r = cp.read_rooflines(cp.profile("l4"))
    assert r["unique_b1_bound"] == 1.0
    assert r["unique_b1_ms"] == pytest.approx(cp.STEP_BYTES / 300e9 * 1e3)
    # 4,096 tokens a step of 7.68 GFLOP each take longer than the step's weights.
    assert r["unique_b256_reads_s"] == pytest.approx(121e12 / (272 * cp.FLOP_PER_TOKEN))
    assert "23.6 GiB" in cp.describe(14, 118.4)


def test_the_workload_is_a_fixed_function_of_its_seed() -> None:
    a, b = workload(0, 3000, SIZES, 5000), workload(0, 3000, SIZES, 5000)
    assert a == b
    assert workload(1, 3000, SIZES, 5000) != a
    reads = [r for batch in a for r in batch]
    assert [r.tag for r in reads] == [f"r{i}" for i in range(len(reads))]
    assert {len(batch) for batch in a} <= set(SIZES)
    shared = [batch for i, batch in enumerate(a) if i % 2]
    assert all(r.shared_prefix_len == 224 for batch in shared for r in batch)
    # four question sets: batch 1 and batch 9 share a prefix, 1 and 3 do not
    assert a[1][0].prompt_ids[:224] == a[9][0].prompt_ids[:224]
    assert a[1][0].prompt_ids[:224] != a[3][0].prompt_ids[:224]


@pytest.mark.parametrize("bad", ["plain", "plain:x", ":", "a:1,b"])
def test_a_bad_phase_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="--phases"):
        parse_phases(bad)


def _soak(values: dict[str, list[list[float]]], failed: int = 0, **kw: Any) -> dict[str, Any]:
    phases = [{"phase": "all", "reads": len(values), "failed_batches": failed}]
    return {"phases": phases, "reads": values, **kw}


def test_the_comparison_sees_a_swapped_read_and_measures_the_noise() -> None:
    rng = np.random.default_rng(0)
    ref = {
        f"r{i}": [rng.normal(-2, 0.3, 2).tolist(), rng.normal(-2, 0.3, 4).tolist()]
        for i in range(50)
    }
    run = {k: [[x + 1e-4 for x in s] for s in v] for k, v in ref.items()}
    run["r1"], run["r2"] = run["r2"], run["r1"]
    run["r3"] = [["nan", -1.0], [-1.0] * 4]
    repeat = {"r0": [[x + 2e-4 for x in s] for s in ref["r0"]]}
    out = soak_compare.compare(_soak(ref), _soak(run, failed=1))
    assert out["compared"] == 49 and out["not_finite_in_run"] == 1
    assert out["lp_gap"]["max"] > 0.01  # the swapped pair
    assert out["lp_gap"]["p50"] == pytest.approx(1e-4, rel=1e-3)
    assert out["failed_batches"] == 1
    assert soak_compare.noise(_soak(ref, repeat=repeat))["max"] == pytest.approx(2e-4, rel=1e-3)
    assert soak_compare.separation(_soak(ref), sample=10)["p50"] > 0.01
    # The swapped pair is each nearer another read than itself, whatever the chunking.
    for chunk in (7, 512):
        ident = soak_compare.identity(_soak(ref), _soak(run), chunk=chunk)
        assert ident["checked"] == 49
        assert sorted(ident["misplaced"]) == ["r1", "r2"]
        assert ident["margin"]["p50"] > 0.01
    assert out["identity"]["misplaced"] == ident["misplaced"]
    clean = soak_compare.identity(_soak(ref), _soak({k: v for k, v in ref.items()}))
    assert clean["misplaced"] == [] and clean["margin"]["n"] == 50


def _run(failed: int) -> dict[str, Any]:
    return {"phases": [{"phase": "plain", "failed_batches": failed}]}


@pytest.mark.parametrize(
    ("ctl", "eager", "emu", "case", "first"),
    [
        (0, 0, 0, "not reproduced", "p10"),
        (3, 0, 2, "torch.compile", "nosplit"),
        (3, 2, 0, "Humming", "emumoe"),
        (3, 2, 2, "none of them", "fa"),
    ],
)
def test_the_second_round_follows_the_first(
    ctl: int, eager: int, emu: int, case: str, first: str
) -> None:
    runs = {"ctl": _run(ctl), "eager": _run(eager), "emu": _run(emu)}
    got, specs = next_round.pick(runs, 3)
    assert got.startswith(case)
    assert 1 <= len(specs) <= 3  # three cards fit an H100's 80 GB
    parts = [s.split(":", 3) for s in specs]
    assert all(len(p) == 4 for p in parts)  # NAME:PCT:VARS:ARGS
    assert parts[0][0] == first
    # Every engine of the round starts from round one's kernel caches.
    assert all("CACHE_FROM=ctl" in p[2].split(",") for p in parts)
    # The engine variables travel comma-separated and the spec colon-separated.
    assert all(":" not in p[2] for p in parts)


def test_the_fix_candidate_is_soaked_beside_a_reference_at_full_speed() -> None:
    runs = {"ctl": _run(5), "eager": _run(0), "emu": _run(4), "nocg": _run(3), "nocombo": _run(0)}
    got, specs = next_round.pick(runs, 5)
    assert got.startswith("Inductor's combo kernels")
    parts = [s.split(":", 3) for s in specs]
    assert [p[1] for p in parts[:3]] == ["15", "25", "100"]
    assert all("combo_kernels=false" in p[2] for p in parts[:3])
    got, specs = next_round.pick({**runs, "nocombo": _run(2), "nocg": _run(0)}, 5)
    assert got.startswith("CUDA graphs")
    got, specs = next_round.pick({**runs, "nocombo": _run(2), "two": _run(0)}, 5)
    assert got.startswith("the one-step reads")
    assert '"one_step_reads":false' in specs[0]


def test_a_run_that_never_served_is_not_a_pass() -> None:
    got, _ = next_round.pick({"ctl": None, "eager": _run(0), "emu": None}, 3)
    assert got.startswith("torch.compile")
    got, _ = next_round.pick({"ctl": _run(1), "eager": None, "emu": None}, 3)
    assert got.startswith("none of them")


def test_inductor_options_for_the_bisection() -> None:
    from dgstream.workers.engine.vllm.args import debug_inductor_options

    assert debug_inductor_options("") == {}
    assert debug_inductor_options("split_reductions=false+combo_kernels=false") == {
        "split_reductions": False,
        "combo_kernels": False,
    }
    with pytest.raises(ValueError, match="name=value"):
        debug_inductor_options("split_reductions")


def test_the_token_watch_names_ranges_and_requests() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from dgstream.workers.engine.vllm_reads import debug

    bad = np.zeros(20, dtype=bool)
    bad[5:9] = True
    bad[15] = True
    bad[19] = True  # past the last request: padding
    info = debug.token_ranges(bad, np.array([0, 4, 8, 12, 16, 18]))
    assert info["ranges"] == [(5, 9), (15, 16), (19, 20)]
    assert info["bad_tokens"] == 6
    assert info["requests"] == [1, 2, 3]
    assert info["request_spans"] == [(4, 8), (8, 12), (12, 16)]
    assert info["padding_tokens_bad"] == 1
    assert debug.token_ranges(bad, None)["num_tokens"] == 20
    many = np.zeros(40, dtype=bool)
    many[::2] = True
    assert debug.token_ranges(many, None, limit=3)["more_ranges"] == 17


def test_the_step_watch_names_the_bad_rows_requests() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from dgstream.workers.engine.vllm_reads import debug

    rows = torch.randn(6, 8)
    rows[2, 3] = float("nan")
    lp = torch.randn(6, 4)
    lp[4] = float("-inf")
    flags = debug.row_flags(rows, lp).numpy()
    assert flags.tolist() == [[0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 0]]
    meta = {
        "step": 3,
        "num_reqs": 3,
        "num_tokens": 100,
        "row_request": np.array([0, 0, 1, 1, 2, 2]),
        "prefill": 0,
        "fused": np.array([1]),
        "req_ids": ["a", "b", "c"],
    }
    info = debug.describe(flags, meta)
    assert info["bad_req_ids"] == ["b", "c"]
    assert (info["bad_hidden_rows"], info["bad_logprob_rows"], info["bad_fused"]) == (1, 1, 1)
    assert info["whole_reqs"] == 0


def test_the_engine_caches_go_under_one_folder_and_keep_what_is_set(tmp_path: Path) -> None:
    from dgstream.workers.engine.vllm.args import CACHE_ENV, apply_cache_dir
    from dgstream.workers.engine.vllm.settings import VllmSettings

    env = {"TRITON_CACHE_DIR": "/operator/triton"}
    added = apply_cache_dir(str(tmp_path), env)
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
    assert env["HUMMING_CACHE_DIR"] == str(tmp_path / "humming")
    assert env["TRITON_CACHE_DIR"] == "/operator/triton"  # the operator's choice stays
    assert set(added) == set(CACHE_ENV) - {"TRITON_CACHE_DIR"}
    assert apply_cache_dir(None, env) == {}
    with pytest.raises(ValueError, match="absolute"):
        VllmSettings(cache_dir="relative/caches")
    assert VllmSettings(cache_dir=str(tmp_path)).cache_dir == str(tmp_path)


@pytest.mark.parametrize(
    ("env", "mode"),
    [
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "15"}, "NONE"),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}, None),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "lots"}, None),
        ({}, None),
    ],
)
def test_an_mps_share_runs_without_cuda_graphs(
    env: dict[str, str], mode: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under an MPS share, graph replays computed NaN for blocks of a step's tokens and the
    same reads without graphs did not (docs/vllm.md): unset graph modes become NONE there."""
    pytest.importorskip("vllm")
    from dgstream.workers.engine.vllm.args import engine_args, graphs_for_the_share
    from dgstream.workers.engine.vllm.settings import VllmSettings

    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings, why = graphs_for_the_share(VllmSettings(), env)
    assert settings.cudagraph_mode == mode
    assert (why is not None) == (mode == "NONE")
    args = engine_args(VllmSettings())
    assert args.get("compilation_config", {}).get("cudagraph_mode") == mode
    if mode == "NONE":
        # FULL graphs for reads step aside with the graphs.
        assert args["additional_config"]["dgstream_read_path"]["full_graph_tokens"] == 0


def test_an_explicit_graph_mode_under_mps_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("vllm")
    from dgstream.workers.engine.vllm.args import graphs_for_the_share
    from dgstream.workers.engine.vllm.settings import VllmSettings

    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    chosen = VllmSettings(cudagraph_mode="PIECEWISE", full_graph_tokens=0)
    with caplog.at_level("WARNING"):
        settings, why = graphs_for_the_share(chosen, env)
    assert settings is chosen and why is None
    assert "MPS share of 25%" in caplog.text
    eager = VllmSettings(enforce_eager=True)
    assert graphs_for_the_share(eager, env) == (eager, None)


@pytest.mark.parametrize(
    ("card_gib", "explicit", "expected"),
    [
        # 0.9 less 0.81 GiB of the emulated 24 GB card: vLLM's own "equivalent to 0.8657
        # without CUDA graph memory profiling" of that engine, rounded down.
        ("23.6", None, 0.8656),
        ("79.18", None, 0.8897),
        ("23.6", 0.9, 0.9),  # the operator's value is theirs
        (None, None, 0.9),  # no card known: nothing to scale by
    ],
)
def test_graphs_off_under_mps_keep_their_memory_out_of_the_kv_cache(
    monkeypatch: pytest.MonkeyPatch, card_gib: str | None, explicit: float | None, expected: float
) -> None:
    """Turning graphs off for an MPS share must not hand the memory vLLM set aside for them
    to the KV cache: both full-size engines at 0.9 without graphs ran out of memory in
    vLLM's warmup on the 24 GB card (2026-12-07)."""
    pytest.importorskip("vllm")
    from dgstream.workers.engine.vllm import sizing
    from dgstream.workers.engine.vllm.args import engine_args, graphs_for_the_share
    from dgstream.workers.engine.vllm.settings import VllmSettings

    if card_gib is None:
        monkeypatch.delenv(sizing.CARD_ENV, raising=False)
        monkeypatch.setattr(sizing, "card_bytes", lambda: None)
        monkeypatch.setattr("dgstream.workers.engine.vllm.args.card_bytes", lambda: None)
    else:
        monkeypatch.setenv(sizing.CARD_ENV, card_gib)
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "15"}
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "15")
    given = VllmSettings() if explicit is None else VllmSettings(gpu_memory_utilization=explicit)
    settings, why = graphs_for_the_share(given, env)
    assert settings.cudagraph_mode == "NONE" and why is not None
    assert settings.gpu_memory_utilization == expected
    assert ("gpu_memory_utilization 0.9 ->" in why) == (expected != 0.9)
    assert engine_args(given)["gpu_memory_utilization"] == expected
    # Without a share nothing changes: graphs on, the budget as given.
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    assert graphs_for_the_share(given, {}) == (given, None)
    assert engine_args(given)["gpu_memory_utilization"] == 0.9

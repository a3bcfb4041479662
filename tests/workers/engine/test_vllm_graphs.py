"""FULL CUDA graphs for small mixed steps (`workers.engine.vllm_reads.graphs`) on the CPU:
vLLM 0.33's own graph manager builds its candidates and dispatches each step, with and
without the read path's addition; the settings that turn it on, refuse it or leave it off.
That a fused read answers the same in such a graph is the gpu tier's
(`test_vllm_gpu.py::test_one_step_reads_answer_as_two_steps[small_full]`)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from dgstream.workers.engine.vllm.settings import VllmSettings
from dgstream.workers.engine.vllm.sizing import GRAPH_SIZES
from dgstream.workers.engine.vllm_reads.options import ReadPathOptions

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

# The card's shapes: the token budget 4,096 (its graph sizes) and 256 reads in flight.
SIZES = [s for s in GRAPH_SIZES if s <= 4096]
SEATS = 256
# vLLM's uniform canvas step: the canvas's 64 positions plus the sampled token.
CANVAS_STEP = 65


def _manager(
    cls: Any,
    mode: Any,
    limit: int,
    *,
    backend: str = "TRITON_ATTN",
    enabled: bool = True,
) -> Any:
    """A vLLM graph manager of class `cls` with its candidates built by its own
    `_init_candidates`, as if captured. Its __init__ needs a GPU process (the pipeline
    group, the graph pool), so the attributes it sets are set here."""
    compilation = SimpleNamespace(
        cudagraph_capture_sizes=list(SIZES), max_cudagraph_capture_size=max(SIZES)
    )
    options = ReadPathOptions(enabled=enabled, full_graph_tokens=limit)
    manager = object.__new__(cls)
    manager.vllm_config = SimpleNamespace(
        compilation_config=compilation,
        speculative_config=None,
        cache_config=SimpleNamespace(use_kda_recoverssm=False),
        additional_config=options.as_additional_config(),
        attention_config=SimpleNamespace(backend=SimpleNamespace(name=backend)),
    )
    manager.compilation_config = compilation
    manager.max_num_reqs = SEATS
    manager.cudagraph_mode = mode
    manager.decode_query_len = CANVAS_STEP
    manager.varlen_decode = False
    manager.ubatch_runner = None
    manager.lora_capture_cases = [0]
    manager._lora_dispatch_map, manager._max_lora_case = {}, 0
    manager._candidates, manager._capture_descs = {}, {}
    manager._init_candidates()
    manager._graphs_captured = True
    return manager


def _ours(mode: Any, limit: int, **kw: Any) -> Any:
    from dgstream.workers.engine.vllm_reads.graphs import _Manager

    return _manager(_Manager, mode, limit, **kw)


def _vllms(mode: Any) -> Any:
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

    return _manager(ModelCudaGraphManager, mode, 0)


def _padded(n: int) -> int:
    return min(s for s in SIZES if s >= n)


def test_mixed_steps_up_to_the_bound_replay_full_graphs_and_larger_ones_stay_piecewise() -> None:
    from vllm.config.compilation import CUDAGraphMode

    limit = 1024
    ours = _ours(CUDAGraphMode.FULL_AND_PIECEWISE, limit)
    vllms = _vllms(CUDAGraphMode.FULL_AND_PIECEWISE)
    for tokens in range(1, max(SIZES) + 1):
        reqs = min(tokens, 3)
        mine = ours.dispatch(reqs, tokens, None, 0)
        theirs = vllms.dispatch(reqs, tokens, None, 0)
        # vLLM's own mode ran every mixed step piecewise.
        assert theirs.cg_mode == CUDAGraphMode.PIECEWISE
        assert theirs.num_tokens == _padded(tokens)
        if tokens <= limit:
            # One FULL graph of the smallest size that holds it, its requests padded as
            # vLLM pads a FULL mode's mixed step.
            assert mine.cg_mode == CUDAGraphMode.FULL, tokens
            assert mine.num_tokens == _padded(tokens)
            assert mine.num_reqs == min(mine.num_tokens, SEATS)
            assert mine.uniform_token_count is None
        else:
            assert mine == theirs, tokens


def test_a_uniform_canvas_step_keeps_the_graph_vllm_made_for_it() -> None:
    from vllm.config.compilation import CUDAGraphMode

    ours = _ours(CUDAGraphMode.FULL_AND_PIECEWISE, 1024)
    vllms = _vllms(CUDAGraphMode.FULL_AND_PIECEWISE)
    for reqs in (1, 2, 4, 15, 40, 56):
        tokens = reqs * CANVAS_STEP
        mine = ours.dispatch(reqs, tokens, CANVAS_STEP, 0)
        assert mine == vllms.dispatch(reqs, tokens, CANVAS_STEP, 0)
        assert mine.cg_mode == CUDAGraphMode.FULL
        assert mine.uniform_token_count == CANVAS_STEP


def test_the_graphs_are_captured_with_vllms_own_largest_first() -> None:
    from vllm.config.compilation import CUDAGraphMode

    ours = _ours(CUDAGraphMode.FULL_AND_PIECEWISE, 512)
    vllms = _vllms(CUDAGraphMode.FULL_AND_PIECEWISE)
    full = ours._capture_descs[CUDAGraphMode.FULL]
    added = [d for d in full if d not in vllms._capture_descs[CUDAGraphMode.FULL]]
    assert sorted(d.num_tokens for d in added) == [s for s in SIZES if s <= 512]
    assert all(d.uniform_token_count is None for d in added)
    # vLLM's own graphs are all still there, and the captures run largest first (the
    # pool's first capture sets its size: vLLM's comment in its capture loop).
    assert set(vllms._capture_descs[CUDAGraphMode.FULL]) <= set(full)
    tokens = [d.num_tokens for d in full]
    assert tokens == sorted(tokens, reverse=True)
    assert (
        ours._capture_descs[CUDAGraphMode.PIECEWISE]
        == (vllms._capture_descs[CUDAGraphMode.PIECEWISE])
    )


@pytest.mark.parametrize(
    ("mode", "over", "named"),
    [
        ("FULL", {}, "cudagraph_mode 'FULL'"),
        ("PIECEWISE", {}, "cudagraph_mode 'PIECEWISE'"),
        ("FULL_AND_PIECEWISE", {"backend": "FLASH_ATTN"}, "FLASH_ATTN"),
    ],
)
def test_an_engine_the_graphs_cannot_serve_keeps_vllms_and_says_why(
    mode: str, over: dict[str, Any], named: str, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.config.compilation import CUDAGraphMode

    cg_mode = CUDAGraphMode[mode]
    with caplog.at_level(logging.WARNING):
        ours = _ours(cg_mode, 1024, **over)
    vllms = _manager(type(ours).__mro__[1], cg_mode, 0, **over)
    assert ours._candidates == vllms._candidates
    assert ours._capture_descs == vllms._capture_descs
    assert any(named in r.getMessage() for r in caplog.records), caplog.text


def test_micro_batching_keeps_vllms_graphs() -> None:
    from vllm.config.compilation import CUDAGraphMode

    from dgstream.workers.engine.vllm_reads.graphs import refusal

    config = SimpleNamespace(attention_config=SimpleNamespace(backend="TRITON_ATTN"))
    assert refusal(config, CUDAGraphMode.FULL_AND_PIECEWISE, None) is None
    why = refusal(config, CUDAGraphMode.FULL_AND_PIECEWISE, object())
    assert why is not None and "micro-batching" in why


@pytest.mark.parametrize(("limit", "enabled"), [(0, True), (1024, False)])
def test_an_engine_that_does_not_ask_gets_vllms_graphs(limit: int, enabled: bool) -> None:
    from vllm.config.compilation import CUDAGraphMode

    ours = _ours(CUDAGraphMode.FULL_AND_PIECEWISE, limit, enabled=enabled)
    vllms = _vllms(CUDAGraphMode.FULL_AND_PIECEWISE)
    assert ours._candidates == vllms._candidates
    assert ours._capture_descs == vllms._capture_descs


def test_install_binds_the_runner_to_the_manager_once_and_refuses_anothers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.worker.gpu import model_runner

    from dgstream.workers.engine.vllm_reads import graphs

    stock = model_runner.ModelCudaGraphManager
    monkeypatch.setattr(model_runner, "ModelCudaGraphManager", stock)
    graphs.install()
    graphs.install()
    assert model_runner.ModelCudaGraphManager is graphs._Manager
    assert graphs._Manager.__mro__[1] is stock
    graphs.uninstall()
    assert model_runner.ModelCudaGraphManager is stock
    monkeypatch.setattr(model_runner, "ModelCudaGraphManager", type("Theirs", (stock,), {}))
    with pytest.raises(RuntimeError, match="full_graph_tokens 0"):
        graphs.install()


@pytest.mark.parametrize(("limit", "installed"), [(1024, True), (0, False)])
def test_the_model_state_installs_the_manager_only_for_an_engine_that_asks(
    monkeypatch: pytest.MonkeyPatch, limit: int, installed: bool
) -> None:
    from vllm.model_executor.models import diffusion_gemma as dg
    from vllm.v1.worker.gpu import model_runner

    from dgstream.workers.engine.vllm_reads import graphs
    from dgstream.workers.engine.vllm_reads.model import DgModelState

    stock = model_runner.ModelCudaGraphManager
    monkeypatch.setattr(model_runner, "ModelCudaGraphManager", stock)

    def base_init(self: Any, *args: Any) -> None:
        # What vLLM's own model state sets that the read path's reads (its __init__ needs
        # a loaded model).
        self.diffusion_states = SimpleNamespace()
        self.max_num_reqs = SEATS

    monkeypatch.setattr(dg.DiffusionGemmaModelState, "__init__", base_init)
    config = SimpleNamespace(
        additional_config=ReadPathOptions(
            enabled=True, full_graph_tokens=limit
        ).as_additional_config(),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    DgModelState(config, None, None, "cpu")
    assert (model_runner.ModelCudaGraphManager is graphs._Manager) is installed


# --- the settings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"read_path": "stock"}, "read_path 'stock'"),
        ({"enforce_eager": True}, "enforce_eager"),
        ({"cudagraph_mode": "FULL"}, "cudagraph_mode 'FULL'"),
        ({"cudagraph_mode": "PIECEWISE"}, "cudagraph_mode 'PIECEWISE'"),
        ({"attention_backend": "FLASH_ATTN"}, "attention_backend 'FLASH_ATTN'"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size 2"),
    ],
)
def test_full_graph_tokens_refuses_settings_it_cannot_run_with_by_name(
    over: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match="full_graph_tokens") as err:
        VllmSettings(full_graph_tokens=1024, **over)
    assert named in str(err.value)
    # Not asked for (0, or the default), the same settings start, with vLLM's own graphs.
    for settings in (VllmSettings(full_graph_tokens=0, **over), VllmSettings(**over)):
        assert settings.full_graphs_resolved()[0] == 0


@pytest.mark.parametrize(
    ("over", "read_path", "tokens"),
    [
        ({"full_graph_tokens": 1024}, None, 1024),
        ({"full_graph_tokens": 1024}, "stock", 0),  # the engine fell back: no plugin
        ({"full_graph_tokens": 0}, None, 0),
        ({"full_graph_tokens": 512, "cudagraph_mode": "FULL_AND_PIECEWISE"}, None, 512),
    ],
)
def test_what_the_engine_hands_vllm_follows_the_resolved_bound(
    over: dict[str, Any], read_path: str | None, tokens: int
) -> None:
    from dgstream.workers.engine.vllm.args import engine_args

    args = engine_args(VllmSettings(max_num_seqs=64, **over), read_path)
    options = ReadPathOptions.from_additional_config(args["additional_config"])
    assert options.full_graph_tokens == tokens


def test_the_engine_says_at_start_which_graphs_its_mixed_steps_get(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from bench.harness.vllm_model import write_model_dir
    from dgstream.workers.engine.vllm.engine import VllmEngine

    model_dir = write_model_dir(tmp_path, 512)

    def said(**over: Any) -> list[str]:
        caplog.clear()
        with caplog.at_level("INFO", logger="dgstream.workers.engine.vllm.engine"):
            VllmEngine(VllmSettings(model=str(model_dir), **over))._engine_kwargs()
        return [r.getMessage() for r in caplog.records if "mixed steps" in r.getMessage()]

    assert said(full_graph_tokens=1024) == [
        "vLLM mixed steps: FULL CUDA graphs up to 1024 tokens (full_graph_tokens 1024)"
    ]
    assert said(full_graph_tokens=0) == [
        "vLLM mixed steps: vLLM's own graphs (full_graph_tokens 0)"
    ]
    # The default, and the default stepping aside for a setting it cannot run with.
    assert said() == [
        "vLLM mixed steps: FULL CUDA graphs up to 1024 tokens (full_graph_tokens 1024)"
    ]
    assert said(cudagraph_mode="FULL") == [
        "vLLM mixed steps: vLLM's own graphs (full_graph_tokens 1024, but cudagraph_mode "
        "'FULL' (needs FULL_AND_PIECEWISE, vLLM's default; FULL graphs every step already))"
    ]


def test_the_read_paths_modules_log_where_the_engine_core_prints() -> None:
    """vLLM's engine core prints its loggers under `vllm.` only: a read-path module that
    logged under its own name lost its info lines there (the first GPU run of this
    module's graphs logged nothing)."""
    import importlib

    for name in ("graphs", "model", "sampler", "scheduler"):
        module = importlib.import_module(f"dgstream.workers.engine.vllm_reads.{name}")
        assert module.logger.name.startswith("vllm."), (name, module.logger.name)

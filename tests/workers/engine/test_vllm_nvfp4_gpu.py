"""NVFP4 with real weights through vLLM: the demo model quantized to NVFP4
(`workers/engine/weights/demo-nvfp4/`, compressed-tensors `nvfp4-pack-quantized`, made by
bench/quantize_nvfp4.py) read by the project's `VllmEngine`, against the unquantized demo
model on the same GPU, on held-out demo requests.

Skipped where there is no CUDA GPU or no vLLM (CI); run on the GPU machine:

    DGSTREAM_GPU_OUT=$OUT python3 -m pytest tests/workers/engine/test_vllm_nvfp4_gpu.py -m gpu -v -s

Both engines run `VllmSettings`' defaults (bf16, CUDA graphs, the project's read path,
constrained reads) but for the memory share: they run side by side on one card, as in
test_vllm_gpu.py. bf16 is also what NVFP4 needs: vLLM's weight-only NVFP4 kernels
(Humming on Hopper, Marlin on Ampere and Ada) take fp16 or bf16 activations only.

For every request both engines read the same canvases (the noise seeds are the request's),
so the differences are NVFP4's (and the kernels'). Asserted: the checkpoint loads as
compressed-tensors; against bf16 the answers agree on at least 99% of the questions, 99%
of the questions' probabilities are within 0.1 and all within 0.35, NVFP4's ECE is at most
0.01 above bf16's, and NVFP4 passes the demo model's own bar. The bars and the CPU
figures they rest on: tests/support/nvfp4.py (`MIN_AGREEMENT`). Figures (agreement,
gaps, ECE, accuracy, the NVFP4 kernels vLLM chose, engine starts, seconds) go to
`$DGSTREAM_GPU_OUT/gpu_nvfp4.json` when set; nothing is asserted on speed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from demo_model_bar import assert_bar_met  # noqa: E402

from bench.harness import nvfp4  # noqa: E402
from dgstream.topology import demo_tasks  # noqa: E402
from dgstream.workers.engine.classifier import Classifier, ClassifierSettings  # noqa: E402
from dgstream.workers.engine.models import TRAINED_DIRS  # noqa: E402
from dgstream.workers.engine.template import ChatFormat, standard_label_ids  # noqa: E402
from dgstream.workers.engine.vllm.engine import VllmEngine  # noqa: E402
from dgstream.workers.engine.vllm.settings import VllmSettings  # noqa: E402
from dgstream.workers.engine.vllm.sizing import check_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

COUNT = int(os.environ.get("DGSTREAM_GPU_REQUESTS", "300"))
BATCH = 64
DEMO = str(TRAINED_DIRS["demo"])
NVFP4 = str(TRAINED_DIRS["demo"].parent / "demo-nvfp4")
# Each engine's share of the card: two run side by side (the demo model needs far less);
# the same share as test_vllm_gpu.py's engines.
GPU_SHARE = 0.12
REPORT: dict[str, Any] = {}
# vLLM's log lines naming the NVFP4 kernels it chose (`init_nvfp4_linear_kernel`,
# `select_nvfp4_moe_backend`), printed by the engine core at load.
LINEAR_KERNEL = re.compile(r"Using (\w+) for NVFP4 GEMM")
MOE_BACKEND = re.compile(r"Using '([\w-]+)' NvFp4 MoE backend")


def settings(model: str) -> VllmSettings:
    return check_model(VllmSettings(model=model, gpu_memory_utilization=GPU_SHARE))


def _write_report() -> None:
    out = os.environ.get("DGSTREAM_GPU_OUT")
    if out:
        Path(out, "gpu_nvfp4.json").write_text(json.dumps(REPORT, indent=2, default=str))


def _chat() -> ChatFormat:
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(DEMO))


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One loop for the module: an in-process vLLM stays bound to the loop it started on."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def examples() -> list[demo_tasks.Example]:
    return demo_tasks.held_out_examples(0, COUNT)


@pytest.fixture(scope="module")
def requests(examples: list[demo_tasks.Example]) -> list[Any]:
    return [demo_tasks.validate(ex.request) for ex in examples]


def start(loop: asyncio.AbstractEventLoop, model: str) -> tuple[VllmEngine, float]:
    """An engine over `model` with the factory's shared labels, started; and its start's
    seconds."""
    chat = _chat()
    engine = VllmEngine(settings(model), shared_labels=standard_label_ids(chat.encode))
    t0 = time.perf_counter()
    loop.run_until_complete(engine.start())
    return engine, time.perf_counter() - t0


def classify(
    loop: asyncio.AbstractEventLoop, engine: VllmEngine, reqs: Sequence[Any]
) -> tuple[list[Any], float]:
    classifier = Classifier(engine, _chat(), ClassifierSettings(seed=0))

    async def run() -> list[Any]:
        out: list[Any] = []
        for i in range(0, len(reqs), BATCH):
            out.extend(await classifier.classify(reqs[i : i + BATCH]))
        return out

    t0 = time.perf_counter()
    results = loop.run_until_complete(run())
    return results, time.perf_counter() - t0


@pytest.fixture(scope="module")
def bf16_engine(loop: asyncio.AbstractEventLoop) -> Iterator[VllmEngine]:
    engine, start_s = start(loop, DEMO)
    REPORT["bf16_start_s"] = start_s
    # Were the plugin missing, both engines would run vLLM's own path: still a valid
    # comparison, but not the product's.
    assert engine.read_path == "dgstream", engine.read_path
    yield engine
    loop.run_until_complete(engine.close())
    _write_report()


def test_nvfp4_answers_as_bf16(
    loop: asyncio.AbstractEventLoop,
    bf16_engine: VllmEngine,
    examples: list[demo_tasks.Example],
    requests: list[Any],
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The NVFP4 checkpoint through vLLM against bf16, constrained (the default) and over
    the full vocabulary: the bars above, each mode on the same requests and canvases."""
    engine, start_s = start(loop, NVFP4)
    try:
        log = capfd.readouterr()
        text = log.out + log.err
        quantization = engine._engine.model_config.quantization
        REPORT["nvfp4_start_s"] = start_s
        REPORT["quantization"] = quantization
        REPORT["linear_kernels"] = sorted(set(LINEAR_KERNEL.findall(text)))
        REPORT["moe_backends"] = sorted(set(MOE_BACKEND.findall(text)))
        REPORT["gpu"] = torch.cuda.get_device_name()
        print(f"\nNVFP4 kernels: {REPORT['linear_kernels']}, MoE {REPORT['moe_backends']}")
        assert quantization == "compressed-tensors", quantization
        assert engine.read_path == "dgstream", engine.read_path
        failures: list[str] = []
        for constrained in (True, False):
            mode = "constrained" if constrained else "full_vocabulary"
            ours = engine.sibling(diffusion_constrained=constrained)
            theirs = bf16_engine.sibling(diffusion_constrained=constrained)
            classify(loop, ours, requests[:BATCH])  # warm-up
            classify(loop, theirs, requests[:BATCH])
            reference, bf16_s = classify(loop, theirs, requests)
            results, nvfp4_s = classify(loop, ours, requests)
            figures = nvfp4.compare(examples, reference, results)
            REPORT[mode] = {**figures, "bf16_seconds": bf16_s, "nvfp4_seconds": nvfp4_s}
            print(
                f"NVFP4 vs bf16 ({mode}, {figures['requests']} requests, "
                f"{figures['questions']} questions): agreement {figures['agreement']:.4f} "
                f"({figures['answers_differ']} differ), largest probability gap "
                f"{figures['max_probability_gap']:.4f} (p99 "
                f"{figures['p99_probability_gap']:.4f}), ECE {figures['quantized']['ece']:.4f} "
                f"against {figures['reference']['ece']:.4f}"
            )
            _write_report()
            if figures["agreement"] < nvfp4.MIN_AGREEMENT:
                failures.append(f"{mode}: agreement {figures['agreement']:.4f}")
            if figures["max_probability_gap"] > nvfp4.MAX_GAP:
                failures.append(f"{mode}: largest gap {figures['max_probability_gap']:.4f}")
            if figures["p99_probability_gap"] > nvfp4.MAX_P99_GAP:
                failures.append(f"{mode}: p99 gap {figures['p99_probability_gap']:.4f}")
            rise = figures["quantized"]["ece"] - figures["reference"]["ece"]
            if rise > nvfp4.MAX_ECE_RISE:
                failures.append(f"{mode}: ECE {rise:+.4f} over bf16's")
            wire = [demo_tasks.result_dict(r) for r in results]
            report = demo_tasks.check(demo_tasks.score_results(examples, wire))
            try:
                assert_bar_met(report)
            except AssertionError as exc:
                failures.append(f"{mode}: the demo bar: {exc}")
        assert not failures, failures
    finally:
        loop.run_until_complete(engine.close())
        _write_report()

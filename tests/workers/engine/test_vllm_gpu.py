"""vLLM for real on a GPU: the demo checkpoint through `VllmEngine` and a real `vllm serve`,
against the transformers engine on the same GPU, on held-out demo requests.

Skipped where there is no CUDA GPU or no vLLM (CI); run on the GPU machine:

    DGSTREAM_GPU_OUT=$OUT python3 -m pytest tests/workers/engine/test_vllm_gpu.py -m gpu -v

For every request the engines read the same canvases (the noise seeds are the request's),
so their answers must agree: the same answer to every question and every probability
within 0.01 (bf16 kernels differ in their last bits). vLLM's answers must also pass the
demo model's own bar. Figures (agreement, gaps, accuracy, reads/s, engine start) go to
`$DGSTREAM_GPU_OUT/gpu_tests.json` when set; nothing is asserted on speed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from demo_model_bar import assert_bar_met  # noqa: E402

from dgstream.schemas import ClassificationResult  # noqa: E402
from dgstream.topology import demo_tasks  # noqa: E402
from dgstream.workers.engine.classifier import Classifier, ClassifierSettings  # noqa: E402
from dgstream.workers.engine.factory import EngineSettings, build_classifier  # noqa: E402
from dgstream.workers.engine.models import TRAINED_DIRS  # noqa: E402
from dgstream.workers.engine.template import standard_label_ids  # noqa: E402
from dgstream.workers.engine.vllm.args import serve_command  # noqa: E402
from dgstream.workers.engine.vllm.engine import VllmEngine  # noqa: E402
from dgstream.workers.engine.vllm.remote import VllmRemoteEngine  # noqa: E402
from dgstream.workers.engine.vllm.settings import VllmRemoteSettings, VllmSettings  # noqa: E402
from dgstream.workers.engine.vllm.sizing import check_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

COUNT = int(os.environ.get("DGSTREAM_GPU_REQUESTS", "300"))
REMOTE_COUNT = min(COUNT, 100)
BATCH = 64
MAX_GAP = 0.01
DEMO = str(TRAINED_DIRS["demo"])
# Each vLLM instance takes this share of the card (an H200's 141 GB: ~17 GB), far more than
# the demo model needs; the in-process engine and the server run side by side.
GPU_SHARE = 0.12
REPORT: dict[str, Any] = {}


def demo_settings(**overrides: Any) -> VllmSettings:
    base = {
        "model": DEMO,
        "gpu_memory_utilization": GPU_SHARE,
        # The demo model is tiny: CUDA graphs would only lengthen the start.
        "enforce_eager": True,
        "max_num_seqs": 127,
        "max_num_batched_tokens": 16_384,
        # fp32 on both engines: the read paths are compared without bf16's rounding (in
        # bf16 the answers agreed too, with probabilities 0.024 apart at most).
        "dtype": "float32",
    }
    return check_model(VllmSettings(**{**base, **overrides}))


def _write_report() -> None:
    out = os.environ.get("DGSTREAM_GPU_OUT")
    if out:
        Path(out, "gpu_tests.json").write_text(json.dumps(REPORT, indent=2, default=str))


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


def classify(
    loop: asyncio.AbstractEventLoop, classifier: Classifier, reqs: Sequence[Any]
) -> tuple[list[Any], float]:
    async def run() -> list[Any]:
        out: list[Any] = []
        for i in range(0, len(reqs), BATCH):
            out.extend(await classifier.classify(reqs[i : i + BATCH]))
        return out

    t0 = time.perf_counter()
    results = loop.run_until_complete(run())
    return results, time.perf_counter() - t0


@pytest.fixture(scope="module")
def hf_results(loop: asyncio.AbstractEventLoop, requests: list[Any]) -> list[Any]:
    classifier = build_classifier(
        EngineSettings(model="demo", device="cuda", dtype="float32", reuse_prefix=False)
    )
    classify(loop, classifier, requests[:BATCH])  # warm-up
    results, seconds = classify(loop, classifier, requests)
    REPORT["transformers"] = {"requests": len(requests), "seconds": seconds}
    return results


@pytest.fixture(scope="module")
def vllm_engine(loop: asyncio.AbstractEventLoop) -> Iterator[VllmEngine]:
    # As the factory builds it: one shared label set for every read.
    chat = _chat()
    engine = VllmEngine(demo_settings(), shared_labels=standard_label_ids(chat.encode))
    t0 = time.perf_counter()
    loop.run_until_complete(engine.start())
    REPORT["vllm_start_s"] = time.perf_counter() - t0
    # The default engine runs the project's read path: were the plugin missing, every test
    # below would compare vLLM's own path with itself.
    assert engine.read_path == "dgstream", engine.read_path
    yield engine
    loop.run_until_complete(engine.close())
    _write_report()


@pytest.fixture(scope="module")
def stock_engine(loop: asyncio.AbstractEventLoop) -> Iterator[VllmEngine]:
    """vLLM 0.33's own read path on the same GPU: the read path's reference."""
    chat = _chat()
    engine = VllmEngine(
        demo_settings(read_path="stock"),
        shared_labels=standard_label_ids(chat.encode),
    )
    t0 = time.perf_counter()
    loop.run_until_complete(engine.start())
    REPORT["stock_start_s"] = time.perf_counter() - t0
    assert engine.read_path == "stock"
    yield engine
    loop.run_until_complete(engine.close())


def _chat() -> Any:
    from transformers import AutoTokenizer

    from dgstream.workers.engine.template import ChatFormat

    return ChatFormat(AutoTokenizer.from_pretrained(DEMO))


def probabilities(answer: Any) -> dict[str, float]:
    if answer.type == "yes_no":
        return {"yes": answer.p_yes, "no": 1 - answer.p_yes}
    return dict(answer.probabilities)


def compare(ours: Sequence[Any], theirs: Sequence[Any]) -> dict[str, Any]:
    """Questions compared, answers that differ, and the largest probability gap."""
    questions = differ = 0
    gap = 0.0
    for a, b in zip(ours, theirs, strict=True):
        assert isinstance(a, ClassificationResult) and isinstance(b, ClassificationResult)
        assert a.id == b.id
        for qid, x in a.answers.items():
            y = b.answers[qid]
            questions += 1
            differ += demo_tasks.answer_name(x.model_dump()) != demo_tasks.answer_name(
                y.model_dump()
            )
            px, py = probabilities(x), probabilities(y)
            assert px.keys() == py.keys()
            gap = max(gap, *(abs(px[k] - py[k]) for k in px))
    return {"questions": questions, "answers_differ": differ, "max_probability_gap": gap}


def bar(examples: Sequence[demo_tasks.Example], results: Sequence[Any]) -> demo_tasks.CheckReport:
    wire = [demo_tasks.result_dict(r) for r in results]
    return demo_tasks.check(demo_tasks.score_results(examples, wire))


@pytest.mark.parametrize("constrained", [True, False], ids=["constrained", "full-vocabulary"])
def test_vllm_answers_as_the_transformers_engine_does(
    loop: asyncio.AbstractEventLoop,
    vllm_engine: VllmEngine,
    examples: list[demo_tasks.Example],
    requests: list[Any],
    hf_results: list[Any],
    constrained: bool,
) -> None:
    engine = vllm_engine.sibling(diffusion_constrained=constrained)
    classifier = Classifier(engine, _chat(), ClassifierSettings(seed=0))
    classify(loop, classifier, requests[:BATCH])  # warm-up
    results, seconds = classify(loop, classifier, requests)
    agreement = compare(hf_results, results)
    report = bar(examples, results)
    mode = "constrained" if constrained else "full_vocabulary"
    REPORT[f"vllm_{mode}"] = {
        **agreement,
        "requests": len(requests),
        "seconds": seconds,
        "accuracy": report.accuracy,
        "ece": report.ece,
        "counts": report.counts,
    }
    print(f"\nvLLM {mode}: {agreement}; {report.summary()}; {len(requests) / seconds:.1f} req/s")
    assert agreement["answers_differ"] == 0, agreement
    assert agreement["max_probability_gap"] <= MAX_GAP, agreement
    assert_bar_met(report)
    if not constrained:  # the full vocabulary is read: the label mass is known
        assert all(m is not None for r in results for m in r.diagnostics.label_mass.values())


@pytest.mark.parametrize("constrained", [True, False], ids=["constrained", "full-vocabulary"])
def test_the_read_path_answers_as_stock_vllm(
    loop: asyncio.AbstractEventLoop,
    vllm_engine: VllmEngine,
    stock_engine: VllmEngine,
    requests: list[Any],
    constrained: bool,
) -> None:
    """The project's read path (the vLLM plugin) against vLLM 0.33's own, both in vLLM on
    the same canvases: every answer the same, every probability within 0.01."""
    chat = _chat()
    ours = Classifier(
        vllm_engine.sibling(diffusion_constrained=constrained), chat, ClassifierSettings(seed=0)
    )
    theirs = Classifier(
        stock_engine.sibling(diffusion_constrained=constrained), chat, ClassifierSettings(seed=0)
    )
    classify(loop, ours, requests[:BATCH])  # warm-up
    classify(loop, theirs, requests[:BATCH])
    mine, ours_s = classify(loop, ours, requests)
    stock, stock_s = classify(loop, theirs, requests)
    agreement = compare(stock, mine)
    mode = "constrained" if constrained else "full_vocabulary"
    REPORT[f"read_path_vs_stock_{mode}"] = {
        **agreement,
        "requests": len(requests),
        "seconds": ours_s,
        "stock_seconds": stock_s,
    }
    print(f"\nread path vs stock vLLM ({mode}): {agreement}")
    assert agreement["answers_differ"] == 0, agreement
    assert agreement["max_probability_gap"] <= MAX_GAP, agreement
    if not constrained:
        assert all(m is not None for r in mine for m in r.diagnostics.label_mass.values())


def _start(loop: asyncio.AbstractEventLoop, **overrides: Any) -> tuple[VllmEngine, float]:
    """A demo-model engine with the factory's shared labels and the given settings, started
    on the read path (close it); and its start's seconds."""
    chat = _chat()
    engine = VllmEngine(demo_settings(**overrides), shared_labels=standard_label_ids(chat.encode))
    t0 = time.perf_counter()
    loop.run_until_complete(engine.start())
    start_s = time.perf_counter() - t0
    if engine.read_path != "dgstream":
        loop.run_until_complete(engine.close())
        raise AssertionError(f"the engine runs the {engine.read_path} read path")
    return engine, start_s


@pytest.mark.parametrize("mode", [None, "FULL"], ids=["default-graphs", "full-graphs"])
def test_cuda_graphs_answer_as_eager(
    loop: asyncio.AbstractEventLoop,
    vllm_engine: VllmEngine,
    requests: list[Any],
    mode: str | None,
) -> None:
    """The product serves with CUDA graphs (vLLM's default mode, whose steps that mix
    prompts and canvases run piecewise; or FULL, every step one graph); the tests above
    read eagerly. The read path with graphs against the same path eager: every answer the
    same, every probability within 0.01, constrained."""
    chat = _chat()
    name = "graphs_" + (mode or "default").lower()
    engine, start_s = _start(loop, enforce_eager=False, cudagraph_mode=mode)
    try:
        graphs = Classifier(engine, chat, ClassifierSettings(seed=0))
        eager = Classifier(vllm_engine, chat, ClassifierSettings(seed=0))
        classify(loop, graphs, requests[:BATCH])  # warm-up
        mine, seconds = classify(loop, graphs, requests)
        reference, eager_s = classify(loop, eager, requests)
        agreement = compare(reference, mine)
        REPORT[name] = {
            **agreement,
            "requests": len(requests),
            "seconds": seconds,
            "eager_seconds": eager_s,
            "start_s": start_s,
        }
        print(f"\nread path, {name} vs eager: {agreement}")
        assert agreement["answers_differ"] == 0, agreement
        assert agreement["max_probability_gap"] <= MAX_GAP, agreement
    finally:
        loop.run_until_complete(engine.close())


@pytest.mark.parametrize(
    "graphs",
    ["default", "eager", "full", "small_full"],
    ids=["graphs", "eager", "full", "small_full"],
)
def test_one_step_reads_answer_as_two_steps(
    loop: asyncio.AbstractEventLoop,
    requests: list[Any],
    graphs: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """One-step reads (a read's prompt and canvas in one forward pass) against the same
    engine's reads opting out (vLLM's two steps, which the tests above hold to vLLM's own
    path and to eager): every answer the same, every probability within 0.01. The engine
    core's log shows that reads did run in one step (else this compares two with two).
    Run with vLLM's own graphs (full_graph_tokens 0: a fused step runs piecewise), eager,
    FULL graphs (every step one graph, its ranges read from one persistent buffer) and the
    product's default (vLLM's graph mode with FULL graphs for steps up to
    `full_graph_tokens`, 1,024: a burst's tail of demo reads fits); with FULL graphs, the
    log shows a fused step ran in one."""
    chat = _chat()
    name = "one_step_" + ("graphs" if graphs == "default" else graphs)
    over: dict[str, Any] = {"enforce_eager": graphs == "eager", "one_step_reads": True}
    if graphs == "default":
        over["full_graph_tokens"] = 0
    if graphs == "full":
        over["cudagraph_mode"] = "FULL"
    if graphs == "small_full":
        assert demo_settings(**over).full_graphs_resolved()[0] > 0
    engine, start_s = _start(loop, **over)
    try:
        one = Classifier(engine, chat, ClassifierSettings(seed=0))
        two = Classifier(engine.sibling(two_step=True), chat, ClassifierSettings(seed=0))
        classify(loop, one, requests[:BATCH])  # warm-up
        classify(loop, two, requests[:BATCH])
        mine, one_s = classify(loop, one, requests)
        theirs, two_s = classify(loop, two, requests)
        agreement = compare(theirs, mine)
        log = capfd.readouterr()
        fused = re.findall(r"dgstream one-step reads: (\d+) read", log.out + log.err)
        in_full = "a fused step ran as one FULL CUDA graph" in log.out + log.err
        REPORT[name] = {
            **agreement,
            "requests": len(requests),
            "seconds": one_s,
            "two_step_seconds": two_s,
            "start_s": start_s,
            "fused_logged": fused,
            "fused_in_full_graph": in_full,
        }
        print(f"\none-step ({name}) vs two steps: {agreement}")
        _write_report()  # this test may run alone (PYTEST_K), without the module's engine
        assert fused, "no read ran in one step"
        assert in_full == (graphs in ("full", "small_full")), in_full
        assert agreement["answers_differ"] == 0, agreement
        assert agreement["max_probability_gap"] <= MAX_GAP, agreement
    finally:
        loop.run_until_complete(engine.close())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `vllm serve` of the demo model on loopback, stopped after the module."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    cmd += serve_command(demo_settings(), port=port, name="demo")
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not come up:\n{log.read_text()[-4000:]}")
            time.sleep(1)  # polling a process we do not control; the loop waits on /health
        REPORT["serve_start_s"] = time.perf_counter() - t0
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        out_dir = os.environ.get("DGSTREAM_GPU_OUT")
        if out_dir:
            Path(out_dir, "vllm_serve.log").write_bytes(log.read_bytes()[-200_000:])


def test_remote_vllm_serve_answers_as_in_process(
    loop: asyncio.AbstractEventLoop,
    vllm_engine: VllmEngine,
    vllm_server: str,
    requests: list[Any],
) -> None:
    chat = _chat()
    remote = VllmRemoteEngine(
        VllmRemoteSettings(base_url=vllm_server, model="demo", canvas_length=64, vocab_size=2048),
        shared_labels=standard_label_ids(chat.encode),
    )
    subset = requests[:REMOTE_COUNT]
    local, _ = classify(loop, Classifier(vllm_engine, chat, ClassifierSettings(seed=0)), subset)
    results, seconds = classify(loop, Classifier(remote, chat, ClassifierSettings(seed=0)), subset)
    agreement = compare(local, results)
    REPORT["vllm_remote"] = {**agreement, "requests": len(subset), "seconds": seconds}
    print(f"\nvllm serve: {agreement}; {len(subset) / seconds:.1f} req/s")
    assert agreement["answers_differ"] == 0, agreement
    assert agreement["max_probability_gap"] <= MAX_GAP, agreement

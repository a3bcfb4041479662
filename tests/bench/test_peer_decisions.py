"""The peer benchmark's harness (bench/harness/peer_decisions.py, run by
bench/peer_decisions.py) on the CPU: what the GPU session cannot afford to find out.

- the request bodies are what vLLM's own request models accept;
- the tokenizer built for the full-size dummy model is one vLLM's DiffusionGemma read
  strategy accepts (every label one token, joint reads on), and vLLM's real decision serving
  code (`OpenAIServingDecisions`, `ServingStructuredDecisions`, their strategy, chat rendering
  and tokenizer) turns the bodies into the engine reads the benchmark claims: one 16-token
  canvas per state, prompts of exactly 256 tokens, the shared prefix it reports. Only the
  engine is replaced, by one that answers the requested label ids with random logprobs
  (there is no GPU here);
- the client holds its concurrency against a local HTTP stub and counts what it gets;
- the server wrapper passes the environment through (with no vLLM plugin) and stops;
- the docs section renders.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.harness import peer_decisions as peer

VOCAB = 262_144


def full_size_dir(root: Path) -> Path:
    """What bench/engine_vllm.py's `full_size_dir` writes, in bf16: the published shape's
    config and a generation config with Gemma's special ids."""
    from dgstream.workers.engine.models import full_size_config, write_generation_config

    config = full_size_config()
    body = {**config.to_dict(), "architectures": ["DiffusionGemmaForBlockDiffusion"]}
    body["torch_dtype"] = "bfloat16"
    path = root / "diffusiongemma-full-bf16"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(body))
    config.text_config.bos_token_id, config.text_config.eos_token_id = 2, 1
    config.text_config.pad_token_id = 0
    write_generation_config(path, config)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return peer.write_tokenizer(full_size_dir(tmp_path_factory.mktemp("peer")))


class FakeEngine:
    """The engine's side of vLLM's read path: a final output per request, with a logprob
    for every requested label id at every canvas position."""

    def __init__(self, model_config: Any, vllm_config: Any, renderer: Any) -> None:
        self.model_config, self.vllm_config, self.renderer = model_config, vllm_config, renderer
        self.errored = False
        self.seen: list[tuple[list[int], Any]] = []

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        return None

    async def generate(self, engine_input: Any, params: Any, request_id: str, **_: Any) -> Any:
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        ids = list(engine_input["prompt_token_ids"])
        self.seen.append((ids, params))
        rng = random.Random(len(self.seen))
        rows = [
            {
                t: Logprob(logprob=math.log(rng.uniform(1e-4, 1e-2)))
                for t in params.logprob_token_ids
            }
            for _ in range(params.max_tokens)
        ]
        out = CompletionOutput(
            index=0,
            text="",
            token_ids=[0] * params.max_tokens,
            cumulative_logprob=None,
            logprobs=rows,
            finish_reason="length",
        )
        yield RequestOutput(request_id, None, ids, None, [out], finished=True)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> SimpleNamespace:
    """vLLM's decision serving as `vllm serve` builds it for the peer's settings, on a CPU."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.generate.structured_decisions.serving import (
        ServingStructuredDecisions,
    )
    from vllm.entrypoints.openai.decisions.serving import OpenAIServingDecisions
    from vllm.entrypoints.openai.decisions.strategies import (
        ReadContext,
        select_read_strategy,
    )
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config

    from dgstream.workers.engine.vllm.args import engine_args

    args = peer.parse_args([])
    settings = peer.peer_settings(args, model_dir)
    engine = AsyncEngineArgs(**engine_args(settings))
    model_config = engine.create_model_config()
    vllm_config = VllmConfig(
        model_config=model_config,
        diffusion_config=engine.create_diffusion_config(),
        device_config=DeviceConfig(device="cpu"),
    )
    renderer = renderer_from_config(vllm_config)
    fake = FakeEngine(model_config, vllm_config, renderer)
    context = ReadContext(
        engine_client=fake,  # type: ignore[arg-type]
        online_renderer=OnlineRenderer(
            model_config=model_config,
            renderer=renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
        ),
        chat_template=None,
        chat_template_content_format="auto",
        default_chat_template_kwargs={},
    )
    # The server's own choice (`init_decisions_state`), which swallows a refusal as
    # "the model does not support the Decisions API": here it must construct.
    strategy = select_read_strategy(model_config, ("generate",))(context)
    models = OpenAIModelRegistry(
        model_config=model_config,
        base_model_paths=[BaseModelPath(name=peer.SERVED_NAME, model_path=str(model_dir))],
    )
    return SimpleNamespace(
        engine=fake,
        strategy=strategy,
        model_config=model_config,
        decisions=OpenAIServingDecisions(models, strategy),  # type: ignore[arg-type]
        systemone=ServingStructuredDecisions(models, strategy),  # type: ignore[arg-type]
        states={
            e: peer.States(model_dir, e, args.prompt, args.prompt - args.shared)
            for e in peer.ROUTES
        },
    )


# --- (a) the bodies ---------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize("joint", [True, False])
def test_bodies_validate_against_vllms_request_models(served: SimpleNamespace, joint: bool) -> None:
    from vllm.entrypoints.generate.structured_decisions.protocol import (
        StructuredDecisionRequest,
    )
    from vllm.entrypoints.openai.decisions.protocol import DecisionRequest

    rng = random.Random(0)
    state = served.states["decisions"].checked("unique", rng)
    body = json.loads(json.dumps(peer.request_body("decisions", state, joint=joint)))
    request = DecisionRequest.model_validate(body)
    assert [q.type for q in request.questions] == ["predicate", "choice", "score"]
    assert [len(q.choices) for q in request.questions if q.type == "choice"] == [4]
    assert [len(q.levels) for q in request.questions if q.type == "score"] == [5]
    assert (request.input, request.joint, request.model) == (state, joint, peer.SERVED_NAME)
    other = StructuredDecisionRequest.model_validate(
        peer.request_body("systemone", state, joint=joint)
    )
    assert [q.type for q in other.questions.values()] == ["noul", "choice", "score"]
    # A field vLLM does not know is refused (extra="forbid"): the bodies carry none.
    with pytest.raises(ValueError, match="extra"):
        DecisionRequest.model_validate({**body, "temperature": 1.0})


# --- (b) the tokenizer, through vLLM's own strategy and serving code --------------------------


@pytest.mark.vllm
def test_vllms_diffusiongemma_strategy_accepts_the_tokenizer(served: SimpleNamespace) -> None:
    from vllm.entrypoints.openai.decisions.question_types import QUESTION_TYPES
    from vllm.entrypoints.openai.decisions.strategies import DiffusionGemmaCanvasStrategy

    s = served.strategy
    assert type(s) is DiffusionGemmaCanvasStrategy
    assert s.joint_reads, "joint reads are off: an answer line is not a prefix and one token"
    tok = s._tokenizer()
    assert s.end == tok.convert_tokens_to_ids("<turn|>")
    assert s.pad == tok.pad_token_id == 0
    assert tok.decode(s.thought) == s.THOUGHT
    for qtype in QUESTION_TYPES.values():
        ids = [s.label_ids[label] for label in qtype.label_set]
        assert len(set(ids)) == len(ids), qtype.name
        for label, i in zip(qtype.label_set, ids, strict=True):
            assert tok.encode(label, add_special_tokens=False) == [i]
            assert len(tok.encode(" " + label, add_special_tokens=False)) == 1
    assert max(tok.get_vocab().values()) < VOCAB
    # The generation prompt the strategy reads its tail from.
    text = tok.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<bos><|turn>user\nx<turn|>\n<|turn>model\n"


def _decide(served: SimpleNamespace, endpoint: str, body: dict[str, Any]) -> peer.Outcome:
    from vllm.entrypoints.generate.structured_decisions.protocol import (
        StructuredDecisionRequest,
    )
    from vllm.entrypoints.openai.decisions.protocol import DecisionRequest

    if endpoint == "decisions":
        result = asyncio.run(
            served.decisions.create_decisions(DecisionRequest.model_validate(body))
        )
    else:
        request = StructuredDecisionRequest.model_validate(body)
        result = asyncio.run(served.systemone.create_decision(request))
    status = getattr(getattr(result, "error", None), "code", 200)
    return peer.Outcome(0.0, status, result.model_dump_json().encode())


@pytest.mark.vllm
@pytest.mark.parametrize("endpoint", sorted(peer.ROUTES))
def test_a_joint_request_is_one_256_token_read_of_one_16_token_canvas(
    served: SimpleNamespace, endpoint: str
) -> None:
    states, rng = served.states[endpoint], random.Random(1)
    prompts: dict[str, list[list[int]]] = {}
    for kind in ("unique", "shared"):
        prompts[kind] = []
        for _ in range(2):
            served.engine.seen.clear()
            outcome = _decide(
                served, endpoint, peer.request_body(endpoint, states.checked(kind, rng), joint=True)
            )
            checked = peer.check(endpoint, outcome)
            assert checked.error is None, checked.error
            assert checked.input_tokens == 256
            ((ids, params),) = served.engine.seen  # one read per request
            assert len(ids) == 256 and max(ids) < VOCAB
            assert params.extra_args["diffusion_canvas_length"] == 16
            assert params.extra_args["diffusion_read_only"] is True
            assert "diffusion_constrained" not in params.extra_args  # stock: full vocabulary
            prompts[kind].append(ids)
    # Unique prompts share the chat template's head only (no cache block); shared ones share
    # what the benchmark reports.
    assert peer.common_prefix_len(*prompts["unique"]) < 16
    assert peer.common_prefix_len(*prompts["shared"]) == states.shared_prefix_tokens()
    assert states.shared_prefix_tokens() == 4 + states.length - 32


@pytest.mark.vllm
def test_without_joint_each_question_is_its_own_read(served: SimpleNamespace) -> None:
    served.engine.seen.clear()
    state = served.states["decisions"].checked("unique", random.Random(2))
    outcome = _decide(served, "decisions", peer.request_body("decisions", state, joint=False))
    assert peer.check("decisions", outcome).error is None
    assert len(served.engine.seen) == 3
    assert all(len(ids) < 256 for ids, _ in served.engine.seen)


@pytest.mark.vllm
def test_the_checks_refuse_wrong_answers(served: SimpleNamespace) -> None:
    state = served.states["decisions"].checked("unique", random.Random(3))
    good = _decide(served, "decisions", peer.request_body("decisions", state, joint=True))
    body = json.loads(good.body)
    cases = {
        "answers": {**body, "answers": body["answers"][:2]},
        "sum to": {
            **body,
            "answers": [
                body["answers"][0],
                {
                    **body["answers"][1],
                    "probabilities": [
                        {**p, "probability": 0.5} for p in body["answers"][1]["probabilities"]
                    ],
                },
                body["answers"][2],
            ],
        },
        "was asked": {
            **body,
            "answers": [body["answers"][1], body["answers"][0], body["answers"][2]],
        },
        "unparsable": {"model": "x"},
    }
    for needle, wrong in cases.items():
        error = peer.check("decisions", peer.Outcome(0.0, 200, json.dumps(wrong).encode())).error
        assert error is not None and needle in error, (needle, error)
    assert "HTTP 400" in (peer.check("decisions", peer.Outcome(0.0, 400, b"{}")).error or "")


# --- (c) the client against a stub server ------------------------------------------------------


class Stub:
    """/v1/decisions answering vLLM's DecisionResponse. It holds the first `gate` requests
    until that many are in flight (so the test sees whether the client keeps them in flight),
    and answers every `bad_every`-th request with probabilities that do not sum to 1."""

    def __init__(self, gate: int, bad_every: int) -> None:
        self.gate, self.bad_every = gate, bad_every
        self.in_flight = self.most = self.count = 0
        self.full = asyncio.Event()

    async def handle(self, request: Any) -> Any:
        from aiohttp import web
        from vllm.entrypoints.openai.decisions.protocol import DecisionRequest

        self.count += 1
        n = self.count
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.in_flight >= self.gate:
            self.full.set()
        try:
            if n <= self.gate:
                await asyncio.wait_for(self.full.wait(), 10)
            try:
                DecisionRequest.model_validate_json(await request.read())
            except ValueError as exc:
                return web.json_response({"error": str(exc)}, status=400)
            return web.json_response(_answer(bad=n % self.bad_every == 0))
        finally:
            self.in_flight -= 1


def _answer(*, bad: bool) -> dict[str, Any]:
    p = 0.6 if bad else 0.25
    return {
        "model": peer.SERVED_NAME,
        "answers": [
            {"type": "predicate", "name": "toxic", "probability": 0.3},
            {
                "type": "choice",
                "name": "category",
                "choice": "A",
                "probabilities": [{"value": v, "probability": p} for v in "ABCD"],
                "confidence": 0.25,
            },
            {
                "type": "score",
                "name": "severity",
                "score": 2.0,
                "probabilities": [
                    {"value": i, "label": v, "probability": 0.2} for i, v in enumerate("12345")
                ],
                "confidence": 0.2,
            },
        ],
        "usage": {
            "input_tokens": 256,
            "input_tokens_details": {"cached_tokens": 64, "cache_write_tokens": 0},
            "output_tokens": 12,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 268,
        },
    }


@pytest.mark.vllm
def test_the_client_holds_32_in_flight_and_counts_what_comes_back() -> None:
    from aiohttp import web

    stub = Stub(gate=32, bad_every=10)
    bodies = [
        json.dumps(peer.request_body("decisions", f"state {i}", joint=True)).encode()
        for i in range(96)
    ]

    async def scenario() -> tuple[list[peer.Outcome], float, list[peer.Outcome]]:
        app = web.Application()
        app.router.add_post("/v1/decisions", stub.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}/v1/decisions"
        try:
            # As the benchmark's session for batches up to 256.
            async with peer.client_session(256, 60) as s:
                outcomes, seconds = await peer.drive(s, url, bodies, 32, float("inf"))
                late, _ = await peer.drive(s, url, bodies, 32, deadline=0.0)
        finally:
            await runner.cleanup()
        return outcomes, seconds, late

    outcomes, seconds, late = asyncio.run(scenario())
    assert stub.most == 32  # held at 32, never more
    assert late == []  # past the deadline nothing is sent
    row = peer.summarize("unique", 32, 96, outcomes, seconds, endpoint="decisions", joint=True)
    bad = 96 // 10
    assert (row["requests"], row["ok"], row["errors"]) == (96, 96 - bad, bad)
    assert row["error_samples"] and "sum to" in row["error_samples"][0]
    assert row["questions_per_s"] == pytest.approx(3 * (96 - bad) / seconds)
    assert row["reads_per_s"] == pytest.approx((96 - bad) / seconds)
    assert 0 < row["p50_ms"] <= row["p99_ms"]
    assert (row["variant"], row["batch"], row["mode"]) == ("peer/unique", 32, "joint")
    assert row["input_tokens"] == [256] and row["cached_tokens_mean"] == 64


# --- the server wrapper ------------------------------------------------------------------------

STUB_SERVER = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps(dict(os.environ)).encode() if self.path == "/env" else b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
print("stub up", flush=True)
print('INFO:     127.0.0.1:50412 - "POST /v1/decisions HTTP/1.1" 200 OK', flush=True)
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.unit
def test_the_server_gets_this_environment_without_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DGSTREAM_CARD_GIB", "24")
    monkeypatch.setenv("VLLM_PLUGINS", "dgstream")
    port = peer.free_port()
    server = peer.PeerServer(
        [sys.executable, "-c", STUB_SERVER, str(port)], port, tmp_path / "server.log"
    )
    try:
        assert server.start(timeout_s=30) > 0
        with urllib.request.urlopen(server.url + "/env", timeout=5) as resp:
            env = json.loads(resp.read())
    finally:
        server.stop()
    assert env["VLLM_PLUGINS"] == ""
    assert env["DGSTREAM_CARD_GIB"] == "24"
    assert env.get("PYTHONPATH") == __import__("os").environ.get("PYTHONPATH")
    assert not server.healthy()
    assert "stub up" in server.tail() and "POST" not in server.tail()  # no access lines


@pytest.mark.unit
def test_a_server_that_exits_fails_the_run_with_its_log(tmp_path: Path) -> None:
    port = peer.free_port()
    cmd = [sys.executable, "-c", "import sys; print('no card'); sys.exit(3)"]
    server = peer.PeerServer(cmd, port, tmp_path / "server.log")
    with pytest.raises(peer.PeerFailed, match=r"exited \(3\)[\s\S]*no card"):
        server.start(timeout_s=30)


@pytest.mark.vllm
def test_the_server_runs_the_in_process_engines_settings(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`vllm serve`'s own parser reads the same engine args as the in-process engine's."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from dgstream.workers.engine.vllm.args import engine_args
    from dgstream.workers.engine.vllm.settings import VllmSettings

    monkeypatch.setattr(current_platform, "device_type", "cpu", raising=False)
    args = peer.parse_args([])
    assert args.gpu_memory_utilization == VllmSettings().gpu_memory_utilization
    settings = peer.peer_settings(args, model_dir)
    argv = peer.serve_argv(settings, 8123)
    assert argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", argv[4], *argv[5:]])
    assert (ns.host, ns.port, ns.served_model_name) == ("127.0.0.1", 8123, [peer.SERVED_NAME])
    assert ns.skip_tokenizer_init is False
    served, ours = AsyncEngineArgs.from_cli_args(ns), engine_args(settings)
    for f in dataclasses.fields(AsyncEngineArgs):
        if f.name in ours:
            assert getattr(served, f.name) == getattr(AsyncEngineArgs(**ours), f.name), f.name


DECISIONS_STUB = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
ANSWER = json.loads(sys.argv[2])
class H(BaseHTTPRequestHandler):
    def _send(self, code, body):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._send(200 if self.path == "/health" else 404, b"{}")
    def do_POST(self):
        json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(200 if self.path == "/v1/decisions" else 404, json.dumps(ANSWER).encode())
    def log_message(self, *a):
        pass
print("GPU KV cache size: 24,053 tokens", flush=True)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.vllm
def test_a_run_writes_every_row_against_a_stand_in_server(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole script, with a stdlib server answering in vLLM's place (and the model
    directory the other tests built)."""

    def stand_in(settings: Any, port: int) -> list[str]:
        return [sys.executable, "-c", DECISIONS_STUB, str(port), json.dumps(_answer(bad=False))]

    monkeypatch.setattr(peer, "serve_argv", stand_in)
    monkeypatch.setenv("DGSTREAM_CARD_REPORT", str(tmp_path / "card"))
    (tmp_path / "card").mkdir()
    (tmp_path / "card" / "card-7.json").write_text('{"pid": 7, "peak_reserved_gib": 20.5}')
    out = tmp_path / "peer.json"
    argv = ["--out", str(out), "--batches", "1,2", "--row-seconds", "20"]
    argv += ["--workdir", str(tmp_path / "work")]  # else a directory of its own under /tmp
    result = peer.run(peer.parse_args(argv), lambda quant, root: model_dir)
    body = json.loads(out.read_text())
    assert body["complete"] is result["complete"] is True
    rows = {(r["variant"], r["batch"]): r for r in body["rows"]}
    assert set(rows) == {(f"peer/{k}", b) for k in ("unique", "shared") for b in (1, 2)}
    for (_, b), row in rows.items():
        assert (row["ok"], row["errors"]) == (b * peer.repeats(b), 0)
    info = body["info"]
    assert info["kv_cache_tokens"] == 24053 and info["start_s"] > 0
    assert info["shared_prefix_tokens"] == 4 + info["state_tokens"] - 32
    from dgstream.workers.engine.vllm.settings import VllmSettings

    assert info["gpu_memory_utilization"] == VllmSettings().gpu_memory_utilization
    assert info["card"] == [{"pid": 7, "peak_reserved_gib": 20.5}]  # the emulation's report
    assert "GPU KV cache size" in info["server_log_tail"]


# --- (d) the docs section ----------------------------------------------------------------------


def plain(md: str) -> str:
    """A rendered section as a page shows it: the figure markers (HTML comments) gone."""
    return re.sub(r"<!-- /?figure[^>]*-->", "", md)


@pytest.mark.unit
def test_render_puts_the_peer_beside_the_in_process_rows(tmp_path: Path) -> None:
    def row(kind: str, b: int, q: float) -> dict[str, Any]:
        return {"variant": f"peer/{kind}", "batch": b, "questions_per_s": q, "p50_ms": 40.0,
                "p99_ms": 90.0, "errors": 0}  # fmt: skip

    info = {"vllm": "0.33.0", "endpoint": "/v1/decisions", "mode": "joint", "quant": "nvfp4",
            "gpu_memory_utilization": 0.9, "card_env": {"DGSTREAM_CARD_GIB": "24"},
            "kv_cache_tokens": 24053, "start_s": 201.0, "prompt_tokens": 256,
            "shared_prefix_tokens": 79}  # fmt: skip
    rows = [row("unique", 1, 60.0), row("shared", 1, 75.0), row("unique", 256, 300.0)]
    rows.append({"variant": "peer/shared", "batch": 256, "skipped": "out of time"})
    (tmp_path / "peer.json").write_text(json.dumps({"info": info, "rows": rows}))
    stock = [{"variant": "vllm/unique", "batch": 256, "reads_per_s": 200.0, "p50_ms": 900.0,
              "p99_ms": 1200.0}]  # fmt: skip
    (tmp_path / "stock.json").write_text(json.dumps({"info": {}, "rows": stock}))
    marked = peer.render(tmp_path / "peer.json", [("stock", tmp_path / "stock.json")])
    # Each ratio is a figure other pages may quote (bench/harness/figures.py).
    assert "<!-- figure: stock_unique_b256_vs_peer -->2.00<!-- /figure -->x" in marked
    md = plain(marked)
    lines = md.splitlines()
    assert "| batch | kind | peer | stock | stock / peer | peer errors |" in lines
    assert "| 256 | unique | 300 (40 / 90) | 600 (900 / 1200) | 2.00x | 0 |" in lines
    assert "| 256 | shared | - | - | - | - |" in lines
    assert "| 1 | unique | 60 (40 / 90) | - | - | 0 |" in lines
    assert "first 79 prompt tokens" in md and "24053" in md
    assert "the emulated 24 GiB card" in md


@pytest.mark.unit
def test_render_holds_the_peer_against_one_batch_in_flight(tmp_path: Path) -> None:
    """The peer's client holds `batch` requests at once; an in-process run's rows of four
    batches in flight (the card runs keep both) are not what it is held against."""
    info = {"vllm": "0.33.0", "endpoint": "/v1/decisions", "mode": "joint", "quant": "nvfp4",
            "gpu_memory_utilization": 0.9, "kv_cache_tokens": 4609, "start_s": 201.0,
            "prompt_tokens": 256, "shared_prefix_tokens": 79}  # fmt: skip
    peer_rows = [{"variant": "peer/unique", "batch": 256, "questions_per_s": 300.0,
                  "p50_ms": 40.0, "p99_ms": 90.0, "errors": 0}]  # fmt: skip
    (tmp_path / "peer.json").write_text(json.dumps({"info": info, "rows": peer_rows}))
    ours = [
        {
            "variant": "vllm/unique",
            "batch": 256,
            "in_flight": depth,
            "reads_per_s": rate,
            "p50_ms": 900.0,
            "p99_ms": 1200.0,
        }
        for depth, rate in ((1, 200.0), (4, 250.0))
    ]
    (tmp_path / "ours.json").write_text(json.dumps({"info": {}, "rows": ours}))
    md = plain(peer.render(tmp_path / "peer.json", [("ours", tmp_path / "ours.json")]))
    assert "| 256 | unique | 300 (40 / 90) | 600 (900 / 1200) | 2.00x | 0 |" in md.splitlines()


@pytest.mark.unit
def test_a_later_session_renders_into_its_own_section_with_its_own_command(
    tmp_path: Path,
) -> None:
    """The first session's section keeps its table and command; a later one names its date
    and GPU, and its reproduce line is the render that made it."""
    info = {"vllm": "0.33.0", "endpoint": "/v1/decisions", "mode": "joint", "quant": "nvfp4",
            "gpu_memory_utilization": 0.9, "kv_cache_tokens": 4675, "start_s": 304.0,
            "prompt_tokens": 256, "shared_prefix_tokens": 83,
            "gpu": "NVIDIA H100 80GB HBM3"}  # fmt: skip
    (tmp_path / "peer.json").write_text(json.dumps({"info": info, "rows": []}))
    beside = [("ours", tmp_path / "ours.json")]
    (tmp_path / "ours.json").write_text(json.dumps({"info": {}, "rows": []}))
    first = peer.render(tmp_path / "peer.json", beside)
    assert first.splitlines()[0].endswith("same card, same reads")
    assert "--section" not in first and "--date" not in first
    later = peer.render(tmp_path / "peer.json", beside, "card24-peer-side-by-side", "2026-12-05")
    assert later.splitlines()[0].endswith("(2026-12-05, NVIDIA H100 80GB HBM3)")
    render_line = next(line for line in later.splitlines() if "--render" in line)
    assert render_line == (
        f"python bench/peer_decisions.py --render {tmp_path / 'peer.json'} --beside "
        f'"ours={tmp_path / "ours.json"}" --section card24-peer-side-by-side --date 2026-12-05 '
        "--write   # here"
    )
    args = peer.parse_args(["--render", "x.json", "--section", "s", "--date", "d"])
    assert (args.section, args.date) == ("s", "d")
    assert peer.COMMAND.count("--beside") == 2 and "--section" not in peer.COMMAND

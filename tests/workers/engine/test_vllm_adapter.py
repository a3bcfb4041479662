"""The vLLM adapter against vLLM 0.33's OWN request validation and output types (CPU only).

Reads are built by hand with a fake tokenizer (the point is vLLM's admission path, not
tokenization), against the real model's vocabulary size (262144) and a served canvas of 64.

What runs on a CPU machine, and why the rest does not:
- `ModelConfig` builds offline from a local directory holding a DiffusionGemma config.json
  (transformers 5.20 ships `DiffusionGemmaConfig`; vLLM reads `canvas_length` from it to set
  `is_diffusion`). The tokenizer is skipped (`skip_tokenizer_init`): none exists offline.
- `AsyncEngineArgs.create_engine_config()` does not: with no GPU, vLLM's platform is
  `UnspecifiedPlatform` and the default `DeviceConfig` raises "Device string must not be
  empty" / "Failed to infer device type" (the CLI parser hits the same default factory).
  A `VllmConfig` built from our engine args' model and diffusion configs with
  `DeviceConfig(device="cpu")` does construct, and with it vLLM's real `InputProcessor`,
  whose `process_inputs` is exactly what `AsyncLLM.add_request` runs at admission:
  `SamplingParams.verify` (logprobs, diffusion sampling limits, ...) and
  `validate_diffusion_sampling_params` with the served canvas and the vocabulary size.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest

from bench.harness.vllm_model import write_model_dir
from dgstream.workers.engine.models import DIFFUSION_GENERATION
from dgstream.workers.engine.types import (
    Engine,
    EngineUnavailable,
    FatalEngineError,
    Read,
    ReadRejected,
    RecoverableEngineError,
    Slot,
)
from dgstream.workers.engine.vllm.args import engine_args
from dgstream.workers.engine.vllm.codec import (
    build_completion_body,
    build_sampling_params,
    build_xargs,
    parse_output,
)
from dgstream.workers.engine.vllm.engine import VllmEngine
from dgstream.workers.engine.vllm.remote import VllmRemoteEngine
from dgstream.workers.engine.vllm.settings import MAX_LOGPROB_TOKEN_IDS as OUR_MAX_LOGPROB_TOKEN_IDS
from dgstream.workers.engine.vllm.settings import VllmRemoteSettings, VllmSettings

_SKIP = os.environ.get("DGSTREAM_SKIP_VLLM") == "1"
_SKIP_REASON = "DGSTREAM_SKIP_VLLM=1: vLLM's own request validation deliberately not checked"
if _SKIP:
    pytest.skip(_SKIP_REASON, allow_module_level=True)

try:
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.config.attention import AttentionConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import tokens_input
    from vllm.logprobs import FlatLogprobs, Logprob, append_logprobs_for_next_position
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import MAX_LOGPROB_TOKEN_IDS, SamplingParams
    from vllm.utils.diffusion import validate_diffusion_sampling_params
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.engine.exceptions import EngineDeadError
    from vllm.v1.engine.input_processor import InputProcessor
except Exception as exc:  # CI installs vllm: its absence is a failure, not a skip
    raise ImportError(
        "tests/workers/engine/test_vllm_adapter.py needs vllm==0.33.x importable "
        "(`make setup-vllm`); "
        f"importing it failed with {type(exc).__name__}: {exc}. "
        "Set DGSTREAM_SKIP_VLLM=1 to skip these tests deliberately."
    ) from exc

pytestmark = [pytest.mark.vllm]

VOCAB = 262_144  # google/diffusiongemma-26B-A4B-it, text_config.vocab_size
SERVED_CANVAS = 64  # VllmSettings().canvas_length
EOT = 106  # Gemma's <end_of_turn>
PAD = 0


class FakeTokenizer:
    """One id per distinct piece, stable, inside the real vocabulary's range."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def id(self, piece: str) -> int:
        if piece not in self._ids:
            self._ids[piece] = 1_000 + 7 * len(self._ids)
        return self._ids[piece]

    def encode(self, text: str) -> list[int]:
        return [self.id(p) for p in text.replace("\n", " \n ").split(" ") if p]


TOK = FakeTokenizer()

YES_NO = ("yes", "no")
CHOICE_26 = tuple(chr(ord("A") + i) for i in range(26))
SCORE_10 = (*"123456789", "A")  # levels past nine are letters


def make_read(
    questions: list[tuple[str, tuple[str, ...]]],
    *,
    width: int = SERVED_CANVAS,
    seed: int = 0,
    tag: str = "",
) -> Read:
    """Prompt + canvas `qid: <slot>` lines, end of turn, padding; slots hold noise ids."""
    rng = np.random.default_rng(seed)
    system = " ".join(f"{q} answer one of {' '.join(labels)}" for q, labels in questions)
    prompt = [2, *TOK.encode(system), *TOK.encode("the state text to classify")]
    canvas: list[int] = []
    slots = []
    for qid, labels in questions:
        canvas.append(TOK.id(f"{qid}:"))
        slots.append(
            Slot(
                question_id=qid,
                position=len(canvas),
                label_ids=tuple(TOK.id(label) for label in labels),
                labels=labels,
            )
        )
        canvas.append(int(rng.integers(0, VOCAB)))  # the noise
        canvas.append(TOK.id("\n"))
    canvas.append(EOT)
    assert len(canvas) <= width
    canvas += [PAD] * (width - len(canvas))
    return Read(tuple(prompt), tuple(canvas), tuple(slots), shared_prefix_len=len(prompt), tag=tag)


READS = {
    "yes_no": make_read([("toxic", YES_NO)], seed=1),
    "choice_26": make_read([("topic", CHOICE_26)], seed=2),
    "score_10": make_read([("severity", SCORE_10)], seed=3),
    "joint": make_read([("toxic", YES_NO), ("topic", CHOICE_26), ("severity", SCORE_10)], seed=4),
    "narrow_48": make_read([("toxic", YES_NO)], width=48, seed=5),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """vLLM's real ModelConfig and InputProcessor for a DiffusionGemma served as configured."""
    model_dir = write_model_dir(tmp_path_factory.mktemp("diffusiongemma"), VOCAB)
    settings = VllmSettings(model=str(model_dir), skip_tokenizer_init=True)
    args = AsyncEngineArgs(**engine_args(settings))
    model_config = args.create_model_config()
    vllm_config = VllmConfig(
        model_config=model_config,
        diffusion_config=args.create_diffusion_config(),
        device_config=DeviceConfig(device="cpu"),
    )
    return SimpleNamespace(
        settings=settings,
        args=args,
        model_config=model_config,
        vllm_config=vllm_config,
        processor=InputProcessor(vllm_config),
    )


def admit(served: SimpleNamespace, read: Read, params: SamplingParams) -> Any:
    """What AsyncLLM.add_request runs before a request reaches the engine core."""
    return served.processor.process_inputs(
        read.tag or "r", tokens_input(list(read.prompt_ids)), params, ("generate",)
    )


# --- engine args -----------------------------------------------------------------------------


def test_engine_args_build_real_async_engine_args() -> None:
    args = AsyncEngineArgs(**engine_args(VllmSettings()))
    assert args.model == "RedHatAI/diffusiongemma-26B-A4B-it-NVFP4"
    diffusion = args.create_diffusion_config()
    assert diffusion is not None and diffusion.canvas_length == 64
    assert args.max_model_len == 16_384
    assert args.enable_prefix_caching is True
    assert args.max_logprobs == MAX_LOGPROB_TOKEN_IDS == OUR_MAX_LOGPROB_TOKEN_IDS
    assert args.quantization is None  # detected from the checkpoint (compressed-tensors)
    assert args.tensor_parallel_size == 1
    backend = AttentionConfig.validate_backend_before(args.attention_backend)
    assert backend is AttentionBackendEnum.TRITON_ATTN


def test_model_config_builds_offline(served: SimpleNamespace) -> None:
    mc = served.model_config
    assert mc.is_diffusion
    assert mc.get_vocab_size() == VOCAB
    assert mc.max_logprobs == MAX_LOGPROB_TOKEN_IDS
    assert mc.max_model_len == 16_384
    assert served.vllm_config.diffusion_config.canvas_length == SERVED_CANVAS
    # Setting a diffusion config selects vLLM's diffusion scheduler.
    assert "diffusion_scheduler" in served.vllm_config.scheduler_config.scheduler_cls


# --- admission: the reads pass vLLM's own validation ------------------------------------------


@pytest.mark.parametrize("name", sorted(READS))
def test_reads_pass_vllm_validation(served: SimpleNamespace, name: str) -> None:
    read = READS[name]
    width = len(read.canvas_ids)
    assert width % 16 == 0 and width <= SERVED_CANVAS
    assert all(0 <= t < VOCAB for t in read.canvas_ids)
    params = build_sampling_params(read, served.settings)  # __post_init__ / _verify_args
    assert params.logprob_token_ids == list(read.label_union)
    assert params.extra_args == {
        "diffusion_canvas_length": width,
        "diffusion_seed_canvas": list(read.canvas_ids),
        "diffusion_max_steps": 1,
        "diffusion_read_only": True,
        "diffusion_constrained": True,
    }
    params.verify(served.model_config, None, None, None)
    validate_diffusion_sampling_params(params, canvas_length=SERVED_CANVAS, vocab_size=VOCAB)
    request = admit(served, read, build_sampling_params(read, served.settings))
    assert request.sampling_params.max_tokens == width
    assert request.sampling_params.ignore_eos is True
    assert request.sampling_params.stop_token_ids == []


def test_label_unions_are_what_we_think() -> None:
    assert len(READS["yes_no"].label_union) == 2
    assert len(READS["choice_26"].label_union) == 26
    assert len(READS["score_10"].label_union) == 10
    assert len(READS["joint"].label_union) == 2 + 26 + 9  # "A" is in choice and score


def test_seed_canvas_of_the_wrong_width_is_refused(served: SimpleNamespace) -> None:
    read = READS["yes_no"]
    params = build_sampling_params(read, served.settings)
    assert params.extra_args is not None
    params.extra_args["diffusion_seed_canvas"] = list(read.canvas_ids[:48])
    with pytest.raises(VLLMValidationError, match="exactly 64 ids") as err:
        validate_diffusion_sampling_params(params, canvas_length=SERVED_CANVAS, vocab_size=VOCAB)
    assert err.value.parameter == "extra_args"
    with pytest.raises(VLLMValidationError) as err:
        admit(served, read, params)
    assert err.value.parameter == "extra_args"


def test_canvas_wider_than_served_is_refused(served: SimpleNamespace) -> None:
    wide = make_read([("toxic", YES_NO)], width=80, seed=6)
    with pytest.raises(VLLMValidationError, match="served canvas") as err:
        admit(served, wide, build_sampling_params(wide, served.settings))
    assert err.value.parameter == "extra_args"


def test_noise_id_outside_the_vocabulary_is_refused(served: SimpleNamespace) -> None:
    read = READS["yes_no"]
    bad = Read(read.prompt_ids, (*read.canvas_ids[:-1], VOCAB), read.slots)
    with pytest.raises(VLLMValidationError, match=r"\[0, 262144\)") as err:
        admit(served, bad, build_sampling_params(bad, served.settings))
    assert err.value.parameter == "extra_args"


def test_label_union_over_128_is_refused(served: SimpleNamespace) -> None:
    labels = tuple(f"L{i}" for i in range(MAX_LOGPROB_TOKEN_IDS + 1))
    read = make_read([("wide", labels)], seed=7)
    assert len(read.label_union) == 129
    params = build_sampling_params(read, served.settings)
    with pytest.raises(VLLMValidationError, match="max allowed: 128") as err:
        params._validate_logprobs(served.model_config)
    assert err.value.parameter == "logprob_token_ids"
    with pytest.raises(VLLMValidationError):
        admit(served, read, build_sampling_params(read, served.settings))


def test_constrained_without_logprob_token_ids_is_refused(served: SimpleNamespace) -> None:
    read = READS["yes_no"]
    params = SamplingParams(
        max_tokens=SERVED_CANVAS,
        extra_args={
            "diffusion_canvas_length": SERVED_CANVAS,
            "diffusion_seed_canvas": list(read.canvas_ids),
            "diffusion_max_steps": 1,
            "diffusion_read_only": True,
            "diffusion_constrained": True,
        },
    )
    with pytest.raises(VLLMValidationError, match="needs logprob_token_ids") as err:
        validate_diffusion_sampling_params(params, canvas_length=SERVED_CANVAS, vocab_size=VOCAB)
    assert err.value.parameter == "extra_args"
    with pytest.raises(VLLMValidationError):
        admit(served, read, params)


def test_remote_body_survives_vllms_completion_request(served: SimpleNamespace) -> None:
    """The remote mode's JSON, through the server's own CompletionRequest -> SamplingParams."""
    read = READS["joint"]
    body = json.loads(json.dumps(build_completion_body(read, VllmRemoteSettings())))
    request = CompletionRequest(**body)
    assert request.vllm_xargs == build_xargs(read)
    params = request.to_sampling_params(body["max_tokens"])
    assert params.extra_args is not None
    assert params.extra_args["diffusion_read_only"] == 1
    assert params.extra_args["diffusion_constrained"] == 1
    assert params.extra_args["diffusion_seed_canvas"] == list(read.canvas_ids)
    assert params.logprob_token_ids == list(read.label_union)
    assert params.logprobs is None  # the union is returned in full, not as a top-k
    admit(served, read, params)
    # A JSON boolean is narrowed to 1 by vllm_xargs' type; 0/1 is what we send anyway.
    narrowed = CompletionRequest(**{**body, "vllm_xargs": {"diffusion_read_only": True}})
    assert narrowed.vllm_xargs == {"diffusion_read_only": 1}


# --- parse_output on vLLM's own output classes ------------------------------------------------


def _request_output(read: Read, rows: dict[int, dict[int, float]], *, flat: bool) -> RequestOutput:
    """A read-only output: one logprob row per canvas position, as the output processor
    builds it (column 0 = the argmax token, then logprob_token_ids)."""
    union = list(read.label_union)
    width = len(read.canvas_ids)
    container: Any = FlatLogprobs() if flat else []
    token_ids = []
    for pos in range(width):
        row = rows.get(pos, {})
        argmax = max(row, key=row.__getitem__) if row else read.canvas_ids[pos]
        token_ids.append(argmax)
        ids = [argmax, *union]
        lps = [row.get(argmax, -0.01), *(row.get(t, -30.0) for t in union)]
        append_logprobs_for_next_position(container, ids, lps, [None] * len(ids), 1, len(union))
    out = CompletionOutput(
        index=0,
        text="",
        token_ids=token_ids,
        cumulative_logprob=None,
        logprobs=container,
        finish_reason="length",
    )
    return RequestOutput("r", None, list(read.prompt_ids), None, [out], finished=True)


@pytest.mark.parametrize("flat", [True, False])
def test_parse_output_full_vocab(flat: bool) -> None:
    read = READS["joint"]
    toxic, topic, severity = read.slots
    yes, no = toxic.label_ids
    rows = {
        # 'yes' -0.5, 'no' -1.5; argmax is 'yes' (a label)
        toxic.position: {no: -1.5, yes: -0.5},
        # topic: C most likely, but the argmax is a non-label id carrying 0.6
        topic.position: {
            **{t: -9.0 for t in topic.label_ids},
            topic.label_ids[2]: -1.2,
            77_777: float(np.log(0.6)),
        },
        severity.position: {t: -3.0 - i for i, t in enumerate(severity.label_ids)},
    }
    result = parse_output(read, _request_output(read, rows, flat=flat), constrained=False)
    assert [s.question_id for s in result.slots] == ["toxic", "topic", "severity"]
    for s in result.slots:
        assert s.probs.sum() == pytest.approx(1.0)
    t = result.slots[0]
    assert t.probs == pytest.approx([1 / (1 + np.exp(-1.0)), np.exp(-1.0) / (1 + np.exp(-1.0))])
    assert t.label_mass == pytest.approx(np.exp(-0.5) + np.exp(-1.5))
    assert t.argmax_is_label is True
    assert t.entropy == pytest.approx(-(t.probs * np.log(t.probs)).sum())
    c = result.slots[1]
    assert int(np.argmax(c.probs)) == 2
    assert c.label_mass == pytest.approx(np.exp(-1.2) + 25 * np.exp(-9.0))
    assert c.argmax_is_label is False
    sv = result.slots[2]
    assert list(np.argsort(-sv.probs)) == list(range(10))  # label order kept
    assert sv.probs[0] / sv.probs[1] == pytest.approx(np.e)


def test_parse_output_constrained() -> None:
    read = READS["choice_26"]
    (slot,) = read.slots
    # Renormalized over the allowed set: log-softmax over the 26 labels.
    logits = np.linspace(2.0, -3.0, 26)
    lps = logits - np.log(np.exp(logits).sum())
    rows = {slot.position: dict(zip(slot.label_ids, lps.tolist(), strict=True))}
    result = parse_output(read, _request_output(read, rows, flat=True), constrained=True)
    (s,) = result.slots
    assert s.probs == pytest.approx(np.exp(lps))
    assert s.probs.sum() == pytest.approx(1.0)
    assert s.label_mass is None and s.argmax_is_label is None


def test_parse_output_missing_label_is_an_engine_error() -> None:
    read = READS["yes_no"]
    (slot,) = read.slots
    out = _request_output(read, {}, flat=False)
    rows = out.outputs[0].logprobs
    assert isinstance(rows, list)
    rows[slot.position] = {slot.label_ids[0]: Logprob(-0.1)}
    with pytest.raises(RecoverableEngineError, match="no logprob for label"):
        parse_output(read, out)


# --- VllmEngine: real admission, real error types, a stand-in for the GPU ---------------------


class _AdmittingEngine:
    """Stands in for AsyncLLM: runs vLLM's real admission, then answers uniformly."""

    def __init__(self, served: SimpleNamespace, reads: list[Read], dead: bool = False) -> None:
        self.served, self.reads, self.dead, self.errored = served, reads, dead, False

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str) -> Any:
        if self.dead:
            raise EngineDeadError()
        read = next(
            r
            for r in self.reads
            if list(r.prompt_ids) == prompt["prompt_token_ids"]
            and list(r.canvas_ids) == (params.extra_args or {}).get("diffusion_seed_canvas")
        )
        admit(self.served, read, params)
        # A constrained row is a log-softmax over the requested ids (parse_output checks it):
        # the slot's labels level, the union's other ids far below.
        union = read.label_union
        rows = {}
        for s in read.slots:
            raw = {t: (-1.0 if t in s.label_ids else -30.0) for t in union}
            norm = float(np.logaddexp.reduce(list(raw.values())))
            rows[s.position] = {t: v - norm for t, v in raw.items()}
        await asyncio.sleep(0)
        yield _request_output(read, rows, flat=True)

    def shutdown(self) -> None:
        pass


def _engine_with(stand_in: _AdmittingEngine, settings: VllmSettings) -> VllmEngine:
    engine = VllmEngine(settings)
    engine._engine = stand_in  # skip building AsyncLLM: no GPU here
    return engine


def test_vllm_engine_reads_and_rejects_per_read(served: SimpleNamespace) -> None:
    good = [READS["yes_no"], READS["joint"]]
    engine = _engine_with(_AdmittingEngine(served, good), served.settings)
    assert isinstance(engine, Engine)
    results = asyncio.run(engine.read(good))
    assert [len(r.slots) for r in results] == [1, 3]
    assert results[1].slots[1].probs == pytest.approx(np.full(26, 1 / 26))
    assert "engine_s" in results[0].timings

    wide = make_read([("toxic", YES_NO)], width=80, seed=8)
    batch = [READS["yes_no"], wide, READS["score_10"]]
    engine = _engine_with(_AdmittingEngine(served, batch), served.settings)
    with pytest.raises(ReadRejected) as err:
        asyncio.run(engine.read(batch))
    assert err.value.index == 1 and set(err.value.rejected) == {1}
    assert "extra_args" in err.value.reason
    assert err.value.results[0] is not None and err.value.results[1] is None
    assert err.value.results[2] is not None
    assert isinstance(err.value, RecoverableEngineError)


def test_vllm_engine_dead_is_fatal(served: SimpleNamespace) -> None:
    engine = _engine_with(_AdmittingEngine(served, [], dead=True), served.settings)
    with pytest.raises(FatalEngineError):
        asyncio.run(engine.read([READS["yes_no"]]))


# --- VllmRemoteEngine against a stdlib HTTP server on 127.0.0.1 -------------------------------


class _FakeServe(BaseHTTPRequestHandler):
    requests: ClassVar[list[tuple[dict[str, str], dict[str, Any]]]] = []
    status = 200

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((dict(self.headers), body))
        if self.status != 200:
            payload: dict[str, Any] = {
                "error": {
                    "message": "diffusion_seed_canvas must hold exactly 64 ids, got 48.",
                    "type": "BadRequestError",
                    "param": "extra_args",
                    "code": self.status,
                }
            }
        else:
            union = body["logprob_token_ids"]
            top = []
            tokens = []
            for pos in range(body["max_tokens"]):
                argmax = union[pos % len(union)]
                tokens.append(f"token_id:{argmax}")
                row = {f"token_id:{argmax}": -0.1}
                row.update({f"token_id:{t}": -1.0 - 0.5 * i for i, t in enumerate(union)})
                top.append(row)
            payload = {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "finish_reason": "length",
                        "logprobs": {
                            "tokens": tokens,
                            "token_logprobs": [-0.1] * len(top),
                            "text_offset": [0] * len(top),
                            "top_logprobs": top,
                        },
                    }
                ],
            }
        raw = json.dumps(payload).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_serve() -> Iterator[tuple[str, type[_FakeServe]]]:
    handler = type("Handler", (_FakeServe,), {"requests": [], "status": 200})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_remote_engine_reads(
    fake_serve: tuple[str, type[_FakeServe]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, handler = fake_serve
    monkeypatch.setenv("DGSTREAM_TEST_VLLM_KEY", "sekrit")
    settings = VllmRemoteSettings(
        base_url=url, api_key_env="DGSTREAM_TEST_VLLM_KEY", diffusion_constrained=False
    )
    read = READS["yes_no"]
    engine = VllmRemoteEngine(settings)
    assert isinstance(engine, Engine)
    (result,) = asyncio.run(engine.read([read]))
    headers, body = handler.requests[0]
    assert headers["Authorization"] == "Bearer sekrit"
    assert "sekrit" not in repr(settings)
    assert body["vllm_xargs"] == build_xargs(read, constrained=False)
    assert body["prompt"] == list(read.prompt_ids)
    assert body["return_tokens_as_token_ids"] is True
    (slot,) = result.slots
    # union is sorted; yes/no ids map to -1.0 / -1.5 in union order
    union = list(read.label_union)
    lp = {t: -1.0 - 0.5 * i for i, t in enumerate(union)}
    expected = np.exp([lp[t] for t in read.slots[0].label_ids])
    assert slot.probs == pytest.approx(expected / expected.sum())
    assert slot.label_mass == pytest.approx(expected.sum())
    assert slot.argmax_is_label is True  # the fake server's argmax is a union (= label) id


def test_remote_engine_maps_http_errors(fake_serve: tuple[str, type[_FakeServe]]) -> None:
    url, handler = fake_serve
    engine = VllmRemoteEngine(VllmRemoteSettings(base_url=url))
    handler.status = 400
    with pytest.raises(ReadRejected) as err:
        asyncio.run(engine.read([READS["yes_no"]]))
    assert err.value.index == 0 and "exactly 64 ids" in err.value.reason
    handler.status = 401
    with pytest.raises(FatalEngineError):
        asyncio.run(engine.read([READS["yes_no"]]))
    handler.status = 500
    with pytest.raises(RecoverableEngineError) as retry:
        asyncio.run(engine.read([READS["yes_no"]]))
    assert not isinstance(retry.value, ReadRejected | EngineUnavailable)
    # A server that is down, restarting or overloaded is an outage, not the read's fault.
    for status in (429, 502, 503, 504):
        handler.status = status
        with pytest.raises(EngineUnavailable):
            asyncio.run(engine.read([READS["yes_no"]]))


def test_remote_engine_out_of_reach_is_unavailable() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = VllmRemoteEngine(VllmRemoteSettings(base_url=f"http://127.0.0.1:{port}"))
    with pytest.raises(EngineUnavailable, match="refused"):
        asyncio.run(engine.read([READS["yes_no"]]))


def test_module_imports_without_vllm_names() -> None:
    """The backend's modules import vllm only inside functions (actors without it load
    them), and so do the read path's modules that the settings read."""
    engine = Path(__file__).parents[3] / "workers" / "engine"
    sources = [*sorted((engine / "vllm").glob("*.py"))]
    sources += [engine / "vllm_reads" / n for n in ("__init__.py", "options.py", "rules.py")]
    assert len(sources) > 6
    top_level = [
        f"{source.name}: {line}"
        for source in sources
        for line in source.read_text().splitlines()
        if line.startswith(("import vllm", "from vllm"))
    ]
    assert top_level == []


# --- the model's settings, checked before vLLM sees them ------------------------------------


def test_demo_checkpoint_generation_config_is_what_vllm_reads() -> None:
    from dgstream.workers.engine.models import (
        TRAINED_DIRS,
        ensure_tiny_model,
        missing_generation_fields,
    )

    demo = TRAINED_DIRS["demo"]
    assert missing_generation_fields(demo) == []
    assert missing_generation_fields(ensure_tiny_model("tiny-random")) == []
    args = AsyncEngineArgs(**engine_args(VllmSettings(model=str(demo))))
    gen = args.create_model_config().try_get_generation_config()
    # What DiffusionGemma's model state and sampler read at start (diffusion_gemma.py).
    assert isinstance(gen["stability_threshold"], int)
    assert "EntropyBound" in gen["sampler_config"]["_cls_name"]
    assert gen["sampler_config"]["entropy_bound"] > 0
    assert 0 <= gen["t_min"] < gen["t_max"]
    assert gen["confidence_threshold"] > 0
    assert gen["max_denoising_steps"] == 48


def test_max_model_len_defaults_to_the_model_and_an_impossible_one_is_refused() -> None:
    from dgstream.workers.engine.models import TRAINED_DIRS
    from dgstream.workers.engine.types import EngineConfigError
    from dgstream.workers.engine.vllm.sizing import check_model

    demo = str(TRAINED_DIRS["demo"])
    assert engine_args(VllmSettings(model=demo))["max_model_len"] == 4096
    assert engine_args(VllmSettings(model=demo, max_model_len=1024))["max_model_len"] == 1024
    assert engine_args(VllmSettings())["max_model_len"] == 16_384  # a hub id: the reference
    with pytest.raises(EngineConfigError, match=r"engine\.vllm\.max_model_len: 16384 .* 4096"):
        check_model(VllmSettings(model=demo, max_model_len=16_384))


def test_null_generation_config_is_refused_naming_the_fields(tmp_path: Path) -> None:
    from dgstream.workers.engine.types import EngineConfigError
    from dgstream.workers.engine.vllm.sizing import check_model

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {}}))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({**DIFFUSION_GENERATION, "t_min": None, "sampler_config": None})
    )
    with pytest.raises(EngineConfigError, match=r"engine\.vllm\.model: .*sampler_config, t_min"):
        check_model(VllmSettings(model=str(tmp_path)))


def test_serve_command_gives_vllm_the_in_process_engine_args(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`serve_command` parsed by vLLM's own `vllm serve` parser = our engine args."""
    import dataclasses

    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from dgstream.workers.engine.models import TRAINED_DIRS
    from dgstream.workers.engine.vllm.args import serve_command

    # The parser's defaults build a DeviceConfig, which needs a device type (no GPU here).
    monkeypatch.setattr(current_platform, "device_type", "cpu", raising=False)
    for settings in (
        VllmSettings(model=str(TRAINED_DIRS["demo"]), enforce_eager=True, max_num_seqs=64),
        VllmSettings(load_format="dummy", enable_prefix_caching=False, skip_tokenizer_init=True),
        VllmSettings(load_format="dummy", async_scheduling=True, cudagraph_capture_sizes=None),
        VllmSettings(load_format="dummy", async_scheduling=None, cudagraph_capture_sizes=(1, 8)),
        VllmSettings(load_format="dummy", moe_backend="marlin", linear_backend="marlin"),
        VllmSettings(load_format="dummy", cudagraph_mode="FULL"),
    ):
        cmd = serve_command(settings, port=8123, name="demo")
        assert cmd[0] == "serve"
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", cmd[1], *cmd[2:]])
        validate_parsed_serve_args(ns)
        assert (ns.host, ns.port, ns.served_model_name) == ("127.0.0.1", 8123, ["demo"])
        served = AsyncEngineArgs.from_cli_args(ns)
        ours = AsyncEngineArgs(**engine_args(settings))
        for f in dataclasses.fields(AsyncEngineArgs):
            if f.name in engine_args(settings):
                assert getattr(served, f.name) == getattr(ours, f.name), f.name


# --- scheduling and label sets ----------------------------------------------------------------


@pytest.mark.parametrize("budget", [512, 4096, 5000, 16_384])
def test_graphs_are_captured_up_to_the_token_budget_by_default(budget: int) -> None:
    """vLLM's own list stops at 512 tokens or less, so full steps of prompts ran eager."""
    args = engine_args(VllmSettings(load_format="dummy", max_num_batched_tokens=budget))
    sizes = args["cudagraph_capture_sizes"]
    assert sizes == sorted(sizes) and sizes[0] == 1
    assert max(sizes) <= budget < max(sizes) * 1.25
    assert "cudagraph_capture_sizes" not in engine_args(
        VllmSettings(load_format="dummy", cudagraph_capture_sizes=None)
    )


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE", "FULL_AND_PIECEWISE", "NONE"])
def test_a_cudagraph_mode_reaches_vllms_compilation_config(mode: str) -> None:
    """Unset, vLLM picks its own mode; set, the mode is vLLM's enum of that name."""
    from vllm.config import CUDAGraphMode

    ours = AsyncEngineArgs(**engine_args(VllmSettings(load_format="dummy", cudagraph_mode=mode)))
    assert ours.compilation_config.cudagraph_mode == CUDAGraphMode[mode]
    assert "compilation_config" not in engine_args(VllmSettings(load_format="dummy"))


# (card GiB, cudagraph_mode, gpu_memory_utilization, read path, refused): FULL graphs
# need 3.0 GiB of the card outside the budget (0.9 of 23.6 leaves 2.36, 0.88 2.83; 0.87
# leaves 3.07, 0.86 3.30, the measured starts); other modes and bigger cards pass; the
# stock path's reserve lowers the utilization first, which leaves the room.
FULL_GRAPH_CASES = [
    ("23.6", "FULL", 0.9, "dgstream", True),
    ("23.6", "FULL", 0.88, "dgstream", True),
    ("23.6", "FULL", 0.87, "dgstream", False),
    ("23.6", "FULL", 0.86, "dgstream", False),
    ("23.6", "FULL_AND_PIECEWISE", 0.9, "dgstream", False),
    ("23.6", None, 0.95, "dgstream", False),
    ("47.5", "FULL", 0.9, "dgstream", False),
    ("23.6", "FULL", 0.9, "stock", False),
]


@pytest.mark.parametrize(("card", "mode", "share", "path", "refused"), FULL_GRAPH_CASES)
def test_full_graphs_that_cannot_be_captured_on_the_card_are_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
    card: str,
    mode: str | None,
    share: float,
    path: str,
    refused: bool,
) -> None:
    from dgstream.workers.engine.types import EngineConfigError
    from dgstream.workers.engine.vllm.sizing import CARD_ENV

    monkeypatch.setenv(CARD_ENV, card)
    settings = VllmSettings(
        load_format="dummy",
        cudagraph_mode=mode,
        gpu_memory_utilization=share,
        read_path=path,
        canvas_length=16,
    )
    if not refused:
        assert engine_args(settings)["gpu_memory_utilization"] <= share
        return
    with pytest.raises(EngineConfigError) as err:
        engine_args(settings)
    text = str(err.value)
    assert "cudagraph_mode 'FULL'" in text and f"gpu_memory_utilization {share}" in text
    most = float(text.split("at most ")[1].split(",")[0])
    # The advice is itself a start: 0.87 of this card.
    assert most == 0.87
    assert engine_args(settings.model_copy(update={"gpu_memory_utilization": most}))


@pytest.mark.parametrize("asked", [127, 128, 256])
@pytest.mark.parametrize("path", ["stock", "dgstream"])
def test_vllm_lowers_max_num_seqs_from_128_unless_the_read_path_keeps_it(
    served: SimpleNamespace, asked: int, path: str
) -> None:
    """vLLM 0.33 resets DiffusionGemma's max_num_seqs >= 128 to 8 silently: the first H200
    runs asked for 256 and read 8 a step. On vLLM's own read path the settings refuse what
    it would reset; the project's read path (its plugin, registered when the engine args
    were built) keeps the value."""
    from vllm.config import SchedulerConfig

    from dgstream.workers.engine import vllm_reads
    from dgstream.workers.engine.vllm.settings import MAX_NUM_SEQS

    assert (vllm_reads.status() or "").startswith("registered")
    sc = SchedulerConfig(
        max_num_seqs=asked,
        max_num_batched_tokens=8192,
        max_model_len=16_384,
        is_encoder_decoder=False,
    )
    options = vllm_reads.ReadPathOptions(enabled=path == "dgstream", max_num_seqs=asked)
    vc = VllmConfig(
        model_config=served.args.create_model_config(),  # fresh: the hook runs once per config
        scheduler_config=sc,
        diffusion_config=served.args.create_diffusion_config(),
        device_config=DeviceConfig(device="cpu"),
        additional_config=options.as_additional_config(),
    )
    kept = path == "dgstream" or asked <= MAX_NUM_SEQS
    assert vc.scheduler_config.max_num_seqs == (asked if kept else 8)
    if not kept:
        with pytest.raises(ValueError, match="max_num_seqs"):
            VllmSettings(max_num_seqs=asked, read_path="stock")
    else:
        settings = VllmSettings(max_num_seqs=asked, read_path=path)  # type: ignore[arg-type]
        assert engine_args(settings, path)["max_num_seqs"] == asked


def test_reads_share_one_label_set_and_still_pass_admission(served: SimpleNamespace) -> None:
    from dgstream.workers.engine.vllm.codec import logprob_ids

    shared = tuple(sorted({t for r in READS.values() for t in r.label_union}))
    for read in READS.values():
        ids = logprob_ids(read, shared)
        assert ids == list(shared)  # every read asks for the one set
        admit(served, read, build_sampling_params(read, served.settings, shared))
    stranger = make_read([("q", ("zz", "yy"))], seed=9)
    assert logprob_ids(stranger, shared) == list(stranger.label_union)  # not inside: its own
    assert logprob_ids(READS["joint"]) == list(READS["joint"].label_union)


def test_a_shared_label_set_leaves_every_slot_distribution_unchanged() -> None:
    """Constrained logprobs are a log-softmax over the requested ids: over a larger set they
    shift by one constant per position, which the slot's own softmax cancels."""
    from dgstream.workers.engine.vllm.codec import logprob_ids

    read = READS["joint"]
    shared = sorted({*read.label_union, *range(50, 90)})
    rng = np.random.default_rng(3)
    width = len(read.canvas_ids)
    logits = rng.normal(size=(width, VOCAB // 1024 + 100)) * 3
    ids = {t: i for i, t in enumerate(sorted({*shared, *read.label_union}))}
    cols = np.array(list(ids.values()))

    def output(asked: list[int]) -> Any:
        flat = FlatLogprobs()
        for pos in range(width):
            row = logits[pos, cols[[ids[t] for t in asked]] % logits.shape[1]]
            lp = row - np.log(np.exp(row).sum())
            # Column 0 is the argmax, as vLLM reports it (parse_output checks it).
            best = int(np.argmax(lp))
            append_logprobs_for_next_position(
                flat,
                [asked[best], *asked],
                [float(lp[best]), *lp.tolist()],
                [None] * (len(asked) + 1),
                1,
                len(asked),
            )
        out = CompletionOutput(
            index=0,
            text="",
            token_ids=list(read.canvas_ids),
            cumulative_logprob=None,
            logprobs=flat,
            finish_reason="length",
        )
        return RequestOutput("r", None, list(read.prompt_ids), None, [out], True)

    own = parse_output(read, output(logprob_ids(read)), constrained=True)
    wide = parse_output(read, output(logprob_ids(read, tuple(shared))), constrained=True)
    for a, b in zip(own.slots, wide.slots, strict=True):
        np.testing.assert_allclose(a.probs, b.probs, rtol=1e-9, atol=1e-12)


class _CoreClient:
    """The engine-core client as vLLM's output handler and shutdown use it: outputs that
    never come, and a shutdown that takes the core away (its socket then says the engine
    is dead) and, as the real one does while its process ends, takes a while."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.outputs: asyncio.Future[Any] = loop.create_future()
        self.handler_ended = threading.Event()

    async def get_output_async(self) -> Any:
        return await self.outputs

    def _die(self) -> None:
        if not self.outputs.done():
            self.outputs.set_exception(EngineDeadError())

    def shutdown(self, timeout: float | None = None) -> None:
        if self.loop.is_closed():
            return  # AsyncLLM.__del__ after the test
        self.loop.call_soon_threadsafe(self._die)
        self.handler_ended.wait(5)  # the process's end: the handler runs meanwhile


class _Outputs:
    def __init__(self, unfinished: bool) -> None:
        self.unfinished = unfinished
        self.errors: list[BaseException] = []

    def has_unfinished_requests(self) -> bool:
        return self.unfinished

    def propagate_error(self, exc: BaseException) -> None:
        self.errors.append(exc)  # how vLLM fails the reads in flight


def _close_real_async_llm(unfinished: bool) -> tuple[list[str], _Outputs]:
    """`VllmEngine.close` over vLLM's own AsyncLLM.shutdown and output handler (the
    engine-core process stood in for): the ERROR lines vLLM logged, and its outputs."""
    from vllm.v1.engine import async_llm

    lines: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                lines.append(record.getMessage())

    catch = Catch()
    async_llm.logger.addHandler(catch)
    outputs = _Outputs(unfinished)

    async def scenario() -> None:
        llm = object.__new__(async_llm.AsyncLLM)  # no engine-core process on a CPU
        core = _CoreClient(asyncio.get_running_loop())
        llm.engine_core, llm.output_processor, llm.output_handler = core, outputs, None
        llm.log_stats, llm.logger_manager = False, None
        llm.renderer = SimpleNamespace(
            mm_processor_cache=None, shutdown=lambda: None, stat_mm_cache=lambda: None
        )
        llm._run_output_handler()
        llm.output_handler.add_done_callback(lambda _: core.handler_ended.set())
        await asyncio.sleep(0)  # the handler waits on the core, as after a first read
        engine = VllmEngine(VllmSettings(model="unused"))
        engine._engine = llm
        await engine.close()
        assert llm.output_handler.done()  # cancelled, or ended on the dead engine

    try:
        asyncio.run(scenario())
    finally:
        async_llm.logger.removeHandler(catch)
    return lines, outputs


def test_a_clean_close_logs_no_dead_engine_error() -> None:
    lines, outputs = _close_real_async_llm(unfinished=False)
    assert not [line for line in lines if "output_handler failed" in line], lines
    assert outputs.errors == []


def test_a_close_with_reads_in_flight_still_fails_them() -> None:
    # vLLM's order is kept: its output handler hands the dead engine to the reads in
    # flight (and says so at ERROR), where cancelling it first would leave them waiting.
    lines, outputs = _close_real_async_llm(unfinished=True)
    assert [type(e) for e in outputs.errors] == [EngineDeadError]
    assert any("output_handler failed" in line for line in lines)

"""The peer of dgstream's vLLM read path, as a harness: `vllm serve`'s own label reads
(`/v1/decisions`, or `/v1/systemone`) on the full-size DiffusionGemma shape with dummy
weights, driven over HTTP by an async client at a fixed concurrency.
`bench/peer_decisions.py` runs it on the GPU machine (its docstring says what a row is);
`tests/bench/test_peer_decisions.py` checks the parts a CPU can: the bodies against vLLM's
request models, the tokenizer and the reads through vLLM's own decision serving code, the
client against a stub, the server wrapper, the docs section.

The tokenizer: there is no Gemma tokenizer offline, so the project's byte-level BPE
(`workers.engine.tokenizer`) is trained with DiffusionGemma's turn and channel markers and
vLLM's prompt text, so that every label vLLM's `DiffusionGemmaCanvasStrategy` asks for is
one token, joint reads are on, and vLLM's question text costs about a token a word (as in
a large vocabulary). It is written into the model directory next to config.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from bench.harness.figures import figure

# DiffusionGemma's chat markers (Gemma 4's): vLLM's DiffusionGemmaCanvasStrategy ends every
# canvas with "<turn|>" and opens an empty "<|channel>thought\n<channel|>" after the prompt;
# it refuses a tokenizer where either marker is more than those tokens.
TURNS = ("<|turn>", "<turn|>", "<|channel>", "<channel|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
SERVED_NAME = "diffusiongemma-peer"
ROUTES = {"decisions": "/v1/decisions", "systemone": "/v1/systemone"}

# The in-process rows' three slots (bench.engine_gpu.make_reads): yes/no, A-D, 1-5.
QUESTIONS: tuple[dict[str, Any], ...] = (
    {"type": "predicate", "name": "toxic", "instructions": "Is the message toxic?"},
    {
        "type": "choice",
        "name": "category",
        "instructions": "What is the message about?",
        "choices": [{"value": v} for v in "ABCD"],
    },
    {
        "type": "score",
        "name": "severity",
        "instructions": "How severe is it?",
        "levels": [{"label": v} for v in "12345"],
    },
)
SYSTEMONE_QUESTIONS: dict[str, dict[str, Any]] = {
    "toxic": {"type": "noul", "instructions": "Is the message toxic?"},
    "category": {
        "type": "choice",
        "instructions": "What is the message about?",
        "criteria": dict.fromkeys("ABCD"),
    },
    "severity": {"type": "score", "instructions": "How severe is it?", "criteria": list("12345")},
}
BATCHES = "1,32,256"
# vLLM's training text repeats this often in the tokenizer's corpus: as often as a word of
# the demo corpus appears (6,000 lines of 4-18 words from ~700 words: ~100 times).
PROMPT_TEXT_REPEATS = 40
# Softmax outputs over a question's labels: float64 sums, far inside this.
PROBABILITY_SUM_TOLERANCE = 1e-3


# --- the model directory -------------------------------------------------------------------


@cache
def _bare_strategy() -> Any:
    """vLLM's DiffusionGemma read strategy without an engine: its prompt text methods read
    only class attributes, so the text here is vLLM's own."""
    from vllm.entrypoints.openai.decisions.strategies import DiffusionGemmaCanvasStrategy

    return DiffusionGemmaCanvasStrategy.__new__(DiffusionGemmaCanvasStrategy)


@cache
def vllm_questions(endpoint: str) -> tuple[Any, ...]:
    """The questions as vLLM's server turns them into reads (`Question`s)."""
    if endpoint == "decisions":
        from vllm.entrypoints.openai.decisions.adapters import make_read_question
        from vllm.entrypoints.openai.decisions.protocol import DecisionRequest

        request = DecisionRequest.model_validate(request_body("decisions", "x", joint=True))
        return tuple(make_read_question(i, q) for i, q in enumerate(request.questions))
    from vllm.entrypoints.generate.structured_decisions.protocol import (
        StructuredDecisionRequest,
    )
    from vllm.entrypoints.generate.structured_decisions.serving import parse_questions

    body = request_body("systemone", "x", joint=True)
    structured = StructuredDecisionRequest.model_validate(body)
    return tuple(parse_questions(structured, _bare_strategy().limits()))


def user_turns(endpoint: str, state: str, *, joint: bool) -> list[str]:
    """The user turn of each engine read of one request, as vLLM writes it."""
    strategy, questions = _bare_strategy(), list(vllm_questions(endpoint))
    if joint:
        return [strategy._joint_content(state, questions, 1)]
    return [strategy._content(state, q) for q in questions]


def tokenizer_lines() -> list[str]:
    """Training text for the peer's tokenizer: vLLM's question prompts, and the answer lines
    of every label of every question type (`k: label`, as joint reads check them)."""
    from vllm.entrypoints.openai.decisions.question_types import QUESTION_TYPES

    prompts = [t for e in ROUTES for j in (True, False) for t in user_turns(e, "", joint=j)]
    labels = dict.fromkeys(label for qt in QUESTION_TYPES.values() for label in qt.label_set)
    answers = [f"{k}: {label}" for k in range(1, 10) for label in labels]
    # The thought block's word, between its two markers.
    return [*prompts, *answers, "thought"] * PROMPT_TEXT_REPEATS


def write_tokenizer(path: Path) -> Path:
    """A model directory (config.json) with a tokenizer for vLLM's decision routes."""
    from dgstream.workers.engine.tokenizer import save_pretrained_tokenizer

    save_pretrained_tokenizer(
        path, turns=TURNS, chat_template=CHAT_TEMPLATE, extra_lines=tokenizer_lines()
    )
    return path


# --- requests --------------------------------------------------------------------------------


def request_body(endpoint: str, state: str, *, joint: bool) -> dict[str, Any]:
    """One request: one state and the three questions."""
    if endpoint == "decisions":
        return {"model": SERVED_NAME, "input": state, "questions": list(QUESTIONS), "joint": joint}
    return {"model": SERVED_NAME, "state": state, "questions": SYSTEMONE_QUESTIONS, "joint": joint}


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class States:
    """States whose prompts are exactly `prompt_tokens` long, built from words that are one
    token with or without a leading space (so a state of n words is n tokens)."""

    def __init__(
        self, model_dir: Path, endpoint: str, prompt_tokens: int, unique_tokens: int
    ) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.endpoint = endpoint
        self.words = one_token_words(self.tokenizer)
        self.thought = self.tokenizer.encode(_bare_strategy().THOUGHT, add_special_tokens=False)
        self.prompt_tokens = prompt_tokens
        # Sized on the joint read's prompt, in either mode: the same states for both.
        self.length = prompt_tokens - (len(self.prompt_ids(self.words[0])) - 1)
        if not 0 < unique_tokens < self.length:
            raise SystemExit(
                f"--prompt {prompt_tokens}: the questions leave {self.length} state tokens, "
                f"and a shared state's unique part is {unique_tokens}"
            )
        self.unique_tokens = unique_tokens
        rng = random.Random(20261202)
        self.common = self._words(rng, self.length - unique_tokens)

    def prompt_ids(self, state: str) -> list[int]:
        """The joint read's prompt as the engine gets it (the thought block included)."""
        content = user_turns(self.endpoint, state, joint=True)[0]
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return [*ids, *self.thought]

    def _words(self, rng: random.Random, n: int) -> list[str]:
        return [rng.choice(self.words) for _ in range(n)]

    def make(self, kind: str, rng: random.Random) -> str:
        if kind == "unique":
            return " ".join(self._words(rng, self.length))
        return " ".join([*self.common, *self._words(rng, self.unique_tokens)])

    def checked(self, kind: str, rng: random.Random) -> str:
        state = self.make(kind, rng)
        n = len(self.prompt_ids(state))
        if n != self.prompt_tokens:
            raise AssertionError(f"a {kind} prompt has {n} tokens, not {self.prompt_tokens}")
        return state

    def shared_prefix_tokens(self) -> int:
        rng = random.Random(1)
        a, b = (self.prompt_ids(self.make("shared", rng)) for _ in range(2))
        return common_prefix_len(a, b)


def one_token_words(tokenizer: Any) -> list[str]:
    """Lower-case words of the vocabulary that are one token after a space and alone."""
    out = []
    for token in sorted(tokenizer.get_vocab()):
        word = token[1:]
        if not (token.startswith("Ġ") and len(word) >= 3 and word.isascii() and word.isalpha()):
            continue
        if not word.islower():
            continue
        if all(len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in (word, " " + word)):
            out.append(word)
    if len(out) < 50:
        raise AssertionError(f"only {len(out)} one-token words in the tokenizer")
    return out


# --- responses -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    seconds: float
    status: int
    body: bytes


@dataclass(frozen=True)
class Checked:
    error: str | None
    input_tokens: int | None = None
    cached_tokens: int | None = None


def _sums_to_one(values: Iterable[float]) -> bool:
    return abs(math.fsum(values) - 1.0) <= PROBABILITY_SUM_TOLERANCE


def _check_decision_answer(want: dict[str, Any], got: Any) -> str | None:
    if got.type != want["type"] or got.name != want["name"]:
        return f"answer {got.name!r} ({got.type}) where {want['name']!r} ({want['type']}) was asked"
    if got.type == "predicate":
        return None if 0.0 <= got.probability <= 1.0 else f"{got.name}: probability out of [0, 1]"
    options = want["choices"] if got.type == "choice" else want["levels"]
    probs = [p.probability for p in got.probabilities]
    if len(probs) != len(options):
        return f"{got.name}: {len(probs)} probabilities for {len(options)} options"
    return None if _sums_to_one(probs) else f"{got.name}: probabilities sum to {math.fsum(probs)}"


def check_decisions(raw: bytes) -> Checked:
    from vllm.entrypoints.openai.decisions.protocol import DecisionResponse

    response = DecisionResponse.model_validate_json(raw)
    if len(response.answers) != len(QUESTIONS):
        return Checked(f"{len(response.answers)} answers to {len(QUESTIONS)} questions")
    for want, got in zip(QUESTIONS, response.answers, strict=True):
        if (error := _check_decision_answer(want, got)) is not None:
            return Checked(error)
    usage = response.usage
    return Checked(None, usage.input_tokens, usage.input_tokens_details.cached_tokens)


def check_systemone(raw: bytes) -> Checked:
    from vllm.entrypoints.generate.structured_decisions.protocol import (
        StructuredDecisionResponse,
    )

    response = StructuredDecisionResponse.model_validate_json(raw)
    if list(response.answers) != list(SYSTEMONE_QUESTIONS):
        return Checked(f"answers {list(response.answers)} to {list(SYSTEMONE_QUESTIONS)}")
    for qid, answer in response.answers.items():
        spec = SYSTEMONE_QUESTIONS[qid]
        probs = answer.get("probabilities") or {}
        options = 2 if spec["type"] == "noul" else len(spec["criteria"])
        if answer.get("type") != spec["type"] or len(probs) != options:
            return Checked(f"{qid}: {answer.get('type')} with {len(probs)} probabilities")
        if not _sums_to_one(probs.values()):
            return Checked(f"{qid}: probabilities sum to {math.fsum(probs.values())}")
    return Checked(None, response.usage.input_tokens)


def check(endpoint: str, outcome: Outcome) -> Checked:
    """Whether one response is a valid answer to the three questions."""
    if outcome.status != 200:
        return Checked(f"HTTP {outcome.status}: {outcome.body[:300].decode(errors='replace')}")
    try:
        return (check_decisions if endpoint == "decisions" else check_systemone)(outcome.body)
    except ValueError as exc:  # pydantic's ValidationError and JSON errors
        return Checked(f"unparsable response: {str(exc)[:300]}")


# --- the client ------------------------------------------------------------------------------


async def drive(
    session: Any, url: str, bodies: Sequence[bytes], concurrency: int, deadline: float
) -> tuple[list[Outcome], float]:
    """Post `bodies` with `concurrency` requests in flight, until all are answered or the
    deadline (perf_counter) passes; (outcomes in completion order, seconds)."""
    import aiohttp

    pending = iter(bodies)
    outcomes: list[Outcome] = []
    headers = {"Content-Type": "application/json"}

    async def worker() -> None:
        for body in pending:
            if time.perf_counter() > deadline:
                return
            t = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    raw, status = await resp.read(), resp.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                raw, status = f"{type(exc).__name__}: {exc}".encode(), -1
            outcomes.append(Outcome(time.perf_counter() - t, status, raw))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes, time.perf_counter() - t0


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(
    kind: str,
    concurrency: int,
    planned: int,
    outcomes: Sequence[Outcome],
    seconds: float,
    *,
    endpoint: str,
    joint: bool,
) -> dict[str, Any]:
    """One row, shaped as bench/engine_vllm.py's (variant, batch, reads_per_s, p50/p99)."""
    checked = [check(endpoint, o) for o in outcomes]
    ok = [o.seconds for o, c in zip(outcomes, checked, strict=True) if c.error is None]
    errors = [c.error for c in checked if c.error is not None]
    cached = [c.cached_tokens for c in checked if c.cached_tokens is not None]
    row: dict[str, Any] = {
        "variant": f"peer/{kind}",
        "batch": concurrency,
        "endpoint": ROUTES[endpoint],
        "mode": "joint" if joint else "per-question",
        "requests": len(outcomes),
        "planned": planned,
        "ok": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "seconds": seconds,
        # A request is one state and its questions: the in-process rows' read.
        "reads_per_s": len(ok) / seconds if seconds > 0 else 0.0,
        "questions_per_s": len(ok) * len(QUESTIONS) / seconds if seconds > 0 else 0.0,
        "p50_ms": statistics.median(ok) * 1e3 if ok else None,
        "p99_ms": percentile(ok, 0.99) * 1e3 if ok else None,
        "input_tokens": sorted({c.input_tokens for c in checked if c.input_tokens is not None}),
        "cached_tokens_mean": statistics.fmean(cached) if cached else None,
    }
    return row


def print_row(row: dict[str, Any]) -> None:
    if row.get("skipped"):
        print(f"{row['variant']:12s} batch {row['batch']:4d}: skipped ({row['skipped']})")
        return
    p50, p99 = row["p50_ms"] or float("nan"), row["p99_ms"] or float("nan")
    print(
        f"{row['variant']:12s} batch {row['batch']:4d}: {row['questions_per_s']:8.1f} "
        f"questions/s  p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  {row['ok']}/{row['requests']} ok"
        + (f"  errors: {row['error_samples']}" if row["errors"] else ""),
        flush=True,
    )


class PeerFailed(RuntimeError):
    """The peer answered no request of a warm-up: the rows would measure nothing."""


@dataclass(frozen=True)
class Plan:
    url: str
    endpoint: str
    joint: bool
    batches: tuple[int, ...]
    row_seconds: float
    end: float  # perf_counter: no row starts past this
    request_timeout_s: float


def repeats(concurrency: int) -> int:
    """Rounds of `concurrency` requests per row: bench/engine_vllm.py's repeats per batch."""
    return max(3, min(64, 256 // concurrency))


def client_session(connections: int, timeout_s: float) -> Any:
    """The client's session: enough connections for the largest concurrency (aiohttp's
    default is 100), so `drive`'s workers alone set how many requests are in flight."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


async def measure(
    plan: Plan, states: States, on_row: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    async with client_session(max(plan.batches), plan.request_timeout_s) as session:
        for c in plan.batches:
            for kind in ("unique", "shared"):
                row = await _row(session, plan, states, kind, c, rng)
                rows.append(row)
                print_row(row)
                on_row(row)
    return rows


def _bodies(states: States, plan: Plan, kind: str, n: int, rng: random.Random) -> list[bytes]:
    return [
        json.dumps(
            request_body(plan.endpoint, states.checked(kind, rng), joint=plan.joint)
        ).encode()
        for _ in range(n)
    ]


async def _row(
    session: Any, plan: Plan, states: States, kind: str, c: int, rng: random.Random
) -> dict[str, Any]:
    left = plan.end - time.perf_counter()
    if left < 5:
        return {"variant": f"peer/{kind}", "batch": c, "skipped": "out of time"}
    # Built before the clock starts: the client's own work stays out of the rows.
    warm = _bodies(states, plan, kind, c, rng)
    bodies = _bodies(states, plan, kind, c * repeats(c), rng)
    # The warm-up: a first round at this concurrency (and, shared: the prefix into the cache).
    outcomes, _ = await drive(
        session, plan.url, warm, c, time.perf_counter() + min(left / 3, plan.row_seconds)
    )
    if outcomes and all(check(plan.endpoint, o).error for o in outcomes):
        raise PeerFailed(f"no request of the warm-up answered: {check(plan.endpoint, outcomes[0])}")
    deadline = time.perf_counter() + min(plan.row_seconds, plan.end - time.perf_counter())
    outcomes, seconds = await drive(session, plan.url, bodies, c, deadline)
    return summarize(
        kind, c, len(bodies), outcomes, seconds, endpoint=plan.endpoint, joint=plan.joint
    )


# --- the server ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def server_env() -> dict[str, str]:
    """This process's environment (the emulated card's variables with it), with no vLLM
    plugin: an empty VLLM_PLUGINS lets none of the discovered ones load."""
    return {**os.environ, "VLLM_PLUGINS": ""}


# uvicorn's access log: `INFO:     127.0.0.1:50412 - "POST /v1/decisions HTTP/1.1" 200 OK`.
ACCESS_LINE = re.compile(r'"(GET|POST) /\S* HTTP/1\.[01]" \d{3}')


class PeerServer:
    """One `vllm serve` on loopback, in its own process group (its engine core with it)."""

    def __init__(self, command: Sequence[str], port: int, log_path: Path) -> None:
        self.command = list(command)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float) -> float:
        """Start it and wait for /health; the seconds that took."""
        t0 = time.perf_counter()
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                self.command,
                env=server_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        while time.perf_counter() - t0 < timeout_s:
            if self._proc.poll() is not None:
                raise PeerFailed(f"the server exited ({self._proc.returncode}):\n{self.tail(40)}")
            if self.healthy():
                return time.perf_counter() - t0
            time.sleep(1.0)
        raise PeerFailed(f"no /health within {timeout_s:.0f} s:\n{self.tail(40)}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, grace_s: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def tail(self, lines: int = 80) -> str:
        """The log's last lines, less uvicorn's access lines (one per request)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        kept = [line for line in text.splitlines() if not ACCESS_LINE.search(line)]
        return "\n".join(kept[-lines:])


def peer_settings(args: argparse.Namespace, model: Path) -> Any:
    """The in-process benchmark's engine settings (bench/engine_vllm.py), but the tokenizer,
    on vLLM's own read path where the settings choose one."""
    from dgstream.workers.engine.vllm.settings import VllmSettings

    stock = {"read_path": "stock"} if "read_path" in VllmSettings.model_fields else {}
    return VllmSettings(
        **stock,
        model=str(model),
        load_format="dummy",
        # The decision routes render chat prompts: the server needs its tokenizer.
        skip_tokenizer_init=False,
        max_model_len=args.max_model_len,
        canvas_length=args.canvas,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.eager,
    )


def serve_argv(settings: Any, port: int) -> list[str]:
    from dgstream.workers.engine.vllm.args import serve_command

    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        *serve_command(settings, port=port, name=SERVED_NAME),
    ]


def card_reports() -> list[dict[str, Any]]:
    """The card emulation's per-process peaks (card-<pid>.json in DGSTREAM_CARD_REPORT)."""
    folder = os.environ.get("DGSTREAM_CARD_REPORT")
    reports = []
    for path in sorted(Path(folder).glob("card-*.json")) if folder else []:
        with contextlib.suppress(OSError, ValueError):
            reports.append(json.loads(path.read_text()))
    return sorted(reports, key=lambda r: -float(r.get("peak_reserved_gib") or 0))


def _flag(argv: Sequence[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _from_log(text: str) -> dict[str, Any]:
    loaded = re.findall(r"Model loading took ([0-9.]+) GiB", text)
    kv = re.findall(r"GPU KV cache size: ([0-9,]+) tokens", text)
    return {
        "weights_gib": float(loaded[-1]) if loaded else None,
        "kv_cache_tokens": int(kv[-1].replace(",", "")) if kv else None,
    }


def run(
    args: argparse.Namespace,
    model_dir: Callable[[str, Path], Path],
    peak_memory: Callable[[], Any] = lambda: None,
) -> dict[str, Any]:
    """The whole run: `model_dir(quant, root)` gives the model directory (config.json,
    generation_config.json); `peak_memory()` an NVML sampler (bench.engine_vllm.PeakMemory)
    or None."""
    from importlib.metadata import version

    t_start = time.perf_counter()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="dg-peer-"))
    model = write_tokenizer(model_dir(args.quant, root))
    states = States(model, args.endpoint, args.prompt, args.prompt - args.shared)
    settings = peer_settings(args, model)
    port = free_port()
    out = Path(args.out) if args.out else root / "peer.json"
    server = PeerServer(serve_argv(settings, port), port, out.with_suffix(".server.log"))
    info: dict[str, Any] = {
        "vllm": version("vllm"),
        "endpoint": ROUTES[args.endpoint],
        "mode": "joint" if args.joint else "per-question",
        "quant": args.quant,
        "prompt_tokens": args.prompt,
        "state_tokens": states.length,
        "shared_prefix_tokens": states.shared_prefix_tokens(),
        "tokenizer_vocab": len(states.tokenizer),
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        # What the server was given (the settings may reserve vLLM's unprofiled step).
        "served_gpu_memory_utilization": _flag(server.command, "--gpu-memory-utilization"),
        "max_num_seqs": _flag(server.command, "--max-num-seqs"),
        "card_env": {k: v for k, v in os.environ.items() if k.startswith("DGSTREAM_CARD")},
        "pythonpath": os.environ.get("PYTHONPATH", ""),
        "command": server.command,
        "settings": settings.model_dump(),
    }
    result: dict[str, Any] = {"info": info, "rows": [], "args": vars(args), "complete": False}

    def save(row: dict[str, Any] | None = None) -> None:
        if row is not None:
            result["rows"].append(row)
        out.write_text(json.dumps(result, indent=2, default=str))

    peak = peak_memory()
    try:
        info["start_s"] = server.start(args.start_timeout_s)
        if peak is not None:
            info.update(gpu=peak.name, start_peak_gib=peak.reset() / 2**30)
        print(f"# the peer is up after {info['start_s']:.0f} s: {server.url}", flush=True)
        save()
        plan = Plan(
            url=server.url + ROUTES[args.endpoint],
            endpoint=args.endpoint,
            joint=args.joint,
            batches=tuple(int(b) for b in args.batches.split(",")),
            row_seconds=args.row_seconds,
            end=t_start + args.time_budget_s,
            request_timeout_s=args.request_timeout_s,
        )
        asyncio.run(measure(plan, states, save))
        result["complete"] = True
    except PeerFailed as exc:
        info["failure"] = str(exc)
        print(f"# the peer failed: {exc}", flush=True)
    finally:
        server.stop()
        log = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""
        info.update(_from_log(log), server_log_tail=server.tail(80), card=card_reports())
        if peak is not None:
            info.update(peak_gib=peak.close() / 2**30, peak_processes_gib=peak.processes)
        save()
    return result


# --- docs/benchmarks.md ----------------------------------------------------------------------

# docs/benchmarks.md's section of the first side-by-side session (2026-12-02); a later
# session renders into its own (`--section`), so that its table never replaces this one.
SECTION = "peer-decisions"


def reproduce(
    render: str | Path, beside: Sequence[tuple[str, Path]], section: str = SECTION, date: str = ""
) -> str:
    """The commands that make a rendered section: the peer's run, then this render."""
    line = f"python bench/peer_decisions.py --render {render}"
    line += "".join(f' --beside "{name}={path}"' for name, path in beside)
    if section != SECTION:
        line += f" --section {section}"
    if date:
        line += f" --date {date}"
    return (
        "bash bench/gpu/peer_session.sh --max-model-len 4096   # on the GPU machine\n"
        f"{line} --write   # here"
    )


COMMAND = reproduce(
    "docs/data/card24/peer_decisions.json",
    [
        ("read path (dgstream defaults)", Path("docs/data/card24/card_dgstream.json")),
        ("stock in-process", Path("docs/data/card24/card_stock.json")),
    ],
)


def _card(info: dict[str, Any]) -> str:
    gib = (info.get("card_env") or {}).get("DGSTREAM_CARD_GIB")
    return f"the emulated {gib} GiB card" if gib else "the whole GPU (no card emulated)"


def _questions_per_s(row: dict[str, Any]) -> float:
    """Questions/s of a peer row, or of an in-process row (3 questions a read)."""
    if "questions_per_s" in row:
        return float(row["questions_per_s"])
    return float(row["reads_per_s"]) * len(QUESTIONS)


def _cell(row: dict[str, Any] | None) -> str:
    if row is None or row.get("skipped") or not row.get("p50_ms"):
        return "-"
    return f"{_questions_per_s(row):.0f} ({row['p50_ms']:.0f} / {row['p99_ms']:.0f})"


def _ratio(other: dict[str, Any] | None, peer: dict[str, Any], key: str = "") -> str:
    """`other` over the peer; marked as figure `key` (other pages quote it) when given."""
    if other is None or "-" in (_cell(other), _cell(peer)):
        return "-"
    value = f"{_questions_per_s(other) / _questions_per_s(peer):.2f}"
    return (figure(key, value) if key else value) + "x"


def _figure_key(name: str, kind: str, batch: int) -> str:
    """A ratio cell's figure: "read path (defaults)", unique, 256 ->
    read_path_defaults_unique_b256_vs_peer."""
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return f"{slug}_{kind}_b{batch}_vs_peer"


def _by_kind(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Rows by kind and batch. An in-process run's rows of more than one batch in flight
    are left out: the peer's client holds `batch` requests at the server, one batch."""
    return {
        (r["variant"].split("/")[-1], r["batch"]): r
        for r in rows
        if r.get("in_flight") in (None, 1)
    }


def render(
    path: Path,
    beside: Sequence[tuple[str, Path]] = (),
    section: str = SECTION,
    date: str = "",
) -> str:
    """The peer's rows beside in-process runs' (`beside`), each as a ratio to the peer."""
    body = json.loads(path.read_text())
    info, peer = body["info"], _by_kind(body["rows"])
    others = [(name, _by_kind(json.loads(p.read_text())["rows"])) for name, p in beside]
    lines = [
        "## The peer: `vllm serve`'s own label reads, same card, same reads"
        + (f" ({date}, {info.get('gpu', 'GPU not recorded')})" if date else ""),
        "",
        f"vLLM {info['vllm']} `vllm serve` ({info['endpoint']}, {info['mode']} reads, no "
        f"plugin), the full-size DiffusionGemma shape in {info['quant']} with dummy weights, "
        f"the in-process engine's settings (`serve_command`): gpu_memory_utilization "
        f"{info.get('served_gpu_memory_utilization') or info['gpu_memory_utilization']}, "
        f"max_num_seqs {info.get('max_num_seqs')}, {_card(info)}; "
        f"KV cache {info.get('kv_cache_tokens')} tokens, server start "
        f"{info.get('start_s', float('nan')):.0f} s. Each request is one state and the 3 "
        f"questions; prompts of {info['prompt_tokens']} tokens; `shared`: states sharing "
        f"their first {info['shared_prefix_tokens']} prompt tokens (the questions follow the "
        "state in vLLM's prompt). An aiohttp client holds `batch` requests in flight. "
        "Questions/s (p50 / p99 ms per request; in-process: per read).",
        "",
    ]
    head = "| batch | kind | peer |" + "".join(f" {n} | {n} / peer |" for n, _ in others)
    lines += [head + " peer errors |", "|---:|---|---:|" + "---:|---:|" * len(others) + "---:|"]
    for b, kind in sorted({(k[1], k[0]) for k in peer}, key=lambda x: (x[0], x[1] != "unique")):
        row = peer[(kind, b)]
        cells = [str(b), kind, _cell(row)]
        for name, rows in others:
            other = rows.get((kind, b))
            cells += [_cell(other), _ratio(other, row, _figure_key(name, kind, b))]
        cells.append(str(row.get("errors", "-")))
        lines.append("| " + " | ".join(cells) + " |")
    command = reproduce(path, beside, section, date)
    lines += ["", "Reproduce:", "", "```", command, "```"]
    return "\n".join(lines)


def _beside(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--beside wants LABEL=PATH, not {spec!r}")
    return name, Path(path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from dgstream.workers.engine.vllm.settings import VllmSettings

    ap = argparse.ArgumentParser(description="vllm serve's own label reads, as dgstream's peer")
    ap.add_argument("--out", default="", help="JSON of the run (rewritten after every row)")
    ap.add_argument("--render", default="", help="print the docs section of this JSON")
    ap.add_argument("--beside", action="append", type=_beside, default=[], help="LABEL=PATH")
    ap.add_argument("--write", action="store_true", help="with --render: into benchmarks.md")
    ap.add_argument("--section", default=SECTION, help="with --write: the section to write")
    ap.add_argument("--date", default="", help="with --render: the device session's date")
    ap.add_argument("--endpoint", choices=sorted(ROUTES), default="decisions")
    ap.add_argument("--joint", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--quant", choices=["bf16", "nvfp4"], default="nvfp4")
    ap.add_argument(
        "--gpu-memory-utilization", type=float, default=VllmSettings().gpu_memory_utilization
    )
    ap.add_argument("--max-model-len", type=int, default=16_384)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (faster start)")
    ap.add_argument("--batches", default=BATCHES, help="concurrencies, comma-separated")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--canvas", type=int, default=16)
    ap.add_argument("--shared", type=int, default=224, help="as bench/engine_gpu.py's")
    ap.add_argument("--row-seconds", type=float, default=35.0, help="cap of one row")
    ap.add_argument("--time-budget-s", type=float, default=500.0, help="no row starts after")
    ap.add_argument("--start-timeout-s", type=float, default=420.0)
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--workdir", default="", help="model directory root (default: a temp dir)")
    return ap.parse_args(argv)

"""The remote engine: the same reads against an external `vllm serve`, over its OpenAI
completions API (stdlib HTTP in worker threads). `args.serve_command` starts such a server
with the in-process engine's settings."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from dgstream.workers.engine.types import EngineInfo, FatalEngineError, Read, ReadResult
from dgstream.workers.engine.vllm.codec import build_completion_body, parse_completion, settle
from dgstream.workers.engine.vllm.settings import VllmRemoteSettings

__all__ = ["VllmRemoteEngine"]


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class VllmRemoteEngine:
    """The same reads against an external `vllm serve` (stdlib HTTP in worker threads)."""

    def __init__(
        self, settings: VllmRemoteSettings | None = None, *, shared_labels: Sequence[int] = ()
    ) -> None:
        self.settings = settings or VllmRemoteSettings()
        self.shared_labels = frozenset(shared_labels)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            backend="vllm-remote",
            model=self.settings.model,
            canvas_length=self.settings.canvas_length,
            vocab_size=self.settings.vocab_size,
            device="remote",
        )

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        url = self.settings.base_url.rstrip("/") + "/v1/completions"
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = os.environ.get(self.settings.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=self.settings.timeout_s) as resp:
                parsed: dict[str, Any] = json.loads(resp.read())
                return parsed
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                message = json.loads(raw)["error"]["message"]
            except Exception:
                message = raw[:500].decode(errors="replace")
            raise _HttpError(exc.code, str(message)) from None

    async def _read_one(self, read: Read) -> ReadResult:
        started = time.perf_counter()
        body = await asyncio.to_thread(
            self._post, build_completion_body(read, self.settings, self.shared_labels)
        )
        result = parse_completion(read, body, constrained=self.settings.diffusion_constrained)
        return ReadResult(slots=result.slots, timings={"engine_s": time.perf_counter() - started})

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
        outcomes = await asyncio.gather(*(self._read_one(r) for r in reads), return_exceptions=True)
        return settle(outcomes, _classify_http_error)

    async def close(self) -> None:
        return None


# A server that is down, restarting or overloaded: 429 Too Many Requests, 502/503/504 from
# it or a proxy in front of it. Other 5xx are errors of one request (retried, then split).
_UNAVAILABLE_STATUS = (429, 502, 503, 504)


def _classify_http_error(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, _HttpError):
        if exc.status in (400, 422):  # vLLM's VLLMValidationError -> 400 Bad Request
            return "rejected", str(exc)
        if exc.status in (401, 403, 404):  # wrong key, URL or model: fix the config
            return "fatal", str(exc)
        if exc.status in _UNAVAILABLE_STATUS:
            return "unavailable", str(exc)
        return "retry", str(exc)
    if isinstance(exc, FatalEngineError):
        return "fatal", str(exc)
    # Connection refused or reset, DNS, a timeout: the server is out of reach
    # (urllib.error.URLError wraps them; TimeoutError and ConnectionError are OSErrors).
    if isinstance(exc, urllib.error.URLError | OSError):
        return "unavailable", f"{type(exc).__name__}: {exc}"
    return "retry", f"{type(exc).__name__}: {exc}"

"""The in-process engine: one vLLM `AsyncLLM` on the actor's GPU, built on first use, its
reads sent as requests of `codec` with the arguments of `args`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

from dgstream.workers.engine.types import (
    EngineInfo,
    FatalEngineError,
    Read,
    ReadRejected,
    ReadResult,
    RecoverableEngineError,
)
from dgstream.workers.engine.vllm.args import apply_cache_dir, engine_args, resolve_read_path
from dgstream.workers.engine.vllm.codec import (
    build_prompt,
    build_sampling_params,
    parse_output,
    settle,
)
from dgstream.workers.engine.vllm.images import ImageLayout
from dgstream.workers.engine.vllm.settings import VllmSettings

__all__ = ["VllmEngine"]

log = logging.getLogger(__name__)


def _request_id(read: Read) -> str:
    return f"dg-{read.tag or 'read'}-{uuid.uuid4().hex[:12]}"


class VllmEngine:
    """The in-process engine: one vLLM `AsyncLLM` on the actor's GPU, built on first use."""

    def __init__(
        self, settings: VllmSettings | None = None, *, shared_labels: Sequence[int] = ()
    ) -> None:
        """`shared_labels`: the token ids of every label the templates write (see
        `logprob_ids`); empty = each read asks for its own labels."""
        self.settings = settings or VllmSettings()
        self.shared_labels = frozenset(shared_labels)
        self._engine: Any = None
        self._lock = asyncio.Lock()
        self._vocab_size = self.settings.vocab_size
        # The read path the running engine uses ("dgstream" or "stock"); None until start.
        self.read_path: str | None = None
        # This engine's reads opt out of one-step reads (a sibling's, for side-by-side runs).
        self.two_step = False
        # Where a read's images go and how they are sized (`images_per_request` > 0 and a
        # model with a vision tower); None until start, and for text-only engines.
        self.image_layout: ImageLayout | None = None

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            backend="vllm",
            model=self.settings.model,
            canvas_length=self.settings.canvas_length,
            vocab_size=self._vocab_size,
            device="cuda",
            # Before start: what the settings ask; after: whether the model has a tower.
            reads_images=self.settings.reads_images
            and (self._engine is None or self.image_layout is not None),
            # What vLLM's processor expands each image token to (known once started).
            image_tokens=0 if self.image_layout is None else self.image_layout.tokens_per_image,
        )

    def sibling(
        self, *, diffusion_constrained: bool | None = None, two_step: bool = False
    ) -> VllmEngine:
        """An engine over the same vLLM instance whose reads differ only per request: in
        `diffusion_constrained`, or (`two_step`) opting out of one-step reads, so both
        modes or both paths run on one GPU allocation; start this one first."""
        constrained = (
            self.settings.diffusion_constrained
            if diffusion_constrained is None
            else diffusion_constrained
        )
        other = VllmEngine(self.settings.model_copy(update={"diffusion_constrained": constrained}))
        other._engine, other._vocab_size, other._lock = self._engine, self._vocab_size, self._lock
        other.read_path = self.read_path
        other.image_layout = self.image_layout
        other.two_step = two_step
        return other

    async def start(self) -> None:
        """Build the engine (loads the weights: minutes). `read` calls it when needed.

        Built on the event loop's thread: vLLM starts its engine-core process from here and
        its output handler on the first request.
        """
        async with self._lock:
            if self._engine is not None:
                return
            from vllm.v1.engine.async_llm import AsyncLLM

            engine_kwargs = self._engine_kwargs()  # EngineConfigError names a bad setting
            # vLLM forks its engine-core process by default, and a fork cannot use CUDA once
            # this process has touched it (torch.cuda.is_available() is enough): spawn.
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
            if added := apply_cache_dir(self.settings.cache_dir):
                log.info("vLLM engine caches under %s (%s)", self.settings.cache_dir, sorted(added))
            try:
                engine = AsyncLLM.from_engine_args(engine_kwargs)
            except Exception as exc:
                raise FatalEngineError(f"vLLM engine failed to start: {exc}") from exc
            self._engine = engine
            self._vocab_size = int(engine.model_config.get_vocab_size())
            if self.settings.reads_images:
                self.image_layout = ImageLayout.from_config(engine.model_config.hf_config)
                if self.image_layout is None:
                    log.warning(
                        "engine.vllm.images_per_request %d, but %s has no vision tower: "
                        "requests with images are refused (IMAGES_NOT_READ)",
                        self.settings.images_per_request,
                        self.settings.model,
                    )

    def _engine_kwargs(self) -> Any:
        """vLLM's engine arguments on the read path that can run here (it says which)."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        from dgstream.workers.engine import vllm_reads

        path, why = resolve_read_path(self.settings)
        kwargs = AsyncEngineArgs(**engine_args(self.settings, path))
        # Building the arguments loaded vLLM's plugins in this process: the read path is
        # only on if its plugin registered (vLLM loads it the same way in its engine core).
        if path == "dgstream" and not (vllm_reads.status() or "").startswith("registered"):
            path, why = "stock", f"the dgstream plugin did not register: {vllm_reads.status()}"
            kwargs = AsyncEngineArgs(**engine_args(self.settings, path))
        self.read_path = path
        (log.info if path == self.settings.read_path else log.warning)(
            "vLLM reads: %s (%s)", path, why
        )
        one_step, one_step_why = self.settings.one_step_resolved(path)
        (log.info if one_step or self.settings.one_step_reads is not True else log.warning)(
            "vLLM reads in %s (%s)", "one step" if one_step else "two steps", one_step_why
        )
        tokens, graphs_why = self.settings.full_graphs_resolved(path)
        asked = "full_graph_tokens" in self.settings.model_fields_set
        (log.warning if asked and self.settings.full_graph_tokens and not tokens else log.info)(
            "vLLM mixed steps: %s (%s)",
            f"FULL CUDA graphs up to {tokens} tokens" if tokens else "vLLM's own graphs",
            graphs_why,
        )
        return kwargs

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
        await self.start()
        engine = self._engine
        if engine.errored:
            raise FatalEngineError("vLLM engine is dead")
        outcomes = await asyncio.gather(
            *(self._read_one(engine, r, i) for i, r in enumerate(reads)), return_exceptions=True
        )
        return settle(outcomes, _classify_vllm_error)

    async def _read_one(self, engine: Any, read: Read, index: int = 0) -> ReadResult:
        prompt = build_prompt(
            read,
            self.image_layout,
            most_images=self.settings.images_per_request,
            index=index,
        )
        params = build_sampling_params(
            read, self.settings, self.shared_labels, two_step=self.two_step
        )
        started = time.perf_counter()

        async def consume() -> Any:
            final = None
            # Text only: rendered token input. With images: a TokensPrompt, which vLLM's
            # renderer runs through the model's multimodal processor (off the event loop).
            async for out in engine.generate(prompt, params, _request_id(read)):
                final = out
            return final

        # Cancelling the consumer makes vLLM's generate() abort the request.
        final = await asyncio.wait_for(consume(), self.settings.read_timeout_s)
        if final is None:
            raise RecoverableEngineError(f"read {read.tag!r}: vLLM returned nothing")
        result = parse_output(read, final, constrained=self.settings.diffusion_constrained)
        return ReadResult(slots=result.slots, timings={"engine_s": time.perf_counter() - started})

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        # vLLM's shutdown stops its engine core before it cancels its output handler, and
        # run off the loop (it blocks for seconds) it lets the handler see the core go:
        # the handler then logs "AsyncLLM output_handler failed" with an EngineDeadError
        # traceback at ERROR on a clean close (in the GPU card runs' logs). That
        # error is how vLLM fails reads still in flight, so the handler goes first only
        # when none is.
        handler = getattr(engine, "output_handler", None)
        if (
            handler is not None
            and not handler.done()
            and not engine.output_processor.has_unfinished_requests()
        ):
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
        await asyncio.to_thread(engine.shutdown)


def _classify_vllm_error(exc: BaseException) -> tuple[str, str]:
    """('fatal' | 'rejected' | 'retry', message) for an exception of one in-process read."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, EngineDeadError | FatalEngineError):
        return "fatal", str(exc) or type(exc).__name__
    if isinstance(exc, ReadRejected):  # refused before vLLM saw it (`build_prompt`)
        return "rejected", exc.reason
    if isinstance(exc, VLLMClientError | ValueError | TypeError):
        return "rejected", str(exc)
    if isinstance(exc, TimeoutError):
        return "retry", "read timed out"
    return "retry", f"{type(exc).__name__}: {exc}"

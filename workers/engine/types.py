"""The engine boundary: what a backend is given (reads) and what it returns (slot reads).

A *read* is one single-step denoising pass over one canvas. Backends know nothing of
questions or answers; they see token ids, slot positions and label ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class Slot:
    """One answer slot on the canvas: where to read, and which token ids are the labels."""

    question_id: str
    position: int  # index into the canvas
    label_ids: tuple[int, ...]  # token id of each label, in label order
    labels: tuple[str, ...]  # the label strings ("yes", "A", "3", ...), same order


@dataclass(frozen=True)
class ReadImage:
    """One image of a read: decoded RGB pixels, named by the SHA-256 of the bytes received.

    Equal hashes are the same image (a backend may share its work); the pixels are left out
    of comparisons, which would otherwise compare megabytes."""

    sha256: str
    image: Any = field(compare=False, repr=False)  # a PIL RGB image


@dataclass(frozen=True)
class Read:
    """One single-step read: a prompt and a seeded canvas (template plus slot noise)."""

    prompt_ids: tuple[int, ...]
    canvas_ids: tuple[int, ...]  # width is a multiple of 16, at most the served canvas
    slots: tuple[Slot, ...]
    # Length of the prompt prefix shared by every request of the same question set
    # (chat header plus system text): a backend may reuse its KV cache.
    shared_prefix_len: int = 0
    tag: str = ""  # correlation only (request id, read index); never affects the output
    # The request's images, in order. `prompt_ids` stays the text prompt: a backend that
    # reads images lays its own placeholder tokens for them at `shared_prefix_len` (the end
    # of what every prompt of the question set shares, just before the user's text: images
    # before the text, as vLLM's chat format places them), so the shared prefix's cache
    # still serves. Empty for a text-only read, whose prompt is exactly `prompt_ids`.
    images: tuple[ReadImage, ...] = ()

    @property
    def label_union(self) -> tuple[int, ...]:
        """Sorted union of every slot's label ids (vLLM's `logprob_token_ids`)."""
        return tuple(sorted({t for s in self.slots for t in s.label_ids}))


@dataclass(frozen=True)
class SlotRead:
    """What one slot of one read says."""

    question_id: str
    probs: np.ndarray  # softmax over the labels' logits, label order, sums to 1
    entropy: float  # of `probs`, in nats
    # Probability the full-vocabulary distribution gives to the labels together; None when
    # the backend computed only the label rows (constrained reads) and cannot know it.
    label_mass: float | None
    # Whether the full-vocabulary argmax is one of the labels (None when unknown).
    argmax_is_label: bool | None


@dataclass(frozen=True)
class ReadResult:
    slots: tuple[SlotRead, ...]
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineInfo:
    backend: str  # "transformers", "vllm", "vllm-remote", "fake"
    model: str
    canvas_length: int  # the widest canvas this engine serves
    vocab_size: int
    device: str = "cpu"
    # Whether reads carry images to a vision tower (`Read.images`). When False the worker
    # dead-letters a request with images (IMAGES_NOT_READ, dgstream.workers.images) rather than
    # answer it from its text alone. The transformers engine sets it when its model has a
    # vision tower; the fake engine and vLLM (for now) do not.
    reads_images: bool = False
    # Prompt tokens a read lays for each of its images (the transformers engine's `<boi>`,
    # 64 image tokens, `<eoi>`: 66), which `diagnostics.input_tokens` adds to the text's;
    # 0 where the engine reads none or does not say.
    image_tokens: int = 0


class EngineError(Exception):
    """Base of the engine's errors."""


class RecoverableEngineError(EngineError):
    """The batch may succeed if retried (or split): a timeout, a transient OOM."""


class ReadRejected(RecoverableEngineError):
    """The engine refused one or more reads of a batch at admission (vLLM's validation of a
    request, say).

    Retrying the same read cannot help: dead-letter `rejected` and keep `results` (the reads
    that did succeed; None where a read was rejected or failed transiently). Catch this before
    `RecoverableEngineError`, whose other cases are worth a retry.
    """

    def __init__(
        self,
        index: int,
        reason: str,
        *,
        rejected: Mapping[int, str] | None = None,
        results: Sequence[ReadResult | None] = (),
    ) -> None:
        self.index = index
        self.reason = reason
        self.rejected: dict[int, str] = dict(rejected) if rejected else {index: reason}
        self.results: list[ReadResult | None] = list(results)
        super().__init__(f"read {index} rejected by the engine: {reason}")


class EngineUnavailable(RecoverableEngineError):
    """The engine cannot be reached (connection refused or reset, a timeout, HTTP 429 or
    5xx from a remote server): an outage, not the input's fault. The worker holds the
    batch and retries with backoff; it never dead-letters because of this."""


class FatalEngineError(EngineError):
    """The engine is unusable: stop consuming and let Ray restart the actor."""


class EngineConfigError(FatalEngineError):
    """The engine's settings cannot work with its model; the message names the setting.

    A restart does not help: fix the configuration."""


@runtime_checkable
class Engine(Protocol):
    """A batch of reads in, slot distributions out (one ReadResult per Read, same order)."""

    @property
    def info(self) -> EngineInfo: ...

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]: ...

    async def close(self) -> None: ...

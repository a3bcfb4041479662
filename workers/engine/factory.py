"""One settings object for the engine, and the builders the worker and the CLI use."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from workers.engine.classifier import Classifier, ClassifierSettings
from workers.engine.template import ChatFormat
from workers.engine.types import Engine
from workers.engine.vllm.settings import VllmRemoteSettings, VllmSettings

Backend = Literal["transformers", "vllm", "vllm-remote", "fake"]


class EngineSettings(BaseModel):
    """Which engine a worker runs, and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Backend = "transformers"
    # transformers: a built-in model name (see workers.engine.models.SPECS: "demo", trained
    # on the demo tasks; "tiny-random", random weights for speed) or a local directory with
    # a DiffusionGemma checkpoint and its tokenizer.
    model: str = "demo"
    device: str = "auto"  # "auto" = CUDA when present
    dtype: str | None = None  # default: bf16 on CUDA, fp32 on the CPU
    # Reads per forward pass. 64 keeps a tiny model's CPU batches quick; on an H200 the
    # full-size model is fastest at 256 (docs/benchmarks.md).
    max_batch_reads: int = Field(default=64, ge=1)
    reuse_prefix: bool = True
    label_rows_only: bool = False
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    remote: VllmRemoteSettings = Field(default_factory=VllmRemoteSettings)
    # The fake engine's cost per read (autoscaling tests); 0 = free.
    fake_cost_per_read_s: float = Field(default=0.0, ge=0.0)
    # Base of every noise seed: results are reproducible for a given seed.
    seed: int = 0
    # The checkpoint's revision as the pipeline declares it, for the results' audit (e.g. a
    # release tag or commit). None: read from the model's hub snapshot (vLLM: its
    # `vllm.revision`), else hashed from its files once at start (seconds per GB).
    revision: str | None = Field(default=None, min_length=1, max_length=200)


def model_dir(name: str) -> Path:
    """The directory a transformers model name stands for (built-in, or a path)."""
    return _model_dir(name)


def _model_dir(name: str) -> Path:
    from workers.engine import models

    if name in models.SPECS:
        return models.ensure_tiny_model(name)
    path = Path(name).expanduser()
    if not (path / "config.json").exists():
        known = ", ".join(sorted(models.SPECS))
        raise ValueError(
            f"engine.model: {name!r} is neither a built-in model ({known}) nor a "
            f"directory holding a config.json"
        )
    return path


def _chat_for(path_or_name: str | Path) -> ChatFormat:
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(str(path_or_name)))


def build_engine(settings: EngineSettings) -> tuple[Engine, ChatFormat]:
    """The engine and the chat format of its model (tokenizer, special ids)."""
    if settings.backend == "transformers":
        from workers.engine.hf_backend import TransformersEngine

        path = _model_dir(settings.model)
        engine: Engine = TransformersEngine.from_pretrained(
            path,
            device=settings.device,
            dtype=settings.dtype,
            max_batch_reads=settings.max_batch_reads,
            reuse_prefix=settings.reuse_prefix,
            label_rows_only=settings.label_rows_only,
        )
        return engine, _chat_for(path)
    if settings.backend == "fake":
        from workers.engine.fake import FakeEngine

        path = _model_dir("tiny-random")  # only its tokenizer is used
        chat = _chat_for(path)
        fake = FakeEngine(vocab_size=chat.vocab_size, cost_per_read_s=settings.fake_cost_per_read_s)
        return fake, chat
    if settings.backend == "vllm":
        from workers.engine.vllm.engine import VllmEngine
        from workers.engine.vllm.sizing import check_model

        v = check_model(settings.vllm)  # a setting the model cannot serve: refused here
        chat = _chat_for(v.tokenizer or v.model)
        return VllmEngine(v, shared_labels=_labels(chat)), chat
    from workers.engine.vllm.remote import VllmRemoteEngine

    r = settings.remote
    chat = _chat_for(r.model)
    return VllmRemoteEngine(r, shared_labels=_labels(chat)), chat


def _labels(chat: ChatFormat) -> tuple[int, ...]:
    from workers.engine.template import standard_label_ids

    return standard_label_ids(chat.encode, chat.eot_id)


def build_classifier(
    settings: EngineSettings,
    question_sets: Mapping[str, Mapping[str, Any]] | None = None,
    worker: str = "",
) -> Classifier:
    engine, chat = build_engine(settings)
    return Classifier(
        engine, chat, ClassifierSettings(seed=settings.seed, worker=worker), question_sets
    )

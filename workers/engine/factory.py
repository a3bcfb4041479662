"""One settings object for the engine, and the builders the worker and the CLI use."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from dgstream.workers.engine import backends
from dgstream.workers.engine.backends import get_backend
from dgstream.workers.engine.backends._base import model_dir as _backend_model_dir
from dgstream.workers.engine.classifier import Classifier, ClassifierSettings
from dgstream.workers.engine.template import ChatFormat
from dgstream.workers.engine.types import Engine


class _EngineSettings(BaseModel):
    """Which engine a worker runs, and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The engine backend: a name of the registry (`workers/engine/backends/`, one module
    # each; the "Engine backends" table below lists them, with their settings keys).
    backend: str = "transformers"
    # transformers: a built-in model name (see dgstream.workers.engine.models.SPECS: "demo", trained
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
    # The fake engine's cost per read (autoscaling tests); 0 = free.
    fake_cost_per_read_s: float = Field(default=0.0, ge=0.0)
    # Base of every noise seed: results are reproducible for a given seed.
    seed: int = 0
    # The checkpoint's revision as the pipeline declares it, for the results' audit (e.g. a
    # release tag or commit). None: read from the model's hub snapshot (vLLM: its
    # `vllm.revision`), else hashed from its files once at start (seconds per GB).
    revision: str | None = Field(default=None, min_length=1, max_length=200)

    @field_validator("backend")
    @classmethod
    def _registered(cls, value: str) -> str:
        get_backend(value)
        return value


if TYPE_CHECKING:
    # The backends' settings fields exist at run time only; a backend reads its own with
    # `Backend.own`.
    EngineSettings = _EngineSettings
else:
    # Each backend's own settings under its key (`vllm`, `remote`), from the registry.
    EngineSettings = create_model(
        "EngineSettings",
        __base__=_EngineSettings,
        __module__=__name__,
        __doc__=_EngineSettings.__doc__,
        **backends.settings_fields(),
    )


def model_dir(name: str) -> Path:
    """The directory a transformers model name stands for (built-in, or a path)."""
    return _backend_model_dir(name)


def build_engine(settings: EngineSettings) -> tuple[Engine, ChatFormat]:
    """The engine and the chat format of its model (tokenizer, special ids), built by the
    backend `settings.backend` names."""
    return get_backend(settings.backend).build(settings)


def build_classifier(
    settings: EngineSettings,
    question_sets: Mapping[str, Mapping[str, Any]] | None = None,
    worker: str = "",
) -> Classifier:
    engine, chat = build_engine(settings)
    return Classifier(
        engine, chat, ClassifierSettings(seed=settings.seed, worker=worker), question_sets
    )

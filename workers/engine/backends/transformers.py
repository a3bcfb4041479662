"""`backend: transformers`: transformers' DiffusionGemma in the worker's process
(`workers.engine.hf_backend`), on a built-in model or a local checkpoint directory. Its
settings are the engine's common fields (`model`, `device`, `dtype`, `max_batch_reads`,
`reuse_prefix`, `label_rows_only`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dgstream.workers.engine.backends import register
from dgstream.workers.engine.backends._base import (
    Backend,
    NoSettings,
    chat_for,
    directory_checkpoint,
    model_dir,
)

if TYPE_CHECKING:
    from dgstream.workers.engine.factory import EngineSettings
    from dgstream.workers.engine.template import ChatFormat
    from dgstream.workers.engine.types import Engine


@register
class Transformers(Backend[NoSettings]):
    name = "transformers"
    settings = NoSettings

    def build(self, engine: EngineSettings) -> tuple[Engine, ChatFormat]:
        from dgstream.workers.engine.hf_backend import TransformersEngine

        path = model_dir(engine.model)
        built = TransformersEngine.from_pretrained(
            path,
            device=engine.device,
            dtype=engine.dtype,
            max_batch_reads=engine.max_batch_reads,
            reuse_prefix=engine.reuse_prefix,
            label_rows_only=engine.label_rows_only,
        )
        return built, chat_for(path)

    def audit_fields(self, engine: EngineSettings) -> dict[str, Any]:
        return {"model": engine.model, "dtype": engine.dtype, "device": engine.device}

    def checkpoint(self, engine: EngineSettings) -> tuple[str, str]:
        return directory_checkpoint(model_dir(engine.model))

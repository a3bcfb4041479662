"""`backend: vllm`: vLLM 0.33 in the worker's process (`workers.engine.vllm.engine`), one
GPU per replica; its settings are `engine.vllm` (`VllmSettings`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dgstream.workers.engine.backends import register
from dgstream.workers.engine.backends._base import (
    Backend,
    chat_for,
    directory_checkpoint,
    hub_checkpoint,
    shared_labels,
)
from dgstream.workers.engine.vllm.settings import VllmSettings

if TYPE_CHECKING:
    from dgstream.workers.engine.factory import EngineSettings
    from dgstream.workers.engine.template import ChatFormat
    from dgstream.workers.engine.types import Engine


@register
class Vllm(Backend[VllmSettings]):
    name = "vllm"
    settings = VllmSettings
    settings_key = "vllm"
    # The engine owns the device.
    gpus = 1.0

    def build(self, engine: EngineSettings) -> tuple[Engine, ChatFormat]:
        from dgstream.workers.engine.vllm.engine import VllmEngine
        from dgstream.workers.engine.vllm.sizing import check_model

        v = check_model(self.own(engine))  # a setting the model cannot serve: refused here
        chat = chat_for(v.tokenizer or v.model)
        return VllmEngine(v, shared_labels=shared_labels(chat)), chat

    def audit_fields(self, engine: EngineSettings) -> dict[str, Any]:
        v = self.own(engine)
        return {
            "model": v.model,
            "dtype": v.dtype,
            "quantization": v.quantization,
            "load_format": v.load_format,
            "diffusion_constrained": v.diffusion_constrained,
            "tensor_parallel_size": v.tensor_parallel_size,
        }

    def checkpoint(self, engine: EngineSettings) -> tuple[str, str]:
        v = self.own(engine)
        local = Path(v.model).expanduser()
        if (local / "config.json").exists():
            return directory_checkpoint(local)
        return hub_checkpoint(v.model, v.revision)

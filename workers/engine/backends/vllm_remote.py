"""`backend: vllm-remote`: the same reads against an external `vllm serve`
(`workers.engine.vllm.remote`); its settings are `engine.remote` (`VllmRemoteSettings`).
The replica needs no GPU of its own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dgstream.workers.engine.backends import register
from dgstream.workers.engine.backends._base import Backend, chat_for, hub_checkpoint, shared_labels
from dgstream.workers.engine.vllm.settings import VllmRemoteSettings

if TYPE_CHECKING:
    from dgstream.workers.engine.factory import EngineSettings
    from dgstream.workers.engine.template import ChatFormat
    from dgstream.workers.engine.types import Engine


@register
class VllmRemote(Backend[VllmRemoteSettings]):
    name = "vllm-remote"
    settings = VllmRemoteSettings
    settings_key = "remote"

    def build(self, engine: EngineSettings) -> tuple[Engine, ChatFormat]:
        from dgstream.workers.engine.vllm.remote import VllmRemoteEngine

        r = self.own(engine)
        chat = chat_for(r.model)
        return VllmRemoteEngine(r, shared_labels=shared_labels(chat)), chat

    def audit_fields(self, engine: EngineSettings) -> dict[str, Any]:
        r = self.own(engine)
        return {"model": r.model, "diffusion_constrained": r.diffusion_constrained}

    def checkpoint(self, engine: EngineSettings) -> tuple[str, str]:
        # The server's weights cannot be read from here: its hub snapshot, if this machine
        # has one, else the model's name.
        return hub_checkpoint(self.own(engine).model)

"""`backend: fake`: answers without a model (`workers.engine.fake.FakeEngine`), for the
worker's own tests and benchmarks; `fake_cost_per_read_s` makes it take time. Only the tiny
model's tokenizer is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

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

# The model whose tokenizer the fake engine's prompts are written with.
TOKENIZER_MODEL = "tiny-random"


@register
class Fake(Backend[NoSettings]):
    name = "fake"
    settings = NoSettings

    def build(self, engine: EngineSettings) -> tuple[Engine, ChatFormat]:
        from dgstream.workers.engine.fake import FakeEngine

        chat = chat_for(model_dir(TOKENIZER_MODEL))
        return FakeEngine(
            vocab_size=chat.vocab_size, cost_per_read_s=engine.fake_cost_per_read_s
        ), chat

    def checkpoint(self, engine: EngineSettings) -> tuple[str, str]:
        # The fake engine reads no weights; its tokenizer is the tiny model's.
        return directory_checkpoint(model_dir(TOKENIZER_MODEL))

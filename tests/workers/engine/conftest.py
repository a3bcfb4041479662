"""A real tiny DiffusionGemma (random weights, fixed seed) shared by the engine tests, built
into the session's own model cache (tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Any:
    from dgstream.workers.engine.models import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Any) -> Any:
    from dgstream.workers.engine.hf_backend import TransformersEngine

    return TransformersEngine.from_pretrained(tiny_model_dir, device="cpu")


@pytest.fixture(scope="session")
def tiny_chat(tiny_model_dir: Any) -> Any:
    from transformers import AutoTokenizer

    from dgstream.workers.engine.template import ChatFormat

    return ChatFormat(AutoTokenizer.from_pretrained(str(tiny_model_dir)))

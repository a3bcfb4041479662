"""Models shared by the engine tests: a real tiny DiffusionGemma (random weights, fixed
seed) built into the session's own model cache (tests/conftest.py), and the committed demo
model (trained weights; its vision tower untrained)."""

from __future__ import annotations

from pathlib import Path
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


# --------------------------------------------------------------------------- the demo model


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """The demo model's directory (committed with the package; nothing is built)."""
    from dgstream.workers.engine.models import ensure_tiny_model

    return ensure_tiny_model("demo")


@pytest.fixture(scope="session")
def demo_chat(demo_dir: Path) -> Any:
    """The demo model's chat format (its tokenizer)."""
    from transformers import AutoTokenizer

    from dgstream.workers.engine.template import ChatFormat

    return ChatFormat(AutoTokenizer.from_pretrained(str(demo_dir)))


@pytest.fixture(scope="module")
def demo_engine(demo_dir: Path) -> Any:
    """The demo model in the transformers engine on the CPU (fp32). One per module: it keeps
    a prefix cache and counters, and a module's tests read its state from their reads."""
    from dgstream.workers.engine.hf_backend import TransformersEngine

    return TransformersEngine.from_pretrained(demo_dir, device="cpu")

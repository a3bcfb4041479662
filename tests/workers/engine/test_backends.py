"""The engine backends are a registry, one module each (`workers/engine/backends/`): every
backend has its settings, audit fields, GPUs and a row in docs/configuration.md, and a toy
backend registered here goes through the build, the audit and the replica's GPUs without a
line of another file."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import BaseModel, ValidationError

from dgstream.workers.engine import backends
from dgstream.workers.engine.backends import Backend, NoSettings, get_backend, register, unregister
from dgstream.workers.engine.backends._base import chat_for, model_dir
from dgstream.workers.engine.factory import EngineSettings, build_classifier, build_engine
from dgstream.workers.engine.fake import FakeEngine
from dgstream.workers.engine.types import EngineInfo, Read, ReadResult
from dgstream.workers.hosting.settings import ActorResources, WorkerSettings
from dgstream.workers.results.audit import checkpoint_of, engine_fields

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def _backend_rows() -> dict[str, str]:
    text = DOC.read_text().split("## Engine backends", 1)[1].split("\n## ", 1)[0]
    return {
        line.split("|")[1].strip().strip("`"): line
        for line in text.splitlines()
        if line.startswith("| `")
    }


def test_the_registry_holds_the_four_backends_the_default_first() -> None:
    assert backends.backend_names() == ("transformers", "vllm", "vllm-remote", "fake")
    assert EngineSettings().backend == backends.backend_names()[0]


@pytest.mark.parametrize("name", backends.backend_names())
def test_every_backend_has_settings_audit_fields_gpus_and_a_doc_row(name: str) -> None:
    backend = get_backend(name)
    assert issubclass(backend.settings, BaseModel)
    assert backend.settings.model_config.get("extra") == "forbid"
    if backend.settings_key is None:
        assert backend.settings is NoSettings
    else:
        field = EngineSettings.model_fields[backend.settings_key]
        assert field.annotation is backend.settings
        assert backend.own(EngineSettings()) == backend.settings()
    fields = engine_fields(EngineSettings(backend=name), 64, (0.9, 4))
    assert fields["backend"] == name
    assert set(backend.audit_fields(EngineSettings(backend=name))) <= set(fields)
    assert backend.gpus >= 0
    row = _backend_rows().get(name)
    assert row is not None, (
        f"docs/configuration.md has no row for {name}: python -m dgstream.topology.docs"
    )
    assert f"| {backend.gpus:g} |" in row


def test_the_audit_fields_and_gpus_are_the_backends() -> None:
    vllm = EngineSettings(backend="vllm")
    assert engine_fields(vllm, 64, (0.9, 4))["quantization"] is None
    assert get_backend("vllm").gpus == 1 and get_backend("transformers").gpus == 0
    remote = engine_fields(EngineSettings(backend="vllm-remote"), 64, (0.9, 4))
    assert set(remote) - set(engine_fields(EngineSettings(backend="fake"), 64, (0.9, 4))) == {
        "model",
        "diffusion_constrained",
    }


def test_an_unknown_backend_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ValidationError, match=r"unknown engine backend 'nope'.*vllm-remote"):
        EngineSettings(backend="nope")


def test_a_backend_with_a_settings_key_must_be_a_module_of_the_package() -> None:
    class Late(Backend[NoSettings]):
        name = "late"
        settings = NoSettings
        settings_key = "late"

    with pytest.raises(ValueError, match="a module of workers/engine/backends/"):
        register(Late)
    assert "late" not in backends.backend_names()
    with pytest.raises(ValueError, match="stays registered"):
        unregister("vllm")


# --------------------------------------------------------------------------- a toy backend


class _Echo(FakeEngine):
    """The fake engine, saying it is the toy's."""

    @property
    def info(self) -> EngineInfo:
        base = super().info
        return EngineInfo(
            backend="toy",
            model="toy-model",
            canvas_length=base.canvas_length,
            vocab_size=base.vocab_size,
            device="cpu",
        )

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
        _Toy.reads += len(reads)
        return await super().read(reads)


class _Toy(Backend[NoSettings]):
    name = "toy"
    settings = NoSettings
    gpus = 0.5
    reads: ClassVar[int] = 0

    def build(self, engine: Any) -> Any:
        chat = chat_for(model_dir("tiny-random"))
        return _Echo(vocab_size=chat.vocab_size), chat

    def audit_fields(self, engine: Any) -> dict[str, Any]:
        return {"model": "toy-model", "temperature": 0.0}

    def checkpoint(self, engine: Any) -> tuple[str, str]:
        return "toy-1", "name"


@pytest.fixture
def toy() -> Iterator[type[_Toy]]:
    register(_Toy)
    try:
        yield _Toy
    finally:
        unregister("toy")


def test_a_toy_backend_goes_through_the_build_the_audit_and_the_gpus(toy: type[_Toy]) -> None:
    from dgstream.schemas import ClassificationRequest, parse_request

    settings = EngineSettings(backend="toy", seed=3)
    engine, _ = build_engine(settings)
    assert engine.info.backend == "toy"
    classifier = build_classifier(settings)
    request = parse_request(
        b'{"id": "t", "state": "hello", "questions": {"q": {"type": "noul", '
        b'"instructions": "Is it a greeting?"}}}'
    )
    assert isinstance(request, ClassificationRequest)
    before = toy.reads
    results = asyncio.run(classifier.classify([request]))
    assert len(results) == 1 and toy.reads > before
    assert engine_fields(settings, 64, (0.9, 4)) == {
        "backend": "toy",
        "seed": 3,
        "canvas_length": 64,
        "auto_threshold": 0.9,
        "auto_max": 4,
        "model": "toy-model",
        "temperature": 0.0,
    }
    assert checkpoint_of(settings) == ("toy-1", "name")
    assert checkpoint_of(settings.model_copy(update={"revision": "v2"})) == ("v2", "declared")
    worker = WorkerSettings.model_construct(engine=settings, resources=ActorResources())
    assert worker.num_gpus == 0.5
    # Gone again, the name is refused like any unknown one.
    unregister("toy")
    try:
        with pytest.raises(ValidationError, match="unknown engine backend 'toy'"):
            EngineSettings(backend="toy")
    finally:
        register(_Toy)

"""Adding an output format is one module: a toy one, registered here only, goes through the
pipeline's settings, the output record and `read_output`'s refusal without any other file
knowing it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kafka import TopicPartition
from pydantic import BaseModel, ConfigDict

from dgstream.schemas import (
    ClassificationRequest,
    ClassificationResult,
    YesNoAnswer,
    encode_output,
    parse_request,
    read_output,
)
from dgstream.schemas.formats import Format, format_names, register, unregister
from dgstream.schemas.result import Diagnostics
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.kafka.settings import KafkaConnection
from dgstream.workers.steps.batches import Batch, Entry, Output
from dgstream.workers.steps.outputs import OutputBuilder
from dgstream.workers.steps.topics import TopicGuard

pytestmark = pytest.mark.unit


class ToyOptions(BaseModel):
    """How the toy writes: the separator between a question and its label."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sep: str = "="


class ToyResponse(BaseModel):
    line: str


class Toy(Format[ToyOptions]):
    """One line of text per result, `q=label` pairs: nothing like the real formats."""

    name = "toy"
    options = ToyOptions
    response = ToyResponse
    schema_file = "toy_result.schema.json"

    def encode(self, result: ClassificationResult, options: ToyOptions) -> bytes:
        pairs = sorted(
            f"{q}{options.sep}{getattr(a, 'label', '?')}" for q, a in result.answers.items()
        )
        return ToyResponse(line=" ".join(pairs)).model_dump_json().encode()

    def recognises(self, obj: Any) -> bool:
        return set(obj) == {"line"}


@pytest.fixture
def toy() -> Iterator[None]:
    register(Toy)
    try:
        yield
    finally:
        unregister("toy")
    assert "toy" not in format_names()


def _result() -> ClassificationResult:
    return ClassificationResult(
        id="req-1",
        status="ok",
        answers={"toxic": YesNoAnswer(p_yes=0.9, label="yes", confidence=0.9)},
        diagnostics=Diagnostics(
            reads=1, entropy={}, label_mass={}, model="demo", engine="e", worker="w"
        ),
    )


def _output(settings: WorkerSettings, result: ClassificationResult, key: bytes) -> Output:
    """`result`'s output record as the worker's output builder makes it (no decisions)."""

    def describe(topic: str) -> tuple[dict[str, Any], int | None, str | None]:
        return {"error_code": 0, "authorized_operations": ["WRITE"]}, 1_048_588, "producer"

    class Log:
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    builder = OutputBuilder(settings, b"demo", TopicGuard(settings, describe), Log())
    q = {"type": "yes_no", "instructions": "Toxic?"}
    body = {"id": result.id, "state": "s", "questions": {"toxic": q}}
    request = parse_request(json.dumps(body).encode())
    assert isinstance(request, ClassificationRequest)
    batch = Batch(seq=0)
    batch.add(Entry(TopicPartition("requests", 0), 0, key, b"{}", 0, [], request))
    (out,) = asyncio.run(builder.build(batch, [result]))
    return out


def _settings(**overrides: Any) -> WorkerSettings:
    return WorkerSettings.model_validate(
        {
            "pipeline": "toy",
            "input_topics": ["requests"],
            "output_topic": "results",
            "dead_letter_topic": "dead",
            "group_id": "g",
            "kafka": KafkaConnection(bootstrap_servers="k:9092"),
            **overrides,
        }
    )


def test_a_toy_format_goes_through_encode_and_the_output_record(toy: None) -> None:
    res = _result()
    assert encode_output(res, "toy") == b'{"line":"toxic=yes"}'
    assert encode_output(res, "toy", ToyOptions(sep=":")) == b'{"line":"toxic:yes"}'

    settings = _settings(output_format="toy")
    assert settings.output_options() == ToyOptions()  # no pipeline key: its defaults
    rec = _output(settings, res, key=b"k")
    assert (rec.topic, rec.key, rec.value) == ("results", b"k", b'{"line":"toxic=yes"}')
    assert rec.headers == [
        ("schema_version", b"1"),
        ("model", b"demo"),
        ("worker", b"default.toy-0"),
        ("output_format", b"toy"),
        ("route", b"default"),
    ]
    # Readers that know the built-in shapes refuse it rather than misread it.
    with pytest.raises(ValueError, match="not a result this reader knows"):
        read_output(rec.value)


def test_without_the_toy_registered_the_pipeline_refuses_it() -> None:
    with pytest.raises(ValueError, match="unknown output format 'toy'"):
        _settings(output_format="toy")
    with pytest.raises(ValueError, match="unknown output format 'toy'"):
        encode_output(_result(), "toy")


def test_a_format_is_registered_once(toy: None) -> None:
    with pytest.raises(ValueError, match="registered twice"):
        register(Toy)

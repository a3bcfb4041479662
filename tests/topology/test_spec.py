"""Topology files: the examples load; bad fields are named by their path; secrets come from
the environment and never appear in the file or the settings' repr."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from topology.spec import SpecError, load_topology, parse_topology

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_load(path: Path) -> None:
    topo = load_topology(path)
    for p in topo.pipelines:
        assert topo.question_sets_for(p)


def _base() -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / "two-pipelines.yaml").read_text())


@pytest.mark.parametrize(
    ("edit", "path"),
    [
        (lambda d: d["pipelines"][0]["replicas"].update(min=3, max=2), "pipelines[0].replicas"),
        (lambda d: d["pipelines"][1].update(output_topic="bad topic"), "pipelines[1].output_topic"),
        (lambda d: d["pipelines"][0].update(delivery="twice"), "pipelines[0].delivery"),
        (
            lambda d: d["pipelines"][0]["autoscale"].update(poll_interval_s=0),
            "pipelines[0].autoscale.poll_interval_s",
        ),
        (
            lambda d: d["pipelines"][0]["engine"].update(backend="gpt"),
            "pipelines[0].engine.backend",
        ),
        (lambda d: d["pipelines"][0].update(colour="red"), "pipelines[0].colour"),
        (
            lambda d: d["question_sets"]["chat"]["toxic"].update(type="maybe"),
            "question_sets.chat.toxic",
        ),
        (lambda d: d["pipelines"][0].update(question_sets=["nope"]), "pipelines[0].question_sets"),
        (lambda d: d["pipelines"][1].update(name="chat"), "pipeline names must be unique"),
        (lambda d: d["kafka"].update(bootstrap_servers=[]), "kafka.bootstrap_servers"),
        (
            lambda d: d["question_sets"]["chat"]["toxic"].update(depends_on=["toxic"]),
            "question_sets.chat",
        ),
    ],
)
def test_errors_name_the_field(edit: Any, path: str) -> None:
    data = _base()
    edit(data)
    with pytest.raises(SpecError) as info:
        parse_topology(data)
    assert path in str(info.value)


def test_secrets_are_named_never_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kafka section IS the connection settings, with the password by name: read from
    the environment where a client is built, never held by the topology."""
    from workers.kafka_settings import KafkaConnection, MissingSecret

    topo = load_topology(EXAMPLES / "moderation.yaml")
    assert isinstance(topo.kafka, KafkaConnection)
    assert topo.kafka.sasl_password_env == "DGSTREAM_KAFKA_PASSWORD"
    monkeypatch.delenv("DGSTREAM_KAFKA_PASSWORD", raising=False)
    with pytest.raises(MissingSecret, match="DGSTREAM_KAFKA_PASSWORD"):
        topo.kafka.client_kwargs()
    monkeypatch.setenv("DGSTREAM_KAFKA_PASSWORD", "s3cret-value")
    assert topo.kafka.client_kwargs()["sasl_plain_password"] == "s3cret-value"
    assert "s3cret-value" not in repr(topo) and "s3cret-value" not in str(topo.kafka.public())
    assert "s3cret-value" not in (EXAMPLES / "moderation.yaml").read_text()


@pytest.mark.parametrize("field", ["sasl_password", "ssl_password"])
def test_a_password_in_the_file_is_refused_without_echoing_it(field: str) -> None:
    data = yaml.safe_load((EXAMPLES / "moderation.yaml").read_text())
    data["kafka"][field] = "s3cret-in-file"
    with pytest.raises(SpecError) as info:
        parse_topology(data)
    assert f"kafka.{field}" in str(info.value) and f"{field}_env" in str(info.value)
    assert "s3cret-in-file" not in str(info.value)


def test_configuration_page_is_up_to_date() -> None:
    from topology.docs import main

    assert main(["--check"]) == 0, "run: python -m topology.docs"

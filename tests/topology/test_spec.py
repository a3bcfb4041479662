"""Topology files: the examples load; bad fields are named by their path; secrets come from
the environment and never appear in the file or the settings' repr."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from dgstream.topology.spec import SpecError, load_topology, parse_topology

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


def _routes(*specs: tuple[str, str, str]) -> list[dict[str, str]]:
    return [{"name": n, "when": w, "topic": t} for n, w, t in specs]


@pytest.mark.parametrize(
    ("routes", "says"),
    [
        (
            _routes(("block", "toxic.p_yes >= 1.5", "chat.block")),
            "pipelines[0].routes[0] (block): when: toxic.p_yes >= 1.5 is false whatever the answer",
        ),
        (
            _routes(
                ("block", "toxic.p_yes >= 0.9", "chat.block"),
                ("review", "0.9 <= toxic.p_yes < 0.4", "chat.review"),
            ),
            "pipelines[0].routes[1] (review): when: never true: no value of toxic.p_yes",
        ),
        (
            _routes(("lang", 'language.choice == "english"', "chat.en")),
            "pipelines[0].routes[0] (lang): when: unknown question 'language'",
        ),
        (
            _routes(("b", "toxic.level == 'x'", "chat.b")),
            "level is a field of score questions and toxic is yes_no",
        ),
        (_routes(("b", "toxic.p_yes >=", "chat.b")), "route 'b': when: expected a value"),
        (_routes(("b", "toxic.skipped", "chat.messages")), "is an input or dead-letter topic"),
        (_routes(("b", "toxic.skipped", "chat.dead-letters")), "is an input or dead-letter"),
        (_routes(("default", "toxic.skipped", "chat.b")), "reserved"),
        (
            _routes(("b", "toxic.skipped", "x"), ("b", "shouting.skipped", "y")),
            "route names must be unique",
        ),
    ],
)
def test_bad_routes_are_refused_naming_the_route(routes: list[dict[str, str]], says: str) -> None:
    data = _base()
    data["pipelines"][0]["routes"] = routes
    with pytest.raises(SpecError) as caught:
        parse_topology(data)
    assert says in str(caught.value)


def test_routes_and_output_format_load() -> None:
    data = _base()
    data["pipelines"][0]["output_format"] = "jev"
    data["pipelines"][0]["routes"] = _routes(
        ("block", "toxic.p_yes >= 0.9", "chat.block"),
        ("loud", "0.5 < shouting.p_yes and not toxic.p_yes > 0.9", "chat.loud"),
    )
    topo = parse_topology(data)
    pipe = topo.pipelines[0]
    assert pipe.output_format == "jev" and [r.topic for r in pipe.routes] == [
        "chat.block",
        "chat.loud",
    ]
    data["pipelines"][0]["output_format"] = "xml"
    with pytest.raises(SpecError, match=r"pipelines\[0\]\.output_format"):
        parse_topology(data)


def test_secrets_are_named_never_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kafka section IS the connection settings, with the password by name: read from
    the environment where a client is built, never held by the topology."""
    from dgstream.workers.kafka.settings import KafkaConnection, MissingSecret

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
    from dgstream.topology.docs import main

    assert main(["--check"]) == 0, "run: python -m dgstream.topology.docs"


def test_the_controller_creates_the_route_topics(monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller's topic setup (step 0 of its tick) with Kafka's admin call recorded:
    route topics are made like the output topic."""
    import dgstream.workers.kafka.admin
    from dgstream.topology.controller import PipelineRunner

    made: dict[str, int] = {}

    def record(target: Any, topics: dict[str, int], **_: Any) -> dict[str, int]:
        made.update(topics)
        return {}

    monkeypatch.setattr(dgstream.workers.kafka.admin, "ensure_topics", record)
    topo = load_topology(EXAMPLES / "jev-routes.yaml")
    (spec,) = topo.pipelines
    runner = PipelineRunner(topo, spec, topo.kafka, "spec-test")
    runner._admin = object()  # never connects: the recorder ignores it
    runner._adopted = True  # no Ray actors to look for
    runner._setup()
    assert runner.topics_ready, runner.setup_error
    n = spec.topics.partitions
    assert made == {
        "jev.requests": n,
        "jev.results": n,
        "jev.dead-letters": 1,
        "jev.block": n,
        "jev.review": n,
    }


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_compression_type_reaches_the_workers_producer(codec: str) -> None:
    from dgstream.topology.controller import PipelineRunner

    data = _base()
    data["pipelines"][0]["compression_type"] = codec
    topo = parse_topology(data)
    spec = topo.pipelines[0]
    settings = PipelineRunner(topo, spec, topo.kafka, "spec-test").worker_settings(0)
    assert settings.producer.compression_type == codec
    assert parse_topology(_base()).pipelines[0].compression_type == "none"


def test_an_unknown_codec_is_refused_by_name() -> None:
    data = _base()
    data["pipelines"][0]["compression_type"] = "brotli"
    with pytest.raises(SpecError, match=r"pipelines\[0\]\.compression_type"):
        parse_topology(data)

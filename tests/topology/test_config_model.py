"""One config model: what a pipeline says is declared once, in
`workers.hosting.settings.PipelineFields`, which the topology's `PipelineSpec` and the worker's
`WorkerSettings` both inherit; the worker's settings are built from the spec by one path
(`Topology.worker_settings` -> `WorkerSettings.from_spec`). Every spec field reaches a worker
setting or is marked control-plane only, and every worker setting comes from the spec or is
marked runtime-only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, create_model

from dgstream.topology.spec import (
    CONTROL_PLANE_ONLY,
    SPEC_TO_WORKER,
    PipelineSpec,
    SpecError,
    load_topology,
    parse_topology,
)
from dgstream.workers.hosting.settings import RUNTIME_ONLY, PipelineFields, WorkerSettings
from dgstream.workers.kafka.settings import KafkaConnection

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"


def unplaced_spec_fields(spec: type[BaseModel]) -> set[str]:
    """Spec fields that reach no worker setting and are not marked control-plane only."""
    placed = set(PipelineFields.model_fields) | set(SPEC_TO_WORKER) | CONTROL_PLANE_ONLY
    return set(spec.model_fields) - placed


def unsourced_worker_fields(settings: type[BaseModel]) -> set[str]:
    """Worker settings that no spec field sets and that are not marked runtime-only."""
    sourced = set(PipelineFields.model_fields) | set(SPEC_TO_WORKER.values()) | RUNTIME_ONLY
    return set(settings.model_fields) - sourced


def test_every_spec_field_reaches_a_worker_setting_or_is_control_plane_only() -> None:
    assert unplaced_spec_fields(PipelineSpec) == set()
    # The marks name real fields, each marked one way only.
    spec = set(PipelineSpec.model_fields)
    assert spec >= CONTROL_PLANE_ONLY and set(SPEC_TO_WORKER) <= spec
    shared = set(PipelineFields.model_fields)
    assert not (CONTROL_PLANE_ONLY & shared or set(SPEC_TO_WORKER) & shared)
    assert not CONTROL_PLANE_ONLY & set(SPEC_TO_WORKER)


def test_every_worker_setting_comes_from_the_spec_or_is_runtime_only() -> None:
    assert unsourced_worker_fields(WorkerSettings) == set()
    worker = set(WorkerSettings.model_fields)
    assert worker >= RUNTIME_ONLY and set(SPEC_TO_WORKER.values()) <= worker
    shared = set(PipelineFields.model_fields)
    assert not (RUNTIME_ONLY & shared or set(SPEC_TO_WORKER.values()) & shared)
    assert not RUNTIME_ONLY & set(SPEC_TO_WORKER.values())


def test_a_new_field_on_either_side_fails_until_it_is_placed() -> None:
    """What the two tests above catch: a spec field added without a worker setting or a
    mark, a worker setting added without a source or a mark."""
    spec = create_model("GrownSpec", __base__=PipelineSpec, colour=(str, "red"))
    assert unplaced_spec_fields(spec) == {"colour"}
    worker = create_model("GrownSettings", __base__=WorkerSettings, flavour=(str, "x"))
    assert unsourced_worker_fields(worker) == {"flavour"}


def test_the_shared_fields_and_checks_are_declared_once() -> None:
    shared = set(PipelineFields.model_fields)
    checks = {"_topic_names", "_topics_and_framing", "check_references"}
    assert checks <= set(vars(PipelineFields))
    for model in (PipelineSpec, WorkerSettings):
        assert not shared & set(vars(model).get("__annotations__", {})), model.__name__
        assert not checks & set(vars(model)), model.__name__


def _topology() -> Any:
    data = yaml.safe_load((EXAMPLES / "jev-routes.yaml").read_text())
    p = data["pipelines"][0]
    p.update(
        compression_type="zstd",
        resources={"gpus": 0.5, "cpus": 3, "custom": {"H200": 1}},
        stall_after_s=31,
        static_membership=True,
        reply_topics=["replies.*"],
        delivery="exactly_once",
    )
    data["ray"] = {"deployment": "blue"}
    data["tracing"] = {"enabled": True, "endpoint": "http://127.0.0.1:4318/v1/traces"}
    return parse_topology(data)


def test_the_controller_builds_settings_through_the_one_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`PipelineRunner.worker_settings` -> `Topology.worker_settings` ->
    `WorkerSettings.from_spec`, which copies `PipelineFields` by name; the builder passes
    exactly the spec's renamed fields and runtime-only ones."""
    from dgstream.topology.controller import PipelineRunner

    topo = _topology()
    spec = topo.pipelines[0]
    conn = KafkaConnection(bootstrap_servers=["127.0.0.1:9"])
    passed: dict[str, Any] = {}
    real = WorkerSettings.from_spec.__func__  # type: ignore[attr-defined]

    def spy(cls: type[WorkerSettings], s: PipelineFields, **fields: Any) -> WorkerSettings:
        passed.update(fields)
        built: WorkerSettings = real(cls, s, **fields)
        return built

    monkeypatch.setattr(WorkerSettings, "from_spec", classmethod(spy))
    settings = PipelineRunner(topo, spec, conn, "ns").worker_settings(2)
    assert set(passed) - RUNTIME_ONLY == set(SPEC_TO_WORKER.values())

    for name in PipelineFields.model_fields:
        assert getattr(settings, name) == getattr(spec, name), name
    assert settings.pipeline == spec.name and settings.group_id == spec.consumer_group
    assert settings.question_sets == topo.question_sets_for(spec) != {}
    assert settings.producer.compression_type == "zstd"
    assert settings.resources.model_dump() == spec.resources.model_dump()
    assert settings.num_gpus == 0.5
    assert settings.deployment == "blue" and settings.tracing == topo.tracing
    assert settings.kafka is conn and settings.replica == 2
    assert settings.name == f"blue.{spec.name}-2"


def test_from_spec_refuses_a_shared_field_given_again() -> None:
    topo = _topology()
    with pytest.raises(TypeError, match="output_topic"):
        WorkerSettings.from_spec(topo.pipelines[0], output_topic="elsewhere")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_pipeline_builds_its_workers_settings(path: Path) -> None:
    topo = load_topology(path)
    for p in topo.pipelines:
        settings = topo.worker_settings(p, 0, topo.kafka)
        assert settings.pipeline == p.name and settings.input_topics == p.input_topics


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        # The shared checks, now refused when the topology is read (and still by the worker).
        (
            {"input_topics": ["chat.messages", "chat.messages"]},
            "pipelines[0]: Value error, input_topics lists",
        ),
        ({"output_topic": ".."}, "pipelines[0].output_topic: Value error, '..' is not a valid"),
        ({"input_topics": ["bad topic"]}, "pipelines[0].input_topics: Value error, 'bad topic'"),
        ({"output_framing": "confluent"}, "output_framing needs schema_registry"),
    ],
)
def test_the_shared_checks_name_the_pipeline(edit: dict[str, Any], says: str) -> None:
    data = yaml.safe_load((EXAMPLES / "two-pipelines.yaml").read_text())
    data["pipelines"][0].update(edit)
    with pytest.raises(SpecError) as caught:
        parse_topology(data)
    assert says in str(caught.value)


def test_question_sets_are_checked_once_for_both() -> None:
    data = yaml.safe_load((EXAMPLES / "two-pipelines.yaml").read_text())
    name = next(iter(data["question_sets"]))
    data["question_sets"][name] = {}
    with pytest.raises(SpecError, match=rf"question_sets\.{name}: question set '{name}' has no"):
        parse_topology(data)

"""WorkerSettings, the actor's options and the metrics' local copy (no broker, no Ray)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from dgstream.workers.engine.factory import EngineSettings
from dgstream.workers.hosting.metrics import WorkerMetrics
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.kafka.settings import KafkaConnection

pytestmark = pytest.mark.unit


def _settings(**overrides: Any) -> WorkerSettings:
    base: dict[str, Any] = {
        "pipeline": "moderation",
        "input_topics": ["requests"],
        "output_topic": "results",
        "dead_letter_topic": "dead",
        "group_id": "dgstream-moderation",
        "kafka": KafkaConnection(
            bootstrap_servers="k:9093",
            security_protocol="SASL_SSL",
            sasl_mechanism="PLAIN",
            sasl_username="u",
            sasl_password="hunter2",
        ),
    }
    base.update(overrides)
    return WorkerSettings.model_validate(base)


def test_worker_settings_defaults_and_derived_names() -> None:
    s = _settings(replica=3)
    assert s.batching.max_records == 64 and s.batching.max_in_flight == 2
    assert s.delivery == "at_least_once" and not s.static_membership
    assert s.name == "default.moderation-3"
    assert s.group_instance_id == "default-moderation-3"
    assert s.transactional_id == "dgstream-moderation-default-moderation-3"
    assert s.num_gpus == 0  # the default engine is transformers
    assert _settings(engine=EngineSettings(backend="vllm")).num_gpus == 1
    assert _settings(resources={"gpus": 0}, engine=EngineSettings(backend="vllm")).num_gpus == 0
    assert "hunter2" not in repr(s) and "hunter2" not in s.model_dump_json()
    with pytest.raises(ValidationError):
        s.replica = 4  # type: ignore[misc]


def test_two_deployments_of_a_replica_have_their_own_ids() -> None:
    """Same pipeline, group and replica number: an upgrade runs both at once; sharing a
    transactional (or static member) id, each would fence the other."""
    blue, green = _settings(deployment="blue"), _settings(deployment="green")
    assert blue.transactional_id != green.transactional_id
    assert blue.group_instance_id != green.group_instance_id
    assert _settings(deployment="blue").transactional_id == blue.transactional_id  # stable


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"deployment": "Blue"}, "should match pattern"),
        ({"output_topic": "requests"}, "must differ from the input topics"),
        ({"dead_letter_topic": "requests"}, "must differ from the input topics"),
        ({"input_topics": ["a", "a"]}, "twice"),
        ({"input_topics": []}, "at least 1"),
        ({"output_topic": "bad topic"}, "not a valid Kafka topic name"),
        ({"pipeline": "Moderation"}, "should match pattern"),
        ({"batching": {"max_in_flight": 0}}, "greater than or equal to 1"),
        ({"delivery": "at_most_once"}, "at_least_once"),
        (
            {"consumer": {"session_timeout_ms": 6000, "heartbeat_interval_ms": 3000}},
            "a third of session_timeout_ms",
        ),
        ({"question_sets": {"s": {}}}, "has no questions"),
        (
            {"question_sets": {"s": {"1bad": {"type": "yes_no", "instructions": "x"}}}},
            "question id '1bad'",
        ),
        (
            {
                "question_sets": {
                    "s": {
                        "a": {"type": "yes_no", "instructions": "a", "depends_on": ["b"]},
                        "b": {"type": "yes_no", "instructions": "b", "depends_on": ["a"]},
                    }
                }
            },
            "dependency cycle",
        ),
        ({"unknown": 1}, "Extra inputs are not permitted"),
    ],
)
def test_worker_settings_refuse(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _settings(**overrides)


def test_worker_actor_options_from_settings() -> None:
    from dgstream.workers.hosting.actor import actor_name, actor_options

    s = _settings(
        replica=1,
        engine=EngineSettings(backend="vllm"),
        resources={"cpus": 2, "custom": {"H200": 1}},
    )
    opts = actor_options(s, lifetime="detached")
    assert opts == {
        "name": "dgstream-default.moderation-1",
        "num_gpus": 1.0,
        "num_cpus": 2.0,
        "max_restarts": -1,
        "max_task_retries": 0,
        "resources": {"H200": 1.0},
        "lifetime": "detached",
    }
    assert actor_name(s) == "dgstream-default.moderation-1"
    # Another deployment of the pipeline (an upgrade) has other names.
    assert actor_name(s.model_copy(update={"deployment": "v2"})) == "dgstream-v2.moderation-1"


def test_worker_metrics_are_local_outside_ray() -> None:
    m = WorkerMetrics("p", "w", use_ray=False)
    assert not m.exported
    m.record_consumed(5)
    m.record_consumed(0)
    m.record_batch(5)
    m.record_engine(0.01, 2)
    m.record_outputs(3, ["INVALID_JSON", "INVALID_JSON"], [0.1, 0.2])
    m.set_in_flight(1)
    m.set_lag({"t-0": 4})
    m.record_routes(["block", "default", "block"])
    m.record_routes([])
    snap = m.snapshot()
    assert snap["routed"] == {"block": 2, "default": 1}
    assert snap["consumed"] == 5 and snap["batches"] == 1 and snap["engine_calls"] == 2
    assert snap["answered"] == 3 and snap["dead_lettered"] == 2
    assert snap["dead_letter_codes"] == {"INVALID_JSON": 2}
    assert snap["in_flight"] == 1 and snap["lag"] == {"t-0": 4}

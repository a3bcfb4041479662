"""The topology's decision settings: shadow pipelines that share only their input,
calibration files read beside the topology file, the moderation shape's references,
tracing; and the controller's worker settings carry them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from dgstream.topology.spec import SpecError, load_topology, parse_topology, read_topology
from dgstream.workers.results.calibration import Calibration, QuestionCalibration

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"


def _base() -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / "jev-routes.yaml").read_text())


def _with_shadow(**changes: Any) -> dict[str, Any]:
    data = _base()
    shadow = copy.deepcopy(data["pipelines"][0])
    shadow.update(
        name="jev-shadow",
        consumer_group="dgstream-jev-shadow",
        output_topic="jev.shadow.results",
        dead_letter_topic="jev.shadow.dead-letters",
        shadow=True,
    )
    shadow.update(changes)
    data["pipelines"].append(shadow)
    return data


CAL = Calibration(
    questions={
        "insult": QuestionCalibration(
            kind="yes_no",
            labels=["yes", "no"],
            temperature=1.7,
            examples=40,
            nll_before=0.5,
            nll_after=0.4,
            ece_before=0.1,
            ece_after=0.02,
        )
    }
)


def test_a_shadow_with_its_own_group_and_topics_loads() -> None:
    topo = parse_topology(_with_shadow())
    assert [p.shadow for p in topo.pipelines] == [False, True]


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"consumer_group": "dgstream-jev"}, "consumer_group must be its own"),
        ({"output_topic": "jev.results"}, "['jev.results'] belong to pipelines[0]"),
        ({"output_topic": "jev.block"}, "['jev.block'] belong to pipelines[0]"),
        ({"dead_letter_topic": "jev.dead-letters"}, "belong to pipelines[0]"),
    ],
)
def test_a_shadow_shares_only_its_input(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_topology(_with_shadow(**changes))


def test_two_ordinary_pipelines_may_still_share_topics() -> None:
    # Only a shadow is held apart: ordinary pipelines keep today's rules.
    data = _with_shadow(output_topic="jev.results")
    data["pipelines"][1]["shadow"] = False
    parse_topology(data)


def test_a_calibration_path_is_read_beside_the_topology_file(tmp_path: Path) -> None:
    (tmp_path / "cal").mkdir()
    (tmp_path / "cal" / "jev.json").write_text(CAL.model_dump_json())
    data = _base()
    data["pipelines"][0]["calibration"] = "cal/jev.json"
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(data))
    topo = load_topology(path)
    assert topo.pipelines[0].calibration == CAL
    # What `dgstream run` sends to the controller holds the content, not the path.
    raw = read_topology(path)
    assert raw["pipelines"][0]["calibration"] == json.loads(CAL.model_dump_json())
    assert parse_topology(raw).pipelines[0].calibration == CAL


def test_a_calibration_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    data = _base()
    data["pipelines"][0]["calibration"] = "missing.json"
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError, match=r"pipelines\[0\]\.calibration: cannot read"):
        load_topology(path)
    (tmp_path / "missing.json").write_text('{"questions": 3}')
    with pytest.raises(SpecError, match=r"pipelines\[0\]\.calibration"):
        load_topology(path)
    # A path given straight to the model (no file to read it from) says what is wrong.
    data["pipelines"][0]["calibration"] = "x.json"
    with pytest.raises(SpecError, match="read when the topology file is loaded"):
        parse_topology(data)


@pytest.mark.parametrize(
    ("moderation", "words"),
    [
        ({"categories": {"harassment": "language"}}, "no yes/no question"),
        ({"categories": {"harassment": "nope"}}, "no yes/no question"),
        ({"flagged_by": "routes", "flag_routes": ["blok"]}, "no route named"),
        ({"flag_routes": ["block"]}, "flag_routes needs"),
    ],
)
def test_moderation_references_are_checked(moderation: dict[str, Any], words: str) -> None:
    data = _base()
    data["pipelines"][0].update(output_format="openai_moderation", moderation=moderation)
    with pytest.raises(SpecError, match=words):
        parse_topology(data)


def test_the_controller_hands_the_decision_settings_to_its_workers() -> None:
    from dgstream.topology.controller import PipelineRunner
    from dgstream.workers.kafka.settings import KafkaConnection

    data = _with_shadow(calibration=json.loads(CAL.model_dump_json()))
    data["tracing"] = {"enabled": True, "endpoint": "http://127.0.0.1:4318/v1/traces"}
    data["pipelines"][0].update(
        output_format="openai_moderation",
        moderation={"categories": {"harassment": "insult"}, "flagged_by": "routes"},
    )
    topo = parse_topology(data)
    conn = KafkaConnection(bootstrap_servers=["127.0.0.1:9"])
    main = PipelineRunner(topo, topo.pipelines[0], conn, "ns").worker_settings(0)
    shadow = PipelineRunner(topo, topo.pipelines[1], conn, "ns").worker_settings(0)
    assert main.moderation.flagged_by == "routes" and main.shadow is False
    assert main.tracing.enabled and shadow.tracing == main.tracing
    assert shadow.shadow is True and shadow.calibration == CAL
    assert shadow.event_source == "/dgstream/default/jev-shadow"

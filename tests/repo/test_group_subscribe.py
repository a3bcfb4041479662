"""Every group consumer in the project (one with a `group_id`) subscribes through
`subscribe_known`: a `KafkaConsumer(topic, ...)` (topics given to the constructor) can send
its first JoinGroup before its first metadata response, and a group whose leader assigned
from empty metadata sits idle until the next metadata refresh, 5 minutes later. CI lost a
broker test to it on 2026-12-01; this check reads every call in the repository's code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("schemas", "workers", "topology", "infra", "dgstream", "bench", "tests")


def _in_a_group(call: ast.Call) -> bool:
    """A `group_id` other than a literal None (kafka-python's default: no group, no join).
    `KafkaConnection.client_kwargs()`, the `**` the project passes, never holds one."""
    for kw in call.keywords:
        if kw.arg == "group_id":
            return not (isinstance(kw.value, ast.Constant) and kw.value.value is None)
    return False


def _positional_consumers() -> list[str]:
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name == "KafkaConsumer" and node.args and _in_a_group(node):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_consumer_is_given_its_topics_in_the_constructor() -> None:
    assert _positional_consumers() == [], "use subscribe_known(consumer, topics)"

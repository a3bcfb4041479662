"""Outages without a broker: the backoff clock (an injected clock, no waiting), which
produce errors are outages, and step 7 telling a request that breaks the engine from an
engine that is down (fake engines that fail on purpose)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
from kafka.errors import (
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NotEnoughReplicasError,
    NotLeaderForPartitionError,
    TopicAuthorizationFailedError,
)

from dgstream.schemas import ClassificationResult, ErrorCode, RequestError, parse_request
from dgstream.workers.engine.factory import EngineSettings, build_classifier
from dgstream.workers.engine.types import EngineUnavailable, RecoverableEngineError
from dgstream.workers.faults.outage import Outage, OutageClock, produce_outage
from dgstream.workers.hosting.logs import get_logger
from dgstream.workers.hosting.settings import OutageTuning
from dgstream.workers.steps.classify import BatchClassifier

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_up_to_the_cap_within_the_budget() -> None:
    clock = Clock()
    o = OutageClock(OutageTuning(initial_backoff_s=1, max_backoff_s=5, budget_s=30), clock)
    assert not o.active and o.status() is None
    pauses = [o.hit(Outage("engine", "refused")) for _ in range(5)]
    assert pauses == [1, 2, 4, 5, 5]
    assert o.holding()
    clock.now += 5
    assert not o.holding() and not o.exhausted()  # time to try again
    st = o.status()
    assert st is not None and st["kind"] == "engine" and st["tries"] == 5
    clock.now += 26  # 31 s since the first failure
    assert o.exhausted()
    assert o.clear() == 31
    assert not o.active and o.status() is None
    assert o.hit(Outage("output", "no leader")) == 1  # a new outage starts over


@pytest.mark.parametrize(
    ("error", "outage"),
    [
        (KafkaTimeoutError("metadata not available after 60000 ms"), True),
        (NotLeaderForPartitionError(), True),
        (NotEnoughReplicasError(), True),
        (MessageSizeTooLargeError(), False),  # the record's fault
        (TopicAuthorizationFailedError(), False),  # configuration
        (ValueError("a bug"), False),
    ],
)
def test_which_produce_errors_are_outages(error: Exception, outage: bool) -> None:
    found = produce_outage(error)
    assert (found is not None) == outage
    if found is not None:
        assert found.kind == "output"


# --------------------------------------------------------------------------- step 7


class Broken:
    """Fails every read of a request whose id is in `bad`; `down` fails every read."""

    def __init__(self, inner: Any, bad: set[str], down: Exception | None = None) -> None:
        self.inner, self.bad, self.down = inner, bad, down
        self.calls = 0

    @property
    def info(self) -> Any:
        return self.inner.info

    async def read(self, reads: Sequence[Any]) -> list[Any]:
        self.calls += 1
        if self.down is not None:
            raise self.down
        if any(r.tag.split("#")[0] in self.bad for r in reads):
            raise RecoverableEngineError("illegal memory access")
        out: list[Any] = await self.inner.read(reads)
        return out

    async def close(self) -> None:
        await self.inner.close()


def _requests(*ids: str) -> list[Any]:
    q = {"q": {"type": "yes_no", "instructions": "Is it so?"}}
    out = [parse_request(json.dumps({"id": i, "state": "s", "questions": q}).encode()) for i in ids]
    assert all(not isinstance(r, RequestError) for r in out)
    return out


def _step(engine: Broken) -> BatchClassifier:
    classifier = build_classifier(EngineSettings(backend="fake"), {}, "t")
    engine.inner = classifier.engine
    classifier.engine = engine
    return BatchClassifier(classifier, retries=1, backoff_s=0.0, log=get_logger())


def test_the_request_that_breaks_the_engine_is_refused_and_its_neighbours_answered() -> None:
    engine = Broken(None, {"bad"})
    step = _step(engine)
    out = asyncio.run(step.classify(_requests("a", "bad", "b", "c")))
    assert [type(o).__name__ for o in out] == [
        "ClassificationResult",
        "RequestError",
        "ClassificationResult",
        "ClassificationResult",
    ]
    assert isinstance(out[1], RequestError) and out[1].code == ErrorCode.ENGINE_FAILED


def test_a_batch_of_one_breaking_request_is_refused_after_a_probe_succeeds() -> None:
    engine = Broken(None, {"bad"})
    step = _step(engine)
    (out,) = asyncio.run(step.classify(_requests("bad")))
    assert isinstance(out, RequestError) and out.code == ErrorCode.ENGINE_FAILED
    assert step.calls == 3  # two tries and the probe


@pytest.mark.parametrize(
    "down",
    [EngineUnavailable("connection refused"), RecoverableEngineError("CUDA error")],
    ids=["unavailable", "failing-everything"],
)
def test_an_engine_that_is_down_is_an_outage_not_a_refusal(down: Exception) -> None:
    engine = Broken(None, set(), down)
    step = _step(engine)
    with pytest.raises(Outage) as caught:
        asyncio.run(step.classify(_requests("a", "b", "c")))
    assert caught.value.kind == "engine"
    if isinstance(down, EngineUnavailable):
        assert engine.calls == 1  # not retried, not split: held as a whole


def test_the_probe_is_a_valid_request() -> None:
    from dgstream.workers.steps.classify import PROBE

    classifier = build_classifier(EngineSettings(backend="fake"), {}, "t")
    (out,) = asyncio.run(classifier.classify([PROBE]))
    assert isinstance(out, ClassificationResult)

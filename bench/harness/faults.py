"""Fault injection for the worker tests (and the fault matrix built on them): engines that
hold or fail on purpose, a member kicked out of its group as a session expiry would, a tap
on a worker's log events, and the broker-side views the checks read (transaction state,
group members).

Every wait is on a condition with a deadline. Engines wrap the fake engine: they test the
pipeline's handling of engine faults, not an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from bench.harness.waiting import wait_for
from dgstream.workers.kafka.settings import KafkaConnection

DELIVERIES = ["at_least_once", "exactly_once"]


# --------------------------------------------------------------------------- engines


class _Wrapped:
    """What the engines here share: the fake engine inside, whose info they report, whose
    reads they pass on (`_passed_on`) when they let them through, and whose close they call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def info(self) -> Any:
        return self.inner.info

    async def _passed_on(self, reads: Sequence[Any]) -> list[Any]:
        out: list[Any] = await self.inner.read(reads)
        return out

    async def close(self) -> None:
        await self.inner.close()


class SlowEngine(_Wrapped):
    """The fake engine, each read taking `read_s` (a slow GPU, not a wait on a condition)."""

    def __init__(self, inner: Any, read_s: float) -> None:
        super().__init__(inner)
        self.read_s = read_s

    async def read(self, reads: Sequence[Any]) -> list[Any]:
        await asyncio.sleep(self.read_s)
        return await self._passed_on(reads)


class GateEngine(_Wrapped):
    """The fake engine, holding every read while `gate` is closed. `entered` is set once
    a read waits at the gate; `calls` counts reads started."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls = 0

    async def read(self, reads: Sequence[Any]) -> list[Any]:
        self.calls += 1
        while not self.gate.is_set():
            self.entered.set()
            await asyncio.sleep(0.01)  # cancellable, unlike a thread waiting on the gate
        return await self._passed_on(reads)

    async def close(self) -> None:
        self.gate.set()
        await super().close()


class DownEngine(_Wrapped):
    """The fake engine, out of reach while `down` is set: every read raises
    `error()` (EngineUnavailable by default: a remote server refusing connections; a
    RecoverableEngineError for a local engine that fails everything). `calls` counts
    the reads tried."""

    def __init__(self, inner: Any, error: Callable[[], Exception] | None = None) -> None:
        from dgstream.workers.engine.types import EngineUnavailable

        super().__init__(inner)
        self.down = threading.Event()
        self.down.set()
        self.error = error or (lambda: EngineUnavailable("connection refused"))
        self.calls = 0

    async def read(self, reads: Sequence[Any]) -> list[Any]:
        self.calls += 1
        if self.down.is_set():
            raise self.error()
        return await self._passed_on(reads)


class CrashOn(_Wrapped):
    """The fake engine, crashing on any read of a request whose id starts with `prefix`:
    a FatalEngineError (the worker fails; Ray would restart it), or, with `exit_code`, the
    whole process dies at once (as an engine that segfaults or is killed for memory)."""

    def __init__(self, inner: Any, prefix: str = "crash", exit_code: int | None = None) -> None:
        super().__init__(inner)
        self.prefix, self.exit_code = prefix, exit_code

    async def read(self, reads: Sequence[Any]) -> list[Any]:
        if any(r.tag.startswith(self.prefix) for r in reads):
            if self.exit_code is not None:
                os._exit(self.exit_code)
            from dgstream.workers.engine.types import FatalEngineError

            raise FatalEngineError("CUDA error: an illegal memory access was encountered")
        return await self._passed_on(reads)


class FlakyEngine(_Wrapped):
    """The fake engine, failing now and then as a transient fault does (a CUDA launch
    failure, an OOM under a burst): a read raises a RecoverableEngineError with
    probability `fail_rate` (a seeded generator), but never twice for one request, so a
    retry cures it (errors that follow an input are CrashOn's). While `down` is set,
    every read raises EngineUnavailable (a remote server out of reach for a moment).
    `calls` and `failures` count the reads."""

    def __init__(self, inner: Any, fail_rate: float = 0.2, seed: int = 0) -> None:
        import random

        super().__init__(inner)
        self.fail_rate = fail_rate
        self.down = threading.Event()
        self._rng = random.Random(seed)
        self._failed: set[str] = set()  # tags of the reads a failure has hit
        self.calls = 0
        self.failures = 0

    async def read(self, reads: Sequence[Any]) -> list[Any]:
        from dgstream.workers.engine.types import EngineUnavailable, RecoverableEngineError

        self.calls += 1
        if self.down.is_set():
            self.failures += 1
            raise EngineUnavailable("connection refused")
        tags = {r.tag for r in reads}
        if not tags & self._failed and self._rng.random() < self.fail_rate:
            self._failed |= tags
            self.failures += 1
            raise RecoverableEngineError("CUDA error: unspecified launch failure")
        return await self._passed_on(reads)


def classifier_with(engine_type: Callable[[Any], Any], settings: Any) -> tuple[Any, Any]:
    """A classifier for `settings`' question sets whose engine is `engine_type(fake)`;
    returns (classifier, engine)."""
    from dgstream.workers.engine.factory import EngineSettings, build_classifier

    classifier = build_classifier(EngineSettings(backend="fake"), settings.question_sets, "t")
    classifier.engine = engine_type(classifier.engine)
    return classifier, classifier.engine


# --------------------------------------------------------------------------- the group


@contextlib.contextmanager
def _admin(conn: KafkaConnection) -> Iterator[Any]:
    """An admin client for the block, closed after it."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(**conn.client_kwargs(client_id="dgstream-tests-faults"))
    try:
        yield admin
    finally:
        admin.close()


def member_ids(conn: KafkaConnection, group: str) -> set[str]:
    with _admin(conn) as admin:
        described = admin.describe_groups([group])
    return {m["member_id"] for m in described[group]["members"]}


def group_members(conn: KafkaConnection, group: str) -> list[dict[str, Any]]:
    """The group's members as the coordinator describes them (member_id, client_id, ...)."""
    with _admin(conn) as admin:
        described = admin.describe_groups([group])
    return list(described[group]["members"])


def kick_member(conn: KafkaConnection, group: str, member_id: str) -> None:
    """Remove a dynamic member from its group, as the coordinator does when its session
    expires: its next heartbeat gets UNKNOWN_MEMBER_ID, its partitions are lost."""
    from kafka.admin import MemberToRemove

    with _admin(conn) as admin:
        result = admin.remove_group_members(group, [MemberToRemove(member_id=member_id)])
    errors = [e for e in result.values() if e.__name__ != "NoError"]
    assert not errors, errors


def kick_worker(conn: KafkaConnection, group: str, worker: Any, timeout_s: float = 30) -> str:
    """Kick a running `StreamWorker` out of its group; returns the member id it had."""
    member: str = wait_for(
        lambda: worker.status()["group"]["member_id"], timeout_s, "the worker's member id"
    )
    kick_member(conn, group, member)
    return member


def delete_topic(conn: KafkaConnection, topic: str) -> None:
    """Delete a topic and wait until the cluster no longer lists it (a worker's producer,
    which does not auto-create topics, then cannot write to it)."""
    with _admin(conn) as admin:
        admin.delete_topics([topic])
        wait_for(lambda: topic not in admin.list_topics(), 30, f"{topic} deleted")


def set_topic_config(conn: KafkaConnection, topic: str, configs: dict[str, str]) -> None:
    """Change a topic's configs (dynamic: they take effect within moments)."""
    from kafka.admin import ConfigResource, ConfigResourceType

    with _admin(conn) as admin:
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs=configs)])


def transaction_state(conn: KafkaConnection, transactional_id: str) -> str:
    """The transaction coordinator's state of a transactional id ("Ongoing" while a
    transaction is open)."""
    with _admin(conn) as admin:
        described = admin.describe_transactions([transactional_id])
    state = described[transactional_id].state
    return str(getattr(state, "value", state))


# --------------------------------------------------------------------------- logs


class LogTap:
    """Wraps a worker's logger: records each event name and runs a hook (once) when an
    event is logged, on the thread that logs it, before the worker goes on."""

    def __init__(self, worker: Any) -> None:
        self.inner = worker.log
        worker.log = self
        self.events: list[str] = []
        self.hooks: dict[str, Callable[[], None]] = {}
        self._lock = threading.Lock()

    def _emit(self, level: str, event: str, **kw: Any) -> None:
        with self._lock:
            self.events.append(event)
            hook = self.hooks.pop(event, None)
        if hook is not None:
            hook()
        getattr(self.inner, level)(event, **kw)

    def debug(self, event: str, **kw: Any) -> None:
        self._emit("debug", event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._emit("info", event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._emit("warning", event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._emit("error", event, **kw)

"""Shared fixtures. Keep this general: each area adds its own fixtures below its section.

Kafka: `kafka_broker` is ONE real broker (KRaft, loopback, a free port, a temporary home)
for the whole session; tests isolate themselves with `unique_name`, `topic` and `group`.
A test using it fails, never skips, when the broker's jars cannot be fetched or it does
not start. `secure_broker` is a second one with TLS and SCRAM-SHA-512 listeners
(`tests/secure_kafka.py`), started only when a test asks for it.

Caches: the models the tests build (the tiny random DiffusionGemma) go to a cache of this
session, never one an earlier run left under $HOME (see `_session_model_cache`).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

# Every local Ray cluster a test starts (in this process or a subprocess) runs its workers
# at normal priority; at Ray's default niceness (15) a worker on a busy 2-core CI machine
# starved (see `topology.cli.demo.LOCAL_WORKER_NICENESS`).
os.environ.setdefault("RAY_worker_niceness", "0")

if TYPE_CHECKING:
    from secure_kafka import SecureBroker

    from dgstream.infra.kafka.broker import BrokerInfo
    from dgstream.workers.kafka.settings import KafkaConnection


# --------------------------------------------------------------------------- caches

# Names a model cache to share across sessions on purpose: `make mutation` runs the suite
# once per mutant and builds the tiny model once for the whole run.
SHARED_CACHE_ENV = "DGSTREAM_TEST_CACHE_DIR"


@pytest.fixture(scope="session", autouse=True)
def _session_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """`DGSTREAM_CACHE_DIR` for the session: a fresh directory, so a tiny model is built by
    this code (its cache key is its spec and the library versions, not the code that builds
    it). Processes the tests start (Ray workers, CLIs) inherit it."""
    name = "DGSTREAM_CACHE_DIR"  # dgstream.workers.engine.models.cache_root
    before = os.environ.get(name)
    os.environ[name] = os.environ.get(SHARED_CACHE_ENV) or str(
        tmp_path_factory.mktemp("dgstream-cache")
    )
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


# --------------------------------------------------------------------------- names


def _slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:limit] or "t"


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """`unique_name("out")` -> "out-<test name>-<random>", a valid Kafka topic/group name.

    Every call gives a new name, so one test can make several topics."""
    base = _slug(request.node.name)

    def make(prefix: str = "dg") -> str:
        return f"{_slug(prefix, 20)}-{base}-{uuid.uuid4().hex[:10]}"

    return make


@pytest.fixture
def topic(unique_name: Callable[[str], str]) -> str:
    """A fresh topic name (the topic itself is not created)."""
    return unique_name("topic")


@pytest.fixture
def group(unique_name: Callable[[str], str]) -> str:
    """A fresh consumer group id."""
    return unique_name("group")


# --------------------------------------------------------------------------- Kafka


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerInfo]:
    """A real single-node Kafka 4.x broker for the session; stopped at the end."""
    from dgstream.infra.kafka import broker

    try:
        broker.fetch()
    except broker.BrokerError as exc:
        pytest.fail(f"cannot fetch Kafka's jars (Maven Central): {exc}", pytrace=False)
    home = tmp_path_factory.mktemp("kafka-home")
    try:
        info = broker.start(home, port=0)
    except broker.BrokerError as exc:
        pytest.fail(f"cannot start the Kafka broker: {exc}", pytrace=False)
    try:
        yield info
    finally:
        broker.stop(home, delete_data=True)


@pytest.fixture
def kafka_connection(kafka_broker: BrokerInfo) -> KafkaConnection:
    """Connection settings for the session broker."""
    from dgstream.workers.kafka.settings import KafkaConnection

    return KafkaConnection(bootstrap_servers=kafka_broker.bootstrap_servers)


@pytest.fixture
def kafka_admin(kafka_connection: KafkaConnection) -> Iterator[Any]:
    """A kafka-python `KafkaAdminClient` on the session broker, closed after the test."""
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(**kafka_connection.client_kwargs(client_id="dgstream-tests"))
    try:
        yield admin
    finally:
        admin.close()


@pytest.fixture(scope="session")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    """A real broker whose client listeners are TLS (certificates made with keytool now)
    and SASL_SSL with one SCRAM-SHA-512 user. Its password, and a wrong one, are random and
    live only in this process's environment (`SecureBroker.password_env`, by name) for
    the session; stopped and unset at the end."""
    import secrets

    from secure_kafka import PASSWORD_ENV, USER, WRONG_PASSWORD_ENV, SecureBroker

    from dgstream.infra.kafka import broker

    try:
        broker.fetch()
    except broker.BrokerError as exc:
        pytest.fail(f"cannot fetch Kafka's jars (Maven Central): {exc}", pytrace=False)
    home = tmp_path_factory.mktemp("kafka-secure")
    password = secrets.token_urlsafe(24)
    os.environ[PASSWORD_ENV] = password
    os.environ[WRONG_PASSWORD_ENV] = secrets.token_urlsafe(24)
    try:
        try:
            info = broker.start_secure(home, users={USER: password})
        except broker.BrokerError as exc:
            pytest.fail(f"cannot start the TLS/SCRAM broker: {exc}", pytrace=False)
        try:
            yield SecureBroker(info, info.extra["ca_file"])
        finally:
            broker.stop(home, delete_data=True)
    finally:
        os.environ.pop(PASSWORD_ENV, None)
        os.environ.pop(WRONG_PASSWORD_ENV, None)

"""A real Apache Kafka broker (KRaft) on loopback, run from Maven Central jars, for tests,
benchmarks and `dgstream broker`. It talks to nothing but Maven Central (only when the jar
cache is missing or stale: the pinned jars of `infra/kafka/jars.lock.json`) and 127.0.0.1.

One module per job: `jars` (fetch), `config` (ports, `server.properties`), `process` (the
JVMs), `lifecycle` (start, resume, stop, status), `secure` (TLS/SCRAM), `faults` (kill,
freeze, restart one node), `cli`, and `state` (the home and its state file). Callers use
this package's names: `from dgstream.infra.kafka import broker; broker.start(...)`.

The home defaults to `<repo>/.cache/kafka/run` (`DGSTREAM_KAFKA_HOME` or `home=`), the jars
to `<repo>/.cache/kafka/lib` (`DGSTREAM_KAFKA_LIB`); `DGSTREAM_KAFKA_HEAP_OPTS` (default
"-Xms128m -Xmx512m") and `DGSTREAM_KAFKA_JVM_OPTS` tune the JVM.
"""

from __future__ import annotations

from dgstream.infra.kafka.broker.cli import add_arguments, cli, main
from dgstream.infra.kafka.broker.config import DEFAULT_CLIENT_PORT
from dgstream.infra.kafka.broker.faults import freeze_node, kill_node, restart_node
from dgstream.infra.kafka.broker.jars import (
    LIB_ENV,
    LOCK_PATH,
    MARKER_NAME,
    POM_PATH,
    FetchResult,
    default_lib_dir,
    fetch,
    lock,
    marker_path,
)
from dgstream.infra.kafka.broker.lifecycle import start, start_cluster, status, stop
from dgstream.infra.kafka.broker.process import HEAP_ENV, JVM_OPTS_ENV, KAFKA_MAIN, STORAGE_TOOL
from dgstream.infra.kafka.broker.secure import SCRAM_MECHANISM, start_secure
from dgstream.infra.kafka.broker.state import (
    HOME_ENV,
    LOOPBACK,
    REPO_ROOT,
    STATE_NAME,
    BrokerError,
    BrokerInfo,
    NodeInfo,
    default_home,
)

__all__ = [
    "DEFAULT_CLIENT_PORT",
    "HEAP_ENV",
    "HOME_ENV",
    "JVM_OPTS_ENV",
    "KAFKA_MAIN",
    "LIB_ENV",
    "LOCK_PATH",
    "LOOPBACK",
    "MARKER_NAME",
    "POM_PATH",
    "REPO_ROOT",
    "SCRAM_MECHANISM",
    "STATE_NAME",
    "STORAGE_TOOL",
    "BrokerError",
    "BrokerInfo",
    "FetchResult",
    "NodeInfo",
    "add_arguments",
    "cli",
    "default_home",
    "default_lib_dir",
    "fetch",
    "freeze_node",
    "kill_node",
    "lock",
    "main",
    "marker_path",
    "restart_node",
    "start",
    "start_cluster",
    "start_secure",
    "status",
    "stop",
]

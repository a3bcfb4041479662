"""Producers dgstream does not use, as Kafka shops run them: librdkafka (through
confluent-kafka) and Kafka's own Java console producer (`kafka-tools`, beside the broker's
jars). Each sends records with keys and headers in batches of the codec it is given.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CODECS = ("gzip", "snappy", "lz4", "zstd")
CONSOLE_PRODUCER = "org.apache.kafka.tools.ConsoleProducer"
# The console tool's INFO lines (its whole config) are noise here.
_QUIET_LOG4J = """\
status = warn
appender.err.type = Console
appender.err.name = STDERR
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = %p %m%n
rootLogger.level = WARN
rootLogger.appenderRef.err.ref = STDERR
"""


@dataclass(frozen=True)
class Record:
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


def librdkafka_produce(
    bootstrap: str,
    topic: str,
    records: Sequence[Record],
    codec: str,
    *,
    transactional_id: str | None = None,
    abort: Sequence[Record] = (),
) -> None:
    """Send with librdkafka, idempotent, batched (`linger.ms`); with `transactional_id`,
    `records` in a committed transaction and `abort` in an aborted one after it."""
    from confluent_kafka import KafkaException, Producer

    conf = {
        "bootstrap.servers": bootstrap,
        "compression.type": codec,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 50,
        "log_level": 3,
    }
    if transactional_id:
        conf["transactional.id"] = transactional_id
    producer = Producer(conf)
    errors: list[str] = []

    def report(err: object, _msg: object) -> None:
        if err is not None:
            errors.append(str(err))

    def send(batch: Sequence[Record]) -> None:
        for r in batch:
            producer.produce(topic, key=r.key, value=r.value, headers=r.headers, on_delivery=report)
        producer.flush(60)

    try:
        if transactional_id:
            producer.init_transactions(60)
            producer.begin_transaction()
            send(records)
            producer.commit_transaction(60)
            if abort:
                producer.begin_transaction()
                send(abort)
                producer.abort_transaction(60)
        else:
            send(records)
    except KafkaException as exc:
        raise AssertionError(f"librdkafka ({codec}): {exc}") from exc
    left = producer.flush(60)
    assert not errors and not left, f"librdkafka ({codec}): {errors or f'{left} not delivered'}"


@functools.cache
def _quiet_log4j() -> Path:
    """The console producers' logging configuration: one file for the test process, removed
    when it exits (the JVMs read it at their start)."""
    folder = Path(tempfile.mkdtemp(prefix="dg-console-"))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "log4j2.properties"
    path.write_text(_QUIET_LOG4J)
    return path


def console_produce(
    java: str,
    lib_dir: str | Path,
    bootstrap: str,
    topic: str,
    records: Sequence[Record],
    codec: str,
) -> subprocess.Popen[bytes]:
    """Start Kafka's console producer on `records` (one line each: headers, key, value,
    tab-separated); idempotent, batched. Returns the process (wait on it: `finish`)."""
    for r in records:
        for part in (r.key, r.value, *(v for _, v in r.headers)):
            assert b"\t" not in part and b"\n" not in part, "the console format splits on these"
        assert all(b"," not in v and b":" not in v for _, v in r.headers), r.headers
    lines = b"".join(
        b",".join(k.encode() + b":" + v for k, v in r.headers)
        + b"\t"
        + r.key
        + b"\t"
        + r.value
        + b"\n"
        for r in records
    )
    log4j = _quiet_log4j()
    cmd = [
        java,
        "-Xmx256m",
        "-XX:TieredStopAtLevel=1",  # a short-lived tool: start fast, no C2
        f"-Dlog4j2.configurationFile={log4j}",
        "-cp",
        f"{lib_dir}{os.sep}*",
        CONSOLE_PRODUCER,
        "--bootstrap-server",
        bootstrap,
        "--topic",
        topic,
        "--compression-codec",
        codec,
        "--reader-property",
        "parse.key=true",
        "--reader-property",
        "parse.headers=true",
        "--command-property",
        "enable.idempotence=true",
        "--command-property",
        "acks=all",
        "--command-property",
        "linger.ms=100",
    ]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert proc.stdin is not None
    proc.stdin.write(lines)
    proc.stdin.close()
    return proc


def finish(proc: subprocess.Popen[bytes], what: str, timeout_s: float = 120.0) -> None:
    """Wait for a console producer; fail with its output when it did not exit 0."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-3000:]}"

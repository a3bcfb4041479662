"""TLS and SASL/SCRAM-SHA-512 against a real broker (`secure_broker`: certificates made with
keytool, one SCRAM user): the worker, the client and the `dgstream` commands connect with
one `KafkaConnection` whose password is named, never written; a wrong password, an unknown
user, an untrusted certificate or a listener of another protocol is one clear error at
once; no password reaches a log, an error message or the command's output."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_runner import run_cli
from secure_kafka import WRONG_PASSWORD_ENV, SecureBroker

from bench.harness.pipeline import INLINE, Pipeline, WorkerThread
from dgstream import Client, KafkaConnectError, RequestFailed
from dgstream.workers.kafka.admin import ensure_topics
from dgstream.workers.kafka.probe import check_connection

pytestmark = [pytest.mark.broker]


def _pipeline(conn: Any, unique_name: Callable[[str], str]) -> Pipeline:
    p = Pipeline(
        conn,
        input=unique_name("in"),
        output=unique_name("out"),
        dead=unique_name("dlq"),
        group=unique_name("g"),
    )
    ensure_topics(conn, {p.input: 2, p.output: 2, p.dead: 1})
    return p


def _no_secret(secure: SecureBroker, *texts: str) -> None:
    for text in texts:
        for secret in secure.secrets():
            assert secret not in text


# --------------------------------------------------------------------------- the check


@pytest.mark.parametrize(
    ("case", "changes", "reason", "says"),
    [
        ("wrong password", {"sasl_password_env": WRONG_PASSWORD_ENV}, "authentication", "refused"),
        ("unknown user", {"sasl_username": "nobody"}, "authentication", "'nobody'"),
        (
            "variable not set here",
            {"sasl_password_env": "DGSTREAM_TEST_UNSET_PASSWORD"},
            "secret",
            "DGSTREAM_TEST_UNSET_PASSWORD is not set",
        ),
        ("untrusted certificate", {"ssl_cafile": None}, "tls", "not trusted"),
        ("mechanism not offered", {"sasl_mechanism": "SCRAM-SHA-256"}, "authentication", "offers"),
    ],
)
def test_a_refused_connection_says_why_at_once(
    secure_broker: SecureBroker, case: str, changes: dict[str, Any], reason: str, says: str
) -> None:
    check_connection(secure_broker.connection())  # the right settings pass
    with pytest.raises(KafkaConnectError) as info:
        check_connection(secure_broker.connection(**changes))
    assert info.value.reason == reason and info.value.fatal
    assert says in str(info.value)
    if reason != "secret":  # no connection is tried without the password
        assert secure_broker.sasl_ssl in str(info.value)
    _no_secret(secure_broker, str(info.value), repr(info.value))


def test_tls_only_listener_and_protocol_mismatches(secure_broker: SecureBroker) -> None:
    from dgstream.workers.kafka.settings import KafkaConnection

    tls = KafkaConnection(
        bootstrap_servers=secure_broker.ssl,
        security_protocol="SSL",
        ssl_cafile=secure_broker.ca_file,
    )
    check_connection(tls)
    ensure_topics(tls, {"tls-only-check": 1})  # kafka-python itself over TLS
    # Plaintext to a TLS listener: the broker closes the connection; said so, not a hang.
    with pytest.raises(KafkaConnectError) as info:
        check_connection(KafkaConnection(bootstrap_servers=secure_broker.sasl_ssl))
    assert info.value.reason == "protocol" and "security_protocol" in str(info.value)
    # SASL to the TLS-only listener.
    with pytest.raises(KafkaConnectError) as info:
        check_connection(secure_broker.connection(bootstrap_servers=[secure_broker.ssl]))
    assert info.value.reason == "protocol" and "not a SASL listener" in str(info.value)


def test_kafka_python_debug_log_masks_the_password(
    secure_broker: SecureBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """KafkaAdminClient logs its whole configuration at DEBUG: an application that turns
    kafka-python's DEBUG on still sees no password."""
    from kafka import KafkaAdminClient

    caplog.set_level(logging.DEBUG, logger="kafka")
    admin = KafkaAdminClient(**secure_broker.connection().client_kwargs())
    try:
        assert admin.describe_cluster()["cluster_id"] == secure_broker.info.cluster_id
    finally:
        admin.close()
    assert "Starting KafkaAdminClient with configuration" in caplog.text
    assert "sasl_plain_password" in caplog.text
    _no_secret(secure_broker, caplog.text)


# --------------------------------------------------------------------------- worker, client


def test_worker_and_client_over_tls_and_scram(
    caplog: pytest.LogCaptureFixture,
    secure_broker: SecureBroker,
    unique_name: Callable[[str], str],
    worker_threads: list[WorkerThread],
    tmp_path: Path,
) -> None:
    """(The worker's own JSON log lines go to stderr; the Ray test reads them from Ray's
    log files. capfd here would hand structlog, configured once per process, a stream that
    closes with this test.)"""
    from dgstream.topology.spec import load_topology

    caplog.set_level(logging.DEBUG)
    p = _pipeline(secure_broker.connection(), unique_name)
    # The worker and the client connect with the topology file's kafka section, as is.
    conn = load_topology(_topology_file(tmp_path / "t.yaml", secure_broker, p)).kafka
    worker_threads.append(WorkerThread(p.settings(kafka=conn)).start())
    with Client(conn, p.input, dead_letter_topic=p.dead, timeout_s=60) as client:
        result = client.classify("see you at the game", INLINE, id="tls-1")
        assert result.id == "tls-1" and set(result.answers) == set(INLINE)
        # The dead-letter path over TLS too: a question set the pipeline does not know.
        with pytest.raises(RequestFailed) as failed:
            client.classify("x", question_set="nope", id="tls-2")
        assert failed.value.error.code == "UNKNOWN_QUESTION_SET"
    status = worker_threads[0].worker.status()
    assert status["answered"] >= 1
    _no_secret(secure_broker, caplog.text, repr(p.settings(kafka=conn)), json.dumps(status))


def test_client_with_a_wrong_password_fails_at_once(
    secure_broker: SecureBroker, unique_name: Callable[[str], str]
) -> None:
    wrong = secure_broker.connection(sasl_password_env=secure_broker.wrong_password_env)
    with pytest.raises(KafkaConnectError) as info:
        Client(wrong, unique_name("in"))
    assert info.value.reason == "authentication"
    assert f"user {secure_broker.user!r}" in str(info.value)
    _no_secret(secure_broker, str(info.value))


# --------------------------------------------------------------------------- the commands


def _topology_file(path: Path, secure: SecureBroker, p: Pipeline, **kafka: Any) -> Path:
    topo = {
        "kafka": secure.kafka_section(**kafka),
        "pipelines": [
            {
                "name": "secure",
                "input_topics": [p.input],
                "output_topic": p.output,
                "dead_letter_topic": p.dead,
                "consumer_group": p.group,
                "engine": {"backend": "fake"},
            }
        ],
    }
    path.write_text(yaml.safe_dump(topo))
    return path


def test_commands_connect_with_the_topology_or_environment_settings(
    secure_broker: SecureBroker,
    unique_name: Callable[[str], str],
    worker_threads: list[WorkerThread],
    tmp_path: Path,
) -> None:
    conn = secure_broker.connection()
    p = _pipeline(conn, unique_name)
    worker_threads.append(WorkerThread(p.settings()).start())
    topo = _topology_file(tmp_path / "secure.yaml", secure_broker, p)
    requests = tmp_path / "requests.jsonl"
    good = [{"id": f"cli-{i}", "state": f"message {i}", "questions": INLINE} for i in range(3)]
    bad = {"id": "cli-bad", "state": "x", "question_set": "nope"}
    requests.write_text("".join(json.dumps(r) + "\n" for r in [*good, bad]))
    outputs: list[str] = []

    # produce with the topology file's settings
    sent = run_cli("produce", p.input, str(requests), "--topology", str(topo))
    assert sent.returncode == 0, sent.stderr[-3000:]
    assert "sent 4, refused 0" in sent.stdout
    outputs += [sent.stdout, sent.stderr]

    # tail with the DGSTREAM_KAFKA_* variables, --bootstrap replacing only the servers:
    # the TLS and SASL settings stay (the variables point at a dead port).
    env = secure_broker.env(DGSTREAM_KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1")
    tail = run_cli(
        "tail", p.output, "--from-beginning", "--max", "3", "--json",
        "--bootstrap", secure_broker.sasl_ssl, env=env, timeout=120,
    )  # fmt: skip
    assert tail.returncode == 0, tail.stderr[-3000:]
    assert sorted(json.loads(line)["id"] for line in tail.stdout.splitlines()) == [
        "cli-0",
        "cli-1",
        "cli-2",
    ]
    outputs += [tail.stdout, tail.stderr]

    # dlq with the topology file, --bootstrap given as well (same rule)
    dlq = run_cli(
        "dlq", p.dead, "--from-beginning", "--max", "1", "--topology", str(topo),
        "--bootstrap", secure_broker.sasl_ssl, timeout=120,
    )  # fmt: skip
    assert dlq.returncode == 0, dlq.stderr[-3000:]
    assert "cli-bad  UNKNOWN_QUESTION_SET" in dlq.stdout
    outputs += [dlq.stdout, dlq.stderr]

    # A wrong password, from the file or from the variables: one line, exit 2, at once.
    wrong_topo = _topology_file(
        tmp_path / "wrong.yaml",
        secure_broker,
        p,
        sasl_password_env=secure_broker.wrong_password_env,
    )
    wrong_env = secure_broker.env(DGSTREAM_KAFKA_SASL_PASSWORD=secure_broker.secrets()[1])
    for args, extra in (
        (["produce", p.input, str(requests), "--topology", str(wrong_topo)], None),
        (["tail", p.output, "--max", "1"], wrong_env),
        (["dlq", p.dead, "--max", "1", "--topology", str(wrong_topo)], None),
    ):
        refused = run_cli(*args, env=extra, timeout=60)
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr[-2000:])
        assert refused.stderr.startswith("error: authentication failed at "), refused.stderr
        assert "Traceback" not in refused.stderr
        outputs += [refused.stdout, refused.stderr]

    # No Kafka named at all: said so, not a pydantic traceback.
    nowhere = run_cli(
        "tail",
        p.output,
        env={"DGSTREAM_KAFKA_BOOTSTRAP_SERVERS": "", "DGSTREAM_KAFKA_HOME": str(tmp_path)},
    )
    assert nowhere.returncode == 2 and "no Kafka to connect to" in nowhere.stderr
    assert "Traceback" not in nowhere.stderr

    # Nothing printed, and nothing the broker logged, holds a password.
    broker_log = Path(secure_broker.info.nodes[0].log_file).read_text(errors="replace")
    assert "Failed authentication" in broker_log  # the broker saw the wrong logins
    _no_secret(secure_broker, broker_log, *outputs)


def test_secure_broker_keeps_no_password_in_its_state(secure_broker: SecureBroker) -> None:
    from dgstream.infra.kafka import broker

    home = Path(secure_broker.info.home)
    st = broker.status(home)
    assert st["running"] and st["answers_metadata"]  # over its own loopback listener
    assert st["extra"]["sasl_ssl_bootstrap"] == secure_broker.sasl_ssl
    _no_secret(secure_broker, (home / "state.json").read_text(), json.dumps(st))
    props = Path(secure_broker.info.nodes[0].properties)
    assert props.stat().st_mode & 0o077 == 0  # it holds the key store's password
    assert "SASL_SSL://127.0.0.1:" in props.read_text()
    _no_secret(secure_broker, props.read_text())

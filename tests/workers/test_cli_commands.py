"""Each Kafka-facing `dgstream` command run as a subprocess against the real broker:
produce (validation before sending), tail (results), dlq (inspect, replay), ask (no Kafka)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_runner import run_cli

from bench.harness.pipeline import OutputReader, Pipeline, WorkerThread
from bench.harness.waiting import wait_for

pytestmark = [pytest.mark.broker]

CLI = [sys.executable, "-m", "dgstream.topology.cli"]
QUESTIONS = {"toxic": {"type": "noul", "instructions": "Is it toxic?"}}


def test_produce_tail_dlq_and_replay(
    pipeline: Pipeline, worker_threads: list[WorkerThread], tmp_path: Path
) -> None:
    boot = ",".join(pipeline.conn.bootstrap_servers)
    good = [{"id": f"cli-{i}", "state": f"text {i}", "questions": QUESTIONS} for i in range(5)]
    lines = [json.dumps(g) for g in good] + ['{"id": "broken", "state": 7}']
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")

    # produce: the bad line is refused with its code and line number; the rest are sent.
    out = run_cli("produce", pipeline.input, str(path), "--bootstrap", boot)
    assert out.returncode == 1, out.stderr
    assert "sent 5, refused 1" in out.stdout
    assert "line 6: WRONG_TYPE" in out.stderr and "state" in out.stderr
    # --no-validate sends it anyway: the worker dead-letters it.
    out = run_cli(
        "produce", pipeline.input, "--no-validate", "--bootstrap", boot, stdin=lines[-1] + "\n"
    )
    assert out.returncode == 0 and "sent 1, refused 0" in out.stdout

    worker_threads.append(WorkerThread(pipeline.settings()).start())
    reader: OutputReader = pipeline.reader()
    reader.read_until(lambda r: len(set(r.keys())) >= 5, 60, "5 results")

    # tail: one readable line per result.
    out = run_cli("tail", pipeline.output, "--from-beginning", "--max", "5", "--bootstrap", boot)
    assert out.returncode == 0, out.stderr
    assert sorted(line.split()[0] for line in out.stdout.splitlines()) == sorted(
        g["id"] for g in good
    )
    assert all("toxic:" in line for line in out.stdout.splitlines())

    # dlq: the dead letter names its code, field and source; replay sends the original.
    replay = pipeline.input + "-replay"
    out = run_cli(
        "dlq",
        pipeline.dead,
        "--from-beginning",
        "--max",
        "1",
        "--replay-to",
        replay,
        "--bootstrap",
        boot,
    )
    assert out.returncode == 0, out.stderr
    assert "broken  WRONG_TYPE" in out.stdout and f"[{pipeline.input}/" in out.stdout
    assert "replayed 1" in out.stdout
    again = OutputReader(pipeline.conn, replay, False)
    try:
        again.read_until(lambda r: len(r.records) >= 1, 30, "the replayed message")
        assert again.records[0].value == lines[-1].encode()
    finally:
        again.close()


@pytest.mark.model
def test_ask_answers_locally() -> None:
    req = json.dumps({"id": "ask-1", "state": "hello", "questions": QUESTIONS})
    out = run_cli("ask", req, "--json", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["id"] == "ask-1" and result["answers"]["toxic"]["type"] == "yes_no"
    bad = run_cli("ask", '{"id": "x"}')
    assert bad.returncode == 2
    assert json.loads(bad.stdout)["error"]["code"] == "MISSING_FIELD"


@pytest.mark.model
def test_ask_takes_a_jev_body_without_id_as_the_worker_does() -> None:
    """A Jev body has no id: `ask` names it after its bytes (as the worker names one after
    its record), so the same body gets the same id, the same noise and the same answer."""
    body = json.dumps(
        {
            "model": "jev-latest",
            "state": "hello",
            "questions": {"billing": {"type": "noul", "instructions": "Is this about billing?"}},
        }
    )
    first = run_cli("ask", body, "--json", "--device", "cpu")
    assert first.returncode == 0, first.stdout + first.stderr
    result = json.loads(first.stdout)
    assert result["id"].startswith("ask-") and result["id_source"] == "record"
    assert result["requested_model"] == "jev-latest"
    assert set(result["answers"]) == {"billing"}
    laid_out = json.dumps(json.loads(body), indent=4)  # the same body, spaced otherwise
    again = json.loads(run_cli("ask", laid_out, "--json", "--device", "cpu").stdout)
    assert (again["id"], again["answers"]) == (result["id"], result["answers"])
    other = run_cli("ask", body.replace("hello", "hello!"), "--json", "--device", "cpu")
    assert json.loads(other.stdout)["id"] != result["id"]


def test_produce_sends_jev_bodies_and_tail_reads_jev_results(pipeline: Pipeline) -> None:
    """Jev's bodies have no id: produce accepts them and sends them without a key (the
    worker names them by topic-partition-offset); tail shows a Jev-format result under its
    record's key."""
    from kafka import KafkaProducer

    from dgstream.schemas import JevResponse

    boot = ",".join(pipeline.conn.bootstrap_servers)
    examples = Path(__file__).resolve().parents[2] / "topology" / "examples"
    jsonl = examples / "jev-requests.jsonl"
    n = len(jsonl.read_text(encoding="utf-8").splitlines())
    out = run_cli("produce", pipeline.input, str(jsonl), "--bootstrap", boot)
    assert out.returncode == 0 and f"sent {n}, refused 0" in out.stdout, out.stderr
    sent = OutputReader(pipeline.conn, pipeline.input, False)
    try:
        sent.read_until(lambda r: len(r.records) >= n, 30, "the Jev bodies")
        assert all(r.key is None for r in sent.records)
        assert sorted(r.value for r in sent.records) == sorted(
            line.encode() for line in jsonl.read_text(encoding="utf-8").splitlines()
        )
    finally:
        sent.close()

    jev = JevResponse.model_validate(
        {
            "model": "demo",
            "answers": {
                "insult": {"type": "noul", "noul": 0.97},
                "language": {
                    "type": "choice",
                    "choice": "english",
                    "confidence": 0.9,
                    "probabilities": {"english": 0.9, "french": 0.1},
                },
                "sev": {
                    "type": "score",
                    "score": 1.8,
                    "confidence": 0.8,
                    "probabilities": {"0": 0.0, "1": 0.2, "2": 0.8},
                    "legend": {"0": "none", "1": "mild", "2": "bad"},
                },
            },
            "usage": {"input_tokens": 10, "output_tokens": 16},
        }
    )
    producer = KafkaProducer(acks="all", **pipeline.conn.client_kwargs())
    try:
        value = jev.model_dump_json().encode()
        producer.send(pipeline.output, key=b"order-17", value=value).get(timeout=60)
    finally:
        producer.close()
    out = run_cli("tail", pipeline.output, "--from-beginning", "--max", "1", "--bootstrap", boot)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "order-17",
        "insult:",
        "p_yes=0.97",
        "language:",
        "english",
        "(0.90)",
        "sev:",
        "bad",
        "score=1.80",
    ]


def _bad_records(pipeline: Pipeline, worker_threads: list[WorkerThread], n: int) -> None:
    """`n` records the worker dead-letters (INVALID_JSON and, every third, WRONG_TYPE)."""
    values = [b'{"id": "w%d", "state": 7}' % i if i % 3 == 0 else b"{nope %d" % i for i in range(n)]
    pipeline.produce(values, keys=[f"k{i}".encode() for i in range(n)])
    worker_threads.append(WorkerThread(pipeline.settings()).start())
    r = pipeline.reader(pipeline.dead)
    r.read_until(lambda x: len(x.records) >= n, 60, f"{n} dead letters")


def test_dlq_lists_from_the_beginning_and_exits_at_the_end(
    pipeline: Pipeline, worker_threads: list[WorkerThread], tmp_path: Path
) -> None:
    """`dgstream dlq TOPIC` lists what is there and exits (no --from-beginning, no
    --idle-s); --code filters; --follow alone waits for new ones only; --follow
    --from-beginning lists what is there, then what arrives, until Ctrl-C."""
    boot = ",".join(pipeline.conn.bootstrap_servers)
    _bad_records(pipeline, worker_threads, 6)
    out = run_cli("dlq", pipeline.dead, "--bootstrap", boot, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 6 and "6 dead letter(s) in" in out.stderr, (out.stdout, out.stderr)
    assert sum("INVALID_JSON" in ln for ln in lines) == 4
    only = run_cli("dlq", pipeline.dead, "--code", "WRONG_TYPE", "--bootstrap", boot)
    assert only.returncode == 0 and len(only.stdout.splitlines()) == 2, only.stdout
    assert "2 dead letter(s) with code WRONG_TYPE" in only.stderr
    # --follow alone: from the end (the old default), so nothing of what is there.
    new_only = run_cli("dlq", pipeline.dead, "--follow", "--idle-s", "3", "--bootstrap", boot)
    assert new_only.returncode == 0 and new_only.stdout == "", new_only.stdout

    listing = tmp_path / "follow.txt"
    with listing.open("w") as sink:
        proc = subprocess.Popen(
            [*CLI, "dlq", pipeline.dead, "--follow", "--from-beginning", "--bootstrap", boot],
            cwd=Path(__file__).resolve().parents[2],
            stdout=sink,
            stderr=subprocess.PIPE,
            # Without PYTHONUNBUFFERED (a developer's shell may set it): the lines must
            # come as they are found, into a file as into a pipe.
            env={
                **{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
                "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            },
            # As a shell starts a background job, SIGINT ignored: Ctrl-C must work anyway.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
        try:
            wait_for(lambda: len(listing.read_text().splitlines()) >= 6, 60, "the six")
            pipeline.produce([b"{late"], keys=[b"k-late"])
            wait_for(
                lambda: (
                    "INVALID_JSON" in listing.read_text().splitlines()[-1]
                    and len(listing.read_text().splitlines()) == 7
                ),
                60,
                "the new one",
            )
            assert proc.poll() is None  # still following
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()[-2000:]


def test_commands_use_the_local_broker_when_no_kafka_is_named(
    pipeline: Pipeline, kafka_broker: Any, tmp_path: Path
) -> None:
    """No --bootstrap, --topology or DGSTREAM_KAFKA_BOOTSTRAP_SERVERS (as the README shows
    the commands): the broker `dgstream broker start` runs is used; without one, one line
    saying what to do, exit 2, no traceback."""
    local = {"DGSTREAM_KAFKA_BOOTSTRAP_SERVERS": "", "DGSTREAM_KAFKA_HOME": kafka_broker.home}
    line = json.dumps({"id": "local-1", "state": "hi", "questions": QUESTIONS})
    out = run_cli("produce", pipeline.input, env=local, stdin=line + "\n")
    assert out.returncode == 0 and "sent 1, refused 0" in out.stdout, out.stderr
    assert f"the local broker at {kafka_broker.bootstrap}" in out.stderr
    tail = run_cli("tail", pipeline.input, "--from-beginning", "--max", "1", env=local)
    assert tail.returncode == 0 and "(not a result)" in tail.stdout, tail.stderr
    dlq = run_cli("dlq", pipeline.dead, env=local)
    assert dlq.returncode == 0 and "0 dead letter(s)" in dlq.stderr, dlq.stderr

    nowhere = {**local, "DGSTREAM_KAFKA_HOME": str(tmp_path / "no-broker")}
    for args in (["produce", pipeline.input], ["tail", pipeline.output], ["dlq", pipeline.dead]):
        refused = run_cli(*args, env=nowhere, stdin="")
        assert refused.returncode == 2, (args, refused.stderr)
        assert refused.stderr.startswith("error: no Kafka to connect to"), refused.stderr
        assert "dgstream broker start" in refused.stderr and "Traceback" not in refused.stderr

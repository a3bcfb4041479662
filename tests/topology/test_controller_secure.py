"""The controller and its worker on Ray against the TLS + SCRAM-SHA-512 broker
(`secure_broker`), started by `dgstream run` from a topology whose Kafka section names the
password's environment variable. The Ray node carries that variable (as a deployment's Ray
pods do); Ray's control store (the GCS, which keeps every actor's arguments) never held it:
the GCS process is started without it, and its memory is searched for the password while
the controller and the worker run. Also: no password in Ray's log files or `dgstream
status`; a wrong password stops `dgstream run` with the reason; a worker on a node without
the variable says so; a literal password cannot become an actor argument at all."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_runner import run_cli
from secure_kafka import PASSWORD_ENV, WRONG_PASSWORD_ENV, SecureBroker

from bench.harness.pipeline import OutputReader
from bench.harness.ray_cluster import describe_workers, pipeline_status, running_controller
from bench.harness.spike import pipeline_io, request_value, topology, unique
from bench.harness.waiting import wait_for
from dgstream.workers.hosting.actor import replica_prefix

pytestmark = [pytest.mark.broker, pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def secure_ray(secure_broker: SecureBroker) -> Iterator[Any]:
    """One Ray node whose raylet (and so every actor it starts) has the passwords'
    variables, while its GCS and the other head processes do not: the variables leave this
    process's environment while the node starts (`env_vars` is the raylet's only)."""
    from bench.harness.ray_cluster import ray_cluster

    with contextlib.ExitStack() as stack:
        passwords = {k: os.environ.pop(k) for k in (PASSWORD_ENV, WRONG_PASSWORD_ENV)}
        try:
            c = stack.enter_context(ray_cluster([{"num_cpus": 2, "env_vars": passwords}]))
        finally:
            os.environ.update(passwords)
        yield c


def _topology(secure: SecureBroker, name: str, **kafka: Any) -> dict[str, Any]:
    topo = topology([secure.sasl_ssl], name, partitions=2, min_replicas=1, max_replicas=1, gpus=0)
    topo["kafka"] = secure.kafka_section(**kafka)
    topo["ray"]["namespace"] = f"dgstream-secure-{name}"
    return topo


def _gcs_memory_holds(cluster: Any, needles: list[bytes]) -> dict[bytes, bool]:
    """Whether each byte string is anywhere in the GCS server's readable memory."""
    from ray._private import ray_constants

    (gcs,) = cluster.cluster.head_node.all_processes[ray_constants.PROCESS_TYPE_GCS_SERVER]
    pid = gcs.process.pid
    found = dict.fromkeys(needles, False)
    overlap = max(len(n) for n in needles)
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("r"):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            tail = b""
            for at in range(start, end, 1 << 22):
                try:
                    mem.seek(at)
                    chunk = tail + mem.read(min(1 << 22, end - at))
                except (OSError, ValueError, OverflowError):
                    break  # an unreadable mapping ([vvar], guard pages)
                for n in needles:
                    found[n] = found[n] or n in chunk
                tail = chunk[-overlap:]
    return found


def _files_holding(root: Path, secrets: list[str]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            text = path.read_bytes()
            if any(s.encode() in text for s in secrets):
                hits.append(str(path))
    return hits


def test_controller_and_worker_on_ray_over_tls_and_scram(
    secure_ray: Any, secure_broker: SecureBroker, tmp_path: Path
) -> None:
    c = secure_ray
    name = unique("tls")
    topo = _topology(secure_broker, name)
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    # `dgstream run` in an environment WITHOUT the password: it is read on the Ray node.
    env = {PASSWORD_ENV: "", WRONG_PASSWORD_ENV: ""}
    run = run_cli("run", str(path), "--detach", "--address", c.address, env=env, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    with running_controller(topo, drain=False) as ctl:
        wait_for(lambda: pipeline_status(ctl, name)["ready"] == 1, 180, "the worker running")
        conn = secure_broker.connection()
        io = pipeline_io(conn, topo)
        io.produce([request_value(f"s{i}", i) for i in range(20)])
        out = OutputReader(conn, topo["pipelines"][0]["output_topic"], False)
        try:
            out.read_until(lambda r: len(set(r.keys())) >= 20, 300, "20 answers over TLS")
        except BaseException:
            # A fresh-clone CI run once saw no answer in 300 s from a worker said running.
            prefix = replica_prefix(topo["ray"]["deployment"], name)
            print(describe_workers(topo["ray"]["namespace"], prefix, c.temp_dir))
            raise
        finally:
            out.close()

        # dgstream status: the settings by name, never the password.
        st = run_cli("status", "--json", "--topology", str(path), "--address", c.address)
        assert st.returncode == 0, st.stderr[-3000:]
        report = json.loads(st.stdout)
        assert report["kafka"]["sasl_password_env"] == PASSWORD_ENV
        assert report["kafka"]["security_protocol"] == "SASL_SSL"
        assert report["kafka_checked"] and "kafka" not in report["errors"]
        texts = [st.stdout, st.stderr, run.stdout, run.stderr]

        # Ray's control store holds the actors' arguments (the topology, the worker's
        # settings): the variable's NAME is there, the password is not.
        password, wrong = (s.encode() for s in secure_broker.secrets())
        marker = topo["pipelines"][0]["output_topic"].encode()
        held = _gcs_memory_holds(c, [password, wrong, PASSWORD_ENV.encode(), marker])
        assert held[PASSWORD_ENV.encode()] and held[marker], "the search must see the arguments"
        assert not held[password] and not held[wrong], "a password reached Ray's GCS"

    for text in texts:
        for secret in secure_broker.secrets():
            assert secret not in text
    # ... nor any of Ray's log files (the controller's and the worker's JSON lines included).
    logs = Path(c.temp_dir)
    assert any(logs.rglob("worker-*.err")), "no worker logs to search"
    assert _files_holding(logs, secure_broker.secrets()) == []


def test_a_wrong_password_stops_dgstream_run_with_the_reason(
    secure_ray: Any, secure_broker: SecureBroker, tmp_path: Path
) -> None:
    import ray

    from dgstream.topology.controller import get_controller

    name = unique("tlsbad")
    topo = _topology(secure_broker, name, sasl_password_env=WRONG_PASSWORD_ENV)
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    run = run_cli("run", str(path), "--detach", "--address", secure_ray.address, timeout=240)
    assert run.returncode == 2, (run.stdout, run.stderr[-3000:])
    assert re.search(
        r"error: the controller cannot use kafka: authentication failed at ", run.stderr
    )
    assert f"user {secure_broker.user!r}" in run.stderr and "Traceback" not in run.stderr
    for secret in secure_broker.secrets():
        assert secret not in run.stdout + run.stderr
    # The refused controller was removed, and started no worker.
    with pytest.raises(ValueError):
        get_controller(name, topo["ray"]["namespace"])
    ns = topo["ray"]["namespace"]
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == ns]


# Ray's serialization error path inspects the refused object's attributes (pydantic warns).
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_worker_actor_reports_a_variable_missing_on_its_node(
    secure_ray: Any, secure_broker: SecureBroker, unique_name: Any
) -> None:
    import ray

    from dgstream.workers.engine.factory import EngineSettings
    from dgstream.workers.hosting.actor import create_worker
    from dgstream.workers.hosting.settings import WorkerSettings

    def settings(**kafka: Any) -> WorkerSettings:
        return WorkerSettings(
            pipeline="secure",
            input_topics=[unique_name("in")],
            output_topic=unique_name("out"),
            dead_letter_topic=unique_name("dlq"),
            group_id=unique_name("g"),
            kafka=secure_broker.connection(**kafka),
            engine=EngineSettings(backend="fake"),
            resources={"cpus": 0.5},
        )

    handle = create_worker(settings(sasl_password_env="DGSTREAM_TEST_UNSET_PASSWORD"))
    try:
        st = wait_for(
            lambda: (s := ray.get(handle.status.remote(), timeout=60)).get("error") and s,
            120,
            "the worker's error",
        )
        assert st["state"] == "new", st  # never started consuming, not restarting either
        assert "DGSTREAM_TEST_UNSET_PASSWORD is not set on" in st["error"]
    finally:
        ray.kill(handle, no_restart=True)
    # A literal password cannot be handed to Ray as an actor argument at all.
    literal = settings(sasl_password_env=None, sasl_password="never-sent-to-ray")
    with pytest.raises(Exception, match="cannot leave its process"):
        create_worker(literal)

"""The fault matrix's harness: faults x {at_least_once, exactly_once} on real brokers, each
cell checked against an oracle. `tests/workers/test_fault_matrix.py` runs its CI tier;
`bench/fault_matrix.py` runs every cell and writes the table (its docstring says what a cell
is and when it passes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bench.harness.faults import CrashOn, FlakyEngine, GateEngine, SlowEngine, delete_topic
from bench.harness.pipeline import (
    INPUT_PARTITIONS,
    OutputReader,
    Pipeline,
    request_bytes,
)
from dgstream.infra.kafka import broker
from dgstream.infra.kafka.broker import BrokerInfo
from dgstream.workers.kafka.settings import KafkaConnection

ROOT = Path(__file__).resolve().parents[2]

BrokerKind = Literal["single", "cluster"]
BROKERS: tuple[BrokerKind, ...] = ("single", "cluster")
DELIVERIES = ("at_least_once", "exactly_once")
WORKER_PROCESS = Path(__file__).with_name("worker_process.py")

# Small initial heaps: the matrix runs four brokers at most (one single, a cluster of
# three) on a shared machine. The maximum stays the project's default, 512 MB: with 256 MB
# a node of the cluster stopped answering in the middle of a full run (why was not kept).
HEAP_OPTS = "-Xms64m -Xmx512m"
# The fake engine's cost per read: a batch of 16 requests (about 24 reads) takes about a
# quarter of a second, so a fault finds batches in flight, while two workers still keep
# up with the matrix's rate with room to spare (tens of requests a second).
COST_PER_READ_S = 0.01
BATCHING = {"max_records": 16, "max_wait_ms": 20, "max_in_flight": 2}
# A result more than this long after its request was produced came late (in steady state
# one takes a fraction of a second: a batch's wait and engine call and a commit).
LATE_S = 2.0
# How long a broker fault lasts. A restart or kill: long enough for the clients to see
# the node gone (their requests time out, leaders move). A freeze: past the group's
# session timeout (6 s in the matrix) on the single broker, and past the brokers' own
# session timeout (broker.session.timeout.ms, 9 s) on the cluster, so the controller
# fences the frozen node and moves its leaderships.
DOWN_S = 4.0
FREEZE_S = {"single": 8.0, "cluster": 12.0}
# How long the output topic stays deleted: past the producer's delivery timeout in that
# cell (OUTPUT_GONE_PRODUCER), so that the workers meet it as an outage rather than as
# retries that the recreated topic ends.
OUTPUT_GONE_S = 6.0
OUTPUT_GONE_PRODUCER = {
    "max_block_ms": 2000,
    "delivery_timeout_ms": 3000,
    "request_timeout_ms": 2000,
}
# Workers are added or removed this often in the scaling cell.
SCALE_EVERY_S = 2.0
# How long a transient engine outage lasts (every read refused), and the share of reads
# that fail on their own meanwhile and outside it (a fifth: several failures a batch, so
# every batch meets the retry path).
ENGINE_DOWN_S = 2.0
# The rebalance cell's engine: each read this long, so that a batch of 16 spends seconds in
# the engine and both slots of every worker stay taken: each rebalance finds the consumer
# thread in its backpressure wait (where it once deadlocked, 2026-12-07).
FULL_READ_S = 0.15
FLAKY_RATE = 0.2
# A cell gives up waiting for its last answers this long after its fault and production
# ended (the worst recoveries take one outage backoff plus a session timeout).
SETTLE_S = 120.0


# --------------------------------------------------------------------------- brokers


@dataclass
class Brokers:
    """A running single broker or cluster started from the project's jars."""

    kind: BrokerKind
    info: BrokerInfo

    @property
    def home(self) -> str:
        return self.info.home

    @property
    def conn(self) -> KafkaConnection:
        return KafkaConnection(bootstrap_servers=self.info.bootstrap_servers)

    @property
    def replication(self) -> int:
        return 3 if self.kind == "cluster" else 1

    def topic_configs(self) -> dict[str, str]:
        return {"min.insync.replicas": "2"} if self.kind == "cluster" else {}


def start_brokers(kind: BrokerKind, home: str | os.PathLike[str]) -> Brokers:
    broker.fetch()
    if kind == "cluster":
        info = broker.start_cluster(3, home, heap_opts=HEAP_OPTS)
    else:
        info = broker.start(home, port=0, heap_opts=HEAP_OPTS)
    return Brokers(kind, info)


@contextlib.contextmanager
def running_brokers(kind: BrokerKind, home: str | os.PathLike[str]) -> Iterator[Brokers]:
    brokers = start_brokers(kind, home)
    try:
        yield brokers
    finally:
        broker.stop(home, delete_data=True)


# --------------------------------------------------------------------------- workers


class ThreadReplica:
    """One incarnation of a replica: a StreamWorker on a thread of this process, its
    engine wrapped by `wrap` (the fake engine with a fault of its own)."""

    def __init__(self, slot: int, settings: Any, wrap: Callable[[Any], Any] | None) -> None:
        from dgstream.workers.engine.factory import build_classifier
        from dgstream.workers.hosting.worker import StreamWorker

        self.slot, self.settings = slot, settings
        classifier = build_classifier(settings.engine, settings.question_sets, settings.name)
        if wrap is not None:
            classifier.engine = wrap(classifier.engine)
        self.engine = classifier.engine
        self.worker = StreamWorker(settings, classifier=classifier)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"matrix-{slot}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:
            self.error = exc

    def running(self) -> bool:
        return self.thread.is_alive()

    def died(self) -> bool:
        return not self.thread.is_alive() and self.error is not None

    def drain(self) -> None:
        self.worker.drain()
        self.thread.join(30)

    def close(self) -> None:
        if self.thread.is_alive():
            self.worker.stop()
            self.thread.join(30)


class ProcessReplica:
    """One incarnation of a replica in a process of its own (bench/harness/worker_process.py),
    for the faults that hit a process: kill -9, SIGSTOP. Its log goes to `log_path`."""

    def __init__(self, slot: int, settings: Any, log_path: Path) -> None:
        self.slot, self.settings, self.log_path = slot, settings, log_path
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER_PROCESS), settings.model_dump_json()],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def running(self) -> bool:
        return self.proc.poll() is None

    def died(self) -> bool:
        return self.proc.poll() not in (None, 0)

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def drain(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.proc.wait(30)


Replica = ThreadReplica | ProcessReplica


# --------------------------------------------------------------------------- the faults


@dataclass(frozen=True)
class Fault:
    """One row of the matrix: what it does (`inject`, on a thread of its own, while the
    requests flow) and what the cell needs for it."""

    name: str
    what: str
    inject: Callable[[Run], None]
    brokers: tuple[BrokerKind, ...] = BROKERS
    # "process": workers in processes of their own (the fault signals a process).
    kind: Literal["thread", "process"] = "thread"
    # The engine of every thread worker: the fake one wrapped by this (run, slot) -> wrap.
    engine: Callable[[Run, int], Callable[[Any], Any]] | None = None
    # Workers a fault may cost duplicates on (at-least-once): one, or every worker.
    touches: Literal["one", "all"] = "one"
    settings: dict[str, Any] = field(default_factory=dict)
    # The dead letters the fault makes (record key -> code); any other fails the cell.
    dead: dict[str, str] = field(default_factory=dict)
    # Topic configs of the output topic in this cell (on top of the brokers' own).
    output_configs: dict[str, str] = field(default_factory=dict)
    # The restarts the fault may cost, where the product documents a limit: the cell fails
    # past it, and the duplicate bound counts it (not the restarts measured).
    max_restarts: int | None = None


def _kill9(run: Run) -> None:
    victim = run.replicas[0]
    assert isinstance(victim, ProcessReplica)
    victim.signal(signal.SIGKILL)
    run.events += 1  # the supervisor restarts it, as Ray does


def _worker_sigstop(run: Run) -> None:
    """Freeze a worker until the group has given its partitions away, let the others work
    on them for a moment, then wake it: the zombie must publish nothing twice (exactly-
    once) once it finds its membership gone."""
    victim = run.replicas[0]
    assert isinstance(victim, ProcessReplica)
    member = run.member_of(victim.settings.name)
    victim.signal(signal.SIGSTOP)
    run.events += 1
    try:
        run.wait(lambda: member not in run.member_ids(), 60, "the frozen worker to be dropped")
        run.wait(run.group_stable, 60, "the group to settle without it")
        run.hold(2.0)  # the others answer its partitions meanwhile
    finally:
        victim.signal(signal.SIGCONT)


def _scaling(run: Run) -> None:
    """Every SCALE_EVERY_S, a worker joins or one drains and leaves: a third (slot 2)
    joins, an original (slot 1) leaves, it comes back, the third leaves, and so on."""
    plan = [(2, True), (1, False), (1, True), (2, False)]
    step = 0
    while not run.production_done.is_set() or step < len(plan):
        run.hold(SCALE_EVERY_S)
        slot, add = plan[step % len(plan)]
        if add:
            run.add(slot)
        else:
            run.remove(slot)
        run.events += 1
        step += 1
    if 2 in run.replicas:
        run.remove(2)
        run.events += 1


def _leader(run: Run) -> int:
    """The node leading most partitions of the pipeline's input and output topics."""
    if run.brokers.kind == "single":
        return 1
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(**run.brokers.conn.client_kwargs(client_id="matrix-leader"))
    try:
        described = admin.describe_topics([run.pipeline.input, run.pipeline.output])
    finally:
        admin.close()
    leaders = Counter(p["leader_id"] for t in described for p in t["partitions"])
    return min(leaders, key=lambda n: (-leaders[n], n))


def _broker_restart(run: Run) -> None:
    node = _leader(run)
    broker.kill_node(node, run.brokers.home)  # SIGTERM: a controlled shutdown
    run.events += 1
    try:
        run.hold(DOWN_S)
    finally:
        broker.restart_node(node, run.brokers.home)


def _leader_kill(run: Run) -> None:
    node = _leader(run)
    broker.kill_node(node, run.brokers.home, hard=True)  # kill -9: no controlled shutdown
    run.events += 1
    try:
        run.hold(DOWN_S)
    finally:
        broker.restart_node(node, run.brokers.home)


def _broker_sigstop(run: Run) -> None:
    node = _leader(run)
    broker.freeze_node(node, run.brokers.home)
    run.events += 1
    try:
        run.hold(FREEZE_S[run.brokers.kind])
    finally:
        broker.freeze_node(node, run.brokers.home, thaw=True)


def _twin(run: Run) -> None:
    """A second worker with replica 0's settings (its transactional id). Under exactly-
    once the broker fences the first when the twin starts; the first, refused, stops (it
    never sets up a producer again: that would fence the twin in turn). Neither is
    restarted (a restart with the same id would fence the survivor: a Ray actor restarts
    with the same id, which is why a replica index must never run twice). Under
    at-least-once both run."""
    with run.lock:
        run.add(10, like=0)
        run.retired.update({0, 10})
    run.events += 1


# The poison cell's output topic takes records of this many bytes at most (the broker's
# default, 1 MB, would need a request near the input's own limit to outgrow it).
POISON_OUTPUT_LIMIT = 20_000


def _poison_records() -> dict[str, tuple[bytes, str]]:
    """Record key -> (value, the dead letter's code): a record that kills the engine, two
    that cannot be parsed (a lone surrogate in the id; bytes that are not UTF-8), and three
    whose output cannot be produced (a reply_topic that is internal, one allowed but
    missing, a result larger than the output topic takes)."""

    def body(rid: str, **extra: Any) -> bytes:
        doc: dict[str, Any] = {"id": rid, "state": f"text of {rid}", "question_set": "moderation"}
        doc.update(extra)
        return json.dumps(doc).encode()

    return {
        "crash-0": (request_bytes("crash-0", 0), "POISON"),
        "bad-surrogate": (body("\ud800"), "INVALID_UNICODE"),
        "bad-utf8": (b"\xff{not json", "INVALID_UTF8"),
        "bad-internal": (
            body("bad-internal", reply_topic="__consumer_offsets"),
            "REPLY_TOPIC_NOT_ALLOWED",
        ),
        "bad-missing": (
            body("bad-missing", reply_topic=f"dgstream.replies.gone-{uuid.uuid4().hex[:8]}"),
            "REPLY_TOPIC_UNKNOWN",
        ),
        "bad-large": (
            body("bad-large", metadata={"pad": "y" * (POISON_OUTPUT_LIMIT + 1000)}),
            "OUTPUT_TOO_LARGE",
        ),
    }


POISON = _poison_records()


def _poison_restarts() -> int:
    """PoisonTuning's documented limit with the defaults: the deaths that make a partition
    suspect, then those that convict its record running alone."""
    from dgstream.workers.hosting.settings import PoisonTuning

    tuning = PoisonTuning()
    return tuning.suspect_after + tuning.poison_after


def _poison(run: Run) -> None:
    """The poison records, in the middle of the stream. A worker that meets the one that
    kills the engine (FatalEngineError on any read of it) dies and is restarted until the
    record is isolated; the others are dead letters at once; their neighbours are
    answered."""
    for key, (value, _) in POISON.items():
        run.produce_extra(key, value)


def _output_gone(run: Run) -> None:
    """The output topic deleted, then created again. The engines are held first and the
    results read to the end, so that the test knows every result the deleted topic held
    (the deletion takes them with it); then the workers meet the missing topic for
    OUTPUT_GONE_S (an outage: nothing is dead-lettered), and answer into the new topic
    once it is back."""
    from dgstream.workers.kafka.admin import ensure_topics

    p = run.pipeline
    run.gate.clear()
    run.events += 1
    try:
        assert run.results is not None
        run.results.quiesce()
        delete_topic(p.conn, p.output)
    finally:
        run.gate.set()
    run.hold(OUTPUT_GONE_S)
    ensure_topics(
        p.conn,
        {p.output: 3},
        replication_factor=run.brokers.replication,
        configs=run.brokers.topic_configs(),
    )
    assert run.results is not None
    run.results.reopen()


def _transient(run: Run) -> None:
    """FLAKY_RATE of the reads fail (RecoverableEngineError) throughout, each cured by a
    retry (FlakyEngine fails a request once at most: an engine that fails good requests
    at random past the retries gets them dead-lettered ENGINE_FAILED, which the worker
    cannot tell from a request that breaks it); at the fault, every read is refused
    (EngineUnavailable) for ENGINE_DOWN_S."""
    run.engine_down.set()
    run.events += 1
    try:
        run.hold(ENGINE_DOWN_S)
    finally:
        run.engine_down.clear()


def _drain_timeout(run: Run) -> None:
    """Replica 0's engine holds its batch; drain() gives up on it after drain_timeout_s;
    the batch then finishes (it must reach no output), and a new incarnation takes over."""
    victim = run.replicas[0]
    assert isinstance(victim, ThreadReplica)
    engine = victim.engine
    assert isinstance(engine, GateEngine)
    engine.gate.clear()
    run.events += 1
    run.wait(engine.entered.is_set, 60, "a batch held in replica 0's engine")
    run.remove(0)
    engine.gate.set()
    run.add(0)


def _slow(run: Run, slot: int) -> Callable[[Any], Any]:
    return lambda inner: SlowEngine(inner, FULL_READ_S)


def _gated(run: Run, slot: int) -> Callable[[Any], Any]:
    def wrap(inner: Any) -> Any:
        engine = GateEngine(inner)
        engine.gate = run.gate
        return engine

    return wrap


def _own_gate(run: Run, slot: int) -> Callable[[Any], Any]:
    def wrap(inner: Any) -> Any:
        engine = GateEngine(inner)
        engine.gate.set()
        return engine

    return wrap


def _crashing(run: Run, slot: int) -> Callable[[Any], Any]:
    return lambda inner: CrashOn(inner, "crash")


def _flaky(run: Run, slot: int) -> Callable[[Any], Any]:
    def wrap(inner: Any) -> Any:
        engine = FlakyEngine(inner, FLAKY_RATE, seed=slot * 1000 + run.incarnations)
        engine.down = run.engine_down
        return engine

    return wrap


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Fault("kill9", "worker kill -9 (restarted)", _kill9, kind="process"),
        Fault(
            "sigstop", "worker SIGSTOP past the session, SIGCONT", _worker_sigstop, kind="process"
        ),
        Fault("scaling", f"a worker added or removed every {SCALE_EVERY_S:g} s", _scaling),
        Fault(
            "rebalance_full",
            f"a worker added or removed every {SCALE_EVERY_S:g} s, every slot taken",
            _scaling,
            engine=_slow,
        ),
        Fault("broker_restart", "broker restart (the leader)", _broker_restart, touches="all"),
        Fault(
            "leader_kill",
            "leader kill -9, back after a while",
            _leader_kill,
            brokers=("cluster",),
            touches="all",
        ),
        Fault("broker_sigstop", "broker SIGSTOP, SIGCONT", _broker_sigstop, touches="all"),
        Fault("twin", "a second worker with the same transactional id", _twin),
        Fault(
            "poison",
            "poison records (an engine crash, bad bytes, unproducible outputs)",
            _poison,
            engine=_crashing,
            dead={key: code for key, (_, code) in POISON.items()},
            output_configs={"max.message.bytes": str(POISON_OUTPUT_LIMIT)},
            max_restarts=_poison_restarts(),
        ),
        Fault(
            "output_gone",
            "output topic deleted, then recreated",
            _output_gone,
            engine=_gated,
            touches="all",
            # The defaults would hold a send to the missing topic for 2 minutes (its
            # delivery timeout) before the outage begins: documented, and slow here.
            settings={"producer": OUTPUT_GONE_PRODUCER},
        ),
        Fault(
            "transient",
            f"transient engine errors ({FLAKY_RATE:.0%} of reads; all for {ENGINE_DOWN_S:g} s)",
            _transient,
            engine=_flaky,
            touches="all",
        ),
        Fault(
            "drain_timeout",
            "a drain that times out",
            _drain_timeout,
            engine=_own_gate,
            settings={"drain_timeout_s": 1.0},
        ),
    ]
}


# --------------------------------------------------------------------------- results


class Collector:
    """Reads the results and the dead letters on a thread of its own for the whole cell,
    keeping every record it read (across a deletion of the output topic)."""

    def __init__(self, pipeline: Pipeline, read_committed: bool) -> None:
        self._p, self._committed = pipeline, read_committed
        self._lock = threading.Lock()
        self._readers = [self._reader()]
        self.dead = OutputReader(pipeline.conn, pipeline.dead, read_committed)
        self._stop = threading.Event()
        self._paused = False
        self._thread = threading.Thread(target=self._loop, name="matrix-reader", daemon=True)
        self._thread.start()

    def _reader(self) -> OutputReader:
        return OutputReader(self._p.conn, self._p.output, self._committed)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if not self._paused:
                    self._readers[-1].poll(100)
                self.dead.poll(50)
            self._stop.wait(0.01)

    def records(self) -> list[Any]:
        with self._lock:
            return [r for reader in self._readers for r in reader.records]

    def dead_records(self) -> list[Any]:
        with self._lock:
            return list(self.dead.records)

    def seen(self) -> set[str]:
        with self._lock:
            keys = {r.key.decode() for reader in self._readers for r in reader.records}
            return keys | {r.key.decode() for r in self.dead.records if r.key}

    def quiesce(self, quiet_s: float = 3.0, timeout_s: float = 60.0) -> None:
        """Read until neither the results nor the group's committed offsets have moved
        for `quiet_s` (the engines are held: the batches past them finish, no other
        does), read the output to its end, then stop reading it."""
        deadline = time.monotonic() + timeout_s
        last: tuple[int, dict[int, int]] | None = None
        since = time.monotonic()
        while time.monotonic() < deadline:
            with self._lock:
                self._readers[-1].poll(100)
                n = len(self._readers[-1].records)
            now = (n, self._p.committed())
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        with self._lock:
            self._readers[-1].read_to_end(60)
            self._paused = True
            self._readers[-1].close()

    def reopen(self) -> None:
        """Read the (new) output topic from its beginning."""
        with self._lock:
            self._readers.append(self._reader())
            self._paused = False

    def read_to_end(self) -> None:
        with self._lock:
            self._readers[-1].read_to_end(60)
            self.dead.read_to_end(60)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for r in [*self._readers, self.dead]:
            r.close()


_ORACLES: dict[tuple[str, ...], dict[str, Any]] = {}  # the cells share their requests


def expected_answers(values: dict[str, bytes], settings: Any) -> dict[str, Any]:
    """The oracle: id -> the fake engine's answers for that request (as JSON), computed
    here with the workers' engine and question sets."""
    from dgstream.schemas import ClassificationResult, parse_request
    from dgstream.workers.engine.factory import build_classifier

    ids = list(values)
    memo = (settings.engine.model_dump_json(), *ids, *(values[i].decode() for i in ids))
    if memo in _ORACLES:
        return _ORACLES[memo]
    classifier = build_classifier(settings.engine, settings.question_sets)
    requests = [parse_request(values[i]) for i in ids]
    out = asyncio.run(classifier.classify(requests))  # type: ignore[arg-type]
    answers: dict[str, Any] = {}
    for rid, result in zip(ids, out, strict=True):
        assert isinstance(result, ClassificationResult), result
        answers[rid] = json.loads(result.model_dump_json())["answers"]
    _ORACLES[memo] = answers
    return answers


@dataclass
class Verdict:
    """What one cell found."""

    broker: str
    fault: str
    delivery: str
    messages: int
    answered: int = 0
    lost: list[str] = field(default_factory=list)
    duplicates: int = 0
    bound: int = 0  # duplicates allowed (at-least-once)
    wrong: list[str] = field(default_factory=list)  # results unlike the oracle's answers
    dead: dict[str, int] = field(default_factory=dict)  # code -> dead letters
    unexpected_dead: list[str] = field(default_factory=list)
    lag: int = 0
    events: int = 0
    restarts: int = 0
    fault_s: float = 0.0  # how long the fault lasted
    recovered_s: float = 0.0  # from its end to the last late result
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # when each step ended (s)

    def problems(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{len(self.lost)} ids neither answered nor dead-lettered: {self.lost[:5]}")
        if self.duplicates > self.bound:
            out.append(f"{self.duplicates} duplicates, more than the bound {self.bound}")
        if self.wrong:
            out.append(f"{len(self.wrong)} results unlike the oracle's: {self.wrong[:5]}")
        if self.unexpected_dead:
            out.append(f"dead letters the fault should not make: {self.unexpected_dead[:5]}")
        if self.lag:
            out.append(f"committed offsets {self.lag} short of the end offsets")
        return out + self.notes

    def row(self) -> list[str]:
        dup = f"{self.duplicates}" + (f" (<= {self.bound})" if self.bound else "")
        dead = ", ".join(f"{c} {n}" for c, n in sorted(self.dead.items())) or "0"
        return [
            self.broker,
            FAULTS[self.fault].what,
            self.delivery.replace("_", "-"),
            str(self.messages),
            str(len(self.lost)),
            dup,
            str(len(self.wrong)),
            dead,
            str(self.restarts),
            f"{self.fault_s:.1f}",
            f"{self.recovered_s:.1f}",
            f"{self.seconds:.0f}",
            "pass" if not self.problems() else "FAIL",
        ]


# --------------------------------------------------------------------------- one cell


@dataclass(frozen=True)
class Size:
    messages: int = 200
    seconds: float = 8.0  # the requests are produced over this long
    fault_at: float = 1 / 3  # the fault comes when this share of them is produced
    workers: int = 2


class Run:
    """One cell: the pipeline, its workers (restarted when they die), the requests, the
    fault, the results, the verdict."""

    def __init__(
        self, brokers: Brokers, fault: Fault, delivery: str, size: Size, log_dir: Path
    ) -> None:
        self.brokers, self.fault, self.delivery, self.size = brokers, fault, delivery, size
        self.log_dir = log_dir
        tag = f"{fault.name}-{delivery[:3]}-{uuid.uuid4().hex[:8]}"
        self.pipeline = Pipeline(
            brokers.conn,
            input=f"mx-in-{tag}",
            output=f"mx-out-{tag}",
            dead=f"mx-dlq-{tag}",
            group=f"mx-g-{tag}",
        )
        self.replicas: dict[int, Replica] = {}
        self.retired: set[int] = set()
        self.events = 0
        self.restarts = 0
        self.incarnations = 0
        self.gate = threading.Event()  # the engines of `_gated` hold reads while clear
        self.gate.set()
        self.engine_down = threading.Event()  # `_flaky` engines refuse every read while set
        self.production_done = threading.Event()
        self._stop = threading.Event()
        self.lock = threading.RLock()  # the replicas: supervisor vs the fault thread
        self.values: dict[str, bytes] = {}
        self.sent_ms: dict[str, int] = {}
        self._extra: list[tuple[str, bytes]] = []
        self.fault_started: float | None = None  # epoch seconds
        self.fault_ended: float | None = None
        self.fault_error: BaseException | None = None
        self.phases: dict[str, float] = {}  # seconds from the start of the cell
        self.results: Collector | None = None

    # ------------------------------------------------------------------ workers

    def settings(self, slot: int) -> Any:
        from dgstream.workers.engine.factory import EngineSettings

        kw: dict[str, Any] = {
            "delivery": self.delivery,
            "replica": slot,
            "batching": BATCHING,
            "engine": EngineSettings(backend="fake", fake_cost_per_read_s=COST_PER_READ_S),
            # Short pauses: an outage of a few seconds is tried again within a second.
            "outage": {"initial_backoff_s": 0.2, "max_backoff_s": 1.0, "budget_s": 300},
            "log_level": "INFO",
        }
        kw.update(self.fault.settings)
        return self.pipeline.settings(**kw)

    def _start(self, slot: int, like: int | None = None) -> Replica:
        settings = self.settings(slot if like is None else like)
        self.incarnations += 1
        if self.fault.kind == "process":
            log = self.log_dir / f"{self.pipeline.group}-{slot}.log"
            return ProcessReplica(slot, settings, log)
        wrap = self.fault.engine(self, slot) if self.fault.engine else None
        return ThreadReplica(slot, settings, wrap)

    def add(self, slot: int, like: int | None = None) -> None:
        with self.lock:
            self.retired.discard(slot)
            self.replicas[slot] = self._start(slot, like)

    def remove(self, slot: int) -> None:
        """Drain the replica in `slot` and keep the slot empty."""
        with self.lock:
            self.retired.add(slot)
            replica = self.replicas.pop(slot)
        replica.drain()

    def supervise(self) -> None:
        """Restart every replica that died, as Ray restarts a failed actor."""
        with self.lock:
            for slot, r in list(self.replicas.items()):
                if r.died() and slot not in self.retired:
                    self.restarts += 1
                    self.replicas[slot] = self._start(slot)

    # ------------------------------------------------------------------ the group

    def _group(self) -> dict[str, Any]:
        """The group as its coordinator describes it; empty while no coordinator answers
        (a fresh broker creating its offsets topic, a broker fault)."""
        from kafka import KafkaAdminClient
        from kafka.errors import KafkaError

        conn = self.pipeline.conn
        try:
            admin = KafkaAdminClient(**conn.client_kwargs(client_id="matrix-group"))
        except KafkaError:
            return {}
        try:
            described: dict[str, Any] = admin.describe_groups([self.pipeline.group])
            return dict(described[self.pipeline.group])
        except KafkaError:
            return {}
        finally:
            admin.close()

    def member_ids(self) -> set[str]:
        return {m["member_id"] for m in self._group().get("members", [])}

    def member_of(self, name: str) -> str:
        """The member id of the worker called `name` (its client id names it)."""

        def find() -> str | None:
            for m in self._group().get("members", []):
                if f"-{name}-consumer" in m["client_id"]:
                    return str(m["member_id"])
            return None

        member: str = self.wait(find, 60, f"{name} in the group")
        return member

    def group_stable(self) -> bool:
        group = self._group()
        return bool(group.get("group_state") == "Stable" and group.get("members"))

    def any_outage(self) -> bool:
        with self.lock:
            workers = [r.worker for r in self.replicas.values() if isinstance(r, ThreadReplica)]
        return any(w.status()["outage"] for w in workers)

    # ------------------------------------------------------------------ waiting

    def hold(self, seconds: float) -> None:
        """The fault lasts this long (cut short when the cell is torn down)."""
        self._stop.wait(seconds)

    def wait(self, predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline or self._stop.is_set():
                raise TimeoutError(f"{self.fault.name}: timed out waiting for {what}")
            self._stop.wait(0.1)

    # ------------------------------------------------------------------ requests

    def produce_extra(self, rid: str, value: bytes) -> None:
        """One more request, sent by the producer thread next."""
        with self.lock:
            self._extra.append((rid, value))

    def _produce(self, ids: list[str]) -> None:
        from kafka import KafkaProducer

        producer = KafkaProducer(
            **self.pipeline.conn.client_kwargs(client_id="matrix-producer"),
            acks="all",
            enable_idempotence=True,
            linger_ms=5,
            # The input must survive every broker fault of the matrix: retry for minutes.
            delivery_timeout_ms=300_000,
            max_block_ms=300_000,
        )
        futures: list[tuple[str, Any]] = []
        every = self.size.seconds / max(1, len(ids))
        t0 = time.monotonic()
        try:
            for k, rid in enumerate(ids):
                self._stop.wait(max(0.0, t0 + k * every - time.monotonic()))
                with self.lock:
                    extra, self._extra = self._extra, []
                for xid, value in [*extra, (rid, self.values[rid])]:
                    self.values[xid] = value
                    futures.append((xid, producer.send(self.pipeline.input, value, xid.encode())))
                if self.fault_started is None and k >= self.size.fault_at * len(ids):
                    self._start_fault()
            producer.flush(timeout=300)
            for rid, fut in futures:
                self.sent_ms[rid] = fut.get(timeout=60).timestamp
        finally:
            producer.close(timeout=10)
            self.production_done.set()

    def _start_fault(self) -> None:
        self.fault_started = time.time()

        def inject() -> None:
            try:
                self.fault.inject(self)
            except BaseException as exc:
                self.fault_error = exc
            finally:
                self.fault_ended = time.time()

        self._fault_thread = threading.Thread(target=inject, name="matrix-fault", daemon=True)
        self._fault_thread.start()

    # ------------------------------------------------------------------ the cell

    def execute(self) -> Verdict:
        from dgstream.workers.kafka.admin import ensure_topics

        t0 = time.monotonic()
        p, n = self.pipeline, self.size.messages
        configs = self.brokers.topic_configs()
        ensure_topics(
            p.conn,
            {p.input: INPUT_PARTITIONS, p.dead: 1},
            replication_factor=self.brokers.replication,
            configs=configs,
        )
        ensure_topics(
            p.conn,
            {p.output: 3},
            replication_factor=self.brokers.replication,
            configs={**configs, **self.fault.output_configs},
        )
        ids = [f"r{i}" for i in range(n)]
        self.values = {rid: request_bytes(rid, i) for i, rid in enumerate(ids)}
        oracle = expected_answers(self.values, self.settings(0))
        self.results = Collector(p, read_committed=self.delivery == "exactly_once")
        self.phases["setup"] = time.monotonic() - t0
        try:
            for slot in range(self.size.workers):
                self.add(slot)
            self.wait(self._all_joined, 120, "every worker in the group")
            self.phases["join"] = time.monotonic() - t0
            producer = threading.Thread(target=self._produce, args=(ids,), name="matrix-produce")
            producer.start()
            self._until_answered(producer)
            self.phases["answered"] = time.monotonic() - t0
            self._drain_all()
            self.results.read_to_end()
            self.phases["drained"] = time.monotonic() - t0
            return self._verdict(oracle, time.monotonic() - t0)
        finally:
            self._teardown()

    def _all_joined(self) -> bool:
        return len(self.member_ids()) >= len(self.replicas) and self.group_stable()

    def _until_answered(self, producer: threading.Thread) -> None:
        """Supervise until the fault and the production are over and every id is
        answered or dead-lettered, and the committed offsets reach the end offsets."""
        deadline: float | None = None
        assert self.results is not None
        while True:
            self.supervise()
            over = not producer.is_alive() and self.fault_started is not None
            over = over and not self._fault_thread.is_alive()
            if over and deadline is None:
                deadline = time.monotonic() + SETTLE_S
            if over and self.results.seen() >= set(self.values) and self.pipeline.lag() == 0:
                return
            if deadline is not None and time.monotonic() > deadline:
                return  # the verdict says what is missing
            self._stop.wait(0.2)

    def _drain_all(self) -> None:
        with self.lock:
            replicas = list(self.replicas.values())
            self.replicas.clear()
        self.gate.set()
        for r in replicas:
            if isinstance(r, ThreadReplica) and isinstance(r.engine, GateEngine):
                r.engine.gate.set()
        # All at once, as a deployment stops: one after the other, each leaving would
        # rebalance the rest.
        drains = [threading.Thread(target=r.drain, daemon=True) for r in replicas]
        for t in drains:
            t.start()
        for t in drains:
            t.join(90)

    def _teardown(self) -> None:
        self._stop.set()
        self.gate.set()
        with self.lock:
            replicas = list(self.replicas.values())
            self.replicas.clear()
        for r in replicas:
            r.close()
        fault = getattr(self, "_fault_thread", None)
        if fault is not None:
            fault.join(60)
        if self.results is not None:
            self.results.close()

    def _verdict(self, oracle: dict[str, Any], seconds: float) -> Verdict:
        assert self.results is not None
        v = Verdict(self.brokers.kind, self.fault.name, self.delivery, len(self.values))
        records, dead = self.results.records(), self.results.dead_records()
        keys = [r.key.decode() for r in records]
        dead_keys = [r.key.decode() for r in dead if r.key]
        v.answered = len(set(keys))
        v.lost = sorted(set(self.values) - set(keys) - set(dead_keys))
        v.duplicates = sum(c - 1 for c in Counter(keys + dead_keys).values() if c > 1)
        v.wrong = [k for r, k in zip(records, keys, strict=True) if not _agrees(r, k, oracle)]
        v.dead, v.unexpected_dead = self._dead_letters(dead)
        v.lag = self.pipeline.lag()
        limit = self.fault.max_restarts
        v.events = max(self.events, self.restarts if limit is None else limit)
        v.restarts = self.restarts
        if limit is not None and self.restarts > limit:
            v.notes.append(f"{self.restarts} restarts, more than the {limit} documented")
        if self.delivery == "at_least_once":
            touched = self.size.workers if self.fault.touches == "all" else 1
            v.bound = v.events * touched * BATCHING["max_in_flight"] * BATCHING["max_records"]
        v.recovered_s = self._recovery(records)
        if self.fault_started is not None and self.fault_ended is not None:
            v.fault_s = round(self.fault_ended - self.fault_started, 1)
        v.seconds = round(seconds, 1)
        v.phases = {k: round(t, 1) for k, t in self.phases.items()}
        if self.fault_error is not None:
            v.notes.append(f"the fault failed: {self.fault_error!r}")
        return v

    def _dead_letters(self, dead: list[Any]) -> tuple[dict[str, int], list[str]]:
        from dgstream.schemas import DeadLetter

        codes: Counter[str] = Counter()
        unexpected = []
        for rec in dead:
            letter = DeadLetter.from_record(rec.value, rec.key, rec.headers)
            code = str(letter.error.code.value)
            codes[code] += 1
            key = rec.key.decode(errors="replace") if rec.key else ""
            if self.fault.dead.get(key) != code:
                unexpected.append(f"{key or letter.request_id}: {code}")
        return dict(codes), unexpected

    def _recovery(self, records: list[Any]) -> float:
        """From the fault's end to the last result that came late (0: none did)."""
        if self.fault_ended is None:
            return 0.0
        first: dict[str, int] = {}
        for r in records:
            k = r.key.decode()
            first[k] = min(first.get(k, r.timestamp), r.timestamp)
        late = [
            ts
            for k, ts in first.items()
            if k in self.sent_ms and ts - self.sent_ms[k] > LATE_S * 1000
        ]
        if not late:
            return 0.0
        return round(max(0.0, max(late) / 1000 - self.fault_ended), 1)


def _agrees(record: Any, key: str, oracle: dict[str, Any]) -> bool:
    """The result is the one for request `key`, with the fake engine's answers for it."""
    body = json.loads(record.value)
    return bool(
        body.get("id") == key and body.get("status") == "ok" and body["answers"] == oracle.get(key)
    )


def run_cell(
    brokers: Brokers, fault: str, delivery: str, size: Size = Size(), log_dir: Path | None = None
) -> Verdict:
    """Run one cell of the matrix on a running broker or cluster. A cell that cannot run
    to its end (a wait that timed out, a broker that died) is a failed verdict saying why,
    with the last words of the workers and the brokers on stderr."""
    with tempfile.TemporaryDirectory(prefix="matrix-logs-") as tmp:
        run = Run(brokers, FAULTS[fault], delivery, size, log_dir or Path(tmp))
        try:
            verdict = run.execute()
        except Exception as exc:
            verdict = Verdict(brokers.kind, fault, delivery, len(run.values))
            verdict.notes.append(f"the cell did not finish: {exc!r}")
        if verdict.problems() and log_dir is None:
            logs = [
                *sorted(Path(tmp).glob("*.log")),
                *(Path(n.log_file) for n in brokers.info.nodes),
            ]
            for log in logs:
                if log.exists():
                    tail = log.read_text(errors="replace").splitlines()[-30:]
                    print(f"--- {log.name}\n" + "\n".join(tail), file=sys.stderr)
        return verdict

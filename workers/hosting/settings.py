"""Everything one stream worker needs, as one frozen, validated object (`WorkerSettings`).

The topology controller builds one per replica (same pipeline, a different `replica`) and
hands it to `workers.hosting.actor.WorkerActor`; tests build it directly. Every tuning constant says
where its value came from. Secrets live only inside `kafka` (a `KafkaConnection`), which
never prints them.

What a pipeline says about its work is declared once, in `PipelineFields`: the topology's
`PipelineSpec` and `WorkerSettings` both inherit it, with its checks, and
`WorkerSettings.from_spec` copies it by name. Every other setting is `RUNTIME_ONLY` (the
replica's identity, the broker, the process's tuning) or comes from a spec field of another
name (`topology.spec.SPEC_TO_WORKER`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dgstream.schemas import (
    DEFAULT_LIMITS,
    ParseLimits,
    Question,
    RequestRejected,
    question_order,
)
from dgstream.schemas.formats import OutputFields
from dgstream.schemas.kinds import holds_kinds
from dgstream.schemas.names import (
    DEPLOYMENT_NAME_PATTERN,
    QUESTION_ID_PATTERN,
    is_question_id,
    is_topic_name,
)
from dgstream.workers.engine.factory import EngineSettings
from dgstream.workers.images.settings import ImageSettings
from dgstream.workers.kafka.schema_registry import RegistrySettings
from dgstream.workers.kafka.settings import KafkaConnection
from dgstream.workers.results.calibration import Calibration
from dgstream.workers.results.tracing import TracingSettings
from dgstream.workers.routes import Route, check_routes

__all__ = [
    "RUNTIME_ONLY",
    "ActorResources",
    "Batching",
    "CompressionType",
    "ConsumerTuning",
    "Delivery",
    "Framing",
    "OutageTuning",
    "PipelineFields",
    "PoisonTuning",
    "ProducerTuning",
    "WorkerSettings",
    "check_question_sets",
]

Delivery = Literal["at_least_once", "exactly_once"]
# "confluent": values carry the Schema Registry wire format (a 0x00 magic byte, a 4-byte
# big-endian schema id, then the JSON).
Framing = Literal["none", "confluent"]
# Kafka's names for the codecs of a record batch (`compression.type`).
CompressionType = Literal["none", "gzip", "snappy", "lz4", "zstd"]

# Pipeline names go into actor names, client ids, transactional ids and instance ids
# (the topology spec uses the same rule).
_NAME_PATTERN = DEPLOYMENT_NAME_PATTERN


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Batching(_Frozen):
    """Micro-batches: how many records, how long to wait for them, how many in flight."""

    # A request's questions share one canvas, so 64 requests are 64 reads with one sample
    # each and 256 when each takes 4 (`samples: 4`, or "auto" topping up to its auto_max
    # of 4): the engine's reads/s on the H200 flatten from 128 to 256 reads a batch
    # (docs/benchmarks.md), so a batch stays within that even when every request takes
    # four. It is also EngineSettings.max_batch_reads' default for the tiny CPU model. The
    # topology file's `batching` is this model.
    max_records: int = Field(default=64, ge=1, le=10_000)
    # A batch waits at most this long to fill once its first record is in, and only while
    # the engine is busy (an idle engine gets what is there at once). 50 ms: a fraction of
    # one full-size engine call.
    max_wait_ms: int = Field(default=50, ge=0, le=60_000)
    # Batches between poll and commit (the one being filled counts). 2: one in the engine
    # while the next is fetched and parsed (the engine never waits on Kafka); it also
    # bounds the duplicates a crash can cause to max_in_flight x max_records.
    max_in_flight: int = Field(default=2, ge=1, le=64)


class ConsumerTuning(_Frozen):
    """Group-membership timings (kafka-python's names and defaults unless noted)."""

    # kafka-python 3's default for brokers 3.0+ (KIP-735). Tests lower it to the broker's
    # group.min.session.timeout.ms (6 s) so a killed dynamic member is noticed quickly.
    session_timeout_ms: int = Field(default=45_000, ge=1_000)
    # kafka-python's default; Kafka recommends at most a third of the session timeout.
    heartbeat_interval_ms: int = Field(default=3_000, ge=100)
    # kafka-python's default (5 minutes). The worker keeps calling poll() (partitions paused)
    # while its batches are full, so only one engine call longer than this would trip it.
    max_poll_interval_ms: int = Field(default=300_000, ge=1_000)
    # Where a group with no committed offset starts: the backlog is work to do.
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    # read_committed skips aborted records of transactional upstream producers; for other
    # producers it changes nothing.
    isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed"
    # On revocation, wait this long for the revoked partitions' batches to finish before
    # abandoning them (they are then consumed again by the new owner). 30 s: far above one
    # engine call (milliseconds to a few seconds) and far below max_poll_interval_ms, which
    # bounds how long the other members wait for this one to rejoin. The wait also stops at
    # half of session_timeout_ms: it runs on kafka-python's I/O thread, which also sends the
    # heartbeats.
    revoke_timeout_s: float = Field(default=30.0, gt=0)
    # The most bytes one record batch may decompress to; past it the batch is not read but
    # dead-lettered once, by reference (BATCH_TOO_LARGE; docs/worker.md, "Memory per
    # record"). None: 32 x parse_limits.max_message_bytes (32 MiB by default), derived in
    # `workers.steps.inputs.bounds`: every default producer's batches stay far below it.
    max_batch_bytes: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _heartbeat_below_session(self) -> ConsumerTuning:
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError(
                "heartbeat_interval_ms must be at most a third of session_timeout_ms "
                f"({self.heartbeat_interval_ms} x 3 > {self.session_timeout_ms})"
            )
        return self


class ProducerTuning(_Frozen):
    """The producer: always acks=all and idempotent (not settable); these are the rest."""

    # Kafka 4.0's Java default (KIP-1030 raised it from 0 to 5 ms): small batches of results
    # share a request, at a cost far below one engine call.
    linger_ms: int = Field(default=5, ge=0, le=10_000)
    # The largest produce request (so the largest record) the producer sends: kafka-python's
    # and Java's default, just under the broker's default max.message.bytes (1,048,588).
    # A result larger than this or its topic's max.message.bytes is OUTPUT_TOO_LARGE.
    max_request_size: int = Field(default=1_048_576, ge=1_024)
    # How long send() may block on metadata or a full buffer; kafka-python's default.
    max_block_ms: int = Field(default=60_000, ge=100)
    # How long the producer keeps retrying one output (no leader, not enough replicas)
    # before it reports the failure: Java's and kafka-python's default. The worker then
    # treats it as an outage (`OutageTuning`), not as bad input.
    delivery_timeout_ms: int = Field(default=120_000, ge=1_000)
    # One produce request's timeout: Java's and kafka-python's default. The delivery
    # timeout must cover it plus linger_ms (kafka-python refuses the producer otherwise).
    request_timeout_ms: int = Field(default=30_000, ge=100)
    # kafka-python's default; Kafka's transaction.max.timeout.ms (15 min) is the ceiling.
    transaction_timeout_ms: int = Field(default=60_000, ge=1_000, le=900_000)
    # The codec of the batches the worker writes (results and dead letters). "none", as
    # Java's and kafka-python's producers: every consumer reads it without a codec library
    # (a consumer that lacks one cannot read a batch at all), and results are small JSON
    # at the engine's rate, rarely what fills a network. lz4 or zstd where the bytes matter.
    compression_type: CompressionType = "none"

    @model_validator(mode="after")
    def _delivery_covers_a_request(self) -> ProducerTuning:
        if self.delivery_timeout_ms < self.linger_ms + self.request_timeout_ms:
            raise ValueError(
                "delivery_timeout_ms must be at least linger_ms + request_timeout_ms "
                f"({self.delivery_timeout_ms} < {self.linger_ms} + {self.request_timeout_ms})"
            )
        return self


class OutageTuning(_Frozen):
    """The engine (or a remote vLLM) or the output topic out of reach: the worker stops
    taking new work and tries again after a pause that doubles each time, up to a cap,
    for at most `budget_s`; it dead-letters nothing because of an outage. Past the budget
    it fails (Ray restarts it), which dead-letters nothing either."""

    # The first pause: a few engine calls' worth, so that a blip (a connection reset, a
    # leader election of a few hundred milliseconds) costs little.
    initial_backoff_s: float = Field(default=0.5, gt=0)
    # The longest pause: the worker resumes within 30 s of the cause being fixed, while
    # a long outage costs one try (one engine call or one produce) every 30 s.
    max_backoff_s: float = Field(default=30.0, gt=0)
    # Ten minutes: longer than restarting a vLLM server (loading the 26B checkpoint takes
    # minutes) or rolling a broker, short enough that a worker which cannot recover by
    # waiting is restarted within the quarter hour; status() and the metrics show the
    # outage meanwhile.
    budget_s: float = Field(default=600.0, gt=0)


class PoisonTuning(_Frozen):
    """A record that keeps killing the worker (an engine crash on it, the process killed
    while it runs) is isolated, not retried forever. The count lives in the committed
    offset's metadata of its partition (`workers.faults.poison`)."""

    # The work from one committed offset was started by this many incarnations that all
    # died before committing past it: the partition's next records run one at a time, each
    # alone in the worker, so the next crash names its record. 2: one crash is common (a
    # node lost, an operator's kill); two in a row at the same offset are not.
    suspect_after: int = Field(default=2, ge=1, le=100)
    # A record that was running alone when this many incarnations died is dead-lettered
    # POISON without running it again. 2: a crash with the record alone points at it; a
    # second rules out a coincidence (the node dying for its own reasons). With the
    # defaults a poison record costs 4 restarts: every death is counted once, including
    # that of an incarnation which committed work before it met the record.
    poison_after: int = Field(default=2, ge=1, le=100)


class ActorResources(_Frozen):
    """What the Ray actor asks for (the topology spec's `resources`: gpus, cpus, custom)."""

    # None: one GPU for the vLLM backend (it owns the device), none otherwise. CPU runs
    # (tests, the fake engine) leave it None or set 0.
    gpus: float | None = Field(default=None, ge=0)
    # One core: the consumer thread, the engine's event loop and the Kafka clients' I/O
    # threads share one Python process (one GIL) anyway.
    cpus: float = Field(default=1.0, ge=0)
    custom: dict[str, float] = Field(default_factory=dict)


def check_question_sets(sets: Mapping[str, Mapping[str, Question]]) -> None:
    """Each question set has questions, each id is a plain word, and the set has an order
    it can be asked in (no dependency cycle). ValueError naming `question_sets.<name>`."""
    for name, questions in sets.items():
        if not questions:
            raise ValueError(f"question_sets.{name}: question set {name!r} has no questions")
        for qid in questions:
            if not is_question_id(qid):
                raise ValueError(
                    f"question_sets.{name}: question id {qid!r} must match {QUESTION_ID_PATTERN}"
                )
        try:
            question_order(questions)
        except RequestRejected as exc:
            raise ValueError(f"question_sets.{name}: {exc.error.message}") from exc


class PipelineFields(OutputFields, _Frozen):
    """What a pipeline says about its work, declared once with its checks: the topology's
    `PipelineSpec` and `WorkerSettings` both inherit it, and `WorkerSettings.from_spec`
    copies it by name. How results are written (`output_format` and each format's options)
    comes from `schemas.formats.OutputFields`. The comment right above a field is its row in
    docs/configuration.md; a block above that one, after a blank line, is for the code's
    readers."""

    input_topics: list[str] = Field(min_length=1)
    output_topic: str
    dead_letter_topic: str
    engine: EngineSettings = Field(default_factory=EngineSettings)
    # A request's images: limits, and URL fetching (off unless `fetch_allow` names
    # prefixes; docs/images.md).
    images: ImageSettings = Field(default_factory=ImageSettings)
    batching: Batching = Field(default_factory=Batching)
    # How 240 s adds up (the comment after the blank line is the field's row in the docs):
    # it is the longest a healthy worker's oldest batch waits with the defaults, its steps
    # in a row: two batches' engine calls with their retries and splits (max_in_flight 2 x
    # about 15 calls of about 2 s at 256 reads on a GPU: 60 s), its outputs' acknowledgement
    # (delivery_timeout_ms, 120 s; past it the failure is an outage), its commit
    # (commit_timeout_s, 60 s). A revocation's wait (30 s) and a batch's wait to fill (50 ms)
    # fit within those. Below max_poll_interval_ms (300 s), after which Kafka itself takes
    # the member's partitions away. The worker counts from when its oldest held batch
    # started, or from its consumer thread's last poll while it owns lag (`workers.hosting.status`;
    # an outage is not a stall).

    # A replica holding records whose committed offsets have not moved for this long (or
    # not answering its status calls for this long) is STALLED: `dgstream status` exits 1,
    # `dgstream_failing{cause="STALLED"}` (docs/operations.md, "Health: STALLED and
    # FAILING"). 240 s: the longest a healthy worker's oldest batch waits with the defaults
    # (workers/hosting/settings.py says how it adds up).
    stall_after_s: float = Field(default=240, gt=0)
    delivery: Delivery = "at_least_once"
    # "confluent": input values carry the Schema Registry wire format (0x00, a 4-byte schema
    # id, the JSON); the id is checked against `schema_registry` when set (cached; while the
    # registry is away, records are read unchecked and counted). A value not framed is
    # dead-lettered NOT_FRAMED, an id the registry does not know SCHEMA_ID_UNKNOWN.
    input_framing: Framing = "none"
    # "confluent": each result is framed with the id of its JSON Schema, registered under
    # "<topic>-value" of the topic it goes to (needs `schema_registry`). Dead letters are
    # never framed.
    output_framing: Framing = "none"
    # The registry's Confluent-compatible API (Confluent's `http://host:8081`, Apicurio's
    # `http://host:8080/apis/ccompat/v7`).
    schema_registry: RegistrySettings | None = None
    # Static membership (KIP-345): the replica keeps its partitions across restarts (no
    # rebalance while Ray restarts it) under the instance id `group_instance_id`.
    static_membership: bool = False
    # In order: the first route whose `when` holds sends a result to its `topic`; results
    # no route takes go to output_topic (docs/routes.md). A request's reply_topic wins over
    # both.
    routes: list[Route] = Field(default_factory=list)
    # Where a request's reply_topic may point (shell-style patterns); the output topic is
    # always allowed, internal topics ("__..."), the input topics and the dead-letter topic
    # never are. Default: the Python client's reply topics ("dgstream.replies.<id>").
    reply_topics: list[str] = Field(default_factory=lambda: ["dgstream.replies.*"])
    # A calibration file (`dgstream calibrate` writes it), applied before the routes: its
    # path, relative to this topology file (`dgstream run` reads it and sends its content).
    # The engine's probabilities stay beside the calibrated ones.
    calibration: Calibration | None = None
    # Shadow mode: a second pipeline on the same input, in its own consumer group, writing
    # every result to its own output topic; its routes are evaluated (each result's audit
    # names the one that matched) but not acted on, and reply topics are ignored
    # (`dgstream compare` reads the two pipelines' results side by side).
    shadow: bool = False

    # ---------------------------------------------------------------- validation

    @field_validator("input_topics", "output_topic", "dead_letter_topic")
    @classmethod
    def _topic_names(cls, value: str | list[str]) -> str | list[str]:
        for name in [value] if isinstance(value, str) else value:
            if not is_topic_name(name):
                raise ValueError(f"{name!r} is not a valid Kafka topic name")
        return value

    @model_validator(mode="after")
    def _topics_and_framing(self) -> Self:
        if self.output_framing != "none" and self.schema_registry is None:
            raise ValueError("output_framing needs schema_registry (the result schema's id)")
        outputs = {self.output_topic, self.dead_letter_topic}
        if outputs & set(self.input_topics):
            raise ValueError("output and dead-letter topics must differ from the input topics")
        if len(set(self.input_topics)) != len(self.input_topics):
            raise ValueError("input_topics lists a topic twice")
        return self

    def check_references(self, question_sets: Mapping[str, Mapping[str, Question]]) -> None:
        """The routes and every format's options name only questions of `question_sets` and
        topics the pipeline may write (ValueError naming the route or option otherwise).
        The worker's settings check their own question sets; a topology, each pipeline's."""
        check_routes(
            self.routes,
            list(question_sets.values()) or None,
            forbidden_topics=[*self.input_topics, self.dead_letter_topic],
        )
        self.check_output_options({r.name for r in self.routes}, question_sets)


# WorkerSettings fields that no pipeline spec field sets: the replica's identity
# (`deployment`, `replica`, `worker_name`), what the controller passes to every pipeline
# alike (`kafka`, the topology's `tracing`), and the process's tuning, left at its defaults
# by the controller. Every other field is a `PipelineFields` field or comes from a spec
# field of another name (`topology.spec.SPEC_TO_WORKER`); tests/topology/test_config_model.py
# fails on a field that is neither.
RUNTIME_ONLY = frozenset(
    {
        "deployment",
        "replica",
        "worker_name",
        "kafka",
        "tracing",
        "parse_limits",
        "consumer",
        "engine_retries",
        "engine_retry_backoff_s",
        "outage",
        "poison",
        "drain_timeout_s",
        "commit_timeout_s",
        "log_level",
    }
)


@holds_kinds
class WorkerSettings(PipelineFields):
    """One replica of one pipeline: where to read and write, which engine, how to batch.
    What the pipeline says (topics, engine, batching, delivery, framing, routes, output
    format ...) comes from `PipelineFields`, the same fields as the topology's pipeline;
    the rest is this replica's (`RUNTIME_ONLY`) or named otherwise in the topology."""

    pipeline: str = Field(pattern=_NAME_PATTERN)
    # The topology's `ray.deployment`: two deployments of one pipeline (an upgrade runs
    # the new one beside the old, in the same group) must not share transactional or
    # static member ids, or each would fence the other's replica of the same number.
    deployment: str = Field(default="default", pattern=_NAME_PATTERN)
    group_id: str = Field(min_length=1, max_length=249)
    kafka: KafkaConnection
    question_sets: dict[str, dict[str, Question]] = Field(default_factory=dict)
    parse_limits: ParseLimits = DEFAULT_LIMITS
    replica: int = Field(default=0, ge=0)
    # Default: "<deployment>.<pipeline>-<replica>". Goes into logs, metrics, result headers and
    # diagnostics, dead letters and the Kafka client id.
    worker_name: str | None = Field(default=None, min_length=1, max_length=200)
    consumer: ConsumerTuning = Field(default_factory=ConsumerTuning)
    producer: ProducerTuning = Field(default_factory=ProducerTuning)
    resources: ActorResources = Field(default_factory=ActorResources)
    # A batch that fails with a recoverable engine error is tried again this many times
    # before it is split in halves to find the request at fault. 2: a transient failure
    # (a timeout, an OOM under a burst) rarely repeats twice; a request that breaks the
    # engine fails every time, and the split costs about 2 x log2(batch) more calls.
    engine_retries: int = Field(default=2, ge=0, le=10)
    # Pause between those tries (doubling each time).
    engine_retry_backoff_s: float = Field(default=0.05, ge=0)
    outage: OutageTuning = Field(default_factory=OutageTuning)
    poison: PoisonTuning = Field(default_factory=PoisonTuning)
    # OpenTelemetry traces (off by default).
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    # drain() waits this long for batches in flight before it gives up on them (they
    # are then consumed again by the partitions' next owner).
    drain_timeout_s: float = Field(default=60.0, gt=0)
    # A commit (offsets; exactly-once: send_offsets_to_transaction, commit or abort of the
    # transaction) gives up after this long. kafka-python waits on transactional calls
    # without a bound; Java's producer bounds them by max.block.ms, 60 s by default, and
    # so does this. At-least-once tries again on the next pass; exactly-once fails the
    # worker (the transaction's state is unknown; the next incarnation aborts it).
    commit_timeout_s: float = Field(default=60.0, gt=0)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @classmethod
    def from_spec(cls, spec: PipelineFields, **fields: Any) -> WorkerSettings:
        """A replica's settings: every `PipelineFields` field of `spec` (a topology's
        `PipelineSpec`) copied by name, and `fields`: the `RUNTIME_ONLY` ones and the spec's
        fields of other names (`topology.spec.Topology.worker_settings` passes them). A
        field given both ways is refused: the spec's is the one."""
        shared = {name: getattr(spec, name) for name in PipelineFields.model_fields}
        twice = sorted(shared.keys() & fields.keys())
        if twice:
            raise TypeError(f"WorkerSettings.from_spec: {twice} come from the spec")
        return cls.model_validate({**shared, **fields})

    # ---------------------------------------------------------------- validation

    @field_validator("question_sets")
    @classmethod
    def _question_sets(
        cls, value: dict[str, dict[str, Question]]
    ) -> dict[str, dict[str, Question]]:
        check_question_sets(value)
        return value

    @model_validator(mode="after")
    def _references(self) -> WorkerSettings:
        self.check_references(self.question_sets)
        return self

    # ---------------------------------------------------------------- derived names

    @property
    def event_source(self) -> str:
        """The CloudEvents `source` of this pipeline's results and dead letters."""
        return f"/dgstream/{self.deployment}/{self.pipeline}"

    @property
    def name(self) -> str:
        """The worker's name: `worker_name`, or "<deployment>.<pipeline>-<replica>" (its
        actor's name without "dgstream-"), so results, dead letters, logs and metrics say
        which deployment answered while two run side by side (an upgrade)."""
        return self.worker_name or f"{self.deployment}.{self.pipeline}-{self.replica}"

    @property
    def group_instance_id(self) -> str:
        """Static member id: stable across restarts of the same replica, distinct per
        deployment."""
        return f"{self.deployment}-{self.pipeline}-{self.replica}"

    @property
    def transactional_id(self) -> str:
        """Stable across restarts of the same replica, so a restarted one fences its
        zombie; distinct per deployment, so two deployments of one pipeline do not fence
        each other (between them, the group coordinator's generation check fences)."""
        return f"{self.group_id}-{self.deployment}-{self.pipeline}-{self.replica}"

    @property
    def num_gpus(self) -> float:
        """GPUs the actor asks Ray for."""
        if self.resources.gpus is not None:
            return self.resources.gpus
        from dgstream.workers.engine.backends import get_backend

        return get_backend(self.engine.backend).gpus  # the backend's default (vllm: 1)

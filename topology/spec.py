"""The topology file: a YAML document validated by pydantic.

Every error names the path of the bad field (`pipelines[0].replicas.max`). Secrets never
live in the file: the Kafka section (a `KafkaConnection`) names environment variables
(`sasl_password_env`, `ssl_password_env`), read by each process that connects, on its node.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from schemas import Question
from schemas.formats import OutputFields
from schemas.names import TOPIC_PATTERN
from schemas.request import QUESTION_TYPES
from workers.calibration import Calibration
from workers.engine.factory import EngineSettings
from workers.images.settings import ImageSettings
from workers.kafka_settings import KafkaConnection
from workers.registry import RegistrySettings
from workers.routes import Route, check_routes
from workers.settings import Batching, CompressionType, Framing
from workers.tracing import TracingSettings

_NAME = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"  # pipeline names go into actor names


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class KafkaSpec(KafkaConnection):
    """The Kafka cluster: a `KafkaConnection`, the same settings object the worker, the
    controller, the client and the `dgstream` commands use. A password is never written
    here: `sasl_password_env` / `ssl_password_env` name the environment variable that
    holds it on every Ray node (the controller and each worker read it there), and a
    literal `sasl_password` / `ssl_password` is refused."""

    @field_validator("sasl_password", "ssl_password", mode="before")
    @classmethod
    def _no_secret_in_the_file(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise ValueError(
                f"a topology never holds a password: name the environment variable that "
                f"holds it ({info.field_name}_env)"
            )
        return v


class TopicSpec(_Frozen):
    # Partitions bound the replicas (one consumer per partition at most); 8 lets a pool
    # grow to 8 GPUs, the largest single host lent here.
    partitions: int = Field(default=8, ge=1)
    replication_factor: int = Field(default=1, ge=1)


class ResourcesSpec(_Frozen):
    # One GPU a replica whatever the engine's backend: a pipeline on the CPU (the
    # transformers engine with device cpu, the fake engine) says 0, else each replica
    # waits for a GPU the cluster may not have.
    gpus: float = Field(default=1, ge=0)
    cpus: float = Field(default=1, ge=0)
    custom: dict[str, float] = Field(default_factory=dict)


class ReplicasSpec(_Frozen):
    min: int = Field(default=1, ge=0)
    max: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _order(self) -> ReplicasSpec:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class AutoscaleSpec(_Frozen):
    # KEDA's Kafka scaler defaults: lagThreshold 10, activationLagThreshold 0
    # (keda.sh/docs/scalers/apache-kafka); ours is per GPU worker, which answers hundreds
    # of reads a second, hence a larger default target.
    target_lag_per_replica: int = Field(default=1000, ge=1)
    activation_lag: int = Field(default=0, ge=0)
    # The HPA's defaults: scale out at once, scale in after 300 s of calm.
    scale_out_stabilization_s: float = Field(default=0, ge=0)
    scale_in_stabilization_s: float = Field(default=300, ge=0)
    # KEDA's default pollingInterval is 30 s; lag moves faster than that under a spike.
    poll_interval_s: float = Field(default=5, gt=0)


class RestartSpec(_Frozen):
    """How the controller starts a failed replica again: at once the first time, then after
    a pause that doubles with each failure in a row, up to the cap. A replica that fails
    on every start (a batch it cannot read) then costs one start per cap, not a crash loop."""

    # A pause of a few ticks (the default poll is 5 s): a second failure in a row is rarely
    # a blip, and the next tries come at 10, 20, 40 s ...
    initial_backoff_s: float = Field(default=5, gt=0)
    # Five minutes: a failing replica costs one start (an engine load: minutes with vLLM)
    # per five minutes, and a fixed cause is picked up within them.
    max_backoff_s: float = Field(default=300, gt=0)
    # A replica that served this long in a row has its failures forgotten: as long as the
    # cap, so a replica failing at that rate still counts as failing.
    reset_after_s: float = Field(default=300, gt=0)
    # This many restarts of one replica in a row (Ray's of its process and the
    # controller's, whatever ended it; none forgotten until it has served reset_after_s in a
    # row) are a restart loop: the pipeline is FAILING (CRASH_LOOP), and the controller
    # takes the replica over from Ray's immediate restarts onto its backoff. 5: a poison
    # record costs 4 restarts with the worker's defaults (poison.suspect_after 2 +
    # poison_after 2) before it is dead-lettered, which is no loop; one worker exiting on
    # every record (seen on 2026-12-07: 48 incarnations in 5 minutes) reaches 5 within
    # half a minute.
    loop_restarts: int = Field(default=5, ge=1)


class PipelineSpec(OutputFields, _Frozen):
    """One pipeline. `output_format` and each output format's options key come from
    `schemas.formats`, the same fields as the worker's settings."""

    name: str = Field(pattern=_NAME)
    input_topics: list[str] = Field(min_length=1)
    output_topic: str = Field(pattern=TOPIC_PATTERN)
    dead_letter_topic: str = Field(pattern=TOPIC_PATTERN)
    consumer_group: str = Field(min_length=1, max_length=249)
    topics: TopicSpec = Field(default_factory=TopicSpec)
    question_sets: list[str] = Field(default_factory=list)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    # A request's images: limits, and URL fetching (off unless `fetch_allow` names
    # prefixes; docs/images.md).
    images: ImageSettings = Field(default_factory=ImageSettings)
    batching: Batching = Field(default_factory=Batching)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    replicas: ReplicasSpec = Field(default_factory=ReplicasSpec)
    autoscale: AutoscaleSpec = Field(default_factory=AutoscaleSpec)
    restarts: RestartSpec = Field(default_factory=RestartSpec)
    # A replica holding records whose committed offsets have not moved for this long (or
    # not answering its status calls for this long) is STALLED: `dgstream status` exits 1,
    # `dgstream_failing{cause="STALLED"}` (docs/operations.md, "Health: STALLED and
    # FAILING"). 240 s: the longest a healthy worker's oldest batch waits with the defaults
    # (WorkerSettings.stall_after_s says how it adds up).
    stall_after_s: float = Field(default=240, gt=0)
    delivery: Literal["at_least_once", "exactly_once"] = "at_least_once"
    # The codec of the record batches the workers write, results and dead letters alike:
    # "none" (the default: any consumer reads them, with no codec library), "gzip",
    # "snappy", "lz4" or "zstd". Input batches of every codec are read whatever this says.
    compression_type: CompressionType = "none"
    # "confluent": input values carry the Schema Registry wire format (0x00, a 4-byte schema
    # id, the JSON); the id is checked against `schema_registry` when set (cached; while the
    # registry is away, records are read unchecked and counted). A value not framed is
    # dead-lettered NOT_FRAMED, an id the registry does not know SCHEMA_ID_UNKNOWN.
    input_framing: Framing = "none"
    # "confluent": each result is framed with the id of its JSON Schema, registered under
    # "<topic>-value" of the topic it goes to (needs `schema_registry`).
    output_framing: Framing = "none"
    # The registry's Confluent-compatible API (Confluent's `http://host:8081`, Apicurio's
    # `http://host:8080/apis/ccompat/v7`).
    schema_registry: RegistrySettings | None = None
    static_membership: bool = False
    # In order: the first route whose `when` holds sends a result to its `topic`; results
    # no route takes go to output_topic (docs/routes.md).
    routes: list[Route] = Field(default_factory=list)
    # Where a request's reply_topic may point (shell-style patterns); the output topic is
    # always allowed. Default: the Python client's reply topics.
    reply_topics: list[str] = Field(default_factory=lambda: ["dgstream.replies.*"])
    # A calibration file (`dgstream calibrate` writes it), applied before the routes: its
    # path, relative to this topology file (`dgstream run` reads it and sends its content).
    calibration: Calibration | None = None
    # Shadow mode: a second pipeline on the same input, in its own consumer group, writing
    # every result to its own output topic; its routes are evaluated (each result's audit
    # names the one that matched) but not acted on, and reply topics are ignored
    # (`dgstream compare` reads the two pipelines' results side by side).
    shadow: bool = False

    @field_validator("calibration", mode="before")
    @classmethod
    def _calibration_content(cls, v: Any) -> Any:
        if isinstance(v, str):
            raise ValueError(
                f"{v!r}: a calibration file's path is read when the topology file is loaded "
                "(load_topology, dgstream run); here its content was expected"
            )
        return v

    @model_validator(mode="after")
    def _topics(self) -> PipelineSpec:
        import re

        for t in self.input_topics:
            if not re.match(TOPIC_PATTERN, t):
                raise ValueError(f"input topic {t!r} is not a valid Kafka topic name")
        if self.output_topic in self.input_topics or self.dead_letter_topic in self.input_topics:
            raise ValueError("output and dead-letter topics must differ from the input topics")
        if self.output_framing != "none" and self.schema_registry is None:
            raise ValueError("output_framing needs schema_registry (the result schema's id)")
        return self


class RaySpec(_Frozen):
    """Where the deployment runs. Ray's token authentication (RAY_AUTH_MODE=token) is on
    when `auth_token_env` names the variable that holds the cluster's token."""

    # None: RAY_ADDRESS, else a cluster on this machine (`ray start --head`), else a new one.
    address: str | None = None
    namespace: str = "dgstream"
    # The deployment's name: the controller is the detached actor "dgstream-controller-<name>".
    deployment: str = Field(default="default", pattern=_NAME)
    auth_token_env: str | None = None

    def init(self, environ: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        """`ray.init` with this spec (token auth from the environment, never logged)."""
        import ray

        env = os.environ if environ is None else environ
        if self.auth_token_env is not None:
            if self.auth_token_env not in env:
                raise SpecError(f"ray.auth_token_env: {self.auth_token_env} is not set")
            os.environ["RAY_AUTH_MODE"] = "token"
            os.environ["RAY_AUTH_TOKEN"] = env[self.auth_token_env]
        ray.init(address=self.address, namespace=self.namespace, **kwargs)


class Topology(_Frozen):
    kafka: KafkaSpec
    ray: RaySpec = Field(default_factory=RaySpec)
    # OpenTelemetry traces of every worker (OTLP export; off by default).
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    question_sets: dict[str, dict[str, Question]] = Field(default_factory=dict)
    pipelines: list[PipelineSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _references(self) -> Topology:
        names = [p.name for p in self.pipelines]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"pipeline names must be unique: {sorted(dup)}")
        for i, p in enumerate(self.pipelines):
            for qs in p.question_sets:
                if qs not in self.question_sets:
                    raise ValueError(
                        f"pipelines[{i}].question_sets: unknown question set {qs!r} "
                        f"(defined: {sorted(self.question_sets)})"
                    )
        from schemas import RequestRejected, question_order

        for name, questions in self.question_sets.items():
            try:
                question_order(questions)
            except RequestRejected as exc:
                raise ValueError(f"question_sets.{name}: {exc.error.message}") from exc
        for i, p in enumerate(self.pipelines):
            # With question sets, route ids and answers are checked against them.
            sets = [self.question_sets[n] for n in p.question_sets] or None
            try:
                check_routes(
                    p.routes, sets, forbidden_topics=[*p.input_topics, p.dead_letter_topic]
                )
            except ValueError as exc:
                raise ValueError(f"pipelines[{i}].{exc}") from None
            try:
                p.check_output_options({r.name for r in p.routes}, self.question_sets_for(p))
            except ValueError as exc:
                raise ValueError(f"pipelines[{i}].{exc}") from None
        _check_shadows(self.pipelines)
        return self

    def pipeline(self, name: str) -> PipelineSpec:
        for p in self.pipelines:
            if p.name == name:
                return p
        raise KeyError(name)

    def question_sets_for(self, pipeline: PipelineSpec) -> dict[str, dict[str, Question]]:
        return {n: self.question_sets[n] for n in pipeline.question_sets}


def _written(p: PipelineSpec) -> set[str]:
    """Every topic a pipeline writes to."""
    return {p.output_topic, p.dead_letter_topic, *(r.topic for r in p.routes)}


def _check_shadows(pipelines: list[PipelineSpec]) -> None:
    """A shadow pipeline shares nothing but its input with the others: not its consumer
    group (it would take their partitions), not a topic it writes (its results would mix
    with theirs)."""
    for i, p in enumerate(pipelines):
        if not p.shadow:
            continue
        for j, other in enumerate(pipelines):
            if i == j:
                continue
            if other.consumer_group == p.consumer_group:
                raise ValueError(
                    f"pipelines[{i}] ({p.name}) is a shadow: its consumer_group must be its "
                    f"own, not that of pipelines[{j}] ({other.name})"
                )
            mine = {p.output_topic, p.dead_letter_topic}
            shared = sorted(mine & (_written(other) | set(other.input_topics)))
            if shared:
                raise ValueError(
                    f"pipelines[{i}] ({p.name}) is a shadow: it must write to topics of its "
                    f"own; {shared} belong to pipelines[{j}] ({other.name})"
                )


def inline_files(data: Any, base: Path) -> Any:
    """The topology document with each pipeline's `calibration` path (relative to `base`,
    the topology file's folder) replaced by the file's content, so that the controller
    (on a Ray node, where the path may not exist) gets the calibration itself."""
    if not isinstance(data, dict) or not isinstance(data.get("pipelines"), list):
        return data
    pipelines = []
    for i, p in enumerate(data["pipelines"]):
        if isinstance(p, dict) and isinstance(p.get("calibration"), str):
            path = (base / p["calibration"]).expanduser()
            try:
                content = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise SpecError(f"pipelines[{i}].calibration: cannot read {path}: {exc}") from None
            p = {**p, "calibration": content}
        pipelines.append(p)
    return {**data, "pipelines": pipelines}


class SpecError(ValueError):
    """A topology file that cannot be used; the message names the bad field's path."""


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def parse_topology(data: Any, source: str = "topology") -> Topology:
    try:
        return Topology.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            # Discriminated unions add the tag to the path; it is not a field.
            loc = tuple(p for p in err["loc"] if p not in QUESTION_TYPES)
            lines.append(f"{_path(loc)}: {err['msg']}")
        raise SpecError(f"{source}: " + "; ".join(lines)) from None


def load_topology(path: str | Path) -> Topology:
    p = Path(path)
    return parse_topology(read_topology(p), str(p))


def read_topology(path: str | Path) -> Any:
    """The topology file's document, its calibration files read in (`inline_files`)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise SpecError(f"{p}: not valid YAML: {exc}") from None
    return inline_files(data, p.parent)

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
from typing import Any

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

from dgstream.schemas import Question
from dgstream.schemas.kinds import holds_kinds, question_types
from dgstream.schemas.names import DEPLOYMENT_NAME_PATTERN
from dgstream.workers.hosting.settings import (
    ActorResources,
    CompressionType,
    PipelineFields,
    ProducerTuning,
    WorkerSettings,
    check_question_sets,
)
from dgstream.workers.kafka.settings import KafkaConnection
from dgstream.workers.results.tracing import TracingSettings

_NAME = DEPLOYMENT_NAME_PATTERN  # pipeline names go into actor names


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


# Spec fields that only the control plane reads (the topics' creation, the replica count,
# autoscaling, restarts): no worker setting holds them.
CONTROL_PLANE_ONLY = frozenset({"topics", "replicas", "autoscale", "restarts"})
# Spec fields the worker's settings hold under another name or in another shape: spec field
# -> WorkerSettings field (`Topology.worker_settings` converts them). Every field of
# `PipelineFields` is copied by name; tests/topology/test_config_model.py fails on a spec
# field that is in none of the three.
SPEC_TO_WORKER = {
    "name": "pipeline",
    "consumer_group": "group_id",
    "question_sets": "question_sets",  # names here, the sets themselves there
    "compression_type": "producer",
    "resources": "resources",
}


class PipelineSpec(PipelineFields):
    """One pipeline. `output_format` and each output format's options key come from
    `schemas.formats`, the same fields as the worker's settings."""

    name: str = Field(pattern=_NAME)
    consumer_group: str = Field(min_length=1, max_length=249)
    topics: TopicSpec = Field(default_factory=TopicSpec)
    question_sets: list[str] = Field(default_factory=list)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    replicas: ReplicasSpec = Field(default_factory=ReplicasSpec)
    autoscale: AutoscaleSpec = Field(default_factory=AutoscaleSpec)
    restarts: RestartSpec = Field(default_factory=RestartSpec)
    # The codec of the record batches the workers write, results and dead letters alike:
    # "none" (the default: any consumer reads them, with no codec library), "gzip",
    # "snappy", "lz4" or "zstd". Input batches of every codec are read whatever this says.
    compression_type: CompressionType = "none"

    @field_validator("calibration", mode="before")
    @classmethod
    def _calibration_content(cls, v: Any) -> Any:
        if isinstance(v, str):
            raise ValueError(
                f"{v!r}: a calibration file's path is read when the topology file is loaded "
                "(load_topology, dgstream run); here its content was expected"
            )
        return v


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


@holds_kinds
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
        check_question_sets(self.question_sets)
        for i, p in enumerate(self.pipelines):
            # With question sets, route ids and answers are checked against them.
            try:
                p.check_references(self.question_sets_for(p))
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

    def worker_settings(
        self, pipeline: PipelineSpec, replica: int, kafka: KafkaConnection
    ) -> WorkerSettings:
        """One replica's settings: `pipeline`'s `PipelineFields` copied by name
        (`WorkerSettings.from_spec`), its fields of other names converted
        (`SPEC_TO_WORKER`), the topology's deployment name and tracing, and the replica's
        number and Kafka connection."""
        p = pipeline
        return WorkerSettings.from_spec(
            p,
            pipeline=p.name,
            group_id=p.consumer_group,
            question_sets=self.question_sets_for(p),
            producer=ProducerTuning(compression_type=p.compression_type),
            resources=ActorResources.model_validate(p.resources.model_dump()),
            deployment=self.ray.deployment,
            tracing=self.tracing,
            kafka=kafka,
            replica=replica,
        )


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
        tags = question_types()
        for err in exc.errors():
            # Discriminated unions add the tag to the path; it is not a field.
            loc = tuple(p for p in err["loc"] if p not in tags)
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

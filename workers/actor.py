"""The Ray actor around one `StreamWorker`: one engine, its GPU, one group member.

Thin on purpose (`StreamWorker` does the work and is tested without Ray): it adds placement,
restarts (a fatal error ends the process so that Ray restarts it), concurrent status calls,
and a Kafka check before the worker starts. docs/worker.md, "The Ray actor", has the
details and the calls the controller makes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import ray

from workers.logs import configure_logging, get_logger
from workers.poll_errors import UnreadableBatch
from workers.settings import WorkerSettings
from workers.status import ReplicaReport
from workers.worker import StreamWorker

__all__ = [
    "WorkerActor",
    "actor_name",
    "actor_options",
    "create_worker",
    "replica_prefix",
    "retire",
]

# status(), ping() and drain() may overlap; the worker itself runs on its own thread.
_MAX_CONCURRENCY = 4
# Exit code of a worker that failed on purpose so that Ray restarts it (EX_SOFTWARE).
_EXIT_FOR_RESTART = 70


class _WorkerActorImpl:
    def __init__(self, settings: WorkerSettings, autostart: bool = True) -> None:
        configure_logging(settings.log_level)
        self._settings = settings
        ctx = ray.get_runtime_context()
        self._actor_id = ctx.get_actor_id()
        self._restarted = bool(ctx.was_current_actor_reconstructed)
        self._log = get_logger(worker=settings.name, pipeline=settings.pipeline)
        self._worker = StreamWorker(settings)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._created = time.time()
        self._error: str | None = None
        self._failure: dict[str, Any] | None = None  # an UnreadableBatch's facts
        self._log.info("actor_created", actor_id=self._actor_id, restarted=self._restarted)
        if autostart:
            self.start()

    def start(self) -> dict[str, Any]:
        """Start consuming (idempotent; a drained or stopped worker stays so); returns
        `status()`."""
        with self._lock:
            if self._thread is None and self._worker.state == "new":
                self._thread = threading.Thread(
                    target=self._run, name=f"{self._settings.name}-consumer", daemon=True
                )
                self._thread.start()
        return self.status()

    def _run(self) -> None:
        from workers.kafka_probe import KafkaConnectError, check_connection

        try:
            check_connection(self._settings.kafka)
        except KafkaConnectError as exc:
            if exc.fatal:  # the same settings would fail the same way after a restart
                self._error = f"kafka: {exc}"
                self._log.error("kafka_refused", reason=exc.reason, error=str(exc))
                return
        try:
            self._worker.run()
        except UnreadableBatch as exc:
            # A restart would meet the same batch at once: stay up, failed, and say why;
            # the controller ends this actor with the cause and starts another after its
            # backoff (`exit_failed`).
            self._error, self._failure = exc.describe(), exc.as_dict()
            self._log.error("unreadable_batch", **self._failure)
        except BaseException as exc:
            # Let Ray restart this actor: an exception here would only end the thread.
            self._log.error("actor_exit_for_restart", error=f"{type(exc).__name__}: {exc}")
            sys.stderr.flush()
            os._exit(_EXIT_FOR_RESTART)

    def drain(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Stop fetching, finish in flight, commit, leave the group; returns `status()`."""
        return self._annotate(self._worker.drain(timeout_s))

    def stop(self) -> dict[str, Any]:
        """Leave at once (work in flight is consumed again elsewhere)."""
        return self._annotate(self._worker.stop())

    def status(self) -> dict[str, Any]:
        return self._annotate(self._worker.status())

    def report(self) -> ReplicaReport:
        """What the controller reads, typed (`status()` is the fuller dict)."""
        state, answered, dead, engine_s = self._worker.report()
        cause = self._failure["cause"] if self._failure else None
        return ReplicaReport(state, self._actor_id, answered, dead, engine_s, self._error, cause)

    def exit_failed(self) -> None:
        """End this actor with its error as the cause Ray records: the actor's state is DEAD
        and its death cause (the Ray dashboard, `ray list actors --detail`) carries the
        error. Ray does not restart an actor that exits so; the controller does, after its
        backoff. Answers nothing (the call fails with ActorDiedError)."""
        from ray._raylet import (  # type: ignore[attr-defined]
            raise_sys_exit_with_custom_error_message,
        )

        why = self._error or f"the worker is {self._worker.state}"
        self._log.warning("actor_exit_failed", error=why)
        sys.stderr.flush()
        # Ray's own exit_actor() with a message of ours (the same private helper it uses).
        raise_sys_exit_with_custom_error_message(f"dgstream: {why}")

    def ping(self) -> str:
        return "pong"

    def _annotate(self, status: dict[str, Any]) -> dict[str, Any]:
        return {
            **status,
            **({"error": self._error} if self._error else {}),
            **({"failure": self._failure} if self._failure else {}),
            "actor_id": self._actor_id,
            "restarted": self._restarted,
            "pid": os.getpid(),
            # The GPUs Ray gave this actor (one per replica with vLLM): operators and the
            # several-GPU benchmark see which card each replica's engine runs on.
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }


# Defaults that every replica shares; `actor_options` adds placement and the name.
# (Ray's type stubs do not list max_concurrency, hence the untyped handle on ray.remote.)
_remote: Any = ray.remote
WorkerActor: Any = _remote(max_restarts=-1, max_task_retries=0, max_concurrency=_MAX_CONCURRENCY)(
    _WorkerActorImpl
)


def replica_prefix(deployment: str, pipeline: str) -> str:
    """What the names of one deployment's replicas of `pipeline` start with. The dot
    cannot occur in either name (`[a-z0-9-]`), so no other deployment or pipeline shares
    the prefix: two deployments of one pipeline (an upgrade) run side by side in one
    namespace, and a controller adopts its own replicas only."""
    return f"dgstream-{deployment}.{pipeline}-"


def actor_name(settings: WorkerSettings) -> str:
    """The actor's name in its namespace: one per deployment, pipeline and replica,
    `dgstream-<deployment>.<pipeline>-<replica>`."""
    return f"{replica_prefix(settings.deployment, settings.pipeline)}{settings.replica}"


def actor_options(
    settings: WorkerSettings,
    *,
    name: str | None = None,
    lifetime: str | None = None,
    namespace: str | None = None,
) -> dict[str, Any]:
    """The `.options(...)` of a replica: name, placement from `settings.resources`,
    `max_restarts=-1` (Ray restarts a crashed worker) and `max_task_retries=0` (a method
    call is not replayed on a restarted actor)."""
    opts: dict[str, Any] = {
        "name": name or actor_name(settings),
        "num_gpus": settings.num_gpus,
        "num_cpus": settings.resources.cpus,
        "max_restarts": -1,
        "max_task_retries": 0,
    }
    if settings.resources.custom:
        opts["resources"] = dict(settings.resources.custom)
    if lifetime is not None:
        opts["lifetime"] = lifetime
    if namespace is not None:
        opts["namespace"] = namespace
    return opts


def create_worker(
    settings: WorkerSettings,
    *,
    name: str | None = None,
    lifetime: str | None = None,
    namespace: str | None = None,
    autostart: bool = True,
) -> Any:
    """A started replica (its handle). Ray must be initialized."""
    opts = actor_options(settings, name=name, lifetime=lifetime, namespace=namespace)
    return WorkerActor.options(**opts).remote(settings, autostart)


def retire(handle: Any, *, timeout_s: float | None = None) -> dict[str, Any]:
    """Scale-in: drain the replica, then remove the actor for good; returns its last status."""
    try:
        status: dict[str, Any] = ray.get(handle.drain.remote(timeout_s), timeout=None)
    finally:
        ray.kill(handle, no_restart=True)
    return status

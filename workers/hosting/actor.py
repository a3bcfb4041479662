"""The Ray actor around one `StreamWorker`: one engine, its GPU, one group member.

Thin on purpose (`StreamWorker` does the work and is tested without Ray): it adds placement,
restarts (a fatal error ends the process so that Ray restarts it), concurrent status calls,
and a Kafka check before the worker starts. docs/worker.md, "The Ray actor", has the
details and the calls the controller makes.

What the Ray dashboard shows of a replica (its Actors table, read from Ray 2.60's dashboard
client): Ray's lifecycle state (ALIVE, RESTARTING, DEAD), "Restarted" (how many times Ray
restarted it), "Exit detail" (a dead actor's death cause), and "Repr", which Ray takes once,
when the actor is created, so it cannot carry a state that changes. So a replica's own
state goes where the dashboard shows it live: the metric `dgstream_worker_state{state}`
(1 for "stalled" while it makes no progress, "failed" when it failed), its log (the events
`worker_stalled` and `worker_progressing`), and, when the controller ends a failing replica
(a batch it cannot read, a crash loop), the DEAD state with the cause as its exit detail
(`exit_failed`). docs/operations.md, "Health: STALLED and FAILING", has the whole picture.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

import ray

from dgstream.workers.faults.poll_errors import UnreadableBatch
from dgstream.workers.hosting.logs import configure_logging, get_logger
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.hosting.status import ReplicaReport
from dgstream.workers.hosting.worker import StreamWorker

__all__ = [
    "WorkerActor",
    "actor_name",
    "actor_options",
    "create_worker",
    "forget_last_exit",
    "last_exit",
    "order_exit",
    "replica_prefix",
    "retire",
]

# status(), ping() and drain() may overlap; the worker itself runs on its own thread.
_MAX_CONCURRENCY = 4
# Exit code of a worker that failed on purpose so that Ray restarts it (EX_SOFTWARE).
_EXIT_FOR_RESTART = 70
# Ray's internal key-value store (the GCS: it outlives the process, on whatever node Ray
# restarts it) holds, per replica, the error its last incarnation exited with for a restart
# (the controller names it when the replica restarts in a loop, which Ray's own records
# cannot: a restarted actor has no death cause, and Ray sees only the exit code), and the
# controller's order to end rather than restart (`order_exit`).
_KV_NAMESPACE = "dgstream"
_LAST_EXIT_CHARS = 1000
# An ordered exit's call runs on one of the actor's own threads within milliseconds; past
# this the process exits for a restart all the same (the controller then kills it).
_ORDERED_EXIT_WAIT_S = 10.0


class _WorkerActorImpl:
    def __init__(self, settings: WorkerSettings, autostart: bool = True) -> None:
        configure_logging(settings.log_level)
        self._settings = settings
        ctx = ray.get_runtime_context()
        self._actor_id = ctx.get_actor_id()
        self._restarted = bool(ctx.was_current_actor_reconstructed)
        self._log = get_logger(worker=settings.name, pipeline=settings.pipeline)
        # The actor's process is this worker's alone: its start-up heap can be frozen.
        self._worker = StreamWorker(settings, freeze_heap=True)
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
        from dgstream.workers.kafka.probe import KafkaConnectError, check_connection

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
            error = f"{type(exc).__name__}: {exc}"
            self._log.error("actor_exit_for_restart", error=error)
            _remember_exit(error)
            why = _exit_ordered(self._actor_id)
            if why:
                # The controller takes this replica out of Ray's restarts (a crash loop):
                # end through a call of our own, the only way Ray records a cause, and
                # wait for it (the process ends meanwhile).
                self._log.warning("actor_exit_ordered", error=why)
                with contextlib.suppress(Exception):
                    ray.get_runtime_context().current_actor.exit_failed.remote(why)
                    threading.Event().wait(_ORDERED_EXIT_WAIT_S)
            sys.stderr.flush()
            os._exit(_EXIT_FOR_RESTART)

    def drain(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Stop fetching, finish in flight, commit, leave the group; returns `status()`."""
        return self._annotate(self._worker.drain(timeout_s))

    def stop(self) -> dict[str, Any]:
        """Leave at once (work in flight is consumed again elsewhere)."""
        return self._annotate(self._worker.stop())

    def status(self) -> dict[str, Any]:
        status = self._worker.status()
        stalled = status.get("stall") is not None and status["state"] == "running"
        return {**self._annotate(status), "health": self._publish_state(stalled)}

    def report(self) -> ReplicaReport:
        """What the controller reads, typed (`status()` is the fuller dict)."""
        state, answered, dead, engine_s = self._worker.report()
        stall = self._worker.stall()
        self._publish_state(stall is not None)
        cause = self._failure["cause"] if self._failure else None
        return ReplicaReport(
            state,
            self._actor_id,
            answered,
            dead,
            engine_s,
            self._error,
            cause,
            stall=stall.describe() if stall else None,
            stalled_for_s=stall.for_s if stall else 0.0,
        )

    def _publish_state(self, stalled: bool) -> str:
        """The state operators see (`dgstream_worker_state`): "failed" with an error of the
        actor's, "stalled" while running without progress, else the worker's state."""
        state = "failed" if self._error else "stalled" if stalled else self._worker.state
        self._worker.metrics.set_state(state)
        return state

    def exit_failed(self, why: str | None = None) -> None:
        """End this actor with its error (or `why`, the controller's reason: a crash loop)
        as the cause Ray records: the actor's state is DEAD and its death cause (the Ray
        dashboard's "Exit detail", `ray list actors --detail`) carries it. Ray does not
        restart an actor that exits so; the controller does, after its backoff. Answers
        nothing (the call fails with ActorDiedError)."""
        from ray._raylet import (  # type: ignore[attr-defined]
            raise_sys_exit_with_custom_error_message,
        )

        why = why or self._error or f"the worker is {self._worker.state}"
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


def _kv_key(kind: str, namespace: str, name: str) -> bytes:
    return f"{kind}/{namespace}/{name}".encode()


def _kv_put(key: bytes, value: dict[str, Any]) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, json.dumps(value).encode(), overwrite=True, namespace=_KV_NAMESPACE)


def _kv_get(key: bytes) -> dict[str, Any] | None:
    """The record under `key`; None when there is none or it cannot be read."""
    try:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(key, namespace=_KV_NAMESPACE)
        value = None if raw is None else json.loads(raw)
    except Exception:
        return None
    return value if isinstance(value, dict) else None


def _remember_exit(error: str) -> None:
    """Leave this incarnation's last error where the controller finds it (`last_exit`);
    never raises (the process is on its way out)."""
    with contextlib.suppress(Exception):
        ctx = ray.get_runtime_context()
        name = ctx.get_actor_name()
        if name:
            record = {"error": error[:_LAST_EXIT_CHARS], "time": time.time()}
            _kv_put(_kv_key("last-exit", ctx.namespace, name), record)


def last_exit(namespace: str, name: str) -> tuple[str, float] | None:
    """The error with which the actor named `name` last exited for a restart, and when
    (time.time()); None when unknown."""
    value = _kv_get(_kv_key("last-exit", namespace, name))
    try:
        return None if value is None else (str(value["error"]), float(value["time"]))
    except (KeyError, TypeError, ValueError):
        return None


def order_exit(namespace: str, name: str, actor_id: str, why: str) -> None:
    """Tell the actor `actor_id` (named `name`) to end with `why` as its death cause the
    next time its worker fails, rather than exit for Ray to restart it: an incarnation of a
    replica in a crash loop may die before a call reaches it (`_exit_ordered`). Never
    raises."""
    with contextlib.suppress(Exception):
        _kv_put(_kv_key("exit-order", namespace, name), {"actor_id": actor_id, "why": why})


def _exit_ordered(actor_id: str | None) -> str | None:
    """The reason the controller gave this actor to end with (`order_exit`), if any."""
    with contextlib.suppress(Exception):
        ctx = ray.get_runtime_context()
        name = ctx.get_actor_name()
        order = _kv_get(_kv_key("exit-order", ctx.namespace, name)) if name else None
        if order is not None and order.get("actor_id") == actor_id:
            return str(order.get("why") or "")
    return None


def forget_last_exit(namespace: str, name: str) -> None:
    """Drop what `last_exit` and `order_exit` keep of the replica named `name` (removed on
    purpose)."""
    with contextlib.suppress(Exception):
        from ray.experimental.internal_kv import _internal_kv_del

        for kind in ("last-exit", "exit-order"):
            _internal_kv_del(_kv_key(kind, namespace, name), namespace=_KV_NAMESPACE)


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

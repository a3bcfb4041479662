"""The `dgstream` command.

Each subcommand lives in its own small function; heavy imports happen inside them so
that `dgstream --help` stays instant.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from dgstream.topology.cli.commands import Refused as _Refused

if TYPE_CHECKING:
    from dgstream.schemas import FallbackId


def _load_topology(path: str) -> Any:
    from dgstream.topology.spec import SpecError, load_topology

    try:
        return load_topology(path)
    except SpecError as exc:
        raise _Refused(str(exc)) from exc


def _connect(spec: Any, **init_kwargs: Any) -> None:
    """`ray.init` through the topology's Ray section (token, namespace, address)."""
    from dgstream.topology.spec import SpecError

    try:
        spec.init(**init_kwargs)
    except SpecError as exc:
        raise _Refused(str(exc)) from exc
    except ConnectionError as exc:  # unreachable, or refused (token authentication)
        raise _Refused(f"cannot connect to Ray at {spec.address}: {exc}") from exc


def _cmd_broker(args: argparse.Namespace) -> int:
    from dgstream.infra.kafka import broker

    return broker.cli(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from dgstream.topology.cli.demo import main as demo_main

    return demo_main(args.events, timeout_s=args.timeout)


def _ask_id(raw: bytes) -> FallbackId:
    """The id of a body without one (Jev's), as the worker names one after its record: here
    after its JSON (keys sorted, spacing dropped), so the same body, however it is laid
    out, gets the same id, hence the same canvas noise and the same answer on every run."""
    import hashlib
    import json

    from dgstream.schemas import FallbackId

    try:
        body = json.dumps(
            json.loads(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode("utf-8", "surrogatepass")
    except ValueError:  # refused by the parser anyway; the id is not used
        body = raw
    return FallbackId(f"ask-{hashlib.blake2b(body, digest_size=8).hexdigest()}", "record")


def _cmd_ask(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from dgstream.schemas import ClassificationResult, RequestError, parse_request
    from dgstream.workers.engine.factory import EngineSettings, build_classifier
    from dgstream.workers.images import ImageSettings, InputGate

    raw = (args.request if args.request is not None else sys.stdin.read()).encode()
    parsed = parse_request(raw, fallback_id=_ask_id(raw))
    if isinstance(parsed, RequestError):
        print(json.dumps({"error": parsed.model_dump(mode="json")}, indent=2))
        return 2
    settings = EngineSettings(backend=args.backend, model=args.model, device=args.device)
    classifier = build_classifier(settings, worker="ask")
    # Images or request-level instructions the engine would not read: refused, as the
    # worker refuses them (no fetching here: `ask` has no topology). Images it reads go to
    # it with the request, as the worker hands them on (dgstream.workers.steps.classify).
    gate = InputGate(ImageSettings(), classifier.engine.info)
    checked = asyncio.run(gate.check([parsed]))
    if checked.refused:
        print(json.dumps({"error": checked.refused[0].model_dump(mode="json")}, indent=2))
        return 2
    images = [checked.images[0]] if 0 in checked.images else None
    (result,) = asyncio.run(classifier.classify([parsed], images))
    if not isinstance(result, ClassificationResult):
        print(json.dumps({"error": result.model_dump(mode="json")}, indent=2))
        return 2
    if args.jev:
        from dgstream.schemas import encode_output

        print(json.dumps(json.loads(encode_output(result, "jev")), indent=2))
        return 0
    if args.json:
        print(result.model_dump_json(indent=2))
        return 0
    for qid, answer in result.answers.items():
        body = answer.model_dump(exclude={"type"}, exclude_none=True)
        print(f"{qid}: {json.dumps(body)}")
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _cmd_run(args: argparse.Namespace) -> int:
    import signal

    import ray

    from dgstream.topology.controller import start_controller, stop_controller

    topo = _load_topology(args.topology)
    address = args.address or topo.ray.address
    _connect(topo.ray.model_copy(update={"address": address}), log_to_driver=False)
    from dgstream.topology.spec import read_topology

    # Calibration files are read here and sent with the document (the controller's node
    # may not have them).
    raw = read_topology(args.topology)
    # SIGTERM (how Kubernetes, systemd and docker stop a process) is Ctrl-C here: the
    # workers are drained and the command exits 0.
    signal.signal(signal.SIGTERM, _interrupt)
    ctl = None
    try:
        # The passwords the Kafka section names are read on the Ray nodes, never sent
        # from here.
        ctl = start_controller(raw, topo.ray.deployment, topo.ray.namespace)
        try:
            ray.get(ctl.ping.remote(), timeout=120)
        except Exception as exc:
            print(f"error: the controller did not start: {exc}", file=sys.stderr)
            return 1
        refused = _kafka_refused(ctl)
        if refused:
            stop_controller(ctl, drain=False, timeout_s=60)
            ctl = None
            raise _Refused(f"the controller cannot use kafka: {refused}")
        print(f"controller {topo.ray.deployment} running in namespace {topo.ray.namespace}")
        if args.detach:
            return 0
        if not _watch(ctl, args.interval, topo.ray.deployment, topo.ray.namespace):
            print("the controller was stopped from elsewhere (dgstream stop)", file=sys.stderr)
    except KeyboardInterrupt:
        # One stop is enough: a second SIGTERM must not cut the drain short (Ctrl-C
        # twice still does, for a person who means it).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if ctl is not None:
            print("stopping: draining workers ...", file=sys.stderr, flush=True)
            stop_controller(ctl, drain=True, timeout_s=300)
            print("stopped", file=sys.stderr, flush=True)
    return 0


def _watch(ctl: Any, interval: float, deployment: str, namespace: str) -> bool:
    """A status line every `interval` seconds, until interrupted (True) or until the
    controller is removed from elsewhere (`dgstream stop`: False). A controller that does
    not answer (Ray is restarting it after a crash: it comes back and adopts its replicas)
    is a line saying so, not the end of the command."""
    import json
    import time

    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from dgstream.topology.controller import get_controller

    while True:
        try:
            st = ray.get(ctl.status.remote(), timeout=60)
        except (RayActorError, GetTimeoutError) as exc:
            try:
                get_controller(deployment, namespace)  # a restarting actor keeps its name
            except ValueError:
                return False
            print(json.dumps({"controller": f"not answering: {type(exc).__name__}"}), flush=True)
        else:
            line = {
                n: {
                    "replicas": p["replicas"],
                    "ready": p["ready"],
                    "lag": p["lag"],
                    "req/s": p["throughput_per_s"],
                    # Why replicas are not healthy (a batch they cannot read, a restart loop,
                    # no progress), when known.
                    **(
                        {"failing": _failing_text(p["failing"], with_state=True)}
                        if p.get("failing")
                        else {}
                    ),
                }
                for n, p in st["pipelines"].items()
            }
            print(json.dumps(line), flush=True)
        time.sleep(interval)


def _kafka_refused(ctl: Any, timeout_s: float = 60.0) -> str | None:
    """Once the controller has tried the topology's Kafka settings from its node: why they
    were refused (a wrong password, a variable not set there), or None."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = ray.get(ctl.status.remote(), timeout=60)
        if st.get("kafka_checked"):
            error: str | None = st["errors"].get("kafka")
            return error
        time.sleep(0.2)
    return None


def _deployment_spec(args: argparse.Namespace) -> Any:
    """The Ray section `status` and `stop` connect with: the file's (--topology), else the
    defaults, with --address, --namespace and --deployment on top."""
    from dgstream.topology.controller import DEFAULT_NAMESPACE
    from dgstream.topology.spec import RaySpec

    spec = RaySpec(address="auto", namespace=DEFAULT_NAMESPACE)
    if args.topology is not None:
        spec = _load_topology(args.topology).ray
    return spec.model_copy(
        update={
            "address": args.address or spec.address or "auto",
            "namespace": args.namespace or spec.namespace,
            "deployment": args.deployment or spec.deployment,
        }
    )


@contextlib.contextmanager
def _controller_of(args: argparse.Namespace) -> Iterator[tuple[Any, Any | None]]:
    """(the Ray section, the deployment's controller or None when none runs), connected to
    that Ray for the block and disconnected after it."""
    import ray

    from dgstream.topology.controller import get_controller

    spec = _deployment_spec(args)
    _connect(spec, log_to_driver=False, logging_level="WARNING")
    try:
        try:
            ctl = get_controller(spec.deployment, spec.namespace)
        except ValueError:
            ctl = None
        yield spec, ctl
    finally:
        ray.shutdown()


def _no_controller(spec: Any) -> int:
    print(
        f"no controller named {spec.deployment!r} is running in namespace {spec.namespace!r}",
        file=sys.stderr,
    )
    return 3


def _cmd_stop(args: argparse.Namespace) -> int:
    """Drain a deployment's workers and remove its controller (one started with
    `dgstream run --detach`, or another host's `dgstream run`)."""
    import ray

    from dgstream.topology.controller import stop_controller

    with _controller_of(args) as (spec, ctl):
        if ctl is None:
            return _no_controller(spec)
        try:
            st = ray.get(ctl.status.remote(), timeout=60)
            workers = sorted(w for p in st["pipelines"].values() for w in p["workers"])
        except Exception:  # restarting, or stuck: stop it all the same
            workers = []
        print(f"stopping {spec.deployment}: draining workers ...", file=sys.stderr, flush=True)
        last = stop_controller(ctl, drain=not args.no_drain, timeout_s=args.timeout)
    if last is None:
        print("the controller did not answer in time; removed it", file=sys.stderr)
        return 1
    print(f"stopped {spec.deployment}" + (f" ({', '.join(workers)})" if workers else ""))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    import ray

    with _controller_of(args) as (spec, ctl):
        if ctl is None:
            return _no_controller(spec)
        st = ray.get(ctl.status.remote(), timeout=60)
    # 1 while a pipeline has replicas FAILING or STALLED (docs/operations.md, "Health:
    # STALLED and FAILING"): a health check can call this.
    rc = _FAILING if any(p.get("failing") for p in st["pipelines"].values()) else 0
    if args.json:
        print(json.dumps(st, indent=2, default=str))
        return rc
    print(
        f"{'pipeline':16s} {'replicas':>8s} {'ready':>5s} {'lag':>10s} {'req/s':>8s}  last decision"
    )
    for name, p in st["pipelines"].items():
        last = p["decisions"][-1]["reason"] if p["decisions"] else ""
        lag = "?" if p["lag"] is None else str(p["lag"])
        shown = f"{name} (shadow)" if p.get("shadow") else name
        print(
            f"{shown:16s} {p['replicas']:>8d} {p['ready']:>5d} {lag:>10s} "
            f"{p['throughput_per_s']:>8.1f}  {last}"
        )
        for f in p.get("failing", []):
            print(f"  {f.get('state', 'FAILING')} {f['replica']}: {_failing_text([f])}")
    return rc


# `dgstream status`'s exit status while a pipeline is FAILING or STALLED (3 is "no
# controller").
_FAILING = 1


def _failing_text(failing: list[dict[str, Any]], *, with_state: bool = False) -> str:
    """One line for the replicas that are not healthy: the first one's cause and error, its
    restart, the rest (with its state, FAILING or STALLED, first when `with_state`)."""
    f = failing[0]
    cause, error = f["cause"], f["error"]
    text = error if error and cause in error else f"{cause}: {error}" if error else cause
    if with_state:
        text = f"{f.get('state', 'FAILING')} {f['replica']}: {text}"
    if f.get("restart_in_s") is not None:
        text += f" (restart in {f['restart_in_s']:.0f} s, failure {f['failures']} in a row)"
    elif f.get("failures"):
        text += f" (failure {f['failures']} in a row)"
    if len(failing) > 1:
        text += f"; {len(failing) - 1} more replica(s) failing or stalled"
    return str(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dgstream",
        description="Answer classification questions about Kafka events with DiffusionGemma "
        "in one denoising step.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p_broker = sub.add_parser("broker", help="start, stop or inspect the local Kafka broker")
    from dgstream.infra.kafka.broker import add_arguments as add_broker_arguments

    add_broker_arguments(p_broker)
    p_broker.set_defaults(func=_cmd_broker)

    p_demo = sub.add_parser(
        "demo", help="run the main job on the embedded default model and a local broker"
    )
    p_demo.add_argument(
        "--events", type=int, default=None, help="answer this many events, then exit"
    )
    p_demo.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="with --events: give up (exit 1, with the workers' logs) after this many seconds",
    )
    p_demo.set_defaults(func=_cmd_demo)

    p_ask = sub.add_parser("ask", help="answer one request (JSON) locally, without Kafka")
    p_ask.add_argument("request", nargs="?", help="the request JSON (default: stdin)")
    p_ask.add_argument("--json", action="store_true", help="print the whole result record")
    p_ask.add_argument(
        "--jev",
        action="store_true",
        help="print the result in Jev's response shape (what output_format: jev writes)",
    )
    p_ask.add_argument("--backend", default="transformers")
    p_ask.add_argument("--model", default="demo")
    p_ask.add_argument("--device", default="auto")
    p_ask.set_defaults(func=_cmd_ask)

    p_run = sub.add_parser("run", help="run a topology on an existing Kafka and Ray cluster")
    p_run.add_argument("topology", help="the topology YAML file")
    p_run.add_argument("--address", default=None, help="Ray address (default: the file's)")
    p_run.add_argument("--detach", action="store_true", help="start the controller and exit")
    p_run.add_argument("--interval", type=float, default=5.0, help="status line period, s")
    p_run.set_defaults(func=_cmd_run)

    p_status = sub.add_parser("status", help="pipelines, replicas, lag, throughput")
    p_status.add_argument("--json", action="store_true", help="the whole status as JSON")
    p_stop = sub.add_parser("stop", help="drain a deployment's workers and remove its controller")
    p_stop.add_argument(
        "--no-drain",
        action="store_true",
        help="stop the workers at once (uncommitted work is read again by the next owner)",
    )
    p_stop.add_argument("--timeout", type=float, default=300.0, help="seconds for the drain")
    for p, fn in ((p_status, _cmd_status), (p_stop, _cmd_stop)):
        p.add_argument(
            "--topology",
            "-t",
            default=None,
            help="take the deployment, namespace, address and token from this file's ray section",
        )
        p.add_argument("--address", default=None, help="Ray address (default: auto)")
        p.add_argument("--namespace", default=None, help="default: dgstream")
        p.add_argument("--deployment", default=None, help="default: default")
        p.set_defaults(func=fn)

    from dgstream.topology.cli import commands, decisions, skip_batch

    commands.register(sub)
    skip_batch.register(sub)
    decisions.register(sub)

    return parser


def _ctrl_c_interrupts() -> None:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt even in a process that inherited SIGINT
    ignored, as a shell starts its background jobs (`dgstream run topology.yaml &`, then
    `kill -INT`): the long-running commands drain or stop on it, as on SIGTERM."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _ctrl_c_interrupts()
    try:
        rc: int = args.func(args)
    except _Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""`dgstream broker start|stop|status|fetch` and `python -m dgstream.infra.kafka.broker`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from dgstream.infra.kafka.broker.jars import LOCK_PATH, fetch, lock
from dgstream.infra.kafka.broker.lifecycle import start, start_cluster, status, stop
from dgstream.infra.kafka.broker.state import HOME_ENV, BrokerError, read_state, resolve_home


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`dgstream broker start|stop|status|fetch [--json] [--port N] [--home DIR]`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--home",
        default=None,
        help=f"state directory (default: ${HOME_ENV} or <repo>/.cache/kafka/run)",
    )
    common.add_argument("--json", action="store_true", help="print a JSON object")
    sub = parser.add_subparsers(dest="broker_command", required=True, metavar="ACTION")
    p_start = sub.add_parser("start", parents=[common], help="start a loopback broker (KRaft)")
    p_start.add_argument(
        "--port", type=int, default=None, help="client port (default 9092 when free, else any)"
    )
    p_start.add_argument(
        "--nodes", type=int, default=1, help="combined broker+controller nodes (default 1)"
    )
    p_start.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for it")
    p_stop = sub.add_parser(
        "stop", parents=[common], help="stop it; its data stays for the next start"
    )
    p_stop.add_argument("--timeout", type=float, default=30.0, help="seconds before SIGKILL")
    p_stop.add_argument(
        "--delete-data",
        action="store_true",
        help="also delete its topics, records and offsets (the next start is a new cluster)",
    )
    sub.add_parser("status", parents=[common], help="is it running and answering?")
    sub.add_parser("fetch", parents=[common], help="fetch Kafka's jars (no-op when cached)")
    sub.add_parser(
        "lock",
        parents=[common],
        help="pin the pom's jars and their checksums again (after a pom change; needs mvn)",
    )


def _emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(obj, sort_keys=True))
    else:
        print(text)


def cli(args: argparse.Namespace) -> int:
    """Run one broker action; returns the exit status (status: 0 running, 3 not running)."""
    action = args.broker_command
    home = getattr(args, "home", None)
    try:
        if action in ("fetch", "lock"):
            return _cli_jars(args, action)
        if action == "start":
            if args.nodes > 1:
                if args.port is not None:
                    raise BrokerError("--port applies to a single node only")
                info = start_cluster(args.nodes, home, timeout_s=args.timeout)
            else:
                info = start(home, port=args.port, timeout_s=args.timeout)
            if info.reused:
                text = f"Kafka already running: bootstrap servers {info.bootstrap}"
            elif info.resumed:
                text = (
                    f"Kafka started on its kept data ({info.home}): bootstrap servers "
                    f"{info.bootstrap} (ready {info.start_seconds:.1f}s after launch)"
                )
            else:
                text = (
                    f"Kafka started: bootstrap servers {info.bootstrap} "
                    f"(ready {info.start_seconds:.1f}s after launch, "
                    f"{info.total_seconds:.1f}s in all)"
                )
            _emit(args, info.to_dict(), text)
            return 0
        if action == "stop":
            return _cli_stop(args, home)
        if action == "status":
            st = status(home)
            if st["running"]:
                text = (
                    f"Kafka running: bootstrap servers {st['bootstrap']}, pids {st['pids']}, "
                    f"answers metadata: {'yes' if st['answers_metadata'] else 'no'}"
                )
            elif st.get("data_kept"):
                text = f"Kafka not running; its data is kept in {st['home']} ({_KEPT_HINT})"
            else:
                text = "Kafka not running"
            _emit(args, st, text)
            return 0 if st["running"] and st["answers_metadata"] else 3
    except BrokerError as exc:
        print(f"dgstream broker {action}: {exc}", file=sys.stderr)
        return 1
    print(f"unknown broker action {action!r}", file=sys.stderr)
    return 2


def _cli_jars(args: argparse.Namespace, action: str) -> int:
    if action == "lock":
        n = lock()
        _emit(args, {"lock": str(LOCK_PATH), "jars": n}, f"pinned {n} jars in {LOCK_PATH}")
        return 0
    r = fetch()
    verb = "fetched" if r.fetched else "already cached"
    _emit(
        args,
        {"lib_dir": str(r.lib_dir), "fetched": r.fetched, "jars": r.jars, "seconds": r.seconds},
        f"Kafka jars {verb}: {r.jars} in {r.lib_dir} ({r.seconds:.1f}s)",
    )
    return 0


_KEPT_HINT = "`dgstream broker start` resumes it, `dgstream broker stop --delete-data` deletes it"


def _cli_stop(args: argparse.Namespace, home: str | None) -> int:
    h = resolve_home(home)
    stopped = stop(home, timeout_s=args.timeout, delete_data=args.delete_data)
    kept = not args.delete_data and read_state(h) is not None
    if args.delete_data:
        text = "Kafka stopped, its data deleted" if stopped else "Kafka was not running"
    elif stopped:
        text = f"Kafka stopped; its data is kept in {h} ({_KEPT_HINT})"
    else:
        text = "Kafka was not running" + (f"; its data is kept in {h}" if kept else "")
    _emit(args, {"stopped": stopped, "data_kept": kept, "home": str(h)}, text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dgstream.infra.kafka.broker", description="The local Kafka broker."
    )
    add_arguments(parser)
    return cli(parser.parse_args(argv))

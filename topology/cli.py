"""The `dgstream` command.

Each subcommand lives in its own small function; heavy imports happen inside them so
that `dgstream --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_broker(args: argparse.Namespace) -> int:
    from infra.kafka import broker

    return broker.cli(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from topology.demo import main as demo_main

    return demo_main(args.events)


def _cmd_ask(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from schemas import ClassificationResult, RequestError, parse_request
    from workers.engine.factory import EngineSettings, build_classifier

    raw = (args.request if args.request is not None else sys.stdin.read()).encode()
    parsed = parse_request(raw)
    if isinstance(parsed, RequestError):
        print(json.dumps({"error": parsed.model_dump(mode="json")}, indent=2))
        return 2
    settings = EngineSettings(backend=args.backend, model=args.model, device=args.device)
    (result,) = asyncio.run(build_classifier(settings, worker="ask").classify([parsed]))
    if not isinstance(result, ClassificationResult):
        print(json.dumps({"error": result.model_dump(mode="json")}, indent=2))
        return 2
    if args.json:
        print(result.model_dump_json(indent=2))
        return 0
    for qid, answer in result.answers.items():
        body = answer.model_dump(exclude={"type"}, exclude_none=True)
        print(f"{qid}: {json.dumps(body)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dgstream",
        description="Answer classification questions about Kafka events with DiffusionGemma "
        "in one denoising step.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p_broker = sub.add_parser("broker", help="start, stop or inspect the local Kafka broker")
    from infra.kafka.broker import add_arguments as add_broker_arguments

    add_broker_arguments(p_broker)
    p_broker.set_defaults(func=_cmd_broker)

    p_demo = sub.add_parser(
        "demo", help="run the main job on the embedded default model and a local broker"
    )
    p_demo.add_argument("--events", type=int, default=24, help="events to answer, then exit")
    p_demo.set_defaults(func=_cmd_demo)

    p_ask = sub.add_parser("ask", help="answer one request (JSON) locally, without Kafka")
    p_ask.add_argument("request", nargs="?", help="the request JSON (default: stdin)")
    p_ask.add_argument("--json", action="store_true", help="print the whole result record")
    p_ask.add_argument("--backend", default="transformers")
    p_ask.add_argument("--model", default="tiny-random")
    p_ask.add_argument("--device", default="auto")
    p_ask.set_defaults(func=_cmd_ask)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())

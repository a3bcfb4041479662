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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())

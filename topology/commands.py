"""The Kafka-facing subcommands of `dgstream`: produce, tail, dlq (inspect and replay)."""

from __future__ import annotations

import argparse
import base64
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

from schemas import ClassificationResult, FallbackId, RequestError, parse_request, read_output


def _connection(args: argparse.Namespace) -> Any:
    from workers.kafka_settings import KafkaConnection

    if args.bootstrap:
        return KafkaConnection(bootstrap_servers=args.bootstrap)
    return KafkaConnection.from_env()


def add_kafka_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bootstrap",
        default=None,
        help="bootstrap servers (default: DGSTREAM_KAFKA_BOOTSTRAP_SERVERS and friends)",
    )


# --------------------------------------------------------------------------- produce


def _lines(path: str) -> Iterator[tuple[int, str]]:
    stream: TextIO = sys.stdin if path == "-" else open(path)  # noqa: SIM115
    try:
        for n, line in enumerate(stream, 1):
            if line.strip():
                yield n, line.rstrip("\n")
    finally:
        if stream is not sys.stdin:
            stream.close()


def produce(args: argparse.Namespace) -> int:
    """JSONL in, one request a line; each is validated before sending (unless told not to)."""
    from kafka import KafkaProducer

    conn = _connection(args)
    producer = KafkaProducer(acks="all", enable_idempotence=True, **conn.client_kwargs())
    sent = refused = 0
    t0 = time.monotonic()
    try:
        for n, line in _lines(args.file):
            raw = line.encode()
            key = None
            if not args.no_validate:
                # A body without id (as Jev's clients send) is sent without a key: the
                # worker then names it <topic>-<partition>-<offset>.
                parsed = parse_request(raw, fallback_id=FallbackId(f"line-{n}", "record"))
                if isinstance(parsed, RequestError):
                    refused += 1
                    print(f"line {n}: {parsed.code}: {parsed.message}", file=sys.stderr)
                    continue
                key = parsed.id.encode() if parsed.id_source == "request" else None
            producer.send(args.topic, key=key, value=raw)
            sent += 1
            if sys.stderr.isatty() and sent % 100 == 0:
                print(f"\rsent {sent}  refused {refused}", end="", file=sys.stderr)
        producer.flush()
    finally:
        producer.close()
    rate = sent / max(time.monotonic() - t0, 1e-9)
    print(f"sent {sent}, refused {refused} ({rate:.0f}/s) to {args.topic}")
    return 0 if refused == 0 else 1


# --------------------------------------------------------------------------- tail / dlq


def _consumer(args: argparse.Namespace, topic: str) -> Any:
    from kafka import KafkaConsumer

    conn = _connection(args)
    return KafkaConsumer(
        topic,
        enable_auto_commit=False,
        auto_offset_reset="earliest" if args.from_beginning else "latest",
        isolation_level="read_committed",
        consumer_timeout_ms=int(args.idle_s * 1000) if args.idle_s else float("inf"),
        **conn.client_kwargs(),
    )


def _answer_text(answer: dict[str, Any]) -> str:
    kind = answer.get("type")
    if kind == "noul":  # Jev's shapes
        return f"p_yes={answer['noul']:.2f}"
    if kind == "score" and "score" in answer:
        top = max(answer["probabilities"], key=answer["probabilities"].get)
        return f"{answer['legend'][top]} score={answer['score']:.2f}"
    if kind == "yes_no":
        return f"{answer['label']} p_yes={answer['p_yes']:.2f}"
    if kind == "choice":
        return f"{answer['choice']} ({answer['confidence']:.2f})"
    if kind == "score":
        return f"{answer['level']} E={answer['expected_score']:.2f}"
    return f"skipped ({answer.get('reason', '')})"


def _key(key: bytes | None) -> str:
    return "(no key)" if key is None else key.decode("utf-8", "backslashreplace")


def tail(args: argparse.Namespace) -> int:
    """Follow a results topic, one readable line per result (or the JSON with --json)."""
    consumer = _consumer(args, args.topic)
    seen = 0
    try:
        for rec in consumer:
            seen += 1
            if args.json:
                print(rec.value.decode(), flush=True)
            else:
                try:
                    res = read_output(rec.value)
                    answers = "  ".join(
                        f"{q}: {_answer_text(a.model_dump())}" for q, a in res.answers.items()
                    )
                    # Jev's shape has no id: the record's key names the request.
                    rid = res.id if isinstance(res, ClassificationResult) else _key(rec.key)
                    print(f"{rid}  {answers}", flush=True)
                except (ValueError, KeyError, TypeError):
                    print(f"(not a result) {rec.value[:120]!r}", flush=True)
            if args.max and seen >= args.max:
                break
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    return 0


def dlq(args: argparse.Namespace) -> int:
    """List dead letters; with --replay-to, send their original bytes to a topic again."""
    from kafka import KafkaProducer

    from schemas import DeadLetter

    consumer = _consumer(args, args.topic)
    producer = None
    if args.replay_to:
        producer = KafkaProducer(
            acks="all", enable_idempotence=True, **_connection(args).client_kwargs()
        )
    seen = replayed = 0
    try:
        for rec in consumer:
            seen += 1
            try:
                dl = DeadLetter.model_validate_json(rec.value)
            except ValueError:
                print(f"(not a dead letter) {rec.value[:120]!r}")
                continue
            if args.code and dl.error.code != args.code:
                continue
            if args.json:
                print(dl.model_dump_json())
            else:
                src = dl.source
                print(
                    f"{dl.request_id or '-'}  {dl.error.code}  {dl.error.message}  "
                    f"[{src.topic}/{src.partition}@{src.offset}]"
                )
            if producer is not None:
                original = base64.b64decode(dl.original)
                key = base64.b64decode(dl.source.key) if dl.source.key else None
                producer.send(args.replay_to, key=key, value=original)
                replayed += 1
            if args.max and seen >= args.max:
                break
    finally:
        if producer is not None:
            producer.flush()
            producer.close()
        consumer.close()
    if producer is not None:
        print(f"replayed {replayed} to {args.replay_to}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("produce", help="send requests (JSONL file or stdin) to a topic")
    p.add_argument("topic")
    p.add_argument("file", nargs="?", default="-", help="JSONL file (default: stdin)")
    p.add_argument("--no-validate", action="store_true", help="send lines as they are")
    add_kafka_arguments(p)
    p.set_defaults(func=produce)

    for name, fn, text in (
        ("tail", tail, "follow a results topic"),
        ("dlq", dlq, "inspect dead letters and replay them after a fix"),
    ):
        q = sub.add_parser(name, help=text)
        q.add_argument("topic")
        q.add_argument("--from-beginning", action="store_true")
        q.add_argument("--max", type=int, default=0, help="stop after this many records")
        q.add_argument("--idle-s", type=float, default=0.0, help="stop after this long idle")
        q.add_argument("--json", action="store_true")
        add_kafka_arguments(q)
        if name == "dlq":
            q.add_argument("--replay-to", default=None, help="send the originals to this topic")
            q.add_argument("--code", default=None, help="only dead letters with this code")
        q.set_defaults(func=fn)

"""The Kafka-facing subcommands of `dgstream`: produce, tail, dlq (inspect and replay).

Each connects with one `KafkaConnection` (`kafka_connection`): a topology file's `kafka`
section (`--topology`), else the `DGSTREAM_KAFKA_*` variables; `--bootstrap` replaces
only the servers, the TLS and SASL settings stay. With no servers named anywhere, the
local broker of `dgstream broker start` is used when it runs. The connection is checked
first (`workers.kafka.probe`), so a wrong password or an untrusted certificate is one
clear line, not a long wait and a traceback.

`dlq` lists a dead-letter topic from its beginning to its end as of the start, then
exits (`--follow` waits for more); `tail` follows a results topic.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

from dgstream.schemas import (
    ClassificationResult,
    FallbackId,
    ModerationResponse,
    RequestError,
    parse_request,
    read_output,
)
from dgstream.schemas.kinds import kind_of_type


class Refused(Exception):
    """A command that cannot run as asked (a bad topology file, a missing secret, Kafka or
    Ray out of reach): `main` prints `error: <message>` on stderr and exits with status 2."""


_ENV_PREFIX = "DGSTREAM_KAFKA_"


def kafka_connection(args: argparse.Namespace, *, check: bool = True) -> Any:
    """The command's Kafka settings (see the module docstring), checked unless told not."""
    import os

    from pydantic import ValidationError

    from dgstream.topology.spec import SpecError, load_topology
    from dgstream.workers.kafka.probe import KafkaConnectError, check_connection
    from dgstream.workers.kafka.settings import KafkaConnection

    try:
        if args.topology:
            base = load_topology(args.topology).kafka.public()
            if args.bootstrap:
                base["bootstrap_servers"] = args.bootstrap
            conn = KafkaConnection.model_validate(base)
        else:
            environ = dict(os.environ)
            servers = f"{_ENV_PREFIX}BOOTSTRAP_SERVERS"
            if args.bootstrap:
                environ[servers] = args.bootstrap
            elif not environ.get(servers, "").strip():
                local = _local_broker()
                if local is not None:
                    print(f"(the local broker at {local}: dgstream broker start)", file=sys.stderr)
                    environ[servers] = local
            conn = KafkaConnection.from_env(_ENV_PREFIX, environ)
    except SpecError as exc:
        raise Refused(str(exc)) from None
    except ValidationError as exc:
        raise Refused(_settings_error(exc, args)) from None
    if check:
        try:
            check_connection(conn)
        except KafkaConnectError as exc:
            raise Refused(str(exc)) from None
    return conn


def _local_broker() -> str | None:
    """The bootstrap servers of the broker `dgstream broker start` runs from its home
    (`DGSTREAM_KAFKA_HOME`, else the repository's `.cache/kafka/run`), if it runs."""
    from dgstream.infra.kafka import broker

    try:
        st = broker.status(probe_timeout_s=2.0)
    except broker.BrokerError:
        return None
    return str(st["bootstrap"]) if st["running"] and st["answers_metadata"] else None


def _settings_error(exc: Any, args: argparse.Namespace) -> str:
    where = "--bootstrap" if args.bootstrap else f"{_ENV_PREFIX}* variables"
    if args.topology:
        where = f"{args.topology} with --bootstrap"
    if any(e["loc"] == ("bootstrap_servers",) and e["type"] == "missing" for e in exc.errors()):
        return (
            "no Kafka to connect to: pass --bootstrap HOST:PORT or --topology FILE, "
            f"or set {_ENV_PREFIX}BOOTSTRAP_SERVERS (and {_ENV_PREFIX}SECURITY_PROTOCOL, ...), "
            "or start the local broker (dgstream broker start)"
        )
    fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    return f"Kafka settings from {where}: {fields}"


def add_kafka_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--topology",
        "-t",
        default=None,
        help="connect with this topology file's kafka section (TLS, SASL, passwords by name)",
    )
    p.add_argument(
        "--bootstrap",
        default=None,
        help="bootstrap servers; replaces only the servers of --topology or of "
        f"{_ENV_PREFIX}BOOTSTRAP_SERVERS (the TLS/SASL settings stay)",
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

    conn = kafka_connection(args)
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


def _consumer(args: argparse.Namespace, conn: Any, topic: str) -> Any:
    from kafka import KafkaConsumer

    return KafkaConsumer(
        topic,
        enable_auto_commit=False,
        auto_offset_reset="earliest" if args.from_beginning else "latest",
        isolation_level="read_committed",
        consumer_timeout_ms=int(args.idle_s * 1000) if args.idle_s else float("inf"),
        **conn.client_kwargs(),
    )


def _answer_text(answer: dict[str, Any]) -> str:
    kind = kind_of_type(answer.get("type"))  # ours or Jev's shape
    if kind is None:
        return f"skipped ({answer.get('reason', '')})"
    return kind.line(answer)


def _key(key: bytes | None) -> str:
    return "(no key)" if key is None else key.decode("utf-8", "backslashreplace")


def _result_line(res: Any, key: bytes | None) -> str:
    """One readable line for a result in any output format."""
    if isinstance(res, ModerationResponse):
        m = res.results[0]
        asked = [c for c, kinds in m.category_applied_input_types.items() if kinds]
        scores = "  ".join(f"{c}={m.category_scores[c]:.2f}" for c in asked)
        return f"{res.id}  flagged={str(m.flagged).lower()}  {scores}"
    answers = "  ".join(f"{q}: {_answer_text(a.model_dump())}" for q, a in res.answers.items())
    # Jev's shape has no id: the record's key names the request.
    rid = res.id if isinstance(res, ClassificationResult) else _key(key)
    return f"{rid}  {answers}"


def tail(args: argparse.Namespace) -> int:
    """Follow a results topic, one readable line per result (or the JSON with --json)."""
    consumer = _consumer(args, kafka_connection(args), args.topic)
    seen = 0
    try:
        for rec in consumer:
            seen += 1
            if args.json:
                print(rec.value.decode(), flush=True)
            else:
                try:
                    print(_result_line(read_output(rec.value), rec.key), flush=True)
                except (ValueError, KeyError, TypeError):
                    print(f"(not a result) {rec.value[:120]!r}", flush=True)
            if args.max and seen >= args.max:
                break
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    return 0


# Replayed records are committed (the replay group's offsets) after each this many, once
# the target acknowledged them: a replay stopped midway resends at most these.
_REPLAY_COMMIT_EVERY = 500


def replay_group(args: argparse.Namespace) -> str:
    """The consumer group that remembers how far a replay of `args.topic` to
    `args.replay_to` (with its `--code` filter) got."""
    if args.group:
        return str(args.group)
    name = f"dgstream-dlq-replay.{args.topic}.{args.replay_to}"
    return f"{name}.{args.code}" if args.code else name


def _dead_letter_consumer(args: argparse.Namespace, conn: Any) -> tuple[Any, list[Any]]:
    """The dead-letter topic's every partition, assigned, and where reading starts: for a
    replay, where its group stopped; else (and for a group that never ran) the
    beginning, or the end with --follow alone (new dead letters only)."""
    from kafka import KafkaConsumer, TopicPartition

    replaying = bool(args.replay_to)
    consumer = KafkaConsumer(
        group_id=replay_group(args) if replaying else None,
        enable_auto_commit=False,
        isolation_level="read_committed",
        **conn.client_kwargs(),
    )
    parts = consumer.partitions_for_topic(args.topic)
    if not parts:
        consumer.close()
        raise Refused(f"no topic {args.topic!r} at {','.join(conn.bootstrap_servers)}")
    tps = [TopicPartition(args.topic, p) for p in sorted(parts)]
    consumer.assign(tps)
    from_start = args.from_beginning or not args.follow
    for tp in tps:
        committed = consumer.committed(tp) if replaying else None
        if committed is not None:
            consumer.seek(tp, committed)
        elif from_start:
            consumer.seek_to_beginning(tp)
        else:
            consumer.seek_to_end(tp)
    return consumer, tps


# How long one poll of `_records` waits: short, so that Ctrl-C and --idle-s are prompt.
_POLL_MS = 500


def _records(consumer: Any, tps: list[Any], *, follow: bool, idle_s: float) -> Iterator[Any]:
    """The records of the assigned partitions from where the consumer stands: up to the
    end offsets as of now (read committed: the last stable offsets), then stop; with
    `follow`, on and on. `idle_s` (when set) stops either after that long without one."""
    ends = None if follow else consumer.end_offsets(tps)
    quiet_since = time.monotonic()
    while True:
        if ends is not None and all(consumer.position(tp) >= ends[tp] for tp in tps):
            return
        polled = consumer.poll(timeout_ms=_POLL_MS)
        now = time.monotonic()
        if polled:
            quiet_since = now
        elif idle_s and now - quiet_since >= idle_s:
            return
        for tp, recs in polled.items():
            for rec in recs:
                if ends is None or rec.offset < ends[tp]:
                    yield rec


def _print_letter(letter: Any, as_json: bool, raw: bool) -> None:
    # Flushed line by line, as `tail`'s: with --follow into a pipe or a file, Python's
    # block buffering would hold the lines back until 8 KiB of them.
    if as_json:
        print(letter.model_dump_json(), flush=True)
        return
    src = letter.source
    form = " (raw)" if raw else " (truncated)" if letter.truncated else ""
    print(
        f"{letter.request_id or '-'}  {letter.error.code}  {letter.error.message}  "
        f"[{src.topic}/{src.partition}@{src.offset}]{form}",
        flush=True,
    )


def dlq(args: argparse.Namespace) -> int:
    """List dead letters (either format); with --replay-to, send each original record
    (value, key, headers) byte for byte to a topic, remembering where it stopped."""
    from kafka import KafkaProducer

    from dgstream.schemas import DeadLetter
    from dgstream.schemas.dead_letter import RAW_FORMAT

    conn = kafka_connection(args)
    consumer, tps = _dead_letter_consumer(args, conn)
    producer = None
    if args.replay_to:
        producer = KafkaProducer(acks="all", enable_idempotence=True, **conn.client_kwargs())
    seen = listed = replayed = 0
    done: dict[Any, int] = {}  # tp -> next offset, for the replay group
    try:
        for rec in _records(consumer, tps, follow=args.follow, idle_s=args.idle_s):
            seen += 1
            done[(rec.topic, rec.partition)] = rec.offset + 1
            try:
                letter = DeadLetter.from_record(rec.value, rec.key, rec.headers)
            except ValueError:
                print(f"(not a dead letter) {(rec.value or b'')[:120]!r}", flush=True)
                continue
            if not args.code or letter.error.code == args.code:
                listed += 1
                _print_letter(letter, args.json, (RAW_FORMAT, b"raw") in (rec.headers or []))
                if producer is not None and _replay(producer, letter, args.replay_to):
                    replayed += 1
                    if replayed % _REPLAY_COMMIT_EVERY == 0:
                        _commit_replayed(producer, consumer, done)
            if args.max and seen >= args.max:
                break
    except KeyboardInterrupt:
        pass  # what was replayed is remembered below
    finally:
        if producer is not None:
            _commit_replayed(producer, consumer, done)
            producer.close()
        consumer.close()
    if producer is not None:
        skipped = listed - replayed
        print(f"replayed {replayed} to {args.replay_to}" + (f", {skipped} not" if skipped else ""))
    elif not args.json:
        code = f" with code {args.code}" if args.code else ""
        print(f"{listed} dead letter(s){code} in {args.topic}", file=sys.stderr)
    return 0


def _replay(producer: Any, letter: Any, target: str) -> bool:
    """Send a dead letter's original record to `target` as it was (value, key, headers);
    False (and a line) when only a prefix of it was kept."""
    if letter.truncated:
        print(f"  not replayed: only {len(letter.original_bytes())} bytes kept", flush=True)
        return False
    # A header without a value goes as b"": kafka-python writes no null.
    headers = [(k, v or b"") for k, v in letter.original_headers()]
    producer.send(
        target, value=letter.original_value(), key=letter.source.key_bytes(), headers=headers
    )
    return True


def _commit_replayed(producer: Any, consumer: Any, done: dict[Any, int]) -> None:
    """Everything replayed so far is acknowledged, then remembered (the group's offsets)."""
    from kafka import OffsetAndMetadata, TopicPartition

    producer.flush()
    if done:
        consumer.commit(
            {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in done.items()}
        )


def register(sub: Any) -> None:
    p = sub.add_parser("produce", help="send requests (JSONL file or stdin) to a topic")
    p.add_argument("topic")
    p.add_argument("file", nargs="?", default="-", help="JSONL file (default: stdin)")
    p.add_argument("--no-validate", action="store_true", help="send lines as they are")
    add_kafka_arguments(p)
    p.set_defaults(func=produce)

    for name, fn, text in (
        ("tail", tail, "follow a results topic (from its end; --from-beginning)"),
        (
            "dlq",
            dlq,
            "list a dead-letter topic from its beginning to its end (--follow: wait for "
            "more), and replay the originals after a fix (--replay-to)",
        ),
    ):
        q = sub.add_parser(name, help=text)
        q.add_argument("topic")
        q.add_argument(
            "--from-beginning",
            action="store_true",
            help="tail: from the topic's beginning; dlq --follow: from the beginning too, "
            "not only new dead letters",
        )
        q.add_argument("--max", type=int, default=0, help="stop after this many records")
        q.add_argument("--idle-s", type=float, default=0.0, help="stop after this long idle")
        q.add_argument("--json", action="store_true")
        add_kafka_arguments(q)
        if name == "dlq":
            q.add_argument(
                "--follow",
                action="store_true",
                help="keep reading after the end, for new dead letters (from the end "
                "unless --from-beginning; a replay from where its group stopped)",
            )
            q.add_argument(
                "--replay-to",
                default=None,
                help="send the original records (value, key, headers) to this topic; a "
                "second run goes on where the first stopped",
            )
            q.add_argument("--code", default=None, help="only dead letters with this code")
            q.add_argument(
                "--group",
                default=None,
                help="the consumer group that remembers a replay's progress (default: "
                "dgstream-dlq-replay.TOPIC.TARGET[.CODE])",
            )
        q.set_defaults(func=fn)

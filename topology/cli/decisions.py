"""`dgstream calibrate` and `dgstream compare`: the two commands that read results back.

calibrate: fits a per-question temperature (`workers.results.calibration`) from labelled results and
writes the calibration file a pipeline applies before its routes. The results come from a
JSONL file of labelled examples (`{"result": <result>, "labels": {qid: answer}}` a line),
from a JSONL file of results or from topics (`--results`, `--topic`), joined by id with a
labels file (`{"id", "labels"}` a line) or with labels in each result's metadata
(`--labels-in-metadata KEY`, as `dgstream demo`'s events carry `truth`).

compare: reads two sets of result topics (a pipeline and its shadow, say) from their
beginning to their end as of the start, joins the results by request id (the record's key
for Jev's shape, which has none), and reports per question the agreement, the confusion
between the answers, and the largest probability shifts with their ids; and, when both
carry an audit, the same for the route that matched.

Both read results in any output format (ours, Jev's, OpenAI's moderation shape).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dgstream.schemas.kinds import get_kind
from dgstream.topology.cli.commands import Refused, add_kafka_arguments, kafka_connection

__all__ = ["calibrate", "compare", "register"]


# --------------------------------------------------------------------------- reading


def _topic_values(
    conn: Any, topics: list[str], idle_s: float
) -> Iterator[tuple[bytes | None, bytes]]:
    """(key, value) of every record of `topics`, from the beginning to the end as of now."""
    from kafka import KafkaConsumer, TopicPartition

    from dgstream.topology.cli.commands import _records

    consumer = KafkaConsumer(
        enable_auto_commit=False, isolation_level="read_committed", **conn.client_kwargs()
    )
    try:
        tps = []
        for topic in topics:
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                raise Refused(f"no topic {topic!r} at {','.join(conn.bootstrap_servers)}")
            tps += [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        for rec in _records(consumer, tps, follow=False, idle_s=idle_s):
            if rec.value is not None:
                yield rec.key, rec.value
    finally:
        consumer.close()


def _result_dict(key: bytes | None, value: bytes | str) -> tuple[str, dict[str, Any]] | None:
    """(request id, the result as a dict) of a result in any format; None for anything else.
    OpenAI's moderation shape becomes yes/no answers, one per category that was asked."""
    from dgstream.schemas import ClassificationResult, ModerationResponse, read_output

    try:
        res = read_output(value)
    except ValueError:
        return None
    if isinstance(res, ModerationResponse):
        m = res.results[0]
        answers = {
            c: {"type": "yes_no", "p_yes": m.category_scores[c]}
            for c, kinds in m.category_applied_input_types.items()
            if kinds
        }
        return res.id, {"answers": answers, "flagged": m.flagged}
    body = res.model_dump(mode="json")
    if isinstance(res, ClassificationResult):
        return res.id, body
    if key is None:
        return None
    return key.decode("utf-8", "backslashreplace"), body


def _results(
    args: argparse.Namespace, spec: str | None, path: str | None
) -> dict[str, dict[str, Any]]:
    """Results by id, the last one of each id (at-least-once may deliver one twice), from
    comma-separated topics or a JSONL file."""
    pairs: Iterable[tuple[bytes | None, bytes | str]]
    if path is not None:
        pairs = ((None, line) for line in _jsonl_lines(path))
    else:
        topics = [t for t in (spec or "").split(",") if t]
        pairs = _topic_values(kafka_connection(args), topics, args.idle_s)
    out: dict[str, dict[str, Any]] = {}
    for key, value in pairs:
        got = _result_dict(key, value)
        if got is not None:
            out[got[0]] = got[1]
    return out


def _jsonl_lines(path: str) -> Iterator[str]:
    try:
        stream = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise Refused(f"cannot read {path}: {exc}") from None
    try:
        for line in stream:
            if line.strip():
                yield line
    finally:
        if stream is not sys.stdin:
            stream.close()


# --------------------------------------------------------------------------- calibrate


def _labels_file(path: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for n, line in enumerate(_jsonl_lines(path), 1):
        try:
            obj = json.loads(line)
            out[str(obj["id"])] = {str(k): str(v) for k, v in obj["labels"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise Refused(f"{path} line {n}: not {{'id', 'labels'}}: {exc}") from None
    return out


def _examples_file(path: str) -> list[tuple[dict[str, Any], dict[str, str]]]:
    out = []
    for n, line in enumerate(_jsonl_lines(path), 1):
        try:
            obj = json.loads(line)
            got = _result_dict(None, json.dumps(obj["result"]))
            labels = {str(k): str(v) for k, v in obj["labels"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise Refused(f"{path} line {n}: not {{'result', 'labels'}}: {exc}") from None
        if got is None:
            raise Refused(f"{path} line {n}: 'result' is not a result")
        out.append((got[1], labels))
    return out


def _labelled(args: argparse.Namespace) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """(result, labels) pairs from the command's sources."""
    if args.examples:
        return _examples_file(args.examples)
    if not (args.results or args.topic):
        raise Refused("give --examples FILE, or --results FILE / --topic T with labels")
    results = _results(args, args.topic, args.results)
    if args.labels:
        labels = _labels_file(args.labels)
        return [(results[i], labels[i]) for i in results if i in labels]
    if args.labels_in_metadata:
        key = args.labels_in_metadata
        return [
            (r, {str(k): str(v) for k, v in r["metadata"][key].items()})
            for r in results.values()
            if isinstance((r.get("metadata") or {}).get(key), Mapping)
        ]
    raise Refused(
        "with --results or --topic, say where the labels are: --labels FILE or "
        "--labels-in-metadata KEY"
    )


def calibrate(args: argparse.Namespace) -> int:
    """Fit, print per question what the fit did, write the file."""
    from dgstream.workers.results.calibration import distribution, fit

    wanted = set(args.questions.split(",")) if args.questions else None
    by_question: dict[str, list[Any]] = {}
    pairs = _labelled(args)
    for result, labels in pairs:
        for qid, truth in labels.items():
            answer = (result.get("answers") or {}).get(qid)
            dist = distribution(answer, raw=True) if isinstance(answer, Mapping) else None
            if dist is not None and (wanted is None or qid in wanted):
                by_question.setdefault(qid, []).append((dist, truth))
    source = args.examples or args.results or f"topics {args.topic}"
    cal, skipped = fit(by_question, min_examples=args.min_examples, source=str(source))
    print(f"{len(pairs)} labelled results; method temperature")
    print(f"{'question':20s} {'n':>6s} {'T':>7s} {'NLL':>15s} {'ECE':>15s}")
    for qid, q in cal.questions.items():
        print(
            f"{qid:20s} {q.examples:>6d} {q.temperature:>7.3f} "
            f"{q.nll_before:>6.3f} -> {q.nll_after:<6.3f} "
            f"{q.ece_before:>6.3f} -> {q.ece_after:<6.3f}"
        )
    for qid, why in skipped.items():
        print(f"{qid:20s} skipped: {why}")
    if not cal.questions:
        print("error: no question could be fitted; nothing written", file=sys.stderr)
        return 1
    Path(args.out).write_text(cal.model_dump_json(indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({cal.hash}); a pipeline applies it with `calibration: {args.out}`")
    return 0


# --------------------------------------------------------------------------- compare


@dataclass
class _Question:
    """What compare gathers for one question (or for the route)."""

    kind: str
    agree: int = 0
    total: int = 0
    confusion: Counter[tuple[str, str]] = field(default_factory=Counter)
    shifts: list[tuple[float, str, str, float, float]] = field(default_factory=list)


def _answer_and_shift(
    a: Mapping[str, Any], b: Mapping[str, Any]
) -> tuple[str, str, float, str, float, float] | None:
    """(answer in A, answer in B, the largest probability shift, the label it is on, its
    value in A, in B), or None when either is not an answer."""
    from dgstream.workers.results.calibration import distribution

    da, db = distribution(a, raw=False), distribution(b, raw=False)
    if da is None or db is None or da.kind != db.kind:
        return None
    pa, pb = (
        dict(zip(da.labels, da.probs, strict=True)),
        dict(zip(db.labels, db.probs, strict=True)),
    )
    labels = list(get_kind(da.kind).compared or sorted(set(pa) | set(pb)))
    label = max(labels, key=lambda k: abs(pb.get(k, 0.0) - pa.get(k, 0.0)))
    x, y = pa.get(label, 0.0), pb.get(label, 0.0)
    return da.answer, db.answer, abs(y - x), label, x, y


def _tally(
    a: Mapping[str, dict[str, Any]], b: Mapping[str, dict[str, Any]], top: int
) -> dict[str, _Question]:
    stats: dict[str, _Question] = {}
    for rid in sorted(set(a) & set(b)):
        ra, rb = a[rid], b[rid]
        for qid, ans in (ra.get("answers") or {}).items():
            other = (rb.get("answers") or {}).get(qid)
            got = _answer_and_shift(ans, other) if isinstance(other, Mapping) else None
            if got is None:
                continue
            x, y, shift, label, pa, pb = got
            q = stats.setdefault(qid, _Question(kind=str(ans.get("type"))))
            q.total += 1
            q.agree += x == y
            q.confusion[(x, y)] += 1
            q.shifts.append((shift, rid, label, pa, pb))
        routes = [((r.get("audit") or {}).get("route")) for r in (ra, rb)]
        if all(routes):
            q = stats.setdefault("(route)", _Question(kind="route"))
            q.total += 1
            q.agree += routes[0] == routes[1]
            q.confusion[(str(routes[0]), str(routes[1]))] += 1
    for q in stats.values():
        q.shifts = sorted(q.shifts, reverse=True)[:top]
    return stats


def _report(stats: Mapping[str, _Question], counts: dict[str, int]) -> dict[str, Any]:
    return {
        **counts,
        "questions": {
            qid: {
                "kind": q.kind,
                "compared": q.total,
                "agreement": round(q.agree / q.total, 6) if q.total else None,
                "confusion": [
                    {"a": x, "b": y, "count": n} for (x, y), n in sorted(q.confusion.items())
                ],
                "largest_shifts": [
                    {
                        "id": rid,
                        "label": label,
                        "a": round(pa, 6),
                        "b": round(pb, 6),
                        "shift": round(s, 6),
                    }
                    for s, rid, label, pa, pb in q.shifts
                ],
            }
            for qid, q in stats.items()
        },
    }


def _print_report(report: Mapping[str, Any]) -> None:
    print(
        f"compared {report['both']} results (only in A: {report['only_a']}, "
        f"only in B: {report['only_b']})"
    )
    for qid, q in report["questions"].items():
        print(f"{qid} ({q['kind']}): agreement {q['agreement']:.3f} of {q['compared']}")
        pairs = ", ".join(f"{c['a']}->{c['b']} {c['count']}" for c in q["confusion"])
        print(f"  A -> B: {pairs}")
        for s in q["largest_shifts"]:
            if s["shift"] > 0:
                print(
                    f"  {s['id']}: {s['label']} {s['a']:.4f} -> {s['b']:.4f} "
                    f"({s['b'] - s['a']:+.4f})"
                )


def compare(args: argparse.Namespace) -> int:
    a = _results(args, args.a, None)
    b = _results(args, args.b, None)
    counts = {
        "both": len(set(a) & set(b)),
        "only_a": len(set(a) - set(b)),
        "only_b": len(set(b) - set(a)),
    }
    report = _report(_tally(a, b, args.top), counts)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0 if counts["both"] else 1


# --------------------------------------------------------------------------- the parser


def register(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help="fit per-question temperatures from labelled results; write a calibration file",
    )
    p.add_argument("--out", "-o", required=True, help="the calibration file to write (JSON)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--examples", help='JSONL: {"result": ..., "labels": {qid: answer}} a line')
    src.add_argument("--results", help="JSONL of results (one result record's value a line)")
    src.add_argument("--topic", help="results from these topics (comma-separated)")
    p.add_argument("--labels", help='JSONL: {"id": ..., "labels": {qid: answer}} a line')
    p.add_argument(
        "--labels-in-metadata",
        metavar="KEY",
        help="take each result's labels from its metadata[KEY] (e.g. truth)",
    )
    p.add_argument("--questions", help="only these question ids (comma-separated)")
    p.add_argument(
        "--min-examples",
        type=int,
        default=20,
        help="fit a question only with at least this many labelled answers (20)",
    )
    p.add_argument("--idle-s", type=float, default=10.0, help="--topic: stop after this long idle")
    add_kafka_arguments(p)
    p.set_defaults(func=calibrate)

    q = sub.add_parser(
        "compare",
        help="two sets of result topics side by side (a pipeline and its shadow): per "
        "question agreement, confusion, largest probability shifts",
    )
    q.add_argument(
        "a", help="A's result topics (comma-separated: a pipeline's output and route topics)"
    )
    q.add_argument("b", help="B's result topics (comma-separated)")
    q.add_argument("--top", type=int, default=5, help="largest shifts to list per question (5)")
    q.add_argument("--json", action="store_true", help="the report as JSON")
    q.add_argument("--idle-s", type=float, default=10.0, help="stop reading after this long idle")
    add_kafka_arguments(q)
    q.set_defaults(func=compare)

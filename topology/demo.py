"""`dgstream demo`: the main job on the embedded default, end to end on this machine.

1. Start a real Kafka broker on loopback (its own state folder, a free port).
2. Create the request, result and dead-letter topics.
3. Produce sample moderation events (and one malformed message).
4. Consume them in a consumer group, answer each micro-batch with the embedded engine in
   one denoising step per read, publish results and dead letters, then commit.
5. Print a table of answers with probabilities and a summary; stop the broker.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from schemas import ClassificationRequest, ClassificationResult, DeadLetter, parse_request

REQUESTS, RESULTS, DEAD = "dgstream.requests", "dgstream.results", "dgstream.dead-letters"

MODERATION: dict[str, Any] = {
    "toxic": {
        "type": "noul",
        "instructions": "Does the message insult or attack someone?",
        "criteria": {"true": "insults, slurs, threats", "false": "polite or neutral"},
    },
    "category": {
        "type": "choice",
        "instructions": "What kind of message is it?",
        "criteria": {"spam": "ads, links, offers", "abuse": "insults", "normal": None},
    },
    "severity": {
        "type": "score",
        "instructions": "How severe is the problem?",
        "criteria": ["none", "mild", "serious", "extreme"],
    },
}

_STATES = [
    "hello friends, the game today was great",
    "you are a stupid idiot and a loser",
    "FREE MONEY NOW!!! click https://www.win.com/prize",
    "the weather is cold, rain and snow today",
    "buy cheap discount deal now, visit www.shop.com",
    "I hate you, you dumb fool!!!",
    "thanks for the song, the band was good",
    "please call the doctor about the medicine",
]


def sample_events(n: int) -> list[dict[str, Any]]:
    return [
        {
            "id": f"event-{i:05d}",
            "state": _STATES[i % len(_STATES)],
            "questions": MODERATION,
            "metadata": {"source": "demo", "seq": i},
        }
        for i in range(n)
    ]


def _answer_cell(answer: Any) -> str:
    kind = answer.type
    if kind == "yes_no":
        return f"{answer.label} (p_yes {answer.p_yes:.2f})"
    if kind == "choice":
        return f"{answer.choice} ({answer.confidence:.2f})"
    if kind == "score":
        return f"{answer.level} (E {answer.expected_score:.2f})"
    return "skipped"


def run_demo(events: int = 24, *, engine_model: str | None = None, batch: int = 16) -> int:
    from kafka import KafkaConsumer, KafkaProducer

    from infra.kafka import broker
    from workers.engine.factory import EngineSettings, build_classifier
    from workers.kafka_admin import ensure_topics

    home = tempfile.mkdtemp(prefix="dgstream-demo-")
    t0 = time.perf_counter()
    print("1. starting a Kafka broker on 127.0.0.1 ...", flush=True)
    info = broker.start(home=home, port=0)
    try:
        print(f"   ready at {info.bootstrap} in {info.start_seconds:.1f}s", flush=True)
        ensure_topics(info.bootstrap, {REQUESTS: 3, RESULTS: 3, DEAD: 1})
        print("2. loading the embedded engine ...", flush=True)
        settings = EngineSettings(model=engine_model) if engine_model else EngineSettings()
        classifier = build_classifier(settings, worker="demo")
        producer = KafkaProducer(
            bootstrap_servers=info.bootstrap, acks="all", enable_idempotence=True
        )
        print(f"3. producing {events} events and one malformed message ...", flush=True)
        for ev in sample_events(events):
            producer.send(REQUESTS, key=ev["id"].encode(), value=json.dumps(ev).encode())
        producer.send(REQUESTS, key=b"bad", value=b'{"id": "bad-1", "state": 42}')
        producer.flush()
        consumer = KafkaConsumer(
            REQUESTS,
            bootstrap_servers=info.bootstrap,
            group_id="dgstream-demo",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=batch,
        )
        print("4. answering in micro-batches (one denoising step per read) ...", flush=True)
        results: list[ClassificationResult] = []
        dead: list[DeadLetter] = []
        deadline = time.monotonic() + 300
        while len(results) + len(dead) < events + 1 and time.monotonic() < deadline:
            polled = consumer.poll(timeout_ms=500)
            records = [r for part in polled.values() for r in part]
            if not records:
                continue
            good: list[tuple[Any, ClassificationRequest]] = []
            for rec in records:
                parsed = parse_request(rec.value)
                if isinstance(parsed, ClassificationRequest):
                    good.append((rec, parsed))
                else:
                    dl = DeadLetter.build(
                        parsed,
                        rec.value,
                        rec.topic,
                        rec.partition,
                        rec.offset,
                        rec.key,
                        rec.timestamp,
                        "demo",
                    )
                    producer.send(DEAD, key=rec.key, value=dl.model_dump_json().encode())
                    dead.append(dl)
            answers = asyncio.run(classifier.classify([req for _, req in good]))
            for (rec, _), res in zip(good, answers, strict=True):
                if isinstance(res, ClassificationResult):
                    producer.send(RESULTS, key=rec.key, value=res.model_dump_json().encode())
                    results.append(res)
                else:
                    dl = DeadLetter.build(
                        res,
                        rec.value,
                        rec.topic,
                        rec.partition,
                        rec.offset,
                        rec.key,
                        rec.timestamp,
                        "demo",
                    )
                    producer.send(DEAD, key=rec.key, value=dl.model_dump_json().encode())
                    dead.append(dl)
            producer.flush()  # results acknowledged first ...
            consumer.commit()  # ... then the offsets that produced them
        consumer.close()
        producer.close()
        _print_table(results, dead, {ev["id"]: ev["state"] for ev in sample_events(events)})
        print(
            f"5. {len(results)} answered, {len(dead)} dead-lettered, "
            f"{time.perf_counter() - t0:.1f}s in all; model {classifier.engine.info.model}",
            flush=True,
        )
        return 0 if len(results) == events and len(dead) == 1 else 1
    finally:
        broker.stop(home=home)
        shutil.rmtree(home, ignore_errors=True)


def _print_table(
    results: Sequence[ClassificationResult], dead: Sequence[DeadLetter], states: dict[str, str]
) -> None:
    width = min(shutil.get_terminal_size((120, 20)).columns, 160)
    header = f"{'id':12s} {'toxic':18s} {'category':18s} {'severity':18s} state"
    print(header[:width])
    print("-" * min(len(header) + 20, width))
    for res in sorted(results, key=lambda r: r.id):
        a = res.answers
        row = (
            f"{res.id:12s} {_answer_cell(a['toxic']):18s} {_answer_cell(a['category']):18s} "
            f"{_answer_cell(a['severity']):18s} {states.get(res.id, '')}"
        )
        print(row[:width])
    for dl in dead:
        print(f"dead letter: {dl.error.code} {dl.error.message}"[:width])


def main(events: int) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return run_demo(events)

"""Schema Registry framing on the real broker: requests serialized by confluent-kafka's own
JSONSerializer (the Confluent wire format: 0x00, a 4-byte schema id, the JSON) are read by
a pipeline told its input is framed, which checks each id against the registry and frames
its results with the id of the result schema registered under "<output topic>-value";
confluent-kafka's JSONDeserializer reads them back. A framed record that is not valid is
dead-lettered with its original bytes intact; while the registry is away, records are read
unchecked and counted.

The registry is `support.registry_stub` on loopback (no registry server runs here: see
there); both confluent-kafka's client and the worker's talk to it over HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.registry_stub import RegistryStub

from bench.harness.pipeline import Pipeline, WorkerThread, request_bytes
from bench.harness.waiting import wait_for
from dgstream.schemas import DeadLetter
from dgstream.schemas.framing import frame, unframe

pytestmark = pytest.mark.broker

REQUEST_SCHEMA = (
    Path(__file__).resolve().parents[2] / "schemas" / "json" / "request.schema.json"
).read_text()


@pytest.fixture
def registry() -> Iterator[RegistryStub]:
    stub = RegistryStub().start()
    try:
        yield stub
    finally:
        stub.stop()


def _serializer(stub: RegistryStub) -> Any:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.json_schema import JSONSerializer

    client = SchemaRegistryClient({"url": stub.url})
    return JSONSerializer(REQUEST_SCHEMA, client, to_dict=lambda obj, ctx: obj)


def _deserializer(stub: RegistryStub) -> Any:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.json_schema import JSONDeserializer

    return JSONDeserializer(None, schema_registry_client=SchemaRegistryClient({"url": stub.url}))


def _ctx(topic: str) -> Any:
    from confluent_kafka.serialization import MessageField, SerializationContext

    return SerializationContext(topic, MessageField.VALUE)


def test_framed_requests_in_framed_results_out(
    pipeline: Pipeline, registry: RegistryStub, worker_threads: list[WorkerThread]
) -> None:
    p = pipeline
    serialize = _serializer(registry)
    good = {
        f"sr{i}": serialize(json.loads(request_bytes(f"sr{i}", i)), _ctx(p.input)) for i in range(6)
    }
    (request_id,) = registry.subjects[f"{p.input}-value"]
    assert all(unframe(v) == (request_id, unframe(v)[1]) for v in good.values())  # type: ignore[index]
    avro = registry.register("other-value", '{"type": "string"}', "AVRO")
    bad = {
        "unframed": (request_bytes("unframed", 0), "NOT_FRAMED"),
        "unknown-id": (frame(9999, request_bytes("unknown-id", 0)), "SCHEMA_ID_UNKNOWN"),
        "avro-id": (frame(avro, request_bytes("avro-id", 0)), "SCHEMA_NOT_JSON"),
        "bad-body": (frame(request_id, b'{"id": "bad-body", "state": 5}'), "WRONG_TYPE"),
        "short": (b"\x00\x00", "NOT_FRAMED"),
    }
    keys = [*good, *bad]
    p.produce([*good.values(), *(v for v, _ in bad.values())], keys=[k.encode() for k in keys])
    worker = WorkerThread(
        p.settings(
            input_framing="confluent",
            output_framing="confluent",
            schema_registry={"url": registry.url},
        )
    ).start()
    worker_threads.append(worker)
    out, dead = p.reader(read_committed=True), p.reader(p.dead, read_committed=True)
    out.read_until(lambda r: len(r.records) >= len(good), 90, "the framed results")
    dead.read_until(lambda r: len(r.records) >= len(bad), 60, "the dead letters")
    # Results: framed with the id of the result schema under "<output>-value", which
    # confluent-kafka's deserializer finds in the registry and reads.
    (result_id,) = registry.subjects[f"{p.output}-value"]
    assert json.loads(registry.schemas[result_id][1])["title"]
    deserialize = _deserializer(registry)
    for rec in out.records:
        assert unframe(rec.value)[0] == result_id  # type: ignore[index]
        body = deserialize(rec.value, _ctx(p.output))
        assert body["id"] == rec.key.decode() and body["status"] == "ok", body
    assert sorted(out.keys()) == sorted(good)
    # Dead letters: each code, the original (framed) bytes byte for byte.
    for rec in dead.records:
        letter = DeadLetter.from_record(rec.value, rec.key, rec.headers)
        value, code = bad[rec.key.decode()]
        assert letter.error.code == code, (rec.key, letter.error)
        assert letter.original_value() == value
    # Known ids are asked once (the cache), however many records carry them.
    assert registry.lookups[request_id] <= 1

    # The registry away: an id the worker knows is read as usual; one it has not seen is
    # read unchecked, and counted; none is dead-lettered for it.
    later = registry.register(f"{p.input}-value", json.dumps({"type": "object", "v": 2}))
    registry.stop()
    p.produce(
        [
            frame(request_id, request_bytes("down-known", 1)),
            frame(later, request_bytes("down-new", 2)),
        ],
        keys=[b"down-known", b"down-new"],
    )
    out.read_until(lambda r: {"down-known", "down-new"} <= set(r.keys()), 60, "both answered")
    assert worker.worker.status()["registry_unverified"] == 1
    dead.read_to_end()
    assert len(dead.records) == len(bad)
    wait_for(lambda: worker.error is None, 1, "no failure")

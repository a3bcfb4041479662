"""Every output fits its topic, to the byte, without a broker: the limit
arithmetic against kafka-python's own sizes, the one decision that shapes a result
(`fit_record`) and a dead letter (`dead_letter_record`), as properties over any key, value
and headers sizes and any limits, and the worker's start refusing a dead-letter topic too
small for its last form. The same against the real broker: test_output_limits_broker.py."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from kafka.record.default_records import DefaultRecordBatchBuilder as Builder

from dgstream.schemas import DeadLetter, ErrorCode, ParseLimits, RequestError, parse_request
from dgstream.schemas.dead_letter import RAW_FORMAT
from dgstream.workers.faults.errors import WorkerFailed
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.kafka.settings import KafkaConnection
from dgstream.workers.steps.outputs import OutputBuilder
from dgstream.workers.steps.records import (
    DEAD_LETTER_CORE,
    RESULT_CORE,
    SHRUNK,
    SHRUNK_HEADERS,
    Original,
    dead_letter_record,
    fit_record,
    key_digest,
    output_headers,
    reference_floor,
)
from dgstream.workers.steps.topics import Limit, TopicGuard, batch_size, record_size

pytestmark = pytest.mark.unit

PROPERTY = settings(
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DEFAULT = Limit(1_048_576, 1_048_588)  # Kafka's and kafka-python's defaults
RESULT_OURS = [
    ("schema_version", b"1"),
    ("model", b"demo"),
    ("worker", b"moderation-0"),
    ("output_format", b"dgstream"),
    ("route", b"default"),
]
LETTER_OURS = [("schema_version", b"1"), ("worker", b"moderation-0"), ("error_code", b"POISON")]
SOURCE = ("moderation.requests", 3, 1_234_567)

Headers = list[tuple[str, bytes | None]]


def _size_of(key: bytes | None, value: bytes | None, headers: Headers) -> int:
    size: int = Builder.size_of(key, value, headers)
    return size


def _lone_batch(key: bytes | None, value: bytes | None, headers: Headers, codec: int = 0) -> int:
    """The batch kafka-python's producer sends for this record alone: built, not summed."""
    b = Builder(2, codec, False, -1, -1, -1, 1 << 30)
    b.append(0, 1_796_000_000_000, key, value, headers)
    return len(b.build())


# ----------------------------------------------------------------------- strategies

sizes = st.one_of(st.integers(0, 300), st.integers(0, 70_000), st.integers(1_000_000, 2_200_000))
keys = st.one_of(st.none(), sizes.map(lambda n: b"k" * n))
header_lists = st.lists(
    st.tuples(st.text(max_size=12), st.one_of(st.none(), sizes.map(lambda n: b"h" * n))),
    max_size=6,
)
limits = st.builds(
    Limit,
    st.one_of(st.just(1_048_576), st.integers(1_024, 2_500_000)),
    st.one_of(st.none(), st.just(1_048_588), st.integers(2_500, 2_500_000)),
    st.sampled_from(["producer", "uncompressed", "zstd", "gzip", "lz4", "snappy"]),
)


# ----------------------------------------------------------------------- the arithmetic


@PROPERTY
@given(keys, sizes, header_lists)
def test_the_sizes_are_kafka_pythons(key: bytes | None, n: int, headers: Headers) -> None:
    """The producer's estimate is its own function's; the lone batch is the batch its
    builder makes (compressed with zstd it is never larger: kafka-python sends a batch
    that compression grew uncompressed)."""
    value = b"v" * n
    assert record_size(key, value, headers) == Builder.estimate_size_in_bytes(key, value, headers)
    assert batch_size(key, value, headers) == _lone_batch(key, value, headers)
    zstd = Builder.CODEC_ZSTD
    assert _lone_batch(key, value, headers, zstd) <= batch_size(key, value, headers)


@PROPERTY
@given(limits, keys, sizes, header_lists)
def test_a_limit_answers_by_size_of_alone(
    limit: Limit, key: bytes | None, n: int, headers: Headers
) -> None:
    value = b"v" * n
    size_of = _size_of(key, value, headers)
    assert limit.fits(key, value, headers) == limit.fits_size_of(size_of)
    assert limit.fits(key, value, headers) == (size_of <= limit.max_size_of)
    if limit.fits(key, value, headers):
        assert record_size(key, value, headers) <= limit.request  # send() takes it
        if limit.batch is not None:
            assert batch_size(key, value, headers) <= limit.batch  # and the broker


@pytest.mark.parametrize(
    ("limit", "largest"),
    [
        # The producer's: 1,048,576 less the estimate's fixed 61 + 21 bytes.
        (DEFAULT, 1_048_576 - 82),
        (Limit(1_048_576), 1_048_576 - 82),
        # The topic's, below: its batch, 61 + 3 + size_of + the length's 3 bytes.
        (Limit(1_048_576, 20_000), 20_000 - 61 - 3 - 3),
        (Limit(1_048_576, 100), 100 - 61 - 3 - 1),
        # A topic that recompresses with zstd: 3 bytes a block and its frame (25 + 3).
        (Limit(1_048_576, 20_000, "zstd"), 20_000 - 61 - 3 - 3 - 28),
    ],
)
def test_the_largest_record_that_fits(limit: Limit, largest: int) -> None:
    assert limit.max_size_of == largest
    assert limit.fits_size_of(largest) and not limit.fits_size_of(largest + 1)


# ----------------------------------------------------------------------- results


def _check_fitted(
    value: bytes, key: bytes | None, headers: Headers, limit: Limit, got: Any
) -> None:
    """What `fit_record` promises of a record it returns."""
    out = dict(got.headers)
    assert limit.fits(got.key, value, got.headers)
    core = [(k, v or b"") for k, v in headers if k in RESULT_CORE]
    assert [h for h in got.headers if h[0] in RESULT_CORE] == core  # all kept, in order
    if not got.cut:
        assert got.key == key and got.headers == [(k, v or b"") for k, v in headers]
        assert SHRUNK not in out
        return
    assert out[SHRUNK] == ",".join(got.cut).encode()
    assert got.key == (key_digest(key) if "key" in got.cut else key)  # type: ignore[arg-type]
    assert out["dgstream.source.offset"] == str(SOURCE[2]).encode()
    kept = [h for h in got.headers if not h[0].startswith("dgstream.")]
    # The headers kept are the input's, in order, less `dropped` of the droppable ones.
    original = [(k, v or b"") for k, v in headers]
    it = iter(original)
    assert all(h in it for h in kept)
    assert len(original) - len(kept) == got.dropped
    assert (SHRUNK_HEADERS in out) == bool(got.dropped)
    if got.dropped:
        assert out[SHRUNK_HEADERS] == str(got.dropped).encode()


def _least(key: bytes | None, extra: Headers, digest: bool) -> tuple[bytes | None, Headers]:
    """A result's key and headers with every header but ours left out (and the key
    replaced by its digest when `digest` and it is longer), marked as docs/errors.md says."""
    short = key_digest(key) if digest and key is not None and len(key) > 71 else key
    cut = [*(["key"] if short is not key else []), *(["headers"] if extra else [])]
    marks: Headers = []
    if cut:
        marks.append((SHRUNK, ",".join(cut).encode()))
        if extra:
            marks.append((SHRUNK_HEADERS, str(len(extra)).encode()))
        marks += [
            ("dgstream.source.topic", SOURCE[0].encode()),
            ("dgstream.source.partition", str(SOURCE[1]).encode()),
            ("dgstream.source.offset", str(SOURCE[2]).encode()),
        ]
    return short, [*RESULT_OURS, *marks]


@PROPERTY
@given(limits, keys, sizes, header_lists)
# Found by the search: a recompressing topic near a 76-byte key's digest, one header.
@example(Limit(1_048_576, 3_139, "snappy"), b"k" * 76, 2_272, [("", b"h" * 149)])
@example(Limit(1_048_576, 2_665, "snappy"), b"k" * 27, 1_916, [("", b"h" * 1_000_726)])
def test_a_result_fits_or_is_refused_only_when_nothing_cut_helps(
    limit: Limit, key: bytes | None, n: int, extra: Headers
) -> None:
    value = b"{" + b"r" * n
    headers: Headers = [*extra, *RESULT_OURS]
    got = fit_record(value, key, headers, limit, keep=RESULT_CORE, source=SOURCE)
    if got is not None:
        _check_fitted(value, key, headers, limit, got)
        if "key" in got.cut:  # the key goes last: not even every header out made room
            kept, least = _least(key, extra, digest=False)
            assert not limit.fits(kept, value, least)
        return
    # Refused: not even the value with our core headers, the markers and the shortest key.
    short, least = _least(key, extra, digest=True)
    assert not limit.fits(short, value, least)


def test_headers_go_largest_first_and_no_more_than_need_be() -> None:
    """A 1 MiB limit: a small trace header stays, two of three 512 KiB headers go (the
    earlier of equal ones first), and the key stays."""
    big = b"h" * (512 << 10)
    trace = ("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    headers: Headers = [trace, ("a", big), ("b", big), ("c", big), *RESULT_OURS]
    got = fit_record(b"{}", b"order-17", headers, DEFAULT, keep=RESULT_CORE, source=SOURCE)
    assert got is not None and got.cut == ("headers",) and got.dropped == 2
    assert got.key == b"order-17"
    assert [k for k, _ in got.headers][:2] == ["traceparent", "c"]


def test_a_key_too_large_for_any_record_is_replaced_by_its_digest() -> None:
    key = b"k" * (2 << 20)  # the report's 2 MB key
    got = fit_record(b"{}", key, RESULT_OURS, DEFAULT, keep=RESULT_CORE, source=SOURCE)
    assert got is not None and got.cut == ("key",) and got.dropped == 0
    assert got.key == b"sha256:" + hashlib.sha256(key).hexdigest().encode()
    assert dict(got.headers)["dgstream.source.topic"] == b"moderation.requests"


def test_a_header_name_without_utf8_is_never_sent() -> None:
    """kafka-python encodes header names as UTF-8; a lone surrogate cannot be."""
    headers: Headers = [("bad\udcff", b"x"), ("good", b"y"), *RESULT_OURS]
    got = fit_record(b"{}", b"k", headers, DEFAULT, keep=RESULT_CORE, source=SOURCE)
    assert got is not None and got.cut == ("headers",) and got.dropped == 1
    assert ("good", b"y") in got.headers


# ----------------------------------------------------------------------- dead letters

error_texts = st.one_of(st.text(max_size=80), st.integers(0, 1_500_000).map(lambda n: "\x00" * n))


@PROPERTY
@given(
    st.one_of(st.none(), sizes.map(lambda n: b"<" * n)),
    keys,
    header_lists,
    error_texts,
    st.integers(0, 1_600_000),
    st.sampled_from(["producer", "zstd", "gzip", "lz4", "snappy"]),
)
def test_a_dead_letter_always_fits_a_topic_above_the_floor(
    value: bytes | None,
    key: bytes | None,
    headers: Headers,
    message: str,
    topic_bytes: int,
    codec: str,
) -> None:
    floor = Limit(1 << 30)
    fits, least = reference_floor("moderation-0", [SOURCE[0]], LETTER_OURS, floor)
    assert fits
    limit = Limit(1_048_576, least + 200 + topic_bytes, codec)  # any topic from the floor
    assume(reference_floor("moderation-0", [SOURCE[0]], LETTER_OURS, limit)[0])
    error = RequestError(code=ErrorCode.POISON, message=message or "x", field=message or None)
    letter = DeadLetter.build(
        error, value, SOURCE[0], SOURCE[1], SOURCE[2], key, 17, "moderation-0", headers=headers
    )
    got = dead_letter_record(letter, Original(key, value, headers), LETTER_OURS, limit, "mod")
    assert got is not None
    assert limit.fits(got.key, got.value, got.headers)
    assert dict(got.headers)[RAW_FORMAT] == got.form.encode()
    back = DeadLetter.from_record(got.value, got.key, got.headers)
    assert back.error.code == ErrorCode.POISON
    assert (back.source.topic, back.source.partition, back.source.offset) == SOURCE
    if value is not None:
        assert back.original_sha256 == hashlib.sha256(value).hexdigest()
    if got.form == "raw":  # the record is the original, byte for byte
        assert (got.key, got.value) == (key, value)
        assert back.original_headers() == headers
        return
    if got.form == "json":
        assert back.original_value() == value and back.source.key_bytes() == key
        assert back.original_headers() == headers and not back.truncated
        return
    assert back.truncated
    assert (value or b"").startswith(back.original_bytes())
    kept = back.original_headers()
    it = iter(headers)
    assert all(h in it for h in kept) and len(headers) - len(kept) == back.headers_omitted
    if back.source.key_bytes() is None and key is not None:
        assert back.source.key_sha256 == hashlib.sha256(key).hexdigest()
        assert back.source.key_size == len(key)
    if got.form == "reference":
        assert back.original == "" and not kept and back.source.key_bytes() is None
    # Neither the whole document, its record cut as far as it may be, nor the original
    # with the error's headers fit: a form before this one would have been taken.
    ours = [*LETTER_OURS, (RAW_FORMAT, b"json")]
    copies = [h for h in output_headers(headers, ours) if h[0] not in DEAD_LETTER_CORE]
    short = key_digest(key) if key is not None and len(key) > 71 else key
    cut = [*(["key"] if short is not key else []), *(["headers"] if copies else [])]
    marks = [(SHRUNK, ",".join(cut).encode())] if cut else []
    marks += [(SHRUNK_HEADERS, str(len(copies)).encode())] if copies else []
    assert not limit.fits(short, letter.model_dump_json().encode(), [*ours, *marks])
    if value is not None:
        assert not limit.fits(key, value, letter.raw_headers("mod"))


@pytest.mark.parametrize(
    ("n", "form"),
    [
        (700_000, "json"),  # 933 KB of base64: the document fits
        (800_000, "raw"),  # 1.07 MB of base64 does not; the original does
        (1_048_576 - 200, "truncated"),  # nor it with the error's headers beside it
        (1_048_577, "truncated"),  # the report's request one byte over the limit
    ],
)
def test_the_forms_in_order_at_kafkas_defaults(n: int, form: str) -> None:
    value = b"<" + b"z" * (n - 1)
    error = RequestError(code=ErrorCode.MESSAGE_TOO_LARGE, message="the message is too large")
    letter = DeadLetter.build(error, value, *SOURCE, b"k-1", 17, "moderation-0")
    got = dead_letter_record(letter, Original(b"k-1", value, []), LETTER_OURS, DEFAULT, "mod")
    assert got is not None and got.form == form
    size = record_size(got.key, got.value, got.headers)
    assert size <= 1_048_576
    if form == "truncated":  # as much of the value as fits: within one base64 quantum
        assert size > 1_048_576 - 4
        assert value.startswith(got.letter.original_bytes())


def test_the_reports_big_key_and_headers_dead_letters() -> None:
    """POISON with a 2 MB key, and with 3 headers of 512 KB: the value kept whole, what
    does not fit left out and named by its digest or count."""
    error = RequestError(code=ErrorCode.POISON, message="alone in 2 incarnations that died")
    value = b'{"id": "r-1", "state": "hello", "question_set": "moderation"}'
    key = b"k" * 2_000_000
    letter = DeadLetter.build(error, value, *SOURCE, key, 17, "moderation-0")
    got = dead_letter_record(letter, Original(key, value, []), LETTER_OURS, DEFAULT, "mod")
    assert got is not None and got.form == "truncated"
    assert got.letter.original_bytes() == value and got.letter.source.key is None
    assert got.letter.source.key_sha256 == hashlib.sha256(key).hexdigest()
    assert got.key == key_digest(key) and got.letter.request_id == "r-1"

    big = [(f"h{i}", b"x" * (512 << 10)) for i in range(3)]
    letter = DeadLetter.build(error, value, *SOURCE, b"k-1", 17, "moderation-0", headers=big)
    got = dead_letter_record(letter, Original(b"k-1", value, big), LETTER_OURS, DEFAULT, "mod")
    assert got is not None and got.form == "truncated"
    assert got.letter.original_bytes() == value and got.letter.headers_omitted == 2
    assert got.letter.source.key_bytes() == b"k-1" and got.key == b"k-1"
    assert record_size(got.key, got.value, got.headers) <= 1_048_576


def test_a_value_the_consumer_kept_only_the_start_of_is_never_sent_raw() -> None:
    """The consumer's bound keeps the first bytes of a longer value: the letter says so,
    names the whole size and has no digest of a value it never held."""
    error = RequestError(code=ErrorCode.MESSAGE_TOO_LARGE, message="too large")
    prefix = b"<" * 5_000
    letter = DeadLetter.build(
        error, prefix, *SOURCE, b"k", 17, "w", complete=False, original_size=3_000_000
    )
    assert letter.truncated and letter.original_size == 3_000_000
    assert letter.original_sha256 is None
    limit = Limit(1_048_576, 6_000)  # the prefix alone would fit, raw
    got = dead_letter_record(letter, Original(b"k", prefix, []), LETTER_OURS, limit, "mod")
    assert got is not None and got.form == "truncated"


# ----------------------------------------------------------------------- the floor


def _settings(**kw: Any) -> WorkerSettings:
    return WorkerSettings(
        pipeline="p",
        input_topics=["requests"],
        output_topic="results",
        dead_letter_topic="dead",
        group_id="g",
        kafka=KafkaConnection(bootstrap_servers="127.0.0.1:9092"),
        **kw,
    )


def _builder(dead_max: int) -> OutputBuilder:
    settings = _settings()

    def describe(topic: str) -> tuple[dict[str, Any], int | None, str | None]:
        meta = {"error_code": 0, "is_internal": False, "authorized_operations": ["WRITE"]}
        return meta, dead_max if topic == "dead" else 1_048_588, "producer"

    topics = TopicGuard(settings, describe)
    topics.lookup("dead")

    class Log:
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    return OutputBuilder(settings, b"demo", topics, Log())


def test_a_dead_letter_topic_below_the_floor_fails_the_start_with_the_figures() -> None:
    ours = [("schema_version", b"1"), ("worker", b"p-0"), ("error_code", b"POISON")]
    _, floor = reference_floor("p-0", ["requests"], ours, Limit(1 << 30))
    # Its batch is up to 15 bytes below its estimate; the floor is an estimate.
    with pytest.raises(WorkerFailed, match=r"dead-letter topic 'dead' is too small") as info:
        _builder(floor - 100)
    assert "max.message.bytes" in str(info.value) and str(floor - 100) in str(info.value)
    _builder(floor)  # at the floor: it starts


@pytest.mark.parametrize("worker", ["default.moderation-0", "x" * 200, "\U0010ffff" * 200])
def test_any_dead_letter_topic_of_4_kib_takes_the_reference_form(worker: str) -> None:
    """docs/errors.md's promise, for the longest names the settings allow (a topic of 249
    characters, a worker_name of 200 4-byte characters); about 2 KB with ordinary ones."""
    ours = [("schema_version", b"1"), ("worker", worker.encode()), ("error_code", b"POISON")]
    fits, size = reference_floor(worker, ["t" * 249], ours, Limit(1_048_576, 4_096))
    assert fits, size
    _, ordinary = reference_floor(worker, ["moderation.requests"], ours, Limit(1 << 30))
    if worker.isascii() and len(worker) < 30:
        assert 1_500 < ordinary < 2_500, ordinary


# ----------------------------------------------------------------------- the input limit


def _request_of(size: int) -> bytes:
    head = b'{"id": "r", "state": "s", "question_set": "moderation"'
    return head + b" " * (size - len(head) - 1) + b"}"


@pytest.mark.parametrize(
    ("size", "refused"), [(1_048_575, False), (1_048_576, False), (1_048_577, True)]
)
def test_the_message_limit_is_exact(size: int, refused: bool) -> None:
    got = parse_request(_request_of(size), ParseLimits())
    assert isinstance(got, RequestError) == refused
    if refused:
        assert isinstance(got, RequestError) and got.code == ErrorCode.MESSAGE_TOO_LARGE
        assert "1048577 bytes; the limit is 1048576" in got.message

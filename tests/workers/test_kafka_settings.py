"""KafkaConnection: validation table, client kwargs, environment, and secrets kept hidden:
passwords named by environment variable and read where the client is built; a literal one
cannot be pickled (Ray's actor arguments)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from dgstream.workers.kafka.settings import (
    KafkaConnection,
    MissingSecret,
    SaslMechanism,
    SecurityProtocol,
)

pytestmark = pytest.mark.unit

SASL_PW = "s3cret-sasl-pw"
SSL_PW = "s3cret-key-pw"
BS = ["broker-1.example.com:9093"]
SASL = {
    "security_protocol": "SASL_SSL",
    "sasl_mechanism": "SCRAM-SHA-512",
    "sasl_username": "svc",
    "sasl_password": SASL_PW,
}

VALID: list[tuple[str, dict[str, Any]]] = [
    ("plaintext list", {"bootstrap_servers": ["127.0.0.1:9092"]}),
    ("comma string", {"bootstrap_servers": "a:1, b.example:2,[::1]:9092"}),
    ("ipv6", {"bootstrap_servers": ["[2001:db8::1]:9092"]}),
    ("ssl ca only", {"bootstrap_servers": BS, "security_protocol": "SSL", "ssl_cafile": "ca.pem"}),
    (
        "ssl mutual tls",
        {
            "bootstrap_servers": BS,
            "security_protocol": "SSL",
            "ssl_certfile": "c.pem",
            "ssl_keyfile": "k.pem",
            "ssl_password": SSL_PW,
        },
    ),
    ("sasl_ssl scram", {"bootstrap_servers": BS, **SASL}),
    (
        "sasl_plaintext plain, lower case",
        {
            "bootstrap_servers": BS,
            "security_protocol": "sasl_plaintext",
            "sasl_mechanism": "plain",
            "sasl_username": "u",
            "sasl_password": "p",
        },
    ),
    ("scram underscores", {"bootstrap_servers": BS, **SASL, "sasl_mechanism": "scram_sha_256"}),
    (
        "sasl password by name",
        {"bootstrap_servers": BS, **SASL, "sasl_password": None, "sasl_password_env": "PW_VAR"},
    ),
]

INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("no servers", {"bootstrap_servers": []}, "bootstrap_servers"),
    ("empty string", {"bootstrap_servers": ""}, "bootstrap_servers"),
    ("missing servers", {}, "bootstrap_servers"),
    ("no port", {"bootstrap_servers": ["localhost"]}, "bootstrap_servers"),
    ("port 0", {"bootstrap_servers": ["localhost:0"]}, "bootstrap_servers"),
    ("port too big", {"bootstrap_servers": ["localhost:70000"]}, "bootstrap_servers"),
    ("port not a number", {"bootstrap_servers": ["localhost:abc"]}, "bootstrap_servers"),
    ("bad host", {"bootstrap_servers": ["bad_host!:9092"]}, "bootstrap_servers"),
    ("bare ipv6", {"bootstrap_servers": ["::1:9092"]}, "bootstrap_servers"),
    ("bad ipv6", {"bootstrap_servers": ["[zz::1]:9092"]}, "bootstrap_servers"),
    ("bad protocol", {"bootstrap_servers": BS, "security_protocol": "TLS"}, "security_protocol"),
    (
        "unknown mechanism",
        {"bootstrap_servers": BS, **SASL, "sasl_mechanism": "GSSAPI"},
        "sasl_mechanism",
    ),
    (
        "sasl without mechanism",
        {"bootstrap_servers": BS, **SASL, "sasl_mechanism": None},
        "sasl_mechanism",
    ),
    (
        "sasl without username",
        {"bootstrap_servers": BS, **SASL, "sasl_username": None},
        "sasl_username",
    ),
    ("sasl empty user", {"bootstrap_servers": BS, **SASL, "sasl_username": ""}, "sasl_username"),
    (
        "sasl without password",
        {"bootstrap_servers": BS, **SASL, "sasl_password": None},
        "sasl_password",
    ),
    ("sasl empty pw", {"bootstrap_servers": BS, **SASL, "sasl_password": ""}, "sasl_password"),
    (
        "credentials on plaintext",
        {"bootstrap_servers": BS, "sasl_username": "u", "sasl_password": SASL_PW},
        "sasl_username",
    ),
    (
        "mechanism on ssl",
        {"bootstrap_servers": BS, "security_protocol": "SSL", "sasl_mechanism": "PLAIN"},
        "sasl_mechanism",
    ),
    ("ssl file on plaintext", {"bootstrap_servers": BS, "ssl_cafile": "ca.pem"}, "ssl_cafile"),
    (
        "ssl file on sasl_plaintext",
        {"bootstrap_servers": BS, **SASL, "security_protocol": "SASL_PLAINTEXT", "ssl_cafile": "c"},
        "ssl_cafile",
    ),
    (
        "key without cert",
        {"bootstrap_servers": BS, "security_protocol": "SSL", "ssl_keyfile": "k.pem"},
        "ssl_keyfile",
    ),
    (
        "key password without key",
        {"bootstrap_servers": BS, "security_protocol": "SSL", "ssl_password": SSL_PW},
        "ssl_password",
    ),
    (
        "sasl password and its variable",
        {"bootstrap_servers": BS, **SASL, "sasl_password_env": "PW_VAR"},
        "sasl_password",
    ),
    (
        "sasl variable not a name",
        {"bootstrap_servers": BS, **SASL, "sasl_password": None, "sasl_password_env": "a b"},
        "sasl_password_env",
    ),
    (
        "sasl variable on plaintext",
        {"bootstrap_servers": BS, "sasl_password_env": "PW_VAR"},
        "sasl_password_env",
    ),
    (
        "key password variable without a key",
        {"bootstrap_servers": BS, "security_protocol": "SSL", "ssl_password_env": "PW_VAR"},
        "ssl_password_env",
    ),
    ("unknown field", {"bootstrap_servers": BS, "sasl_user": "u"}, "sasl_user"),
    ("empty client id", {"bootstrap_servers": BS, "client_id": ""}, "client_id"),
]


@pytest.mark.parametrize(("case", "kwargs"), VALID, ids=[c for c, _ in VALID])
def test_valid(case: str, kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PW_VAR", SASL_PW)
    conn = KafkaConnection(**kwargs)
    kw = conn.client_kwargs()
    assert kw["security_protocol"] == conn.security_protocol.value
    assert kw["bootstrap_servers"] == conn.bootstrap_servers


@pytest.mark.parametrize(("case", "kwargs", "field"), INVALID, ids=[c for c, _, _ in INVALID])
def test_invalid_names_the_field(case: str, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        KafkaConnection(**kwargs)
    fields = {str(loc) for e in info.value.errors() for loc in e["loc"]}
    assert field in fields, info.value.errors()
    assert SASL_PW not in str(info.value)  # rejected input is never echoed
    assert SSL_PW not in str(info.value)


def test_parsed_values() -> None:
    conn = KafkaConnection(bootstrap_servers=" a:1 , [::1]:2 ", **SASL)
    assert conn.bootstrap_servers == ["a:1", "[::1]:2"]
    assert conn.bootstrap == "a:1,[::1]:2"
    assert conn.security_protocol is SecurityProtocol.SASL_SSL
    assert conn.sasl_mechanism is SaslMechanism.SCRAM_SHA_512


def test_frozen() -> None:
    conn = KafkaConnection(bootstrap_servers=BS)
    with pytest.raises(ValidationError):
        conn.client_id = "other"  # type: ignore[misc]


def test_client_kwargs_plaintext() -> None:
    conn = KafkaConnection(bootstrap_servers=["127.0.0.1:9092"], client_id="w1")
    assert conn.client_kwargs() == {
        "bootstrap_servers": ["127.0.0.1:9092"],
        "security_protocol": "PLAINTEXT",
        "client_id": "w1",
        "reconnect_backoff_max_ms": 1000,
    }
    assert conn.client_kwargs(client_id="x", request_timeout_ms=5)["client_id"] == "x"


def test_client_kwargs_unwrap_secrets_for_kafka_python() -> None:
    conn = KafkaConnection(
        bootstrap_servers=BS,
        **SASL,
        ssl_cafile="ca.pem",
        ssl_certfile="c.pem",
        ssl_keyfile="k.pem",
        ssl_password=SSL_PW,
        ssl_check_hostname=False,
    )
    assert conn.client_kwargs() == {
        "bootstrap_servers": BS,
        "security_protocol": "SASL_SSL",
        "client_id": "dgstream",
        "reconnect_backoff_max_ms": 1000,
        "ssl_check_hostname": False,
        "ssl_cafile": "ca.pem",
        "ssl_certfile": "c.pem",
        "ssl_keyfile": "k.pem",
        "ssl_password": SSL_PW,
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "svc",
        "sasl_plain_password": SASL_PW,
    }


def test_kwargs_accepted_by_kafka_python() -> None:
    """Every key is a real kafka-python config name (no connection is attempted)."""
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

    conn = KafkaConnection(bootstrap_servers=BS, **SASL, ssl_cafile="ca.pem")
    for cls in (KafkaAdminClient, KafkaConsumer, KafkaProducer):
        assert set(conn.client_kwargs()) <= set(cls.DEFAULT_CONFIG), cls.__name__


def test_secrets_never_shown() -> None:
    conn = KafkaConnection(
        bootstrap_servers=BS,
        **SASL,
        ssl_certfile="c.pem",
        ssl_keyfile="k.pem",
        ssl_password=SSL_PW,
    )
    for text in (repr(conn), str(conn), conn.model_dump_json(), str(conn.model_dump())):
        assert SASL_PW not in text
        assert SSL_PW not in text
    assert "svc" in repr(conn)  # the user name is not a secret


def test_from_env() -> None:
    env = {
        "DGSTREAM_KAFKA_BOOTSTRAP_SERVERS": "k1:9093,k2:9093",
        "DGSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "DGSTREAM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
        "DGSTREAM_KAFKA_SASL_USERNAME": "svc",
        "DGSTREAM_KAFKA_SASL_PASSWORD": SASL_PW,
        "DGSTREAM_KAFKA_SSL_CHECK_HOSTNAME": "false",
        "DGSTREAM_KAFKA_HOME": "/ignored/not/a/field",
        "OTHER_SASL_PASSWORD": "nope",
    }
    conn = KafkaConnection.from_env(environ=env)
    assert conn.bootstrap_servers == ["k1:9093", "k2:9093"]
    assert conn.sasl_mechanism is SaslMechanism.SCRAM_SHA_256
    assert conn.ssl_check_hostname is False
    # The password is taken by name: the object holds no secret, and can travel.
    assert conn.sasl_password is None
    assert conn.sasl_password_env == "DGSTREAM_KAFKA_SASL_PASSWORD"
    assert SASL_PW not in repr(conn) and SASL_PW not in pickle.dumps(conn).decode("latin-1")
    secret = conn.secret("sasl_password", env)
    assert secret is not None and secret.get_secret_value() == SASL_PW


def test_from_env_names_another_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KAFKA_PW", SASL_PW)
    env = {
        "DGSTREAM_KAFKA_BOOTSTRAP_SERVERS": "k1:9093",
        "DGSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "DGSTREAM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "DGSTREAM_KAFKA_SASL_USERNAME": "svc",
        "DGSTREAM_KAFKA_SASL_PASSWORD_ENV": "MY_KAFKA_PW",
        "DGSTREAM_KAFKA_SASL_PASSWORD": "ignored: the named variable wins",
    }
    conn = KafkaConnection.from_env(environ=env)
    assert conn.sasl_password_env == "MY_KAFKA_PW"
    assert conn.client_kwargs()["sasl_plain_password"] == SASL_PW


def test_from_env_prefix_defaults_and_secret_file(tmp_path: Path) -> None:
    pw_file = tmp_path / "pw"
    pw_file.write_text(SASL_PW + "\n")
    env = {
        "APP_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "APP_SASL_MECHANISM": "PLAIN",
        "APP_SASL_USERNAME": "u",
        "APP_SASL_PASSWORD_FILE": str(pw_file),
    }
    conn = KafkaConnection.from_env("APP_", environ=env, bootstrap_servers="localhost:9092")
    assert conn.bootstrap_servers == ["localhost:9092"]
    assert conn.client_kwargs()["sasl_plain_password"] == SASL_PW


def test_from_env_missing_bootstrap_names_the_field() -> None:
    with pytest.raises(ValidationError, match="bootstrap_servers"):
        KafkaConnection.from_env(environ={})


def test_from_env_uses_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DGSTREAM_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:19092")
    assert KafkaConnection.from_env().bootstrap_servers == ["127.0.0.1:19092"]


def _named(var: str = "DG_TEST_KAFKA_PW") -> KafkaConnection:
    return KafkaConnection(
        bootstrap_servers=BS, **{**SASL, "sasl_password": None}, sasl_password_env=var
    )


def test_named_password_is_read_where_the_client_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    conn = _named()
    monkeypatch.setenv("DG_TEST_KAFKA_PW", SASL_PW)
    assert conn.client_kwargs()["sasl_plain_password"] == SASL_PW
    monkeypatch.setenv("DG_TEST_KAFKA_PW", "rotated")
    assert conn.client_kwargs()["sasl_plain_password"] == "rotated"  # read each time
    for text in (repr(conn), str(conn), conn.model_dump_json(), str(conn.public())):
        assert "rotated" not in text
    assert conn.public()["sasl_password_env"] == "DG_TEST_KAFKA_PW"


def test_named_password_not_set_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DG_TEST_KAFKA_PW", raising=False)
    conn = _named()
    with pytest.raises(MissingSecret, match="sasl_password_env: environment variable "):
        conn.client_kwargs()
    with pytest.raises(MissingSecret, match="DG_TEST_KAFKA_PW is not set"):
        conn.check_secrets()
    monkeypatch.setenv("DG_TEST_KAFKA_PW", "")
    with pytest.raises(MissingSecret):  # empty is not a password
        conn.check_secrets()
    conn.check_secrets({"DG_TEST_KAFKA_PW": "x"})


def test_key_password_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DG_TEST_KEY_PW", SSL_PW)
    conn = KafkaConnection(
        bootstrap_servers=BS,
        security_protocol="SSL",
        ssl_certfile="c.pem",
        ssl_keyfile="k.pem",
        ssl_password_env="DG_TEST_KEY_PW",
    )
    assert conn.client_kwargs()["ssl_password"] == SSL_PW
    assert SSL_PW not in repr(conn)


def test_a_literal_password_cannot_be_pickled_a_named_one_can(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    literal = KafkaConnection(bootstrap_servers=BS, **SASL)
    with pytest.raises(TypeError, match="sasl_password_env"):
        pickle.dumps(literal)
    key = KafkaConnection(
        bootstrap_servers=BS,
        security_protocol="SSL",
        ssl_certfile="c.pem",
        ssl_password=SSL_PW,
    )
    with pytest.raises(TypeError, match="ssl_password_env"):
        pickle.dumps(key)
    named = _named()
    raw = pickle.dumps(named)
    assert pickle.loads(raw) == named
    monkeypatch.setenv("DG_TEST_KAFKA_PW", SASL_PW)
    assert SASL_PW.encode() not in raw


def test_ray_refuses_to_store_a_literal_password() -> None:
    """What Ray does with an actor argument (cloudpickle) meets the same refusal."""
    from ray import cloudpickle

    with pytest.raises(TypeError, match="cannot leave its process"):
        cloudpickle.dumps({"kafka": KafkaConnection(bootstrap_servers=BS, **SASL)})
    assert b"DG_TEST_KAFKA_PW" in cloudpickle.dumps({"kafka": _named()})

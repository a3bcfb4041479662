"""How to reach a Kafka cluster: addresses, TLS and SASL, as one validated, frozen object.

`KafkaConnection` is what every Kafka client in dgstream is built from: the worker, the
controller, the client and every `dgstream` command (a topology's `kafka` section is one).
A password is given by the NAME of the environment variable that holds it
(`sasl_password_env`, `ssl_password_env`) and read from the environment of the process
that connects, on its own node, when `client_kwargs()` builds a client (a `SecretStr`
until then). So the object itself holds no secret and may travel: to Ray actors, into
logs and status. A literal `sasl_password` / `ssl_password` (a `SecretStr`, for programs)
stays in its process: pickling such an object (Ray's actor arguments) is refused.
`repr`, `str` and `model_dump_json` show secrets masked.

Rules checked across fields (each error is reported on the field at fault):

* `SASL_PLAINTEXT` / `SASL_SSL` need `sasl_mechanism`, `sasl_username` and a password
  (`sasl_password_env` or `sasl_password`, not both); other protocols refuse them
  (credentials that would silently not be used).
* `ssl_cafile`, `ssl_certfile`, `ssl_keyfile` and the key's password need `SSL` or
  `SASL_SSL`; `ssl_keyfile` needs `ssl_certfile`; a key password needs a certificate or key.

Note: SASL `PLAIN` over `SASL_PLAINTEXT` sends the password unencrypted; prefer `SASL_SSL`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
)

__all__ = ["KafkaConnection", "MissingSecret", "SaslMechanism", "SecurityProtocol"]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# kafka-python client arguments that carry a secret (what `client_kwargs` unwraps).
_SECRET_KWARGS = frozenset({"sasl_plain_password", "ssl_password"})

# The longest pause between two connection attempts to a broker: the Java clients' default
# (reconnect.backoff.max.ms). kafka-python's own, 30 s, kept the workers of the fault
# matrix's broker restart (bench/fault_matrix.py) away for up to 30 s after the broker was
# back; every client built from a KafkaConnection gets this one.
RECONNECT_BACKOFF_MAX_MS = 1000


class _MaskClientConfig(logging.Filter):
    """kafka-python's KafkaAdminClient logs its whole configuration at DEBUG, passwords
    included: mask them in that record, whoever configured logging at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # logging keeps a lone mapping argument as `args` itself.
        if isinstance(args, Mapping) and _SECRET_KWARGS & set(args):
            record.args = {k: "**********" if k in _SECRET_KWARGS else v for k, v in args.items()}
        return True


logging.getLogger("kafka.admin.client").addFilter(_MaskClientConfig())


class MissingSecret(ValueError):
    """A password's environment variable is not set where the client is built. The
    message names the field and the variable (never a value)."""


class SecurityProtocol(StrEnum):
    PLAINTEXT = "PLAINTEXT"
    SSL = "SSL"
    SASL_PLAINTEXT = "SASL_PLAINTEXT"
    SASL_SSL = "SASL_SSL"

    @property
    def uses_sasl(self) -> bool:
        return self in (SecurityProtocol.SASL_PLAINTEXT, SecurityProtocol.SASL_SSL)

    @property
    def uses_ssl(self) -> bool:
        return self in (SecurityProtocol.SSL, SecurityProtocol.SASL_SSL)


class SaslMechanism(StrEnum):
    PLAIN = "PLAIN"
    SCRAM_SHA_256 = "SCRAM-SHA-256"
    SCRAM_SHA_512 = "SCRAM-SHA-512"


_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)


def _check_server(entry: str) -> str:
    """`host:port` with a hostname, an IPv4 address or a bracketed IPv6 address."""
    s = entry.strip()
    if s.startswith("["):
        host, sep, port = s[1:].partition("]:")
        if not sep:
            raise ValueError(f"{entry!r} is not [ipv6]:port")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{entry!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port = s.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{entry!r} is not host:port")
        if ":" in host:
            raise ValueError(f"{entry!r}: write an IPv6 address as [address]:port")
        if not _HOSTNAME.match(host):
            raise ValueError(f"{entry!r}: {host!r} is not a valid host name or address")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{entry!r}: port must be a number from 1 to 65535")
    return s


def _protocol(info: ValidationInfo) -> SecurityProtocol | None:
    """The already-validated protocol (None when it failed its own validation)."""
    p = info.data.get("security_protocol")
    return p if isinstance(p, SecurityProtocol) else None


class KafkaConnection(BaseModel):
    """Connection settings for any Kafka cluster (the local test broker or a real one)."""

    # hide_input_in_errors: a rejected password must not reach a log through the error text.
    model_config = ConfigDict(
        frozen=True, extra="forbid", str_strip_whitespace=True, hide_input_in_errors=True
    )

    # host:port entries (a list, or one comma-separated string)
    bootstrap_servers: list[str] = Field(min_length=1)
    # Field order matters: the validators below read earlier fields through `info.data`.

    # PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL
    security_protocol: SecurityProtocol = SecurityProtocol.PLAINTEXT
    # PEM file of the CA(s) that signed the brokers' certificates (default: the system's).
    # A path on every node that connects (mount it on every Ray pod).
    ssl_cafile: str | None = Field(default=None, validate_default=True)
    # A client certificate (PEM), for brokers that ask for one (mutual TLS).
    ssl_certfile: str | None = Field(default=None, validate_default=True)
    ssl_keyfile: str | None = Field(default=None, validate_default=True)
    # Name of the environment variable holding the password of ssl_keyfile.
    ssl_password_env: str | None = Field(default=None, validate_default=True)
    # The key's password itself: programs only (a topology file refuses it).
    ssl_password: SecretStr | None = Field(default=None, validate_default=True)
    # Check that the broker's certificate names the host connected to.
    ssl_check_hostname: bool = True
    # PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
    sasl_mechanism: SaslMechanism | None = Field(default=None, validate_default=True)
    sasl_username: str | None = Field(default=None, validate_default=True)
    # Name of the environment variable holding the SASL password, read on each node.
    sasl_password_env: str | None = Field(default=None, validate_default=True)
    # The SASL password itself: programs only (a topology file refuses it).
    sasl_password: SecretStr | None = Field(default=None, validate_default=True)
    client_id: str = Field(default="dgstream", min_length=1, max_length=249)

    # ---------------------------------------------------------------- single fields

    @field_validator("bootstrap_servers", mode="before")
    @classmethod
    def _split_servers(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [s for s in (p.strip() for p in v.split(",")) if s]
        if isinstance(v, tuple):
            return list(v)
        return v

    @field_validator("bootstrap_servers")
    @classmethod
    def _servers(cls, v: list[str]) -> list[str]:
        return [_check_server(s) for s in v]

    @field_validator("security_protocol", mode="before")
    @classmethod
    def _protocol_name(cls, v: Any) -> Any:
        return v.strip().upper().replace("-", "_") if isinstance(v, str) else v

    @field_validator("sasl_mechanism", mode="before")
    @classmethod
    def _mechanism_name(cls, v: Any) -> Any:
        return v.strip().upper().replace("_", "-") if isinstance(v, str) else v

    # ---------------------------------------------------------------- across fields

    @field_validator("ssl_cafile", "ssl_certfile", "ssl_keyfile")
    @classmethod
    def _ssl_files(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return None
        if not v:
            raise ValueError(f"{info.field_name} must not be empty")
        proto = _protocol(info)
        if proto is not None and not proto.uses_ssl:
            raise ValueError(
                f"{info.field_name} is only used with SSL or SASL_SSL, not {proto.value}"
            )
        if info.field_name == "ssl_keyfile" and info.data.get("ssl_certfile") is None:
            raise ValueError("ssl_keyfile needs ssl_certfile (the certificate of this key)")
        return v

    @field_validator("ssl_password_env", "sasl_password_env")
    @classmethod
    def _env_name(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and not _ENV_NAME.match(v):
            raise ValueError(f"{info.field_name} must name an environment variable ([A-Za-z_0-9])")
        return v

    @field_validator("ssl_password_env", "ssl_password")
    @classmethod
    def _ssl_password(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return None
        if info.field_name == "ssl_password" and info.data.get("ssl_password_env") is not None:
            raise ValueError("set ssl_password_env or ssl_password, not both")
        proto = _protocol(info)
        if proto is not None and not proto.uses_ssl:
            raise ValueError(
                f"{info.field_name} is only used with SSL or SASL_SSL, not {proto.value}"
            )
        if info.data.get("ssl_certfile") is None and info.data.get("ssl_keyfile") is None:
            raise ValueError(
                f"{info.field_name} needs ssl_certfile or ssl_keyfile (it unlocks the private key)"
            )
        return v

    @field_validator("sasl_mechanism", "sasl_username", "sasl_password_env", "sasl_password")
    @classmethod
    def _sasl(cls, v: Any, info: ValidationInfo) -> Any:
        proto = _protocol(info)
        if proto is None:
            return v
        empty = (
            v is None
            or (isinstance(v, str) and not v)
            or (isinstance(v, SecretStr) and not v.get_secret_value())
        )
        # The password may be named instead (sasl_password_env, validated just before).
        optional = info.field_name == "sasl_password_env" or (
            info.field_name == "sasl_password" and info.data.get("sasl_password_env") is not None
        )
        if info.field_name == "sasl_password" and optional and v is not None:
            raise ValueError("set sasl_password_env or sasl_password, not both")
        if proto.uses_sasl and empty and not optional:
            suffix = " (or sasl_password_env)" if info.field_name == "sasl_password" else ""
            raise ValueError(
                f"{info.field_name} is required when security_protocol is {proto.value}{suffix}"
            )
        if not proto.uses_sasl and v is not None:
            raise ValueError(
                f"{info.field_name} is only used with SASL_PLAINTEXT or SASL_SSL, "
                f"not {proto.value} "
                "(credentials would be ignored)"
            )
        return v

    # ---------------------------------------------------------------- use

    @property
    def bootstrap(self) -> str:
        """The servers as one comma-separated string."""
        return ",".join(self.bootstrap_servers)

    def secret(
        self,
        name: Literal["sasl_password", "ssl_password"],
        environ: Mapping[str, str] | None = None,
    ) -> SecretStr | None:
        """The password itself: the literal one, else the named variable of `environ`
        (default: this process's environment). Raises `MissingSecret` when it names a
        variable that is not set (or empty)."""
        literal: SecretStr | None = getattr(self, name)
        var: str | None = getattr(self, f"{name}_env")
        if literal is not None or var is None:
            return literal
        value = (os.environ if environ is None else environ).get(var)
        if not value:
            raise MissingSecret(
                f"{name}_env: environment variable {var} is not set on {socket.gethostname()} "
                "(each process that connects reads it from its own environment)"
            )
        return SecretStr(value)

    def check_secrets(self, environ: Mapping[str, str] | None = None) -> None:
        """Raise `MissingSecret` when a named password is not in `environ` (or this
        process's environment)."""
        if self.security_protocol.uses_sasl:
            self.secret("sasl_password", environ)
        if self.security_protocol.uses_ssl:
            self.secret("ssl_password", environ)

    def public(self) -> dict[str, Any]:
        """The settings without literal secrets (status pages, logs): names only."""
        return self.model_dump(mode="json", exclude={"sasl_password", "ssl_password"})

    def __getstate__(self) -> dict[Any, Any]:
        # Ray keeps actor arguments in its control store (and restarts actors from them):
        # a literal password must not get there. Named passwords travel as names.
        held = [n for n in ("sasl_password", "ssl_password") if getattr(self, n) is not None]
        if held:
            raise TypeError(
                f"a KafkaConnection holding a literal {held[0]} cannot leave its process "
                f"(pickled, e.g. as a Ray actor argument): name the environment variable "
                f"that holds it instead ({held[0]}_env)"
            )
        state: dict[Any, Any] = super().__getstate__()
        return state

    def client_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for kafka-python clients; the only place secrets are unwrapped
        (named ones are read from this process's environment here: `MissingSecret`).
        Every client dgstream builds comes through here, so kafka-python's workarounds that
        act process-wide are put in place here first (`workers.kafka.quirks.install`)."""
        from dgstream.workers.kafka.quirks import install

        install()
        kw: dict[str, Any] = {
            "bootstrap_servers": list(self.bootstrap_servers),
            "security_protocol": self.security_protocol.value,
            "client_id": self.client_id,
            "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
        }
        if self.security_protocol.uses_ssl:
            kw["ssl_check_hostname"] = self.ssl_check_hostname
            for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                value = getattr(self, name)
                if value is not None:
                    kw[name] = value
            key_password = self.secret("ssl_password")
            if key_password is not None:
                kw["ssl_password"] = key_password.get_secret_value()
        if self.security_protocol.uses_sasl:
            password = self.secret("sasl_password")
            assert self.sasl_mechanism is not None and password is not None
            kw["sasl_mechanism"] = self.sasl_mechanism.value
            # kafka-python names the user/password "plain" for both PLAIN and SCRAM.
            kw["sasl_plain_username"] = self.sasl_username
            kw["sasl_plain_password"] = password.get_secret_value()
        kw.update(overrides)
        return kw

    @classmethod
    def from_env(
        cls,
        prefix: str = "DGSTREAM_KAFKA_",
        environ: Mapping[str, str] | None = None,
        **defaults: Any,
    ) -> KafkaConnection:
        """Read `<prefix><FIELD>` variables, e.g. DGSTREAM_KAFKA_BOOTSTRAP_SERVERS (comma
        separated) and DGSTREAM_KAFKA_SASL_USERNAME.

        A password variable (`<prefix>SASL_PASSWORD`, `<prefix>SSL_PASSWORD`) is taken by
        name: the result's `sasl_password_env` is "<prefix>SASL_PASSWORD" (or what
        `<prefix>SASL_PASSWORD_ENV` names). Secrets may also come from files (mounted
        secrets): `<prefix>SASL_PASSWORD_FILE`, `<prefix>SSL_PASSWORD_FILE`, read here.
        Unknown variables with the prefix are ignored; `defaults` fill fields the
        environment does not set.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = dict(defaults)
        secrets = ("sasl_password", "ssl_password")
        for name in cls.model_fields:
            raw = env.get(prefix + name.upper())
            if raw is None or raw.strip() == "":
                continue
            if name in secrets:  # by name: read where a client is built
                values.setdefault(f"{name}_env", prefix + name.upper())
                values.pop(name, None)
            else:
                values[name] = raw
        for secret in secrets:
            path = env.get(f"{prefix}{secret.upper()}_FILE")
            if path and f"{secret}_env" not in values:
                values[secret] = Path(path).read_text().rstrip("\r\n")
        return cls.model_validate(values)

"""How to reach a Kafka cluster: addresses, TLS and SASL, as one validated, frozen object.

`KafkaConnection` is what every Kafka client in dgstream is built from. Secrets are
`SecretStr` and leave the object only through `client_kwargs()` (the keyword arguments of
kafka-python's `KafkaProducer`, `KafkaConsumer` and `KafkaAdminClient`); `repr`, `str` and
`model_dump_json` show them masked.

Rules checked across fields (each error is reported on the field at fault):

* `SASL_PLAINTEXT` / `SASL_SSL` need `sasl_mechanism`, `sasl_username` and `sasl_password`;
  other protocols refuse them (credentials that would silently not be used).
* `ssl_cafile`, `ssl_certfile`, `ssl_keyfile` and `ssl_password` need `SSL` or `SASL_SSL`;
  `ssl_keyfile` needs `ssl_certfile`; `ssl_password` needs a certificate or key file.

Note: SASL `PLAIN` over `SASL_PLAINTEXT` sends the password unencrypted; prefer `SASL_SSL`.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
)

__all__ = ["KafkaConnection", "SaslMechanism", "SecurityProtocol"]


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

    bootstrap_servers: list[str] = Field(min_length=1)
    # Field order matters: the validators below read earlier fields through `info.data`.
    security_protocol: SecurityProtocol = SecurityProtocol.PLAINTEXT
    ssl_cafile: str | None = Field(default=None, validate_default=True)
    ssl_certfile: str | None = Field(default=None, validate_default=True)
    ssl_keyfile: str | None = Field(default=None, validate_default=True)
    ssl_password: SecretStr | None = Field(default=None, validate_default=True)
    ssl_check_hostname: bool = True
    sasl_mechanism: SaslMechanism | None = Field(default=None, validate_default=True)
    sasl_username: str | None = Field(default=None, validate_default=True)
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

    @field_validator("ssl_password")
    @classmethod
    def _ssl_password(cls, v: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if v is None:
            return None
        proto = _protocol(info)
        if proto is not None and not proto.uses_ssl:
            raise ValueError(
                f"{info.field_name} is only used with SSL or SASL_SSL, not {proto.value}"
            )
        if info.data.get("ssl_certfile") is None and info.data.get("ssl_keyfile") is None:
            raise ValueError(
                "ssl_password needs ssl_certfile or ssl_keyfile (it unlocks the private key)"
            )
        return v

    @field_validator("sasl_mechanism", "sasl_username", "sasl_password")
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
        if proto.uses_sasl and empty:
            raise ValueError(
                f"{info.field_name} is required when security_protocol is {proto.value}"
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

    def client_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for kafka-python clients; the only place secrets are unwrapped."""
        kw: dict[str, Any] = {
            "bootstrap_servers": list(self.bootstrap_servers),
            "security_protocol": self.security_protocol.value,
            "client_id": self.client_id,
        }
        if self.security_protocol.uses_ssl:
            kw["ssl_check_hostname"] = self.ssl_check_hostname
            for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                value = getattr(self, name)
                if value is not None:
                    kw[name] = value
            if self.ssl_password is not None:
                kw["ssl_password"] = self.ssl_password.get_secret_value()
        if self.security_protocol.uses_sasl:
            assert self.sasl_mechanism is not None and self.sasl_password is not None
            kw["sasl_mechanism"] = self.sasl_mechanism.value
            # kafka-python names the user/password "plain" for both PLAIN and SCRAM.
            kw["sasl_plain_username"] = self.sasl_username
            kw["sasl_plain_password"] = self.sasl_password.get_secret_value()
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
        separated) and DGSTREAM_KAFKA_SASL_PASSWORD.

        Secrets may also come from files (mounted secrets): `<prefix>SASL_PASSWORD_FILE`,
        `<prefix>SSL_PASSWORD_FILE`. Unknown variables with the prefix are ignored; `defaults`
        fill fields the environment does not set.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = dict(defaults)
        for name in cls.model_fields:
            raw = env.get(prefix + name.upper())
            if raw is not None and raw.strip() != "":
                values[name] = raw
        for secret in ("sasl_password", "ssl_password"):
            path = env.get(f"{prefix}{secret.upper()}_FILE")
            if path and secret not in values:
                values[secret] = Path(path).read_text().rstrip("\r\n")
        return cls.model_validate(values)

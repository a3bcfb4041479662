"""A one-node broker with TLS and SCRAM-SHA-512 listeners on loopback, for the secure tests."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from dgstream.infra.kafka.broker.lifecycle import start_nodes
from dgstream.infra.kafka.broker.state import BrokerError, BrokerInfo, resolve_home, write_state

# The SCRAM mechanism of the secure test broker: the strongest Kafka offers.
SCRAM_MECHANISM = "SCRAM-SHA-512"


# What StorageTool's `--add-scram 'SCRAM-SHA-512=[name=...,password=...]'` parses safely
# (no quoting is needed for these characters; secrets.token_urlsafe() stays within them).
_SCRAM_SAFE = re.compile(r"^[A-Za-z0-9._~-]{1,128}$")


def start_secure(
    home: str | os.PathLike[str] | None = None,
    *,
    users: Mapping[str, str],
    lib_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 120.0,
) -> BrokerInfo:
    """One node, as `start(port=0)`, with two more listeners on 127.0.0.1 for clients:
    `SASL_SSL` (TLS, then SCRAM-SHA-512 for `users`, name -> password, stored at format
    time) and `SSL` (TLS only). Certificates come from keytool (`infra.kafka.tls`) in
    `<home>/tls`; `info.extra` holds `ca_file` and both listeners' bootstrap servers
    (`info.listener_bootstrap("SASL_SSL")`). The PLAINTEXT listener stays for the
    broker's own use (replication, the readiness probe, `status`). No password is kept in
    the state file. The storage is always formatted afresh (the users are stored then)."""
    from dgstream.infra.kafka.tls import TlsError, make_certificates

    for name, password in users.items():
        if not _SCRAM_SAFE.match(name) or not _SCRAM_SAFE.match(password):
            raise ValueError(f"SCRAM user {name!r}: names and passwords must be [A-Za-z0-9._~-]+")
    h = resolve_home(home)
    try:
        tls = make_certificates(h / "tls")
    except TlsError as exc:
        raise BrokerError(str(exc)) from exc
    pw = tls.store_password
    overrides = {
        "sasl.enabled.mechanisms": SCRAM_MECHANISM,
        f"listener.name.sasl_ssl.{SCRAM_MECHANISM.lower()}.sasl.jaas.config": (
            "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        ),
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": str(tls.keystore),
        "ssl.keystore.password": pw,
        "ssl.key.password": pw,
        "ssl.truststore.type": "PKCS12",
        "ssl.truststore.location": str(tls.truststore),
        "ssl.truststore.password": pw,
        "ssl.client.auth": "none",
    }
    scram = [
        arg
        for name, password in users.items()
        for arg in ("--add-scram", f"{SCRAM_MECHANISM}=[name={name},password={password}]")
    ]
    try:
        info = start_nodes(
            h,
            lib_dir=lib_dir,
            timeout_s=timeout_s,
            overrides=overrides,
            extra_listeners=("SASL_SSL", "SSL"),
            format_args=scram,
        )
    except BrokerError as exc:  # a storage tool error may quote its arguments
        text = str(exc)
        for password in users.values():
            text = text.replace(password, "**********")
        raise BrokerError(text) from None
    info.extra.update(
        ca_file=str(tls.ca_pem),
        sasl_ssl_bootstrap=info.listener_bootstrap("SASL_SSL"),
        ssl_bootstrap=info.listener_bootstrap("SSL"),
    )
    write_state(info)
    return info

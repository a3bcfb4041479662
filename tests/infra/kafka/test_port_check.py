"""The broker's port check binds as Kafka does (SO_REUSEADDR): a port held only by
TIME-WAIT sockets, as one is for a minute after a broker on it stopped, is free for it.
(The check once bound without SO_REUSEADDR and refused such a port, while Kafka's own bind
would have worked: a probe restarting a broker seconds after another stopped.)"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dgstream.infra.kafka.broker.config import port_free


def time_wait_port() -> int:
    """A loopback port whose only socket is in TIME-WAIT, as a stopped broker leaves it: a
    connection closed first by the listening side (the side that closes first keeps
    TIME-WAIT), the listener gone. The listener sets SO_REUSEADDR, as the JVM's does."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = int(listener.getsockname()[1])
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server side closes first: its socket goes to TIME-WAIT
    listener.close()
    client.recv(1)  # sees the FIN
    client.close()
    return port


def _plain_bind_fails(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def time_wait_held(port: int) -> bool:
    text = Path("/proc/net/tcp").read_text()
    hexport = f":{port:04X} "
    # state 06 is TIME_WAIT
    return any(hexport in line and line.split()[3] == "06" for line in text.splitlines()[1:])


@pytest.mark.unit
def test_a_port_in_time_wait_is_free_for_the_broker() -> None:
    port = time_wait_port()
    assert time_wait_held(port) and _plain_bind_fails(port), "the premise: TIME-WAIT holds it"
    assert port_free(port)


@pytest.mark.unit
def test_a_listening_port_is_not_free() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert not port_free(int(s.getsockname()[1]))

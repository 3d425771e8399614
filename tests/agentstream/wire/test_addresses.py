"""Addresses handed from one process to another (agentstream.wire.addresses). Runs in milliseconds."""

import socket

import pytest

from agentstream.wire.addresses import advertised_address


@pytest.mark.parametrize(
    "bind, expected",
    [
        ("tcp://127.0.0.1:5556", "tcp://127.0.0.1:5556"),  # a named interface is reached as named
        ("tcp://10.0.0.9:41000", "tcp://10.0.0.9:41000"),
        ("tcp://[::1]:5556", "tcp://[::1]:5556"),  # IPv6 keeps its brackets
        ("tcp://0.0.0.0:5556", f"tcp://{socket.getfqdn()}:5556"),  # a wildcard: this machine's name
        ("tcp://127.0.0.1:*", ""),
        ("tcp://127.0.0.1:0", ""),  # a port the OS picks is known only to the socket
        ("/tmp/run/weights", ""),
        ("", ""),  # no TCP address (a learner test's file publisher, or none)
    ],
)
def test_the_address_of_a_bound_socket_is_what_others_connect_to(bind: str, expected: str) -> None:
    """What learner rank 0 tells the broker of the publisher it binds (VersionUpdate.weights)."""
    assert advertised_address(bind) == expected

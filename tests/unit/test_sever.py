"""pd_transfer.transfer.sever: which of this process's TCP connections a stalled peer's host gets shut down."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator

import pytest

from pd_transfer.transfer import sever

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="severing reads /proc/self (Linux only)")


#: Loopback addresses of this module's own (Linux routes all of 127/8 to lo): severing them must not touch the other
#: connections of the test process (to 127.0.0.1: servers other tests left running, say).
SERVER = f"127.{os.getpid() % 200 + 20}.33.1"
CLIENT = f"127.{os.getpid() % 200 + 20}.33.2"


def pair(listener: socket.socket, source: str = SERVER) -> tuple[socket.socket, socket.socket]:
    """A connection to ``listener`` from ``source`` (a loopback address): (our connecting end, the accepted end)."""
    client = socket.create_connection(listener.getsockname(), timeout=5.0, source_address=(source, 0))
    accepted, _ = listener.accept()
    return client, accepted


def is_shut(sock: socket.socket) -> bool:
    """Whether ``sock`` itself was shut down for writing (a send fails with a broken pipe)."""
    try:
        sock.send(b"x")
    except BrokenPipeError:
        return True
    return False


@pytest.fixture
def listeners() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A listener noted as UCX's (made inside ``noting_listeners``) and another server's, at :data:`SERVER`."""
    with sever.noting_listeners():
        ucx = socket.create_server((SERVER, 0))
    other = socket.create_server((SERVER, 0))
    with ucx, other:
        yield ucx, other


def test_connections_accepted_from_the_host_on_ucx_listeners_are_shut_down_not_another_servers(
    listeners: tuple[socket.socket, socket.socket],
) -> None:
    ucx, other = listeners
    # from CLIENT: the accepted ends' peer is the severed address, the connecting ends' peer is SERVER
    to_ucx, from_ucx = pair(ucx, CLIENT)
    to_other, from_other = pair(other, CLIENT)
    with to_ucx, from_ucx, to_other, from_other:
        assert sever.sever_addresses({CLIENT}) == 1
        assert is_shut(from_ucx)
        assert not is_shut(from_other) and not is_shut(to_ucx) and not is_shut(to_other)


def test_connections_opened_to_the_host_are_shut_down(listeners: tuple[socket.socket, socket.socket]) -> None:
    ucx, other = listeners
    to_ucx, from_ucx = pair(ucx, CLIENT)
    to_other, from_other = pair(other, CLIENT)
    with to_ucx, from_ucx, to_other, from_other:
        assert sever.sever_addresses({SERVER}) == 2  # the ends we opened (the listeners are left)
        assert is_shut(to_ucx) and is_shut(to_other)
        assert not is_shut(from_ucx) and not is_shut(from_other)
        another, accepted = pair(ucx, CLIENT)  # the listener still listens
        with another, accepted:
            assert not is_shut(another)


def test_another_host_and_this_hosts_own_addresses_are_left_alone(
    listeners: tuple[socket.socket, socket.socket],
) -> None:
    ucx, _ = listeners
    to_ucx, from_ucx = pair(ucx)
    with to_ucx, from_ucx:
        assert sever.sever_addresses({"192.0.2.1"}) == 0  # TEST-NET-1: nobody here
        assert sever.sever_host(SERVER) == 0  # loopback: never
        assert sever.sever_host(socket.gethostname()) == 0  # this host: never
        assert sever.sever_host("no-such-host.invalid") == 0
        assert sever.sever_addresses(set()) == 0
        assert not is_shut(to_ucx) and not is_shut(from_ucx)


def test_a_noted_peer_is_severed_by_its_host_and_forgotten() -> None:
    sever.note_peer("prefill-agent", "127.0.0.1")
    try:
        assert sever.sever_peer("prefill-agent") == 0  # its host is this one: nothing
    finally:
        sever.forget_peer("prefill-agent")
    assert sever.sever_peer("prefill-agent") == 0


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("0100007F", "127.0.0.1"),
        ("0201E70A", "10.231.1.2"),
        ("0000000000000000FFFF00000100007F", "127.0.0.1"),  # IPv4-mapped IPv6
        ("00000000000000000000000001000000", "::1"),
    ],
)
def test_proc_net_tcp_addresses_read_as_one_spelling(text: str, address: str) -> None:
    if sys.byteorder != "little":
        pytest.skip("the table's words are in host order; these are a little-endian host's")
    assert sever.proc_net_address(text) == address

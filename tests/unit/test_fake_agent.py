"""The fake agent (tests/support/fake_agent.py) keeps the contract the connector relies on: reads and writes copy
exactly the rows asked for, then notify the peer; rows outside registered memory (when prepared, or deregistered by
the time they are read), rows of a peer not added, rows of different lengths and a closed peer are refused as
TransferAgent refuses them. That it is an ``Agent`` (the interface the connector uses) mypy checks; that the connector
makes its agents only through the factory it is handed (no module outside pd_transfer/transfer makes a
``TransferAgent``, no test swaps a constructor by its dotted name) this module does."""

from __future__ import annotations

import ast
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fake_agent import FakeAgent, FakeFabric

from pd_transfer.transfer import PeerDisconnected, TransferError, UnknownPeer

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pd_transfer"


def _rows(memory: np.ndarray, rows: list[tuple[int, int]]) -> np.ndarray:
    """Descriptor rows (address, length, 0) of ``memory``'s bytes ``[offset, offset + length)``."""
    base = memory.ctypes.data
    return np.array([[base + offset, length, 0] for offset, length in rows], dtype=np.uint64)


def _span(memory: np.ndarray) -> tuple[int, int]:
    return memory.ctypes.data, memory.ctypes.data + memory.nbytes


class Inbox:
    """A notification handler that keeps what arrived, and on which thread."""

    def __init__(self) -> None:
        self.got: list[tuple[str, bytes, str]] = []
        self.arrived = threading.Event()

    def __call__(self, peer: str, payload: bytes) -> None:
        self.got.append((peer, payload, threading.current_thread().name))
        self.arrived.set()


@pytest.fixture
def pair() -> Iterator[tuple[FakeAgent, FakeAgent, Inbox]]:
    """A reader and an owner (whose notifications land in the inbox) on a fabric of their own."""
    fabric, inbox = FakeFabric(), Inbox()
    with (
        FakeAgent("reader", fabric=fabric) as reader,
        FakeAgent("owner", on_notification=inbox, fabric=fabric) as owner,
    ):
        yield reader, owner, inbox


def test_a_read_copies_the_rows_asked_for_then_notifies(pair: tuple[FakeAgent, FakeAgent, Inbox]) -> None:
    reader, owner, inbox = pair
    theirs = np.arange(256, dtype=np.uint8)
    ours = np.zeros(256, dtype=np.uint8)
    owner.register_spans([_span(theirs)])
    reader.register_spans([_span(ours)])
    peer = reader.add_peer(owner.metadata)
    assert peer == "owner" and reader.has_peer("owner")
    remote = reader.prepare_remote(peer, _rows(theirs, [(0, 16), (64, 16), (200, 8)]))
    local = reader.prepare_local(_rows(ours, [(100, 16), (0, 8), (32, 16)]))
    stats = reader.read(local, np.array([0, 2, 1]), remote, np.array([0, 1, 2]), notification=b"done")
    assert (stats.bytes, stats.descriptors) == (16 + 16 + 8, 3)
    assert ours[100:116].tolist() == list(range(16)) and ours[32:48].tolist() == list(range(64, 80))
    assert ours[0:8].tolist() == list(range(200, 208)) and not ours[8:32].any() and not ours[116:].any()
    assert inbox.arrived.wait(5.0)
    assert inbox.got == [("reader", b"done", "owner-fake-poller")]  # on the owner's delivery thread
    assert owner.notifications_received == 1


def test_a_write_lands_in_the_peer_then_notifies(pair: tuple[FakeAgent, FakeAgent, Inbox]) -> None:
    writer, owner, inbox = pair
    source = np.full(32, 7, dtype=np.uint8)
    target = np.zeros(64, dtype=np.uint8)
    writer.register_spans([_span(source)])
    owner.register_spans([_span(target)])
    remote = writer.prepare_remote(writer.add_peer(owner.metadata), _rows(target, [(16, 32)]))
    local = writer.prepare_local(_rows(source, [(0, 32)]))
    writer.write(local, np.array([0]), remote, np.array([0]), notification=b"written")
    assert target[16:48].tolist() == [7] * 32 and not target[:16].any() and not target[48:].any()
    assert inbox.arrived.wait(5.0) and inbox.got[0][:2] == ("reader", b"written")


def test_rows_outside_registered_memory_are_refused(pair: tuple[FakeAgent, FakeAgent, Inbox]) -> None:
    reader, owner, _ = pair
    memory = np.zeros(128, dtype=np.uint8)
    owner.register_spans([(memory.ctypes.data, memory.ctypes.data + 64)])  # the first half only
    reader.register_spans([_span(memory)])
    peer = reader.add_peer(owner.metadata)
    with pytest.raises(TransferError, match="1 rows lie outside registered memory"):
        reader.prepare_remote(peer, _rows(memory, [(0, 16), (60, 8)]))  # the second row crosses the end
    with pytest.raises(TransferError, match="local memory"):
        reader.prepare_local(np.array([[memory.ctypes.data + 128, 8, 0]], dtype=np.uint64))
    with pytest.raises(ValueError, match="N x 3"):
        reader.prepare_local(np.zeros((0, 3), dtype=np.uint64))


def test_a_peer_must_be_added_and_its_rows_match_ours(pair: tuple[FakeAgent, FakeAgent, Inbox]) -> None:
    reader, owner, _ = pair
    memory = np.zeros(64, dtype=np.uint8)
    owner.register_spans([_span(memory)])
    reader.register_spans([_span(memory)])
    with pytest.raises(UnknownPeer):
        reader.prepare_remote("owner", _rows(memory, [(0, 8)]))
    with pytest.raises(TransferError):
        reader.add_peer(b"not metadata")
    peer = reader.add_peer(owner.metadata)
    remote = reader.prepare_remote(peer, _rows(memory, [(0, 8)]))
    local = reader.prepare_local(_rows(memory, [(32, 16)]))
    with pytest.raises(TransferError, match="different lengths"):
        reader.read(local, np.array([0]), remote, np.array([0]))
    with pytest.raises(ValueError, match="1 local rows but 2 remote rows"):
        reader.read(local, np.array([0]), remote, np.array([0, 0]))
    reader.remove_peer(peer)
    assert remote.released and not reader.has_peer(peer)
    with pytest.raises(TransferError, match="released"):
        reader.read(local, np.array([0]), remote, np.array([0]))


@pytest.mark.parametrize("side", ["its", "our"])
def test_a_read_of_memory_deregistered_after_its_rows_were_prepared_is_refused(
    pair: tuple[FakeAgent, FakeAgent, Inbox], side: str
) -> None:
    reader, owner, _ = pair
    theirs = np.arange(64, dtype=np.uint8)
    ours = np.zeros(64, dtype=np.uint8)
    theirs_registration = owner.register_spans([_span(theirs)])
    ours_registration = reader.register_spans([_span(ours)])
    remote = reader.prepare_remote(reader.add_peer(owner.metadata), _rows(theirs, [(0, 16), (32, 16)]))
    local = reader.prepare_local(_rows(ours, [(0, 16), (16, 16)]))
    if side == "its":  # the owner freed its memory; our metadata of it is stale
        owner.deregister(theirs_registration)
    else:
        reader.deregister(ours_registration)
    with pytest.raises(TransferError, match=f"2 of 2 rows of {side} memory are no longer registered"):
        reader.read(local, np.array([0, 1]), remote, np.array([0, 1]))
    assert not ours.any()  # refused before a byte was copied


def test_connection_metadata_lets_a_peer_notify_but_not_read(pair: tuple[FakeAgent, FakeAgent, Inbox]) -> None:
    reader, owner, inbox = pair
    memory = np.zeros(64, dtype=np.uint8)
    owner.register_spans([_span(memory)])
    peer = reader.add_peer(owner.connection_metadata)
    with pytest.raises(TransferError, match="outside registered memory"):
        reader.prepare_remote(peer, _rows(memory, [(0, 8)]))
    reader.notify(peer, b"hello")
    assert inbox.arrived.wait(5.0) and inbox.got[0][:2] == ("reader", b"hello")


def test_a_closed_peer_is_disconnected(pair: tuple[FakeAgent, FakeAgent, Inbox]) -> None:
    reader, owner, _ = pair
    memory = np.zeros(64, dtype=np.uint8)
    owner.register_spans([_span(memory)])
    reader.register_spans([_span(memory)])
    peer = reader.add_peer(owner.metadata)
    remote = reader.prepare_remote(peer, _rows(memory, [(0, 8)]))
    local = reader.prepare_local(_rows(memory, [(32, 8)]))
    owner.close()
    with pytest.raises(PeerDisconnected, match="peer disconnected"):
        reader.read(local, np.array([0]), remote, np.array([0]))
    with pytest.raises(PeerDisconnected):
        reader.notify(peer, b"anyone?")


def test_poll_delivers_on_the_calling_thread_in_order() -> None:
    fabric, inbox = FakeFabric(), Inbox()
    with FakeAgent("a", fabric=fabric) as sender, FakeAgent("b", on_notification=inbox, fabric=fabric) as receiver:
        peer = sender.add_peer(receiver.connection_metadata)
        for index in range(50):
            sender.notify(peer, str(index).encode())
        deadline = time.monotonic() + 5.0
        while len(inbox.got) < 50 and time.monotonic() < deadline:
            receiver.poll()
        assert [payload for _, payload, _ in inbox.got] == [str(index).encode() for index in range(50)]
        assert receiver.notifications_received == 50


def test_one_name_per_fabric() -> None:
    fabric = FakeFabric()
    with FakeAgent("twice", fabric=fabric), pytest.raises(TransferError, match="up already"):
        FakeAgent("twice", fabric=fabric)
    with FakeAgent("twice", fabric=fabric):  # the first one left when it closed
        pass


def _calls_of(name: str, path: Path) -> list[int]:
    """The lines of ``path`` that call ``name(...)`` (or ``something.name(...)``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if called == name:
                lines.append(node.lineno)
    return lines


def test_agents_are_made_by_the_factory_handed_in() -> None:
    """Outside pd_transfer/transfer (whose ``NIXL_AGENTS`` is the default factory) no module makes a
    ``TransferAgent`` itself: each takes the ``agent_factory`` it is handed, which is how unit tests give the connector
    fake agents. The benchmarks' own bare agents (a raw NIXL yardstick, a transport probe) are not the connector's."""
    made = {
        f"{path.relative_to(REPO)}:{line}"
        for path in PACKAGE.rglob("*.py")
        if not path.is_relative_to(PACKAGE / "transfer") and not path.is_relative_to(PACKAGE / "bench")
        for line in _calls_of("TransferAgent", path)
    }
    assert not made


def test_no_test_patches_an_agent_constructor_by_its_name() -> None:
    """No test names an agent constructor as a string (``"pd_transfer.connector.decode.rank.TransferAgent"``, or
    ``setattr(module, "TransferAgent", ...)``): tests hand in a factory instead."""
    constructors = {"TransferAgent", "NIXL_AGENTS", "FakeAgent", "new_agent"}
    named = {
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in (REPO / "tests").rglob("*.py")
        if path != Path(__file__).resolve()  # this module names them to look for them
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.rsplit(".", 1)[-1] in constructors
    }
    assert not named

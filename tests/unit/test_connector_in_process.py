"""A request's life through the connector with prefill and decode engines in this process and fake agents
(tests/unit/conftest.py): the connector's own logic (plans across TP and block sizes, read indices, leases, the hold
window, confirmations, releases, push) end to end, each case in about a second.

The scenarios of tests/process/test_connector_lifecycle.py and test_hold_window.py run here as they are, against
this folder's fixtures (``prefills``, ``decode``, ``decode_fail``: the same engines, in this process); those modules
run them again over real NIXL with the prefill engines in a child process. Added here: a TP 2 decode, decodes of
larger blocks, push, and a prefill agent that is gone. Every received request is checked element by element against
the prefill's cache through each side's own layout (:func:`pd_transfer.sim.verify.received_correctly`), never
through the plan."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NoReturn

import pytest
from engine_specs import FINGERPRINT, decode_config, layouts
from in_process_prefill import InProcessPrefill
from test_connector_lifecycle import (  # noqa: F401 (collected here, run with this folder's fixtures)
    test_decode_abort_before_reading_releases_the_prefill,
    test_full_request_lifecycle,
    test_heartbeats_keep_a_queued_request_alive,
    test_heterogeneous_tp_prefill_2_to_decode_1,
    test_malformed_params_never_crash_and_the_next_request_succeeds,
    test_replicated_heads_the_unread_rank_is_released_too,
    test_stale_read_after_the_lease_is_refused_and_never_used,
)
from test_hold_window import (  # noqa: F401 (collected here, run with this folder's fixtures)
    test_a_read_ending_after_the_window_is_not_used,
    test_abort_after_the_window_frees_now_and_the_read_is_refused,
    test_abort_inside_the_window_waits_for_the_reader,
    test_params_state_the_window,
    test_read_inside_the_window_needs_no_confirmation,
    test_windowless_or_foreign_params_fall_back_to_confirming,
)

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.errors import LeaseNotConfirmed
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.settings import DEFAULTS, Settings
from pd_transfer.sim.engines import DecodeEngine, LocalPrefillEngines
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout
from pd_transfer.transfer import PeerDisconnected, TransferTimeout
from pd_transfer.transfer.agent_protocol import AgentFactory

pytestmark = pytest.mark.timeout(60)


def _freed(prefills: LocalPrefillEngines, engine_id: str, request_ids: list[str], ranks: int, status: str) -> None:
    """The prefill finished sending ``request_ids``, ended their leases as ``status`` and holds nothing."""
    sent = prefills.wait_sending(engine_id, request_ids, timeout_s=10)
    assert sent["finished_sending"] == sorted(request_ids), sent
    assert all(sent["status"][request_id] == [status] * ranks for request_id in request_ids), sent
    assert sent["held_blocks"] == [0] * ranks and sent["lent_blocks"] == 0, sent


def test_two_decode_ranks_read_one_prefill_rank_and_both_report(
    agent_factory: AgentFactory, prefills: LocalPrefillEngines
) -> None:
    with DecodeEngine(
        "d-tp2", layouts(FINGERPRINT, 2), 32, decode_config(), agent_factory=agent_factory, settings=DEFAULTS
    ) as decode:
        out = prefills.prefill("p1", "tp1-to-2", prompt_len=45)
        got = decode.receive("dec-tp1-to-2", 45, out["params"])
        assert got.ok, got
        expected = prefills.specs["p1"].caches()
        for cache in decode.caches:  # each rank its own two heads of the prefill's four
            assert received_correctly(cache, got.local_block_ids, expected, out["block_ids"], 45)
        _freed(prefills, "p1", ["tp1-to-2"], 1, "read")  # freed once both readers reported


@pytest.mark.parametrize("decode_block", [32, 64])
def test_a_decode_of_larger_blocks_reads_every_token(
    agent_factory: AgentFactory, prefills: LocalPrefillEngines, decode_block: int
) -> None:
    decode_layouts = layouts(FINGERPRINT, 1, decode_block)
    with DecodeEngine(
        f"d-block-{decode_block}", decode_layouts, 16, decode_config(), agent_factory=agent_factory, settings=DEFAULTS
    ) as decode:
        out = prefills.prefill("p1", f"blocks-{decode_block}", prompt_len=100)
        got = decode.receive(f"dec-blocks-{decode_block}", 100, out["params"])
        assert got.ok, got
        expected = prefills.specs["p1"].caches()
        assert received_correctly(decode.caches[0], got.local_block_ids, expected, out["block_ids"], 100)
        _freed(prefills, "p1", [f"blocks-{decode_block}"], 1, "read")


# ---------------------------------------------------------------------------------------------- one rank each
LAYOUT = KVCacheLayout(fingerprint=FINGERPRINT, tp_size=1, tp_rank=0, block_size=16)


@pytest.fixture
def prefill(agent_factory: AgentFactory) -> Iterator[InProcessPrefill]:
    made = InProcessPrefill(f"one-rank-{time.monotonic_ns()}", LAYOUT, 32, agent_factory)
    try:
        yield made
    finally:
        made.close()


def test_a_held_request_is_pushed_and_counts_as_read(agent_factory: AgentFactory, prefill: InProcessPrefill) -> None:
    small_pushed = Settings(push_min_bytes=0)  # these requests are small: push them all the same
    decode = DecodeRank(
        f"push-decode-{time.monotonic_ns()}",
        KVCache.allocate(LAYOUT, 32),
        # pushes are for reads over NIXL (a decode here would read the prefill in place)
        DecodeOptions(push="on", settings=small_pushed, transport="nixl"),
        agent_factory=agent_factory,
    )
    try:
        assert decode.push_ready(prefill.host, prefill.port, timeout_s=10)
        remote_ids, local_ids, tokens = [17, 3, 29, 8, 30], [5, 31, 0, 21, 22], 16 * 4 + 7
        prefill.rank.hold("pushed", remote_ids)
        stats = decode.pull_confirmed("pushed", prefill.host, prefill.port, remote_ids, local_ids, tokens)
        assert stats.pushed_peers == (prefill.rank.agent.name,) and stats.pushed_bytes == stats.bytes > 0
        assert received_correctly(decode.cache, local_ids, prefill.expected(), remote_ids, tokens)
        assert decode.confirmations.received == 0  # the write proved the lease: no LeaseConfirm
        # an unheld request is refused for push, read instead, and its confirmation tells the truth
        stats = decode.pull("never-held", prefill.host, prefill.port, [1, 2], [3, 4], 20)
        assert (
            stats.pushed_peers == ()
            and decode.ends["nixl"].pushes is not None
            and decode.ends["nixl"].pushes.read_instead == 1
        )
        with pytest.raises(LeaseNotConfirmed):
            decode.pull_confirmed(
                "never-held-2", prefill.host, prefill.port, [5], [6], 16, confirm_timeout_s=0.5
            )  # never held: no answer comes
    finally:
        decode.close()


def test_a_prefill_agent_gone_is_a_disconnected_peer(agent_factory: AgentFactory, prefill: InProcessPrefill) -> None:
    decode = DecodeRank(
        f"gone-decode-{time.monotonic_ns()}",
        KVCache.allocate(LAYOUT, 32),
        DecodeOptions(settings=DEFAULTS, push="off"),
        agent_factory=agent_factory,
    )
    try:
        stats = decode.pull("before", prefill.host, prefill.port, [1, 2], [3, 4], 20)
        assert received_correctly(decode.cache, [3, 4], prefill.expected(), [1, 2], 20) and stats.bytes > 0
        prefill.rank.agent.close()  # the side channel still answers, with the same (now dead) agent
        with pytest.raises(PeerDisconnected):
            decode.pull("after", prefill.host, prefill.port, [5], [6], 16)
    finally:
        decode.close()


def test_a_timed_out_pull_drops_the_engine_and_the_next_pull_handshakes_afresh(
    agent_factory: AgentFactory, prefill: InProcessPrefill, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that times out (its connection stalled behind a network cut) drops the engine, so that the next pull
    handshakes afresh and reads through a new link instead of the stalled one (tests/process/test_network_cut.py
    cuts a real wire)."""
    decode = DecodeRank(
        f"stalled-decode-{time.monotonic_ns()}",
        KVCache.allocate(LAYOUT, 32),
        DecodeOptions(settings=DEFAULTS, push="off", transport="nixl"),  # read by the agent, not in place
        agent_factory=agent_factory,
    )
    try:
        decode.pull("before", prefill.host, prefill.port, [1, 2], [3, 4], 20)
        handshakes = decode.client.handshakes_performed
        stalled = decode.remotes.get(prefill.host, prefill.port)
        assert stalled is not None

        def cut(*_args: object, **_kwargs: object) -> NoReturn:
            raise TransferTimeout("read not done after 0.1 s (the wire is cut)")

        with monkeypatch.context() as patch:
            patch.setattr(decode.agent, "read", cut)
            with pytest.raises(TransferTimeout):
                decode.pull("cut", prefill.host, prefill.port, [5], [6], 16)
        assert decode.remotes.get(prefill.host, prefill.port) is None  # dropped: no more reads on that link
        stats = decode.pull("after", prefill.host, prefill.port, [7, 8], [9, 10], 20)
        assert received_correctly(decode.cache, [9, 10], prefill.expected(), [7, 8], 20) and stats.bytes > 0
        assert decode.client.handshakes_performed == handshakes + 1
        fresh = decode.remotes.get(prefill.host, prefill.port)
        assert fresh is not None and fresh is not stalled
    finally:
        decode.close()


def test_a_reader_whose_endpoint_broke_is_added_afresh_and_confirmed(
    agent_factory: AgentFactory, prefill: InProcessPrefill, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill's endpoint to a decode broke (NIXL says the peer disconnected, though the decode is there: a cut
    network, or the decode made its side again): the confirmation is sent again through the peer added afresh, and
    the read is confirmed, this one and the next."""
    decode = DecodeRank(
        f"broken-ep-decode-{time.monotonic_ns()}",
        KVCache.allocate(LAYOUT, 32),
        DecodeOptions(settings=DEFAULTS, push="off", transport="nixl"),  # confirmed by a NIXL notification
        agent_factory=agent_factory,
    )
    agent = prefill.rank.agent
    notify, add_peer = agent.notify, agent.add_peer
    broken: list[str] = []
    added: list[str] = []

    def notify_once_broken(peer: str, payload: bytes) -> None:
        if peer == decode.agent.name and not broken:
            broken.append(peer)
            raise PeerDisconnected(f"notifying {peer}: peer disconnected (the endpoint broke)")
        notify(peer, payload)

    def counted_add_peer(metadata: bytes) -> str:
        name = add_peer(metadata)
        added.append(name)
        return name

    try:
        prefill.rank.hold("first", [1])
        decode.pull_confirmed("first", prefill.host, prefill.port, [1], [2], 16)  # the prefill adds the reader
        with monkeypatch.context() as patch:
            patch.setattr(agent, "notify", notify_once_broken)
            patch.setattr(agent, "add_peer", counted_add_peer)
            for request_id, remote, local in (("cut", [5, 6], [7, 8]), ("next", [9], [10])):
                prefill.rank.hold(request_id, remote)
                decode.pull_confirmed(request_id, prefill.host, prefill.port, remote, local, 16 * len(remote))
                assert received_correctly(decode.cache, local, prefill.expected(), remote, 16 * len(remote))
        assert broken == [decode.agent.name] and added == [decode.agent.name]  # removed and added once
    except LeaseNotConfirmed:
        pytest.fail("a confirmation was lost to the broken endpoint")
    finally:
        decode.close()

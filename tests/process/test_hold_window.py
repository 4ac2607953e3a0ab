"""The prefill's hold window, over real processes, ZMQ and NIXL: a decode whose read ended inside the window
the prefill promised in its params uses the KV without a confirmation round trip; a read that cannot rely on the
window (too little left, another incarnation, a lease gone) still waits for the prefill's word and is refused
when the blocks were freed; an abort inside the window waits for the window (or the reader) before the engine
gets its blocks back.

Prefill engines run in a child process (``prefills`` of tests/process/conftest.py: ``p1`` leases 30 s, so a 10 s
window; ``pshort`` leases 1.5 s, a 0.5 s window, too short to rely on); decode engines here.
"""

from __future__ import annotations

import time

import pytest
from engine_specs import SHORT_LEASE_S

from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.errors import LeaseNotConfirmed
from pd_transfer.connector.leases import hold_window
from pd_transfer.connector.params import HOLD_MARGIN_S, parse_transfer_params
from pd_transfer.connector.transports.requests import PullRequest
from pd_transfer.sim.engines import DecodeEngine, PrefillEngines
from pd_transfer.sim.verify import received_correctly


def _rank(decode: DecodeEngine) -> DecodeRank:
    rank = decode.workers[0].decode_rank()  # type: ignore[attr-defined]
    assert isinstance(rank, DecodeRank)
    return rank


def _counts(decode: DecodeEngine) -> tuple[int, int, int]:
    """(reads trusted by the window, reads confirmed, LeaseConfirm answers received) of decode rank 0."""
    rank = _rank(decode)
    return rank.reads_in_window, rank.reads_confirmed, rank.confirmations.received


def _delta(before: tuple[int, int, int], after: tuple[int, int, int]) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(before, after, strict=True))


def _wait_confirmations(decode: DecodeEngine, at_least: int, timeout_s: float = 5.0) -> int:
    """LeaseConfirm answers received once at least ``at_least`` came, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _rank(decode).confirmations.received < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return _rank(decode).confirmations.received


def test_params_state_the_window(prefills: PrefillEngines, decode: DecodeEngine) -> None:
    before = time.time()
    params = prefills.prefill("p1", "window-params", prompt_len=40)["params"]
    assert params["remote_hold_seconds"] == hold_window(30.0) == 10.0
    assert before + 10.0 <= params["remote_hold_until"] <= time.time() + 10.0
    parsed = parse_transfer_params(params, prompt_len=40, local_block_size=16)
    now = time.monotonic()
    deadline = parsed.trust_deadline(now, time.time())  # type: ignore[union-attr]
    assert deadline is not None and now + 10.0 - HOLD_MARGIN_S - 0.5 < deadline <= now + 10.0 - HOLD_MARGIN_S
    # a skewed wall clock (the prefill's 3 s behind ours) shortens the window by the skew, never lengthens it
    skewed = parsed.trust_deadline(now, time.time() + 3.0)  # type: ignore[union-attr]
    assert skewed is not None and skewed <= deadline - 2.9
    assert decode.receive("dec-window-params", 40, params).ok


def test_read_inside_the_window_needs_no_confirmation(prefills: PrefillEngines, decode: DecodeEngine) -> None:
    before = _counts(decode)
    out = prefills.prefill("p1", "window-in", prompt_len=70)
    got = decode.receive("dec-window-in", 70, out["params"])
    assert got.ok, got
    expected = prefills.specs["p1"].caches()
    assert received_correctly(decode.caches[0], got.local_block_ids, expected, out["block_ids"], 70)
    sent = prefills.wait_sending("p1", ["window-in"])
    assert sent["finished_sending"] == ["window-in"] and sent["status"]["window-in"] == ["read"], sent
    # freed by our ReadDone, and no LeaseConfirm was asked for or sent: no round trip on the load's path
    assert _delta(before, _counts(decode)) == (1, 0, 0)


def test_windowless_or_foreign_params_fall_back_to_confirming(prefills: PrefillEngines, decode: DecodeEngine) -> None:
    cases = {
        "no-window": lambda p: {k: v for k, v in p.items() if not k.startswith("remote_hold")},
        "other-incarnation": lambda p: {**p, "remote_incarnation": "0" * 32},  # e.g. promised before a restart
        "window-nearly-over": lambda p: {**p, "remote_hold_until": time.time() + HOLD_MARGIN_S + 0.2},
        "short-window": lambda p: {**p, "remote_hold_seconds": HOLD_MARGIN_S + 0.2},
    }
    for name, change in cases.items():
        before = _counts(decode)
        out = prefills.prefill("p1", f"fallback-{name}", prompt_len=40)
        got = decode.receive(f"dec-fallback-{name}", 40, change(out["params"]))
        assert got.ok, (name, got)
        assert received_correctly(
            decode.caches[0], got.local_block_ids, prefills.specs["p1"].caches(), out["block_ids"], 40
        ), name
        assert _delta(before, _counts(decode)) == (0, 1, 1), name  # confirmed: one round trip


def test_abort_inside_the_window_waits_for_the_reader(prefills: PrefillEngines, decode: DecodeEngine) -> None:
    out = prefills.prefill("p1", "abort-in-window", prompt_len=50)
    state = prefills.abort("p1", "abort-in-window")
    # the engine asked for the blocks back, but the params promised 10 s: still held
    assert state["status"]["abort-in-window"] == ["held"], state
    before = _counts(decode)
    got = decode.receive("dec-abort-in-window", 50, out["params"])
    assert got.ok, got
    expected = prefills.specs["p1"].caches()
    assert received_correctly(decode.caches[0], got.local_block_ids, expected, out["block_ids"], 50)
    assert _delta(before, _counts(decode)) == (1, 0, 0)
    # the read ends the deferred abort at once (well before the window's end)
    sent = prefills.wait_sending("p1", ["abort-in-window"], timeout_s=5.0)
    assert sent["finished_sending"] == ["abort-in-window"] and sent["status"]["abort-in-window"] == ["aborted"], sent
    assert prefills.state("p1", ["abort-in-window"])["held_blocks"] == [0]


def test_abort_after_the_window_frees_now_and_the_read_is_refused(
    prefills: PrefillEngines, decode: DecodeEngine
) -> None:
    out = prefills.prefill("pshort", "abort-late", prompt_len=40)
    window_over = time.monotonic() + hold_window(SHORT_LEASE_S) + 0.05
    while time.monotonic() < window_over:  # let the window pass (the lease, 1.5 s, still runs)
        time.sleep(0.02)
    state = prefills.abort("pshort", "abort-late")
    assert state["status"]["abort-late"] == ["aborted"] and state["held_blocks"] == [0], state
    before = _counts(decode)
    got = decode.receive("dec-abort-late", 40, out["params"])
    assert got.finished and not got.failed and set(got.local_block_ids) <= got.load_errors  # recomputed
    assert "aborted" in decode.workers[0].outcomes[-1].error  # type: ignore[attr-defined]
    assert _delta(before, _counts(decode)) == (0, 0, 1)  # asked, and refused


def test_a_read_ending_after_the_window_is_not_used(prefills: PrefillEngines, decode: DecodeEngine) -> None:
    out = prefills.prefill("p1", "window-late", prompt_len=40)
    params = parse_transfer_params(out["params"], prompt_len=40, local_block_size=16)
    assert params is not None and not isinstance(params, dict)
    rank = _rank(decode)
    local = decode.allocate(40)
    confirmations = rank.confirmations.received
    with pytest.raises(LeaseNotConfirmed, match="after the prefill's hold window"):
        # the window check after the read (the path a read slower than the window's rest takes)
        rank.pull_in_window(
            PullRequest("window-late", list(params.block_ids), local, 40),  # type: ignore[union-attr]
            prefills.host,
            prefills.ports["p1"],
            None,
            time.monotonic() - 1.0,
            params.incarnation,  # type: ignore[union-attr]
        )
    sent = prefills.wait_sending("p1", ["window-late"])  # the read happened and freed the blocks
    assert sent["status"]["window-late"] == ["read"], sent
    assert _wait_confirmations(decode, confirmations + 1, timeout_s=0.5) == confirmations  # nothing was asked

"""A prefill engine restarted where it was (same side-channel host and port), and block ids that repeat.

Prefill engines run in child processes (killed with SIGKILL, restarted on the same port), the decode engine
here; real ZMQ and NIXL. A restarted prefill is a new incarnation: new NIXL agents (their names change on
every start) and, as vLLM does by default, possibly a new engine id. The decode must recognise it at the
next pull, handshake afresh and read from it, and not keep a failed endpoint out for the whole handshake
back-off once it answers again.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from engine_specs import FINGERPRINT, decode_config, layouts
from metric_samples import metric_samples

from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.errors import DuplicateBlockIds
from pd_transfer.connector.metadata import RecvSpec, StepMetadata
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.handshake.client import HandshakeClient
from pd_transfer.handshake.errors import HandshakeBackoff, HandshakeTimeout
from pd_transfer.metrics import TransferMetrics
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.engines import DecodeEngine, EngineSpec, PrefillEngines, Received
from pd_transfer.sim.verify import received_correctly

PROMPT = 40  # tokens: three 16-token blocks
RECOVERY_BOUND_S = 5.0  # generous: the requirement is about a second after the new prefill answers


def _spec(engine_id: str, port: int = 0, seed: int = 31) -> EngineSpec:
    return EngineSpec(
        engine_id=engine_id, layouts=layouts(FINGERPRINT, 1), num_blocks=256, seed=seed, side_channel_port=port
    )


def _load(decode: DecodeEngine, prefill: PrefillEngines, engine_id: str, name: str) -> tuple[Received, dict]:
    """Prefill a prompt on ``engine_id`` and load it on the decode; returns how it ended and the prefill's reply."""
    out = prefill.prefill(engine_id, name, prompt_len=PROMPT)
    return decode.receive(f"dec-{name}", PROMPT, out["params"]), out


def _assert_loaded(decode: DecodeEngine, prefill: PrefillEngines, engine_id: str, got: Received, out: dict) -> None:
    assert got.ok, (got, decode.workers[0].outcomes[-1].error)
    expected = prefill.specs[engine_id].caches()
    assert received_correctly(decode.caches[0], got.local_block_ids, expected, out["block_ids"], PROMPT)


@pytest.fixture
def metrics() -> TransferMetrics:
    return TransferMetrics()


@pytest.fixture
def decode(metrics: TransferMetrics) -> Iterator[DecodeEngine]:
    with DecodeEngine(
        "d-restarts", layouts(FINGERPRINT, 1), 1024, decode_config(), metrics=metrics, settings=DEFAULTS
    ) as engine:
        yield engine


def _rehandshakes(metrics: TransferMetrics, reason: str) -> float:
    return metric_samples(metrics, "pd_transfer_peer_rehandshakes_total").get(reason, 0.0)


@pytest.mark.parametrize("new_engine_id", [True, False], ids=["new-engine-id", "same-engine-id"])
def test_the_next_pull_after_a_restart_on_the_same_port_succeeds(
    decode: DecodeEngine, metrics: TransferMetrics, new_engine_id: bool
) -> None:
    old = PrefillEngines([_spec("restart-a", seed=31)])
    try:
        port = old.ports["restart-a"]
        got, out = _load(decode, old, "restart-a", "before-restart")
        _assert_loaded(decode, old, "restart-a", got, out)
    finally:
        old.kill()
    engine_id = "restart-b" if new_engine_id else "restart-a"
    with PrefillEngines([_spec(engine_id, port, seed=32)]) as new:
        assert new.ports[engine_id] == port
        ready = time.monotonic()
        got, out = _load(decode, new, engine_id, "after-restart")  # the very next pull, nothing in between
        seconds = time.monotonic() - ready
        _assert_loaded(decode, new, engine_id, got, out)
        assert not any("WrongEngine" in outcome.error for outcome in decode.workers[0].outcomes)
        assert seconds < RECOVERY_BOUND_S
        reason = "engine_id" if new_engine_id else "agents"
        assert _rehandshakes(metrics, reason) == 1
        sent = new.wait_sending(engine_id, ["after-restart"], timeout_s=10)
        assert sent["finished_sending"] == ["after-restart"] and sent["held_blocks"] == [0]
        print(f"\nrestart ({'new' if new_engine_id else 'same'} engine id): next pull ok in {seconds:.2f} s")


def test_pulls_during_the_outage_do_not_keep_the_restarted_prefill_out(
    decode: DecodeEngine, metrics: TransferMetrics
) -> None:
    old = PrefillEngines([_spec("outage", seed=33)])
    try:
        port = old.ports["outage"]
        got, out = _load(decode, old, "outage", "before-outage")
        _assert_loaded(decode, old, "outage", got, out)
        stale = out["params"]
    finally:
        old.kill()

    # the prefill restarts in the background while requests keep coming (and failing) on the decode
    restarted: list[PrefillEngines] = []
    starter = threading.Thread(target=lambda: restarted.append(PrefillEngines([_spec("outage", port, seed=34)])))
    starter.start()
    failed_during_outage = 0
    try:
        deadline = time.monotonic() + 120
        while starter.is_alive() and time.monotonic() < deadline:
            got = decode.receive(f"dec-outage-{failed_during_outage}", PROMPT, stale)
            assert not got.ok
            failed_during_outage += 1
            time.sleep(0.1)  # pacing the requests, not a synchronisation: the loop ends when the child is up
        starter.join(10)
        assert restarted, "the prefill did not restart"
        new = restarted[0]
        ready = time.monotonic()
        attempt = 0
        while True:
            got, out = _load(decode, new, "outage", f"after-outage-{attempt}")
            if got.ok or time.monotonic() - ready > RECOVERY_BOUND_S:
                break
            attempt += 1
            time.sleep(0.05)  # pacing
        seconds = time.monotonic() - ready
        _assert_loaded(decode, new, "outage", got, out)
        assert seconds < RECOVERY_BOUND_S, f"recovered after {seconds:.1f} s"
        assert _rehandshakes(metrics, "reconnect") == 1
        failures = metric_samples(metrics, "pd_transfer_pull_failures_total")
        print(
            f"\noutage: {failed_during_outage} loads failed during it; recovered {seconds:.2f} s after the"
            f" restarted prefill was ready ({attempt} failed attempts after); failures by kind {failures}"
        )
        # every failed load counted once, by why: the dead prefill's peer gone (the first), the address refused
        # (handshake), and, for a load sent just as the restarted prefill began to answer, before this thread saw
        # it ready, its refusal of a lease it never held (unconfirmed: stale params fall back to confirming)
        assert set(failures) <= {"disconnected", "handshake", "unconfirmed"}, failures
        assert sum(failures.values()) == failed_during_outage + attempt, failures
    finally:
        for engines in restarted:
            engines.close()


def test_a_listener_back_at_a_failed_endpoint_ends_the_back_off_but_a_mute_one_does_not() -> None:
    with socket.socket() as placeholder:  # a free port, nobody listening once closed
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    client = HandshakeClient(FINGERPRINT, timeout_s=0.3, retries=0, failure_backoff_s=30.0, knock_interval_s=0.2)
    try:
        with pytest.raises(HandshakeTimeout, match="refused"):
            client.fetch("127.0.0.1", port)
        with pytest.raises(HandshakeBackoff):  # nobody listens: the knock is refused, the window stands
            client.fetch("127.0.0.1", port)
        with socket.socket() as mute:  # listens, never answers a handshake (a hung process)
            mute.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            mute.bind(("127.0.0.1", port))
            mute.listen()
            deadline = time.monotonic() + 5
            while True:  # the next knock (at most one per 0.2 s) finds the listener: a handshake is tried
                try:
                    client.fetch("127.0.0.1", port)
                except HandshakeBackoff:
                    assert time.monotonic() < deadline, "never knocked"
                    time.sleep(0.05)  # pacing the fetches
                    continue
                except HandshakeTimeout as error:
                    assert "no Challenge" in str(error.reasons)
                    break
            # it accepted the connection and did not answer: no more knocking, the 60 s window stands
            knocks_after = time.monotonic() + 1.0
            while time.monotonic() < knocks_after:
                with pytest.raises(HandshakeBackoff):
                    client.fetch("127.0.0.1", port)
                time.sleep(0.05)
    finally:
        client.close()


# ---------------------------------------------------------------------- repeated block ids
@pytest.fixture(scope="module")
def prefill() -> Iterator[PrefillEngines]:
    with PrefillEngines([_spec("dups", seed=35)]) as engines:
        yield engines


def _untouched(decode: DecodeEngine, block_ids: list[int]) -> bool:
    return all(bool((tensor[block_ids] == 0).all()) for tensor in decode.caches[0].tensors)


def test_repeated_remote_block_ids_in_the_params_are_refused_and_the_prefill_released(
    prefill: PrefillEngines, decode: DecodeEngine
) -> None:
    out = prefill.prefill("dups", "dup-params", prompt_len=PROMPT)
    first, second, _ = out["block_ids"]
    params = {**out["params"], "remote_block_ids": [[first, second, first]]}
    tokens, load = decode.admit("dec-dup-params", PROMPT, params)
    assert (tokens, load) == (0, False)  # refused at the edge: computed locally, nothing read
    assert decode.scheduler.invalid_params == 1  # type: ignore[attr-defined]
    assert _untouched(decode, decode.blocks["dec-dup-params"])
    sent = prefill.wait_sending("dups", ["dup-params"], timeout_s=10)  # released by the decode, not the lease
    assert sent["finished_sending"] == ["dup-params"] and sent["held_blocks"] == [0], sent


def test_repeated_remote_block_ids_at_the_worker_are_refused_before_any_read(
    prefill: PrefillEngines, decode: DecodeEngine
) -> None:
    out = prefill.prefill("dups", "dup-worker", prompt_len=PROMPT)
    first, second, _ = out["block_ids"]
    local = decode.allocate(PROMPT)
    params = out["params"]
    spec = RecvSpec(
        remote_engine_id=params["remote_engine_id"],
        remote_host=params["remote_host"],
        remote_port=params["remote_port"],
        remote_request_id="dup-worker",
        remote_tp_size=1,
        remote_block_ids=(first, second, second),
        local_block_ids=tuple(local),
        num_tokens=PROMPT,
    )
    decode.blocks["dec-dup-worker"] = local
    for worker in decode.workers:  # an adapter that builds its own specs: the worker checks again
        worker.start_load(StepMetadata(reqs_to_recv={"dec-dup-worker": spec}))
    got = decode.wait_received("dec-dup-worker")
    assert got.finished and set(local) <= got.load_errors  # recompute
    error = decode.workers[0].outcomes[-1].error
    assert "DuplicateBlockIds" in error and "dup-worker" in error and f"block {second} " in error, error
    assert _untouched(decode, local)
    sent = prefill.wait_sending("dups", ["dup-worker"], timeout_s=10)
    assert sent["finished_sending"] == ["dup-worker"] and sent["held_blocks"] == [0], sent


def test_repeated_remote_block_ids_at_the_decode_rank_name_the_request_and_the_block(
    prefill: PrefillEngines,
) -> None:
    out = prefill.prefill("dups", "dup-rank", prompt_len=PROMPT)
    host, port = prefill.host, prefill.ports["dups"]
    decode = DecodeRank(
        "dup-rank-decode", KVCache.allocate(layouts(FINGERPRINT, 1)[0], 8), DecodeOptions(settings=DEFAULTS)
    )
    try:
        first, _, third = out["block_ids"]
        with pytest.raises(DuplicateBlockIds) as caught:
            decode.pull_confirmed("dup-rank", host, port, [third, first, third], [0, 1, 2], PROMPT)
        assert (caught.value.request_id, caught.value.block_id) == ("dup-rank", third)
        assert "request dup-rank" in str(caught.value) and f"block {third} " in str(caught.value)
        assert isinstance(caught.value, ValueError)
        for tensor in decode.cache.tensors:
            assert bool((tensor == 0).all())  # nothing was read
        decode.abandon("dup-rank", host, port, "repeated block ids")
    finally:
        decode.close()
    sent = prefill.wait_sending("dups", ["dup-rank"], timeout_s=10)
    assert sent["finished_sending"] == ["dup-rank"] and sent["held_blocks"] == [0], sent

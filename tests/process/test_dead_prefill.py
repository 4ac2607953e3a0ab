"""A prefill that died between the hops is known at once, and one restarted where it was is still handshaken and read.

Real processes: the prefill engine in a child process (``pd_transfer.sim.engines``), SIGKILLed after it computed the
requests and before any decode read them, then started again on the same side-channel port; two decode engines here
(one had read from the dead prefill before, one never reached it); real ZMQ side channel and NIXL reads.

Nothing listens at a dead prefill's address: its side channel's connection is refused, and so is a bare TCP connect
right after. That is the whole verdict: one handshake attempt, one knock, and the failure policy applies
(``recompute`` here: the request's blocks are reported as load errors). Before, the handshake client tried three
times with 0.1 + 0.2 s of pauses in between, and the policy waited for them. The times printed are the
connector's, from the load's start to its outcome (the figure is in docs/faults.md); nothing asserts them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from engine_specs import FINGERPRINT, decode_config, layouts
from metric_samples import metric_samples

from pd_transfer.connector.worker import LoadOutcome, WorkerSide
from pd_transfer.metrics import TransferMetrics
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.engines import DecodeEngine, EngineSpec, PrefillEngines, Received
from pd_transfer.sim.verify import received_correctly

PROMPT = 40  # tokens: three 16-token blocks
ENGINE = "mortal"


def _spec(port: int = 0, seed: int = 41) -> EngineSpec:
    return EngineSpec(
        engine_id=ENGINE, layouts=layouts(FINGERPRINT, 1), num_blocks=64, seed=seed, side_channel_port=port
    )


def _outcome(decode: DecodeEngine, request_id: str) -> LoadOutcome:
    worker = decode.workers[0]
    assert isinstance(worker, WorkerSide)
    return next(outcome for outcome in reversed(worker.outcomes) if outcome.request_id == request_id)


def _assert_recomputed(got: Received) -> None:
    """The load failed and the policy applied: every local block of the request is to be recomputed."""
    assert got.finished and not got.failed and set(got.local_block_ids) <= got.load_errors, got


Decodes = dict[str, tuple[DecodeEngine, TransferMetrics]]


@pytest.fixture
def decodes() -> Iterator[Decodes]:
    """Decode engines of their own metrics: ``warm`` and ``slept`` will have read from the prefill, ``cold`` not."""
    with contextlib.ExitStack() as stack:
        engines: Decodes = {}
        for name in ("warm", "cold", "slept"):
            metrics = TransferMetrics()
            engine = DecodeEngine(
                f"d-{name}", layouts(FINGERPRINT, 1), 256, decode_config(), metrics=metrics, settings=DEFAULTS
            )
            engines[name] = (stack.enter_context(engine), metrics)
            worker = engine.workers[0]
            assert isinstance(worker, WorkerSide)
            worker.decode_rank()  # its agent made now: a load's time is the load's
        yield engines


def test_a_dead_prefill_is_known_after_one_refused_attempt_and_a_restarted_one_is_read(decodes: Decodes) -> None:
    (warm, warm_metrics), (cold, cold_metrics), (slept, _) = decodes["warm"], decodes["cold"], decodes["slept"]
    dead = PrefillEngines([_spec()])
    try:
        port = dead.ports[ENGINE]
        for decode in (warm, slept):  # these two know this incarnation (its metadata cached, its agent a peer)
            first = dead.prefill(ENGINE, f"before-{decode.engine_id}", prompt_len=PROMPT)
            assert decode.receive(f"dec-before-{decode.engine_id}", PROMPT, first["params"]).ok
        orphans = {name: dead.prefill(ENGINE, name, prompt_len=PROMPT)["params"] for name in ("warm", "cold", "stale")}
    finally:
        dead.kill()  # SIGKILL: its side channel and its NIXL agent are gone, nothing listens at the port

    # -- dead: the warm decode's read fails (peer gone), the re-handshake is refused once, the knock too
    handshakes = metric_samples(warm_metrics, "pd_transfer_handshakes_total")
    _assert_recomputed(warm.receive("dec-warm", PROMPT, orphans["warm"]))
    after = metric_samples(warm_metrics, "pd_transfer_handshakes_total")
    assert after.get("timeout", 0) - handshakes.get("timeout", 0) == 1  # one failed handshake, no other
    assert after.get("ok", 0) == handshakes.get("ok", 0)
    warm_outcome = _outcome(warm, "dec-warm")
    assert warm_outcome.error.startswith("PeerDisconnected") and "1 attempt(s)" in warm_outcome.error, warm_outcome
    assert "connection refused" in warm_outcome.error
    assert metric_samples(warm_metrics, "pd_transfer_pull_failures_total").get("disconnected") == 1

    # -- dead, first contact: the cold decode's handshake is refused once, the knock too
    _assert_recomputed(cold.receive("dec-cold", PROMPT, orphans["cold"]))
    cold_outcome = _outcome(cold, "dec-cold")
    assert cold_outcome.error.startswith("HandshakeTimeout") and "1 attempt(s)" in cold_outcome.error, cold_outcome
    assert "(connection refused)" in cold_outcome.error
    assert metric_samples(cold_metrics, "pd_transfer_handshakes_total").get("timeout") == 1

    # -- restarted where it was: a new incarnation, same engine id
    with PrefillEngines([_spec(port, seed=42)]) as restarted:
        assert restarted.ports[ENGINE] == port
        expected = restarted.specs[ENGINE].caches()
        # the slept decode still has the dead incarnation: its read fails, the re-handshake finds the new one, which
        # never held the request (its params name the dead one): recomputed at once, not read and left unconfirmed
        _assert_recomputed(slept.receive("dec-stale", PROMPT, orphans["stale"]))
        stale_outcome = _outcome(slept, "dec-stale")
        assert stale_outcome.error.startswith("PeerDisconnected") and "never held" in stale_outcome.error
        # requests of the new incarnation are read: by the slept decode (connected to it now) and by the warm one,
        # whose fail-fast window for the address a knock ends (something listens again)
        for decode, name in ((slept, "fresh-slept"), (warm, "fresh-warm")):
            fresh = restarted.prefill(ENGINE, name, prompt_len=PROMPT)
            got = decode.receive(f"dec-{name}", PROMPT, fresh["params"])
            assert got.ok, (got, _outcome(decode, f"dec-{name}"))
            assert received_correctly(decode.caches[0], got.local_block_ids, expected, fresh["block_ids"], PROMPT)
        assert metric_samples(warm_metrics, "pd_transfer_handshakes_total").get("ok") == handshakes.get("ok", 0) + 1
    print(
        f"\ndead prefill, policy applied after (load start to outcome): {warm_outcome.seconds * 1e3:.1f} ms"
        f" (the decode had read from it), {cold_outcome.seconds * 1e3:.1f} ms (first contact);"
        f" restarted there: a request of the dead one recomputed after {stale_outcome.seconds * 1e3:.1f} ms,"
        f" the new one's read in {_outcome(warm, 'dec-fresh-warm').seconds * 1e3:.1f} ms"
    )

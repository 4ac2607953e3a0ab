"""Read checks (issue 42): a decode's reads (NIXL, in place, any transport copying its plan's rows) checked against
the prefill's digest of the same rows; the prefill's answers to checks that do not fit it, the decode's to answers
that do not come or differ, and a prefill that offers no checks. The corrupted-cache case end to end, over real NIXL
and ``process_vm_readv``: tests/process/test_corrupted_kv.py."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from in_process_prefill import InProcessPrefill

from pd_transfer.connector import messages
from pd_transfer.connector.cache import KVCache
from pd_transfer.connector.decode.rank import DecodeRank
from pd_transfer.connector.decode.read_checks import ReadChecks, SourceCheck
from pd_transfer.connector.options import DecodeOptions
from pd_transfer.connector.prefill import rank as prefill_rank
from pd_transfer.connector.prefill.rank import serve_engine
from pd_transfer.connector.transports.seam import Source
from pd_transfer.metrics import TransferMetrics
from pd_transfer.settings import DEFAULTS
from pd_transfer.sim.verify import received_correctly
from pd_transfer.spec import KVCacheLayout, ModelFingerprint
from pd_transfer.transfer.agent_protocol import AgentFactory
from pd_transfer.transfer.cma import merged_rows
from pd_transfer.transfer.digests import rows_digest
from pd_transfer.transfer.errors import DigestMismatch

MODEL = ModelFingerprint(model="read-checks", dtype="float16", num_layers=3, total_num_kv_heads=4, head_size=16)
LAYOUT = KVCacheLayout(MODEL, 1, 0, 16, "NHD")
BLOCKS = 32


@pytest.fixture
def prefill(agent_factory: AgentFactory) -> Iterator[InProcessPrefill]:
    made = InProcessPrefill(f"checked-prefill-{time.monotonic_ns()}", LAYOUT, BLOCKS, agent_factory, transport="nixl")
    try:
        yield made
    finally:
        made.close()


def decode_rank(agent_factory: AgentFactory, verify: str) -> DecodeRank:
    options = DecodeOptions(settings=DEFAULTS, transport="nixl", push="off", verify=verify)  # type: ignore[arg-type]
    return DecodeRank(
        f"checked-decode-{time.monotonic_ns()}",
        KVCache.allocate(LAYOUT, BLOCKS),
        options,
        metrics=TransferMetrics(),
        agent_factory=agent_factory,
    )


def checks_counted(decode: DecodeRank, outcome: str) -> float:
    value = decode.metrics.registry.get_sample_value("pd_transfer_digest_checks_total", {"outcome": outcome})
    return value or 0.0


@pytest.mark.parametrize("verify", ["all", "sample", "off"])
def test_a_pull_checks_what_verify_says_and_the_kv_is_right(
    prefill: InProcessPrefill, agent_factory: AgentFactory, verify: str
) -> None:
    """A pull of a held request (and one of blocks nobody holds: a digest needs no lease) is checked under ``all``
    and ``sample`` (one digest a source), not under ``off``; the rows are right either way."""
    decode = decode_rank(agent_factory, verify)
    try:
        remote_ids, local_ids, tokens = [9, 2, 30, 17], [4, 0, 21, 13], 16 * 3 + 5
        prefill.rank.hold("held", remote_ids)
        decode.pull_confirmed("held", prefill.host, prefill.port, remote_ids, local_ids, tokens)
        decode.pull("unheld", prefill.host, prefill.port, [5, 6], [7, 8], 20)
        assert received_correctly(decode.cache, local_ids, prefill.expected(), remote_ids, tokens)
        assert received_correctly(decode.cache, [7, 8], prefill.expected(), [5, 6], 20)
        checked = 0 if verify == "off" else 2
        assert decode.confirmations.digests_received == checked
        assert checks_counted(decode, "equal") == checked and checks_counted(decode, "mismatch") == 0
    finally:
        decode.close()


def test_a_prefill_that_offers_no_checks_is_read_unchecked(
    prefill: InProcessPrefill, agent_factory: AgentFactory
) -> None:
    """A prefill whose metadata has no read-checks offer (an older one, or a cache on a GPU) is sent no ``CheckRows``
    (a message it would drop as unknown) and is read as before."""
    rank = prefill.rank.rank_metadata
    older = msgspec.structs.replace(
        rank, offers=[offer for offer in rank.offers if offer.transport != messages.READ_CHECKS_OFFER]
    )
    server = serve_engine(f"{prefill.engine_id}-older", [older])
    decode = decode_rank(agent_factory, "all")
    try:
        decode.pull("older", "127.0.0.1", server.port, [3], [3], 16)
        assert received_correctly(decode.cache, [3], prefill.expected(), [3], 16)
        assert decode.confirmations.digests_received == 0 and checks_counted(decode, "equal") == 0
    finally:
        decode.close()
        server.stop()


def check_rows(check: messages.RowCheck) -> messages.CheckRows:
    return messages.CheckRows(request_id="checked", reader_engine_id="d", reader_rank=0, check=check, reply_to=b"x")


def answers_to(prefill: InProcessPrefill, message: messages.CheckRows) -> list[messages.PeerMessage]:
    """What the prefill rank sends back to a reader for ``message`` (its answers, decoded), once they came."""
    answers: list[bytes] = []
    prefill.rank.receive("reader", message, answers.append)
    deadline = time.monotonic() + 5.0
    while not answers and time.monotonic() < deadline:
        time.sleep(0.005)
    return [messages.decode(answer) for answer in answers]


@pytest.mark.parametrize(
    ("fields", "refusal"),
    [
        ({"first_global_head": 2, "num_heads": 4}, "not all the rank's"),
        ({"unit_heads": 3}, "do not tile"),
        ({"head_size": 32}, "head size"),
        ({"num_heads": 0}, "positive integer"),
        ({"block_ids": [BLOCKS]}, "out of range"),
        ({"block_ids": [1, 2]}, "need 1 block ids"),
        ({"first_unit": 3, "end_unit": 2}, "units 3..2"),
        ({"end_unit": 10**6}, "units 0..1000000"),
    ],
)
def test_a_check_that_does_not_fit_the_prefill_is_refused_saying_why(
    prefill: InProcessPrefill, fields: dict[str, object], refusal: str
) -> None:
    """Hostile or broken checks (heads the rank does not hold, units that do not tile its blocks, block ids out of its
    cache, a run of units outside the request) are answered with a refusal, never a digest of other memory; the
    decode takes a refusal as a mismatch (below)."""
    good = {
        "first_global_head": 0, "num_heads": 4, "unit_heads": 4, "unit_tokens": 16, "head_size": 16,
        "block_ids": [1], "num_tokens": 16, "first_unit": 0, "end_unit": 6,
    }  # fmt: skip
    answers = answers_to(prefill, check_rows(messages.RowCheck(**{**good, **fields})))  # type: ignore[arg-type]
    assert len(answers) == 1 and isinstance(answers[0], messages.RowDigest), answers
    assert answers[0].digest is None and refusal in answers[0].refused, answers[0]
    # the good one is digested (no lease needed)
    answers = answers_to(prefill, check_rows(messages.RowCheck(**good)))  # type: ignore[arg-type]
    assert len(answers) == 1 and isinstance(answers[0], messages.RowDigest) and answers[0].digest is not None


class NoCourier:
    def notify(self, peer: str, payload: bytes) -> None:
        raise AssertionError("nothing is sent in a comparison")


def test_the_decode_takes_any_answer_but_an_equal_digest_as_a_mismatch() -> None:
    """A digest that differs, a block changed at the prefill, a refusal or no answer in time: each a ``DigestMismatch``
    naming the source and the units; equal digests count."""
    cache = KVCache.allocate(LAYOUT, 4)
    rows = merged_rows(np.array([cache.regions[0].base_address], dtype=np.uint64), 64)
    source = Source(remote_rank=0, peer="prefill-0", expected_readers=1, courier=NoCourier())
    check = SourceCheck(source, messages.RowCheck(0, 4, 4, 1, 16, [0], 1, 0, 1), rows)
    digest = rows_digest(rows)
    assert ReadChecks.compare("r", [check], [digest], {"prefill-0": messages.RowDigest("r", digest=digest)}) == 1
    cases = {
        "digests differ": messages.RowDigest("r", digest=digest ^ 1),
        "block 3 of layer 0 (k) changed": messages.RowDigest("r", changed="block 3 of layer 0 (k) changed"),
        "refused the check: units": messages.RowDigest("r", refused="units 0..9 of 6"),
        "no digest in time": messages.RowDigest("r"),
    }
    for expected, answer in cases.items():
        with pytest.raises(DigestMismatch, match=f"units 0..1 of request r from prefill-0: .*{re.escape(expected)}"):
            ReadChecks.compare("r", [check], [digest], {"prefill-0": answer})
    with pytest.raises(DigestMismatch, match="no digest in time"):
        ReadChecks.compare("r", [check], [digest], {})


def test_checks_beyond_the_queue_bound_are_refused_at_once(
    prefill: InProcessPrefill, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader asking for checks faster than the prefill digests them is refused past the bound (memory and CPU stay
    bounded), answered at once."""
    monkeypatch.setattr(prefill_rank, "MAX_QUEUED_CHECKS", 0)
    check = messages.RowCheck(0, 4, 4, 16, 16, [1], 16, 0, 6)
    answers = answers_to(prefill, check_rows(check))
    assert len(answers) == 1 and isinstance(answers[0], messages.RowDigest), answers
    assert answers[0].digest is None and answers[0].refused == "too many checks queued here"


def test_a_request_stays_held_while_its_rows_are_digested(prefill: InProcessPrefill) -> None:
    """A ``CheckRows`` pins the request until its digest is made: the reader's ``ReadDone`` arriving first (its read
    was quick) does not free the blocks under the digest; they are freed once it is answered."""
    rank = prefill.rank
    rank.hold("pinned", [1])
    busy = threading.Event()
    rank._checks.submit(busy.wait, 10.0)  # noqa: SLF001 (the checking thread busy: the check waits its turn)
    answers: list[bytes] = []
    check = messages.RowCheck(0, 4, 4, 16, 16, [1], 16, 0, 6)
    asked = messages.CheckRows(request_id="pinned", reader_engine_id="d", reader_rank=0, check=check, reply_to=b"x")
    rank.receive("reader", asked, answers.append)
    done = messages.ReadDone(request_id="pinned", reader_engine_id="d", reader_rank=0, expected_readers=1)
    rank.receive("reader", done, answers.append)
    assert rank.ledger.status("pinned") == "held" and rank.ledger.blocks_held == 1  # read, but pinned
    busy.set()
    deadline = time.monotonic() + 5.0
    while (not answers or rank.ledger.blocks_held) and time.monotonic() < deadline:
        time.sleep(0.005)
    digest = messages.decode(answers[0])
    assert isinstance(digest, messages.RowDigest) and digest.digest is not None, digest
    assert rank.ledger.blocks_held == 0 and [freed.request_id for freed in rank.take_freed()] == ["pinned"]

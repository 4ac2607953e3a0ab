"""The release soak's plan and answer check (``pd_transfer.bench.soak.kv_standins``): every kind in turn, clients
leaving as asked, a seed that replays its round, and an answer that counts only with its tokens and a verified KV
report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("aiohttp", reason="the soak's client needs the 'proxy' extra (aiohttp)")

from pd_transfer.bench.soak.kv_standins import KINDS, STREAMED, Planned, plan_round, problem_of


def test_the_plan_mixes_every_kind_and_leaves_as_asked() -> None:
    planned = plan_round(200, 20, 15, seed=3)
    assert [p.kind for p in planned[:5]] == list(KINDS)
    assert sum(p.leaves == "early" for p in planned) == 20
    mid = [p for p in planned if p.leaves == "mid_stream"]
    assert len(mid) == 15 and all(p.kind in STREAMED for p in mid)
    assert plan_round(200, 20, 15, seed=3) == planned  # a seed replays its round
    _path, body = mid[0].path_and_body("t")
    assert body["stream"] is True and body["standin_token_delay_s"] > 0
    token_ids = next(p for p in planned if p.kind == "token_ids").path_and_body("t")
    assert token_ids[0] == "/v1/completions" and all(isinstance(t, int) for t in token_ids[1]["prompt"])


def _answer(text: str, chat: bool) -> bytes:
    choice = {"message": {"content": text}} if chat else {"text": text}
    return json.dumps({"choices": [choice]}).encode()


def test_an_answer_counts_only_with_its_tokens_and_a_verified_report() -> None:
    planned = Planned(index=1, kind="chat", leaves="stays", words=20, tokens=3)
    report = json.dumps({"verified": True}, separators=(",", ":"))
    assert problem_of(planned, 200, _answer(f" {report} w1 w2", chat=True)) is None
    assert problem_of(planned, 502, b'{"error":{}}') == "502 b'{\"error\":{}}'"
    assert problem_of(planned, 200, _answer(f" {report} w1", chat=True)) == "2 tokens instead of 3"
    wrong = json.dumps({"verified": False}, separators=(",", ":"))
    assert "not the prompt's" in (problem_of(planned, 200, _answer(f" {wrong} w1 w2", chat=True)) or "")
    assert "unreadable" in (problem_of(planned, 200, b"not json") or "")
    streamed = Planned(index=2, kind="completion_stream", leaves="stays", words=20, tokens=2)
    events = [{"choices": [{"text": f" {report}"}]}, {"choices": [{"text": " w1"}]}]
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    assert problem_of(streamed, 200, raw + b"data: [DONE]\n\n") is None
    assert problem_of(streamed, 200, raw) == "the stream did not end with [DONE]"

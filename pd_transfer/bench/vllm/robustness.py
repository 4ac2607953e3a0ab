"""The robustness row of ``pd-transfer bench vllm``, last for each pair because it may kill the engine: one decode
request whose live params carry ``remote_block_ids: "zzz"``, then a normal P/D request."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pd_transfer.bench.vllm.pairs import Pair
from pd_transfer.bench.vllm.requests import decode_hop, prefill_hop
from pd_transfer.cluster.http_client import RequestFailed, answer_tokens

__all__ = ["robustness"]

ROBUSTNESS_TIMEOUT_S = 60.0  # for the malformed request and the normal one after it
ENGINE_DEATH_S = 1.0  # an engine that dies of the malformed request does so within this many seconds


def _outcome(answer: Mapping[str, Any], expected: list[str] | None) -> str:
    same = answer_tokens(answer) == expected
    return "answered, tokens equal the reference" if same else "answered, tokens DIFFER"


def _malformed(pair: Pair, prompt: list[int], expected: list[str] | None, out: dict[str, Any]) -> None:
    """The malformed request: a live request's params with ``remote_block_ids: "zzz"``; into ``out``."""
    tag = f"bench-{pair.connector}-zzz-{time.time_ns()}"
    live = prefill_hop(pair, prompt, tag)["kv_transfer_params"]
    bad = {**live, "remote_block_ids": "zzz"}
    out["params"] = {key: ("zzz" if key == "remote_block_ids" else "...") for key in bad}
    started = time.perf_counter()
    try:
        out["malformed"] = _outcome(decode_hop(pair, prompt, tag, bad, ROBUSTNESS_TIMEOUT_S), expected)
    except RequestFailed as error:
        out["malformed"] = str(error)
    out["malformed_s"] = round(time.perf_counter() - started, 2)


def _next_request(pair: Pair, prompt: list[int], expected: list[str] | None, out: dict[str, Any]) -> None:
    """A normal P/D request after the malformed one; into ``out``, with whether the decode still serves."""
    started = time.perf_counter()
    try:
        tag = f"bench-{pair.connector}-after-{time.time_ns()}"
        params = prefill_hop(pair, prompt, tag)["kv_transfer_params"]
        out["next_request"] = _outcome(decode_hop(pair, prompt, tag, params, ROBUSTNESS_TIMEOUT_S), expected)
        out["still_serving"] = True
    except RequestFailed as error:
        out["next_request"] = str(error)
        out["still_serving"] = False
    out["next_request_s"] = round(time.perf_counter() - started, 2)


def robustness(
    pair: Pair, bad_prompt: list[int], good_prompt: list[int], reference: Mapping[str, list[str]]
) -> dict[str, Any]:
    """A decode request with a live request's params but ``remote_block_ids: "zzz"``, then a normal P/D request:
    what each got (compared with ``reference["zzz"]`` and ``reference["after"]``, the plain server's tokens), their
    seconds, and whether the decode server still runs and answers /health afterwards."""
    out: dict[str, Any] = {}
    _malformed(pair, bad_prompt, reference.get("zzz"), out)
    # Not a synchronisation: the row reports the server's state after a death, which would come in this window.
    time.sleep(ENGINE_DEATH_S)
    _next_request(pair, good_prompt, reference.get("after"), out)
    out["decode_process_running"] = pair.decode.exit_code() is None
    out["decode_healthy"] = pair.decode.healthy()
    return out

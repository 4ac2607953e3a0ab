"""KV changed in a prefill's cache after its forward is caught by the decode's digests, never answered (issue 42).

A KV-moving stand-in prefill (``pd_transfer.sim.kv_standin``) changes one byte of every third request's KV once the
request is held (``--corrupt-every 3``: a block, plane and offset drawn at random), and three stand-in decodes read
from it, one per ``verify`` mode, by each transport in turn: ``tcp`` (the digest rides with the rows), NIXL reads,
NIXL pushes and ``process_vm_readv`` in place (read checks). Each decode compares every byte it pulled with the KV of
its own prompt, so a corrupted request that got through is an answer that says so (``verification failed``: on a real
engine, wrong tokens). What each mode must show, counted against the prefill's own count of what it corrupted:

- ``all``: every corrupted request fails its pull as a digest mismatch naming the block, none gets through, every
  other request is right (injected = detected);
- ``sample`` (the default: an eighth of a tcp read's rows, a 32nd of a NIXL read's or push's, the next run for the
  next request): the corrupted requests split into those whose changed byte fell in the rows checked (detected) and
  the others (through): both counts printed, their sum the injected (``process_vm_readv``, a same-host read, is
  checked under ``all`` only: all through);
- ``off``: every corrupted request gets through (the control: what the digests are for).

At the end neither side holds a block.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="the stand-ins serve HTTP with aiohttp (the 'proxy' extra)")

from kv_standins import Server, get_json, post_json, report_of, standins, wait_released, words

pytestmark = pytest.mark.timeout(240)

NUM_BLOCKS = 256
CORRUPT_EVERY = 3
REQUESTS = 24  # a decode's share: 8 corrupted
PROMPT_TOKENS = 256  # 16 blocks
HOP_TIMEOUT_S = 30.0
MODES = ("all", "sample", "off")


def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    return post_json(url, body, HOP_TIMEOUT_S)


def one_request(prefill: Server, decode: Server, tag: str, transport: str) -> tuple[str, bool, bool]:
    """A prompt prefilled and then decoded: what came of it ("right", "detected": a digest mismatch, "through": the
    decode's byte check failed), whether the prefill corrupted it and whether it pushed it (known of right ones)."""
    before = get_json(prefill.url + "/control/kv")["corrupted"]
    prompt = words(PROMPT_TOKENS, tag)
    status, text = post(
        prefill.url + "/v1/completions",
        {"model": "m", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 200, (status, text[:500])
    corrupted = get_json(prefill.url + "/control/kv")["corrupted"] == before + 1
    params = json.loads(text)["kv_transfer_params"]
    status, text = post(
        decode.url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}
    )
    if status == 200:
        report = report_of(json.loads(text)["choices"][0]["text"])
        assert report["verified"] is True, report  # a 200 is only ever right KV
        assert report["transport"] == transport, report
        return "right", corrupted, report["pushed_bytes"] == report["bytes"]
    assert status == 500, (status, text[:500])
    if "DigestMismatch" in text:
        assert "changed in the prefill's cache after request" in text, text[:500]  # names the block
        return "detected", corrupted, False
    assert "verification failed" in text, text[:500]
    return "through", corrupted, False


@pytest.mark.parametrize(("transport", "push"), [("tcp", "off"), ("nixl", "off"), ("nixl", "on"), ("host_cma", "off")])
def test_kv_corrupted_after_the_forward_is_caught_by_the_digests_of_each_mode(
    tmp_path: Path, transport: str, push: str
) -> None:
    """Each way a decode reads: ``tcp`` (the digest rides with the rows), NIXL reads, NIXL pushes (the prefill writes)
    and ``process_vm_readv`` in place (read checks: the decode's ``CheckRows`` names the rows, the prefill answers
    their digest)."""
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "PD_TRANSFER_PUSH": push, "PD_TRANSFER_PUSH_MIN_BYTES": "0"}
    common = ["--transport", transport, "--num-blocks", str(NUM_BLOCKS), "--lease-seconds", "30"]
    specs: dict[str, tuple[dict[str, str], list[str], str | None]] = {
        "prefill": (env, [*common, "--corrupt-every", str(CORRUPT_EVERY)], None)
    }
    for mode in MODES:
        specs[f"decode-{mode}"] = (env, [*common, "--engine-id", f"decode-{mode}", "--verify", mode], None)
    with standins(tmp_path, specs) as servers:
        prefill = servers["prefill"]
        counts: dict[str, Counter[tuple[str, bool]]] = {}
        for mode in MODES:
            outcomes = [
                one_request(prefill, servers[f"decode-{mode}"], f"{mode}-{n}-", transport) for n in range(REQUESTS)
            ]
            counts[mode] = Counter((outcome, corrupted) for outcome, corrupted, _ in outcomes)
            pushed = sum(was_pushed for _, _, was_pushed in outcomes)
            # pushed where asked (but the first few, read while the push target is set up), else read
            right = counts[mode]["right", False]
            assert (pushed >= right // 2) if push == "on" else pushed == 0, (pushed, counts[mode])
            got = counts[mode]
            injected = sum(count for (_, corrupted), count in got.items() if corrupted)
            print(
                f"\nverify={mode}: {REQUESTS} requests, {injected} corrupted; detected {got['detected', True]},"
                f" through {got['through', True]}; right {got['right', False]}"
            )
            assert injected == REQUESTS // CORRUPT_EVERY
            assert got["right", False] == REQUESTS - injected  # every clean request right
            assert got["detected", False] == got["through", False] == got["right", True] == 0
            if mode == "all":
                assert got["detected", True] == injected
            elif mode == "off":
                assert got["through", True] == injected
            else:
                assert got["detected", True] + got["through", True] == injected
        state = wait_released(prefill, timeout_s=10.0)
        assert state["blocks_held"] == state["requests_held"] == 0 and state["blocks_free"] == NUM_BLOCKS, state
        for mode in MODES:
            assert get_json(servers[f"decode-{mode}"].url + "/control/kv")["blocks_free"] == NUM_BLOCKS

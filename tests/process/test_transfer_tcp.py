"""Reads over UCX's tcp transport with pd-transfer's segment sizes (:mod:`pd_transfer.transfer.tcp`): a child
process owns the memory, this process reads it with NIXL; either side may be a peer left at UCX's own defaults.
(How the sizes are put in force, once per process: tests/unit/test_settings.py.)"""

from __future__ import annotations

import pytest
import torch
from agent_peer import NUM_REGIONS, pattern, read_whole_regions, served_peer

from pd_transfer.bench.transfer.ucx_transports import ucx_transports
from pd_transfer.settings import DEFAULTS, TCP_SEGMENT_ENV
from pd_transfer.transfer import TransferAgent

pytestmark = pytest.mark.timeout(180)

UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "8k", "UCX_TCP_RX_SEG_SIZE": "64k"}  # UCX's own


@pytest.mark.parametrize("at_ucx_defaults", ["target", "reader"])
def test_whole_regions_read_over_tcp_beside_a_peer_at_ucx_defaults(
    monkeypatch: pytest.MonkeyPatch, at_ucx_defaults: str
) -> None:
    # a read of whole regions goes as one descriptor of NUM_BLOCKS blocks each: many segments of either size
    if "tcp" not in ucx_transports({"UCX_TLS": "tcp,self"}):
        pytest.skip("UCX has no tcp transport here")
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    ours, theirs = TCP_SEGMENT_ENV, UCX_DEFAULTS
    reader_env, target_env = (ours, theirs) if at_ucx_defaults == "target" else (theirs, ours)
    for key, value in reader_env.items():
        monkeypatch.setenv(key, value)
    with (
        served_peer({"UCX_TLS": "tcp,self", **target_env}) as (conn, metadata, bases),
        TransferAgent("test-decode-tcp-segments", settings=DEFAULTS) as agent,
    ):
        order = list(reversed(range(NUM_REGIONS)))
        tensors = read_whole_regions(agent, metadata, bases, order, notification=b"whole", timeout_s=60)
        for region, tensor in enumerate(tensors):
            assert torch.equal(tensor, pattern(NUM_REGIONS - 1 - region)), region
        conn.send("notification")
        assert conn.poll(30) and conn.recv() == (agent.name, b"whole")


PORT_RANGE = (21400, 21460)  # below the kernel's ephemeral ports, where UCX's listeners land by default


@pytest.mark.parametrize("pinned", [True, False])
def test_ucx_tcp_port_range_pins_the_listeners_a_firewall_must_open(
    monkeypatch: pytest.MonkeyPatch, pinned: bool
) -> None:
    # across hosts a firewall must let peers reach each agent's UCX listener: UCX_TCP_PORT_RANGE (docs/deploy.md)
    # puts every listener of a prefill-like agent in the range, and a read over TCP goes through it
    if "tcp" not in ucx_transports({"UCX_TLS": "tcp,self"}):
        pytest.skip("UCX has no tcp transport here")
    low, high = PORT_RANGE
    env = {"UCX_TLS": "tcp,self", **({"UCX_TCP_PORT_RANGE": f"{low}-{high}"} if pinned else {})}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with (
        served_peer(env, serves_reads=True) as (conn, metadata, bases),
        TransferAgent("test-decode-port-range", settings=DEFAULTS) as agent,
    ):
        tensors = read_whole_regions(agent, metadata, bases, list(range(NUM_REGIONS)), timeout_s=60)
        assert all(torch.equal(tensor, pattern(region)) for region, tensor in enumerate(tensors))
        conn.send("listening_ports")
        assert conn.poll(30)
        ports = conn.recv()
    assert ports, "the agent listens on no TCP port"
    inside = {port for port in ports if low <= port <= high}
    assert inside == (ports if pinned else set()), (pinned, sorted(ports))

"""``pd-transfer bench transfer --netns``: the TCP benchmark across a veth pair, the prefill (and the stream's
sender) inside a network namespace of its own, the decode in this process's namespace: two hosts on one wire.

Needs root and ``ip`` (iproute2); otherwise the section says why it was skipped. The namespace and the veth are
deleted again on the way out (deleting the namespace takes its end of the veth, and the pair with it). Addresses
come from 10.232.N.0/24 with N not in use on this host. The veth's byte counters, read before and after, show the
KV crossed it.

``--wire-gbit RATE`` makes the veth a wire of that rate: a token bucket (``tc qdisc ... tbf``, iproute2) on each
end's egress. An unshaped veth is as fast as the host's copies, so there the cores, not a wire, bound both the
stream and the reads; a shaped one stands for a NIC slower than memory (10 or 25 Gbit/s Ethernet), the case of
clusters without RDMA.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pd_transfer.settings import Settings, process_environment
from pd_transfer.sim.shape import Shape

from .tcp import run

_IP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Veth:
    """A namespace ``ns`` holding ``inner`` (``inner_address``); ``outer`` (``outer_address``) here."""

    ns: str
    outer: str
    inner: str
    outer_address: str
    inner_address: str


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()[:300]}")
    return done.stdout


def free_subnet(prefix: str = "10.232", lowest: int = 20) -> str:
    """A ``PREFIX.N`` (N from ``lowest``, 200 of them, drawn at random) that no address of this host's is in: a /24
    for a bridge or veth of one's own (the benchmarks draw from 10.232, the tests from 10.231: never each other's)."""
    used = _ip("-4", "-o", "addr", "show")
    for _ in range(50):
        subnet = f"{prefix}.{secrets.randbelow(200) + lowest}"
        if f" {subnet}." not in used:
            return subnet
    raise RuntimeError(f"no free {prefix}.N.0/24 subnet")


def make_veth() -> Veth:
    """Create the namespace and the veth pair, addresses up; deletes what it made and raises RuntimeError on any
    failure."""
    tag = f"{os.getpid() % 100000}{secrets.token_hex(1)}"
    subnet = free_subnet()
    net = Veth(f"pdt-bench-{tag}", f"pdtb{tag}o", f"pdtb{tag}i", f"{subnet}.1", f"{subnet}.2")
    _ip("netns", "add", net.ns)
    try:
        _ip("link", "add", net.outer, "type", "veth", "peer", "name", net.inner)
        _ip("link", "set", net.inner, "netns", net.ns)
        _ip("addr", "add", f"{net.outer_address}/24", "dev", net.outer)
        _ip("link", "set", net.outer, "up")
        _ip("-n", net.ns, "addr", "add", f"{net.inner_address}/24", "dev", net.inner)
        _ip("-n", net.ns, "link", "set", net.inner, "up")
        _ip("-n", net.ns, "link", "set", "lo", "up")
    except RuntimeError:
        delete_veth(net)
        raise
    return net


def delete_veth(net: Veth) -> None:
    """Delete the namespace (with its end of the pair) and the outer end if it is still there (best effort)."""
    for args in (("netns", "delete", net.ns), ("link", "delete", net.outer)):
        subprocess.run(["ip", *args], capture_output=True, timeout=_IP_TIMEOUT_S, check=False)


def shape_wire(net: Veth, gbit: float) -> None:
    """Limit both ends of ``net``'s veth to ``gbit`` Gbit/s each way (a token bucket of 1/250 s of traffic, at least
    1 MiB, queueing at most 50 ms). Raises ``ValueError`` for a rate that is not positive and finite,
    ``RuntimeError`` when ``tc`` fails (e.g. no tbf in this kernel)."""
    if not _is_rate(gbit):
        raise ValueError(f"wire rate must be a positive number of Gbit/s, got {gbit}")
    if shutil.which("tc") is None:
        raise RuntimeError("shaping the veth needs iproute2's tc")
    burst = max(2**20, int(gbit * 1e9 / 8 / 250))
    qdisc = ["qdisc", "add", "dev"]
    limits = ["root", "tbf", "rate", f"{gbit}gbit", "burst", str(burst), "latency", "50ms"]
    for prefix, device in (([], net.outer), (["ip", "netns", "exec", net.ns], net.inner)):
        command = [*prefix, "tc", *qdisc, device, *limits]
        done = subprocess.run(command, capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: exit {done.returncode}: {done.stderr.strip()[:300]}")


def add_wire_argument(parser: argparse.ArgumentParser, when: str = "") -> None:
    """``--wire-gbit RATE`` (``wire_gbit``, None when absent): a positive, finite number of Gbit/s."""
    parser.add_argument(
        "--wire-gbit",
        type=_positive_gbit,
        metavar="RATE",
        help=f"{when}shape the veth to RATE Gbit/s each way (tc tbf), a NIC slower than the host's copies",
    )


def _is_rate(gbit: float) -> bool:
    return 0 < gbit < float("inf")  # false for NaN too


def _positive_gbit(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not _is_rate(value):
        raise argparse.ArgumentTypeError(f"a positive number of Gbit/s, not {text[:40]!r}")
    return value


def rx_bytes(device: str) -> int:
    """Bytes ``device`` (in this namespace) has received so far."""
    return int(Path(f"/sys/class/net/{device}/statistics/rx_bytes").read_text())


@contextmanager
def veth_or_reason(wire_gbit: float | None = None) -> Iterator[Veth | str]:
    """A namespace and veth pair from :func:`make_veth`, shaped to ``wire_gbit`` Gbit/s if given
    (:func:`shape_wire`), deleted on the way out; or, where that cannot be done here, the reason (a string)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        yield "network namespaces need root and iproute2's ip"
        return
    try:
        net = make_veth()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        yield f"could not build a namespace and veth: {error}"
        return
    try:
        if wire_gbit is not None:
            try:
                shape_wire(net, wire_gbit)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
                yield f"could not shape the veth: {error}"
                return
        yield net
    finally:
        delete_veth(net)


def run_netns(
    shape: Shape,
    *,
    repeats: int,
    idle_seconds: float,
    wire_gbit: float | None = None,
    busy_prefill: bool = False,
    settings: Settings,
) -> dict:
    """:func:`.tcp.run` with the prefill across a veth, shaped to ``wire_gbit`` Gbit/s if given
    (:func:`shape_wire`; the result's ``wire_gbit``); ``{"skipped": reason}`` where that cannot be built."""
    with veth_or_reason(wire_gbit) as net:
        if isinstance(net, str):
            return {"skipped": net}
        received = rx_bytes(net.outer)
        with process_environment({"UCX_NET_DEVICES": net.outer}):
            result = run(
                shape,
                repeats=repeats,
                idle_seconds=idle_seconds,
                prefill_host=net.inner_address,
                decode_host=net.outer_address,
                stream_prefix=["ip", "netns", "exec", net.ns],
                prefill_options={"netns": net.ns, "ucx_net_devices": net.inner},
                busy_prefill=busy_prefill,
                settings=settings,
            )
        result["veth_rx_bytes"] = rx_bytes(net.outer) - received
        result["wire_gbit"] = wire_gbit
    return result

"""Test helpers: two network namespaces (``p`` and ``d``, a prefill's host and a decode's) with one veth each into a
bridge on this host that has an address too, as separate machines on one network would be; and the ways to cut
the wire between them (a link down, a ``tc`` filter dropping some of a side's packets) and heal it.

Everything made is deleted, newest first, by :func:`delete_network`; :func:`network_or_skip` skips with a one-line
reason where namespaces cannot be made (not root, no ``ip``, no permission). Every command is bounded (30 s)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pd_transfer.bench.transfer.netns import free_subnet

HOST_NUMBER = {"host": 1, "p": 2, "d": 3}  # last octet of each address on the bridge's /24
COMMAND_TIMEOUT_S = 30.0


def run(command: list[str]) -> str:
    """Runs ``command`` (bounded); its stdout, or ``RuntimeError`` naming its exit and stderr."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Network:
    """Namespaces ``p`` and ``d`` with one veth each into a bridge on this host that also has an address."""

    suffix: str
    subnet: str  # "10.231.N"
    made: list[tuple[str, str]]  # ("netns" | "link", name), in creation order

    @property
    def bridge(self) -> str:
        return f"pdtbr-{self.suffix}"

    def ns(self, side: str) -> str:
        return f"pdt-{side}-{self.suffix}"

    def veth(self, side: str) -> str:
        """The interface inside namespace ``side``."""
        return f"pdt{side}-{self.suffix}"

    def host_end(self, side: str) -> str:
        return f"pdth{side}-{self.suffix}"

    def address(self, side: str) -> str:
        return f"{self.subnet}.{HOST_NUMBER[side]}"

    def counters(self, side: str) -> dict[str, int]:
        """rx/tx bytes of namespace ``side``'s veth (/sys/class/net as that namespace sees it)."""
        path = f"/sys/class/net/{self.veth(side)}/statistics"
        out = run(["ip", "netns", "exec", self.ns(side), "cat", f"{path}/rx_bytes", f"{path}/tx_bytes"]).split()
        return {"rx": int(out[0]), "tx": int(out[1])}

    # ---- cutting the wire ----

    def set_link(self, side: str, up: bool) -> None:
        """Side ``side``'s veth, at its host end, up or down: down, nothing reaches that side or leaves it (its
        own end stays up, without a carrier: its addresses and routes stay)."""
        run(["ip", "link", "set", self.host_end(side), "up" if up else "down"])

    def drop_to(self, side: str, other: str, *, port: int | None = None, but_port: int | None = None) -> None:
        """Side ``side`` drops what it sends to ``other``: all of it; with ``port`` only packets from or to that
        port; with ``but_port`` all but those. Made of what even a kernel without tc actions or ``prio`` and
        ``netem`` qdiscs has: an ``htb`` root whose default class passes everything, and a class whose queue holds
        nothing (``pfifo limit 0``: every packet classified there is dropped), chosen by ``u32`` filters (the
        first matching, by ascending prio, wins). Undone by :meth:`undrop`."""
        device, ns = self.veth(side), self.ns(side)
        tc = ["ip", "netns", "exec", ns, "tc"]
        run([*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "20", "r2q", "100000"])
        for classid in ("1:10", "1:20"):
            run([*tc, "class", "add", "dev", device, "parent", "1:", "classid", classid, "htb", "rate", "10gbit"])
        run([*tc, "qdisc", "add", "dev", device, "parent", "1:10", "handle", "10:", "pfifo", "limit", "0"])
        to = ["match", "ip", "dst", f"{self.address(other)}/32"]
        base = [*tc, "filter", "add", "dev", device, "parent", "1:", "protocol", "ip"]
        if but_port is not None:
            for field in ("sport", "dport"):
                run([*base, "prio", "1", "u32", *to, "match", "ip", field, str(but_port), "0xffff", "flowid", "1:20"])
        if port is not None:
            for field in ("sport", "dport"):
                run([*base, "prio", "2", "u32", *to, "match", "ip", field, str(port), "0xffff", "flowid", "1:10"])
        else:
            run([*base, "prio", "2", "u32", *to, "flowid", "1:10"])

    def dropped(self, side: str) -> int:
        """Packets :meth:`drop_to` dropped on side ``side`` so far."""
        out = run(["ip", "netns", "exec", self.ns(side), "tc", "-s", "qdisc", "show", "dev", self.veth(side)])
        for block in out.split("qdisc ")[1:]:
            if block.startswith("pfifo 10:"):
                return int(block.split("dropped ")[1].split(",")[0])
        return 0

    def undrop(self, side: str) -> None:
        """Removes :meth:`drop_to`'s qdiscs and filters from side ``side``'s veth."""
        run(["ip", "netns", "exec", self.ns(side), "tc", "qdisc", "del", "dev", self.veth(side), "root"])


def delete_network(net: Network) -> list[str]:
    """Deletes what was made, newest first (a veth's host end takes its peer along); returns what failed."""
    problems = []
    for kind, name in reversed(net.made):
        command = ["ip", "netns", "delete", name] if kind == "netns" else ["ip", "link", "delete", name]
        try:
            run(command)
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            problems.append(str(error))
    return problems


def create_network() -> Network:
    """Builds the namespaces, veths and bridge; on any failure deletes what was made and raises RuntimeError."""
    net = Network(secrets.token_hex(3), free_subnet("10.231", 50), [])
    try:
        for side in ("p", "d"):
            run(["ip", "netns", "add", net.ns(side)])
            net.made.append(("netns", net.ns(side)))
        run(["ip", "link", "add", net.bridge, "type", "bridge"])
        net.made.append(("link", net.bridge))
        run(["ip", "addr", "add", f"{net.address('host')}/24", "dev", net.bridge])
        run(["ip", "link", "set", net.bridge, "up"])
        for side in ("p", "d"):
            run(["ip", "link", "add", net.host_end(side), "type", "veth", "peer", "name", net.veth(side)])
            net.made.append(("link", net.host_end(side)))
            run(["ip", "link", "set", net.veth(side), "netns", net.ns(side)])
            run(["ip", "link", "set", net.host_end(side), "master", net.bridge, "up"])
            run(["ip", "-n", net.ns(side), "addr", "add", f"{net.address(side)}/24", "dev", net.veth(side)])
            run(["ip", "-n", net.ns(side), "link", "set", net.veth(side), "up"])
            run(["ip", "-n", net.ns(side), "link", "set", "lo", "up"])
    except (RuntimeError, subprocess.TimeoutExpired):
        delete_network(net)
        raise
    return net


@contextlib.contextmanager
def network_or_skip(*, needs_tc: bool = False) -> Iterator[Network]:
    """A :class:`Network` for the block's duration (deleted after, checked gone); skips the test with a one-line
    reason where it cannot be made (or, with ``needs_tc``, where iproute2's ``tc`` is missing)."""
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: the 'ip' command (iproute2) is not installed")
    if needs_tc and shutil.which("tc") is None:
        pytest.skip("cutting the wire: the 'tc' command (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces: creating them needs root")
    try:
        net = create_network()
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"network namespaces cannot be created here: {error}")
    try:
        yield net
    finally:
        problems = delete_network(net)
        left = [name for name in run(["ip", "netns", "list"]).split() if name.endswith(net.suffix)]
        assert not problems and not left, (problems, left)

"""ZMQ TCP endpoints for host names, IPv4 and IPv6 literals."""

from __future__ import annotations


def is_ipv6(host: str) -> bool:
    return ":" in host


def tcp_endpoint(host: str, port: int | str) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed; ``port`` may be ``"*"`` to bind any free port."""
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if is_ipv6(host) else f"tcp://{host}:{port}"


def peer_name(host: str, port: int) -> str:
    """``host:port`` for messages, IPv6 literals bracketed."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"

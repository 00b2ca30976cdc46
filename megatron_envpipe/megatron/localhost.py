"""Rendezvous on this machine: a free TCP port for a single-node process group."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nobody listens on right now (the OS picks it; another process may still take it first)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

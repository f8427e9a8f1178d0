"""A loopback port for a server that another process, or a later call, will start.

A port found free now is bound a moment later by someone else; meanwhile the kernel may hand it to any outgoing
connection or to any `bind` on port 0, which all draw from the ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`). On a busy machine (a panel running several runs, a test suite) that race
is lost now and then, and a replica fails to start with "address already in use". So the port is picked at random
below that range, where the kernel never assigns one by itself, and checked to be free when picked; where the range
cannot be read (not Linux) the kernel picks.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20_000  # ports below are more often taken by services people run (5000, 8000, 8080, 9000, ...)
_TRIES = 50
# Not the `random` module's shared generator: processes that seed it alike (a trainer seeds everything) would pick
# the same ports in the same order.
_RANDOM = random.SystemRandom()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now and that the kernel will not give to anything else meanwhile."""
    ceiling = _ephemeral_floor()
    if ceiling - LOWEST >= 1_000:
        for _ in range(_TRIES):
            port = _RANDOM.randrange(LOWEST, ceiling)
            if _bindable(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_floor() -> int:
    """The lowest port the kernel picks by itself; 0 where that cannot be read."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True

"""A loopback port for a server that another process, or a later call, will start.

A port found free now is bound a moment later by someone else; meanwhile the kernel may hand it to any outgoing
connection or to any `bind` on port 0, which all draw from the ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`). On a busy machine (a panel running several runs, a test suite) that race
is lost now and then, and a replica fails to start with "address already in use". So the port is picked at random
below that range, where the kernel never assigns one by itself, and checked to be free when picked; where the range
cannot be read (not Linux) the kernel picks.

Two pickers can still draw the same free port while neither server is up yet: an engine binds its port seconds
after the replica picked it (CI lost that race once with three test workers side by side). So every port picked
is also written down, in a file shared by this user's processes, and passed over by every other picker until its
server has had `RESERVED_FOR_S` to bind it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20_000  # ports below are more often taken by services people run (5000, 8000, 8080, 9000, ...)
UPTIME = Path("/proc/uptime")
RESERVATIONS = Path(tempfile.gettempdir()) / f"grpo-panel-ports-{os.getuid()}.json"
RESERVED_FOR_S = 300.0  # longer than any engine takes to bind its port once started; a bound port is passed over anyway
_TRIES = 50
# Not the `random` module's shared generator: processes that seed it alike (a trainer seeds everything) would pick
# the same ports in the same order.
_RANDOM = random.SystemRandom()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now and that neither the kernel nor another picker gives out meanwhile."""
    ceiling = _ephemeral_floor()
    if ceiling - LOWEST >= 1_000:
        with _reservations() as reserved:
            for _ in range(_TRIES):
                port = _RANDOM.randrange(LOWEST, ceiling)
                if port not in reserved and _bindable(host, port):
                    reserved[port] = _since_boot()
                    return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        kernel_pick: int = sock.getsockname()[1]
        return kernel_pick


@contextlib.contextmanager
def _reservations() -> Iterator[dict[int, float]]:
    """The ports picked in the last `RESERVED_FOR_S` (port: seconds since boot), held under an exclusive lock and
    written back."""
    with open(os.open(RESERVATIONS, os.O_RDWR | os.O_CREAT, 0o600), "r+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            now = _since_boot()
            reserved = {port: at for port, at in _read(file).items() if 0 <= now - at < RESERVED_FOR_S}
            yield reserved
            file.seek(0)
            file.truncate()
            json.dump(reserved, file)
            file.flush()  # before the lock is let go, not when the file is closed after it
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _read(file: TextIO) -> dict[int, float]:
    try:
        return {int(port): float(at) for port, at in json.loads(file.read() or "{}").items()}
    except (ValueError, TypeError, AttributeError):  # a file cut short or written by hand: start afresh
        return {}


def _since_boot() -> float:
    """Seconds since the machine started, read from the kernel: the same for every process, whatever clock it is
    shown (a job under libfaketime, hours ahead, would otherwise write reservations that lapse at once)."""
    return float(UPTIME.read_text().split()[0])


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

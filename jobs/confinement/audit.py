"""Python's audit hook for confined code: the first line, for clear messages. The OS layers (confine.py) hold past it
against ctypes and whatever reaches the kernel without an audited call; the hook says in words what was refused."""

from __future__ import annotations

import sys
from typing import Any

BLOCKED = {
    "socket.connect": "open network connections",
    "socket.bind": "open network sockets",
    "socket.sendto": "send network packets",
    "socket.getaddrinfo": "resolve host names",
    "subprocess.Popen": "start processes",
    "os.system": "run shell commands",
    "os.exec": "run programs",
    "os.posix_spawn": "start processes",
    "os.spawn": "start processes",
    "os.fork": "fork",
    "os.forkpty": "fork",
    "os.kill": "signal processes",
    "os.killpg": "signal processes",
    "ctypes.dlopen": "load C libraries",
    "ctypes.dlsym": "call C functions",
    "ctypes.call_function": "call C functions",
}


class SandboxViolation(RuntimeError):
    pass


def install(who: str) -> None:
    """Refuse the blocked events from now on, for good, saying `who` ("reward code") may not do them."""

    def guard(event: str, _args: Any) -> None:
        if event in BLOCKED:
            raise SandboxViolation(f"{who} may not {BLOCKED[event]} ({event}) in the sandbox")

    sys.addaudithook(guard)

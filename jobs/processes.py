"""Stopping local job processes cleanly: SIGTERM to the whole process group, SIGKILL after a grace period.

Every local job runs in its own process group (its children — a spawned rollout worker, a vLLM server, a proxy —
belong to it), so signalling the group leaves nothing behind. Used by the local launcher and by a trainer stopping
its replicas.
"""

from __future__ import annotations

import os
import signal
import time


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def terminate_group(pgid: int, grace: float = 10.0) -> bool:
    """SIGTERM the group, wait up to `grace` seconds, then SIGKILL. Returns True if it had to kill.

    The caller that started the group leader must reap it (a zombie still counts as a member of its group).
    """
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return False
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True

"""Stopping local job processes cleanly: SIGTERM to the whole process group, SIGKILL after a grace period.

Every local job runs in its own process group (its children — a spawned rollout worker, a vLLM server, a proxy —
belong to it), so signalling the group leaves nothing behind. Used by the local launcher and by a trainer stopping
its replicas.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def terminate_group(pgid: int, grace: float = 10.0, reap: Callable[[], object] | None = None) -> bool:
    """SIGTERM the group, wait up to `grace` seconds, then SIGKILL. Returns True if it had to kill.

    A caller that is the group leader's parent passes `reap` (e.g. `popen.poll`), so the exited leader is collected
    rather than lingering as a zombie that still counts as a member of the group.
    """
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if reap is not None:
            reap()
        if not group_alive(pgid):
            return False
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    if reap is not None:
        reap()
    return True

"""A rollout loop for a real TRL rollout child that only waits to be stopped, after reporting a failure if asked.

TRL's worker spawns a child that builds its loop class, starts a thread waiting on the parent's stop event, and calls
`run()`. A test swaps in this loop (`worker._loop_cls`) to get that child without a model or a replica, and freezes
it (SIGSTOP) to stand in for a child that is dying when the trainer stops it: alive, but its threads never run again.
"""

from __future__ import annotations

import asyncio
from typing import Any


class IdleRolloutLoop:
    def __init__(self, *, fail: bool = False, failed_event: Any, **_: Any) -> None:
        # TRL's stop watcher sets `_stop_event` through `_loop`: both names are its contract with a loop.
        self._loop = asyncio.new_event_loop()
        self._stop_event = asyncio.Event()
        self.fail, self.failed_event = fail, failed_event

    def run(self) -> None:
        if self.fail:
            self.failed_event.set()  # what TRL's loop does when a reward has failed too often, before it exits
        self._loop.run_until_complete(self._stop_event.wait())
        self._loop.close()

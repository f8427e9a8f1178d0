"""Per-owner limits, so that one user of a shared panel cannot crowd out the others.

A Space's CPU runs every user's checks (dataset reads, reward code in the sandbox) and smoke tests, and every run it
launches bills its owner: a script looping on /launch_run, or a reward test held down, would otherwise take the
panel from everyone. Limits count per owner, in the services (the pages and the public API go through them alike),
and a refusal says which limit, what is using it and what to do.

On this machine there is one owner and the limits are generous; a Space sets its own through the environment
(`GRPO_PANEL_LIMITS`, e.g. `runs=2,checks=1,reward_tests=10`).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

from backend import settings


class LimitReached(RuntimeError):
    """An owner is at one of their limits; the message says which and what to do."""


@dataclass(frozen=True)
class OwnerLimits:
    runs: int = 4  # runs launching or training at once (each bills replicas and a trainer)
    checks: int = 2  # checks ("Check settings", /launch_run's) and smoke tests at once
    reward_tests: int = 30  # reward-code test executions in any 60 s

    @classmethod
    def from_env(cls, text: str | None = None) -> OwnerLimits:
        """`runs=2,checks=1,reward_tests=10` (any subset; the rest keep their defaults)."""
        text = (settings.LIMITS.get() or "") if text is None else text
        names = {field.name for field in fields(cls)}
        values: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            if name.strip() not in names or not value.strip().isdigit() or int(value) < 1:
                raise ValueError(
                    f"{settings.LIMITS.name}: {item!r} is not a limit; use e.g. runs=2,checks=1,reward_tests=10 "
                    f"(names: {', '.join(sorted(names))}; each a whole number of at least 1)"
                )
            values[name.strip()] = int(value)
        return replace(cls(), **values)


class OwnerLimiter:
    """Counts what each owner is using against `OwnerLimits`. Thread-safe: the panel serves pages in threads."""

    def __init__(self, limits: OwnerLimits | None = None, clock: Callable[[], float] = time.monotonic):
        self.limits = limits or OwnerLimits.from_env()
        self._clock = clock
        self._lock = threading.Lock()
        self._checks: dict[str, int] = defaultdict(int)
        self._reward_tests: dict[str, deque[float]] = defaultdict(deque)

    def check_runs(self, owner: str, active: list[str]) -> None:
        """Refuse a launch when `active` (the owner's runs launching or training) is already at the limit."""
        if len(active) >= self.limits.runs:
            raise LimitReached(
                f"you have {len(active)} runs active ({', '.join(sorted(active))}), the most one user may run at once "
                f"on this panel ({self.limits.runs}); stop one or wait for one to finish, then launch again"
            )

    @contextmanager
    def checking(self, owner: str, what: str = "check") -> Iterator[None]:
        """Hold one of the owner's check slots for the duration of a check or a smoke test."""
        with self._lock:
            if self._checks[owner] >= self.limits.checks:
                raise LimitReached(
                    f"{self._checks[owner]} of your checks or smoke tests are still running, the most one user may run "
                    f"at once on this panel ({self.limits.checks}); wait for one to end, then start this {what} again"
                )
            self._checks[owner] += 1
        try:
            yield
        finally:
            with self._lock:
                self._checks[owner] -= 1

    def count_reward_tests(self, owner: str, executions: int) -> None:
        """Count `executions` reward-code runs, refusing them all when they would pass the per-minute limit."""
        with self._lock:
            now, recent = self._clock(), self._reward_tests[owner]
            while recent and recent[0] <= now - 60:
                recent.popleft()
            if len(recent) + executions > self.limits.reward_tests:
                wait = 60 - (now - recent[0]) if recent else 60
                raise LimitReached(
                    f"reward tests: {len(recent)} ran in the last minute and these would add {executions}, more than "
                    f"one user may run per minute on this panel ({self.limits.reward_tests}); try again in "
                    f"{max(1, round(wait))} s"
                )
            recent.extend([now] * executions)

"""Bounded retries with exponential backoff and jitter, for every network call the product makes.

A retry loop that never ends hides an outage; one that never waits hammers a struggling service. Every caller states
what counts as transient, and gets at most `attempts` tries spread over a bounded time.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    base_delay: float = 0.2
    max_delay: float = 5.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (1-based): exponential, capped, with full jitter."""
        ceiling = min(self.max_delay, self.base_delay * (2 ** (attempt - 1)))
        return random.uniform(ceiling / 2, ceiling)


def retry_call(
    fn: Callable[[], T],
    is_transient: Callable[[BaseException], bool],
    policy: RetryPolicy = RetryPolicy(),
    what: str = "call",
) -> T:
    """Call `fn`, retrying transient failures up to `policy.attempts` times in all."""
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as error:
            if attempt == policy.attempts or not is_transient(error):
                raise
            delay = policy.delay(attempt)
            log.warning(
                "%s failed (%s); retry %d/%d in %.2fs", what, _short(error), attempt, policy.attempts - 1, delay
            )
            time.sleep(delay)
    raise AssertionError("unreachable")


async def retry_async(
    fn: Callable[[], Awaitable[T]],
    is_transient: Callable[[BaseException], bool],
    policy: RetryPolicy = RetryPolicy(),
    what: str = "call",
) -> T:
    """The asyncio twin of `retry_call`."""
    for attempt in range(1, policy.attempts + 1):
        try:
            return await fn()
        except Exception as error:
            if attempt == policy.attempts or not is_transient(error):
                raise
            delay = policy.delay(attempt)
            log.warning(
                "%s failed (%s); retry %d/%d in %.2fs", what, _short(error), attempt, policy.attempts - 1, delay
            )
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__

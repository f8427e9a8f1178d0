"""Bounded retries with exponential backoff and jitter, for every network call the product makes (tenacity).

A retry loop that never ends hides an outage; one that never waits hammers a struggling service. Every caller states
what counts as transient, and gets at most `attempts` tries spread over a bounded time. Every retrying call in jobs/
and backend/ goes through `retry_call` or `retry_async`, except jobs/bootstrap.py, which runs on an image's bare
Python before any package is installed.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import AsyncRetrying, BaseRetrying, RetryCallState, Retrying, retry_if_exception, stop_after_attempt

T = TypeVar("T")
R = TypeVar("R", bound=BaseRetrying)  # Retrying or AsyncRetrying
Wait = Callable[[BaseException, float], float]  # (the error, the policy's delay) -> the seconds to wait instead
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    base_delay: float = 0.2
    max_delay: float = 5.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (1-based): exponential, capped, with equal jitter."""
        ceiling = min(self.max_delay, self.base_delay * (2 ** (attempt - 1)))
        return random.uniform(ceiling / 2, ceiling)


def retry_call(
    fn: Callable[[], T],
    is_transient: Callable[[BaseException], bool],
    policy: RetryPolicy = RetryPolicy(),
    what: str = "call",
    wait: Wait | None = None,
) -> T:
    """Call `fn`, retrying transient failures up to `policy.attempts` times in all; the last failure is raised.
    `wait` may replace the policy's delay for an error that says how long to wait (a 429's Retry-After)."""
    return _retrying(Retrying, is_transient, policy, what, wait)(fn)


async def retry_async(
    fn: Callable[[], Awaitable[T]],
    is_transient: Callable[[BaseException], bool],
    policy: RetryPolicy = RetryPolicy(),
    what: str = "call",
    wait: Wait | None = None,
) -> T:
    """`retry_call` for a coroutine function: waits with asyncio.sleep."""
    return await _retrying(AsyncRetrying, is_transient, policy, what, wait)(fn)


def _retrying(
    kind: type[R], is_transient: Callable[[BaseException], bool], policy: RetryPolicy, what: str, wait: Wait | None
) -> R:
    def delay(state: RetryCallState) -> float:
        planned = policy.delay(state.attempt_number)
        return wait(_error(state), planned) if wait is not None else planned

    def announce(state: RetryCallState) -> None:
        seconds = state.next_action.sleep if state.next_action is not None else 0.0
        retry = f"retry {state.attempt_number}/{policy.attempts - 1} in {seconds:.2f}s"
        log.warning("%s failed (%s); %s", what, _short(_error(state)), retry)

    return kind(
        stop=stop_after_attempt(policy.attempts),
        wait=delay,
        retry=retry_if_exception(is_transient),
        before_sleep=announce,
        reraise=True,
    )


def _error(state: RetryCallState) -> BaseException:
    assert state.outcome is not None and state.outcome.failed
    error = state.outcome.exception()
    assert error is not None  # a failed outcome holds its exception
    return error


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__

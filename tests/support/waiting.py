"""Waiting for something another process or thread does: the one polling loop every test uses."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 5.0, interval: float = 0.05, what: str = "condition") -> T:
    """Call `predicate` every `interval` seconds until it returns something truthy, and return that.

    Raises TimeoutError naming `what` if `timeout` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while True:
        if value := predicate():
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:.0f}s")
        time.sleep(interval)

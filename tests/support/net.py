"""Small helpers for loopback servers."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request


def accepted(listener: socket.socket) -> bool:
    """Whether a connection was waiting on the (non-blocking) listener; it is closed."""
    try:
        connection, _ = listener.accept()
    except BlockingIOError:
        return False
    connection.close()
    return True


def wait_http(url: str, timeout: float = 30.0) -> None:
    """Wait until `url` answers at all (any HTTP status counts as up)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not come up within {timeout:.0f}s") from None
            time.sleep(0.1)

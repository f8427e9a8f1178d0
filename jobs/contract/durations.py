"""Durations as people write them in a spec ('90s', '30m', '4h') and as the panel says them back ('7m 05s').

Both directions live together so that a limit a user typed and the time a job has spent against it read alike, in
the panel's pages and in the messages the backend writes.
"""

from __future__ import annotations

import re

MAX_DURATION_S = 7 * 86400  # HF Jobs refuses longer timeouts; no limit of ours needs more
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_DURATION_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def timeout_seconds(value: str | int | float) -> int:
    """Seconds in a timeout written as 90, '90s', '30m', '2h' or '1d' (the forms HF Jobs accepts)."""
    match = _DURATION.match(str(value).strip())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{value!r} is not a duration; write e.g. '90s', '30m', '4h' or '1d'")
    seconds = float(match.group(1)) * _DURATION_SECONDS[match.group(2)]
    if seconds > MAX_DURATION_S:
        raise ValueError(f"{value!r} is longer than 7 days; jobs that long are not allowed")
    return int(seconds)


def duration(seconds: float | None) -> str:
    """'42s', '7m 05s', '3h 12m', '2d 4h'; '—' when unknown."""
    if seconds is None or seconds < 0:
        return "—"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h"

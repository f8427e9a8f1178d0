"""Numbers as people read them: durations, money, sizes, times — one place, so every page says it the same way."""

from __future__ import annotations

import time

from jobs.contract.durations import duration as duration  # re-exported: every page formats through here


def money(usd: float | None, per_hour: bool = False) -> str:
    if usd is None:
        return "—"
    text = f"${usd:,.2f}" if usd >= 0.01 or usd == 0 else f"${usd:.4f}"
    return text + ("/h" if per_hour else "")


def size(num_bytes: int | None) -> str:
    if not num_bytes:
        return "—"
    value = float(num_bytes)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1000
    return f"{value:,.1f} GB"


def number(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "—"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 10**-digits):
        return f"{value:.2e}"
    return f"{value:.{digits}f}"


def clock(epoch: float | None) -> str:
    """Local wall-clock time, with the date when it is not today."""
    if epoch is None:
        return "—"
    moment = time.localtime(epoch)
    if time.strftime("%Y-%m-%d", moment) == time.strftime("%Y-%m-%d"):
        return time.strftime("%H:%M:%S", moment)
    return time.strftime("%Y-%m-%d %H:%M", moment)


def ago(epoch: float | None, now: float | None = None) -> str:
    if epoch is None:
        return "—"
    return duration((now or time.time()) - epoch) + " ago"

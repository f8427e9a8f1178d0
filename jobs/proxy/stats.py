"""The proxy's counters, and their snapshots: `GET /proxy/stats` and `telemetry/proxy/<seq>.json` every 10 s.

A snapshot's shape is `ProxySnapshot` below, with its parts beside it (the replicas' `ReplicaView` in upstreams.py,
the router's counters in router.py). Every counter is a total since the proxy started; durations are in seconds;
`time` is the writing machine's clock, for display only. A latency window (`LatencySummary`) covers the last 1024
syncs, its values None before the first. Of the adapters' counters, `load_retries` counts replica-level re-sends of a
load (a replica that had not seen the new version yet); `rolled_back` counts loads undone on the replicas that had
accepted them because another one failed; `evaluation_loads` counts versions loaded under their evaluation name for
held-out evaluation, and `evaluating` names those loaded now.
Error kinds: upstream_<connect|timeout|disconnected|protocol>, admission, publish, current_pointer, telemetry,
upstreams_file, bad_request, no_replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TypedDict

from jobs.contract import layout
from jobs.proxy.router import RouterCounters
from jobs.proxy.upstreams import ReplicaView
from jobs.store import ObjectStore, StoreError
from jobs.telemetry import next_sequence

log = logging.getLogger(__name__)
_WINDOW = 1024


class LatencySummary(TypedDict):
    """A latency window: the count of all syncs, and the last, median, 95th percentile and slowest of the window's."""

    count: int
    last: float | None
    p50: float | None
    p95: float | None
    max: float | None


class HealthView(TypedDict):
    healthy: int
    known: int
    min_healthy: int
    ok: bool


class RoutingView(RouterCounters):
    retried: int
    block_size: int
    imbalance: int
    lead_over: str
    group_allowance: int


class AdaptersView(TypedDict):
    current: int | None
    live: list[int]
    evaluating: list[str]
    step: int | None
    loads_ok: int
    loads_failed: int
    load_retries: int
    rolled_back: int
    unloads_ok: int
    unloads_failed: int
    replays: int
    evaluation_loads: int


class SyncTimes(TypedDict):
    upload: LatencySummary
    broadcast: LatencySummary
    total: LatencySummary


class MembershipView(TypedDict):
    ejections: int
    readmissions: int


class ProxySnapshot(TypedDict):
    """A snapshot (see above): the body of `GET /proxy/stats` and of each telemetry chunk."""

    time: float
    started: float
    run_id: str
    health: HealthView
    replicas: list[ReplicaView]
    routing: RoutingView
    adapters: AdaptersView
    sync_s: SyncTimes
    membership: MembershipView
    errors: dict[str, int]


class Window:
    """The last `_WINDOW` durations of one kind, summarised as percentiles."""

    def __init__(self) -> None:
        self._values: deque[float] = deque(maxlen=_WINDOW)
        self.count = 0

    def add(self, seconds: float) -> None:
        self._values.append(seconds)
        self.count += 1

    def summary(self) -> LatencySummary:
        if not self._values:
            return {"count": 0, "last": None, "p50": None, "p95": None, "max": None}
        ordered = sorted(self._values)
        return {
            "count": self.count,
            "last": round(self._values[-1], 4),
            "p50": round(percentile(ordered, 0.50), 4),
            "p95": round(percentile(ordered, 0.95), 4),
            "max": round(ordered[-1], 4),
        }


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty list."""
    index = min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))
    return ordered[index]


class Stats:
    def __init__(self) -> None:
        self.started = time.time()
        self.errors: Counter[str] = Counter()
        self.adapters: Counter[str] = Counter()
        self.retried = 0
        self.upload = Window()
        self.broadcast = Window()
        self.total = Window()

    def count_error(self, kind: str) -> None:
        self.errors[kind] += 1


class TelemetryWriter:
    """Writes a snapshot to `telemetry/proxy/<seq>.json` every period; seq continues after existing chunks."""

    def __init__(self, store: ObjectStore, run_id: str, snapshot: Callable[[], ProxySnapshot], stats: Stats):
        self._store = store
        self._run_id = run_id
        self._snapshot = snapshot
        self._stats = stats
        self._seq: int | None = None

    def _put(self, data: bytes) -> None:
        if self._seq is None:
            self._seq = next_sequence(self._store, self._run_id, "proxy")
        self._store.put_bytes(layout.telemetry_key(self._run_id, "proxy", self._seq), data)
        self._seq += 1

    async def write(self) -> None:
        """Write one snapshot. It is taken on the event loop, which alone changes what it reads; only the upload runs
        in a thread."""
        data = json.dumps(self._snapshot()).encode()
        try:
            await asyncio.to_thread(self._put, data)
        except (StoreError, OSError) as error:
            self._stats.count_error("telemetry")
            log.warning("could not write proxy telemetry: %s", error)

    async def loop(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            await self.write()

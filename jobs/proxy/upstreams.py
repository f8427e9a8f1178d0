"""The replica pool: who the replicas are, which are healthy, ejection and re-admission.

Replicas come from `--upstream` flags (fixed for the proxy's life) and from the store file
`control/upstreams.json` (`{"replicas": [{"role": "replica-0", "url": "..."}], "updated": <float>}`), polled so that
replicas can be added or replaced mid-run. A replica whose role gets a new URL is a new replica.

States: `new` (never admitted) -> `admitting` -> `healthy` -> `ejected` -> `admitting` -> ... Only healthy replicas
are routed to and take part in broadcasts. A replica is ejected when a health check fails or when a request to it
fails in transport and an immediate re-check fails too (the public recipe kept routing to dead replicas: they fail
fast, so they looked least loaded). It is admitted only after the admission hook (adapter replay, owned by
`adapters.AdapterSync`) succeeded, so a routable replica always serves every live adapter version. Each admission
gets a fresh router slot: a replica that comes back is assumed to have lost its prefix cache.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from jobs.proxy.http_client import HttpClient, Origin, UpstreamError
from jobs.store import ObjectNotFound, ObjectStore, StoreError

log = logging.getLogger(__name__)

NEW, ADMITTING, HEALTHY, EJECTED = "new", "admitting", "healthy", "ejected"


class ReplicaView(TypedDict):
    """A replica as `GET /proxy/replicas` and the proxy's snapshots show it (stats.py)."""

    role: str
    url: str
    state: str  # new, admitting, healthy or ejected
    healthy: bool
    routed: int
    inflight: int
    failed: int
    loaded_versions: list[int]
    admissions: int
    ejections: int
    last_error: str | None
    since: float


@dataclass(eq=False)
class Replica:
    role: str
    origin: Origin
    source: str  # "flag" or "store"
    state: str = NEW
    slot: int = -1
    inflight: int = 0
    routed: int = 0
    failed: int = 0
    loaded: set[int] = field(default_factory=set)  # adapter versions this proxy loaded onto it
    admissions: int = 0
    ejections: int = 0
    last_error: str | None = None
    changed: float = field(default_factory=time.time)
    probing: bool = False
    # Set when the replica was ejected for serving the wrong policy (the trainer's audit): its adapters cannot be
    # trusted, so its admission unloads every one of them and loads the live versions afresh.
    reload: bool = False

    @property
    def url(self) -> str:
        return self.origin.url

    def describe(self) -> ReplicaView:
        return {
            "role": self.role,
            "url": self.url,
            "state": self.state,
            "healthy": self.state == HEALTHY,
            "routed": self.routed,
            "inflight": self.inflight,
            "failed": self.failed,
            "loaded_versions": sorted(self.loaded),
            "admissions": self.admissions,
            "ejections": self.ejections,
            "last_error": self.last_error,
            "since": self.changed,
        }


class UpstreamsFileError(ValueError):
    pass


def parse_upstreams_file(data: bytes) -> list[tuple[str, str]]:
    """(role, url) pairs from `control/upstreams.json`; UpstreamsFileError says what is wrong."""
    try:
        body = json.loads(data)
        entries = body["replicas"]
        if not isinstance(entries, list):
            raise TypeError
        pairs = [(str(entry["role"]), str(entry["url"])) for entry in entries]
    except (ValueError, KeyError, TypeError):
        raise UpstreamsFileError(
            'expected {"replicas": [{"role": "replica-0", "url": "http://..."}], "updated": <time>}'
        ) from None
    for _, url in pairs:
        try:
            Origin.parse(url)
        except ValueError as error:
            raise UpstreamsFileError(str(error)) from None
    return pairs


class Membership:
    """Tracks replicas and their health. `routable` is the list the router picks from (rebuilt on every change)."""

    def __init__(
        self,
        client: HttpClient,
        auth_headers: list[tuple[str, str]],
        health_timeout: float,
        admit: Callable[[Replica, Callable[[], None]], Awaitable[None]],
        count_error: Callable[[str], None],
    ):
        self._client = client
        self._auth = auth_headers
        self._health_timeout = health_timeout
        self._admit_hook = admit
        self._count_error = count_error
        self.replicas: dict[str, Replica] = {}
        self.routable: list[Replica] = []
        self.ejections = 0
        self.readmissions = 0
        self._next_slot = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- membership ------------------------------------------------------------------------------------------------

    def set_upstreams(self, source: str, pairs: list[tuple[str, str]]) -> None:
        """Make the replicas from `source` exactly `pairs`; replicas from the other source are kept."""
        wanted = {Origin.parse(url).url: role for role, url in pairs}
        for url, replica in list(self.replicas.items()):
            if replica.source == source and url not in wanted:
                log.info("replica %s (%s) left the upstream list", replica.role, url)
                self._remove(replica)
        for url, role in wanted.items():
            known = self.replicas.get(url)
            if known is None:
                self.replicas[url] = Replica(role=role, origin=Origin.parse(url), source=source)
                log.info("replica %s (%s) joined; it is admitted once healthy", role, url)
            elif source == "store" and known.role != role:
                known.role = role
        self._rebuild()

    def _remove(self, replica: Replica) -> None:
        self.replicas.pop(replica.url, None)
        replica.state = EJECTED
        self._client.forget(replica.origin)

    def _rebuild(self) -> None:
        self.routable = [replica for replica in self.replicas.values() if replica.state == HEALTHY]

    def find(self, role: str) -> Replica | None:
        for replica in self.replicas.values():
            if replica.role == role or replica.url == role:
                return replica
        return None

    @property
    def healthy_count(self) -> int:
        return len(self.routable)

    # -- health ----------------------------------------------------------------------------------------------------

    async def check(self, replica: Replica) -> str | None:
        """None if the replica answers /health with 200, else why not."""
        try:
            response = await self._client.request(
                replica.origin, "GET", "/health", self._auth, timeout=self._health_timeout
            )
        except UpstreamError as error:
            return f"health check failed: {error}"
        if response.status != 200:
            return f"health check answered {response.status}"
        return None

    async def check_all(self) -> None:
        """One round of health checks: eject failing replicas, start admitting recovered ones."""
        replicas = [replica for replica in self.replicas.values() if replica.state != ADMITTING]
        results = await asyncio.gather(*(self.check(replica) for replica in replicas))
        for replica, problem in zip(replicas, results, strict=True):
            if self.replicas.get(replica.url) is not replica:
                continue  # removed meanwhile
            if replica.state == HEALTHY and problem is not None:
                self.eject(replica, problem)
            elif replica.state in (NEW, EJECTED):
                if problem is None:
                    self._spawn(self.admit(replica))
                else:
                    replica.last_error = problem

    def eject(self, replica: Replica, reason: str) -> None:
        if replica.state != HEALTHY:
            return
        replica.state = EJECTED
        replica.ejections += 1
        replica.last_error = reason
        replica.changed = time.time()
        self.ejections += 1
        self._client.forget(replica.origin)
        self._rebuild()
        log.warning("ejected replica %s (%s): %s", replica.role, replica.url, reason)

    def suspect(self, replica: Replica, error: UpstreamError) -> None:
        """A request to `replica` failed in transport: check it now, eject it if the check fails too."""
        self._count_error(f"upstream_{error.kind}")
        replica.failed += 1
        if replica.state != HEALTHY or replica.probing:
            return
        replica.probing = True

        async def probe() -> None:
            try:
                problem = await self.check(replica)
                if problem is not None:
                    self.eject(replica, f"{error}; then {problem}")
            finally:
                replica.probing = False

        self._spawn(probe())

    async def admit(self, replica: Replica) -> bool:
        """Run the admission hook; it calls `activate` (which makes the replica routable) once it is ready."""
        if replica.state == ADMITTING:
            return False
        previous = replica.state
        replica.state = ADMITTING

        def activate() -> None:
            if self.replicas.get(replica.url) is not replica:
                raise RuntimeError("the replica left the upstream list")
            if replica.admissions:
                self.readmissions += 1
            replica.admissions += 1
            replica.slot = self._next_slot
            self._next_slot += 1
            replica.state = HEALTHY
            replica.last_error = None
            replica.changed = time.time()
            self._rebuild()
            log.info("admitted replica %s (%s)", replica.role, replica.url)

        try:
            await self._admit_hook(replica, activate)
        except Exception as error:  # the hook says what failed; the replica stays out and is tried again later
            if replica.state == ADMITTING:
                replica.state = previous if previous != HEALTHY else EJECTED
            problem = f"admission failed: {error}"
            if problem != replica.last_error:  # tried at every health check: say it once, not every 2 s
                log.warning("could not admit replica %s (%s): %s", replica.role, replica.url, error)
            replica.last_error = problem
            self._count_error("admission")
            return False
        return replica.state == HEALTHY

    def _spawn(self, coroutine: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def health_loop(self, interval: float) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # a failed round must not end the loop
                log.exception("health check round failed")
            await asyncio.sleep(interval)

    async def watch_upstreams_file(self, store: ObjectStore, key: str, interval: float) -> None:
        """Poll the store's upstream list; apply it whenever its content changes."""
        last: bytes | None = None
        while True:
            try:
                data: bytes | None = await asyncio.to_thread(store.get_bytes, key)
            except ObjectNotFound:
                data = b""
            except StoreError as error:
                self._count_error("upstreams_file")
                log.warning("cannot read %s: %s", key, error)
                data = last
            if data is not None and data != last:
                last = data
                try:
                    pairs = parse_upstreams_file(data) if data else []
                except UpstreamsFileError as error:
                    self._count_error("upstreams_file")
                    log.error("ignoring %s: %s", key, error)
                else:
                    self.set_upstreams("store", pairs)
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

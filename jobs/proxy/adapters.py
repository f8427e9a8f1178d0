"""Adapter versions across the replicas: publish, broadcast all-or-nothing, unload, pause/resume, replay.

Load (`POST /v1/load_lora_adapter` from TRL, naming `trl-policy-vN` and a directory on the trainer's disk):

1. The directory is published to the store as version N (files, then the manifest with the optimizer step the
   trainer last reported through `/proxy/trainer_state`). A store that keeps failing transiently (5xx, timeouts,
   resets beyond the store's own retries) is retried with backoff for about a minute: TRL treats a failed load as
   fatal, so a brief store outage must not end the run. An interrupted upload has no manifest, so no replica can
   load it; the retry uploads every file again and writes the manifest last.
2. Every healthy replica is asked to load `<run_id>-vN` from `store:runs/<run_id>/adapters/v00000N/`; its sidecar
   materialises that from the store. A replica answering 404 "No adapter found" cannot see the version yet and is
   re-sent the load alone every `load_retry_interval` until `load_deadline`. A transport failure is retried a few
   times with backoff, a 503 (the sidecar could not read the store just then) for as long as a store outage is
   ridden out (below); a replica that stays unreachable, or is ejected meanwhile, is left out (it gets the version on
   re-admission) and the sync goes on with the others, as long as `min_healthy` accepted.
3. Any other failure undoes the load on the replicas that accepted it (one that fails to unload it is ejected, and
   its re-admission unloads it) and answers TRL with an error it treats as fatal but not as "runtime LoRA
   disabled": never 404 (TRL's reading of 404), 504 for a version that never became visible. A policy name
   therefore never exists on only some routable replicas, where requests for it would fail.
4. On success `adapters/CURRENT` is set to N.

While fewer than `min_healthy` replicas are routable, a load, pause or resume waits for them (up to
`load_deadline`) instead of failing the sync at once. So does a load that fell short only because replicas became
unreachable during it: it is undone where it was taken, and sent again once enough replicas are routable.

Unload, pause, resume and reset_prefix_cache go to every healthy replica; failures are counted, never hidden. One
lock orders all of these and the final step of a re-admission, so a replica joins between two broadcasts, never in
the middle of one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.contract import derived, layout
from jobs.proxy.http_client import ClientResponse, HttpClient, UpstreamError
from jobs.proxy.http_server import Response, content_type_header
from jobs.proxy.names import AdapterNames, BadName
from jobs.proxy.router import Router
from jobs.proxy.stats import Stats
from jobs.proxy.upstreams import EJECTED, Membership, Replica
from jobs.retry import RetryPolicy, retry_async
from jobs.store import ObjectStore, StoreError, publish_through_outage
from jobs.store.published import OUTAGE_RETRY

log = logging.getLogger(__name__)

_NOT_VISIBLE = "No adapter found"
_ALREADY_LOADED = "already been loaded"
_TRANSPORT_RETRY = RetryPolicy(attempts=3, base_delay=0.2, max_delay=2.0)
_RESUME_RETRY = RetryPolicy(attempts=2, base_delay=0.2, max_delay=2.0)  # after the broadcast's own try: three in all
_TEXT = [("Content-Type", "text/plain; charset=utf-8")]


def text_response(status: int, message: str) -> Response:
    return Response(status, message.encode(), list(_TEXT))


class _NotResumed(Exception):
    """A replica answered a resume with an error, or could not be reached."""


@dataclass
class _Outcome:
    replica: Replica
    kind: str  # "ok", "not_visible" (no adapter found until the deadline), "failed", "unreachable"
    status: int = 0
    detail: str = ""
    body: bytes = b""
    headers: list[tuple[str, str]] | None = None


class AdapterSync:
    def __init__(
        self,
        *,
        run_id: str,
        names: AdapterNames,
        store: ObjectStore,
        client: HttpClient,
        membership: Membership,
        router: Router,
        stats: Stats,
        auth_headers: list[tuple[str, str]],
        min_healthy: int,
        load_retry_interval: float,
        load_deadline: float,
        control_timeout: float,
    ):
        self.run_id = run_id
        self.names = names
        self.store = store
        self.client = client
        self.membership = membership
        self.router = router
        self.stats = stats
        self.auth = auth_headers
        self.min_healthy = min_healthy
        self.load_retry_interval = load_retry_interval
        self.load_deadline = load_deadline
        self.control_timeout = control_timeout
        self.live: set[int] = set()
        self.current: int | None = None
        self.step: int | None = None
        self.paused_query: str | None = None  # the query of the last pause, while paused
        self.evaluating: dict[str, int] = {}  # evaluation names loaded on the replicas -> their version
        self.lock = asyncio.Lock()

    # -- load ------------------------------------------------------------------------------------------------------

    def _parse_load(self, body: bytes) -> tuple[int, Path]:
        try:
            request = json.loads(body)
        except ValueError:
            raise BadName("the body is not JSON") from None
        if not isinstance(request, dict):
            raise BadName("the body must be a JSON object with lora_name and lora_path")
        version = self.names.version(request.get("lora_name"))
        path = request.get("lora_path")
        if not isinstance(path, str) or not os.path.isabs(path) or ".." in Path(path).parts:
            raise BadName(
                f"lora_path {path!r} must be an absolute directory on the trainer's disk, without '..' "
                "(the proxy publishes it to the store)"
            )
        if not Path(path).is_dir():
            raise BadName(f"lora_path {path!r} is not a directory on the trainer machine; nothing to publish")
        return version, Path(path)

    async def load(self, body: bytes) -> Response:
        try:
            version, path = self._parse_load(body)
        except BadName as error:
            self.stats.count_error("bad_request")
            return text_response(400, f"proxy: {error}")
        trl_name = derived.trl_adapter_name(version)
        started = time.monotonic()
        deadline = started + self.load_deadline
        uploaded: float | None = None
        undone = ""  # what an earlier try rolled back, for the error if none succeeds
        while True:
            await self._await_replicas(deadline)
            async with self.lock:
                replicas = list(self.membership.routable)
                if len(replicas) < self.min_healthy:
                    self.stats.adapters["loads_failed"] += 1
                    return text_response(503, self._too_few(trl_name, len(replicas)) + undone)
                if uploaded is None:
                    try:
                        await asyncio.to_thread(self._publish, version, path)
                    except (StoreError, OSError, ValueError) as error:
                        self.stats.count_error("publish")
                        self.stats.adapters["loads_failed"] += 1
                        log.error("publishing %s from %s failed: %s", trl_name, path, error)
                        return text_response(
                            500, f"proxy: publishing {trl_name} to {self.store.describe()} failed: {error}"
                        )
                    uploaded = time.monotonic()
                outcomes = await asyncio.gather(*(self._load_on(replica, version, deadline) for replica in replicas))
                if self._replicas_dropped_out(outcomes) and time.monotonic() < deadline:
                    undone = await self._drop_out(trl_name, version, outcomes)
                    continue  # outside the lock: a replaced replica can be admitted meanwhile
                response = await self._settle_load(trl_name, version, outcomes)
                if response.status == 200:
                    finished = time.monotonic()
                    self.stats.upload.add(uploaded - started)
                    self.stats.broadcast.add(finished - uploaded)
                    self.stats.total.add(finished - started)
                return response

    def _replicas_dropped_out(self, outcomes: list[_Outcome]) -> bool:
        """Whether a load fell short only because replicas became unreachable during it (none refused it).

        Replicas die between two health checks: a load sent to every replica just after they were all lost finds
        them routable, cannot reach them, and would fail the sync (fatal to TRL) before the trainer's replica
        watchdog could end the run saying why. Such a load waits for replicas again instead, as one sent after the
        health checks noticed would.
        """
        accepted = sum(outcome.kind == "ok" for outcome in outcomes)
        return accepted < self.min_healthy and all(outcome.kind in ("ok", "unreachable") for outcome in outcomes)

    async def _drop_out(self, trl_name: str, version: int, outcomes: list[_Outcome]) -> str:
        """Eject the replicas that could not be reached and undo the load on those that took it, before a retry;
        what the rollback did, for the error TRL gets if no retry succeeds."""
        for outcome in outcomes:
            if outcome.kind == "unreachable":
                self.membership.eject(outcome.replica, f"load of {trl_name} failed: {outcome.detail}")
        accepted = [outcome.replica for outcome in outcomes if outcome.kind == "ok"]
        undone = await self._rollback(trl_name, version, accepted) if accepted else ""
        self.stats.adapters["load_retries"] += 1
        log.warning("%s%s; waiting for replicas to retry", self._too_few(trl_name, len(accepted)), undone)
        return undone

    def _publish(self, version: int, path: Path) -> None:
        prefix = layout.adapter_prefix(self.run_id, version)
        meta = {
            "version": version,
            "step": self.step,
            "run_id": self.run_id,
            "trl_name": derived.trl_adapter_name(version),
        }
        publish_through_outage(self.store, prefix, path, meta)

    async def _settle_load(self, trl_name: str, version: int, outcomes: list[_Outcome]) -> Response:
        accepted = [outcome for outcome in outcomes if outcome.kind == "ok"]
        failed = [outcome for outcome in outcomes if outcome.kind in ("failed", "not_visible")]
        for outcome in outcomes:
            if outcome.kind == "unreachable":
                self.membership.eject(outcome.replica, f"load of {trl_name} failed: {outcome.detail}")
        if not failed and len(accepted) >= self.min_healthy:
            for outcome in accepted:
                outcome.replica.loaded.add(version)
            self.live.add(version)
            self.current = version
            self.stats.adapters["loads_ok"] += 1
            await self._write_current(version)
            first = accepted[0]
            return Response(200, first.body, content_type_header(first.headers) or list(_TEXT))
        self.stats.adapters["loads_failed"] += 1
        undone = await self._rollback(trl_name, version, [outcome.replica for outcome in accepted]) if accepted else ""
        if failed:
            details = "; ".join(f"{outcome.replica.role}: {outcome.detail}" for outcome in failed)
            statuses = [outcome.status for outcome in failed if outcome.kind == "failed"]
            # 404 means "runtime LoRA updating disabled" to TRL: never pass one through.
            status = (502 if statuses[0] == 404 else statuses[0]) if statuses else 504
            message = f"proxy: loading {trl_name} failed on {len(failed)}/{len(outcomes)} replicas ({details}){undone}"
            log.error("%s", message)
            return text_response(status, message)
        message = self._too_few(trl_name, len(accepted)) + undone
        log.error("%s", message)
        return text_response(503, message)

    def _too_few(self, trl_name: str, healthy: int) -> str:
        return (
            f"proxy: cannot load {trl_name}: {healthy} replica(s) can take it, --min-healthy is {self.min_healthy}; "
            "see GET /proxy/replicas for why the others are out"
        )

    async def _load_on(
        self, replica: Replica, version: int, deadline: float, replay: bool = False, name: str | None = None
    ) -> _Outcome:
        """Load one version onto one replica (under `name`, else its policy name), retrying while it cannot see the
        version yet."""
        name = name or derived.replica_adapter_name(self.run_id, version)
        body = json.dumps(
            {"lora_name": name, "lora_path": layout.adapter_ref(self.run_id, version), "load_inplace": False}
        ).encode()
        transport_failures = transient = 0
        while True:
            timeout = max(deadline - time.monotonic(), 1.0)
            try:
                response = await self._post(replica, "/v1/load_lora_adapter", body, timeout)
            except UpstreamError as error:
                transport_failures += 1
                self.stats.count_error(f"upstream_{error.kind}")
                if transport_failures >= _TRANSPORT_RETRY.attempts or time.monotonic() >= deadline:
                    return _Outcome(replica, "unreachable", detail=str(error))
                self.stats.adapters["load_retries"] += 1
                await asyncio.sleep(_TRANSPORT_RETRY.delay(transport_failures))
                continue
            if response.status == 200 or (replay and response.status == 400 and _ALREADY_LOADED in response.text):
                return _Outcome(replica, "ok", 200, body=response.body, headers=response.headers)
            detail = f"{response.status} {self.names.restore_in_text(response.text.strip())[:300]}"
            if response.status == 503 and replica.state == EJECTED:
                return _Outcome(replica, "unreachable", detail=detail)  # its health check failed meanwhile
            if response.status == 503 and transient + 1 < OUTAGE_RETRY.attempts and time.monotonic() < deadline:
                transient += 1  # the replica's store read failed for now (the sidecar's 503): try again shortly
                self.stats.adapters["load_retries"] += 1
                await asyncio.sleep(min(OUTAGE_RETRY.delay(transient), max(deadline - time.monotonic(), 0)))
                continue
            if response.status == 404 and _NOT_VISIBLE in response.text:
                if time.monotonic() + self.load_retry_interval >= deadline:
                    return _Outcome(
                        replica,
                        "not_visible",
                        504,
                        f"the version was still not visible after {self.load_deadline:.0f}s ({detail})",
                    )
                self.stats.adapters["load_retries"] += 1
                await asyncio.sleep(self.load_retry_interval)
                continue
            return _Outcome(replica, "failed", response.status, detail)

    async def _rollback(self, trl_name: str, version: int, replicas: list[Replica]) -> str:
        """Unload a version that did not go live from the replicas that took it; what to add to the error for TRL.

        A replica that did not unload it may still serve it, so it is ejected: its re-admission unloads the version
        (and keeps it out while that fails), and no routable replica serves a version that is not live.
        """
        self.stats.adapters["rolled_back"] += 1
        results = await asyncio.gather(*(self._unload_on(replica, version) for replica in replicas))
        undone, failures = [], []
        for replica, problem in zip(replicas, results, strict=True):
            if problem is None:
                undone.append(replica)
                continue
            self.stats.adapters["unloads_failed"] += 1
            log.error("rollback: unloading version %d from %s failed: %s", version, replica.role, problem)
            self.membership.eject(replica, f"rolling back {trl_name} failed: {problem}")
            failures.append(f"{replica.role} ({problem})")
        said = f"; rolled back on {_roles_of(undone)}" if undone else ""
        if failures:
            said += f"; rollback failed on {', '.join(failures)}, ejected until re-admission unloads it"
        return said

    async def _write_current(self, version: int) -> None:
        try:
            await asyncio.to_thread(self.store.put_bytes, layout.current_key(self.run_id), str(version).encode())
        except (StoreError, OSError) as error:
            self.stats.count_error("current_pointer")
            log.error("could not update adapters/CURRENT to %d: %s", version, error)

    # -- unload ----------------------------------------------------------------------------------------------------

    async def unload(self, body: bytes) -> Response:
        try:
            request = json.loads(body)
            version = self.names.version(request.get("lora_name") if isinstance(request, dict) else None)
        except (ValueError, BadName) as error:
            self.stats.count_error("bad_request")
            detail = error if isinstance(error, BadName) else "the body is not JSON"
            return text_response(400, f"proxy: {detail}")
        trl_name = derived.trl_adapter_name(version)
        name = derived.replica_adapter_name(self.run_id, version)
        async with self.lock:
            replicas = list(self.membership.routable)
            results = await asyncio.gather(*(self._unload_on(replica, version) for replica in replicas))
            self.live.discard(version)
            self.router.forget_model(name)
            problems = []
            for replica, problem in zip(replicas, results, strict=True):
                if problem is None:
                    self.stats.adapters["unloads_ok"] += 1
                else:
                    self.stats.adapters["unloads_failed"] += 1
                    problems.append(f"{replica.role}: {problem}")
        if problems:
            message = f"proxy: unloading {trl_name} failed on {len(problems)}/{len(replicas)} replicas: " + "; ".join(
                problems
            )
            log.error("%s", message)
            return text_response(502, message)
        return text_response(200, f"Success: LoRA adapter '{trl_name}' removed successfully.")

    async def _unload_on(self, replica: Replica, version: int, name: str | None = None) -> str | None:
        """Unload a version (under `name`, else its policy name) from one replica; None on success, else what went
        wrong. An unload sent again after its answer was lost finds nothing to unload: its 404 (vLLM's "cannot be
        found") then means the lost one did it."""
        body = json.dumps({"lora_name": name or derived.replica_adapter_name(self.run_id, version)}).encode()
        try:
            response, tries = await self._post_retrying(replica, "/v1/unload_lora_adapter", body)
        except UpstreamError as error:
            self.membership.suspect(replica, error)
            return str(error)
        if name is None:  # on an error too: a replica that refuses an unload does not serve it
            replica.loaded.discard(version)
        if response.status == 200 or (response.status == 404 and tries > 1):
            return None
        return f"{response.status} {self.names.restore_in_text(response.text.strip())[:300]}"

    async def _post_retrying(self, replica: Replica, target: str, body: bytes) -> tuple[ClientResponse, int]:
        """POST a control request (unload, pause, resume, ...) and its number of tries. The HTTP client never sends
        one twice, since its bytes may have reached the replica; these requests may be repeated, so a transport
        failure is retried here, a few times with backoff. Raises the last UpstreamError."""
        tries = 0

        async def post() -> ClientResponse:
            nonlocal tries
            tries += 1
            try:
                return await self._post(replica, target, body, self.control_timeout)
            except UpstreamError as error:
                self.stats.count_error(f"upstream_{error.kind}")
                raise

        transient = lambda error: isinstance(error, UpstreamError)  # noqa: E731
        response = await retry_async(post, transient, _TRANSPORT_RETRY, what=f"{target} on {replica.role}")
        return response, tries

    # -- evaluation ------------------------------------------------------------------------------------------------

    async def load_for_evaluation(self, body: bytes) -> Response:
        """Load a published version under its evaluation name on every routable replica, all-or-nothing like a
        policy load (undone where it was taken if any replica fails), without publishing it or touching the live
        versions: held-out evaluation scores it there by that name, then unloads it."""
        named = self._evaluation_name(body)
        if isinstance(named, Response):
            return named
        version, name = named
        if not await asyncio.to_thread(
            self.store.exists, layout.manifest_key(layout.adapter_prefix(self.run_id, version))
        ):
            return text_response(404, f"proxy: v{version} is not published; evaluate a published version")
        async with self.lock:
            replicas = list(self.membership.routable)
            if not replicas:
                return text_response(503, f"proxy: no replica can take {name}; see GET /proxy/replicas")
            for left, left_version in list(self.evaluating.items()):  # one evaluation slot: a leftover goes first
                await self._unload_everywhere(left, left_version, replicas)
            deadline = time.monotonic() + self.load_deadline
            outcomes = await asyncio.gather(*(self._load_on(r, version, deadline, name=name) for r in replicas))
            refused = [outcome for outcome in outcomes if outcome.kind != "ok"]
            self.evaluating[name] = version
            if not refused:
                self.stats.adapters["evaluation_loads"] += 1
                return text_response(200, name)
            await self._unload_everywhere(name, version, [o.replica for o in outcomes if o.kind == "ok"])
        details = "; ".join(f"{outcome.replica.role}: {outcome.detail}" for outcome in refused)
        return text_response(
            502, f"proxy: loading {name} failed on {len(refused)}/{len(outcomes)} replicas ({details})"
        )

    async def unload_for_evaluation(self, body: bytes) -> Response:
        """Unload a version's evaluation name from every routable replica."""
        named = self._evaluation_name(body)
        if isinstance(named, Response):
            return named
        version, name = named
        async with self.lock:
            await self._unload_everywhere(name, version, list(self.membership.routable))
        return text_response(200, f"Success: {name} removed.")

    def _evaluation_name(self, body: bytes) -> tuple[int, str] | Response:
        """The version a `{"version": N}` body names (N >= 1) and its evaluation name, or the 400 saying what to
        send."""
        try:
            version = json.loads(body)["version"]
        except (ValueError, KeyError, TypeError):
            version = None
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            self.stats.count_error("bad_request")
            return text_response(400, 'proxy: send {"version": N}, a published adapter version (N >= 1)')
        return version, derived.eval_adapter_name(self.run_id, version)

    async def _unload_everywhere(self, name: str, version: int, replicas: list[Replica]) -> None:
        """Unload an evaluation name; a replica that keeps it is ejected, and its re-admission clears it."""
        self.evaluating.pop(name, None)
        self.router.forget_model(name)
        results = await asyncio.gather(*(self._unload_on(replica, version, name) for replica in replicas))
        for replica, problem in zip(replicas, results, strict=True):
            if problem is not None and "404" not in problem[:3]:
                self.membership.eject(replica, f"unloading {name} failed: {problem}")

    # -- pause, resume, reset_prefix_cache -------------------------------------------------------------------------

    async def control(self, path: str, query: str) -> Response:
        """Broadcast /pause, /resume or /reset_prefix_cache to every healthy replica.

        A replica that cannot be reached at all is ejected rather than failing the call (it is resynchronised when it
        is re-admitted), so losing a replica does not stop the run as long as `min_healthy` answered; with fewer left,
        the call is held and tried again as replicas come back, up to `load_deadline`. A replica that answers with an
        error fails the call; a failed pause is undone on the replicas that paused, and a replica that cannot resume
        is ejected, never left in rotation paused.
        """
        target = f"{path}?{query}" if query else path
        deadline = time.monotonic() + self.load_deadline
        while True:
            await self._await_replicas(deadline)
            async with self.lock:
                response, too_few = await self._control_once(path, query, target)
            if not too_few or time.monotonic() >= deadline:
                return response

    async def _control_once(self, path: str, query: str, target: str) -> tuple[Response, bool]:
        """One broadcast, under the lock: its response, and whether it failed only for want of replicas."""
        replicas = list(self.membership.routable)
        results = await asyncio.gather(*(self._control_on(replica, target) for replica in replicas))
        done = [(replica, detail) for replica, (kind, detail) in zip(replicas, results, strict=True) if kind == "ok"]
        failed = [
            (replica, detail) for replica, (kind, detail) in zip(replicas, results, strict=True) if kind == "failed"
        ]
        for replica, (kind, detail) in zip(replicas, results, strict=True):
            if kind == "unreachable":
                self.membership.eject(replica, f"{path} could not reach it: {detail}")
        if path == "/resume":
            for replica, _ in failed:
                if not await self._resume_again(replica):
                    self.membership.eject(replica, "it did not resume after a pause")
            self.paused_query = None
            failed = []
        if failed or len(done) < self.min_healthy:
            if path == "/pause" and done:
                await asyncio.gather(*(self._control_on(replica, "/resume") for replica, _ in done))
            details = "; ".join(f"{replica.role}: {problem}" for replica, problem in failed) or "too few replicas"
            undone = f"; resumed {_roles_of([replica for replica, _ in done])}" if path == "/pause" and done else ""
            message = (
                f"proxy: {path} failed on {len(replicas) - len(done)}/{len(replicas)} replicas ({details}){undone};"
                " see GET /proxy/replicas"
            )
            return text_response(502, message), not failed
        if path == "/pause":
            self.paused_query = query
        elif path == "/reset_prefix_cache":
            self.router.clear()
        response = done[0][1]
        return Response(200, response.body, content_type_header(response.headers) or list(_TEXT)), False

    async def _control_on(self, replica: Replica, target: str) -> tuple[str, Any]:
        """("ok", response) on 200, ("failed", what it answered) or ("unreachable", the transport error)."""
        try:
            response, _ = await self._post_retrying(replica, target, b"")
        except UpstreamError as error:
            return "unreachable", str(error)
        if response.status != 200:
            return "failed", f"{response.status} {response.text.strip()[:300]}"
        return "ok", response

    async def _resume_again(self, replica: Replica) -> bool:
        """Resume a replica whose resume failed, a few times with backoff; whether it resumed."""

        async def resume() -> None:
            kind, detail = await self._control_on(replica, "/resume")
            if kind != "ok":
                raise _NotResumed(detail)

        try:
            await retry_async(
                resume, lambda error: isinstance(error, _NotResumed), _RESUME_RETRY, what=f"resuming {replica.role}"
            )
        except _NotResumed:
            return False
        return True

    async def _await_replicas(self, deadline: float | None = None) -> None:
        """Hold a load or a pause/resume while fewer than `min_healthy` replicas are routable, until `deadline`
        (`load_deadline` from now by default).

        TRL treats a failed sync as fatal. With every replica gone, answering at once would end the run at its next
        sync, before anyone could replace a replica, and with an error about a pause rather than about the replicas;
        held, the sync goes through once a replaced replica is admitted (admission needs the lock, so this waits
        outside it), or the trainer's replica watchdog ends the run saying why.
        """
        deadline = deadline or time.monotonic() + self.load_deadline
        while len(self.membership.routable) < self.min_healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.5)

    # -- admission -------------------------------------------------------------------------------------------------

    async def admit(self, replica: Replica, activate: Callable[[], None]) -> None:
        """Bring a replica's adapters in line with the live set, then `activate` it between two broadcasts.

        Adapters of this run that are not live (left by an earlier trainer or proxy) are unloaded; every live version
        is loaded. A replica marked `reload` (ejected for serving the wrong policy) first has every adapter of this
        run unloaded, so each live version is loaded afresh from the store. Raises RuntimeError saying what failed;
        the replica then stays out and is tried again later.
        """
        held, evaluation_names = await self._held_adapters(replica)
        replica.loaded = set(held)
        for name in evaluation_names:  # an evaluation's adapter left behind: its slot is for the next evaluation
            problem = await self._unload_on(replica, 0, name)
            if problem is not None:
                raise RuntimeError(f"unloading {name} failed: {problem}")
        if replica.reload:  # ejected for serving the wrong policy: nothing it holds is trusted, load all afresh
            await self._converge(replica, set())
        await self._converge(replica, set(self.live))
        async with self.lock:
            await self._converge(replica, set(self.live))  # versions loaded or unloaded meanwhile
            target = "/pause?" + self.paused_query if self.paused_query is not None else "/resume"
            kind, detail = await self._control_on(replica, target)
            if kind != "ok":
                raise RuntimeError(f"{target} failed: {detail}")
            activate()
            replica.reload = False

    async def _converge(self, replica: Replica, live: set[int]) -> None:
        for version in sorted(replica.loaded - live):
            problem = await self._unload_on(replica, version)
            if problem is not None:
                raise RuntimeError(f"unloading stale version {version} failed: {problem}")
        missing = sorted(live - replica.loaded)
        if not missing:
            return
        deadline = time.monotonic() + self.load_deadline
        for version in missing:
            outcome = await self._load_on(replica, version, deadline, replay=True)
            if outcome.kind != "ok":
                raise RuntimeError(f"replaying version {version} failed: {outcome.detail}")
            replica.loaded.add(version)
            self.stats.adapters["replays"] += 1

    async def _held_adapters(self, replica: Replica) -> tuple[set[int], list[str]]:
        """The policy versions of this run a replica holds, and the evaluation names."""
        try:
            response = await self.client.request(
                replica.origin, "GET", "/v1/models", self.auth, b"", self.control_timeout
            )
        except UpstreamError as error:
            raise RuntimeError(f"GET /v1/models failed: {error}") from None
        if response.status != 200:
            raise RuntimeError(f"GET /v1/models answered {response.status}")
        try:
            ids = [item["id"] for item in json.loads(response.body)["data"]]
        except (ValueError, KeyError, TypeError):
            raise RuntimeError("GET /v1/models did not answer a model list") from None
        versions: set[int] = set()
        evaluation_names: list[str] = []
        for model_id in ids:
            trl_name = self.names.to_trl(model_id) if isinstance(model_id, str) else None
            if trl_name is not None:
                version = derived.parse_trl_adapter_name(trl_name)
                assert version is not None  # to_trl makes only well-formed TRL names
                versions.add(version)
            elif isinstance(model_id, str) and derived.parse_eval_adapter_name(self.run_id, model_id) is not None:
                evaluation_names.append(model_id)
        return versions, evaluation_names

    async def _post(self, replica: Replica, target: str, body: bytes, timeout: float) -> ClientResponse:
        headers = [*self.auth, ("Content-Type", "application/json")] if body else list(self.auth)
        return await self.client.request(replica.origin, "POST", target, headers, body, timeout)


def _roles_of(replicas: list[Replica]) -> str:
    return ", ".join(replica.role for replica in replicas)

"""The sidecar: the replica's one public port, in front of the engine.

vLLM cannot read `s3://` and a FUSE mount of the bucket lags, so adapter versions reach a replica through the sidecar:
a load whose `lora_path` is a store reference (`store:runs/<run_id>/adapters/v000007/`) is downloaded from the run's
store into a local cache, every file checked against `manifest.json`, and only then handed to the engine with the
local path. Everything else (completions, streaming, pause/resume, metrics, ...) passes through unchanged, so the
engine behind it, vLLM or the CPU engine, answers for itself.

Load answers: a version with no manifest yet gets vLLM's 404 `Loading lora <name> failed: No adapter found for <path>`
(the proxy retries on that text while a publish is in flight); a version whose files do not match the manifest gets
422 and nothing is loaded; a store that cannot be read gets 503 (transient) or 502 (access). A `lora_path` that is
neither a store reference nor an absolute local path (a Hub id, a relative or `..` path) is refused with 400.

Unload passes through; afterwards, cached versions of that run older than the staleness window
(newest - max_staleness - 1) that are no longer loaded are deleted from disk. The version just unloaded stays one
more sync, as TRL does, because vLLM may re-read an adapter's files after the unload answered.

When `REPLICA_TOKEN` is set, every request must carry `Authorization: Bearer <token>` (401 otherwise, like vLLM's
`--api-key`); the header is not forwarded to the engine.

Fault injection (tests only), for either engine: with `GRPO_FAULT_SERVE_PREVIOUS_ADAPTER=1` in the replica's
environment, every load is answered as usual but the engine is handed the adapter asked for *before* (the first load
is honest), so the replica keeps serving v(N-1) under vN's name: the stale replica the trainer's policy audit must
catch (tests/test_faults.py, tests/test_e2e_vllm.py). With `until-emptied` the fault heals once every adapter has been
unloaded (the proxy's clean re-load of an ejected replica does that; ordinary unloads of old versions never empty it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from jobs.contract import layout
from jobs.replica.adapter_requests import parse_load
from jobs.replica.errors import error_body, error_response, no_adapter_found
from jobs.store import (
    IntegrityError,
    ObjectStore,
    StoreAccessError,
    StoreError,
    TransientStoreError,
    VersionNotPublished,
    download_published,
    read_manifest,
)

log = logging.getLogger(__name__)
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_NOT_FORWARDED = _HOP_BY_HOP | {"host", "authorization", "content-length"}
_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# TRL waits up to 1800 s on a pause or a load and up to 600 s on a completion; an engine request may take that long.
ENGINE_REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=3600, sock_connect=10)


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    path: str
    run_id: str | None = None  # None for an adapter loaded from an absolute local path
    version: int | None = None


class Sidecar:
    def __init__(
        self,
        engine_url: str,
        store: ObjectStore,
        max_staleness: int,
        cache_root: Path,
        token: str | None = None,
        fault: str | None = None,
    ):
        self.engine_url = engine_url.rstrip("/")
        self.store = store
        self.max_staleness = max_staleness
        self.cache_root = cache_root
        self.token = token
        self.adapters: dict[str, LoadedAdapter] = {}
        self.requests_served = 0
        # Generation requests handed to the engine and not yet answered: what the replica holds, even while the
        # engine is paused (vLLM's own gauges only move when it steps).
        self.requests_in_flight = 0
        self.last_error: dict[str, Any] | None = None
        # (run id, version) -> the `created` time of the manifest the cached copy was verified against
        self._cached: dict[tuple[str, int], float] = {}
        self._locks: defaultdict[tuple[str, int], asyncio.Lock] = defaultdict(asyncio.Lock)
        self._session: aiohttp.ClientSession | None = None
        # The stale-replica fault (tests only): see the module docstring.
        self.serve_previous = fault in ("1", "until-emptied")
        self.heal_when_emptied = fault == "until-emptied"
        self._last_requested: str | None = None

    # ---- wiring ----------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._authorize], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        # No decompression: bytes pass through exactly as the engine sent them, headers included.
        self._session = aiohttp.ClientSession(timeout=ENGINE_REQUEST_TIMEOUT, auto_decompress=False)

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.token is not None:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    def note_error(self, message: str, exc_info: bool = False) -> None:
        """Log a failure and remember it as the last thing that went wrong, for the heartbeat."""
        log.warning("%s", message, exc_info=exc_info)
        self.last_error = {"time": time.time(), "message": message}

    async def engine_get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        """GET a path of the engine directly (health checks, heartbeat); raises aiohttp/asyncio errors."""
        assert self._session is not None, "the sidecar app is not running"
        async with self._session.get(self.engine_url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            return response.status, await response.read()

    # ---- adapters --------------------------------------------------------------------------------------------

    async def load_lora_adapter(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError as error:
            return error_response(400, f"The request body is not valid JSON: {error}")
        load = parse_load(body)
        if isinstance(load, web.Response):
            return load
        name, path = load.lora_name, load.lora_path
        loaded = self.adapters.get(name)
        if (
            loaded is not None
            and loaded.run_id is not None
            and loaded.version is not None  # set together with run_id
            and path == layout.adapter_ref(loaded.run_id, loaded.version)
        ):
            # The same version under the same name again: a retry whose first answer was lost. Loading is idempotent
            # here, so the proxy's retry cannot turn a success into vLLM's "already loaded" error.
            return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
        if path.startswith(layout.STORE_REF_SCHEME):
            ref = layout.parse_adapter_ref(path)
            if ref is None:
                return error_response(
                    400,
                    f"lora_path {path!r} is not a store reference; write store:runs/<run_id>/adapters/v<6 digits>/",
                )
            run_id, version = ref
            try:
                local = await self._materialise(run_id, version)
            except VersionNotPublished:
                return no_adapter_found(name, path)
            except IntegrityError as error:
                return self._load_failed(422, name, f"{path} is corrupt in the store ({error}); publish it again")
            except TransientStoreError as error:
                return self._load_failed(503, name, f"the store did not answer ({error}); retry later")
            except (StoreAccessError, StoreError) as error:
                return self._load_failed(502, name, f"the replica cannot read the store ({error}); check its access")
            except OSError as error:
                return self._load_failed(500, name, f"could not write {path} to the local cache: {error}")
            record = LoadedAdapter(name, str(local), run_id, version)
            body = {**body, "lora_path": str(local)}
        elif _is_safe_absolute(path):
            record = LoadedAdapter(name, path)
        else:
            return error_response(
                400,
                f"lora_path {path!r} must be a store reference (store:runs/<run_id>/adapters/vNNNNNN/) or an absolute "
                "path on the replica without '..'",
            )
        asked = body["lora_path"]
        if self.serve_previous:
            body = {**body, "lora_path": self._stale_source(asked)}
        status, data, content_type = await self._engine_post("/v1/load_lora_adapter", body)
        if status == 200:
            self._last_requested = asked
            self.adapters[name] = record
            log.info("loaded adapter %s from %s", name, record.path if record.run_id is None else path)
        elif status >= 500:  # the caller's mistakes (4xx) are answered, not counted against the replica
            self.note_error(f"engine failed to load {name} ({status}): {data[:300].decode(errors='replace')}")
        return web.Response(status=status, body=data, content_type=content_type)

    async def unload_lora_adapter(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError as error:
            return error_response(400, f"The request body is not valid JSON: {error}")
        status, data, content_type = await self._engine_post("/v1/unload_lora_adapter", body)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if status == 200 and isinstance(name, str) and name in self.adapters:
            record = self.adapters.pop(name)
            log.info("unloaded adapter %s", name)
            if record.run_id is not None:
                await self._prune(record.run_id)
            if self.serve_previous and self.heal_when_emptied and not self.adapters:
                self.serve_previous = False
                log.warning("fault injection: healed, every adapter unloaded")
        return web.Response(status=status, body=data, content_type=content_type)

    def _stale_source(self, requested: str) -> str:
        """The stale-replica fault: the adapter loaded before this one (still on disk), else the one asked for."""
        previous = self._last_requested
        if previous is not None and (Path(previous) / "adapter_config.json").is_file():
            log.warning("fault injection: serving %s instead of %s", previous, requested)
            return previous
        return requested

    def _load_failed(self, status: int, name: str, reason: str) -> web.Response:
        message = f"Loading lora {name} failed: {reason}"
        self.note_error(message)
        return error_response(status, message)

    async def _materialise(self, run_id: str, version: int) -> Path:
        """The local folder of a published version, downloaded and verified on first use."""
        key = (run_id, version)
        dest = self.cache_root / run_id / layout.version_dir(version)
        async with self._locks[key]:
            if key in self._cached and dest.is_dir():
                # One small read proves the cached copy is still the published one (a version republished after a
                # crash has a new manifest); anything else re-downloads.
                current = await asyncio.to_thread(read_manifest, self.store, layout.adapter_prefix(run_id, version))
                if current.created == self._cached[key]:
                    return dest
            started = time.monotonic()
            manifest = await asyncio.to_thread(
                download_published, self.store, layout.adapter_prefix(run_id, version), dest
            )
            self._cached[key] = manifest.created
            log.info(
                "downloaded %s v%d (%d bytes) in %.2fs",
                run_id,
                version,
                manifest.total_size,
                time.monotonic() - started,
            )
            return dest

    async def _prune(self, run_id: str) -> None:
        """Delete cached versions of `run_id` that are unloaded and older than the staleness window."""
        versions = [v for r, v in self._cached if r == run_id]
        loaded = {a.version for a in self.adapters.values() if a.run_id == run_id}
        oldest_kept = max(versions, default=0) - self.max_staleness - 1
        for version in sorted(v for v in versions if v < oldest_kept and v not in loaded):
            key = (run_id, version)
            async with self._locks[key]:
                await asyncio.to_thread(shutil.rmtree, self.cache_root / run_id / layout.version_dir(version), True)
                self._cached.pop(key, None)
            log.info("removed cached adapter %s v%d (outside the staleness window)", run_id, version)

    async def remove_cache(self) -> None:
        """Delete every version this sidecar downloaded (at shutdown)."""
        for run_id in {r for r, _ in self._cached}:
            await asyncio.to_thread(shutil.rmtree, self.cache_root / run_id, True)
        self._cached.clear()

    async def _engine_post(self, path: str, body: Any) -> tuple[int, bytes, str]:
        assert self._session is not None, "the sidecar app is not running"
        try:
            async with self._session.post(self.engine_url + path, json=body) as response:
                return response.status, await response.read(), response.content_type
        except (TimeoutError, aiohttp.ClientError) as error:
            message = f"the inference engine is not reachable ({type(error).__name__}); it may still be starting"
            self.note_error(message)
            return 503, json.dumps(error_body(503, message)).encode(), "application/json"

    # ---- everything else -------------------------------------------------------------------------------------

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """Relay a request to the engine and stream its answer back byte for byte."""
        assert self._session is not None, "the sidecar app is not running"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        data = await request.read() if request.can_read_body else None
        generation = request.path in _GENERATION_PATHS
        self.requests_in_flight += generation
        try:
            try:
                upstream = await self._session.request(
                    request.method,
                    self.engine_url + str(request.rel_url),
                    headers=headers,
                    data=data,
                    allow_redirects=False,
                )
            except (TimeoutError, aiohttp.ClientError) as error:
                message = f"the inference engine is not reachable ({type(error).__name__}); retry later"
                return error_response(503, message)
            async with upstream:  # an engine that fails mid-answer cuts the client's answer short
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for key, value in upstream.headers.items():
                    if key.lower() not in _HOP_BY_HOP:
                        response.headers.add(key, value)
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
        finally:  # answered, failed, or cancelled because the client went away
            self.requests_in_flight -= generation
        if generation and upstream.status == 200:
            self.requests_served += 1
        return response


def _is_safe_absolute(path: str) -> bool:
    posix = PurePosixPath(path)
    return posix.is_absolute() and ".." not in posix.parts and "\x00" not in path

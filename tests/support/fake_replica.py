"""A fake vLLM replica: a real aiohttp server on loopback speaking the subset of vLLM that TRL and the proxy use.

Endpoints: /health, /ping, /server_info, /v1/models, /pause, /resume, /is_paused, /reset_prefix_cache,
/v1/load_lora_adapter, /v1/unload_lora_adapter, /v1/completions and /v1/chat/completions (token ids and log-probs,
optionally streamed as server-sent events). Errors are vLLM's: an already-loaded name is 400, a path with no adapter
is 404 "No adapter found for <path>", an unknown adapter on unload 404, an unknown model 404.

With a store, a load whose `lora_path` is a `store:` reference is materialised like the sidecar does (download,
sha256-verified); a version without a manifest answers "No adapter found", so the proxy's retry is exercised for real.
Like the sidecar (`jobs/replica/sidecar.py`), a repeated load of a name with the same `store:` reference answers 200
without loading again (a retry whose first answer was lost), unless `idempotent_loads` is off; the same name with
another path is vLLM's 400.

Switches (attributes; all but `raw_response`, `load_gate` and `unload_gate` also through `POST /fake/control` with a
JSON object of them) make it misbehave: `healthy` (False: /health answers 503), `lag_loads` (the next N load attempts
answer "No adapter found"), `transient_loads` (the next N answer 503, as a sidecar does when the store does not
answer), `fail_loads` / `fail_unloads` / `fail_pause` (an HTTP status to answer with), `fail_resumes` (the next N
/resume answer 500 and leave it paused), `lose_load_answers` / `lose_unload_answers` (the next N load / unload
attempts are carried out, then the connection is dropped without an answer), `lose_pause_answers` (the next N /pause
are carried out, then the connection is cut after the status line: an answer cut short),
`idempotent_loads` (False: a repeated load of a loaded name is vLLM's 400 "already been loaded" even with the same
`store:` reference, as vLLM without the sidecar answers), `raw_response` (bytes returned verbatim by generations),
`load_gate` (a `Gate`: loads that get past the repeat check wait there until the test releases them, and the test
learns when one is waiting), `unload_gate` (a `Gate` that unloads wait at: a replica that accepts an unload and does
not answer). `/pause` holds generations until `/resume`, so a test can keep requests in flight; one cut while held (its
caller went away, or the replica died) is counted in `counters.cancelled`. `stop()` makes it die (requests in flight,
held ones too, are cut) and `start()` come back on the same port, with `fresh=True` as a restarted engine (no
adapters, not paused, empty prefix cache; `counters`, `seen` and `unrouted` keep counting). `unrouted` lists the
requests for paths it does not serve; `open_connections` counts the client connections it has served a request on
that are still open.

For the benchmark it keeps a vLLM-shaped prefix cache (16-token blocks, hashes chained from the adapter name, LRU,
hits capped so the last prompt token is always computed, generated blocks cached too) and charges `prefill_s` per
uncached prompt token and `decode_s` per generated token; `service_from_seed` instead derives a service time from the
request's seed so that two runs of the same requests get the same times. `GET /fake/stats` reports what it computed.
Run alone with `python -m tests.support.fake_replica --port P [...]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import ssl
import tempfile
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler

from jobs.contract import layout, parse_storage_uri
from jobs.replica.adapter_requests import parse_load
from jobs.store import ObjectStore, VersionNotPublished, download_published, open_store


@dataclass(frozen=True)
class Seen:
    """A generation request as the replica received it."""

    at: float
    path: str
    headers: dict[str, str]  # names lower-cased, repeated ones joined with ", "
    body: bytes


@dataclass
class Counters:
    requests: int = 0
    cancelled: int = 0  # generations cut while a pause held them
    prompt_tokens: int = 0
    computed_tokens: int = 0  # prompt tokens not served from the prefix cache
    cached_requests: int = 0  # requests whose prompt was cached as far as vLLM can use it
    generated_tokens: int = 0
    loads: int = 0
    load_attempts: int = 0
    unloads: int = 0
    pauses: int = 0
    resumes: int = 0
    resets: int = 0


class Gate:
    """Holds requests on the replica's event loop until a test, on its own thread, releases them.

    `arrived` is set once a request is held at the gate, so the test can act while it waits there; `release()` lets
    every held request and every later one through. Both are safe to use from any thread.
    """

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self._lock = threading.Lock()
        self._open = False
        self._held: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._open:
                return
            held: asyncio.Future[None] = loop.create_future()
            self._held.append((loop, held))
        self.arrived.set()
        await held

    def release(self) -> None:
        with self._lock:
            self._open = True
            held, self._held = self._held, []
        for loop, future in held:
            loop.call_soon_threadsafe(_let_through, future)


def _let_through(future: asyncio.Future[None]) -> None:
    if not future.done():  # not cut meanwhile by the replica dying
        future.set_result(None)


class PrefixCache:
    """vLLM's automatic prefix cache in miniature: whole blocks, chained hashes seeded by the adapter name, LRU."""

    def __init__(self, block_size: int, capacity: int):
        self.block_size = block_size
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def chain(self, model: str, tokens: list[int]) -> list[int]:
        size = self.block_size
        chain, previous = [], hash(model)
        for start in range(0, len(tokens) - size + 1, size):
            previous = hash((previous, *tokens[start : start + size]))
            chain.append(previous)
        return chain

    def admit(self, model: str, tokens: list[int]) -> int:
        """Cached prompt tokens for a new request; its blocks are cached from now on (vLLM caches at scheduling)."""
        chain = self.chain(model, tokens)
        usable = (len(tokens) - 1) // self.block_size  # vLLM always computes the last prompt token
        hits = 0
        for block in chain[:usable]:
            if block not in self._blocks:
                break
            hits += 1
        self.insert(chain)
        return hits * self.block_size

    def insert(self, chain: list[int]) -> None:
        blocks = self._blocks
        for block in chain:
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


@dataclass
class FakeReplica:
    port: int = 0
    model: str = "fake/base-model"
    max_model_len: int = 4096
    max_loras: int = 8
    max_lora_rank: int = 16
    data_parallel_size: int = 1
    store: ObjectStore | None = None
    ssl_context: ssl.SSLContext | None = None  # serve HTTPS, as replicas behind HF Jobs do
    block_size: int = 16
    cache_blocks: int = 16384
    prefill_s: float = 0.0  # per uncached prompt token
    decode_s: float = 0.0  # per generated token
    service_from_seed: tuple[float, float] | None = None
    default_tokens: int = 4
    # switches
    healthy: bool = True
    lag_loads: int = 0
    transient_loads: int = 0
    fail_loads: int = 0
    fail_unloads: int = 0
    fail_pause: int = 0
    fail_resumes: int = 0
    lose_load_answers: int = 0
    lose_unload_answers: int = 0
    lose_pause_answers: int = 0
    idempotent_loads: bool = True
    load_gate: Gate | None = None
    unload_gate: Gate | None = None
    raw_response: bytes | None = None
    # what happened
    counters: Counters = field(default_factory=Counters)
    adapters: dict[str, str] = field(default_factory=dict)  # name -> path
    seen: deque[Seen] = field(default_factory=lambda: deque(maxlen=512))  # the last generation requests
    unrouted: list[str] = field(default_factory=list)  # "METHOD /path" of requests for paths it does not serve

    def __post_init__(self) -> None:
        self.cache = PrefixCache(self.block_size, self.cache_blocks)
        self._runner: web.AppRunner | None = None
        self._resumed: asyncio.Event | None = None
        self._workdir = Path(tempfile.mkdtemp(prefix="fake-replica-"))
        self._next_id = 0
        self._sources: dict[str, str] = {}  # adapter name -> the lora_path it was loaded from
        self._transports: set[asyncio.BaseTransport] = set()  # connections it served a request on
        self._transports_lock = threading.Lock()  # read by the test's thread

    @property
    def open_connections(self) -> int:
        """Client connections it has served a request on that are still open (read from any thread)."""
        with self._transports_lock:
            self._transports = {transport for transport in self._transports if not transport.is_closing()}
            return len(self._transports)

    @property
    def url(self) -> str:
        if self.ssl_context is not None:
            return f"https://localhost:{self.port}"
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self, fresh: bool = False) -> FakeReplica:
        """Listen; with `fresh`, as a restarted engine that holds no adapter, is not paused and has an empty cache."""
        if fresh:
            self.adapters.clear()
            self._sources.clear()
            self.cache.clear()
            self._resumed = None
        if self._resumed is None:
            self._resumed = asyncio.Event()
            self._resumed.set()
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._note_request])
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/ping", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_get("/is_paused", self._is_paused)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_post("/v1/load_lora_adapter", self._load)
        app.router.add_post("/v1/unload_lora_adapter", self._unload)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/fake/stats", self._stats)
        app.router.add_post("/fake/control", self._control)
        app.router.add_post("/fake/reset", self._reset)
        # A short shutdown_timeout: stop() is a death, it cuts requests in flight rather than waiting for them.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, backlog=1024, ssl_context=self.ssl_context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Die: close the socket and every connection (in-flight requests are cut)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def close(self) -> None:
        shutil.rmtree(self._workdir, ignore_errors=True)

    # -- endpoints ----------------------------------------------------------------------------------------------

    @web.middleware
    async def _note_request(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.transport is not None:
            with self._transports_lock:
                self._transports.add(request.transport)
        if request.match_info.http_exception is not None:
            self.unrouted.append(f"{request.method} {request.path}")
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "vllm_config": {
                    "lora_config": {"max_lora_rank": self.max_lora_rank, "max_loras": self.max_loras},
                    "parallel_config": {"data_parallel_size": self.data_parallel_size, "tensor_parallel_size": 1},
                    "model_config": {"dtype": "torch.bfloat16", "model": self.model},
                    "cache_config": {"block_size": self.block_size, "enable_prefix_caching": True},
                }
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        base = {"id": self.model, "object": "model", "root": self.model, "parent": None}
        data = [{**base, "max_model_len": self.max_model_len}]
        data += [
            {"id": name, "object": "model", "root": path, "parent": self.model} for name, path in self.adapters.items()
        ]
        return web.json_response({"object": "list", "data": data})

    async def _pause(self, request: web.Request) -> web.Response:
        if self.fail_pause:
            return web.json_response({"error": "pause refused (fake)"}, status=self.fail_pause)
        self.counters.pauses += 1
        self._resumed.clear()
        if self.lose_pause_answers > 0:
            self.lose_pause_answers -= 1
            request.transport.write(b"HTTP/1.1 200 OK\r\n")  # some of the answer, so no client re-sends it
            request.transport.close()
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        if self.fail_resumes > 0:
            self.fail_resumes -= 1
            return web.json_response({"error": "resume refused (fake)"}, status=500)
        self.counters.resumes += 1
        self._resumed.set()
        return web.json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": not self._resumed.is_set()})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.counters.resets += 1
        self.cache.clear()
        return web.json_response({"success": True})

    async def _load(self, request: web.Request) -> web.Response:
        self.counters.load_attempts += 1
        response = await self._load_answer(await request.json())
        if self.lose_load_answers > 0:
            self.lose_load_answers -= 1
            request.transport.close()  # whatever was done stays done; the answer never reaches the caller
        return response

    async def _load_answer(self, body: dict) -> web.Response:
        load = parse_load(body)  # vLLM's 400s for a body it refuses
        if isinstance(load, web.Response):
            return load
        name, path = load.lora_name, load.lora_path
        if name in self.adapters:
            repeat = path.startswith(layout.STORE_REF_SCHEME) and self._sources.get(name) == path
            if repeat and self.idempotent_loads:
                return _loaded(name)  # the sidecar's answer to a retry whose first answer was lost
            return _error(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.",
            )
        if self.load_gate is not None:
            await self.load_gate.wait()
        if self.lag_loads > 0:
            self.lag_loads -= 1
            return _error(404, f"Loading lora {name} failed: No adapter found for {path}")
        if self.transient_loads > 0:
            self.transient_loads -= 1
            return _error(503, f"Loading lora {name} failed: the store did not answer; retry later")
        if self.fail_loads:
            return _error(self.fail_loads, f"LoRA rank 64 is greater than max_lora_rank {self.max_lora_rank}.")
        local = path
        if self.store is not None and path.startswith(layout.STORE_REF_SCHEME):
            prefix = path[len(layout.STORE_REF_SCHEME) :]
            try:
                await asyncio.to_thread(download_published, self.store, prefix, self._workdir / name)
            except VersionNotPublished:
                return _error(404, f"Loading lora {name} failed: No adapter found for {path}")
            local = str(self._workdir / name)
        self.adapters[name] = local
        self._sources[name] = path
        self.counters.loads += 1
        return _loaded(name)

    async def _unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body.get("lora_name")
        if self.unload_gate is not None:
            await self.unload_gate.wait()
        if self.fail_unloads:
            return _error(self.fail_unloads, "unload refused (fake)")
        if name not in self.adapters:
            return _error(404, f"The lora adapter '{name}' cannot be found.")
        del self.adapters[name]
        self._sources.pop(name, None)
        shutil.rmtree(self._workdir / name, ignore_errors=True)
        self.counters.unloads += 1
        if self.lose_unload_answers > 0:
            self.lose_unload_answers -= 1
            request.transport.close()  # unloaded all the same; the answer never reaches the caller
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers: dict[str, str] = {}
        for name, value in request.headers.items():  # repeated headers joined, so a duplicate shows
            headers[name.lower()] = f"{headers[name.lower()]}, {value}" if name.lower() in headers else value
        self.seen.append(Seen(time.monotonic(), request.path, headers, raw))
        body = json.loads(raw)
        model = body.get("model")
        if model != self.model and model not in self.adapters:
            return _error(404, f"The model `{model}` does not exist.")
        try:
            await self._resumed.wait()
        except asyncio.CancelledError:
            self.counters.cancelled += 1
            raise
        if self.raw_response is not None:
            return web.Response(body=self.raw_response, content_type="application/json")
        prompt = body.get("prompt")
        tokens = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else []
        cached = self.cache.admit(model, tokens) if tokens else 0
        counters = self.counters
        counters.requests += 1
        counters.prompt_tokens += len(tokens)
        counters.computed_tokens += len(tokens) - cached
        if tokens and cached == (len(tokens) - 1) // self.block_size * self.block_size:
            counters.cached_requests += 1
        seed = int(body.get("seed") or 0)
        count = max(1, min(int(body.get("max_tokens") or self.default_tokens), 4096))
        generated = [(seed + index) % 50000 for index in range(count)]
        counters.generated_tokens += count
        if self.service_from_seed is not None:
            low, high = self.service_from_seed
            delay = low + (seed % 10007) / 10007 * (high - low)
        else:
            delay = (len(tokens) - cached) * self.prefill_s + count * self.decode_s
        if delay > 0:
            await asyncio.sleep(delay)
        if tokens:
            self.cache.insert(self.cache.chain(model, tokens + generated)[len(tokens) // self.block_size :])
        self._next_id += 1
        created = int(time.time())
        if body.get("stream"):
            return await self._stream(request, model, created, generated)
        choice = {
            "index": 0,
            "text": " ".join(map(str, generated)),
            "token_ids": generated,
            "logprobs": {"token_logprobs": [-1.0] * count},
            "finish_reason": "length",
        }
        answer = {
            "id": f"cmpl-{self._next_id}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(tokens),
                "completion_tokens": count,
                "prompt_tokens_details": {"cached_tokens": cached},  # as vLLM with --enable-prompt-tokens-details
            },
        }
        return web.Response(body=json.dumps(answer).encode(), content_type="application/json")

    async def _stream(self, request: web.Request, model: str, created: int, generated: list[int]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for token in generated:
            event = {
                "id": f"cmpl-{self._next_id}",
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "text": str(token), "token_ids": [token], "logprobs": None}],
            }
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({**self.counters.__dict__, "adapters": sorted(self.adapters)})

    async def _control(self, request: web.Request) -> web.Response:
        for key, value in (await request.json()).items():
            if key not in _SWITCHES:
                return _error(400, f"unknown switch {key!r}")
            setattr(self, key, tuple(value) if key == "service_from_seed" and value else value)
        return web.json_response({"ok": True})

    async def _reset(self, request: web.Request) -> web.Response:
        self.counters = Counters()
        self.cache.clear()
        return web.json_response({"ok": True})


_SWITCHES = {
    "healthy",
    "lag_loads",
    "transient_loads",
    "fail_loads",
    "fail_unloads",
    "fail_pause",
    "fail_resumes",
    "lose_load_answers",
    "lose_unload_answers",
    "lose_pause_answers",
    "idempotent_loads",
    "prefill_s",
    "decode_s",
}
_SWITCHES |= {"service_from_seed", "default_tokens"}


def _loaded(name: str) -> web.Response:
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


def _error(status: int, message: str) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake vLLM replica for tests and benchmarks")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill-s", type=float, default=0.0, help="seconds per uncached prompt token")
    parser.add_argument("--decode-s", type=float, default=0.0, help="seconds per generated token")
    parser.add_argument("--cache-blocks", type=int, default=16384)
    parser.add_argument("--spec-store", default=None, help="storage URI to materialise store: adapters from")
    parser.add_argument("--store-endpoint", default=None)
    args = parser.parse_args()

    async def run() -> None:
        store = None
        if args.spec_store:
            store = open_store(parse_storage_uri(args.spec_store, endpoint=args.store_endpoint))
        replica = FakeReplica(
            port=args.port,
            store=store,
            prefill_s=args.prefill_s,
            decode_s=args.decode_s,
            cache_blocks=args.cache_blocks,
        )
        await replica.start()
        print(f"fake replica listening on {replica.url}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()

"""The proxy as one object: endpoints, background loops, and the relay of generation requests.

Endpoints (everything TRL 1.16's AsyncGRPOTrainer calls, plus the proxy's own):

    POST /v1/completions, /v1/chat/completions   routed to one replica by prefix affinity (router.py); the `model`
                                                 field is rewritten trl-policy-vN <-> <run_id>-vN both ways; the
                                                 answer names its replica in `X-Proxy-Upstream`; stream=true streams
    POST /v1/load_lora_adapter                   publish + all-or-nothing broadcast (adapters.py)
    POST /v1/unload_lora_adapter, /pause, /resume, /reset_prefix_cache    broadcast to every healthy replica
    GET  /health, /ping                          200 when at least --min-healthy replicas are healthy, else 503
    GET  /server_info, /v1/models                from one healthy replica; data_parallel_size reported as 1;
                                                 this run's adapters listed under their TRL names
    POST /tokenize, /detokenize, other GETs      forwarded to one healthy replica
    GET  /proxy/stats                            counters (shape in stats.py)
    GET  /proxy/replicas                         every replica and its state
    POST /proxy/replicas/<role>/eject            take a replica out of rotation; it is re-admitted once healthy,
                                                 after a clean re-load of every live adapter; optional body
                                                 {"reason": "..."} (shown as its last error)
    POST /proxy/replicas/<role>/admit            try to admit a replica now instead of at the next health check
    POST /proxy/trainer_state {"step": N}        the optimizer step stamped into the next published manifest
    POST /proxy/evaluation/load {"version": N}   load published version N as <run_id>-eval-vN on every replica,
                                                 all-or-nothing, for held-out evaluation (jobs/evaluation)
    POST /proxy/evaluation/unload {"version": N} and unload it after

Anything else is refused with 404 rather than forwarded: a state-changing call sent to one replica (e.g. NCCL weight
transfer) would leave the replicas inconsistent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from jobs.contract import RunSpec, layout
from jobs.proxy.adapters import AdapterSync, text_response
from jobs.proxy.config import ProxyConfig
from jobs.proxy.http_client import ClientResponse, HttpClient, UpstreamError, UpstreamExchange
from jobs.proxy.http_server import (
    Exchange,
    HttpServer,
    Response,
    ResponseStream,
    content_type_header,
    forwardable_headers,
)
from jobs.proxy.names import AdapterNames, BadJson, BadName, generation_fields, replace_model, restore_model
from jobs.proxy.router import Router
from jobs.proxy.stats import ProxySnapshot, Stats, TelemetryWriter
from jobs.proxy.upstreams import Membership, Replica
from jobs.store import ObjectStore

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # never anything else: the proxy has no authentication of its own
_DROP_REQUEST = frozenset({"host", "content-length", "authorization", "accept-encoding"})
_DROP_RESPONSE = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "content-length"}
)
_JSON = [("Content-Type", "application/json")]


class Proxy:
    def __init__(self, config: ProxyConfig, spec: RunSpec, store: ObjectStore, upstream_token: str | None = None):
        self.config = config
        self.run_id = spec.run_id
        self.store = store
        allowance = config.group_allowance
        if allowance is None:
            allowance = spec.grpo.num_generations - 1
        self.router = Router(
            config.block_size, config.imbalance, allowance, config.max_tracked_blocks, config.lead_over
        )
        self.names = AdapterNames(spec.run_id)
        self.stats = Stats()
        self.client = HttpClient(config.connect_timeout)
        self.auth = [("Authorization", f"Bearer {upstream_token}")] if upstream_token else []
        self._relay_headers = [("Accept-Encoding", "identity"), *self.auth]
        self.membership = Membership(self.client, self.auth, config.health_timeout, self._admit, self.stats.count_error)
        self.adapters = AdapterSync(
            run_id=spec.run_id,
            names=self.names,
            store=store,
            client=self.client,
            membership=self.membership,
            router=self.router,
            stats=self.stats,
            auth_headers=self.auth,
            min_healthy=config.min_healthy,
            load_retry_interval=config.load_retry_interval,
            load_deadline=config.load_deadline,
            control_timeout=config.read_timeout,
        )
        self.telemetry = TelemetryWriter(store, spec.run_id, self.snapshot, self.stats)
        self.server = HttpServer(self.handle, HOST, config.port, max_body=config.max_body)
        self._tasks: list[asyncio.Task[None]] = []
        self._routes = {
            ("POST", "/v1/completions"): self._generate,
            ("POST", "/v1/chat/completions"): self._generate,
            ("POST", "/v1/load_lora_adapter"): lambda exchange: self.adapters.load(exchange.request.body),
            ("POST", "/v1/unload_lora_adapter"): lambda exchange: self.adapters.unload(exchange.request.body),
            ("POST", "/pause"): self._control,
            ("POST", "/resume"): self._control,
            ("POST", "/reset_prefix_cache"): self._control,
            ("GET", "/health"): self._health,
            ("GET", "/ping"): self._health,
            ("POST", "/ping"): self._health,
            ("GET", "/server_info"): self._server_info,
            ("GET", "/v1/models"): self._models,
            ("GET", "/proxy/stats"): self._stats,
            ("GET", "/proxy/replicas"): self._replicas,
            ("POST", "/proxy/trainer_state"): self._trainer_state,
            ("POST", "/proxy/evaluation/load"): lambda exchange: self.adapters.load_for_evaluation(
                exchange.request.body
            ),
            ("POST", "/proxy/evaluation/unload"): lambda exchange: self.adapters.unload_for_evaluation(
                exchange.request.body
            ),
            ("POST", "/tokenize"): self._forward,
            ("POST", "/detokenize"): self._forward,
        }

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server.port}"

    async def start(self) -> None:
        """Listen, take the --upstream replicas, and start the health, upstream-file and telemetry loops."""
        await self.server.start()
        self.membership.set_upstreams("flag", [(f"upstream-{i}", url) for i, url in enumerate(self.config.upstreams)])
        control = layout.control_key(self.run_id, "upstreams")
        self._tasks = [
            asyncio.create_task(self.membership.health_loop(self.config.health_interval)),
            asyncio.create_task(self.membership.watch_upstreams_file(self.store, control, self.config.upstreams_poll)),
            asyncio.create_task(self.telemetry.loop(self.config.stats_period)),
        ]
        log.info("proxy for run %s listening on %s", self.run_id, self.url)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.membership.stop()
        await self.server.stop()
        await self.telemetry.write()  # the last counters, so the panel sees how the run ended
        await self.client.close()

    async def _admit(self, replica: Replica, activate: Callable[[], None]) -> None:
        await self._adopt_block_size(replica)
        await self.adapters.admit(replica, activate)

    async def _adopt_block_size(self, replica: Replica) -> None:
        """Route by the engine's own prefix-cache block, which vLLM reports in /server_info: 16 tokens on a GPU, 128
        on a CPU, where a 16-token model of its cache would count blocks it never reuses. Read at admission, before
        anything is routed; an engine that does not say (ours keeps no cache across requests) leaves the setting."""
        try:
            response = await self.client.request(
                replica.origin, "GET", "/server_info?config_format=json", self.auth, timeout=self.config.health_timeout
            )
            block = json.loads(response.body)["vllm_config"]["cache_config"]["block_size"]
        except (UpstreamError, ValueError, KeyError, TypeError) as error:
            log.info("replica %s did not report its prefix-cache block (%s)", replica.role, error)
            return
        if isinstance(block, int) and block > 0 and not self.router.adopt_block_size(block):
            log.warning(
                "replica %s caches %d-token blocks; routing keeps %d-token blocks it already tracks",
                replica.role,
                block,
                self.router.block_size,
            )

    # -- dispatch --------------------------------------------------------------------------------------------------

    async def handle(self, exchange: Exchange) -> Response | None:
        request = exchange.request
        route = self._routes.get((request.method, request.path))
        if route is not None:
            return await route(exchange)
        if request.method == "POST" and request.path.startswith("/proxy/replicas/"):
            return await self._replica_action(request.path, request.body)
        if request.method in ("GET", "HEAD") and not request.path.startswith("/proxy/"):  # the proxy's own: above
            return await self._forward(exchange)
        return text_response(
            404,
            f"proxy: {request.method} {request.path} is not supported. The proxy serves adapter-only (LoRA) sync; "
            "state-changing calls it does not know are not forwarded, since reaching one replica only would leave "
            "the replicas inconsistent.",
        )

    # -- generation ------------------------------------------------------------------------------------------------

    async def _generate(self, exchange: Exchange) -> Response | None:
        request = exchange.request
        body = request.body
        try:
            fields = generation_fields(body)
        except BadJson as error:
            self.stats.count_error("bad_request")
            return text_response(400, f"proxy: the request body must be a JSON object ({error})")
        model = fields.model
        if not isinstance(model, str):
            self.stats.count_error("bad_request")
            return text_response(400, "proxy: the request needs a string 'model' (trl-policy-v<N> or the base model)")
        try:
            served, _ = self.names.to_replica(model)
        except BadName as error:
            self.stats.count_error("bad_request")
            return text_response(400, f"proxy: {error}")
        if served != model:
            span = fields.model_span
            assert span is not None  # a string `model` is always read with its span
            body = replace_model(body, span, served)
        namespace, chains = self.router.chains(served, fields.tokens, fields.prompt, fields.messages)
        replicas = self.membership.routable
        if not replicas:
            return self._no_replica()
        decision = self.router.decide(namespace, chains, replicas)
        self.router.record(decision)
        headers = forwardable_headers(request.headers, _DROP_REQUEST)
        headers += self._relay_headers
        failures: list[str] = []
        while True:
            replica = decision.replica
            replica.inflight += 1
            replica.routed += 1
            upstream = None
            try:
                upstream = await self.client.open(
                    replica.origin, "POST", request.path, headers, body, self.config.read_timeout
                )
                response = await self._relay(exchange, upstream, replica, model, served, fields.stream)
                if response is not None and response.status == 200 and fields.tokens is not None:
                    self.router.record_answer(decision, fields.tokens, response.body)
                return response
            except UpstreamError as error:
                if upstream is not None:
                    raise  # a streamed answer broke off: nothing left to do but cut the client's stream too
                self.membership.suspect(replica, error)
                failures.append(f"{replica.role} ({replica.url}) failed: {error}")
                retry = error.before_response and len(failures) == 1
            finally:
                replica.inflight -= 1
                self.router.release(decision)
                if upstream is not None:
                    upstream.release()
            others = [other for other in self.membership.routable if other is not replica]
            if not (retry and others):
                return text_response(502, "proxy: " + "; retried, then ".join(failures))
            decision = self.router.decide(namespace, chains, others)
            self.router.record(decision, retry=True)
            self.stats.retried += 1

    async def _relay(
        self, exchange: Exchange, upstream: UpstreamExchange, replica: Replica, model: str, served: str, stream: bool
    ) -> Response | None:
        headers = [(name, value) for name, value in upstream.headers if name.lower() not in _DROP_RESPONSE]
        headers.append(("X-Proxy-Upstream", replica.role))
        if stream and upstream.status == 200 and _is_event_stream(upstream.headers):
            await self._relay_events(upstream, exchange.start_stream(200, headers), replica, model, served)
            return None
        try:
            payload = await upstream.read_all()
        except UpstreamError as error:
            self.membership.suspect(replica, error)
            return text_response(502, f"proxy: {replica.role} ({replica.url}) failed mid-answer: {error}")
        if served != model:
            payload = self._restore_model(payload, model, served, upstream.status)
        return Response(upstream.status, payload, headers)

    async def _relay_events(
        self, upstream: UpstreamExchange, out: ResponseStream, replica: Replica, model: str, served: str
    ) -> None:
        pending = b""
        try:
            async for data in upstream.iter_body():
                pending += data
                *events, pending = pending.split(b"\n\n")
                if events:
                    await out.write(b"".join(self._restore_event(event, model, served) + b"\n\n" for event in events))
        except UpstreamError as error:
            self.membership.suspect(replica, error)
            raise
        if pending:
            await out.write(self._restore_event(pending, model, served))

    def _restore_event(self, event: bytes, model: str, served: str) -> bytes:
        if served == model or not event.startswith(b"data: {"):
            return event
        return restore_model(event, served, model)

    def _restore_model(self, payload: bytes, model: str, served: str, status: int) -> bytes:
        """The replica's answer with the adapter named as TRL named it (also inside an error message)."""
        if status == 200:
            return restore_model(payload, served, model)
        try:
            return self.names.restore_in_text(payload.decode()).encode()
        except UnicodeDecodeError:
            return payload

    def _no_replica(self) -> Response:
        self.stats.count_error("no_replica")
        states = "; ".join(
            f"{replica.role} {replica.state}" + (f" ({replica.last_error})" if replica.last_error else "")
            for replica in self.membership.replicas.values()
        )
        return text_response(
            502,
            f"proxy: no healthy replica to serve this request ({states or 'no replica configured'}); "
            "see GET /proxy/replicas",
        )

    # -- control plane ---------------------------------------------------------------------------------------------

    async def _control(self, exchange: Exchange) -> Response:
        return await self.adapters.control(exchange.request.path, exchange.request.query)

    async def _health(self, exchange: Exchange) -> Response:
        healthy = self.membership.healthy_count
        known = len(self.membership.replicas)
        if healthy >= self.config.min_healthy:
            return text_response(200, f"ok: {healthy}/{known} replicas healthy")
        problems = "; ".join(
            f"{replica.role}: {replica.last_error or replica.state}"
            for replica in self.membership.replicas.values()
            if replica.state != "healthy"
        )
        if not known:
            problems = f"no replica configured; pass --upstream or write {layout.control_key(self.run_id, 'upstreams')}"
        return text_response(
            503, f"proxy: {healthy}/{known} replicas healthy, need {self.config.min_healthy}: {problems}"
        )

    async def _forward_one(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[Replica, ClientResponse] | None:
        """Send a read-only request to the first healthy replica (by role) that answers; None if none did."""
        for replica in sorted(self.membership.routable, key=lambda replica: replica.role):
            try:
                return replica, await self.client.request(
                    replica.origin, method, target, headers, body, self.config.read_timeout
                )
            except UpstreamError as error:
                self.membership.suspect(replica, error)
        return None

    async def _forward(self, exchange: Exchange) -> Response:
        request = exchange.request
        headers = forwardable_headers(request.headers, _DROP_REQUEST) + self._relay_headers
        answer = await self._forward_one(request.method, request.target, headers, request.body)
        if answer is None:
            return self._no_replica()
        replica, response = answer
        kept = [(name, value) for name, value in response.headers if name.lower() not in _DROP_RESPONSE]
        kept.append(("X-Proxy-Upstream", replica.role))
        return Response(response.status, response.body, kept)

    async def _json_from_one(self, target: str) -> tuple[Response | None, object]:
        """(None, the parsed JSON a replica answered at `target`), or (the answer to send instead, None)."""
        answer = await self._forward_one("GET", target, list(self.auth), b"")
        if answer is None:
            return self._no_replica(), None
        _, response = answer
        if response.status != 200:
            return Response(response.status, response.body, content_type_header(response.headers)), None
        try:
            return None, json.loads(response.body)
        except ValueError:
            return Response(200, response.body, content_type_header(response.headers)), None

    async def _server_info(self, exchange: Exchange) -> Response:
        answer, info = await self._json_from_one(exchange.request.target)
        if answer is not None:
            return answer
        config = info.get("vllm_config") if isinstance(info, dict) else None
        if isinstance(config, dict):
            # TRL refuses adapter sync with data parallelism: the proxy is one server to it, whatever is behind.
            parallel = config.setdefault("parallel_config", {})
            if isinstance(parallel, dict):
                parallel["data_parallel_size"] = 1
        return Response(200, json.dumps(info).encode(), list(_JSON))

    async def _models(self, exchange: Exchange) -> Response:
        answer, models = await self._json_from_one(exchange.request.target)
        if answer is not None:
            return answer
        data = models.get("data") if isinstance(models, dict) else None
        for item in data if isinstance(data, list) else []:
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                item["id"] = self.names.to_trl(item["id"]) or item["id"]
        return Response(200, json.dumps(models).encode(), list(_JSON))

    async def _stats(self, exchange: Exchange) -> Response:
        return Response(200, json.dumps(self.snapshot()).encode(), list(_JSON))

    async def _replicas(self, exchange: Exchange) -> Response:
        body = {"replicas": [replica.describe() for replica in self.membership.replicas.values()]}
        return Response(200, json.dumps(body).encode(), list(_JSON))

    async def _replica_action(self, path: str, body: bytes = b"") -> Response:
        _, _, rest = path.partition("/proxy/replicas/")
        role, _, action = rest.rpartition("/")
        replica = self.membership.find(role)
        if replica is None or action not in ("eject", "admit"):
            return text_response(404, f"proxy: no replica {role!r} or no action {action!r} (use eject or admit)")
        if action == "eject":
            # Whoever asks (the trainer's policy audit) distrusts what the replica holds: re-load it from scratch.
            replica.reload = True
            self.membership.eject(replica, _eject_reason(body))
        elif replica.state != "healthy":
            problem = await self.membership.check(replica)
            if problem is not None:
                return text_response(503, f"proxy: {replica.role} is not healthy: {problem}")
            if not await self.membership.admit(replica):
                return text_response(503, f"proxy: {replica.role} was not admitted: {replica.last_error}")
        return Response(200, json.dumps(replica.describe()).encode(), list(_JSON))

    async def _trainer_state(self, exchange: Exchange) -> Response:
        try:
            step = json.loads(exchange.request.body)["step"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return text_response(400, 'proxy: send {"step": <optimizer step, an integer >= 0>}')
        self.adapters.step = step
        return Response(200, json.dumps({"step": step}).encode(), list(_JSON))

    # -- stats -----------------------------------------------------------------------------------------------------

    def snapshot(self) -> ProxySnapshot:
        """The counters as documented in stats.py."""
        healthy = self.membership.healthy_count
        adapters = self.adapters
        counts = self.stats.adapters
        return {
            "time": time.time(),
            "started": self.stats.started,
            "run_id": self.run_id,
            "health": {
                "healthy": healthy,
                "known": len(self.membership.replicas),
                "min_healthy": self.config.min_healthy,
                "ok": healthy >= self.config.min_healthy,
            },
            "replicas": [replica.describe() for replica in self.membership.replicas.values()],
            "routing": {
                **self.router.counters(),
                "retried": self.stats.retried,
                "block_size": self.router.block_size,
                "imbalance": self.router.imbalance,
                "lead_over": self.router.lead_over,
                "group_allowance": self.router.group_allowance,
            },
            "adapters": {
                "current": adapters.current,
                "live": sorted(adapters.live),
                "evaluating": sorted(adapters.evaluating),
                "step": adapters.step,
                "loads_ok": counts["loads_ok"],
                "loads_failed": counts["loads_failed"],
                "load_retries": counts["load_retries"],
                "rolled_back": counts["rolled_back"],
                "unloads_ok": counts["unloads_ok"],
                "unloads_failed": counts["unloads_failed"],
                "replays": counts["replays"],
                "evaluation_loads": counts["evaluation_loads"],
            },
            "sync_s": {
                "upload": self.stats.upload.summary(),
                "broadcast": self.stats.broadcast.summary(),
                "total": self.stats.total.summary(),
            },
            "membership": {"ejections": self.membership.ejections, "readmissions": self.membership.readmissions},
            "errors": dict(self.stats.errors),
        }


def _is_event_stream(headers: list[tuple[str, str]]) -> bool:
    return any(name.lower() == "content-type" and value.startswith("text/event-stream") for name, value in headers)


def _eject_reason(body: bytes) -> str:
    """The reason an eject request gives in its optional JSON body {"reason": ...}, else a generic one."""
    try:
        reason = json.loads(body).get("reason") if body else None
    except (ValueError, AttributeError):
        reason = None
    return f"ejected on request: {reason[:300]}" if isinstance(reason, str) and reason else "ejected on request"

"""A lean HTTP/1.1 client with a keep-alive pool per upstream, for relaying to replicas (HTTP or HTTPS).

It exists for the same reason as `http_server`: the relay path must cost little CPU. Answers are parsed by llhttp
(httptools). It also makes the failure the router cares about explicit: `UpstreamError.before_response` says whether
any byte of an answer arrived, which is what decides if a request may be retried on another replica.

Timeouts: connecting is bounded by `connect_timeout`; reading by `read_timeout` of *inactivity* (a non-streamed
generation sends nothing until it is done, so this is also the longest generation allowed), checked every second.
Idle pooled connections are dropped after `_POOL_IDLE_S`, below uvicorn's (vLLM's server) 5 s keep-alive. A GET or
HEAD that fails on a reused connection before any answer byte is sent once more on a fresh one (the server closed it
while idle); no other request is ever re-sent by the transport, since its bytes may have reached the upstream.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

import httptools

_POOL_IDLE_S = 4.0
_SWEEP_S = 1.0  # read timeouts are checked this often (one timer for all requests, not one per request)
_MAX_HEAD_BYTES = 64 * 1024
# Requests the transport may send twice. Anything else (a completion, an adapter load or unload, pause, resume) is
# never re-sent once written: the caller decides, knowing what the request does (see jobs/proxy/adapters.py).
_IDEMPOTENT = frozenset({"GET", "HEAD"})


class UpstreamError(Exception):
    """A transport failure talking to an upstream. `kind`: connect, timeout, disconnected or protocol."""

    def __init__(self, kind: str, message: str, before_response: bool):
        super().__init__(message)
        self.kind = kind
        self.before_response = before_response


@dataclass(frozen=True)
class Origin:
    """Where an upstream is: parsed once from its base URL."""

    url: str
    scheme: str
    host: str
    port: int
    host_header: str
    base_path: str
    ssl_context: ssl.SSLContext | None = field(default=None, compare=False)

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s) URL; write e.g. http://127.0.0.1:8101 or https://host")
        if parts.username or parts.password:
            raise ValueError("upstream URLs must not carry credentials; the bearer token comes from UPSTREAM_TOKEN")
        if parts.query or parts.fragment:
            raise ValueError(f"{url!r}: an upstream URL has no query or fragment")
        https = parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        default_port = port == (443 if https else 80)
        host_header = parts.hostname if default_port else f"{parts.hostname}:{port}"
        if ":" in parts.hostname:  # IPv6 literal
            host_header = f"[{parts.hostname}]" if default_port else f"[{parts.hostname}]:{port}"
        return cls(
            url=url.strip().rstrip("/"),
            scheme=parts.scheme,
            host=parts.hostname,
            port=port,
            host_header=host_header,
            base_path=parts.path.rstrip("/"),
            ssl_context=ssl.create_default_context() if https else None,
        )


def _oversized_head() -> UpstreamError:
    return UpstreamError("protocol", f"the upstream sent headers over {_MAX_HEAD_BYTES // 1024} KiB", False)


class ClientResponse:
    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes):
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class _Connection(asyncio.Protocol):
    """One upstream connection; one request at a time. The answer is parsed by llhttp (httptools), whose `on_*`
    callbacks below run inside `feed_data` and make the body available as it arrives. One parser serves every answer
    on the connection, as llhttp reads keep-alive answers one after another (making one per request cost ~4 % of the
    proxy's CPU, with the garbage collections it set off)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, busy: set[_Connection]):
        self.loop = loop
        self._busy = busy
        self.transport: asyncio.Transport  # set by connection_made, before `create_connection` returns this
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._received_any = False
        self._head_method = False
        self._head_bytes = 0  # of the header lines received whole
        self._head_wire = 0  # of everything received while the head is incomplete (interim answers included)
        self._status = 0
        self._header_list: list[tuple[str, str]] = []
        self._headers: list[tuple[str, str]] | None = None
        self._keep_alive = True
        self._until_close = False  # the body ends when the upstream closes (no length, not chunked)
        self._body = bytearray()
        self._complete = True  # no answer is awaited until a request is sent
        self._last_data = 0.0
        self._timeout = 0.0

    # -- transport callbacks ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP (or TLS) connection's is a Transport

    def data_received(self, data: bytes) -> None:
        self._received_any = True
        self._last_data = self.loop.time()
        if self._complete:
            # Bytes nobody asked for (a second answer, or noise on an idle connection): it cannot be reused.
            self._fail(UpstreamError("protocol", "the upstream sent more than one answer", False))
            return
        try:
            self._parser.feed_data(data)
            if self._headers is None:
                self._head_wire += len(data)  # the head may not end at all
                if self._head_wire > 2 * _MAX_HEAD_BYTES:
                    raise _oversized_head()
        except UpstreamError as error:
            self._fail(error)
            return
        except httptools.HttpParserCallbackError as error:
            if isinstance(error.__context__, UpstreamError):
                self._fail(error.__context__)
                return
            raise
        except httptools.HttpParserError as error:
            self._fail(UpstreamError("protocol", f"the upstream sent a malformed answer: {error}", False))
            return
        self._wake()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._until_close and not self._complete and self._error is None:
            self._complete = True
            self._wake()
            return
        if not self._complete:
            what = f" ({type(exc).__name__})" if exc else ""
            self._fail(
                UpstreamError(
                    "disconnected", f"the upstream closed the connection{what}", before_response=not self._received_any
                )
            )

    # -- parser callbacks (from inside feed_data) ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            raise UpstreamError("protocol", "the upstream sent more than one answer", False)
        self._header_list = []
        self._head_bytes = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > _MAX_HEAD_BYTES:
            raise _oversized_head()
        self._header_list.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim answer (100 Continue): the real one follows
        self._status = status
        self._headers = self._header_list
        self._keep_alive = self._parser.should_keep_alive()
        names = {name.lower() for name, _ in self._header_list}
        if self._head_method:
            # llhttp cannot be told that a HEAD answer has no body: this one is complete here, and the connection
            # is not reused (a body the upstream might still send would be read as the next answer).
            self._complete = True
            self._keep_alive = False
        elif "content-length" not in names and "transfer-encoding" not in names and status not in (204, 304):
            self._until_close = True

    def on_body(self, part: bytes) -> None:
        self._body += part

    def on_message_complete(self) -> None:
        if self._headers is not None:
            self._complete = True

    # -- request lifecycle -----------------------------------------------------------------------------------------

    def send(self, data: bytes, head_method: bool, timeout: float) -> None:
        self._error = None
        self._received_any = False
        self._head_method = head_method
        self._head_bytes = self._head_wire = 0
        self._status = 0
        self._headers = None
        self._keep_alive = True
        self._until_close = False
        self._body = bytearray()
        self._complete = False
        self._timeout = timeout
        self._last_data = self.loop.time()
        self._busy.add(self)
        self.transport.write(data)

    def check_timeout(self, now: float) -> None:
        if now - self._last_data >= self._timeout:
            message = f"no answer from the upstream for {self._timeout:.0f}s"
            self._fail(UpstreamError("timeout", message, not self._received_any))

    async def wait(self) -> None:
        """Wait until there is news: some body bytes, completion, or an error."""
        if self._error is not None:
            raise self._error
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    async def read_head(self) -> tuple[int, list[tuple[str, str]]]:
        while self._headers is None:
            await self.wait()
        return self._status, self._headers

    async def read_all(self) -> bytes:
        while not self._complete:
            await self.wait()
        return bytes(self._body)

    async def read_some(self) -> bytes:
        """Body bytes received so far and not yet returned; b'' once the body is complete."""
        while not self._body and not self._complete:
            await self.wait()
        data = bytes(self._body)
        self._body.clear()
        return data

    @property
    def reusable(self) -> bool:
        return self._complete and self._keep_alive and not self._until_close and not self.closed

    def finish(self) -> None:
        self._busy.discard(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None and not self._complete:
            self._error = error
        self._busy.discard(self)
        self._wake()
        self.close()


class UpstreamExchange:
    """An upstream request in flight: its head, then its body whole or piece by piece. Use as a context manager."""

    def __init__(self, client: HttpClient, origin: Origin, connection: _Connection):
        self._client = client
        self._origin = origin
        self._connection = connection
        self.status = 0
        self.headers: list[tuple[str, str]] = []

    async def read_all(self) -> bytes:
        return await self._connection.read_all()

    async def iter_body(self) -> AsyncIterator[bytes]:
        while True:
            data = await self._connection.read_some()
            if not data:
                return
            yield data

    def release(self) -> None:
        """Return the connection to the pool if its answer was read whole; otherwise close it."""
        connection = self._connection
        connection.finish()
        if connection.reusable:
            self._client._put_back(self._origin, connection)
        else:
            connection.close()

    async def __aenter__(self) -> UpstreamExchange:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


class HttpClient:
    def __init__(self, connect_timeout: float = 10.0):
        self.connect_timeout = connect_timeout
        self._pools: dict[str, list[_Connection]] = {}  # idle connections by upstream URL
        self._busy: set[_Connection] = set()
        self._sweeper: asyncio.Task[None] | None = None

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(_SWEEP_S)
            now = loop.time()
            for connection in list(self._busy):
                connection.check_timeout(now)

    async def open(
        self,
        origin: Origin,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        timeout: float,
    ) -> UpstreamExchange:
        """Send a request and wait for the head of its answer. Raises UpstreamError."""
        head = [f"{method} {origin.base_path}{path} HTTP/1.1\r\nHost: {origin.host_header}\r\n"]
        head.extend(f"{name}: {value}\r\n" for name, value in headers)
        if body or method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body)}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + body
        connection = await self._connection(origin)
        try:
            return await self._exchange(origin, connection, data, method == "HEAD", timeout)
        except UpstreamError as error:
            stale = connection.reused and error.before_response and error.kind == "disconnected"
            if not (stale and method in _IDEMPOTENT):
                raise
        # The pooled connection had most likely been closed by the upstream while idle, but the request was written
        # to it and may have arrived: only a request that may be repeated is sent once more, on a fresh connection.
        connection = await self._connect(origin)
        return await self._exchange(origin, connection, data, method == "HEAD", timeout)

    async def request(
        self,
        origin: Origin,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes = b"",
        timeout: float = 30.0,
    ) -> ClientResponse:
        """A whole request and answer. Raises UpstreamError on transport failure (never for an HTTP status)."""
        exchange = await self.open(origin, method, path, headers, body, timeout)
        async with exchange:
            payload = await exchange.read_all()
        return ClientResponse(exchange.status, exchange.headers, payload)

    async def _exchange(
        self, origin: Origin, connection: _Connection, data: bytes, head_method: bool, timeout: float
    ) -> UpstreamExchange:
        connection.send(data, head_method, timeout)
        try:
            status, headers = await connection.read_head()
        except BaseException:
            connection.finish()
            connection.close()
            raise
        exchange = UpstreamExchange(self, origin, connection)
        exchange.status = status
        exchange.headers = headers
        return exchange

    async def _connection(self, origin: Origin) -> _Connection:
        pool = self._pools.get(origin.url)
        if pool:
            now = pool[-1].loop.time()  # not asyncio.get_running_loop(), which makes a getpid() system call
            while pool:
                connection = pool.pop()
                alive = not (connection.closed or connection.transport.is_closing())
                if alive and now - connection.idle_since < _POOL_IDLE_S:
                    connection.reused = True
                    return connection
                connection.close()
        return await self._connect(origin)

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep())
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop, self._busy),
                    origin.host,
                    origin.port,
                    ssl=origin.ssl_context,
                    server_hostname=origin.host if origin.ssl_context else None,
                ),
                self.connect_timeout,
            )
        except TimeoutError:
            raise UpstreamError("connect", f"connecting timed out after {self.connect_timeout:.0f}s", True) from None
        except OSError as error:
            reason = error.strerror or str(error) or type(error).__name__
            raise UpstreamError("connect", f"cannot connect: {reason}", True) from None
        return connection

    def _put_back(self, origin: Origin, connection: _Connection) -> None:
        connection.idle_since = connection.loop.time()
        self._pools.setdefault(origin.url, []).append(connection)

    def forget(self, origin: Origin) -> None:
        """Close the idle connections to an upstream (it was ejected or removed)."""
        self._close_idle(origin.url)

    def _close_idle(self, url: str) -> None:
        """Close and drop the idle connections pooled for one upstream."""
        for connection in self._pools.pop(url, []):
            connection.close()

    async def close(self) -> None:
        for url in list(self._pools):
            self._close_idle(url)
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None

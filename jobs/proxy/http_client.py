"""A lean HTTP/1.1 client with a keep-alive pool per upstream, for relaying to replicas (HTTP or HTTPS).

It exists for the same reason as `http_server`: the relay path must cost little CPU. It also makes the failure the
router cares about explicit: `UpstreamError.before_response` says whether any byte of an answer arrived, which is
what decides if a request may be retried on another replica.

Timeouts: connecting is bounded by `connect_timeout`; reading by `read_timeout` of *inactivity* (a non-streamed
generation sends nothing until it is done, so this is also the longest generation allowed), checked every second.
Idle pooled connections are dropped after `_POOL_IDLE_S`, below uvicorn's (vLLM's server) 5 s keep-alive, and a
request that fails on a reused connection before any answer byte is sent once more on a fresh one (the server closed
it while idle).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_POOL_IDLE_S = 4.0
_SWEEP_S = 1.0  # read timeouts are checked this often (one timer for all requests, not one per request)
_MAX_HEAD_BYTES = 64 * 1024


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
    """One upstream connection; one request at a time. Decodes the response body as it arrives."""

    def __init__(self, loop: asyncio.AbstractEventLoop, busy: set[_Connection]):
        self.loop = loop
        self._busy = busy
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._buffer = bytearray()
        self._waiter: asyncio.Future | None = None
        self._error: UpstreamError | None = None
        self._received_any = False
        self._head_method = False
        self._status = 0
        self._headers: list[tuple[str, str]] | None = None
        self._keep_alive = True
        self._length: int | None = None  # None: chunked or until close
        self._chunked = False
        self._body = bytearray()
        self._complete = False
        self._last_data = 0.0
        self._timeout = 0.0

    # -- transport callbacks ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._received_any = True
        self._last_data = self.loop.time()
        self._buffer += data
        try:
            self._parse()
        except UpstreamError as error:
            self._fail(error)
            return
        self._wake()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._headers is not None and self._length is None and not self._chunked and not self._complete:
            self._complete = True  # body delimited by the connection closing
            self._keep_alive = False
            self._wake()
            return
        if not self._complete:
            what = f" ({type(exc).__name__})" if exc else ""
            self._fail(
                UpstreamError(
                    "disconnected", f"the upstream closed the connection{what}", before_response=not self._received_any
                )
            )

    # -- request lifecycle -----------------------------------------------------------------------------------------

    def send(self, data: bytes, head_method: bool, timeout: float) -> None:
        self._buffer.clear()
        self._error = None
        self._received_any = False
        self._head_method = head_method
        self._status = 0
        self._headers = None
        self._keep_alive = True
        self._length = None
        self._chunked = False
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
        return self._complete and self._keep_alive and not self.closed and not self._buffer

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

    # -- response parsing ------------------------------------------------------------------------------------------

    def _parse(self) -> None:
        buffer = self._buffer
        while self._headers is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > _MAX_HEAD_BYTES:
                    raise UpstreamError("protocol", "the upstream sent oversized headers", False)
                return
            self._parse_head(bytes(buffer[:end]))
            del buffer[: end + 4]
        if self._complete:
            if buffer:
                raise UpstreamError("protocol", "the upstream sent more than one answer", False)
            return
        if self._chunked:
            self._parse_chunks()
        elif self._length is not None:
            take = min(len(buffer), self._length - len(self._body))
            self._body += buffer[:take]
            del buffer[:take]
            if len(self._body) == self._length:
                self._complete = True
        else:
            self._body += buffer
            buffer.clear()

    def _parse_head(self, head: bytes) -> None:
        try:
            status_line, *lines = head.decode("latin-1").split("\r\n")
            protocol, status_text, *_ = status_line.split(" ", 2)
            status = int(status_text)
        except ValueError:
            raise UpstreamError("protocol", "the upstream sent a malformed status line", False) from None
        if not protocol.startswith("HTTP/1."):
            raise UpstreamError("protocol", f"the upstream speaks {protocol[:20]!r}, not HTTP/1.x", False)
        if 100 <= status < 200:
            return  # interim answer (100 Continue): the real one follows
        headers = []
        length = None
        chunked = False
        keep_alive = protocol == "HTTP/1.1"
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep:
                raise UpstreamError("protocol", "the upstream sent a malformed header", False)
            value = value.strip()
            lower = name.lower()
            if lower == "content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise UpstreamError("protocol", "the upstream sent an invalid content-length", False) from None
            elif lower == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif lower == "connection":
                keep_alive = "close" not in value.lower() if keep_alive else "keep-alive" in value.lower()
            headers.append((name, value))
        self._status = status
        self._headers = headers
        self._keep_alive = keep_alive
        if self._head_method or status in (204, 304):
            self._length = 0
            self._complete = True
        elif chunked:
            self._chunked = True
        else:
            self._length = length
            if length == 0:
                self._complete = True
            elif length is None:
                self._keep_alive = False  # read until the upstream closes

    def _parse_chunks(self) -> None:
        buffer = self._buffer
        while not self._complete:
            line_end = buffer.find(b"\r\n")
            if line_end < 0:
                return
            try:
                size = int(bytes(buffer[:line_end]).split(b";", 1)[0], 16)
            except ValueError:
                raise UpstreamError("protocol", "the upstream sent a malformed chunk", False) from None
            if size == 0:
                end = buffer.find(b"\r\n\r\n", line_end)
                if end < 0:
                    return
                del buffer[: end + 4]
                self._complete = True
                return
            if len(buffer) < line_end + 2 + size + 2:
                return
            start = line_end + 2
            self._body += buffer[start : start + size]
            del buffer[: start + size + 2]


class Exchange:
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

    async def __aenter__(self) -> Exchange:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.release()


class HttpClient:
    def __init__(self, connect_timeout: float = 10.0):
        self.connect_timeout = connect_timeout
        self._pools: dict[Origin, list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._sweeper: asyncio.Task | None = None

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
    ) -> Exchange:
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
            if not (connection.reused and error.before_response and error.kind == "disconnected"):
                raise
        # The pooled connection had been closed by the upstream while idle: once more, on a fresh connection.
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
    ) -> Exchange:
        connection.send(data, head_method, timeout)
        try:
            status, headers = await connection.read_head()
        except BaseException:
            connection.finish()
            connection.close()
            raise
        exchange = Exchange(self, origin, connection)
        exchange.status = status
        exchange.headers = headers
        return exchange

    async def _connection(self, origin: Origin) -> _Connection:
        pool = self._pools.get(origin)
        if pool:
            now = asyncio.get_running_loop().time()
            while pool:
                connection = pool.pop()
                if not connection.closed and now - connection.idle_since < _POOL_IDLE_S:
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
        connection.idle_since = asyncio.get_running_loop().time()
        self._pools.setdefault(origin, []).append(connection)

    def forget(self, origin: Origin) -> None:
        """Close the idle connections to an upstream (it was ejected or removed)."""
        for connection in self._pools.pop(origin, []):
            connection.close()

    async def close(self) -> None:
        for origin in list(self._pools):
            self.forget(origin)
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None

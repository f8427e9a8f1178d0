"""A lean HTTP/1.1 server on asyncio protocols, for the proxy's one job: relaying many small JSON requests.

Why not aiohttp's server: on this project's 2-core reference machine an aiohttp proxy (server + client session) spends
150-200 µs of CPU per relayed completion, so it relays at ~0.45x the rate a replica is reached directly; the public
recipe measured 0.43. Parsing and writing the few shapes of request the trainer sends directly on the transport costs
a fraction of that (see docs/benchmarks/proxy.md). The parser is strict and small on purpose:

- HTTP/1.1 and 1.0, keep-alive (1.1 default), `Connection: close`, pipelined requests answered in order;
- request bodies by `Content-Length` or `Transfer-Encoding: chunked`; `Expect: 100-continue` is answered;
- responses either whole (`Content-Length`) or streamed (`Transfer-Encoding: chunked`) with write back-pressure;
- limits on header and body size (431 / 413), 400 on anything malformed, an idle timeout per connection;
- a client that disconnects cancels its request's handler, so upstream work stops too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "expect"}
)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Request:
    """One parsed request. Header names are lower-cased; repeated headers are joined with ', '."""

    __slots__ = ("body", "headers", "keep_alive", "method", "path", "query", "target")

    def __init__(self, method: str, target: str, headers: dict[str, str], body: bytes, keep_alive: bool):
        self.method = method
        self.target = target
        path, _, query = target.partition("?")
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive


class Response:
    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, body: bytes = b"", headers: list[tuple[str, str]] | None = None):
        self.status = status
        self.body = body
        self.headers = headers or []


class ResponseStream:
    """A response whose body is written as it is produced (chunked transfer encoding)."""

    def __init__(self, protocol: _ServerProtocol):
        self._protocol = protocol
        self.finished = False

    async def write(self, data: bytes) -> None:
        if data:
            self._protocol.write(b"%x\r\n%s\r\n" % (len(data), data))
            await self._protocol.drain()

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self._protocol.write(b"0\r\n\r\n")


class Exchange:
    """What a handler gets: the request, and a way to start a streamed response instead of returning one."""

    __slots__ = ("_protocol", "request", "stream")

    def __init__(self, protocol: _ServerProtocol, request: Request):
        self._protocol = protocol
        self.request = request
        self.stream: ResponseStream | None = None

    def start_stream(self, status: int, headers: list[tuple[str, str]]) -> ResponseStream:
        head = [_status_line(status)]
        head.extend(f"{name}: {value}\r\n" for name, value in headers)
        head.append("Transfer-Encoding: chunked\r\n")
        if not self.request.keep_alive:
            head.append("Connection: close\r\n")
        head.append("\r\n")
        self._protocol.write("".join(head).encode("latin-1"))
        self.stream = ResponseStream(self._protocol)
        return self.stream


Handler = Callable[[Exchange], Awaitable[Response | None]]


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


_STATUS_LINES: dict[int, str] = {}


def _status_line(status: int) -> str:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {phrase}\r\n"
    return line


def encode_response(response: Response, keep_alive: bool, head_only: bool = False) -> bytes:
    lines = [_status_line(response.status)]
    lines.extend(f"{name}: {value}\r\n" for name, value in response.headers)
    lines.append(f"Content-Length: {len(response.body)}\r\n")
    if not keep_alive:
        lines.append("Connection: close\r\n")
    lines.append("\r\n")
    head = "".join(lines).encode("latin-1")
    return head if head_only else head + response.body


class _ServerProtocol(asyncio.Protocol):
    """One client connection: parse requests, run the handler for one at a time, write answers in order."""

    def __init__(self, server: HttpServer):
        self._server = server
        self._loop = server.loop
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._task: asyncio.Task | None = None
        self._closed = False
        self._paused_reading = False
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._last_activity = 0.0
        self._idle_handle: asyncio.TimerHandle | None = None
        # Partially parsed request: (method, target, headers, keep_alive).
        self._head: tuple[str, str, dict[str, str], bool] | None = None
        self._length = 0
        self._chunked = False
        self._chunks = bytearray()

    # -- transport callbacks ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._server.connections.add(self)
        self._touch()
        self._idle_handle = self._loop.call_later(self._server.idle_timeout, self._check_idle)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._last_activity = self._loop.time()
        if self._task is None:
            self._parse()
        elif len(self._buffer) > MAX_HEAD_BYTES and not self._paused_reading:
            # A pipelining client is far ahead of us: stop reading until the current answer is out.
            self._paused_reading = True
            self._transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server.connections.discard(self)
        self._can_write.set()
        if self._idle_handle is not None:
            self._idle_handle.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # -- writing ---------------------------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self._closed:
            self._transport.write(data)

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionResetError("the client closed the connection")
        await self._can_write.wait()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._transport.close()

    # -- idle timeout ----------------------------------------------------------------------------------------------

    def _touch(self) -> None:
        self._last_activity = self._loop.time()

    def _check_idle(self) -> None:
        if self._closed:
            return
        idle_for = self._loop.time() - self._last_activity
        if self._task is None and idle_for >= self._server.idle_timeout:
            self.close()
            return
        self._idle_handle = self._loop.call_later(max(self._server.idle_timeout - idle_for, 1.0), self._check_idle)

    # -- parsing ---------------------------------------------------------------------------------------------------

    def _parse(self) -> None:
        try:
            request = self._next_request()
        except _BadRequest as error:
            self._fail(error.status, str(error))
            return
        if request is not None:
            self._task = self._loop.create_task(self._serve(request))

    def _next_request(self) -> Request | None:
        buffer = self._buffer
        if self._head is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise _BadRequest(431, "request headers are too large")
                return None
            if end > MAX_HEAD_BYTES:
                raise _BadRequest(431, "request headers are too large")
            self._head = self._parse_head(bytes(buffer[:end]))
            del buffer[: end + 4]
        method, target, headers, keep_alive = self._head
        if self._chunked:
            if not self._read_chunks():
                return None
            body = bytes(self._chunks)
            self._chunks = bytearray()
        else:
            if len(buffer) < self._length:
                return None
            body = bytes(buffer[: self._length])
            del buffer[: self._length]
        self._head = None
        self._chunked = False
        return Request(method, target, headers, body, keep_alive)

    def _parse_head(self, head: bytes) -> tuple[str, str, dict[str, str], bool]:
        try:
            text = head.decode("latin-1")
            request_line, *lines = text.split("\r\n")
            method, target, protocol = request_line.split(" ")
        except ValueError:
            raise _BadRequest(400, "malformed request line") from None
        if protocol not in ("HTTP/1.1", "HTTP/1.0") or not target.startswith("/"):
            raise _BadRequest(400, f"unsupported request line {request_line[:100]!r}")
        headers: dict[str, str] = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise _BadRequest(400, "malformed header line")
            name = name.lower()
            value = value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        version = protocol[5:]
        connection = headers.get("connection", "").lower()
        keep_alive = "close" not in connection if version == "1.1" else "keep-alive" in connection
        encoding = headers.get("transfer-encoding", "").lower()
        if encoding:
            if encoding != "chunked" or "content-length" in headers:
                raise _BadRequest(400, f"unsupported transfer-encoding {encoding!r}")
            self._chunked = True
            self._length = 0
        else:
            try:
                self._length = int(headers.get("content-length", "0"))
            except ValueError:
                raise _BadRequest(400, "invalid content-length") from None
            if self._length < 0:
                raise _BadRequest(400, "invalid content-length")
            if self._length > self._server.max_body:
                raise _BadRequest(413, f"request body larger than {self._server.max_body} bytes")
        if headers.get("expect", "").lower() == "100-continue":
            self.write(_CONTINUE)
        return method, target, headers, keep_alive

    def _read_chunks(self) -> bool:
        """Move complete chunks from the buffer into the body; True once the last chunk and trailers are in."""
        buffer = self._buffer
        while True:
            line_end = buffer.find(b"\r\n")
            if line_end < 0:
                if len(buffer) > 1024:
                    raise _BadRequest(400, "malformed chunk size line")
                return False
            try:
                size = int(bytes(buffer[:line_end]).split(b";", 1)[0], 16)
            except ValueError:
                raise _BadRequest(400, "malformed chunk size line") from None
            if size == 0:
                trailers_end = buffer.find(b"\r\n\r\n", line_end)
                if trailers_end == line_end:
                    del buffer[: line_end + 4]
                    return True
                if trailers_end < 0:
                    return False
                del buffer[: trailers_end + 4]
                return True
            if len(buffer) < line_end + 2 + size + 2:
                return False
            start = line_end + 2
            self._chunks += buffer[start : start + size]
            if len(self._chunks) > self._server.max_body:
                raise _BadRequest(413, f"request body larger than {self._server.max_body} bytes")
            del buffer[: start + size + 2]

    def _fail(self, status: int, message: str) -> None:
        self.write(encode_response(Response(status, message.encode(), [("Content-Type", "text/plain")]), False))
        self.close()

    # -- serving ---------------------------------------------------------------------------------------------------

    async def _serve(self, request: Request) -> None:
        exchange = Exchange(self, request)
        try:
            response = await self._server.handler(exchange)
        except asyncio.CancelledError:
            self.close()
            raise
        except Exception:
            log.exception("unhandled error answering %s %s", request.method, request.path)
            response = Response(500, b"proxy: internal error; see the proxy log", [("Content-Type", "text/plain")])
            if exchange.stream is not None:
                self.close()  # a streamed answer cannot be replaced half-way: cut it so the client sees an error
                return
        finally:
            self._task = None
        if self._closed:
            return
        if exchange.stream is not None:
            exchange.stream.finish()
        elif response is not None:
            self.write(encode_response(response, request.keep_alive, head_only=request.method == "HEAD"))
        self._touch()
        if not request.keep_alive:
            self.close()
            return
        if self._paused_reading:
            self._paused_reading = False
            self._transport.resume_reading()
        if self._buffer:
            self._parse()


class HttpServer:
    """Serve `handler` on host:port. `start()` binds; `stop()` closes the socket and every open connection."""

    def __init__(
        self,
        handler: Handler,
        host: str,
        port: int,
        idle_timeout: float = 120.0,
        max_body: int = 64 * 1024 * 1024,
    ):
        self.handler = handler
        self.host = host
        self.port = port
        # Longer than aiohttp's client keep-alive (15 s), so clients close idle connections before we do.
        self.idle_timeout = idle_timeout
        self.max_body = max_body
        self.connections: set[_ServerProtocol] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _ServerProtocol(self), self.host, self.port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for connection in list(self.connections):
                connection.close()
            await self._server.wait_closed()
            self._server = None


def forwardable_headers(headers: dict[str, str], drop: frozenset[str]) -> list[tuple[str, str]]:
    """The request headers worth passing upstream: no hop-by-hop header and none named in `drop`."""
    return [(name, value) for name, value in headers.items() if name not in _HOP_BY_HOP and name not in drop]


def content_type_header(headers: list[tuple[str, str]] | None) -> list[tuple[str, str]]:
    """The Content-Type of an upstream answer, to pass on with a body the proxy answers itself ([] if it had none)."""
    for name, value in headers or []:
        if name.lower() == "content-type":
            return [("Content-Type", value)]
    return []

"""A lean HTTP/1.1 server on asyncio protocols, for the proxy's one job: relaying many small JSON requests.

Why not aiohttp's server: on this project's 2-core reference machine an aiohttp proxy (server + client session) spends
150-200 µs of CPU per relayed completion, so it relays at ~0.45x the rate a replica is reached directly; the public
recipe measured 0.43. Requests are parsed by llhttp (Node's parser, through httptools, as uvicorn does), and the few
shapes of answer the proxy sends are written directly on the transport (see docs/benchmarks/proxy.md):

- HTTP/1.1 and 1.0, keep-alive (1.1 default), `Connection: close`, pipelined requests answered in order;
- request bodies by `Content-Length` or `Transfer-Encoding: chunked` (extensions and trailers accepted, ignored);
  `Expect: 100-continue` is answered;
- responses either whole (`Content-Length`) or streamed (`Transfer-Encoding: chunked`) with write back-pressure;
- limits on the head (431) and the body (413, checked as it arrives, whatever its framing), 400 on anything llhttp
  refuses, 505 for other HTTP versions, 501 for other transfer codings; each of these closes the connection;
  an idle timeout per connection;
- a client that disconnects cancels its request's handler, so upstream work stops too.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import cast

import httptools

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
    """One client connection: parse requests (llhttp, through httptools), serve one at a time, answer in order.

    httptools calls the `on_*` methods below from inside `feed_data`. A request is served once its whole body is in;
    requests pipelined behind it wait in `_pending`, and reading pauses until they are answered. Anything llhttp
    refuses, and anything over a limit, is answered with its status and the connection closed: after a framing
    error nothing later on the connection can be trusted to start where it seems to.
    """

    def __init__(self, server: HttpServer):
        self._server = server
        loop = server.loop
        assert loop is not None  # protocols are made by the server `start()` opened, on its loop
        self._loop = loop
        self._transport: asyncio.Transport  # set by connection_made, which asyncio calls before anything else
        self._parser = httptools.HttpRequestParser(self)
        self._pending: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._failed = False
        self._paused_reading = False
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._last_activity = 0.0
        self._idle_handle: asyncio.TimerHandle | None = None
        # The request being parsed.
        self._fail_after: tuple[int, str] | None = None  # an error to answer once the request being served is answered
        self._heads_begun = 0
        self._in_head = False
        self._head_bytes = 0  # of the head's complete parts (target, header lines)
        self._head_wire = 0  # bytes received while the head stayed incomplete (one header may never end)
        self._target = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_size = 0

    # -- transport callbacks ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a TCP server's connections are Transports
        self._server.connections.add(self)
        self._touch()
        self._idle_handle = self._loop.call_later(self._server.idle_timeout, self._check_idle)

    def data_received(self, data: bytes) -> None:
        if self._failed:
            return
        self._last_activity = self._loop.time()
        in_head_before, heads_begun = self._in_head, self._heads_begun
        try:
            self._parser.feed_data(data)
            if self._in_head:
                # Counted only while one head spans several reads, so a read that also ends the previous request
                # does not count against the next one.
                same_head = in_head_before and heads_begun == self._heads_begun
                self._head_wire = self._head_wire + len(data) if same_head else 0
                if self._head_wire > MAX_HEAD_BYTES:
                    raise _BadRequest(431, "request headers are too large")
        except _BadRequest as error:
            self._fail(error.status, str(error))
        except httptools.HttpParserCallbackError as error:
            if isinstance(error.__context__, _BadRequest):
                self._fail(error.__context__.status, str(error.__context__))
            else:
                raise
        except httptools.HttpParserUpgrade:  # CONNECT, or an upgrade llhttp saw before the head was complete
            self._fail(400, "protocol upgrades are not supported; send plain HTTP/1.1 requests")
        except httptools.HttpParserError as error:
            self._fail(400, f"malformed request: {error}")
        self._serve_next()

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

    # -- parser callbacks (from inside feed_data) ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._heads_begun += 1
        self._in_head = True
        self._head_bytes = self._head_wire = 0
        self._target = b""
        self._headers = {}
        self._body = []
        self._body_size = 0

    def on_url(self, part: bytes) -> None:
        self._target += part
        self._count_head(len(part))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers = self._headers
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._parser.get_http_version() not in ("1.1", "1.0"):
            raise _BadRequest(505, "only HTTP/1.0 and HTTP/1.1 are served")
        if not self._target.startswith(b"/"):
            raise _BadRequest(400, "the request target must be a path starting with '/'")
        if self._parser.should_upgrade():
            raise _BadRequest(400, "protocol upgrades are not supported; send plain HTTP/1.1 requests")
        headers = self._headers
        encoding = headers.get("transfer-encoding")
        if encoding is not None and encoding.lower() != "chunked":
            raise _BadRequest(501, f"unsupported transfer-encoding {encoding[:100]!r}; send chunked or Content-Length")
        length = headers.get("content-length")
        if length is not None and int(length) > self._server.max_body:
            raise _BadRequest(413, f"request body larger than {self._server.max_body} bytes")
        if headers.get("expect", "").lower() == "100-continue":
            self.write(_CONTINUE)

    def on_body(self, part: bytes) -> None:
        self._body_size += len(part)
        if self._body_size > self._server.max_body:
            raise _BadRequest(413, f"request body larger than {self._server.max_body} bytes")
        self._body.append(part)

    def on_message_complete(self) -> None:
        parser = self._parser
        request = Request(
            parser.get_method().decode("ascii"),
            self._target.decode("latin-1"),
            self._headers,
            b"".join(self._body),
            parser.should_keep_alive(),
        )
        self._body = []
        self._pending.append(request)
        if self._task is not None and not self._paused_reading:
            # A pipelining client is ahead of us: stop reading until what it sent is answered.
            self._paused_reading = True
            self._transport.pause_reading()

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _BadRequest(431, "request headers are too large")

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

    # -- serving ---------------------------------------------------------------------------------------------------

    def _fail(self, status: int, message: str) -> None:
        """Answer a request that cannot be served, then close: whatever follows it on the wire is not trusted."""
        self._failed = True
        if self._task is None and not self._pending:
            self._answer_error_and_close(status, message)
        else:  # the complete requests before it still get their answers first
            self._fail_after = (status, message)

    def _answer_error_and_close(self, status: int, message: str) -> None:
        self.write(encode_response(Response(status, message.encode(), [("Content-Type", "text/plain")]), False))
        self.close()

    def _serve_next(self) -> None:
        if self._task is None and self._pending and not self._closed:
            self._task = self._loop.create_task(self._serve(self._pending.popleft()))

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
        elif self._pending:
            self._serve_next()
        elif self._fail_after is not None:
            self._answer_error_and_close(*self._fail_after)
        elif self._paused_reading:
            self._paused_reading = False
            self._transport.resume_reading()


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

"""Malformed traffic, both ways through the proxy's HTTP layer (issue 15), in the style of uvicorn's protocol tests.

Server side: the proxy's `HttpServer` on a real socket, behind it a handler that records what reached it. Each row
sends raw bytes and checks the status (or that the connection was closed), that the answer came well within the
socket's 5 s timeout, and that nothing of a refused request was forwarded to the handler.

Client side: the proxy's `HttpClient` against a scripted upstream (a raw socket server that answers with given
bytes). Each row checks that a broken answer is a clear `UpstreamError` at once, not a read timeout much later and
never a wrong body; and that a request whose bytes may have reached an upstream is not sent twice by the transport
unless it may be repeated.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from jobs.proxy.http_client import HttpClient, Origin, UpstreamError
from jobs.proxy.http_server import Exchange, HttpServer, Response
from tests.support.loop_thread import LoopThread

MAX_BODY = 1024
SOCKET_TIMEOUT = 5.0
# Every answer below must come within this bound, below the socket's timeout and the client's read timeout: a parser
# that waits for more bytes instead of refusing would hit those instead. Generous, for a loaded 2-core machine.
PROMPT_S = 4.0


# --- the server side ----------------------------------------------------------------------------------------------


@dataclass
class Recorder:
    """The handler behind the server: what reached it, and a path that waits until released (or cancelled)."""

    seen: list[tuple[str, str, bytes]] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    release: asyncio.Event | None = None

    async def __call__(self, exchange: Exchange) -> Response:
        request = exchange.request
        self.seen.append((request.method, request.target, request.body))
        if request.path == "/slow":
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return Response(200, b"served " + request.target.encode(), [("Content-Type", "text/plain")])


@dataclass
class Served:
    port: int
    recorder: Recorder


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("malformed")
    yield thread
    thread.close()


@pytest.fixture
def served(loop) -> Iterator[Served]:
    recorder = Recorder()

    async def start() -> HttpServer:
        recorder.release = asyncio.Event()
        server = HttpServer(recorder, "127.0.0.1", 0, idle_timeout=1.0, max_body=MAX_BODY)
        await server.start()
        return server

    server = loop.run(start())
    yield Served(server.port, recorder)
    loop.run(server.stop())


@dataclass
class Answer:
    data: bytes
    closed: bool  # the server closed the connection
    seconds: float

    @property
    def statuses(self) -> list[int]:
        return [int(head.split(b" ")[1]) for head in _whole_answers(self.data)]


def send(port: int, *parts: bytes, pause: float = 0.0, answers: int = 1) -> Answer:
    """Send `parts` (pausing between them), then read until the server closes or `answers` answers are whole."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for part in parts:
                sock.sendall(part)
                if pause:
                    time.sleep(pause)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused before everything was sent: its answer is still to be read
        data, closed = b"", False
        while len(_whole_answers(data)) < answers:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            except TimeoutError:
                break
            if not chunk:
                closed = True
                break
            data += chunk
        if not closed and len(_whole_answers(data)) >= answers:
            closed = _closes_soon(sock)
    return Answer(data, closed, time.monotonic() - started)


def _whole_answers(data: bytes) -> list[bytes]:
    answers = []
    while b"\r\n\r\n" in data:
        head, _, rest = data.partition(b"\r\n\r\n")
        length = content_length(head)
        if head.startswith(b"HTTP/1.1 100 "):
            data = rest
            continue
        if len(rest) < length:
            break
        answers.append(head)
        data = rest[length:]
    return answers


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def _closes_soon(sock: socket.socket) -> bool:
    sock.settimeout(0.5)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


HEAD = b"POST /x HTTP/1.1\r\nHost: proxy\r\n"
CHUNKED = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"

REFUSED = {
    # the request line and version
    "not http": (b"NONSENSE\r\n\r\n", 400),
    "http/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    "version 2.0": (b"GET /x HTTP/2.0\r\nHost: p\r\n\r\n", 505),
    "version 1.2": (b"GET /x HTTP/1.2\r\nHost: p\r\n\r\n", 400),
    "version 0.9": (b"GET /x\r\n\r\n", 505),
    "lower-case version": (b"GET /x http/1.1\r\nHost: p\r\n\r\n", 400),
    "absolute target": (b"GET http://elsewhere/x HTTP/1.1\r\nHost: p\r\n\r\n", 400),
    "asterisk target": (b"OPTIONS * HTTP/1.1\r\nHost: p\r\n\r\n", 400),
    "invalid method": (b"G@T /x HTTP/1.1\r\nHost: p\r\n\r\n", 400),
    "nul in target": (b"GET /a\x00b HTTP/1.1\r\nHost: p\r\n\r\n", 400),
    # header syntax
    "bare LF": (b"GET /x HTTP/1.1\nHost: p\n\n", 400),
    "space in a name": (b"GET /x HTTP/1.1\r\nHo st: p\r\n\r\n", 400),
    "space before the colon": (b"GET /x HTTP/1.1\r\nHost : p\r\n\r\n", 400),
    "obs-fold": (b"GET /x HTTP/1.1\r\nHost: p\r\nX-A: a\r\n b\r\n\r\n", 400),
    "control character": (b"GET /x HTTP/1.1\r\nHost: p\r\nX-A: a\x01b\r\n\r\n", 400),
    "no colon": (b"GET /x HTTP/1.1\r\nHost\r\n\r\n", 400),
    "empty name": (b"GET /x HTTP/1.1\r\n: p\r\n\r\n", 400),
    "connect": (b"CONNECT elsewhere:443 HTTP/1.1\r\nHost: elsewhere:443\r\n\r\n", 400),
    "protocol upgrade": (b"GET /x HTTP/1.1\r\nHost: p\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", 400),
    # Content-Length
    "negative length": (HEAD + b"Content-Length: -1\r\n\r\n", 400),
    "non-numeric length": (HEAD + b"Content-Length: 3a\r\n\r\nabc", 400),
    "signed length": (HEAD + b"Content-Length: +3\r\n\r\nabc", 400),
    "duplicated length": (HEAD + b"Content-Length: 3\r\nContent-Length: 3\r\n\r\nabc", 400),
    "two different lengths": (HEAD + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
    "length with chunked": (
        HEAD + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        400,
    ),
    # transfer codings
    "gzip only": (HEAD + b"Transfer-Encoding: gzip\r\n\r\nabc", 501),
    "gzip then chunked": (HEAD + b"Transfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", 501),
    "chunked twice": (HEAD + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    # chunk grammar
    "0x prefix": (CHUNKED + b"0x3\r\nabc\r\n0\r\n\r\n", 400),
    "plus sign": (CHUNKED + b"+3\r\nabc\r\n0\r\n\r\n", 400),
    "underscore": (CHUNKED + b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n", 400),
    "space after the size": (CHUNKED + b"3 \r\nabc\r\n0\r\n\r\n", 400),
    "no CRLF after the data": (CHUNKED + b"3\r\nabcXY0\r\n\r\n", 400),
    "LF only after the size": (CHUNKED + b"3\nabc\n0\n\n", 400),
    "size overflow": (CHUNKED + b"f" * 20 + b"\r\nabc", 400),
    # sizes
    "head too large": (b"GET /x HTTP/1.1\r\nHost: p\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
    "many headers": (b"GET /x HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 60) for i in range(1200)), 431),
    "declared body too large": (HEAD + b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1), 413),
    "one chunk too large": (CHUNKED + b"%x\r\n" % (64 * MAX_BODY) + b"a" * (MAX_BODY + 1), 413),
    "many chunks too large": (
        CHUNKED + b"100\r\n" + b"a" * 256 + b"\r\n" + (b"100\r\n" + b"a" * 256 + b"\r\n") * 4,
        413,
    ),
}


@pytest.mark.parametrize("request_bytes, status", REFUSED.values(), ids=list(REFUSED))
def test_malformed_requests_are_refused_and_the_connection_closed(served, request_bytes, status):
    answer = send(served.port, request_bytes)
    assert answer.statuses == [status], answer.data[:300]
    assert b"Connection: close" in answer.data
    assert answer.closed
    assert answer.seconds < PROMPT_S
    assert served.recorder.seen == []


def test_the_body_limit_holds_before_a_large_chunk_is_all_sent(served):
    """The 413 comes while the client is still sending a 64 KiB chunk: the server does not buffer it first."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=SOCKET_TIMEOUT) as sock:
        sock.sendall(CHUNKED + b"%x\r\n" % (64 * MAX_BODY) + b"a" * (2 * MAX_BODY))
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert served.recorder.seen == []


def test_expect_continue_is_not_answered_for_a_body_over_the_limit(served):
    answer = send(served.port, HEAD + b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (MAX_BODY + 1))
    assert answer.statuses == [413] and b"100 Continue" not in answer.data
    assert served.recorder.seen == []


ACCEPTED = {
    "chunk extension": (CHUNKED + b"3;name=value\r\nabc\r\n0\r\n\r\n", b"abc"),
    "trailer": (CHUNKED + b"3\r\nabc\r\n0\r\nX-Checksum: 1\r\n\r\n", b"abc"),
    "upper-case hex": (CHUNKED + b"A\r\n0123456789\r\n0\r\n\r\n", b"0123456789"),
    "body at the limit": (HEAD + b"Content-Length: %d\r\n\r\n" % MAX_BODY + b"b" * MAX_BODY, b"b" * MAX_BODY),
    "http/1.0": (b"POST /x HTTP/1.0\r\nContent-Length: 2\r\n\r\nok", b"ok"),
}


@pytest.mark.parametrize("request_bytes, body", ACCEPTED.values(), ids=list(ACCEPTED))
def test_unusual_but_valid_requests_are_served(served, request_bytes, body):
    answer = send(served.port, request_bytes)
    assert answer.statuses == [200]
    assert served.recorder.seen == [("POST", "/x", body)]


def test_a_slow_sender_is_served(served):
    request = HEAD + b"Content-Length: 5\r\n\r\nhello"
    answer = send(served.port, *[request[i : i + 1] for i in range(len(request))], pause=0.002)
    assert answer.statuses == [200]
    assert served.recorder.seen == [("POST", "/x", b"hello")]


def test_a_sender_that_stops_mid_head_is_closed_after_the_idle_timeout(served):
    answer = send(served.port, b"GET /x HTTP/1.1\r\nHost: p\r\nX-Half: ")
    assert answer.data == b"" and answer.closed
    assert 0.9 < answer.seconds < 1.0 + PROMPT_S  # idle_timeout=1.0
    assert served.recorder.seen == []


def test_pipelined_requests_are_answered_in_order(served):
    answer = send(served.port, b"GET /a HTTP/1.1\r\nHost: p\r\n\r\nGET /b HTTP/1.1\r\nHost: p\r\n\r\n", answers=2)
    assert answer.statuses == [200, 200]
    assert answer.data.index(b"served /a") < answer.data.index(b"served /b")
    assert [target for _, target, _ in served.recorder.seen] == ["/a", "/b"]


def test_a_malformed_request_behind_a_valid_one_is_refused_after_the_valid_one_is_answered(served):
    answer = send(served.port, b"GET /a HTTP/1.1\r\nHost: p\r\n\r\nGET /b HTTP/1.1\r\nHo st: p\r\n\r\n", answers=2)
    assert answer.statuses == [200, 400]
    assert answer.closed
    assert [target for _, target, _ in served.recorder.seen] == ["/a"]


def test_a_client_that_leaves_mid_body_forwards_nothing(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=SOCKET_TIMEOUT) as sock:
        sock.sendall(HEAD + b"Content-Length: 100\r\n\r\nonly part of it")
    time.sleep(0.2)
    assert served.recorder.seen == []


def test_a_client_that_leaves_cancels_its_request(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=SOCKET_TIMEOUT) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: p\r\n\r\n")
        deadline = time.monotonic() + PROMPT_S
        while not served.recorder.seen and time.monotonic() < deadline:
            time.sleep(0.01)
    assert served.recorder.seen == [("GET", "/slow", b"")]
    assert served.recorder.cancelled.wait(PROMPT_S)


# --- the client side ----------------------------------------------------------------------------------------------


class ScriptedUpstream:
    """A raw socket server: each request it reads (head and Content-Length body) is answered by `script(n)`, the
    bytes to send and whether to close the connection afterwards; n counts requests from 1 over all connections."""

    def __init__(self, script: Callable[[int], tuple[bytes, bool]]):
        self.script = script
        self.requests: list[bytes] = []
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            buffer = b""
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = content_length(head)
                while len(buffer) < length:
                    buffer += sock.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + buffer[:length])
                buffer = buffer[length:]
                reply, close = self.script(len(self.requests))
                sock.sendall(reply)
                if close:
                    return

    def close(self) -> None:
        self._listener.close()


def request(
    loop: LoopThread, port: int, method: str = "POST", requests: int = 1, read_timeout: float = 10.0
) -> list[object]:
    """Send `requests` requests one after another through one HttpClient on `loop` (not `asyncio.run`: the browser
    tests' Playwright keeps an event loop running in the main thread for the whole session); each result is
    (status, body) or the UpstreamError it raised."""

    async def go() -> list[object]:
        client = HttpClient(connect_timeout=2.0)
        origin = Origin.parse(f"http://127.0.0.1:{port}")
        results: list[object] = []
        try:
            for _ in range(requests):
                body = b"{}" if method == "POST" else b""
                try:
                    response = await client.request(origin, method, "/v1/x", [], body, timeout=read_timeout)
                    results.append((response.status, response.body))
                except UpstreamError as error:
                    results.append(error)
        finally:
            await client.close()
        return results

    return loop.run(go())


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
BROKEN_ANSWERS = {
    "negative length": b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    "non-numeric length": b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
    "two lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    "0x chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nok\r\n0\r\n\r\n",
    "signed chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+2\r\nok\r\n0\r\n\r\n",
    "chunk without CRLF": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXY0\r\n\r\n",
    "bare LF": b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",
    "not http": b"HTTX/1.1 200 OK\r\n\r\n",
    "status out of range": b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
    "space in a header name": b"HTTP/1.1 200 OK\r\nX y: 1\r\nContent-Length: 0\r\n\r\n",
    "head too large": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("reply", BROKEN_ANSWERS.values(), ids=list(BROKEN_ANSWERS))
def test_a_malformed_answer_is_a_protocol_error_at_once(loop, reply):
    upstream = ScriptedUpstream(lambda n: (reply, False))
    try:
        started = time.monotonic()
        (result,) = request(loop, upstream.port)
    finally:
        upstream.close()
    assert isinstance(result, UpstreamError), result
    assert result.kind == "protocol"
    assert time.monotonic() - started < PROMPT_S  # not the 10 s read timeout
    assert len(upstream.requests) == 1


def test_an_answer_cut_short_is_an_error_after_the_head(loop):
    upstream = ScriptedUpstream(lambda n: (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", True))
    try:
        (result,) = request(loop, upstream.port)
    finally:
        upstream.close()
    assert isinstance(result, UpstreamError) and result.kind == "disconnected"
    assert result.before_response is False  # some of the answer arrived: it must not be tried elsewhere


# reply, whether the upstream closes after it, the body read, connections used for two requests
ANSWERS = {
    "interim 100 first": (b"HTTP/1.1 100 Continue\r\n\r\n" + OK, False, b"ok", 1),
    "body until close": (b"HTTP/1.1 200 OK\r\n\r\nall of it", True, b"all of it", 2),
    "chunked with extension and trailer": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;x=y\r\nok\r\n0\r\nX-T: 1\r\n\r\n",
        False,
        b"ok",
        1,
    ),
    "an extra answer behind it": (OK + OK, False, b"ok", 2),
}


@pytest.mark.parametrize("reply, close, body, connections", ANSWERS.values(), ids=list(ANSWERS))
def test_valid_answers_are_read_and_the_connection_reused_only_when_clean(loop, reply, close, body, connections):
    upstream = ScriptedUpstream(lambda n: (reply, close))
    try:
        results = request(loop, upstream.port, requests=2)
    finally:
        upstream.close()
    assert results == [(200, body), (200, body)]
    assert upstream.connections == connections


def test_a_head_answer_has_no_body_whatever_its_length(loop):
    upstream = ScriptedUpstream(lambda n: (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", False))
    try:
        (result,) = request(loop, upstream.port, method="HEAD")
    finally:
        upstream.close()
    assert result == (200, b"")


def _closes_on_the_second_request(n: int) -> tuple[bytes, bool]:
    """Answers the first request and keeps the connection; reads the second and closes without an answer (a server
    that closed an idle connection as the request arrived); answers every later one."""
    return (b"", True) if n == 2 else (OK, False)


def test_a_post_that_may_have_arrived_is_not_sent_again(loop):
    upstream = ScriptedUpstream(_closes_on_the_second_request)
    try:
        first, second = request(loop, upstream.port, method="POST", requests=2)
    finally:
        upstream.close()
    assert first == (200, b"ok")
    assert isinstance(second, UpstreamError) and second.kind == "disconnected" and second.before_response
    assert len(upstream.requests) == 2  # the second was not re-sent on a fresh connection


def test_a_get_that_failed_on_a_reused_connection_is_sent_once_more(loop):
    upstream = ScriptedUpstream(_closes_on_the_second_request)
    try:
        results = request(loop, upstream.port, method="GET", requests=2)
    finally:
        upstream.close()
    assert results == [(200, b"ok"), (200, b"ok")]
    assert len(upstream.requests) == 3 and upstream.connections == 2

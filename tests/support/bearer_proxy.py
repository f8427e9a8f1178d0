"""A loopback reverse proxy that demands a bearer token, standing in for the HF Jobs proxy in front of an exposed port.

On Hugging Face, `https://<job_id>--<port>.hf.jobs` answers 401 unless the request carries `Authorization: Bearer
<HF token>`; it forwards everything else to the container and streams the answer back (generation requests stay open
for minutes). This proxy does the same on 127.0.0.1 so a client that forgets the header, or buffers a stream, fails
here as it would there. The Authorization header is forwarded upstream unchanged, as the real proxy does. With `tls`
it speaks HTTPS, as the real edge does, so a client that cannot verify a certificate fails here too.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
from collections.abc import Callable, Collection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-connection",
    "proxy-authorization",
    "expect",
}
_CHUNK = 64 * 1024


class BearerProxy:
    """Forward every request to 127.0.0.1:`target_port` if it carries one of `tokens` as a bearer (any, if `public`).

    `is_up` tells whether the job behind the port is running; when it is not, the proxy answers 503 without trying
    the port (a finished job's port may already belong to someone else). An upstream that refuses the connection
    (the job's server is not listening yet) gives 502, so callers must poll for readiness as they would on HF.
    `read_timeout` bounds each wait for upstream bytes; the default follows the real proxy's multi-minute patience.
    """

    def __init__(
        self,
        target_port: int,
        tokens: Collection[str],
        *,
        public: bool = False,
        is_up: Callable[[], bool] = lambda: True,
        read_timeout: float = 300.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.target_port = target_port
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # the test output stays readable
                pass

            def _handle(self) -> None:
                body = _read_body(self)
                if not public and not bearer_ok(self.headers.get("Authorization"), tokens):
                    send_json(self, 401, {"error": "Unauthorized"}, {"WWW-Authenticate": "Bearer"})
                    return
                if not is_up():
                    send_json(self, 503, {"error": "Job is not running"})
                    return
                proxy._forward(self, body, read_timeout)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _handle

        self.server = _EdgeServer(("127.0.0.1", 0), Handler, tls)
        self.server.daemon_threads = True
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True)

    def start(self) -> BearerProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _forward(self, handler: BaseHTTPRequestHandler, body: bytes, read_timeout: float) -> None:
        upstream = http.client.HTTPConnection("127.0.0.1", self.target_port, timeout=read_timeout)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body:
            headers["Content-Length"] = str(len(body))
        try:
            upstream.request(handler.command, handler.path, body=body or None, headers=headers)
            response = upstream.getresponse()
        except OSError as error:
            upstream.close()
            send_json(handler, 502, {"error": f"Bad Gateway: {type(error).__name__}"})
            return
        try:
            _relay(handler, response)
        except OSError:  # either side hung up mid-stream: nothing left to tell anyone
            handler.close_connection = True
        finally:
            upstream.close()


class _EdgeServer(ThreadingHTTPServer):
    """Serves plain HTTP, or HTTPS with `tls` (the handshake in each connection's own thread, as an edge does)."""

    def __init__(self, address, handler, tls: ssl.SSLContext | None) -> None:
        self.tls = tls
        super().__init__(address, handler)

    def finish_request(self, request, client_address) -> None:
        if self.tls is not None:
            request = self.tls.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        pass  # a client that fails the handshake or hangs up: its own business, as on the real edge


def bearer_ok(header: str | None, tokens: Collection[str]) -> bool:
    """True if an Authorization header value is `Bearer <one of tokens>` (scheme case-insensitive, as in RFC 6750)."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and token.strip() in tokens


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    """Read a request body sent with Content-Length or chunked encoding (streaming clients use the latter)."""
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(parts)
            parts.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""


def _relay(handler: BaseHTTPRequestHandler, response: http.client.HTTPResponse) -> None:
    """Copy the upstream answer to the client as it arrives: fixed length if known, else re-chunked."""
    handler.send_response(response.status, response.reason)
    for key, value in response.getheaders():
        if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
            handler.send_header(key, value)
    length = response.getheader("Content-Length")
    bodiless = handler.command == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200
    if bodiless:
        if length is not None:
            handler.send_header("Content-Length", length)
        handler.end_headers()
        return
    if length is not None:
        handler.send_header("Content-Length", length)
        handler.end_headers()
        while chunk := response.read1(_CHUNK):
            handler.wfile.write(chunk)
        return
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    while chunk := response.read1(_CHUNK):
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    handler.wfile.write(b"0\r\n\r\n")


def send_json(handler: BaseHTTPRequestHandler, status: int, payload: object, headers: dict | None = None) -> None:
    """Answer with a JSON body and an exact Content-Length, so keep-alive connections stay usable."""
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    for key, value in (headers or {}).items():
        handler.send_header(key, value)
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)

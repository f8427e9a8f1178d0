"""A loopback HTTP forwarder that injects faults: 5xx answers, connection resets, stalls and answers cut short.

Put it in front of a real server (moto, a replica) and tell it what the next N requests should suffer. Everything
else is forwarded unchanged, so a client sees a real service misbehaving for a while, not a mock.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-connection",
    "expect",
}


@dataclass
class Fault:
    # "status": answer `status`; "reset": drop the connection; "stall": wait `seconds`, then forward; "cut": forward,
    # then send the answer's head and only half of its body, and close (the client sees a body cut mid-read)
    kind: str
    status: int = 503
    seconds: float = 0.0
    methods: tuple[str, ...] = ()  # empty: any method
    path: str = ""  # only requests whose path contains this (empty: any path)


class FaultyProxy:
    def __init__(self, upstream: str):
        parsed = urlparse(upstream)
        self.upstream_host, self.upstream_port = parsed.hostname, parsed.port
        self._faults: deque[Fault] = deque()
        self._lock = threading.Lock()
        self.injected = 0
        self.forwarded = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy._next_fault(self.command, self.path)
                if fault is not None:
                    if fault.kind == "reset":
                        self.connection.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                        )
                        self.close_connection = True
                        self.connection.close()
                        return
                    if fault.kind == "status":
                        payload = b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
                        self.send_response(fault.status)
                        self.send_header("Content-Length", str(len(payload)))
                        self.send_header("Content-Type", "application/xml")
                        self.end_headers()
                        self.wfile.write(payload)
                        return
                    time.sleep(fault.seconds)
                proxy._forward(self, body, cut=fault is not None and fault.kind == "cut")

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FaultyProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def inject(self, kind: str, count: int = 1, **options) -> None:
        with self._lock:
            self._faults.extend(Fault(kind, **options) for _ in range(count))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def pending(self) -> int:
        with self._lock:
            return len(self._faults)

    def _next_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            fault = self._faults[0] if self._faults else None
            if fault and (not fault.methods or method in fault.methods) and fault.path in path:
                self.injected += 1
                return self._faults.popleft()
            return None

    def _forward(self, handler: BaseHTTPRequestHandler, body: bytes, cut: bool = False) -> None:
        connection = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=60)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
        connection.request(handler.command, handler.path, body=body or None, headers=headers)
        response = connection.getresponse()
        payload = response.read()
        connection.close()
        try:
            handler.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                    handler.send_header(key, value)
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            if handler.command != "HEAD":
                handler.wfile.write(payload[: len(payload) // 2] if cut else payload)
            if cut:
                handler.wfile.flush()
                handler.close_connection = True
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True  # the client gave up waiting (a stall past its timeout)
        with self._lock:
            self.forwarded += 1

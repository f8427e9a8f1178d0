"""A loopback HTTP server that records every request it gets and answers like a minimal vLLM server.

It stands upstream of the proxy (as a replica) or behind the sidecar (as the engine) when a test needs to see exactly
what reached the far side: every request's method, path, headers and body are kept in `requests`, in order.

    echo = EchoServer().start()
    ...  # point a proxy or a sidecar at echo.url
    assert all(seen.values("Authorization") == ["Bearer t"] for seen in echo.requests)
    echo.stop()

Answers: `GET /health` 200; `GET /v1/models` a one-model list; `POST /v1/completions` and `/v1/chat/completions` a
completion naming the requested model; anything else 200 with `{}`. Nothing else is emulated.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BASE_MODEL = "echo/base-model"


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: list[tuple[str, str]]  # as sent, repeated headers included
    body: bytes

    def values(self, name: str) -> list[str]:
        """Every value sent for header `name` (case-insensitive)."""
        return [value for key, value in self.headers if key.lower() == name.lower()]


class EchoServer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: list[Seen] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True)

    def start(self) -> EchoServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def requests(self) -> list[Seen]:
        with self._lock:
            return list(self._seen)

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)


def _answer(method: str, path: str, body: bytes) -> dict:
    if path == "/v1/models":
        return {"object": "list", "data": [{"id": BASE_MODEL, "object": "model"}]}
    if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
        try:
            model = json.loads(body).get("model", BASE_MODEL)
        except (ValueError, AttributeError):
            model = BASE_MODEL
        return {
            "id": "cmpl-echo",
            "object": "text_completion",
            "model": model,
            "choices": [{"index": 0, "text": "4", "finish_reason": "stop"}],
        }
    return {}


def _handler(echo: EchoServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            path = self.path.split("?", 1)[0]
            echo._record(Seen(self.command, path, list(self.headers.items()), body))
            data = json.dumps(_answer(self.command, path, body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _handle

    return Handler

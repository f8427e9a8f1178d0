"""Error answers in vLLM's shape, shared by the CPU engine and the sidecar.

Clients (TRL's `VLLMClient`, the proxy) branch on the status code and sometimes on the message text, e.g. the proxy
retries a load whose 404 says "No adapter found". Both servers of a replica must therefore answer exactly as vLLM
does: `{"error": {"message", "type", "param", "code"}}` with the HTTP status equal to `code`.
"""

from __future__ import annotations

import re

from aiohttp import web

from jobs.contract.layout import STORE_REF_SCHEME

# vLLM 0.27.1 cuts local paths, memory addresses and traceback lines out of every error it answers (its
# `sanitize_message`): "No adapter found for /tmp/x/v3" reaches the client as "No adapter found for <path>".
_SANITIZED = (
    (re.compile(r" at 0x[0-9a-f]+>"), ">"),
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),
)

_TYPES = {
    400: "BadRequestError",
    401: "Unauthorized",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, error_type: str | None = None) -> dict[str, dict[str, object]]:
    """vLLM's JSON error shape, which TRL and OpenAI clients parse."""
    return {
        "error": {"message": message, "type": error_type or _TYPES.get(status, "Error"), "param": None, "code": status}
    }


def error_response(status: int, message: str, error_type: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, error_type), status=status)


def engine_error(status: int, message: str, error_type: str | None = None) -> web.Response:
    """An error as vLLM's server answers it, with what it cuts out of messages cut out. The engine answers so; the
    sidecar's own errors keep their paths, which say what to fix in the store or the cache."""
    for pattern, replacement in _SANITIZED:
        message = pattern.sub(replacement, message)
    return error_response(status, message.strip(), error_type)


def no_adapter_found(lora_name: str, lora_path: str) -> web.Response:
    """vLLM's answer for a load whose path holds no adapter; the proxy retries on its "No adapter found" text. A
    local path reads `<path>`, as vLLM writes it; a `store:` reference (the sidecar's own answer) stays whole."""
    message = f"Loading lora {lora_name} failed: No adapter found for {lora_path}"
    if lora_path.startswith(STORE_REF_SCHEME):
        return error_response(404, message)
    return engine_error(404, message)


def success_text(message: str) -> web.Response:
    """vLLM answers adapter loads and unloads with plain text, not JSON."""
    return web.Response(text=message, content_type="text/plain")

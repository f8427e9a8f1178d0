"""Error answers in vLLM's shape, shared by the CPU engine and the sidecar.

Clients (TRL's `VLLMClient`, the proxy) branch on the status code and sometimes on the message text, e.g. the proxy
retries a load whose 404 says "No adapter found". Both servers of a replica must therefore answer exactly as vLLM
does: `{"error": {"message", "type", "param", "code"}}` with the HTTP status equal to `code`.
"""

from __future__ import annotations

from aiohttp import web

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


def no_adapter_found(lora_name: str, lora_path: str) -> web.Response:
    """vLLM's answer for a load whose path holds no adapter; the proxy retries on exactly this text."""
    return error_response(404, f"Loading lora {lora_name} failed: No adapter found for {lora_path}")


def success_text(message: str) -> web.Response:
    """vLLM answers adapter loads and unloads with plain text, not JSON."""
    return web.Response(text=message, content_type="text/plain")

"""The bodies of `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, checked as vLLM 0.27.1's server checks them.

vLLM validates them with pydantic under FastAPI: a missing or mistyped field is a 400 listing each error as FastAPI
words it (`1 validation error:\\n  {'type': 'missing', 'loc': ('body', 'lora_path'), ...}`, `param` naming the first
field), and only then an empty name or path is its own 400 (`Both 'lora_name' and 'lora_path' must be provided.`).
The sidecar (in front of either engine) and our CPU engine answer the same way through `parse_load` / `parse_unload`,
so a client sees one answer whatever serves the replica (tests/jobs/test_replica_contract.py, on both engines).
"""

from __future__ import annotations

from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from jobs.replica.errors import error_body, error_response

Request = TypeVar("Request", bound=BaseModel)


class LoadAdapter(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadAdapter(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def parse_load(body: Any) -> LoadAdapter | web.Response:
    """The load request, or vLLM's 400 for a body it would refuse."""
    parsed = _validated(LoadAdapter, body)
    if isinstance(parsed, LoadAdapter) and not (parsed.lora_name and parsed.lora_path):
        return error_response(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    return parsed


def parse_unload(body: Any) -> UnloadAdapter | web.Response:
    """The unload request, or vLLM's 400 for a body it would refuse."""
    parsed = _validated(UnloadAdapter, body)
    if isinstance(parsed, UnloadAdapter) and not parsed.lora_name:
        return error_response(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
    return parsed


def _validated(model: type[Request], body: Any) -> Request | web.Response:
    try:
        return model.model_validate(body, from_attributes=True)  # a non-object body: FastAPI's error type
    except ValidationError as error:
        problems = [
            {"type": e["type"], "loc": ("body", *e["loc"]), "msg": e["msg"], "input": e["input"]}
            for e in error.errors(include_url=False, include_context=False)
        ]
        count = f"{len(problems)} validation error{'s' if len(problems) > 1 else ''}"
        message = f"{count}:\n" + "\n".join(f"  {problem}" for problem in problems)
        payload = error_body(400, message, "Bad Request")
        payload["error"]["param"] = ".".join(str(part) for part in problems[0]["loc"])
        return web.json_response(payload, status=400)

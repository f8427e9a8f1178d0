"""Adapter names across the proxy, and editing one top-level JSON field of a body without re-serialising it.

TRL names every policy version `trl-policy-v<N>` and restarts at v1 in each run; on replicas the same version is
`<run_id>-v<N>` (`derived.replica_adapter_name`), so two runs or a branch can share replicas and a restarted trainer
never collides with a name a replica still holds. The proxy rewrites the `model` field on the way in and out.

Bodies pass through byte for byte except that one string value, so every number, escape and key order stays as the
sender wrote it. TRL's requests are flat objects (`model`, a token-id `prompt`, scalars), read here with a few
searches and no JSON parse; anything else (a chat request, `stream`, an escape outside the token ids, a second
"model" or "prompt" key) is read exactly by walking the top-level members with the C JSON scanner, one value at a
time, so the position of each is known. Both ways give a token-id prompt as the same canonical text (ids joined by
commas), which the router hashes.
"""

from __future__ import annotations

import functools
import json
import json.decoder
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from jobs.contract.derived import TRL_ADAPTER_PREFIX, parse_trl_adapter_name, replica_adapter_name

# json's own scanners (the C ones where built): typeshed declares neither `scan_once` nor `json.decoder.scanstring`.
_SCAN: Callable[[str, int], tuple[Any, int]] = vars(json.JSONDecoder())["scan_once"]
_FAST_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]*)"')
_FAST_PROMPT = re.compile(rb'"prompt"\s*:\s*\[')
_FAST_KEYS = re.compile(rb'"(model|prompt|stream|messages)"')  # anywhere else, a key or a value: read exactly
_TOKEN_TEXT = b"0123456789, \t\r\n"
_JSON_SPACE = b" \t\r\n"
_ANSWER_KEY = b'"token_ids"'
_AFTER_ANSWER_KEY = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*\[")
_ID_BYTES = 12  # a token id (at most 10 digits), a comma and a space
_EXACT_FIELDS = frozenset({"model", "prompt", "messages", "stream"})
_SCANSTRING: Callable[[str, int], tuple[str, int]] = vars(json.decoder)["scanstring"]
# Where the JSON whitespace at an index ends: `_WS(text, index).end()`. Typed as never None (the pattern matches the
# empty string too, at any index), so the hot loop of `top_level` calls the C matcher directly, with no check.
_WS = cast("Callable[[str, int], re.Match[str]]", re.compile(r"[ \t\n\r]*").match)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NAMES_REMEMBERED = 256  # a run sends a handful of model names, each thousands of times


class BadName(ValueError):
    """A model or adapter name the proxy refuses (answered with 400)."""


class BadJson(ValueError):
    """A body that is not a JSON object."""


@dataclass(slots=True)
class GenerationFields:
    """What the proxy needs from a generation request."""

    model: object  # the `model` value as sent, unchecked JSON (None if absent)
    model_span: tuple[int, int] | None  # byte offsets of the model's JSON string literal, quotes included
    tokens: bytes | None  # a flat token-id prompt as canonical text: decimal ids joined by commas, b"1,2,3"
    prompt: object  # any other prompt (text, a batch), None if absent
    messages: object  # chat messages, None if absent
    stream: bool


def generation_fields(body: bytes) -> GenerationFields:
    """The model, prompt and stream flag of a completion request. Raises BadJson for a body that is no JSON object."""
    fast = _flat_token_request(body)
    if fast is not None:
        return fast
    try:
        text = body.decode()
    except UnicodeDecodeError:
        raise BadJson("the body is not UTF-8") from None
    members = top_level(text, _EXACT_FIELDS)
    model, span = None, None
    if "model" in members:
        model, start, end = members["model"]
        span = (start, end) if len(body) == len(text) else (len(text[:start].encode()), len(text[:end].encode()))
    prompt = members["prompt"][0] if "prompt" in members else None
    tokens = None
    if isinstance(prompt, list) and all(type(item) is int for item in prompt):
        tokens, prompt = token_text(prompt), None
    messages = members["messages"][0] if "messages" in members else None
    stream = "stream" in members and members["stream"][0] is True
    return GenerationFields(model, span, tokens, prompt, messages, stream)


def _flat_token_request(body: bytes) -> GenerationFields | None:
    """The fields of a body shaped as TRL sends it (one `model` string, a flat token-id `prompt`, no `stream` or
    `messages`), read with a few searches; None for any other body, which is then read exactly."""
    prompt = _FAST_PROMPT.search(body)
    if prompt is None:
        return None
    end = body.find(b"]", prompt.end())
    inner = body[prompt.end() : end]
    if end < 0 or inner.translate(None, _TOKEN_TEXT):
        return None
    # Token ids hold no key and are most of the body, so the rest is searched around them. A backslash there may
    # spell a key in escapes (\u006dodel), which only a JSON reader would see as "model".
    before, after = (0, prompt.start()), (end, len(body))
    if body.find(b"\\", *before) >= 0 or body.find(b"\\", *after) >= 0:
        return None
    model = _FAST_MODEL.search(body)
    if model is None or _FAST_KEYS.findall(body, *before) + _FAST_KEYS.findall(body, *after) != [b"model"]:
        return None
    try:
        name = model.group(1).decode()
    except UnicodeDecodeError:
        raise BadJson("the body is not UTF-8") from None
    span = (model.start(1) - 1, model.end(1) + 1)
    return GenerationFields(name, span, inner.translate(None, _JSON_SPACE), None, None, False)


def answer_token_ids(body: bytes, first: int) -> list[bytes] | None:
    """The first `first` token ids of a completion answer (vLLM's `token_ids`, which TRL asks for; the first choice's
    if there are several) as pieces of canonical text (b"17"), read with a few searches as a request's prompt is and
    no further than they reach; None when the answer has no token ids or anything but ids there."""
    key = body.find(_ANSWER_KEY)
    opening = _AFTER_ANSWER_KEY.match(body, key + len(_ANSWER_KEY)) if key >= 0 else None
    if opening is None:
        return None
    head = body[opening.end() : opening.end() + _ID_BYTES * first]  # enough for `first` ids and their separators
    end = head.find(b"]")
    if end >= 0:
        head = head[:end]
    ids = head.replace(b" ", b"").split(b",", first)[:first]  # json.dumps writes a space after each comma
    return ids if b"".join(ids).isdigit() else None


def token_text(tokens: list[int]) -> bytes:
    """The canonical text of a token-id list, as the fast path reads it from a body: b"1,2,3"."""
    return ",".join(map(str, tokens)).encode()


def replace_model(body: bytes, span: tuple[int, int], name: str) -> bytes:
    """`body` with the JSON string literal at byte offsets `span` replaced by the string `name`."""
    return body[: span[0]] + _json_string(name) + body[span[1] :]


@functools.lru_cache(maxsize=_NAMES_REMEMBERED)
def _json_string(name: str) -> bytes:
    return json.dumps(name).encode()


def restore_model(payload: bytes, served: str, name: str) -> bytes:
    """A replica's answer with its first `"model": "<served>"` member renamed to `name`.

    vLLM puts `model` at the top of a completion (and of each streamed event), before any generated text, and a
    generated text cannot hold an unescaped quote: the first occurrence is the top-level one.
    """
    found = _FAST_MODEL.search(payload)
    if found is None or found.group(1) != served.encode():
        return payload
    return replace_model(payload, (found.start(1) - 1, found.end(1) + 1), name)


def top_level(text: str, wanted: frozenset[str]) -> dict[str, tuple[Any, int, int]]:
    """The members of the JSON object `text` named in `wanted`: name -> (value, start, end) of the value's text.

    Raises BadJson if `text` is not a JSON object.
    """
    try:
        index = _WS(text, 0).end()
        if text[index : index + 1] != "{":
            raise BadJson("the body is not a JSON object")
        index = _WS(text, index + 1).end()
        found: dict[str, tuple[Any, int, int]] = {}
        if text[index : index + 1] == "}":
            return found
        while True:
            if text[index : index + 1] != '"':
                raise BadJson("malformed JSON object")
            key, index = _SCANSTRING(text, index + 1)
            index = _WS(text, index).end()
            if text[index : index + 1] != ":":
                raise BadJson("malformed JSON object")
            start = _WS(text, index + 1).end()
            value, index = _SCAN(text, start)
            if key in wanted:
                found[key] = (value, start, index)
            index = _WS(text, index).end()
            separator = text[index : index + 1]
            if separator == ",":
                index = _WS(text, index + 1).end()
            elif separator == "}":
                if _WS(text, index + 1).end() != len(text):
                    raise BadJson("trailing data after the JSON object")
                return found
            else:
                raise BadJson("malformed JSON object")
    except (StopIteration, ValueError) as error:
        if isinstance(error, BadJson):
            raise
        raise BadJson("malformed JSON") from None


def check_served_name(name: str) -> None:
    """Refuse names that could reach a filesystem path on a replica (vLLM resolves unknown names as paths)."""
    if not name or _CONTROL.search(name) or "\\" in name or ".." in name.split("/"):
        raise BadName(f"model name {name!r} is not allowed: no '..' segments, backslashes or control characters")


class AdapterNames:
    """The mapping between TRL's adapter names and this run's names on the replicas."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._replica_name = re.compile(rf"(?<![\w-]){re.escape(run_id)}-v([1-9][0-9]{{0,8}})(?![\w-])")
        self._to_replica: dict[str, tuple[str, int | None]] = {}  # every request asks; names are few

    def version(self, trl_name: Any, field: str = "lora_name") -> int:
        """The version in a TRL adapter name; BadName (with what to send instead) if it is not one."""
        version = parse_trl_adapter_name(trl_name) if isinstance(trl_name, str) else None
        if version is None:
            raise BadName(
                f"{field} {trl_name!r} is not a TRL adapter name; expected {TRL_ADAPTER_PREFIX}<N> with N >= 1 "
                f"(e.g. {TRL_ADAPTER_PREFIX}3)"
            )
        return version

    def to_replica(self, model: str) -> tuple[str, int | None]:
        """(name to send to a replica, adapter version or None for the base model)."""
        known = self._to_replica.get(model)
        if known is not None:
            return known
        if model.startswith(TRL_ADAPTER_PREFIX):
            version = self.version(model, "model")
            known = replica_adapter_name(self.run_id, version), version
        else:
            check_served_name(model)
            known = model, None
        if len(self._to_replica) >= _NAMES_REMEMBERED:
            self._to_replica.clear()
        self._to_replica[model] = known
        return known

    def to_trl(self, name: str) -> str | None:
        """The TRL name of one of this run's replica adapter names, else None."""
        match = self._replica_name.fullmatch(name)
        return f"{TRL_ADAPTER_PREFIX}{match.group(1)}" if match else None

    def restore_in_text(self, text: str) -> str:
        """Every replica adapter name of this run in `text` (an error message) turned back into its TRL name."""
        return self._replica_name.sub(lambda match: f"{TRL_ADAPTER_PREFIX}{match.group(1)}", text)

"""The CPU engine: transformers + PEFT behind the subset of vLLM's HTTP API that TRL 1.16's AsyncGRPOTrainer uses.

    python -m jobs.replica.cpu_engine --model <path or hub id> --served-model-name <name> --port 8001 \\
        --max-model-len 1024 --max-lora-rank 8 --max-loras 3

It answers like `vllm serve --enable-lora --logprobs-mode processed_logprobs` with `VLLM_SERVER_DEV_MODE=1` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`: same paths, same JSON shapes, same statuses and error messages, so the sidecar,
the proxy and TRL cannot tell it from vLLM. Generation itself is in `jobs.replica.batcher` (continuous batching on a
worker thread); this module is the HTTP surface. It uses CUDA when present, otherwise float32 on the CPU with one torch
thread by default (measured: two threads in both the trainer and the engine slowed a 2-core machine down).

Differences from vLLM that a client could notice: adapters stay loaded until unloaded (no LRU eviction, so
`max_loras` is a floor, reported for TRL's check); log-probs ignore top-k/top-p/min-p truncation (see `sampling.py`);
`echo`, `suffix`, `best_of`, `logit_bias`, `prompt_logprobs` and stop strings are refused with 400; there is no
prefix cache across requests, so `/reset_prefix_cache` has nothing to do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from jobs.replica.adapter_requests import parse_load, parse_unload
from jobs.replica.batcher import AdapterError, BatchEngine, EngineBusy, Sequence
from jobs.replica.errors import engine_error, no_adapter_found, success_text
from jobs.replica.sampling import LOGPROB_FLOOR, SamplingParams, parse_sampling
from jobs.runtime import setup_logging

log = logging.getLogger("jobs.replica.cpu_engine")
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
PAUSE_MODES = ("abort", "wait", "keep")
# Completion fields whose non-default values this engine does not implement: refused rather than silently ignored.
_UNSUPPORTED = {
    "echo": False,
    "suffix": None,
    "best_of": None,
    "logit_bias": None,
    "prompt_logprobs": None,
    "stop": None,
}


@dataclass(frozen=True)
class ServedModel:
    name: str
    path: str
    max_model_len: int
    max_lora_rank: int
    max_loras: int
    dtype: str  # as vLLM reports it, e.g. "torch.float32"
    device: str
    threads: int
    vocab_size: int
    eos_ids: frozenset[int]
    # vLLM's --enable-prompt-tokens-details: answers carry usage.prompt_tokens_details.cached_tokens, always 0 here
    prompt_tokens_details: bool = False


class CpuEngineServer:
    """The HTTP routes; everything that touches the model goes through `BatchEngine`."""

    def __init__(
        self,
        engine: BatchEngine,
        tokenizer: Any,
        served: ServedModel,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.served = served
        self.started = int(time.time())
        self._token_texts: dict[int, str] = {}

    def token_text(self, token: int) -> str:
        """How a single token reads in `logprobs.tokens` (decoded once per token id, then remembered)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        app.router.add_get("/is_paused", self.is_paused)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        return app

    # ---- introspection ---------------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.alive else 503)

    async def models(self, request: web.Request) -> web.Response:
        base = self._model_card(self.served.name, self.served.path, None, self.served.max_model_len)
        cards = [base] + [self._model_card(a.name, a.path, self.served.name, None) for a in self.engine.adapters()]
        return web.json_response({"object": "list", "data": cards})

    def _model_card(self, name: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
        permission = {
            "id": f"modelperm-{secrets.token_hex(16)}",
            "object": "model_permission",
            "created": self.started,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
            "permission": [permission],
        }

    async def server_info(self, request: web.Request) -> web.Response:
        config_format = request.query.get("config_format", "text")
        if config_format not in ("text", "json"):
            return engine_error(400, f"config_format must be 'text' or 'json', got {config_format!r}")
        served = self.served
        config = {
            "model_config": {
                "model": served.path,
                "served_model_name": served.name,
                "dtype": served.dtype,
                "max_model_len": served.max_model_len,
                "max_logprobs": MAX_LOGPROBS,
                "logprobs_mode": "processed_logprobs",
            },
            "lora_config": {
                "max_lora_rank": served.max_lora_rank,
                "max_loras": served.max_loras,
                "lora_dtype": served.dtype,  # resolved, as vLLM reports it
            },
            "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1},
            "scheduler_config": {
                "max_num_seqs": self.engine.max_num_seqs,
                "max_num_batched_tokens": self.engine.max_prefill_tokens,
            },
            "device_config": {"device": served.device},
        }
        body = {
            "vllm_config": config if config_format == "json" else json.dumps(config),
            "vllm_env": {},
            "system_env": {"engine": "jobs.replica.cpu_engine", "torch_threads": served.threads},
        }
        return web.json_response(body)

    async def metrics(self, request: web.Request) -> web.Response:
        stats = self.engine.stats
        labels = {"engine": "0", "model_name": self.served.name}
        running_adapters, waiting_adapters = self.engine.adapter_names_in_use()
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for extra, value in samples:
                lines.append(f"{name}{_labels({**labels, **extra})} {float(value)}")

        metric("vllm:num_requests_running", "gauge", "Sequences in the running batch.", [({}, self.engine.running)])
        metric("vllm:num_requests_waiting", "gauge", "Sequences waiting to be admitted.", [({}, self.engine.waiting)])
        lora_info = {
            "max_lora": str(self.served.max_loras),
            "running_lora_adapters": ",".join(sorted(running_adapters)),
            "waiting_lora_adapters": ",".join(sorted(waiting_adapters)),
        }
        metric("vllm:lora_requests_info", "gauge", "Running stats on LoRA requests.", [(lora_info, time.time())])
        counters = [
            ("vllm:prompt_tokens_total", "Prefill tokens processed.", stats.prompt_tokens),
            ("vllm:generation_tokens_total", "Generation tokens processed.", stats.generation_tokens),
            ("vllm:prefix_cache_queries_total", "Prompt tokens looked up for reuse.", stats.prefix_queries),
            ("vllm:prefix_cache_hits_total", "Prompt tokens reused from a shared prefill.", stats.prefix_hits),
        ]
        for name, help_text, value in counters:
            metric(name, "counter", help_text, [({}, value)])
        reasons: list[tuple[dict[str, str], float]] = [
            ({"finished_reason": reason}, stats.finished.get(reason, 0)) for reason in ("stop", "length", "abort")
        ]
        metric("vllm:request_success_total", "counter", "Finished sequences by finish reason.", reasons)
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    # ---- control ---------------------------------------------------------------------------------------------

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return engine_error(400, f"Invalid mode {mode!r}; use one of {', '.join(PAUSE_MODES)}.")
        await self.engine.pause(mode)
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.engine.paused})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """Nothing to reset: identical prompts share a prefill only within one admission, never across requests."""
        return web.json_response({"success": True})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body, problem = await _json_body(request, object_only=False)
        if problem:
            return problem
        load = parse_load(body)
        if isinstance(load, web.Response):
            return load
        name, path = load.lora_name, load.lora_path
        if name == self.served.name:
            return engine_error(400, f"The lora adapter '{name}' conflicts with a served base model.")
        local = Path(path).expanduser()
        if not local.is_absolute() or not (local / "adapter_config.json").is_file():
            return no_adapter_found(name, path)
        try:
            rank = await asyncio.to_thread(_adapter_rank, local)
        except (OSError, ValueError) as error:
            return engine_error(500, f"Loading lora {name} failed: unreadable adapter_config.json: {error}")
        if rank > self.served.max_lora_rank:
            return engine_error(500, f"LoRA rank {rank} is greater than max_lora_rank {self.served.max_lora_rank}.")
        try:
            await self.engine.load_adapter(name, str(local), inplace=load.load_inplace)
        except AdapterError as error:
            level = logging.WARNING if error.status >= 500 else logging.INFO
            log.log(level, "loading LoRA adapter %s from %s refused: %s", name, local, error)
            return engine_error(error.status, str(error))
        except EngineBusy as error:
            return engine_error(503, str(error))
        log.info("loaded LoRA adapter %s from %s", name, local)
        return success_text(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body, problem = await _json_body(request, object_only=False)
        if problem:
            return problem
        unload = parse_unload(body)
        if isinstance(unload, web.Response):
            return unload
        name = unload.lora_name
        if not self.engine.unload_adapter(name):
            return engine_error(404, f"The lora adapter '{name}' cannot be found.")
        log.info("unloaded LoRA adapter %s", name)
        return success_text(f"Success: LoRA adapter '{name}' removed successfully.")

    # ---- generation ------------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, problem = await _json_body(request)
        if problem:
            return problem
        model = body.get("model")
        adapter_name = None if model in (None, self.served.name) else model
        try:
            prompts, params, n = self._parse_completion(body)
        except ValueError as error:
            return engine_error(400, str(error))
        count = n * len(prompts)
        try:
            slot = self.engine.acquire(adapter_name, count)
        except KeyError:
            return engine_error(404, f"The model `{model}` does not exist.")
        streaming = bool(body.get("stream", False))
        events: asyncio.Queue[tuple[Sequence, int]] = asyncio.Queue()
        finished: dict[int, asyncio.Future[None]] = {}

        def on_update(seq: Sequence, available: int) -> None:
            if streaming:
                events.put_nowait((seq, available))
            elif seq.finished and not finished[id(seq)].done():
                finished[id(seq)].set_result(None)

        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.served.eos_ids)
        sequences = []
        for prompt in prompts:
            for choice in range(n):
                seed = None if params.seed is None else params.seed + choice
                choice_params = params if seed == params.seed else _with_seed(params, seed)
                sequences.append(Sequence(prompt, choice_params, slot, stop_ids, on_update))
        finished.update({id(seq): asyncio.get_running_loop().create_future() for seq in sequences})
        try:
            self.engine.submit(sequences)
        except EngineBusy as error:
            self.engine.release(slot, count)
            return engine_error(503, str(error))
        render = _Renderer(
            self.tokenizer, self.token_text, body, params, model or self.served.name, self.served.prompt_tokens_details
        )
        try:
            if streaming:
                return await self._stream(request, render, sequences, events)
            await asyncio.gather(*finished.values())
        except asyncio.CancelledError:  # the client went away: stop spending compute on it
            self.engine.cancel(sequences)
            raise
        failed = [(seq.error_status, seq.error) for seq in sequences if seq.error]
        if failed:
            return engine_error(*failed[0])
        return web.json_response(render.response(sequences, prompts))

    def _parse_completion(self, body: dict[str, Any]) -> tuple[list[list[int]], SamplingParams, int]:
        for field, default in _UNSUPPORTED.items():
            if body.get(field, default) not in (default, [], ""):
                raise ValueError(f"'{field}' is not supported by the CPU engine; remove it or serve with vLLM.")
        if "prompt" not in body:
            raise ValueError("'prompt' is required: a string, a list of token ids, or a list of either.")
        prompts = [self._tokenize(p, body.get("add_special_tokens", True)) for p in _prompt_list(body["prompt"])]
        n = body.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be at least 1, got {n}.")
        params = parse_sampling(body, MAX_LOGPROBS)
        for prompt in prompts:
            if not prompt:
                raise ValueError("The prompt cannot be empty.")
            outside = [token for token in prompt if not 0 <= token < self.served.vocab_size]
            if outside:
                raise ValueError(f"Token id {outside[0]} is out of vocabulary (size {self.served.vocab_size}).")
            if len(prompt) + params.max_tokens > self.served.max_model_len:
                raise ValueError(
                    f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context length is "
                    f"{self.served.max_model_len} tokens and your request has {len(prompt)} input tokens "
                    f"({params.max_tokens} > {self.served.max_model_len} - {len(prompt)})."
                )
        return prompts, params, n

    def _tokenize(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        return prompt

    async def _stream(
        self,
        request: web.Request,
        render: _Renderer,
        sequences: list[Sequence],
        events: asyncio.Queue[tuple[Sequence, int]],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        index = {id(seq): i for i, seq in enumerate(sequences)}
        sent = [0] * len(sequences)
        texts = [""] * len(sequences)
        done = 0
        while done < len(sequences):
            seq, available = await events.get()
            i = index[id(seq)]
            final = seq.finished and available == len(seq.output)
            if available <= sent[i] and not final:
                continue
            if seq.error:
                chunk = {"error": {"message": seq.error, "type": "InternalServerError", "code": seq.error_status}}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                done += 1
                continue
            chunk, texts[i] = render.stream_chunk(i, seq, sent[i], available, texts[i], final)
            sent[i] = available
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            done += final
        if (render.body.get("stream_options") or {}).get("include_usage"):
            await response.write(f"data: {json.dumps(render.usage_chunk(sequences))}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _Renderer:
    """Turns finished sequences into vLLM's completion JSON."""

    def __init__(
        self,
        tokenizer: Any,
        token_text: Callable[[int], str],
        body: dict[str, Any],
        params: SamplingParams,
        model: str,
        prompt_tokens_details: bool = False,
    ):
        self.tokenizer = tokenizer
        self.prompt_tokens_details = prompt_tokens_details
        self.token_text = token_text
        self.body = body
        self.params = params
        self.model = model
        self.id = f"cmpl-{secrets.token_hex(16)}"
        self.created = int(time.time())
        self.skip_special = bool(body.get("skip_special_tokens", True))
        self.token_ids = bool(body.get("return_token_ids", False))
        self.as_ids = bool(body.get("return_tokens_as_token_ids", False))

    def response(self, sequences: list[Sequence], prompts: list[list[int]]) -> dict[str, Any]:
        choices = []
        for index, seq in enumerate(sequences):
            choice = {
                "index": index,
                "text": self.tokenizer.decode(seq.output, skip_special_tokens=self.skip_special),
                "logprobs": self._logprobs(seq, 0, len(seq.output)),
                "finish_reason": seq.finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            if self.token_ids:
                choice["prompt_token_ids"] = seq.prompt
                choice["token_ids"] = seq.output
            choices.append(choice)
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(sequences, sum(len(p) for p in prompts)),
        }

    def stream_chunk(
        self, index: int, seq: Sequence, start: int, end: int, sent_text: str, final: bool
    ) -> tuple[dict[str, Any], str]:
        text = self.tokenizer.decode(seq.output[:end], skip_special_tokens=self.skip_special)
        if text.endswith("\ufffd") and not final:  # half of a multi-byte character: wait for the rest
            text = sent_text
        choice = {
            "index": index,
            "text": text[len(sent_text) :],
            "logprobs": self._logprobs(seq, start, end),
            "finish_reason": seq.finish_reason if final else None,
            "stop_reason": None,
        }
        if self.token_ids:
            choice["token_ids"] = seq.output[start:end]
            if start == 0:
                choice["prompt_token_ids"] = seq.prompt
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}
        return {**chunk, "choices": [choice]}, text

    def usage_chunk(self, sequences: list[Sequence]) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in {tuple(seq.prompt): seq.prompt for seq in sequences}.values())
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}
        return {**chunk, "choices": [], "usage": self._usage(sequences, prompt_tokens)}

    def _usage(self, sequences: list[Sequence], prompt_tokens: int) -> dict[str, Any]:
        completion_tokens = sum(len(seq.output) for seq in sequences)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            # No prefix cache across requests here: none of a prompt is ever served from a cache.
            "prompt_tokens_details": {"cached_tokens": 0} if self.prompt_tokens_details else None,
        }

    def _logprobs(self, seq: Sequence, start: int, end: int) -> dict[str, Any] | None:
        if self.params.logprobs is None:
            return None
        tokens = [self._token(t) for t in seq.output[start:end]]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top = []
        for position in range(start, end):
            entry = {self._token(seq.output[position]): max(seq.logprobs[position], LOGPROB_FLOOR)}
            if self.params.logprobs and position < len(seq.top):
                entry.update({self._token(token): value for token, value in seq.top[position]})
            top.append(entry)
        return {
            "text_offset": offsets,
            "token_logprobs": seq.logprobs[start:end],
            "tokens": tokens,
            "top_logprobs": top,
        }

    def _token(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else self.token_text(token)


def _with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "seed": seed})


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    """vLLM's four prompt forms: a string, a token-id list, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt)
    ):
        return list(prompt)
    raise ValueError("'prompt' must be a string, a list of token ids, or a non-empty list of either.")


async def _json_body(request: web.Request, object_only: bool = True) -> tuple[Any, web.Response | None]:
    """The request's JSON, or a 400; with `object_only`, only an object (the adapter requests judge other values as
    vLLM's validation does, in `adapter_requests`)."""
    try:
        body = await request.json()
    except ValueError as error:
        return {}, engine_error(400, f"The request body is not valid JSON: {error}")
    if object_only and not isinstance(body, dict):
        return {}, engine_error(400, "The request body must be a JSON object.")
    return body, None


def _adapter_rank(path: Path) -> int:
    """The largest LoRA rank an adapter directory uses (`r` and any `rank_pattern` override)."""
    config = json.loads((path / "adapter_config.json").read_text())
    return max([int(config.get("r", 8)), *(int(v) for v in (config.get("rank_pattern") or {}).values())])


def _labels(labels: dict[str, str]) -> str:
    escaped = (
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in labels.items()
    )
    return "{" + ",".join(escaped) + "}"


# ---- process entry point ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobs.replica.cpu_engine", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="local folder or Hub id of the base model")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--served-model-name", default=None, help="name of the base model in the API (default --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=1)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1; see the module docstring)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="largest running batch")
    parser.add_argument("--max-prefill-tokens", type=int, default=8192, help="padded prompt tokens per prefill")
    parser.add_argument(
        "--enable-prompt-tokens-details", action="store_true", help="answer usage.prompt_tokens_details, as vLLM"
    )
    parser.add_argument(
        "--no-prefill-sharing", action="store_true", help="prefill identical prompts separately (for benchmarks)"
    )
    return parser


def load_served_model(args: argparse.Namespace) -> tuple[Any, Any, ServedModel, Any]:
    """(model, tokenizer, description, reload) — the model on CUDA if present, else float32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # bfloat16 matmuls are slow on most CPUs, and the CPU trainer computes in float32: match it for ratio == 1.
    dtype = torch.float32 if device == "cpu" else (args.dtype if args.dtype == "auto" else getattr(torch, args.dtype))

    def load() -> Any:
        model = AutoModelForCausalLM.from_pretrained(
            args.model, revision=args.revision, dtype=dtype, attn_implementation="sdpa"
        )
        return model.to(device).eval()

    model = load()
    tokenizer = AutoTokenizer.from_pretrained(args.model, revision=args.revision)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and args.max_model_len > limit:
        raise SystemExit(
            f"--max-model-len {args.max_model_len} exceeds what {args.model} was built for ({limit} positions); "
            f"lower model.max_model_len in the run spec to at most {limit}"
        )
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    served = ServedModel(
        name=args.served_model_name or args.model,
        path=args.model,
        max_model_len=args.max_model_len,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        dtype=str(next(model.parameters()).dtype),
        device=device,
        threads=args.threads,
        vocab_size=model.config.get_text_config().vocab_size,
        eos_ids=frozenset(eos_ids),
        prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    return model, tokenizer, served, load


async def serve(args: argparse.Namespace) -> None:
    model, tokenizer, served, reload = await asyncio.to_thread(load_served_model, args)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(served.eos_ids, default=0)
    engine = BatchEngine(
        model,
        reload,
        asyncio.get_running_loop(),
        pad_id=pad_id,
        max_num_seqs=args.max_num_seqs,
        max_prefill_tokens=args.max_prefill_tokens,
        prefill_sharing=not args.no_prefill_sharing,
    )
    engine.start()
    server = CpuEngineServer(engine, tokenizer, served)
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info(
        "serving %s on %s:%d (%s, %s, %d thread(s), max_loras %d, max_lora_rank %d)",
        served.name,
        args.host,
        args.port,
        served.device,
        served.dtype,
        served.threads,
        served.max_loras,
        served.max_lora_rank,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("shutting down")
    await site.stop()
    await asyncio.to_thread(engine.stop)  # answers every pending request (503), so no handler holds the shutdown
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    setup_logging("cpu-engine")
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Every request names its adapter explicitly, so PEFT's "active adapter" never matters; its note on each unload
    # (one per weight sync), and a deprecation inside PEFT's own loading code, would only fill the job log.
    warnings.filterwarnings("ignore", message=r"Adapter \S+ was active which is now deleted", category=UserWarning)
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()

"""The engine a replica runs, and its exact command line, derived from the run spec in one place.

Both engines listen on 127.0.0.1 only: the sidecar is the replica's single public port. Secrets the engine does not
need (the replica bearer token, the proxy's token, the bucket keys, any vLLM API key) are removed from its
environment; `HF_TOKEN` stays, since vLLM downloads gated base models with it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from jobs import settings
from jobs.contract import RunSpec
from jobs.contract.derived import replica_max_loras, replica_tensor_parallel, vllm_max_lora_rank

# The public recipe's value: what the KV cache may take of the GPU, leaving room for LoRA slots and activations.
GPU_MEMORY_UTILIZATION = 0.85
_ENGINE_ENV_DROPPED = (
    settings.REPLICA_TOKEN.name,
    settings.UPSTREAM_TOKEN.name,
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "VLLM_API_KEY",  # the Jobs endpoint already checks the Authorization header; vLLM must not demand its own
)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class EngineCommand:
    argv: list[str]
    env: dict[str, str]  # the engine's whole environment


def choose_engine(requested: str) -> str:
    """`vllm` or `cpu` for a spec's `compute.engine` (`auto`: vLLM where it is installed and a GPU is visible)."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if requested == "cpu":
        return "cpu"
    if requested == "vllm":
        if not has_vllm:
            raise ValueError(
                "compute.engine is 'vllm' but vLLM is not installed here; use the vLLM image for replicas, "
                "or set compute.engine to 'cpu' or 'auto'"
            )
        return "vllm"
    if requested != "auto":
        raise ValueError(f"unknown engine {requested!r}; use auto, vllm or cpu")
    if has_vllm:
        import torch

        if torch.cuda.is_available():
            return "vllm"
    return "cpu"


def engine_command(
    engine: str, spec: RunSpec, model_path: str, port: int, threads: int = 1, environ: Mapping[str, str] = os.environ
) -> EngineCommand:
    if engine == "vllm":
        return vllm_command(spec, model_path, port, environ)
    return cpu_engine_command(spec, model_path, port, threads, environ)


def vllm_command(spec: RunSpec, model_path: str, port: int, environ: Mapping[str, str] = os.environ) -> EngineCommand:
    """`vllm serve` with everything TRL's adapter-only sync needs (see shared/reference/vllm-runtime-lora.md)."""
    max_loras = replica_max_loras(spec)
    argv = [
        "vllm",
        "serve",
        model_path,
        *_serving_flags(spec, port),
        "--gpu-memory-utilization",
        str(GPU_MEMORY_UTILIZATION),
        # One model over every GPU of the replica's flavor (TRL needs data_parallel_size 1 behind one URL).
        "--tensor-parallel-size",
        str(replica_tensor_parallel(spec.compute)),
        "--enable-lora",
        # Host RAM is cheap next to GPU slots: room for a branch's adapters or the proxy's replay of live versions.
        "--max-cpu-loras",
        str(2 * max_loras),
        "--logprobs-mode",
        "processed_logprobs",  # TRL computes its ratio against log-softmax(logits / temperature)
        "--generation-config",
        "vllm",  # a model card's sampling defaults (e.g. top_p) must not override what TRL sends
    ]
    if spec.model.revision and model_path == spec.model.id:
        argv += ["--revision", spec.model.revision, "--tokenizer-revision", spec.model.revision]
    env = _engine_env(environ)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # registers /v1/load_lora_adapter and /v1/unload_lora_adapter
    env["VLLM_SERVER_DEV_MODE"] = "1"  # registers /pause, /resume and /server_info, which TRL calls
    return EngineCommand(argv=argv, env=env)


def cpu_engine_command(
    spec: RunSpec, model_path: str, port: int, threads: int = 1, environ: Mapping[str, str] = os.environ
) -> EngineCommand:
    """`python -m jobs.replica.cpu_engine` with the same limits vLLM would get."""
    argv = [
        sys.executable,
        "-m",
        "jobs.replica.cpu_engine",
        "--model",
        model_path,
        *_serving_flags(spec, port),
        "--threads",
        str(threads),
    ]
    if spec.model.revision and model_path == spec.model.id:
        argv += ["--revision", spec.model.revision]
    env = _engine_env(environ)
    # The engine imports `jobs` wherever the replica was started from.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    return EngineCommand(argv=argv, env=env)


def _serving_flags(spec: RunSpec, port: int) -> list[str]:
    """The flags both engines take alike: what to serve, where, and the LoRA limits TRL checks at start."""
    return [
        "--served-model-name",
        spec.model.id,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        spec.model.dtype,
        "--max-model-len",
        str(spec.model.max_model_len),
        "--max-lora-rank",
        str(vllm_max_lora_rank(spec.lora.rank)),
        "--max-loras",
        str(replica_max_loras(spec)),
    ]


def _engine_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in environ.items() if key not in _ENGINE_ENV_DROPPED}

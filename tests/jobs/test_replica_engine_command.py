"""Which engine a replica runs, and the command lines it derives from its run spec: vLLM on a GPU (which cannot run
here, so its command is checked), vLLM's CPU build and our engine (which the contract suite runs for real)."""

from __future__ import annotations

import sys

import pytest

from jobs.replica.engine_command import (
    CHECKOUT_VLLM_PYTHON,
    EngineChoice,
    choose_engine,
    cpu_build_settings,
    cpu_engine_command,
    decide_engine,
    engine_command,
    find_cpu_build,
    vllm_command,
)
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
        "--enable-prompt-tokens-details": None,
    }
    assert "--api-key" not in command.argv
    assert "--enforce-eager" not in command.argv and "--no-enable-chunked-prefill" not in command.argv
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


@pytest.mark.parametrize(
    ("requested", "gpu_build", "cpu_build", "cuda", "engine", "cpu_python"),
    [
        ("cpu", True, "/v/python", True, "cpu", None),  # asked for: even beside a GPU and vLLM
        ("auto", True, None, True, "vllm", None),  # the job image on a GPU flavor: `vllm serve`
        ("vllm", True, "/v/python", True, "vllm", None),  # a GPU with its vLLM beats the CPU build
        ("auto", True, None, False, "cpu", None),  # the image on a CPU flavor: ours
        ("auto", False, "/v/python", False, "cpu", None),  # no GPU: ours, faster on a CPU
        ("auto", False, "/v/python", True, "cpu", None),  # a GPU but only the CPU build: ours
        ("auto", False, None, False, "cpu", None),
        ("vllm", False, "/v/python", False, "vllm", "/v/python"),  # asked for, no GPU: the CPU build
        ("vllm", False, "/v/python", True, "vllm", "/v/python"),  # a GPU with no vLLM for it: the CPU build
    ],
)
def test_the_engine_decision_on_each_branch(requested, gpu_build, cpu_build, cuda, engine, cpu_python):
    choice = decide_engine(requested, gpu_build, cpu_build, cuda)
    assert choice.engine == engine and choice.reason.startswith(f"compute.engine is {requested}")
    assert choice.vllm_cpu_python == cpu_python


def test_an_engine_that_cannot_run_here_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"vLLM is not installed here: run `scripts/setup vllm`"):
        decide_engine("vllm", False, None, cuda=True)
    with pytest.raises(ValueError, match="built for GPUs and there is no GPU: choose a replica flavor with a GPU"):
        decide_engine("vllm", True, None, cuda=False)  # HF Jobs: the image on a CPU flavor
    with pytest.raises(ValueError, match="unknown engine"):
        decide_engine("tpu", True, "/v/python", cuda=True)


def test_where_the_cpu_build_is_found(tmp_path):
    named = tmp_path / "python"
    named.write_text("#!/bin/sh\n")
    named.chmod(0o755)
    assert find_cpu_build({"GRPO_VLLM_PYTHON": str(named)}) == str(named)
    for wrong in ("/nowhere/python", str(tmp_path)):  # missing, or a folder
        with pytest.raises(ValueError, match=f"GRPO_VLLM_PYTHON={wrong} is not an executable Python"):
            find_cpu_build({"GRPO_VLLM_PYTHON": wrong})
    assert find_cpu_build({}) == (str(CHECKOUT_VLLM_PYTHON) if CHECKOUT_VLLM_PYTHON.exists() else None)
    # Our engine needs nothing probed: a wrong setting for vLLM does not fail it.
    assert choose_engine("cpu", {"GRPO_VLLM_PYTHON": "/nowhere/python"}).engine == "cpu"


def test_vllm_cpu_build_gets_the_gpu_flags_and_what_the_build_needs():
    spec = hub_spec(rank=16, max_staleness=2)
    environ = {"VLLM_CPU_KVCACHE_SPACE": "4", "PYTHONPATH": "/the/panel/checkout"}
    gpu = vllm_command(spec, "/models/m", 8103, environ)
    choice = EngineChoice("vllm", "asked for", vllm_cpu_python="/opt/vllm/bin/python")
    cpu = engine_command(choice, spec, "/models/m", 8103, threads=2, environ=environ)
    # The build's console script fails (its distribution is vllm-cpu): its module takes the same flags.
    assert cpu.argv[:5] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m"]
    extra, env = cpu_build_settings("0.27.1", threads=2)
    assert flags(cpu.argv) == {**flags(gpu.argv[3:]), "--model": "/models/m", **flags(extra)}
    assert {k: v for k, v in cpu.env.items() if k not in gpu.env} == {
        k: v for k, v in env.items() if k != "VLLM_CPU_KVCACHE_SPACE"
    }
    assert cpu.env["VLLM_CPU_KVCACHE_SPACE"] == "4", "what the job's environment sets wins"
    assert "PYTHONPATH" not in cpu.env, "the build runs in its own environment"


def test_the_cpu_build_workarounds_depend_on_the_release():
    """0.27.1's chunked prefill kills the engine on seeded requests (tests/jobs/test_vllm_cpu.py shows it): off there,
    and only there, so that an upgrade re-decides it (its reproduction must be run against the new release)."""
    fixed, env = cpu_build_settings("0.27.1", threads=1)
    assert fixed == ["--enforce-eager", "--no-enable-chunked-prefill"]
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert cpu_build_settings("0.28.0", threads=1)[0] == ["--enforce-eager"]


@pytest.mark.parametrize(("flavor", "parallel"), [("h200", "1"), ("h200x2", "2"), ("a100x8", "8"), ("cpu-basic", "1")])
def test_a_multi_gpu_replica_flavor_spreads_the_model_over_every_gpu(flavor, parallel):
    """TRL needs one engine (data_parallel_size 1) behind a replica URL: several GPUs mean tensor parallelism."""
    spec = hub_spec()
    compute = spec.compute.model_copy(update={"backend": "hf_jobs", "namespace": "me", "replica_flavor": flavor})
    command = vllm_command(spec.model_copy(update={"compute": compute}), spec.model.id, 8101, {})
    assert flags(command.argv)["--tensor-parallel-size"] == parallel


def test_one_vllm_release_everywhere():
    """The release the CPU build's settings are decided for is the one `scripts/setup vllm` installs and the one the
    replica image runs on HF Jobs."""
    from pathlib import Path

    from jobs.contract import ComputeSpec
    from jobs.replica.engine_command import VLLM_VERSION

    pins = (Path(__file__).resolve().parents[2] / "requirements-vllm.txt").read_text()
    assert f"vllm-cpu=={VLLM_VERSION}\n" in pins
    assert ComputeSpec().replica_image == f"vllm/vllm-openai:v{VLLM_VERSION}"

"""`python -m backend plan`: what a launch would submit, for GPU flavors and for this machine, before anything exists.

That the launchers submit exactly these plans is proven through the Hub emulator in tests/backend/test_launchers.py;
here the plan's content: the trainer under `accelerate launch` on a multi-GPU flavor, the recipe's batch shape on GPU, a
replica's tensor parallelism from its flavor, secret names without values, and errors that name their field.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from backend.context import PanelContext
from backend.database.connection import Database
from backend.launch.plan import derived_values
from backend.launch.preflight import run_preflight
from backend.services.runs import RunService
from jobs.contract import parse_spec
from jobs.demo.preset import demo_spec
from jobs.replica.engine_command import EngineChoice

ROOT = Path(__file__).resolve().parents[2]

OURS = EngineChoice("cpu", "the engine does not matter to these checks")


def plan_command(tmp_path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GRPO_PANEL_DATA": str(tmp_path / "data"), **(env or {})}
    command = [sys.executable, "-m", "backend", "plan", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_math_recipe_on_two_gpu_flavors_uses_every_gpu(tmp_path):
    done = plan_command(tmp_path, "--preset", "math", "--set", "compute.replica_flavor=h200x2", "--set", "grpo.seed=7")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert [job["role"] for job in plan["jobs"]] == ["replica-0", "replica-1", "replica-2", "trainer"]
    trainer = plan["jobs"][-1]
    assert (trainer["flavor"], trainer["image"]) == ("h200x2", "vllm/vllm-openai:v0.27.1")
    module = trainer["command"].index("accelerate.commands.launch")
    assert trainer["command"][module + 1 : module + 4] == ["--multi_gpu", "--num_processes", "2"]
    assert trainer["command"][trainer["command"].index("-m", module) + 1] == "jobs.trainer"
    assert trainer["ports"] == [] and trainer["timeout_s"] == 4 * 3600
    assert trainer["name"] == "grpo-plan-preview-trainer"
    assert set(trainer["secrets"]) >= {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    replica = plan["jobs"][0]
    assert replica["ports"] == [8000] and replica["flavor"] == "h200x2"
    assert "accelerate.commands.launch" not in replica["command"]
    # The bootstrap's source is abbreviated unless --full.
    assert any(arg.startswith("<") and "characters" in arg for arg in trainer["command"])

    derived = plan["derived"]
    assert derived["trainer"] == {
        "gpus": 2,
        "gpu_memory_gb": 141,
        "processes": 2,
        "sharding": "auto",  # decided from the model's size: preflight, which reads it from the Hub, resolves it
        "model_parameters": None,
        "per_device_train_batch_size": 1,  # the recipe's micro-batch on GPU
        "gradient_accumulation_steps": 64,  # 128 completions per step / (1 x 2 processes)
        "completions_per_step": 128,
        "weights_dtype": "float32",
        "bf16_autocast": True,
    }
    assert derived["replicas"]["tensor_parallel_size"] == 2 and derived["replicas"]["gpus_each"] == 2
    assert (derived["replicas"]["dtype"], derived["replicas"]["max_lora_rank"]) == ("bfloat16", 1)  # vLLM takes 1
    rollouts = derived["rollouts"]  # the recipe's measured limits, derived from its 3 replicas and staleness window
    assert (rollouts["max_inflight"], rollouts["queue_size"], rollouts["staleness_window"]) == (384, 768, 2048)
    assert rollouts["expected_trained_share"].startswith("over 90 %") and rollouts["scored_groups"] == 16
    assert derived["evaluation"] is None  # the recipe has no held-out prompts


def test_the_plan_expects_stale_samples_when_the_replicas_may_outrun_the_trainer(tmp_path):
    """Issue 33, item 5: the demo's old limits (64 in flight, 256 queued) against its window of 64 lost half of its
    samples; the plan says so before launch, and the derived limits fit."""
    derived = json.loads(plan_command(tmp_path, "--preset", "demo").stdout)["derived"]["rollouts"]
    assert (derived["max_inflight"], derived["queue_size"], derived["staleness_window"]) == (32, 24, 64)
    assert derived["expected_trained_share"].startswith("over 90 %")
    done = plan_command(tmp_path, "--preset", "demo", "--set", "grpo.max_inflight=64", "--set", "grpo.queue_size=256")
    share = json.loads(done.stdout)["derived"]["rollouts"]["expected_trained_share"]
    assert share.startswith("below 90 %") and "328 samples in flight, scored and queued exceed the staleness" in share


def test_full_prints_the_bootstrap_whole(tmp_path):
    done = plan_command(tmp_path, "--preset", "math", "--full")
    assert done.returncode == 0, done.stderr
    trainer = json.loads(done.stdout)["jobs"][-1]
    source = trainer["command"][2]
    assert trainer["command"][:2] == ["python3", "-c"] and "def main(argv" in source


def test_a_plan_the_spec_refuses_names_the_field_and_submits_nothing(tmp_path):
    done = plan_command(tmp_path, "--preset", "math", "--set", "compute.trainer_processes=3")
    assert done.returncode == 2 and done.stdout == ""
    assert "compute.trainer_processes" in done.stderr and "h200x2" in done.stderr
    unknown = plan_command(tmp_path, "--preset", "math", "--set", "compute.replica_flavor=h100x9")
    assert unknown.returncode == 2 and "compute.replica_flavor" in unknown.stderr
    assert "is not an HF Jobs flavor" in unknown.stderr


def test_the_plan_says_which_engine_the_replicas_run_and_why_and_refuses_one_that_cannot_run(tmp_path):
    """The engine is decided where the replicas run: vLLM on an HF Jobs GPU flavor, refused on a CPU one (the image's
    vLLM is built for GPUs); locally, `cpu` whatever else is set, `vllm` where its CPU build is installed."""
    hub = json.loads(plan_command(tmp_path, "--preset", "math").stdout)["derived"]["replicas"]
    assert (hub["engine"], hub["engine_reason"]) == ("vllm", "compute.engine is auto: vLLM on the GPU")
    cpu_flavor = plan_command(tmp_path, "--preset", "math", "--set", "compute.replica_flavor=cpu-basic")
    assert json.loads(cpu_flavor.stdout)["derived"]["replicas"]["engine"] == "cpu"  # auto: ours
    refused = plan_command(
        tmp_path, "--preset", "math", "--set", "compute.replica_flavor=cpu-basic", "--set", "compute.engine=vllm"
    )
    assert refused.returncode == 2 and refused.stdout == ""
    assert "compute.engine: the vLLM here is built for GPUs and there is no GPU" in refused.stderr
    local = json.loads(plan_command(tmp_path, "--preset", "demo").stdout)["derived"]["replicas"]
    assert (local["engine"], local["engine_reason"]) == ("cpu", "compute.engine is cpu: our CPU engine")
    wrong = {"GRPO_VLLM_PYTHON": str(tmp_path / "no-python")}
    done = plan_command(tmp_path, "--preset", "demo", "--set", "compute.engine=vllm", env=wrong)
    assert done.returncode == 2 and f"GRPO_VLLM_PYTHON={wrong['GRPO_VLLM_PYTHON']} is not an executable" in done.stderr


def test_the_demo_plans_local_processes_with_the_cpu_batch_shape(tmp_path):
    done = plan_command(tmp_path, "--preset", "demo", "--set", "compute.trainer_processes=2")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    trainer = plan["jobs"][-1]
    assert trainer["command"][:4] == [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    assert trainer["command"][-2:] == ["--proxy-port", "PORT"]  # chosen when the job starts
    assert trainer["image"] is None and trainer["flavor"] is None
    cpu = plan["derived"]["trainer"]
    assert (cpu["processes"], cpu["per_device_train_batch_size"], cpu["gradient_accumulation_steps"]) == (2, 32, 1)
    assert (cpu["weights_dtype"], cpu["bf16_autocast"]) == ("float32", False)
    one = json.loads(plan_command(tmp_path, "--preset", "demo").stdout)["jobs"][-1]["command"]
    assert one[:3] == [sys.executable, "-m", "jobs.trainer"]
    # Issue 29: held-out evaluation during the run, its interval and what it may cost (at most eval.prompts = 128).
    assert plan["derived"]["evaluation"] == {
        "every_n_versions": 10,
        "evaluations": 5,
        "tokens_vs_rollouts_at_most": "100.0% with 128 held-out prompts",  # the demo has 32: 25 %
    }
    assert plan["derived"]["replicas"]["max_loras"] == 4  # max_staleness 1 + 2, and the evaluation's own slot


def test_the_trainer_gpus_a_plan_shows_follow_the_hardware_on_both_branches():
    """Locally the trainer uses one GPU per process when this machine has CUDA, none otherwise; on HF Jobs it uses
    every GPU of its flavor (the CUDA branch cannot run here: the decision is a pure function, tested both ways)."""
    local = demo_spec("plan-gpus", "file:///tmp/plan-gpus", compute={"trainer_processes": 2})
    assert derived_values(local, trainer_cuda=True, engine=OURS)["trainer"]["gpus"] == 2
    assert derived_values(local, trainer_cuda=False, engine=OURS)["trainer"]["gpus"] == 0
    data = json.loads(local.to_json())
    data["compute"] = {"backend": "hf_jobs", "namespace": "me", "trainer_flavor": "h200x4", "replica_flavor": "h200"}
    data["storage"] = {"uri": "s3://some-bucket/runs", "region": "us-east-1"}
    hub = parse_spec(data)
    assert derived_values(hub, trainer_cuda=True, engine=OURS)["trainer"]["gpus"] == 4


def test_the_sharding_a_plan_shows_is_the_one_the_trainer_will_choose():
    """DDP while a whole float32 copy fits one GPU of the flavor, FSDP beyond; "auto" until the size is known."""
    data = json.loads(demo_spec("plan-shard", "file:///tmp/plan-shard").to_json())
    data["compute"] = {"backend": "hf_jobs", "namespace": "me", "trainer_flavor": "h200x2", "replica_flavor": "h200"}
    data["storage"] = {"uri": "s3://some-bucket/runs", "region": "us-east-1"}
    hub = parse_spec(data)
    sharding = {
        size: derived_values(hub, True, size, engine=OURS)["trainer"]["sharding"]
        for size in (None, 7_600_000_000, 32e9)
    }
    assert sharding == {None: "auto", 7_600_000_000: "ddp", 32e9: "fsdp"}  # 30 GB fits 60% of 141 GB; 128 GB not
    forced = parse_spec({**data, "compute": {**data["compute"], "trainer_sharding": "fsdp"}})
    assert derived_values(forced, True, engine=OURS)["trainer"]["sharding"] == "fsdp"
    single = parse_spec({**data, "compute": {**data["compute"], "trainer_flavor": "h200"}})
    assert derived_values(single, True, 32e9, engine=OURS)["trainer"]["sharding"] == "single"
    local = demo_spec("plan-shard", "file:///tmp/plan-shard", compute={"trainer_processes": 2})
    assert derived_values(local, False, engine=OURS)["trainer"]["sharding"] == "ddp"  # no GPU memory to outgrow


def test_a_plan_writes_nothing(tmp_path):
    """A dry run keeps no replica token for a run that has none yet (a launch creates and keeps it)."""
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    spec = demo_spec("plan-dry", f"file://{tmp_path / 'store'}")
    RunService(ctx, "local").create(spec)
    ctx.plan(RunService(ctx, "local").get("plan-dry"))
    assert RunService(ctx, "local").get("plan-dry").replica_token_ciphertext is None
    ctx.secrets_for(RunService(ctx, "local").get("plan-dry"))  # what a launch does
    assert RunService(ctx, "local").get("plan-dry").replica_token_ciphertext is not None
    ctx.db.close()


def test_a_passing_check_carries_the_plan_launch_would_submit(tmp_path):
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    spec = demo_spec("plan-check", f"file://{tmp_path / 'store'}", compute={"trainer_processes": 2})
    result = run_preflight(ctx, "local", spec)
    assert result.ok, result.errors
    roles = [job["role"] for job in result.plan["jobs"]]
    assert roles == ["replica-0", "replica-1", "trainer"]
    assert result.plan["derived"]["trainer"]["processes"] == 2
    assert result.plan["spec"] == json.loads(spec.to_json())  # every setting, as the jobs will read it
    failing = run_preflight(ctx, "local", {**json.loads(spec.to_json()), "dataset": {"source": "hub", "id": ""}})
    assert not failing.ok and failing.plan is None
    ctx.db.close()


def test_a_plan_names_the_secrets_a_launch_sends_and_holds_none_of_their_values(tmp_path):
    """With the run's credentials in the vault, the plan is the one Launch submits: every secret by name only."""
    from backend.services.runs import run_row

    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    token, secret = "hf_" + "x" * 34, "s3cret-" + "y" * 33  # made up, like the key below: valid nowhere
    hf = ctx.vault.save("local", "hub", "hf_token", token).id
    keys = ctx.vault.save(
        "local", "bucket", "s3", {"access_key_id": "AKIAEXAMPLEKEY000000", "secret_access_key": secret}
    )
    spec = parse_spec(
        {
            "run_id": "secret-plan",
            "compute": {"backend": "hf_jobs", "namespace": "me", "trainer_flavor": "h200", "replica_flavor": "h200"},
            "storage": {"uri": "s3://some-bucket/runs", "region": "us-east-1"},
        }
    )
    shown = json.dumps(ctx.plan(run_row(spec, "local", "draft", keys.id, hf)).to_json(full=True))
    assert token not in shown and secret not in shown and "AKIAEXAMPLEKEY000000" not in shown
    trainer = json.loads(shown)["jobs"][-1]
    assert set(trainer["secrets"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "UPSTREAM_TOKEN"}
    ctx.db.close()


def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path):
    """Issue 33, item 9: `python -m backend versions my-run | head` ended in a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line, as `head` is after its last
    try:
        done = subprocess.run(
            [sys.executable, "-m", "backend", "plan", "--preset", "demo"],
            cwd=ROOT,
            env={**os.environ, "GRPO_PANEL_DATA": str(tmp_path / "data")},
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.returncode == 128 + signal.SIGPIPE
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_the_demo_commands_options_say_what_they_do_and_their_defaults(capsys):
    from backend.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for option, default in (("--steps", "40"), ("--replicas", "2"), ("--seed", "42"), ("--trainer-processes", "1")):
        described = re.search(rf" {option} [A-Z_]+ (.+?)(?= --[a-z]| examples:)", help_text)
        assert described and described.group(1).endswith(f"(default: {default})"), (option, help_text)

"""RunSpec validation, defaults, JSON round trip, derived values and the store layout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jobs.contract import RunSpec, SpecError, derived, layout, parse_spec, parse_storage_uri, timeout_seconds
from jobs.demo.preset import demo_spec


def errors_of(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as raised:
        parse_spec(data)
    return raised.value.errors


def test_defaults_follow_the_public_recipe():
    spec = RunSpec(run_id="recipe-1")
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.target_modules) == (1, 2.0, "all-linear")
    assert spec.grpo.num_generations == 8
    assert spec.grpo.learning_rate == 4e-5
    assert (spec.grpo.max_staleness, spec.grpo.weight_sync_steps, spec.grpo.save_steps) == (4, 4, 50)
    assert spec.compute.replica_image == "vllm/vllm-openai:v0.27.1"


def test_json_round_trip_is_exact():
    spec = parse_spec(
        {
            "run_id": "round-trip",
            "name": "a name",
            "rewards": [
                {"kind": "builtin", "name": "regex", "params": {"pattern": r"\d+"}, "weight": 0.5},
                {
                    "kind": "code",
                    "name": "mine",
                    "source": "def f(completions, **kw):\n    return [1.0]\n",
                    "entry_point": "f",
                },
            ],
            "lora": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
            "parent": {"run_id": "other-run", "version": 3},
        }
    )
    text = spec.to_json()
    assert RunSpec.from_json(text) == spec
    assert json.loads(text)["schema_version"] == 1


@pytest.mark.parametrize(
    ("data", "field", "fragment"),
    [
        ({"run_id": "../etc"}, "run_id", "not a valid run id"),
        ({"run_id": "UPPER"}, "run_id", "lowercase"),
        ({"run_id": "ab"}, "run_id", "3-48"),
        ({"lora": {"rank": 0}}, "lora.rank", "use a rank from 1 to 512"),
        ({"lora": {"rank": 600}}, "lora.rank", "use a rank from 1 to 512"),
        ({"lora": {"target_modules": ["q_proj", "lm_head"]}}, "lora.target_modules", "lm_head"),
        ({"compute": {"replicas": 0}}, "compute.replicas", "1 to 16"),
        ({"compute": {"replicas": 17}}, "compute.replicas", "1 to 16"),
        ({"compute": {"timeout": "4 hours"}}, "compute.timeout", "'30m'"),
        ({"compute": {"backend": "hf_jobs"}}, "compute.namespace", "required for HF Jobs"),
        ({"grpo": {"max_staleness": -1}}, "grpo.max_staleness", "cannot be negative"),
        ({"grpo": {"max_staleness": 0}}, "grpo.max_staleness", "requests still in flight fail; use 1"),
        ({"grpo": {"top_p": 0.9}}, "grpo.top_p", "TRL 1.16 does not model"),
        ({"grpo": {"top_k": 20}}, "grpo.top_k", "leave top-k at 0"),
        ({"grpo": {"max_staleness": 40}}, "grpo.max_staleness", "at most 16"),
        ({"grpo": {"queue_size": 4}}, "grpo.queue_size", "cannot hold one group of 8"),
        ({"grpo": {"max_inflight": 4}}, "grpo.max_inflight", "raise it to at least 8"),
        ({"grpo": {"completions_per_step": 100}}, "grpo.completions_per_step", "multiple of num_generations"),
        ({"grpo": {"max_stalenes": 2}}, "grpo.max_stalenes", "not a known field"),
        ({"grpo": {"max_completion_length": 5000}}, "grpo.max_completion_length", "below model.max_model_len"),
        ({"rewards": [{"name": "accuracy"}]}, "rewards.0.name", "unknown built-in reward"),
        ({"rewards": [{"name": "regex", "params": {"patern": "x"}}]}, "rewards.0.params", "allowed: pattern"),
        ({"rewards": [{"kind": "code", "name": "mine"}]}, "rewards.0.source", "needs"),
        ({"rewards": [{"kind": "code", "name": "m", "source": "x=1"}]}, "rewards.0.entry_point", "name of the reward"),
        ({"rewards": []}, "rewards", "at least 1"),
        ({"storage": {"uri": "bucket/prefix"}}, "storage.uri", "not a storage URI"),
        ({"storage": {"uri": "s3://Bad_Bucket"}}, "storage.uri", "not a bucket name"),
        ({"storage": {"uri": "file://relative/path"}}, "storage.uri", "absolute path"),
        ({"storage": {"uri": "s3://bucket", "endpoint": "htps:/typo"}}, "storage.endpoint", "not a URL"),
        ({"model": {"id": "not a model"}}, "model.id", "not a Hub model id"),
        ({"model": {"id": "a/../b"}}, "model.id", "not a Hub model id"),
        ({"dataset": {"source": "store", "id": "../secrets.jsonl"}}, "dataset.id", "inside the store"),
        ({"parent": {"run_id": "same-run", "version": 1}, "run_id": "same-run"}, "parent.run_id", "another run"),
    ],
)
def test_each_rule_names_the_field_and_the_fix(data, field, fragment):
    errors = errors_of({"run_id": "valid-run", **data})
    assert field in errors, errors
    assert fragment in errors[field]


def test_every_error_a_section_holds_is_reported_in_one_pass():
    """Issue 33, item 9: completions_per_step's error came only once the other training errors were mended."""
    with pytest.raises(SpecError) as refused:
        parse_spec(
            {"run_id": "one-pass", "grpo": {"max_steps": -5, "completions_per_step": 100, "queue_size": 2, "top_k": 9}}
        )
    assert set(refused.value.errors) == {
        "grpo.max_steps",
        "grpo.completions_per_step",
        "grpo.queue_size",
        "grpo.top_k",
    }
    assert refused.value.errors["grpo.completions_per_step"].startswith("100 must be a multiple of num_generations (8)")


@pytest.mark.parametrize(
    "secret",
    [
        "hf_abcdefghijklmnopqrstuvwxyz0123",
        "AKIAIOSFODNN7EXAMPLE",
        "Bearer eyJhbGciOiJIUzI1NiJ9.payload",
        "https://user:hunter2@minio.local",
        "password='correct-horse-battery'",
    ],
)
def test_a_spec_carrying_a_secret_is_refused(secret):
    errors = errors_of({"run_id": "leaky", "dataset": {"system_prompt": f"use {secret} please"}})
    assert "dataset.system_prompt" in errors
    assert "secrets never go in a run spec" in errors["dataset.system_prompt"]
    assert secret not in json.dumps(errors)


def test_secrets_in_reward_code_are_refused():
    source = (
        'TOKEN = "hf_abcdefghijklmnopqrstuvwxyz0123"\ndef f(completions, **kw):\n    return [0.0] * len(completions)\n'
    )
    errors = errors_of(
        {"run_id": "leaky", "rewards": [{"kind": "code", "name": "f", "source": source, "entry_point": "f"}]}
    )
    assert "rewards[0].source" in errors


def test_timeouts_parse_like_hf_jobs():
    assert timeout_seconds("90s") == 90
    assert timeout_seconds("30m") == 1800
    assert timeout_seconds("4h") == 14400
    assert timeout_seconds("1d") == 86400
    assert timeout_seconds(120) == 120
    for bad in ("0s", "-5m", "soon", "10y", "8d"):
        with pytest.raises(ValueError):
            timeout_seconds(bad)


def test_rollout_limits_keep_in_flight_and_queued_samples_within_the_staleness_window():
    from backend.launch.presets import math_recipe

    demo = demo_spec("demo-limits", "file:///tmp/store")
    assert derived.staleness_window(demo.grpo) == 64  # staleness 1 × a sync every step × 64 completions
    assert derived.rollout_limits(demo) == (32, 24, 1)  # in flight, queued, TRL's scored groups: 64 samples
    recipe = RunSpec.model_validate(math_recipe("recipe-limits", "me", "bucket"))
    assert derived.staleness_window(recipe.grpo) == 2048  # 4 × 4 × 128
    assert derived.rollout_limits(recipe) == (384, 768, 16)  # the recipe's measured fastest; TRL's 16 groups
    one_group = demo.model_copy(update={"grpo": demo.grpo.model_copy(update={"completions_per_step": 8})})
    assert derived.rollout_limits(one_group) == (8, 8, 1)  # never under one group, however small the window
    chosen = demo.model_copy(update={"grpo": demo.grpo.model_copy(update={"max_inflight": 48, "queue_size": 96})})
    assert derived.rollout_limits(chosen) == (48, 96, 1)


def test_derived_values():
    assert [derived.vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    assert derived.vllm_max_loras(4) == 6
    spec = RunSpec(run_id="derive")
    assert derived.staleness_window(spec.grpo) == 4 * 4 * 128
    assert derived.rollout_limits(spec) == (256, 512, 16)  # two replicas' 128 each; two rounds of them queued
    assert derived.batch_shape(spec.grpo) == (64, 2)
    assert derived.replica_adapter_name("derive", 7) == "derive-v7"
    assert derived.parse_trl_adapter_name(derived.trl_adapter_name(12)) == 12
    assert derived.parse_trl_adapter_name("trl-policy-v0") is None
    assert derived.parse_trl_adapter_name("../trl-policy-v1") is None


def test_layout_keys_are_zero_padded_and_validated():
    assert layout.spec_key("run-a") == "runs/run-a/spec.json"
    assert layout.adapter_prefix("run-a", 7) == "runs/run-a/adapters/v000007/"
    assert layout.manifest_key(layout.adapter_prefix("run-a", 7)) == "runs/run-a/adapters/v000007/manifest.json"
    assert layout.telemetry_key("run-a", "metrics", 42) == "runs/run-a/telemetry/metrics/000000000042.jsonl"
    assert layout.telemetry_key("run-a", "proxy", 3).endswith("000000000003.json")
    assert layout.checkpoint_prefix("run-a", 50) == "runs/run-a/checkpoints/step-00000050/"
    assert layout.status_key("run-a", "replica-1") == "runs/run-a/status/replica-1.json"
    assert layout.control_key("run-a", "upstreams") == "runs/run-a/control/upstreams.json"
    assert layout.parse_version_dir("v000007") == 7 and layout.parse_version_dir("x") is None
    assert layout.parse_checkpoint_dir("step-00000050") == 50
    ordered = [layout.telemetry_key("r-1", "samples", n) for n in (9, 10, 100, 1000)]
    assert ordered == sorted(ordered)
    for bad in (
        lambda: layout.spec_key("../x"),
        lambda: layout.status_key("run-a", "../x"),
        lambda: layout.adapter_prefix("run-a", 0),
        lambda: layout.control_key("run-a", "a/b"),
    ):
        with pytest.raises(ValueError):
            bad()


def test_storage_uris():
    hf = parse_storage_uri("hf://buckets/alice/grpo/runs")
    assert (hf.kind, hf.provider, hf.bucket, hf.prefix, hf.region) == ("s3", "hf", "grpo", "runs", "us-east-1")
    s3 = parse_storage_uri("s3://my-bucket/a/b/", endpoint="https://acct.r2.cloudflarestorage.com/", region="auto")
    assert (s3.bucket, s3.prefix, s3.endpoint) == ("my-bucket", "a/b", "https://acct.r2.cloudflarestorage.com")
    assert "my-bucket" in s3.describe() and "r2.cloudflarestorage.com" in s3.describe()
    assert parse_storage_uri("file:///tmp/x/").root == "/tmp/x"
    with pytest.raises(ValueError, match="credentials"):
        parse_storage_uri("s3://bucket", endpoint="https://key:secret@host")


def test_a_spec_stored_before_a_refusal_was_added_still_loads():
    """Refusals added later (top-p, top-k, staleness 0, HF Jobs timeouts and flavors) apply to new input only: a run
    created by an earlier version must still load, poll and relaunch."""
    old = {
        "run_id": "stored-run",
        "grpo": {"top_p": 0.9, "top_k": 20, "max_staleness": 0},
        "compute": {"backend": "hf_jobs", "namespace": "me", "timeout": "5m", "replica_flavor": "retired-gpu"},
    }
    with pytest.raises(SpecError) as refused:
        parse_spec(old)
    assert {"grpo.top_p", "grpo.top_k", "grpo.max_staleness"} <= set(refused.value.errors)
    with pytest.raises(SpecError, match="is not an HF Jobs flavor"):
        parse_spec({**old, "grpo": {}})
    stored = RunSpec.from_json(json.dumps(old))
    assert (stored.grpo.top_p, stored.grpo.max_staleness, stored.compute.replica_flavor) == (0.9, 0, "retired-gpu")


# --- parity with the installed TRL (issue 17): a TRL bump that changes a rule fails here ---------------------------


def test_the_lora_ranks_and_their_rounding_are_trls():
    """We serve an adapter of any rank TRL trains (r=4 included), with `--max-lora-rank` rounded up exactly as TRL's
    own check asks the server to be restarted with."""
    from trl.experimental.async_grpo import async_grpo_trainer as trl

    assert trl.VLLM_LORA_RANKS == derived.VLLM_LORA_RANKS
    for rank in range(1, trl.VLLM_LORA_RANKS[-1] + 1):
        assert derived.vllm_max_lora_rank(rank) == trl.round_lora_rank(rank), rank
    for impossible in (trl.VLLM_LORA_RANKS[-1] + 1,):
        with pytest.raises(ValueError):
            trl.round_lora_rank(impossible)
        with pytest.raises(ValueError):
            derived.vllm_max_lora_rank(impossible)
    assert parse_spec({"run_id": "rank-four", "lora": {"rank": 4}}).lora.rank == 4


@pytest.mark.parametrize("rank", [1, 4, 16])
@pytest.mark.parametrize("max_staleness", [1, 4])
def test_the_replicas_lora_slots_and_rank_pass_trls_own_server_check(rank, max_staleness):
    """TRL decides from the server's reported `lora_config` whether adapter-only sync works, and refuses a server
    with too few slots or too low a rank: our replicas' values must pass it, and one slot fewer must not."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync

    tiny = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    model = get_peft_model(LlamaForCausalLM(tiny), LoraConfig(r=rank, target_modules=["q_proj", "v_proj"]))
    args = SimpleNamespace(max_staleness=max_staleness)

    def server(max_lora_rank: int, max_loras: int) -> dict:
        lora = {"max_lora_rank": max_lora_rank, "max_loras": max_loras}
        return {"lora_config": lora, "parallel_config": {"data_parallel_size": 1}}

    ours = server(derived.vllm_max_lora_rank(rank), derived.vllm_max_loras(max_staleness))
    assert select_adapter_sync(ours, model, args) is True
    # With held-out evaluation during the run, its own slot comes on top of what TRL asks for.
    evaluating = server(derived.vllm_max_lora_rank(rank), derived.vllm_max_loras(max_staleness, evaluating=True))
    assert select_adapter_sync(evaluating, model, args) is True
    assert evaluating["lora_config"]["max_loras"] == ours["lora_config"]["max_loras"] + 1
    with pytest.raises(ValueError, match="--max-loras"):
        select_adapter_sync(
            server(ours["lora_config"]["max_lora_rank"], ours["lora_config"]["max_loras"] - 1), model, args
        )


def test_every_job_entry_point_takes_its_run_the_same_way():
    """The trainer, replica, proxy and smoke-test jobs share one argument group for the run and its store."""
    groups = set()
    for module in ("jobs.trainer", "jobs.replica", "jobs.proxy", "jobs.smoke"):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        group = done.stdout.split("the run:")[1].split("\n\n")[0]
        assert "--spec" in group and "--store-endpoint" in group and "--store-region" in group, (module, group)
        groups.add(group)
    assert len(groups) == 1, groups

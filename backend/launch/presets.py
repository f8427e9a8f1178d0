"""Starting points for the launch form: the embedded demo, its agent twin, and the public recipe's math sanity run
on HF Jobs."""

from __future__ import annotations

from typing import Any

from jobs.demo.preset import agent_demo_spec, demo_spec

# A completion each preset's rewards can be tried on before a run: the demo's dataset has no reference answers, so
# scoring them gave a newcomer's first reward test nothing but zeros. The math recipe's rows carry their own.
SAMPLE_COMPLETIONS = {"demo": "4 8 15 16 23 42 and 7", "agent": "7", "math": ""}


def demo(run_id: str, storage_uri: str) -> dict[str, Any]:
    """Runs on this machine with no account: tiny built-in model, 2 CPU replicas, a local folder as the bucket."""
    return demo_spec(run_id, storage_uri).model_dump()


def agent(run_id: str, storage_uri: str) -> dict[str, Any]:
    """The demo as an agent: a tiny model warm-started to call a tool learns that looking the answer up pays."""
    return agent_demo_spec(run_id, storage_uri).model_dump()


LOCAL = {"demo": demo, "agent": agent}  # the presets that run on this machine, by name


def math_recipe(run_id: str, namespace: str, bucket: str) -> dict[str, Any]:
    """The public recipe (Qwen2.5-Math-1.5B, LoRA r=1 all-linear, boxed-answer reward) with its fastest measured
    settings: 3 replicas, 384 completions in flight and 768 queued (what `derived.rollout_limits` gives for them), no
    gradient checkpointing (53 min for 500 steps in the blog)."""
    return {
        "run_id": run_id,
        "name": "Math sanity recipe",
        "model": {"id": "Qwen/Qwen2.5-Math-1.5B", "max_model_len": 4096, "dtype": "bfloat16"},
        "dataset": {
            "source": "hub",
            "id": "sail/Sanity-Test-R1D-1.5B",
            "split": "train",
            "prompt_column": "prompt",
            "answer_column": "reward_model.ground_truth",  # where the dataset keeps its gold answer
        },
        "rewards": [{"kind": "builtin", "name": "math_boxed"}],
        "lora": {"rank": 1, "alpha": 2, "target_modules": "all-linear"},
        "grpo": {
            "num_generations": 8,
            "completions_per_step": 128,
            "max_completion_length": 3000,
            "learning_rate": 4e-5,
            "max_steps": 500,
            "max_staleness": 4,
            "weight_sync_steps": 4,
            "gradient_checkpointing": False,
            "save_steps": 50,
        },
        "compute": {
            "backend": "hf_jobs",
            "namespace": namespace,
            "trainer_flavor": "h200x2",
            "replica_flavor": "h200",
            "replicas": 3,
            "timeout": "4h",
            "engine": "auto",
        },
        "storage": {"uri": f"hf://buckets/{namespace}/{bucket}"},
    }

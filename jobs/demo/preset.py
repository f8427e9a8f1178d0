"""The embedded demo run: settings measured to make the tiny model learn in a few dozen steps on two cores.

From shared/reference/tiny-demo-findings.md: lr 2e-2 (the AsyncGRPO default 1e-6 does nothing at this scale), LoRA
r=8 all-linear, 8 groups of 8 per step, 16-token completions, max staleness 1 with a sync every step, no gradient
checkpointing. The reward is the fraction of digit tokens, dense enough for group-relative advantages at step 1.
"""

from __future__ import annotations

from typing import Any

from jobs.contract import DEMO_DATASET_ID, DEMO_MODEL_ID, RunSpec, parse_spec


def demo_spec(run_id: str, storage_uri: str, **sections: dict[str, Any]) -> RunSpec:
    """The demo RunSpec; `sections` override fields per section, e.g. `grpo={"max_steps": 10}`."""
    data: dict[str, Any] = {
        "run_id": run_id,
        "name": "Demo on this machine",
        "model": {"id": DEMO_MODEL_ID, "max_model_len": 512, "dtype": "float32"},
        "dataset": {"source": "builtin", "id": DEMO_DATASET_ID, "prompt_column": "prompt", "answer_column": "answer"},
        "rewards": [{"kind": "builtin", "name": "digit_frac"}],
        "lora": {"rank": 8, "alpha": 16, "target_modules": "all-linear"},
        "grpo": {
            "num_generations": 8,
            "completions_per_step": 64,
            "max_completion_length": 16,
            "learning_rate": 2e-2,
            "max_steps": 40,
            "max_staleness": 1,
            "weight_sync_steps": 1,
            "gradient_checkpointing": False,
            "save_steps": 10,
            "audit_every": 10,
        },
        "compute": {"backend": "local", "replicas": 2, "engine": "cpu", "timeout": "1h"},
        "storage": {"uri": storage_uri},
    }
    for section, values in sections.items():
        if isinstance(data.get(section), dict):
            data[section] = {**data[section], **values}
        else:
            data[section] = values
    if data["dataset"]["source"] == "builtin":
        # The built-in dataset's test split: the same instructions about other things, never trained on; every tenth
        # version scored during the run (a quarter of the rollout tokens: cheap at 16 tokens, and a curve to see).
        data.setdefault("eval", {"split": "test", "every": 10})
    return parse_spec(data)

"""The embedded demo run: settings measured to make the tiny model learn in a few dozen steps on two cores.

From shared/reference/tiny-demo-findings.md: lr 2e-2 (the AsyncGRPO default 1e-6 does nothing at this scale), LoRA
r=8 all-linear, 8 groups of 8 per step, 16-token completions, max staleness 1 with a sync every step, no gradient
checkpointing. The reward is the fraction of digit tokens, dense enough for group-relative advantages at step 1.
"""

from __future__ import annotations

from typing import Any

from jobs.contract import (
    AGENT_DEMO_DATASET_ID,
    AGENT_DEMO_MODEL_ID,
    DEMO_DATASET_ID,
    DEMO_MODEL_ID,
    RunSpec,
    parse_spec,
)


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
    _override(data, sections)
    if data["dataset"]["source"] == "builtin":
        # The built-in dataset's test split: the same instructions about other things, never trained on; every tenth
        # version scored during the run (a quarter of the rollout tokens: cheap at 16 tokens, and a curve to see).
        data.setdefault("eval", {"split": "test", "every": 10})
    return parse_spec(data)


def agent_demo_spec(run_id: str, storage_uri: str, **sections: dict[str, Any]) -> RunSpec:
    """The agent demo: the warm-started tiny model learns that looking a code up in the `codebook` environment pays.

    Each episode is a question, at most two tool turns and an answer; only a reply that is the row's code scores
    (`exact_answer`). The warm-started model calls the tool in about a quarter of its episodes, so most groups mix
    right and wrong episodes from the first step. The learning rate is lower than the digits demo's: the warm start
    already put the model where it must be, and a step as large would unlearn the copying it was taught. Versions are
    evaluated as the digits demo's are, every tenth, on the test split: things the training split never asks about.
    """
    data = demo_spec(run_id, storage_uri).model_dump()
    data.update(
        name="Agent demo on this machine",
        model={**data["model"], "id": AGENT_DEMO_MODEL_ID},
        dataset={**data["dataset"], "id": AGENT_DEMO_DATASET_ID},
        rewards=[{"kind": "builtin", "name": "exact_answer"}],
        # A lookup and an answer take ~25 tokens: the budget leaves room for them and ends an episode that loops.
        environment={"kind": "builtin", "name": "codebook", "max_turns": 2, "max_episode_tokens": 48},
    )
    data["grpo"].update(max_completion_length=32, learning_rate=AGENT_LEARNING_RATE)
    _override(data, sections)
    return parse_spec(data)


AGENT_LEARNING_RATE = 5e-3


def _override(data: dict[str, Any], sections: dict[str, Any]) -> None:
    """Apply `sections`: a dict merges into its section, anything else replaces it."""
    for section, values in sections.items():
        if isinstance(data.get(section), dict) and isinstance(values, dict):
            data[section] = {**data[section], **values}
        else:
            data[section] = values

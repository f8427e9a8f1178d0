"""Values derived from a RunSpec, computed in exactly one place.

The launcher, the replica, the proxy and the trainer all need some of these; deriving them separately is how the
public recipe ended up with `MAX_LORAS` correct in one script and wrong in another.
"""

from __future__ import annotations

import re

from jobs.contract.spec import VLLM_LORA_RANKS, GrpoSpec, RunSpec

TRL_ADAPTER_PREFIX = "trl-policy-v"
_TRL_NAME = re.compile(r"^trl-policy-v([1-9][0-9]{0,8})$")
# Recipe: 128 completions in flight per unit of staleness fill the queue without dropping stale samples.
_QUEUE_PER_STALENESS = 128


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that can serve an adapter of `rank`."""
    for accepted in VLLM_LORA_RANKS:
        if accepted >= rank:
            return accepted
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest ({VLLM_LORA_RANKS[-1]})")


def vllm_max_loras(max_staleness: int) -> int:
    """Adapters a replica must hold at once.

    TRL keeps `max_staleness + 1` versions servable and loads the next one before unloading the oldest; with only
    `+1` slots vLLM silently LRU-evicts a policy that requests still name.
    """
    return max_staleness + 2


def queue_size(grpo: GrpoSpec) -> int:
    if grpo.queue_size is not None:
        return grpo.queue_size
    return max(grpo.max_staleness, 1) * _QUEUE_PER_STALENESS


def batch_shape(grpo: GrpoSpec) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) giving `completions_per_step` on one process.

    Micro-batches hold whole groups where possible and at most 64 completions, which keeps a CPU step's memory flat.
    """
    per_device = grpo.completions_per_step
    while per_device > 64 and per_device % 2 == 0:
        per_device //= 2
    return per_device, grpo.completions_per_step // per_device


def max_model_len(spec: RunSpec) -> int:
    return spec.model.max_model_len


def replica_adapter_name(run_id: str, version: int) -> str:
    """The name an adapter version has on a replica: unique to the run, so runs and branches can share replicas."""
    return f"{run_id}-v{version}"


def trl_adapter_name(version: int) -> str:
    return f"{TRL_ADAPTER_PREFIX}{version}"


def parse_trl_adapter_name(name: str) -> int | None:
    """The version in a TRL adapter name (`trl-policy-v7` -> 7), or None if `name` is not one."""
    match = _TRL_NAME.match(name)
    return int(match.group(1)) if match else None

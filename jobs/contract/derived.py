"""Values derived from a RunSpec, computed in exactly one place.

The launcher, the replica, the proxy and the trainer all need some of these; deriving them separately is how the
public recipe ended up with `MAX_LORAS` correct in one script and wrong in another.
"""

from __future__ import annotations

import re

from jobs.contract.flavors import flavor
from jobs.contract.spec import VLLM_LORA_RANKS, ComputeSpec, GrpoSpec, RunSpec

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


def trainer_gpus(compute: ComputeSpec) -> int:
    """GPUs the trainer job has: its flavor's on HF Jobs; none locally (the embedded default runs on the CPU)."""
    return flavor(compute.trainer_flavor).gpus if compute.backend == "hf_jobs" else 0


def trainer_processes(compute: ComputeSpec) -> int:
    """Training processes (data-parallel ranks): the spec's `trainer_processes`, else one per GPU of the trainer."""
    return compute.trainer_processes or max(1, trainer_gpus(compute))


def replica_tensor_parallel(compute: ComputeSpec) -> int:
    """GPUs one replica's vLLM spreads the model over: every GPU of its flavor (vLLM's --tensor-parallel-size).

    TRL requires the server it talks to to report data_parallel_size == 1, so a multi-GPU replica is one model split
    over its GPUs, never several engines behind one URL.
    """
    return max(1, flavor(compute.replica_flavor).gpus) if compute.backend == "hf_jobs" else 1


def batch_shape(grpo: GrpoSpec, processes: int = 1, cuda: bool = False) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) giving `completions_per_step` over `processes`.

    On GPU the recipe's shape: one completion per micro-batch. TRL normalises each micro-batch's loss by its own
    token count, so a micro-batch of one weights every completion's token mean equally, as the recipe measured. On the
    CPU (the demo) micro-batches hold whole groups of at most 64 completions: one forward per group is what keeps a
    CPU step fast, and the demo's completions all have the same length.
    """
    per_process = grpo.completions_per_step // processes
    per_device = 1 if cuda else per_process
    while per_device > 64 and per_device % 2 == 0:
        per_device //= 2
    return per_device, per_process // per_device


def trainer_precision(cuda: bool) -> tuple[str, bool]:
    """(weights dtype, bf16 autocast): float32 weights always, as TRL 1.16 trains by default; bf16 autocast on GPU.

    Loading the trainer's base weights in bf16 (the replicas' serving dtype) would change ratio, kl and clipping.
    """
    return "float32", cuda


# Of one GPU's memory, the share the trainer's copy of the model may take; the rest holds a micro-batch's activations,
# the LoRA optimizer state and CUDA's own allocations.
TRAINER_WEIGHT_SHARE = 0.6


def trainer_weights_gb(parameters: int, shards: int = 1) -> float:
    """GB one trainer process holds for the model: float32 weights (`trainer_precision`), a whole copy on every GPU
    under DDP, a 1/`shards` part of it under FSDP."""
    return parameters * 4 / 1e9 / shards


def trainer_fits(parameters: int, gpu_memory_gb: float, shards: int = 1) -> bool:
    """Whether a model of `parameters` trains on GPUs of `gpu_memory_gb`, its weights split in `shards`."""
    return trainer_weights_gb(parameters, shards) <= TRAINER_WEIGHT_SHARE * gpu_memory_gb


def trainer_sharding(requested: str, processes: int, parameters: int | None, gpu_memory_gb: float) -> str:
    """How the trainer's processes hold the model: "single" (one process), "ddp" (a whole copy each) or "fsdp"
    (FSDP2: each holds 1/processes of every weight and gathers a layer's weights for its forward and backward).

    `requested` is the spec's `compute.trainer_sharding`; "auto" is FSDP exactly when a whole float32 copy does not
    fit one GPU, since DDP keeps no gathers in the step and is the faster of the two whenever it fits. Without a GPU
    (a CPU rehearsal) "auto" is DDP. On GPUs whose model size cannot be read, "auto" is FSDP: preflight may have
    accepted the flavor only because the model fits it sharded, and FSDP runs whatever DDP would, only slower.
    """
    if processes == 1:
        return "single"
    if requested != "auto":
        return requested
    if not gpu_memory_gb or (parameters is not None and trainer_fits(parameters, gpu_memory_gb)):
        return "ddp"
    return "fsdp"


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

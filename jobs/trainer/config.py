"""Every GRPO and LoRA field of a RunSpec mapped onto TRL's `AsyncGRPOConfig` and PEFT's `LoraConfig`, in one place."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from jobs.contract import RunSpec, derived
from jobs.trainer.reporting import report_arguments

if TYPE_CHECKING:
    from peft import LoraConfig
    from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig

# Seconds to wait for a completion: long generations through the HF Jobs proxy take minutes.
REQUEST_TIMEOUT_S = 900


def lora_config(spec: RunSpec) -> LoraConfig:
    from peft import LoraConfig

    return LoraConfig(
        r=spec.lora.rank,
        lora_alpha=spec.lora.alpha,
        lora_dropout=spec.lora.dropout,
        target_modules=spec.lora.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def sharding_arguments(sharding: str) -> dict[str, Any]:
    """TrainingArguments that make the trainer's processes hold the model as `sharding` says
    (`derived.trainer_sharding`): FSDP2 for "fsdp" (TRL 1.16's async trainer supports no other FSDP), each decoder
    layer a unit of its own (accelerate wraps the model's `_no_split_modules`), a layer's gathered weights freed after
    its forward; none for DDP and a single process."""
    if sharding != "fsdp":
        return {}
    return {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2, "reshard_after_forward": True}}


def grpo_config(
    spec: RunSpec, output_dir: str, server_url: str, cuda: bool | None = None, sharding: str = "single"
) -> AsyncGRPOConfig:
    """The AsyncGRPOConfig for `spec`, training into `output_dir` against the proxy at `server_url`, its processes
    holding the model as `sharding` says."""
    from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig

    cuda = torch.cuda.is_available() if cuda is None else cuda
    grpo = spec.grpo
    limits = derived.rollout_limits(spec)
    per_device, accumulation = derived.batch_shape(grpo, spec.compute.training_ranks, cuda)
    dtype, bf16 = derived.trainer_precision(cuda)
    return AsyncGRPOConfig(
        output_dir=output_dir,
        # Model
        dtype=dtype,
        model_init_kwargs={"revision": spec.model.revision} if spec.model.revision else None,
        use_cpu=not cuda,
        bf16=bf16,
        gradient_checkpointing=grpo.gradient_checkpointing,
        # Generation
        num_generations=grpo.num_generations,
        max_completion_length=grpo.max_completion_length,
        temperature=grpo.temperature,
        top_p=grpo.top_p,
        top_k=grpo.top_k,
        vllm_server_base_url=server_url,
        request_timeout=REQUEST_TIMEOUT_S,
        max_tool_calling_iterations=spec.environment.max_turns if spec.environment.enabled else None,
        # Optimisation
        learning_rate=grpo.learning_rate,
        adam_beta2=grpo.adam_beta2,
        lr_scheduler_type="constant",
        epsilon=grpo.epsilon,
        max_steps=grpo.max_steps,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        token_budget=grpo.token_budget,
        seed=grpo.seed,
        # Asynchrony
        max_staleness=grpo.max_staleness,
        weight_sync_steps=grpo.weight_sync_steps,
        max_inflight_tasks=limits.inflight,
        queue_maxsize=limits.queue,
        # Bookkeeping
        logging_steps=1,
        save_strategy="steps",
        save_steps=grpo.save_steps,
        save_total_limit=2,
        disable_tqdm=True,
        **report_arguments(spec),
        **sharding_arguments(sharding),
    )

"""What a launch submits, built in one place: `python -m backend plan` prints it, and the launchers submit it.

A `RunPlan` holds one `JobPlan` per job (role, image, flavor, full command, the environment we set, the names of the
secrets it gets — never their values —, exposed ports, timeout, labels), the derived values that decide how the
hardware is used (trainer processes and batch shape, replica tensor parallelism, LoRA slots, dtype per side), and the
spec every job reads, so a setting shows in the plan as soon as the spec has it.
`HfJobsLauncher` submits each JobPlan as it is (tests compare what the Hub emulator received with the plan);
`LocalLauncher` runs the same commands as local processes, putting a free port where a plan says `PORT`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jobs.contract import BUILTIN_ENVIRONMENTS, RunSpec, derived
from jobs.contract.flavors import flavor
from jobs.replica.engine_command import GPU_MEMORY_UTILIZATION, EngineChoice

PORT = "PORT"  # stands for a port chosen when the job starts (local jobs listen on free ports)
_SHOWN_CHARS = 160  # a plan shown to people abbreviates longer arguments (the bootstrap's source)


@dataclass(frozen=True)
class JobPlan:
    role: str
    command: list[str]
    env: dict[str, str]  # what we set; local jobs also inherit a few of the panel's variables (LocalLauncher)
    secrets: list[str]  # names only: values travel as HF Job secrets or process environment, never in a plan
    ports: list[int] = field(default_factory=list)
    image: str | None = None  # HF Jobs only: locally the job runs with this checkout's interpreter
    flavor: str | None = None
    timeout_s: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    name: str | None = None  # HF Jobs only: how the job is listed on the Hub (huggingface_hub stores it as a label)

    def to_json(self, full: bool = False) -> dict[str, Any]:
        command = self.command if full else [_shown(arg) for arg in self.command]
        return {
            "role": self.role,
            "name": self.name,
            "image": self.image,
            "flavor": self.flavor,
            "command": command,
            "env": self.env,
            "secrets": self.secrets,
            "ports": self.ports,
            "timeout_s": self.timeout_s,
            "labels": self.labels,
        }


@dataclass(frozen=True)
class RunPlan:
    run_id: str
    backend: str
    namespace: str | None
    jobs: list[JobPlan]
    derived: dict[str, Any]
    spec: dict[str, Any]  # the settings every job reads (spec.json), each field as the check validated it

    def job(self, role: str) -> JobPlan:
        return next(job for job in self.jobs if job.role == role)

    def to_json(self, full: bool = False) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "backend": self.backend,
            "namespace": self.namespace,
            "jobs": [job.to_json(full) for job in self.jobs],
            "derived": self.derived,
            "spec": self.spec,
        }


def derived_values(
    spec: RunSpec, trainer_cuda: bool, parameters: int | None = None, *, engine: EngineChoice
) -> dict[str, Any]:
    """How the run uses its hardware, as the jobs will compute it (jobs/contract/derived.py), with the replicas'
    `engine` as they will decide it, for a model of `parameters` where known."""
    compute, grpo = spec.compute, spec.grpo
    limits = derived.rollout_limits(spec)
    window = derived.staleness_window(grpo)
    processes = compute.training_ranks
    per_device, accumulation = derived.batch_shape(grpo, processes, trainer_cuda)
    weights, autocast = derived.trainer_precision(trainer_cuda)
    hub = compute.backend == "hf_jobs"
    gpu_memory_gb = flavor(compute.trainer_flavor).gpu_memory_gb if hub else 0.0
    return {
        "trainer": {
            # On HF Jobs the flavor's GPUs; locally one per process when this machine has CUDA.
            "gpus": compute.trainer_gpus if hub else (processes if trainer_cuda else 0),
            "gpu_memory_gb": gpu_memory_gb,
            "processes": processes,
            "sharding": _sharding(compute.trainer_sharding, processes, parameters, gpu_memory_gb),
            "model_parameters": parameters,
            "per_device_train_batch_size": per_device,
            "gradient_accumulation_steps": accumulation,
            "completions_per_step": grpo.completions_per_step,
            "weights_dtype": weights,
            "bf16_autocast": autocast,
        },
        "replicas": {
            "count": compute.replicas,
            "gpus_each": compute.replica_gpus,
            "gpu_memory_gb": flavor(compute.replica_flavor).gpu_memory_gb if hub else 0.0,
            "engine": engine.engine,
            "engine_reason": engine.reason,
            "tensor_parallel_size": derived.replica_tensor_parallel(compute),
            "dtype": spec.model.dtype,
            "max_model_len": spec.model.max_model_len,
            "max_lora_rank": derived.vllm_max_lora_rank(spec.lora.rank),
            "max_loras": derived.replica_max_loras(spec),
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
        },
        "rollouts": {
            "queue_size": limits.queue,
            "max_staleness": grpo.max_staleness,
            "max_inflight": limits.inflight,
            "scored_groups": limits.scored_groups,
            "staleness_window": window,
            "expected_trained_share": _expected_trained_share(limits, grpo.num_generations, window),
        },
        "evaluation": _evaluation(spec),
        "tools": _tools(spec, limits),
    }


def _tools(spec: RunSpec, limits: derived.RolloutLimits) -> dict[str, Any] | None:
    """What an agent run offers the model (jobs/environments): its tools, its turn cap, and how many episodes (and
    their tools) run at once on the trainer's CPU."""
    environment = spec.environment
    if not environment.enabled:
        return None
    offered = (
        BUILTIN_ENVIRONMENTS[environment.name] if environment.kind == "builtin" else ", ".join(environment.entry_points)
    )
    unbounded = spec.grpo.max_completion_length * (environment.max_turns + 1)
    return {
        "environment": environment.name if environment.kind == "builtin" else "code",
        "offers": offered,
        "max_turns": environment.max_turns,
        # TRL asks each turn for up to max_completion_length tokens: with no budget, an episode's bound is that many
        # per turn over its first turn and its tool turns.
        "episode_tokens": environment.max_episode_tokens or unbounded,
        "episode_tokens_from": "environment.max_episode_tokens"
        if environment.max_episode_tokens
        else f"no budget: {spec.grpo.max_completion_length} tokens x {environment.max_turns + 1} turns",
        "episodes_in_flight": limits.inflight,
        "packages": environment.packages,  # installed by the trainer where its image lacks them
    }


def _evaluation(spec: RunSpec) -> dict[str, Any] | None:
    """Held-out evaluation during the run: its interval and its cost in tokens beside the rollouts (at most
    `eval.prompts` prompts: the held-out set may hold fewer)."""
    if not (spec.eval.enabled and spec.eval.during_run):
        return None
    cost = derived.eval_cost(spec)
    return {
        "every_n_versions": cost.every,
        "evaluations": cost.evaluations,
        # With fewer held-out prompts than eval.prompts it costs less: Check settings counts them.
        "tokens_vs_rollouts_at_most": f"{cost.token_share:.1%} with {spec.eval.prompts} held-out prompts",
    }


def _expected_trained_share(limits: derived.RolloutLimits, group: int, window: int) -> str:
    """What share of the replicas' samples the trainer can be expected to train on, in words: nearly all while what
    waits for it (in flight, scored and queued) fits the staleness window, fewer when the replicas outrun it."""
    waiting = limits.inflight + limits.queue + limits.scored_groups * group
    if waiting <= window:
        return f"over 90 %: {waiting} samples in flight, scored and queued fit the staleness window of {window}"
    return (
        f"below 90 % whenever the replicas outrun the trainer: {waiting} samples in flight, scored and queued exceed "
        f"the staleness window of {window}, and those beyond it go stale before the trainer reaches them"
    )


def _sharding(requested: str, processes: int, parameters: int | None, gpu_memory_gb: float) -> str:
    """The trainer's sharding as the job will decide it; "auto" while the model's size is unknown (the trainer then
    decides from it at start; preflight's plan, which has read it from the Hub, shows the decision)."""
    if requested == "auto" and processes > 1 and parameters is None and gpu_memory_gb:
        return "auto"
    return derived.trainer_sharding(requested, processes, parameters, gpu_memory_gb)


def _shown(arg: str) -> str:
    if len(arg) <= _SHOWN_CHARS:
        return arg
    first = arg.strip().splitlines()[0][:60]
    return f"<{len(arg)} characters: {first} …>"

"""Held-out episodes of an agent under one version: TRL's own tool-calling loop, run as training runs it.

An agent's held-out score is only comparable with its training if its episodes are made the same way: the same chat
template with the tools' schemas, the same `/v1/completions` requests with token ids, the same reading of tool calls
(`parse_response`), tool results fed back as `str(result)`, the same turn cap and token budget. So the loop here is
the job's (`jobs/trainer/episode_loop.py`, TRL's with each reply's version and the budget), built outside TRL's
rollout child and driven one episode at a time, with two differences that evaluation needs: every turn names the
version being evaluated (training names whatever version is current at each turn), and each (prompt, sample) draws
from its own seeds, so two versions are compared on the same draws.

The environment's code runs in this process, as it does in the trainer's rollout child: in a job beside the trainer,
or in the panel for the built-in environments only (ours; the Python tool confines itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from jobs.contract import RunSpec
from jobs.environments.loading import ENVIRONMENT_COLUMN, environment_tools, trainer_arguments, unload_code
from jobs.evaluation.sampling import Completion, Sampling, SamplingError
from jobs.trainer.episode_loop import EpisodeLoop, detached_loop, episode_seed
from jobs.trainer.telemetry import episode_text


@dataclass(frozen=True)
class Agent:
    """What an agent's episodes are made with: the environment as `trainer_arguments` gives it (`tools=` or
    `environment_factory=`), the tokenizer as the trainer fits it, and the run's settings."""

    spec: RunSpec
    environment: dict[str, Any]
    tokenizer: Any
    eos_token_ids: list[int]


def agent_for(spec: RunSpec, tokenizer: Any, eos_token_ids: list[int]) -> Agent:
    """The agent of a run with tools: its environment loaded and checked as the trainer loads it (a user's code into a
    folder of its own, removed with the agent: the panel makes one per evaluation), its tokenizer fitted as the
    trainer fits it (the response template TRL reads tool calls by); `eos_token_ids` end its turns, the trainer's
    (`jobs.models.eos_token_ids`, which the evaluation's rewards are built with too)."""
    from jobs.chat_templates import fit_tokenizer

    fit_tokenizer(tokenizer, spec.model.id, tools=True)
    folder = Path(tempfile.mkdtemp(prefix="environment-"))  # the module TRL's loop imports the code from
    try:
        agent = Agent(spec, trainer_arguments(spec.environment, folder), tokenizer, eos_token_ids)
    except BaseException:
        _remove(folder)
        raise
    weakref.finalize(agent, _remove, folder)
    return agent


def _remove(folder: Path) -> None:
    """An agent's code folder, unloaded (`load_code` imported from it) and gone from the disk."""
    unload_code(folder)
    shutil.rmtree(folder, ignore_errors=True)


def sample_episodes(
    agent: Agent, endpoint: str, model: str, records: list[dict[str, Any]], sampling: Sampling, concurrency: int
) -> list[list[Completion]]:
    """Per held-out row (as the trainer builds it: `prompt` messages and every column), `sampling.k` episodes of
    `model` at `endpoint`, at most `concurrency` rows' episodes at a time."""
    return asyncio.run(_sample(agent, endpoint, model, records, sampling, concurrency))


async def _sample(
    agent: Agent, endpoint: str, model: str, records: list[dict[str, Any]], sampling: Sampling, concurrency: int
) -> list[list[Completion]]:
    gate = asyncio.Semaphore(max(1, concurrency) * sampling.k)

    turns = agent.spec.environment.max_turns + 1  # an episode's turns at most: each draws with a seed of its own

    async def one(loop: EpisodeLoop, index: int, sample: int) -> Completion:
        async with gate:
            return await _episode(loop, records[index], sampling.seed + (index * sampling.k + sample) * turns)

    async with _loop(agent, endpoint, model, sampling) as loop:
        drawn = await asyncio.gather(
            *(one(loop, index, sample) for index in range(len(records)) for sample in range(sampling.k))
        )
    return [list(drawn[index * sampling.k : (index + 1) * sampling.k]) for index in range(len(records))]


class EvaluationLoop(EpisodeLoop):
    """The job's loop, failing a request at once with `SamplingError` where training retries it for minutes (TRL
    retries every error, a refusal too): a version that cannot be sampled is skipped, said, as a single-turn
    run's is."""

    async def _retry(self, coro_factory: Any, *, label: str, max_attempts: int = 1) -> Any:
        try:
            return await coro_factory()
        except SamplingError:
            raise
        except Exception as error:
            raise SamplingError(f"{self.model_name} failed a held-out episode's turn ({label}): {error}") from None


def _loop(
    agent: Agent, endpoint: str, model: str, sampling: Sampling
) -> contextlib.AbstractAsyncContextManager[EpisodeLoop]:
    """The job's rollout loop set up for evaluation (`detached_loop`: usable in the block): `model` named on every
    turn (no LoRA name: it would be followed by the current version), the run's turn cap and budget, the evaluation's
    sampling."""
    spec = agent.spec
    return detached_loop(
        EvaluationLoop,
        model_name=model,
        lora_name=None,
        processing_class=agent.tokenizer,
        eos_token_ids=agent.eos_token_ids,
        vllm_server_url=endpoint,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=spec.grpo.top_k,
        max_tool_calling_iterations=spec.environment.max_turns,
        episode_token_budget=spec.environment.max_episode_tokens,
        **agent.environment,
    )


def with_observation(prompt: list[dict[str, Any]], observation: Any) -> list[dict[str, Any]]:
    """The prompt with what `reset` returned appended to its last message, as TRL's generate loop does (text to
    text; either side a list of parts, the other made one)."""
    if observation is None:
        return prompt
    last = prompt[-1]
    content = last["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return [*prompt[:-1], {**last, "content": content + observation}]


async def _episode(loop: EpisodeLoop, record: dict[str, Any], seed: int) -> Completion:
    """One episode from `record`, as TRL's generate loop starts one: its environment (the one its row names, where
    there are several) reset from the row, the observation `reset` returns appended to the prompt, the tools those
    of the environment and the tool functions."""
    prompt = list(record["prompt"])
    tools = loop.tools
    methods: list[Any] = []
    # By name; {None: factory} for one environment (TRL's attribute is typed as what it was given).
    factories = cast("dict[Any, Any] | None", loop.environment_factories)
    if factories is not None:
        name = record.get(ENVIRONMENT_COLUMN) if loop._multi_environment else None
        environment = factories[name]()
        row = {k: v for k, v in record.items() if k != ENVIRONMENT_COLUMN} if loop._multi_environment else record
        observation = await asyncio.get_running_loop().run_in_executor(
            loop._tool_pool, lambda: environment.reset(**row)
        )
        prompt = with_observation(prompt, observation)
        tools = loop._env_tools[name]
        methods = environment_tools(environment)
    tool_dict = {tool.__name__: tool for tool in [*loop._standalone_tools, *methods]}
    with episode_seed(seed):
        completion, completion_ids, *_ = await loop._generate_one(prompt, tool_dict=tool_dict, tools=tools)
    return Completion(episode_text(completion), list(completion_ids), completion)

"""Completions of the held-out prompts under one version, from any engine that speaks vLLM's completions API (the
CPU engine on this machine, vLLM in a replica), addressed by the version's LoRA name.

Each (prompt, sample) has its own seed, derived from the eval seed alone, so two versions are compared on the same
draws and asking again gives the same completions.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import requests

from jobs.contract import RunSpec
from jobs.evaluation.heldout import EvalPrompts

CONCURRENT_PROMPTS = 8  # requests in flight: enough for an engine to batch, few enough to leave it to others


class SamplingError(RuntimeError):
    """The engine refused or failed a request; the message says which prompt and why."""


@dataclass(frozen=True)
class Sampling:
    k: int
    temperature: float  # 0: greedy
    top_p: float
    max_tokens: int
    seed: int

    @classmethod
    def of(cls, spec: RunSpec) -> Sampling:
        """The run's own sampling (its temperature, top-p and completion length), or greedy when asked."""
        settings = spec.eval
        temperature = 0.0 if settings.greedy else spec.grpo.temperature
        return cls(settings.k, temperature, spec.grpo.top_p, spec.grpo.max_completion_length, settings.seed)

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    def request(self, model: str, prompt: list[int], index: int) -> dict[str, Any]:
        """The completions request for prompt number `index`: its k samples seeded seed + index * k + j (vLLM seeds
        the request; the CPU engine seeds each of its n choices from it)."""
        return {
            "model": model,
            "prompt": prompt,
            "n": self.k,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed + index * self.k,
            "return_token_ids": True,  # what length- and EOS-aware rewards score, as in training
        }


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    messages: list[dict[str, Any]] | None = None  # an agent's episode, as its rewards score it (text: as shown)

    def scored(self) -> list[dict[str, Any]]:
        """The completion as the run's rewards take it in training: a message list."""
        return self.messages if self.messages is not None else [{"role": "assistant", "content": self.text}]


def draw(
    prompts: EvalPrompts,
    endpoint: str,
    model: str,
    sampling: Sampling,
    concurrency: int = CONCURRENT_PROMPTS,
) -> list[list[Completion]]:
    """Each held-out prompt's k completions from `model` at `endpoint`: replies, or for an agent its episodes (TRL's
    loop, imported only then: a single-turn run's evaluator starts as fast as it did)."""
    if prompts.agent is None:
        return sample(endpoint, model, prompts.token_ids, sampling, None, concurrency)
    from jobs.evaluation.episodes import sample_episodes

    return sample_episodes(prompts.agent, endpoint, model, prompts.records, sampling, concurrency)


def sample(
    endpoint: str,
    model: str,
    prompts: list[list[int]],
    sampling: Sampling,
    headers: dict[str, str] | None = None,
    concurrency: int = CONCURRENT_PROMPTS,
) -> list[list[Completion]]:
    """Per prompt (token ids), its k completions from `model` at `endpoint`, `concurrency` prompts at a time."""

    def one(index: int) -> list[Completion]:
        body = sampling.request(model, prompts[index], index)
        try:
            response = requests.post(f"{endpoint.rstrip('/')}/v1/completions", json=body, headers=headers, timeout=600)
        except requests.RequestException as error:
            raise SamplingError(f"the engine at {endpoint} did not answer ({type(error).__name__})") from None
        if response.status_code != 200:
            raise SamplingError(
                f"{model} refused held-out prompt {index}: {response.status_code} {response.text[:300]}"
            )
        choices = sorted(response.json()["choices"], key=lambda choice: int(choice["index"]))
        return [Completion(str(choice["text"]), [int(i) for i in choice.get("token_ids") or []]) for choice in choices]

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(prompts))))

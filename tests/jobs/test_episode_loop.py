"""The job's rollout loop for agents (jobs/trainer/episode_loop.py) and held-out episodes made with it
(jobs/evaluation/episodes.py), driven against a stand-in replica on loopback that answers turn by turn as a script says
and records every request it gets.

TRL's own loop runs each episode: the stand-in answers the first turn with a tool call and the next with an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from jobs.demo.preset import demo_spec
from jobs.environments.calculator import calculate
from jobs.evaluation.episodes import Agent, sample_episodes, with_observation
from jobs.evaluation.sampling import Sampling, SamplingError
from jobs.models import builtin_model_folder
from jobs.trainer import cpu_compat
from jobs.trainer.episode_loop import TURN_VERSION, EpisodeLoop, detached_loop

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6*7"}}\n</tool_call>'
MAX_TOKENS = 96  # a turn's tokens: the call takes 73 of the tiny model's, its end included


class Replica:
    """A stand-in for the replicas: answers a turn that has a tool result with `answer`, any other with `CALL`, cut to
    the request's max_tokens; records each request; `after_first` runs once the first answer is sent."""

    def __init__(self, tokenizer: Any, status: int = 200) -> None:
        self.tokenizer, self.status = tokenizer, status
        self.requests: list[dict[str, Any]] = []
        self.after_first: Any = None
        self._lock = threading.Lock()

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = self.tokenizer.decode(body["prompt"])
        text = "42" if "<tool_response>" in prompt else CALL
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        ids = ids[: body["max_tokens"]]
        with self._lock:
            self.requests.append(body)
            first = len(self.requests) == 1
        if first and self.after_first is not None:
            self.after_first()
        return {"choices": [{"index": 0, "token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}}]}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from jobs.chat_templates import fit_tokenizer

    loaded = AutoTokenizer.from_pretrained(builtin_model_folder("builtin:tiny-qwen2"))
    fit_tokenizer(loaded, "builtin:tiny-qwen2", tools=True)
    return loaded


@pytest.fixture
def replica(tokenizer: Any) -> Iterator[tuple[Replica, str]]:
    stand_in = Replica(tokenizer)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            reply = json.dumps(stand_in.answer(body)).encode()
            self.send_response(stand_in.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield stand_in, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def training_loop(
    tokenizer: Any, url: str, version: Any, budget: int | None
) -> contextlib.AbstractAsyncContextManager[EpisodeLoop]:
    """The loop as training runs it (a LoRA name and the shared version counter), one episode at a time."""
    cpu_compat.apply_cpu_patches(force=True)
    return detached_loop(
        EpisodeLoop,
        version,
        model_name="builtin:tiny-qwen2",
        lora_name="trl-policy",
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        vllm_server_url=url,
        max_tokens=MAX_TOKENS,
        tools=[calculate],
        max_tool_calling_iterations=2,
        episode_token_budget=budget,
    )


def run_episode(detached: contextlib.AbstractAsyncContextManager[EpisodeLoop]) -> list[dict[str, Any]]:
    async def episode() -> list[dict[str, Any]]:
        async with detached as loop:
            prompt = [{"role": "user", "content": "What is 6 times 7?"}]
            completion, *_ = await loop._generate_one(prompt, tool_dict={"calculate": calculate}, tools=[calculate])
            return list(completion)

    return asyncio.run(episode())


def test_each_reply_names_the_version_its_request_named_when_a_sync_lands_mid_episode(
    tokenizer: Any, replica: tuple[Replica, str]
) -> None:
    """A weight sync between two turns of an episode: the second turn asks for the next version, and its reply is
    attributed to that version, not to the one the episode started on (what TRL records for the whole episode)."""
    stand_in, url = replica
    version = multiprocessing.Value("i", 1)
    stand_in.after_first = lambda: setattr(version, "value", 2)  # the trainer's sync, between the two turns
    completion = run_episode(training_loop(tokenizer, url, version, budget=None))
    replies = [message for message in completion if message["role"] == "assistant"]
    assert [request["model"] for request in stand_in.requests] == ["trl-policy-v1", "trl-policy-v2"]
    assert [reply[TURN_VERSION] for reply in replies] == [1, 2]
    assert replies[0]["tool_calls"] and replies[1]["content"] == "42"
    assert [message["role"] for message in completion] == ["assistant", "tool", "assistant"]


def test_an_episode_keeps_to_its_token_budget_over_its_turns(tokenizer: Any, replica: tuple[Replica, str]) -> None:
    """Each turn is asked for what is left of the budget less one token; the turn after a budget spent on the tool
    call gets one token, which ends the episode."""
    stand_in, url = replica
    call_tokens = len(tokenizer.encode(CALL, add_special_tokens=False)) + 1
    completion = run_episode(training_loop(tokenizer, url, multiprocessing.Value("i", 1), budget=call_tokens + 1))
    # The call is asked for the budget less one (all it needs), the next turn for the one token left.
    assert [request["max_tokens"] for request in stand_in.requests] == [call_tokens, 1]
    assert [message["role"] for message in completion] == ["assistant", "tool", "assistant"]
    assert len(tokenizer.encode(completion[-1]["content"], add_special_tokens=False)) <= 1


def agent(tokenizer: Any) -> Agent:
    spec = demo_spec(
        "agent-eval", "file:///unused", environment={"kind": "builtin", "name": "calculator", "max_turns": 2}
    )
    return Agent(spec, {"tools": [calculate]}, tokenizer, [tokenizer.eos_token_id])


def test_held_out_episodes_name_the_version_evaluated_and_draw_each_turn_from_a_seed_of_its_own(
    tokenizer: Any, replica: tuple[Replica, str]
) -> None:
    """Every turn of every held-out episode names the version being evaluated (never the current one), each turn of
    each (prompt, sample) has its own seed, and asking again draws the same seeds: two versions meet the same draws."""
    stand_in, url = replica
    records = [{"prompt": [{"role": "user", "content": f"What is {n} times 7?"}], "answer": "42"} for n in (6, 3)]
    sampling = Sampling(k=2, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=100)
    drawn = sample_episodes(agent(tokenizer), url, "eval-v3", records, sampling, concurrency=2)
    assert [len(prompt) for prompt in drawn] == [2, 2]
    assert all("→ calculate(expression='6*7')" in c.text and c.messages for prompt in drawn for c in prompt)
    assert {request["model"] for request in stand_in.requests} == {"eval-v3"}
    seeds = [request["seed"] for request in stand_in.requests]
    assert len(seeds) == 8 and len(set(seeds)) == 8  # 2 prompts x 2 samples x 2 turns
    first = sorted(seeds)
    stand_in.requests.clear()
    sample_episodes(agent(tokenizer), url, "eval-v4", records, sampling, concurrency=2)
    assert sorted(request["seed"] for request in stand_in.requests) == first


def test_a_held_out_turn_the_engine_refuses_fails_at_once_naming_the_version(
    tokenizer: Any, replica: tuple[Replica, str]
) -> None:
    """Training retries every failed request for minutes (TRL retries a refusal too); evaluation skips the version
    instead, saying why, as it does for single answers."""
    stand_in, url = replica
    stand_in.status = 400
    records = [{"prompt": [{"role": "user", "content": "What is 6 times 7?"}], "answer": "42"}]
    with pytest.raises(SamplingError, match="eval-v3 failed a held-out episode's turn"):
        sample_episodes(agent(tokenizer), url, "eval-v3", records, Sampling(1, 1.0, 1.0, MAX_TOKENS, 0), concurrency=1)
    assert len(stand_in.requests) == 1


TEXT_PART = {"type": "text", "text": "Question?"}
IMAGE_PART = {"type": "image", "image": "cat.png"}


@pytest.mark.parametrize(
    ("content", "observation", "expected"),
    [
        ("Question?", " Seen: 3.", "Question? Seen: 3."),
        ([TEXT_PART], " Seen: 3.", [TEXT_PART, {"type": "text", "text": " Seen: 3."}]),
        ("Question?", [IMAGE_PART], [TEXT_PART, IMAGE_PART]),
        ("Question?", None, "Question?"),
    ],
    ids=["text+text", "parts+text", "text+parts", "no-observation"],
)
def test_what_reset_returns_is_appended_to_the_last_message_as_trl_appends_it(
    content: Any, observation: Any, expected: Any
) -> None:
    """A held-out episode starts from the prompt TRL's generate loop would build (async_rollout_worker.py): `reset`'s
    text or parts appended to the last message's, either side made a list of parts when the other is one; the
    earlier messages and the row's own prompt untouched."""
    system = {"role": "system", "content": "Be brief."}
    prompt = [system, {"role": "user", "content": content}]
    original = [dict(message) for message in prompt]
    assert with_observation(prompt, observation) == [system, {"role": "user", "content": expected}]
    assert prompt == original

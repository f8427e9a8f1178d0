"""The built-in agent demo model: the tiny Qwen2 warm-started to call a tool, built locally and cached.

A model built from random weights never writes a tool call, so reinforcement learning has nothing to reward. This one
is first taught the format by a short supervised phase on synthetic episodes of the agent demo (the `codebook`
environment and dataset): a question about a thing, then a call to `lookup` with that thing and the code it answers
copied into the reply. Copying is what takes a model this small long to learn, so the phase first shows only such
episodes, until the model writes nine in ten of them right, then mixes in replies that guess without the tool until it
starts fewer than 30 % of its replies with a call. Both phases end on what the model does, not after a fixed number of
steps: fixed, the build was a lottery (issue 45). The model comes out calling the tool in one to two in ten of its
episodes, nearly always correctly when it does; GRPO then has one thing to learn, that calling the tool pays, and the
share of episodes with a correct tool call rises over a real run (docs/benchmarks/agent.md).

The tokenizer is trained on the same episodes and splits text as transformers' Qwen2 tokenizer does (which replaces
any other pre-tokenizer a Qwen2 model is saved with), so the tools' preamble TRL renders into every prompt takes about
150 tokens and every digit is one token. Everything is seeded and computed on one thread with deterministic kernels:
processes on one machine build the same model byte for byte, and the first build is cached for the others (under a
lock, so they wait rather than build it three times over on two cores).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from jobs.demo.dataset import codebook_question
from jobs.demo.tiny_model import SPECIAL_TOKENS, cached_build, chat_tokenizer, save_model, tiny_config
from jobs.environments.codebook import Codebook

BUILD_VERSION = 2  # bump when anything below changes: caches are keyed on it
VOCAB_SIZE = 1024
TOOL_CALL_SHARE = 0.3  # episodes of the warm start's last phase that call the tool; the rest guess
# The first phase (tool-calling episodes only) lasts until the model copies the tool's answer into its reply: in a
# fixed batch of such episodes, COPY_ACCURACY of the answers predicted right (teacher-forced argmax), checked every
# COPY_CHECK steps, for at most COPY_MAX_STEPS. A fixed 1,000 steps was a lottery: the model learns to copy somewhere
# between 400 and 650 steps and, at this learning rate, may unlearn it again after; a build that did not copy called
# the tool without using its answer, and RL had nothing to reinforce (issue 45: runs starting at rewards 0.08-0.26
# over three builds, one collapsing to empty replies).
COPY_ACCURACY = 0.9
COPY_CHECK = 25
COPY_MIN_STEPS = 300
COPY_MAX_STEPS = 4000
# The second phase mixes in guesses without the tool (TOOL_CALL_SHARE of the episodes call it) until the model starts
# a reply with a call no more often than CALL_SHARE_TARGET (checked every MIX_CHECK steps, for at most MIX_MAX_STEPS),
# at a lower learning rate: guesses are digits written where a copied answer is a digit too, and 150 steps at the
# first phase's rate took the share of episodes copied right from 0.94 to 0.08.
CALL_SHARE_TARGET = 0.3
MIX_CHECK = 2
MIX_MAX_STEPS = 400
MIX_LEARNING_RATE = 1e-3
SFT_BATCH = 16
SFT_LEARNING_RATE = 3e-3
# One thread, deterministic kernels: with two, parallel reductions summed in varying order and every build came out
# different (the same seeds gave models whose runs started at rewards 0.08, 0.18 and 0.19).
BUILD_THREADS = 1


def ensure_agent_model(root: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder of the agent demo model, building it first (45 s on a quiet core) if this machine has not yet.

    One process builds while any other asking meanwhile waits for it, then reads its build.
    """
    return cached_build(f"tiny-agent-v{BUILD_VERSION}", _build, root)


def conversation(rng: random.Random, tool_call_share: float = TOOL_CALL_SHARE) -> list[dict[str, Any]]:
    """One synthetic episode of the warm start: the question, then a lookup and the code copied, or a guess."""
    row = codebook_question(rng)
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    if rng.random() < tool_call_share:
        call = {"type": "function", "function": {"name": "lookup", "arguments": {"name": row["thing"]}}}
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "lookup", "content": row["answer"]},
            {"role": "assistant", "content": row["answer"]},
        ]
    else:
        messages.append({"role": "assistant", "content": str(rng.randrange(10))})
    return messages


def _build(folder: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    rng = random.Random(4321)
    _save_tokenizer(folder, rng)
    config = _config(folder)
    config.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)  # as TRL and the replicas will load it
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(BUILD_THREADS)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(config)
            _warm_start(model, tokenizer, rng)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    save_model(folder, model, tokenizer, BUILD_VERSION)


def _save_tokenizer(folder: Path, rng: random.Random) -> None:
    """A byte-level BPE trained on warm-start conversations, split into words as transformers' Qwen2 tokenizer
    splits them (it replaces whatever pre-tokenizer a Qwen2 model's tokenizer was saved with)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()

    renderer = chat_tokenizer(tokenizer)  # renders the chat template; nothing is tokenized before training
    corpus = [_render(renderer, conversation(rng)) for _ in range(2000)]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    chat_tokenizer(tokenizer).save_pretrained(folder)


def _config(folder: Path) -> Any:
    """The tiny model's shape over the agent tokenizer, initialised as usual: the warm start trains the head too, so
    the wide initialisation the digits demo needs (its head stays frozen under LoRA) is not."""
    from transformers import AutoTokenizer

    return tiny_config(AutoTokenizer.from_pretrained(folder), initializer_range=0.02)


def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """A conversation as TRL renders it, with the environment's tools' schemas."""
    return str(tokenizer.apply_chat_template(messages, tools=[Codebook().lookup], tokenize=False))


def _example(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and its labels: the assistant's replies (and the end of each), -100
    elsewhere, as the rollout loop will ask the model for them."""
    text = _render(tokenizer, messages)
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    spans = []
    start_marker, end_marker = "<|im_start|>assistant\n", "<|im_end|>"
    at = text.find(start_marker)
    while at != -1:
        begin = at + len(start_marker)
        end = text.index(end_marker, begin) + len(end_marker)
        spans.append((begin, end))
        at = text.find(start_marker, end)
    labels = [
        token if any(begin <= offset[0] < end for begin, end in spans) else -100
        for token, offset in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)
    ]
    return list(encoded["input_ids"]), labels


def _warm_start(model: Any, tokenizer: Any, rng: random.Random) -> None:
    """Supervised steps on the replies only: tool-calling episodes until the model writes them right (`copies`), then
    a short mix in which most replies are guesses without the tool."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LEARNING_RATE, weight_decay=0.0)
    checks = [_example(tokenizer, conversation(random.Random(seed), 1.0)) for seed in range(64)]
    step = 0
    while step < COPY_MAX_STEPS and not (
        step >= COPY_MIN_STEPS and step % COPY_CHECK == 0 and _copy_accuracy(model, checks, tokenizer) >= COPY_ACCURACY
    ):
        _supervised_step(
            model, optimizer, tokenizer, [_example(tokenizer, conversation(rng, 1.0)) for _ in range(SFT_BATCH)]
        )
        step += 1
    for group in optimizer.param_groups:
        group["lr"] = MIX_LEARNING_RATE
    questions = [_question_ids(tokenizer, conversation(random.Random(10_000 + seed), 1.0)) for seed in range(32)]
    call = tokenizer("<tool_call>", add_special_tokens=False)["input_ids"][
        0
    ]  # a reply's first token: a call or a digit
    step = 0
    while step < MIX_MAX_STEPS and not (
        step % MIX_CHECK == 0 and _call_share(model, questions, call) <= CALL_SHARE_TARGET
    ):
        batch = [_example(tokenizer, conversation(rng, TOOL_CALL_SHARE)) for _ in range(SFT_BATCH)]
        _supervised_step(model, optimizer, tokenizer, batch)
        step += 1
    model.eval()


def _question_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The token ids of an episode's question as the rollout loop sends it: up to the assistant's first reply."""
    ids: list[int] = tokenizer(_render(tokenizer, messages[:1]) + "<|im_start|>assistant\n", add_special_tokens=False)[
        "input_ids"
    ]
    return ids


def _call_share(model: Any, questions: list[list[int]], call: int) -> float:
    """How likely the model is to start its reply to each question with a tool call, on average."""
    import torch

    model.eval()
    with torch.no_grad():
        return float(
            sum(model(torch.tensor([ids])).logits[0, -1].softmax(-1)[call] for ids in questions) / len(questions)
        )


def _supervised_step(model: Any, optimizer: Any, tokenizer: Any, batch: list[tuple[list[int], list[int]]]) -> None:
    """One step on the replies of `batch`.

    Every conversation opens with the same tokens (the tools' preamble, two thirds of each), whose hidden states do
    not depend on what follows: they are computed once per step and shared by the batch, and the LM head runs only
    where a reply is scored. Together that makes a step about three times cheaper.
    """
    import torch

    model.train()
    hidden, labels = _reply_states(model, batch, tokenizer.pad_token_id)
    scored = labels != -100
    loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[scored]), labels[scored])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _copy_accuracy(model: Any, batch: list[tuple[list[int], list[int]]], tokenizer: Any) -> float:
    """The share of `batch`'s tool-calling episodes whose every reply token the model predicts right (argmax,
    teacher-forced): the call, naming the thing the question asks about, and the tool's answer copied after it."""
    import torch

    model.eval()
    with torch.no_grad():
        hidden, labels = _reply_states(model, batch, tokenizer.pad_token_id)
        scored = labels != -100
        wrong = (model.lm_head(hidden).argmax(dim=-1) != labels) & scored
    return float((~wrong.any(dim=1)).float().mean())


def _reply_states(model: Any, batch: list[tuple[list[int], list[int]]], pad: int) -> tuple[Any, Any]:
    """The last hidden states after the batch's shared prefix, and the labels they predict (-100: not scored)."""
    import torch

    shared = _shared_prefix([ids for ids, _ in batch])
    cache = model.model(input_ids=torch.tensor([batch[0][0][:shared]]), use_cache=True).cache
    cache.batch_repeat_interleave(len(batch))
    rests = [(ids[shared:], [*labels[shared + 1 :], -100]) for ids, labels in batch]
    width = max(len(ids) for ids, _ in rests)
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rests])
    labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in rests])
    attention = torch.tensor([[1] * (shared + len(ids)) + [0] * (width - len(ids)) for ids, _ in rests])
    positions = torch.arange(shared, shared + width).expand(len(batch), -1)
    hidden = model.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, cache=cache)
    return hidden.last_hidden_state, labels


def _shared_prefix(sequences: list[list[int]]) -> int:
    """How many tokens every sequence starts with (at least one is left to each)."""
    shortest = min(len(ids) for ids in sequences)
    shared = 0
    while shared < shortest - 1 and all(ids[shared] == sequences[0][shared] for ids in sequences):
        shared += 1
    return shared

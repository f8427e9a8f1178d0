"""The built-in agent demo model: the tiny Qwen2 warm-started to call a tool, built locally and cached.

A model built from random weights never writes a tool call, so reinforcement learning has nothing to reward. This one
is first taught the format by a short supervised phase on synthetic episodes of the agent demo (the `codebook`
environment and dataset): a question about a thing, then a call to `lookup` with that thing and the code it answers
copied into the reply. Copying is what takes a model this small long to learn, so the phase first shows only such
episodes, then a short mix in which most replies are guesses without the tool. The model comes out calling the tool
in about a quarter of its episodes, nearly always correctly when it does; GRPO then has one thing to learn, that
calling the tool pays, and the share of episodes with a correct tool call rises over a real run
(docs/benchmarks/agent.md).

The tokenizer is trained on the same episodes and splits text as transformers' Qwen2 tokenizer does (which replaces
any other pre-tokenizer a Qwen2 model is saved with), so the tools' preamble TRL renders into every prompt takes about
150 tokens and every digit is one token. Everything is seeded: processes on one machine build the same model, and the
first build is cached for the others (under a lock, so they wait rather than build it three times over on two cores).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from jobs.demo.dataset import codebook_question
from jobs.demo.tiny_model import SPECIAL_TOKENS, cached_build, chat_tokenizer, save_model, tiny_config
from jobs.environments.codebook import Codebook

BUILD_VERSION = 1  # bump when anything below changes: caches are keyed on it
VOCAB_SIZE = 1024
TOOL_CALL_SHARE = 0.3  # episodes of the warm start's last phase that call the tool; the rest guess
SFT_STEPS = 1150
SFT_MIXED_STEPS = 150  # the last steps, where episodes mix tool calls and guesses
SFT_BATCH = 16
SFT_LEARNING_RATE = 3e-3
BUILD_THREADS = 2


def ensure_agent_model(root: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder of the agent demo model, building it first (about a minute) if this machine has not yet.

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
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(config)
            _warm_start(model, tokenizer, rng)
    finally:
        torch.set_num_threads(threads)
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
    """Supervised steps on the replies only.

    Every conversation opens with the same tokens (the tools' preamble, two thirds of each), whose hidden states do
    not depend on what follows: they are computed once per step and shared by the batch, and the LM head runs only
    where a reply is scored. Together that makes a step about three times cheaper.
    """
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LEARNING_RATE, weight_decay=0.0)
    model.train()
    pad = tokenizer.pad_token_id
    for step in range(SFT_STEPS):
        share = 1.0 if step < SFT_STEPS - SFT_MIXED_STEPS else TOOL_CALL_SHARE
        batch = [_example(tokenizer, conversation(rng, share)) for _ in range(SFT_BATCH)]
        shared = _shared_prefix([ids for ids, _ in batch])
        cache = model.model(input_ids=torch.tensor([batch[0][0][:shared]]), use_cache=True).cache
        cache.batch_repeat_interleave(len(batch))
        rests = [(ids[shared:], [*labels[shared + 1 :], -100]) for ids, labels in batch]
        width = max(len(ids) for ids, _ in rests)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rests])
        labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in rests])
        attention = torch.tensor([[1] * (shared + len(ids)) + [0] * (width - len(ids)) for ids, _ in rests])
        positions = torch.arange(shared, shared + width).expand(len(batch), -1)
        hidden = model.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, cache=cache
        ).last_hidden_state
        scored = labels != -100
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[scored]), labels[scored])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def _shared_prefix(sequences: list[list[int]]) -> int:
    """How many tokens every sequence starts with (at least one is left to each)."""
    shortest = min(len(ids) for ids in sequences)
    shared = 0
    while shared < shortest - 1 and all(ids[shared] == sequences[0][shared] for ids in sequences):
        shared += 1
    return shared

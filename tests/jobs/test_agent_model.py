"""The agent demo model's warm start, piece by piece, without the minute its build takes (jobs/demo/agent_model.py).

The build only shows whether the whole came out calling its tool; these say why it could: the supervised phase scores
exactly the assistant's replies (with the end of each), and the prefix it computes once per batch holds none of them.
The tokenizer is the cached model's when this machine has built it, else trained here as the build trains it (a few
seconds; the same files, as the build is seeded).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from jobs.demo.agent_model import BUILD_VERSION, _example, _save_tokenizer, _shared_prefix, conversation
from jobs.demo.tiny_model import cache_root


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    folder = cache_root() / f"tiny-agent-v{BUILD_VERSION}"
    if not (folder / "tokenizer.json").is_file():
        folder = tmp_path_factory.mktemp("agent-tokenizer")
        _save_tokenizer(Path(folder), random.Random(4321))
    return AutoTokenizer.from_pretrained(folder)


def _labelled_runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The stretches of consecutive tokens that carry a label, in order."""
    runs: list[list[int]] = []
    previous = -100
    for token, label in zip(ids, labels, strict=True):
        if label != -100:
            if previous == -100:
                runs.append([])
            runs[-1].append(token)
        previous = label
    return runs


def _episode(tool_call: bool) -> list[dict[str, Any]]:
    rng = random.Random(7)
    while True:
        messages = conversation(rng, 0.5)
        if (len(messages) > 2) == tool_call:
            return messages


def test_an_episode_with_a_lookup_is_scored_on_its_two_replies_only(tokenizer: Any) -> None:
    """The call and the copied answer, each with its `<|im_end|>`, are labelled with their own ids; the preamble, the
    question, the tool's answer and the `<|im_start|>assistant` headers are not."""
    messages = _episode(tool_call=True)
    thing = messages[1]["tool_calls"][0]["function"]["arguments"]["name"]
    code = messages[2]["content"]
    ids, labels = _example(tokenizer, messages)
    assert len(ids) == len(labels)
    assert all(label in (-100, token) for token, label in zip(ids, labels, strict=True))
    call, answer = (tokenizer.decode(run) for run in _labelled_runs(ids, labels))
    assert call.startswith("<tool_call>") and f'"name": "{thing}"' in call and call.endswith("</tool_call><|im_end|>")
    assert answer == f"{code}<|im_end|>"
    assert sum(label != -100 for label in labels) == 25  # "a lookup and an answer take 25" (docs/benchmarks/agent.md)
    unscored = tokenizer.decode([token for token, label in zip(ids, labels, strict=True) if label == -100])
    assert messages[0]["content"] in unscored and f"<tool_response>\n{code}\n</tool_response>" in unscored
    assert unscored.count("<|im_start|>assistant\n") == 2


def test_a_guess_is_scored_on_its_one_reply(tokenizer: Any) -> None:
    messages = _episode(tool_call=False)
    ids, labels = _example(tokenizer, messages)
    assert [tokenizer.decode(run) for run in _labelled_runs(ids, labels)] == [f"{messages[1]['content']}<|im_end|>"]


def test_the_prefix_shared_by_a_batch_leaves_at_least_one_token_to_each() -> None:
    assert _shared_prefix([[1, 2, 3, 4], [1, 2, 5]]) == 2
    assert _shared_prefix([[1, 2, 3], [1, 2, 3]]) == 2  # identical: the last token is still each one's own
    assert _shared_prefix([[1, 2, 3]]) == 2
    assert _shared_prefix([[1, 2], [3, 4]]) == 0
    assert _shared_prefix([[7], [7, 8]]) == 0


def test_no_scored_token_falls_in_a_real_batchs_shared_prefix(tokenizer: Any) -> None:
    """The warm start computes the shared prefix once and scores only what follows it; the first token after it is
    predicted inside the prefix, so it must not be scored either. The tools' preamble is most of the prefix."""
    rng = random.Random(3)
    batch = [_example(tokenizer, conversation(rng, share)) for share in (1.0, 0.0) * 8]
    shared = _shared_prefix([ids for ids, _ in batch])
    assert all(label == -100 for _, labels in batch for label in labels[: shared + 1])
    assert "lookup" in tokenizer.decode(batch[0][0][:shared]) and shared > len(batch[0][0]) / 2

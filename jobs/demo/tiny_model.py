"""The built-in demo model: a ~0.4 M-parameter Qwen2 built locally and deterministically.

Nothing is downloaded: the trainer and every replica build the same weights and tokenizer from fixed seeds, so the
panel runs end to end with no account and no network. The settings are the ones measured to learn under TRL 1.16 on
two cores (see shared/reference/tiny-demo-findings.md): hidden 128, 2 layers, vocabulary 512, and an
`initializer_range` of 0.1 — with the usual 0.02 the frozen LM head caps how far logits can move and LoRA cannot
learn at all.

Numbers in the tokenizer's corpus are single digits, so every digit token ('7' or ' 7', 20 of the 512) holds exactly
one digit: "fraction of digit tokens" then equals "digit characters per completion token", which the demo reward
computes without the tokenizer. An untrained model writes about 4 % digit tokens, enough signal for group-relative
advantages from the first step.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobs import settings

BUILD_VERSION = 2  # bump when anything below changes: caches are keyed on it
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
_NOUNS = (
    "apple river stone cloud forest window garden candle mirror ladder bridge island rocket violin pepper harbor "
    "meadow lantern pillow marble thunder basket feather compass"
).split()
_VERBS = "sees finds carries paints counts follows builds opens hears keeps".split()
_ADJECTIVES = "red quiet small bright old green heavy soft cold tall".split()
_SYLLABLES = "ka lo mi nu re sa ti vo be da fe gi ho ju ki ma ne po ru si ta wu ye zo".split()


def cache_root() -> Path:
    return Path(settings.MODEL_CACHE.get() or "").expanduser()


def ensure_tiny_model(root: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder of the demo model, building it first if this machine has not yet."""
    return cached_build(f"tiny-qwen2-v{BUILD_VERSION}", _build, root)


def cached_build(name: str, build: Callable[[Path], None], root: str | os.PathLike[str] | None = None) -> Path:
    """Return the demo model folder `name` under the model cache (or `root`), running `build` into it first if this
    machine has not yet.

    Safe to call from several processes at once: one builds while the others wait on a file lock, then read its
    build, so two cores never build the same model twice over. The build goes to a temporary folder renamed into
    place, so a build that dies leaves nothing a later call would take for a model.
    """
    target = Path(root or cache_root()) / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():
            return target
        staging = target.parent / f".tmp-{secrets.token_hex(6)}"
        staging.mkdir()
        try:
            build(staging)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def save_model(folder: Path, model: Any, tokenizer: Any, build_version: int) -> None:
    """Save a built demo model beside its tokenizer: generation ends at the tokenizer's EOS and pads with its pad
    token (the replicas and TRL read both from here), and demo.json records the build it came from."""
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "demo.json").write_text(
        json.dumps({"build_version": build_version, "parameters": model.num_parameters()})
    )


def _corpus(rng: random.Random, sentences: int = 4000) -> list[str]:
    """Short sentences of words, made-up words and single digits, and the chat scaffolding, so the BPE learns all."""
    invented = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))) for _ in range(300)]
    words = [*_NOUNS, *_VERBS, *_ADJECTIVES, *invented]
    lines = []
    for _ in range(sentences):
        sentence = [rng.choice(words) for _ in range(rng.randint(4, 8))]
        if rng.random() < 0.5:  # single digits only: no token ever holds two of them
            sentence.insert(rng.randrange(len(sentence)), " ".join(str(rng.randrange(10)) for _ in range(3)))
        lines.append(" ".join(sentence).capitalize() + ".")
    lines += ["<|im_start|>user\nWrite some numbers.<|im_end|>\n<|im_start|>assistant\n"] * 50
    return lines


def chat_tokenizer(trained: Any) -> Any:
    """A trained `tokenizers.Tokenizer` as a demo model's tokenizer: ChatML's special tokens, left padding, and one of
    TRL's recognised chat templates, verbatim (a one-character edit makes the rollout worker refuse it)."""
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_instruct_2507_chat_template

    fast = PreTrainedTokenizerFast(
        tokenizer_object=trained,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        model_max_length=1024,
    )
    fast.chat_template = qwen3_instruct_2507_chat_template
    return fast


def tiny_config(tokenizer: Any, initializer_range: float) -> Any:
    """The demo models' shape: a 2-layer Qwen2 of hidden size 128 over `tokenizer`'s vocabulary, in fp32."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def _build(folder: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2ForCausalLM

    rng = random.Random(1234)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(rng), trainer=trainer)
    fast = chat_tokenizer(tokenizer)
    fast.save_pretrained(folder)

    config = tiny_config(fast, initializer_range=0.1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    save_model(folder, model, fast, BUILD_VERSION)

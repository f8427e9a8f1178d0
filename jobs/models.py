"""Turning a spec's model id into something `from_pretrained` can load."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

from jobs.contract import AGENT_DEMO_MODEL_ID, BUILTIN_MODELS, ModelSpec

log = logging.getLogger(__name__)


def resolve_model(model: ModelSpec) -> str:
    """A local folder for a built-in demo model (built on first use), otherwise the Hub id or path as given."""
    if model.id in BUILTIN_MODELS:
        return str(builtin_model_folder(model.id))
    return model.id


def builtin_model_folder(model_id: str) -> Path:
    """The folder of one of the built-in demo models (`BUILTIN_MODELS`), built on first use."""
    if model_id == AGENT_DEMO_MODEL_ID:
        from jobs.demo.agent_model import ensure_agent_model

        return ensure_agent_model()
    from jobs.demo.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


def eos_token_ids(model_path: str, tokenizer_eos: int | None, revision: str | None = None) -> list[int]:
    """Every token id that ends a generation: the tokenizer's EOS and each one the model's generation config lists.

    vLLM stops at any of them (Qwen2.5's instruct models list both `<|im_end|>` and `<|endoftext|>`); a truncation
    check that knew only the tokenizer's would score a completion that ended cleanly as cut off at the length cap.
    """
    from transformers import GenerationConfig

    try:
        listed = GenerationConfig.from_pretrained(model_path, revision=revision).eos_token_id
    except OSError:  # the model has no generation_config.json
        listed = None
    listed = listed if isinstance(listed, list) else [listed]
    return sorted({tokenizer_eos, *listed} - {None})


def parameter_count(model_path: str, revision: str | None = None) -> int | None:
    """The model's parameter count from its safetensors headers (no weight is read), or None when it cannot be told.

    A local folder's files are read directly; a Hub model's headers are fetched with ranged requests (the job's token
    from the environment, as the model itself will be downloaded).
    """
    folder = Path(model_path)
    try:
        if folder.is_dir():
            files = sorted(folder.glob("*.safetensors"))
            return sum(_safetensors_parameters(path) for path in files) if files else None
        from huggingface_hub import get_safetensors_metadata

        return sum(get_safetensors_metadata(model_path, revision=revision).parameter_count.values())
    except Exception as error:  # the size only picks the sharding; training itself reports a missing model
        log.warning("could not count %s's parameters (%s: %s)", model_path, type(error).__name__, error)
        return None


def _safetensors_parameters(path: Path) -> int:
    """Parameters in one safetensors file: the product of every tensor's shape, from its JSON header."""
    with path.open("rb") as file:
        (size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(size))
    total = 0
    for name, tensor in header.items():
        if name != "__metadata__":
            count = 1
            for dimension in tensor["shape"]:
                count *= dimension
            total += count
    return total

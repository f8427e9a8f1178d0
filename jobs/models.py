"""Turning a spec's model id into something `from_pretrained` can load."""

from __future__ import annotations

from jobs.contract import DEMO_MODEL_ID, ModelSpec


def resolve_model(model: ModelSpec) -> str:
    """A local folder for the built-in demo model (built on first use), otherwise the Hub id or path as given."""
    if model.id == DEMO_MODEL_ID:
        from jobs.demo.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    return model.id


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

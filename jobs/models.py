"""Turning a spec's model id into something `from_pretrained` can load."""

from __future__ import annotations

from jobs.contract import DEMO_MODEL_ID, ModelSpec


def resolve_model(model: ModelSpec) -> str:
    """A local folder for the built-in demo model (built on first use), otherwise the Hub id or path as given."""
    if model.id == DEMO_MODEL_ID:
        from jobs.demo.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    return model.id

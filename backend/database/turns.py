"""An agent's episode turn by turn, as a sample's row keeps it (`RolloutSample.turns_json`) and its readers see it.

Each turn is a reply of the model (its text, the tools it called with their arguments, the adapter version that
generated it: after a weight sync, a later one than the version the episode started on) or a tool's answer. What a job
sent is checked field by field once, at ingest (backend/ingestion/episodes.py), and stored in exactly this shape, so
readers (the API, the exports, the sample cards) only decode it here: checking it again would hide a writer's bug.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] | str  # a string where the model's arguments were not parsed (or were cut short)


@dataclass(frozen=True)
class Turn:
    role: str  # "assistant" (the model), "tool", or another role the episode held
    content: str
    name: str | None = None  # the tool that answered, on a tool turn
    tool_calls: list[ToolCall] = field(default_factory=list)
    version: int | None = None  # the adapter version that generated a model turn; None where unknown

    @property
    def by_model(self) -> bool:
        return self.role == "assistant"


def read_turns(stored: str | None) -> list[Turn] | None:
    """The turns a row keeps (the JSON of a list of `Turn`s, as ingest stored them), or None for a single reply."""
    if stored is None:
        return None
    return [_turn(entry) for entry in json.loads(stored)]


def _turn(entry: dict[str, Any]) -> Turn:
    return Turn(**{**entry, "tool_calls": [ToolCall(**call) for call in entry["tool_calls"]]})

"""An agent's episode as the trainer records it in a sample's `turns`, checked once, at ingest, as the panel keeps it.

Records come from a job over the network, so every field is checked here: what SQLite holds is always a JSON list of
turns of one shape (backend/database/turns.py's `Turn`; NULL for a single-turn sample), which the filters (SQLite's
json_each), the API, the exports and the sample cards read back through `RolloutSample.turns` without checking each
field again.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from backend.database.turns import ToolCall, Turn
from jobs.contract.spec import MAX_TURNS

# What one episode keeps of its texts (replies, arguments, tool answers), in turn order: three completions' worth
# (the trainer cuts a single-turn completion at 20,000 characters). A text cut short ends with CUT.
MAX_EPISODE_CHARS = 60_000
# Turns kept at most: a reply and a few tool answers for each of the most tool-calling iterations a run may allow.
MAX_TURNS_KEPT = 8 * MAX_TURNS
CUT = "…"


class _Budget:
    """What is left of an episode's characters: texts taken in turn order are cut once it runs out."""

    def __init__(self, chars: int):
        self.left = chars

    def cut(self, text: str) -> str:
        kept = text[: self.left]
        self.left -= len(kept)
        return kept if len(kept) == len(text) else kept + CUT

    def arguments(self, arguments: dict[str, Any] | str) -> dict[str, Any] | str:
        """An object of arguments kept as it is while it fits, else as its JSON text cut short."""
        if isinstance(arguments, str):
            return self.cut(arguments)
        try:
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except ValueError:  # NaN or infinity: JSON that SQLite's json functions refuse, so kept as text
            return self.cut(json.dumps(arguments, ensure_ascii=False))
        kept = self.cut(text)
        return arguments if kept == text else kept


def stored_turns(raw: Any) -> str | None:
    """The turns of a sample record as the JSON its row keeps: None for a single-turn sample (no `turns`, or nothing
    in them that reads as a turn); entries that are not turns are left out, fields of the wrong type coerced or
    dropped, texts cut to MAX_EPISODE_CHARS in all."""
    turns = _turns(raw, _Budget(MAX_EPISODE_CHARS))
    return json.dumps([asdict(turn) for turn in turns], ensure_ascii=False) if turns else None


def _turns(raw: Any, budget: _Budget) -> list[Turn]:
    if not isinstance(raw, list):
        return []
    turns = (_turn(entry, budget) for entry in raw[:MAX_TURNS_KEPT])
    return [turn for turn in turns if turn is not None]


def _turn(entry: Any, budget: _Budget) -> Turn | None:
    """One turn from what a record holds; None when it is not a turn (not an object, or without a role)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("role"), str) or not entry["role"]:
        return None
    calls = entry["tool_calls"] if isinstance(entry.get("tool_calls"), list) else []
    return Turn(
        role=entry["role"],
        content=budget.cut(_text(entry.get("content"))),
        name=entry["name"] if isinstance(entry.get("name"), str) else None,
        tool_calls=[call for call in (_tool_call(call, budget) for call in calls) if call is not None],
        version=_whole(entry.get("version")),
    )


def _tool_call(entry: Any, budget: _Budget) -> ToolCall | None:
    """A tool call as the trainer records it ({name, arguments}) or in OpenAI's form ({function: {...}}); None
    without a tool's name."""
    if not isinstance(entry, dict):
        return None
    function = entry["function"] if isinstance(entry.get("function"), dict) else entry
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        return None
    if not isinstance(arguments, dict | str):
        arguments = {} if arguments is None else _text(arguments)
    return ToolCall(name, budget.arguments(arguments))


def _text(value: Any) -> str:
    """A turn's text: a string as it is, nothing as empty, anything else (a list of content parts) as its JSON."""
    if isinstance(value, str):
        return value
    return "" if value is None else json.dumps(value, ensure_ascii=False)


def _whole(value: Any) -> int | None:
    """A version: a whole number that fits SQLite's and Parquet's 64-bit integers, else unknown."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63 else None

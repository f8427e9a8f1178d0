"""The built-in demo dataset: short instructions the tiny model can learn to answer with digits."""

from __future__ import annotations

INSTRUCTIONS = (
    "Write some numbers.",
    "Say a number.",
    "Count for me.",
    "Give me digits.",
    "List a few numbers.",
    "Name a number.",
    "Write digits now.",
    "Show me numbers.",
)
NOUNS = ("apple", "river", "stone", "cloud")


def digits_rows() -> list[dict[str, str]]:
    """32 rows (8 instructions x 4 nouns) with a `prompt` column and an empty `answer`, as the findings used."""
    return [{"prompt": f"{instruction} {noun}", "answer": ""} for instruction in INSTRUCTIONS for noun in NOUNS]

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
# The training split's nouns, and the held-out split's: the same instructions about things the model never trained on.
NOUNS = {"train": ("apple", "river", "stone", "cloud"), "test": ("forest", "window", "garden", "candle")}
SPLITS = tuple(NOUNS)


def digits_rows(split: str = "train") -> list[dict[str, str]]:
    """32 rows (8 instructions x 4 nouns) with a `prompt` column and an empty `answer`, as the findings used; the
    `test` split asks the same of other nouns, for held-out evaluation."""
    return [{"prompt": f"{instruction} {noun}", "answer": ""} for instruction in INSTRUCTIONS for noun in NOUNS[split]]

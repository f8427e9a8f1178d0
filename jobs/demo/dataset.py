"""The built-in datasets: short instructions the tiny model can learn to answer with digits, and the agent demo's
questions that only a tool call answers."""

from __future__ import annotations

import random

from jobs.contract import AGENT_DEMO_DATASET_ID

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


# The things the agent demo asks about (a row's code is its own: the same thing keeps other codes in other rows, so
# only the environment's lookup knows the answer).
THINGS = (
    "apple river stone cloud forest window garden candle mirror ladder bridge island rocket violin pepper harbor "
    "meadow lantern pillow marble thunder basket feather compass"
).split()
CODEBOOK_ROWS = {"train": 64, "test": 32}
# The held-out split asks about things the training split never does (the warm start saw them all).
CODEBOOK_THINGS = {"train": THINGS[:16], "test": THINGS[16:]}


def codebook_question(rng: random.Random, things: tuple[str, ...] | list[str] = THINGS) -> dict[str, str]:
    """One row of the agent demo: a question about a thing, the thing, and the code the row keeps for it."""
    thing = rng.choice(things)
    return {"prompt": f"What is the code of the {thing}?", "thing": thing, "answer": str(rng.randrange(10))}


def codebook_rows(split: str = "train") -> list[dict[str, str]]:
    """The agent demo's rows: 64 about 16 things to train on, 32 about 8 others held out."""
    rng = random.Random(f"codebook-{split}")
    return [codebook_question(rng, CODEBOOK_THINGS[split]) for _ in range(CODEBOOK_ROWS[split])]


def builtin_splits(dataset_id: str) -> tuple[str, ...]:
    """The splits one of the built-in datasets (`BUILTIN_DATASETS`) has."""
    return tuple(CODEBOOK_ROWS) if dataset_id == AGENT_DEMO_DATASET_ID else SPLITS


def builtin_rows(dataset_id: str, split: str) -> list[dict[str, str]]:
    """The rows of one of the built-in datasets (`BUILTIN_DATASETS`)."""
    return codebook_rows(split) if dataset_id == AGENT_DEMO_DATASET_ID else digits_rows(split)

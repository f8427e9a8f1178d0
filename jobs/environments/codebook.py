"""The `codebook` built-in: the agent demo's environment, where the answer is a code only the environment keeps.

Each dataset row names a thing and keeps a code for it (the row's `thing` and `answer` columns); the same thing has
other codes in other rows, so a model cannot learn the answers, only to ask for them. An episode starts from its row
(`reset`), and `lookup` answers with the code when asked about that thing.
"""

from __future__ import annotations

from typing import Any


class Codebook:
    """One episode's codebook: the thing its row asks about, and that thing's code."""

    def __init__(self) -> None:
        self.thing, self.code = "", ""

    def reset(self, **row: Any) -> None:
        self.thing = str(row.get("thing") or "").strip().lower()
        self.code = str(row.get("answer") or "")

    def lookup(self, name: str) -> str:
        """Look up the code of a thing.

        Args:
            name: the thing, e.g. "apple"
        """
        if name.strip().lower() == self.thing:
            return self.code
        return f"no code is kept for {name!r}; ask about {self.thing!r}"


ENVIRONMENT = Codebook

"""Where the panel is hosted, which decides how much it must distrust its users."""

from __future__ import annotations

from backend import settings


def on_space() -> bool:
    """True inside a Hugging Face Space: many signed-in users share this process, so their code must be confined."""
    return bool(settings.SPACE_ID.get()) or settings.SYSTEM.get() == "spaces"

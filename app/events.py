"""Gradio's event values as the pages handle them, given a shape once here (Gradio's event boundary).

Gradio calls a handler with each input component's value, or, when the inputs are given as a set, with one dict of
them all; a handler answers with a dict from output components to what each now shows: a plain value, or the
component again carrying new settings (`gr.Dropdown(choices=...)`, `gr.update(...)`, `gr.skip()`). What a value is
depends on its component (text, a number, a DataFrame, a figure), so the values stay `Any`; the keys are typed.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from gradio.blocks import Block

Updates: TypeAlias = dict[Block, Any]
"""A handler's answer: output component -> its new value or settings (an output left out keeps what it shows)."""

Values: TypeAlias = dict[Block, Any]
"""What a handler whose inputs are a set receives: each input component -> its value."""

Components: TypeAlias = list[Block]
"""An event's inputs or outputs, in the order its handler takes or answers them."""

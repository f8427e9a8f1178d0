"""The Adapters page's figure: per-layer update norms of two versions and of their difference, as heatmaps."""

from __future__ import annotations

import re

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.charts.style import empty_figure
from backend.services.adapters import Comparison

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def _cell(module: str) -> tuple[str, str]:
    """('layer 3', 'self_attn.q_proj') for 'model.layers.3.self_attn.q_proj'; non-layer modules keep their name."""
    match = _LAYER.search(module)
    if match is None:
        return "other", module
    return f"layer {int(match.group(1))}", match.group(2)


def norms_heatmap(comparison: Comparison | None) -> go.Figure:
    """Three panels on one color scale: ‖ΔW‖ of version A, of version B, and ‖ΔW_B − ΔW_A‖ per layer and module."""
    title = "Update norm per layer and module, ‖(α/r)·B·A‖"
    if comparison is None or not comparison.modules:
        return empty_figure(title, "Pick two versions and press Compare to see where the updates landed", height=420)
    rows: list[str] = []
    columns: list[str] = []
    cells: dict[tuple[str, str], tuple[float, float, float]] = {}
    for delta in comparison.modules:
        row, column = _cell(delta.module)
        if row not in rows:
            rows.append(row)
        if column not in columns:
            columns.append(column)
        cells[(row, column)] = (delta.norm_a, delta.norm_b, delta.diff_norm)
    rows.sort(key=lambda r: (r == "other", int(r.split()[-1]) if r != "other" else 0))
    short = [c.split(".")[-1] for c in columns]
    panels = [
        f"v{comparison.version_a} (step {comparison.step_a})",
        f"v{comparison.version_b} (step {comparison.step_b})",
        f"difference v{comparison.version_b} − v{comparison.version_a}",
    ]
    peak = max((max(v) for v in cells.values()), default=1.0) or 1.0
    figure = make_subplots(rows=1, cols=3, shared_yaxes=True, subplot_titles=panels, horizontal_spacing=0.075)
    for index in range(3):
        z = [[cells[(r, c)][index] if (r, c) in cells else None for c in columns] for r in rows]
        figure.add_trace(
            go.Heatmap(
                z=z,
                x=short,
                y=rows,
                zmin=0,
                zmax=peak,
                colorscale="Blues" if index < 2 else "Oranges",
                showscale=index in (1, 2),
                colorbar={
                    "title": {"text": "norm" if index == 1 else "diff"},
                    "x": 1.0 if index == 2 else 0.645,
                    "len": 0.8,
                    "thickness": 10,
                },
                customdata=[[columns[j] for j in range(len(columns))] for _ in rows],
                hovertemplate="%{y} · %{customdata}<br>norm %{z:.4g}<extra></extra>",
            ),
            row=1,
            col=index + 1,
        )
    figure.update_layout(
        template="plotly_white",
        title={"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        height=max(320, 90 + 26 * len(rows)),
        margin={"l": 70, "r": 40, "t": 80, "b": 60},
        font={"family": "Source Sans Pro, Liberation Sans, sans-serif", "size": 12},
    )
    figure.update_yaxes(autorange="reversed")
    figure.update_xaxes(tickangle=-35)
    return figure

"""The Runs page's figure: reward curves of several runs on one axis, each branch drawn from where it forked."""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from app.charts.style import base_figure, empty_figure, rolling_mean, series_color, smoothing_window


@dataclass
class Curve:
    label: str
    reward: list[tuple[int, float]]
    offset: int = 0  # a branch starts at its parent version's step, so it continues the parent's curve
    branch: bool = False


def overlay_figure(curves: list[Curve]) -> go.Figure:
    title = "Reward of the ticked runs (rolling mean; branches start where they forked)"
    if not curves:
        return empty_figure(title, "Tick runs in the list to compare their reward curves here")
    if not any(curve.reward for curve in curves):
        return empty_figure(title, "The ticked runs have logged no reward yet")
    figure = base_figure(title, x_title="optimizer step (a branch counts from its parent's step)", y_title="reward")
    for index, curve in enumerate(curves):
        if not curve.reward:
            continue
        steps = [step + curve.offset for step, _ in curve.reward]
        values = [value for _, value in curve.reward]
        color = series_color(index)
        figure.add_scatter(
            x=steps,
            showlegend=True,
            y=rolling_mean(values, smoothing_window(len(values))),
            name=curve.label,
            line={"color": color, "width": 2, "dash": "dash" if curve.branch else "solid"},
        )
        if curve.branch:
            figure.add_scatter(
                x=[curve.offset],
                y=[values[0]],
                mode="markers",
                showlegend=False,
                hoverinfo="skip",
                marker={"symbol": "diamond", "size": 10, "color": color},
            )
    return figure

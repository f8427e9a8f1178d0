"""The Runs page's figure: one metric of several runs on one axis, each branch drawn from where it forked."""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from app.charts.style import base_figure, empty_figure, rolling_mean, series_color, smoothing_window


@dataclass
class Curve:
    label: str
    points: list[tuple[int, float]]  # (step, value) of the compared metric
    offset: int = 0  # a branch starts at its parent version's step, so it continues the parent's curve
    branch: bool = False


def overlay_figure(curves: list[Curve], metric: str = "reward", smoothing: int = 0) -> go.Figure:
    """Each ticked run's `metric`, smoothed by a rolling mean of `smoothing` steps (0: a window suited to the run's
    length, 1: not smoothed)."""
    smoothed = "not smoothed" if smoothing == 1 else "rolling mean"
    title = f"{metric} of the ticked runs ({smoothed}; branches start where they forked)"
    if not curves:
        return empty_figure(title, "Tick runs in the list to compare them here")
    if not any(curve.points for curve in curves):
        return empty_figure(title, f"The ticked runs have logged no {metric} yet")
    figure = base_figure(title, x_title="optimizer step (a branch counts from its parent's step)", y_title=metric)
    for index, curve in enumerate(curves):
        if not curve.points:
            continue
        steps = [step + curve.offset for step, _ in curve.points]
        values = [value for _, value in curve.points]
        color = series_color(index)
        figure.add_scatter(
            x=steps,
            showlegend=True,
            y=rolling_mean(values, smoothing or smoothing_window(len(values))),
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

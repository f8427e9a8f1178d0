"""One look for every figure: colors per meaning, the base layout, and the empty state.

A color always means the same thing across pages (reward is blue everywhere, weight sync violet, ...), so a reader
who learned one plot can read the next without its legend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

COLORS = {
    "reward": "#2563eb",
    "reward_raw": "rgba(37, 99, 235, 0.28)",
    "ratio": "#059669",
    "kl": "#d97706",
    "fwd_bwd": "#2563eb",
    "rollout_wait": "#f59e0b",
    "weight_sync": "#8b5cf6",
    "other": "#cbd5e1",
    "queue": "#0891b2",
    "backpressure": "#dc2626",
    "staleness": "#7c3aed",
    "tokens": "#16a34a",
    "limit": "#64748b",
    "affinity": "#16a34a",
    "followed": "#65a30d",
    "unmatched": "#f59e0b",
    "spilled": "#dc2626",
    "upload": "#0ea5e9",
    "broadcast": "#f97316",
}
# For series without a fixed meaning (reward functions, replicas, runs in an overlay), in this order.
SERIES = ("#2563eb", "#0891b2", "#7c3aed", "#059669", "#d97706", "#db2777", "#65a30d", "#475569", "#e11d48")
HEIGHT = 300


def series_color(index: int) -> str:
    return SERIES[index % len(SERIES)]


def base_figure(title: str, x_title: str = "optimizer step", y_title: str = "", height: int = HEIGHT) -> go.Figure:
    figure = go.Figure()
    figure.update_layout(
        template="plotly_white",
        title={"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        height=height,
        margin={"l": 56, "r": 24, "t": 64, "b": 44},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "right", "x": 1.0, "font": {"size": 11}},
        hovermode="x unified",
        font={"family": "Source Sans Pro, Liberation Sans, sans-serif", "size": 12},
        xaxis={"title": {"text": x_title}, "gridcolor": "#eef2f7", "zeroline": False},
        yaxis={"title": {"text": y_title}, "gridcolor": "#eef2f7", "zeroline": False},
        uirevision="keep",  # keep the reader's zoom across refreshes
    )
    return figure


def integer_steps(figure: go.Figure, steps: Sequence[int]) -> go.Figure:
    """Steps are whole numbers: on a short run, tick every step instead of at 1.5, 2.5, ..."""
    if steps and max(steps) - min(steps) <= 12:
        figure.update_xaxes(dtick=1)
    return figure


def empty_figure(title: str, message: str, height: int = HEIGHT) -> go.Figure:
    """A titled figure that says what will appear here, and when — instead of an empty box."""
    figure = base_figure(title, height=height)
    figure.update_layout(xaxis={"visible": False}, yaxis={"visible": False}, hovermode=False)
    figure.add_annotation(
        text=message,
        x=0.5,
        y=0.5,
        xref="paper",
        yref="paper",
        showarrow=False,
        font={"size": 13, "color": "#64748b"},
        align="center",
    )
    return figure


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to `window` points (shorter at the start, so the line starts with the data)."""
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def smoothing_window(points: int) -> int:
    """About 1/20 of the series, at least 5 points: smooth enough to show a trend, short enough to follow it."""
    return max(5, points // 20)


def elapsed_axis(seconds: Sequence[float], since: str) -> tuple[list[float], str]:
    """Elapsed times in the unit that reads best for their span (seconds, minutes or hours) and the axis title that
    names it: a minute-long run is not plotted at 0.333, 0.5 and 0.667 minutes."""
    span = max(seconds, default=0.0)
    unit, size = ("seconds", 1.0) if span < 180 else ("minutes", 60.0) if span < 3 * 3600 else ("hours", 3600.0)
    return [value / size for value in seconds], f"{unit} since {since}"


@dataclass(frozen=True)
class ChartOptions:
    """What the reader chose above the training figures: the smoothing window (0: automatic, `smoothing_window`;
    1: none), a logarithmic y axis, and what the x axis counts. The raw series stays drawn beside every smoothed
    one."""

    smoothing: int = 0
    log_y: bool = False
    x_values: Mapping[int, float] | None = None  # optimizer step -> what the x axis counts instead (None: the step)
    x_title: str = "optimizer step"

    def window(self, points: int) -> int:
        return self.smoothing if self.smoothing > 0 else smoothing_window(points)

    def apply(self, figure: go.Figure) -> go.Figure:
        """The log scale, and the x axis counted in `x_values` (a step without a value leaves a gap)."""
        if self.log_y:
            figure.update_yaxes(type="log")
        if self.x_values is not None:
            for trace in figure.data:
                if trace.x is not None:
                    trace.x = [self.x_values.get(step) for step in trace.x]
            figure.update_xaxes(title_text=self.x_title, dtick=None)
        return figure

"""The monitor's rollout figures: the queue against its limit, staleness, generation speed, sample policy versions."""

from __future__ import annotations

from collections.abc import Callable

import plotly.graph_objects as go

from app.charts.style import COLORS, base_figure, empty_figure, integer_steps
from backend.services.queries import VersionUse

Series = list[tuple[int, float]]


def _xy(series: Series) -> tuple[list[int], list[float]]:
    return [step for step, _ in series], [value for _, value in series]


def queue_figure(queue: Series, queue_max: int, backpressure: Series) -> go.Figure:
    """A full queue with backpressure means the trainer is the bottleneck; an empty one, the replicas."""
    title = "Rollout queue: size vs its limit, and backpressure"
    if not queue and not backpressure:
        return empty_figure(title, "The queue size appears after the first optimizer step")
    figure = base_figure(title, y_title="samples in the queue")
    if queue:
        steps, values = _xy(queue)
        figure.add_scatter(x=steps, y=values, name="queue size", line={"color": COLORS["queue"], "width": 2})
    figure.add_hline(
        y=queue_max,
        line={"color": COLORS["limit"], "dash": "dash", "width": 1},
        annotation_text=f"limit {queue_max}",
        annotation_position="top left",
    )
    if backpressure:
        steps, values = _xy(backpressure)
        figure.add_bar(
            x=steps,
            y=values,
            name="backpressure (s, right axis)",
            yaxis="y2",
            marker={"color": COLORS["backpressure"]},
            opacity=0.45,
        )
        figure.update_layout(
            yaxis2={"title": {"text": "seconds blocked"}, "overlaying": "y", "side": "right", "showgrid": False}
        )
    figure.update_yaxes(rangemode="tozero")
    return integer_steps(figure, [s for s, _ in queue or backpressure])


def staleness_figure(mean: Series, worst: Series, limit: int) -> go.Figure:
    title = "Staleness of trained samples (policy versions behind)"
    if not mean:
        return empty_figure(title, "Staleness appears after the first optimizer step")
    figure = base_figure(title, y_title="versions behind the trainer")
    steps, values = _xy(mean)
    figure.add_scatter(x=steps, y=values, name="mean", line={"color": COLORS["staleness"], "width": 2})
    if worst:
        steps, values = _xy(worst)
        figure.add_scatter(
            x=steps, y=values, name="max", line={"color": COLORS["staleness"], "width": 1, "dash": "dot"}
        )
    figure.add_hline(
        y=limit,
        line={"color": COLORS["limit"], "dash": "dash", "width": 1},
        annotation_text=f"max_staleness {limit}: older samples are dropped",
        annotation_position="top left",
    )
    figure.update_yaxes(rangemode="tozero", range=[0, max(limit + 0.5, max(values, default=0) * 1.1)])
    return integer_steps(figure, [s for s, _ in mean])


def tokens_figure(generated: Series) -> go.Figure:
    title = "Generation speed (tokens/s across all replicas)"
    if not generated:
        return empty_figure(title, "Generated tokens/s appear once the rollout worker reports them")
    figure = base_figure(title, y_title="tokens / s")
    steps, values = _xy(generated)
    figure.add_scatter(
        x=steps, y=values, name="generated tok/s", fill="tozeroy", line={"color": COLORS["tokens"], "width": 2}
    )
    return integer_steps(figure, steps)


def sample_versions_figure(uses: list[VersionUse]) -> go.Figure:
    """Each dot: the samples of one step that one adapter version generated (bigger = more; red = dropped as stale).

    The dashed line is the trainer's own version at that step: dots on it or just below are fresh samples, the proof
    that the replicas sample from the adapter the trainer just published.
    """
    title = "Which adapter version generated each step's samples"
    if not uses:
        return empty_figure(title, "Appears when the first rollout samples arrive")
    figure = base_figure(title, y_title="adapter version")
    biggest = max(use.samples for use in uses) or 1
    counts: tuple[tuple[str, Callable[[VersionUse], int], str], ...] = (
        ("trained on (size = count)", lambda use: use.samples - use.dropped, COLORS["reward"]),
        ("dropped as too stale", lambda use: use.dropped, COLORS["backpressure"]),
    )
    for label, count, color in counts:
        shown = [use for use in uses if count(use)]
        figure.add_scatter(
            x=[use.step for use in shown],
            y=[use.policy_version for use in shown],
            mode="markers",
            name=label,
            marker={"size": [7 + 13 * count(use) / biggest for use in shown], "color": color, "opacity": 0.75},
            customdata=[count(use) for use in shown],
            hovertemplate=f"step %{{x}}: %{{customdata}} samples from v%{{y}} {label.split(' (')[0]}<extra></extra>",
        )
    trainer: dict[int, int] = {}
    for use in uses:
        trainer[use.step] = max(trainer.get(use.step, use.trainer_version), use.trainer_version)
    steps = sorted(trainer)
    figure.add_scatter(
        x=steps,
        y=[trainer[s] for s in steps],
        name="trainer's version",
        mode="lines",
        line={"color": COLORS["limit"], "dash": "dash", "width": 1},
    )
    versions = [use.policy_version for use in uses] + list(trainer.values())
    figure.update_layout(hovermode="closest")
    if max(versions) - min(versions) < 15:
        figure.update_yaxes(dtick=1)
    return integer_steps(figure, steps)

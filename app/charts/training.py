"""The monitor's training figures: reward, held-out reward per version, reward per function, ratio and KL, and where
each step's time goes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import plotly.graph_objects as go

from app.charts.style import (
    COLORS,
    ChartOptions,
    base_figure,
    empty_figure,
    integer_steps,
    rolling_mean,
    series_color,
)
from backend.services.queries import HeldOutScore

Series = list[tuple[int, float]]
AFTER_FIRST_STEP = "after the first optimizer step<br>(the trainer logs every step)"


def _xy(series: Series) -> tuple[list[int], list[float]]:
    return [step for step, _ in series], [value for _, value in series]


def reward_figure(reward: Series, options: ChartOptions = ChartOptions()) -> go.Figure:
    title = "Reward (mean over each step's completions)"
    if not reward:
        return empty_figure(title, "The mean reward appears " + AFTER_FIRST_STEP)
    steps, values = _xy(reward)
    window = options.window(len(values))
    figure = base_figure(title, y_title="reward")
    figure.add_scatter(
        x=steps,
        y=values,
        name="per step",
        mode="lines+markers" if len(values) < 60 else "lines",
        line={"color": COLORS["reward_raw"], "width": 1},
        marker={"size": 4, "color": COLORS["reward_raw"]},
    )
    if window > 1:  # 1: smoothing off, the raw series alone
        figure.add_scatter(
            x=steps,
            y=rolling_mean(values, window),
            name=f"rolling mean ({window} steps)",
            line={"color": COLORS["reward"], "width": 3},
        )
    return options.apply(integer_steps(figure, steps))


def held_out_figure(
    reward: list[HeldOutScore],
    training: Series,
    per_function: dict[str, list[HeldOutScore]] | None = None,
    options: ChartOptions = ChartOptions(),
    metrics: dict[str, list[HeldOutScore]] | None = None,
) -> go.Figure:
    """Held-out reward per evaluated version at the version's step, with its 95 % interval, over the training reward
    (lighter): a training reward that climbs while the held-out one stays flat is overfitting or reward hacking. Each
    reward function's held-out mean gets its own trace when there are several, each eval metric (scored, never
    trained on) always. A version's score belongs to its step, so the x axis stays on steps whatever the controls
    count; smoothing applies to the training reward only."""
    title = "Held-out reward per version (95 % interval)"
    if not reward:
        return empty_figure(
            title,
            "No held-out evaluation yet: the run evaluates every Nth version<br>when its spec has an eval section",
        )
    figure = base_figure(title, y_title="reward")
    figure.update_layout(showlegend=True)
    if training:
        _add_training_reward(figure, training, options.window(len(training)))
    _add_held_out(figure, "held-out reward", reward, COLORS["reward"], intervals=True)
    functions = {name: scores for name, scores in (per_function or {}).items() if scores}
    traces = {f"held-out {name}": scores for name, scores in sorted(functions.items())} if len(functions) > 1 else {}
    traces |= {f"held-out metric {name}": scores for name, scores in sorted((metrics or {}).items()) if scores}
    for index, (name, scores) in enumerate(traces.items()):
        _add_held_out(figure, name, scores, series_color(index), intervals=False)
    steps = [score.step for score in reward] + [step for step, _ in training]
    figure = replace(options, x_values=None).apply(integer_steps(figure, steps))
    if options.x_values is not None:
        figure.update_xaxes(title_text="optimizer step (held-out scores stay on the version's step)")
    return figure


def _add_training_reward(figure: go.Figure, training: Series, window: int) -> None:
    steps, values = _xy(training)
    smoothed = window > 1
    figure.add_scatter(
        x=steps,
        y=rolling_mean(values, window) if smoothed else values,
        name=f"training reward, rolling mean ({window} steps)" if smoothed else "training reward per step",
        line={"color": COLORS["reward_raw"], "width": 2},
    )


def _add_held_out(figure: go.Figure, name: str, scores: list[HeldOutScore], color: str, intervals: bool) -> None:
    """One version per point; with `intervals`, its 95 % interval as an error bar (none where it is unbounded)."""
    bounds = [
        f"[{score.low:.3f}, {score.high:.3f}]" if score.half_width is not None else "(interval unbounded)"
        for score in scores
    ]
    figure.add_scatter(
        x=[score.step for score in scores],
        y=[score.mean for score in scores],
        name=name,
        mode="lines+markers",
        line={"color": color, "width": 2 if intervals else 1.5, "dash": "solid" if intervals else "dot"},
        marker={"size": 7 if intervals else 5, "color": color},
        error_y=_interval_bars(scores, color) if intervals else None,
        customdata=[[score.version, bound] for score, bound in zip(scores, bounds, strict=True)],
        hovertemplate=f"v%{{customdata[0]}}: %{{y:.3f}} %{{customdata[1]}}<extra>{name}</extra>",
    )


def _interval_bars(scores: list[HeldOutScore], color: str) -> dict[str, Any]:
    """Error bars from each mean to its interval's bounds (an unbounded side draws none)."""
    return {
        "type": "data",
        "symmetric": False,
        "array": [None if s.high is None else s.high - s.mean for s in scores],
        "arrayminus": [None if s.low is None else s.mean - s.low for s in scores],
        "color": color,
        "thickness": 1.5,
        "width": 4,
    }


def reward_functions_figure(per_function: dict[str, Series], options: ChartOptions = ChartOptions()) -> go.Figure:
    title = "Reward by function (rewards/<name>, weighted)"
    shown = {name: series for name, series in per_function.items() if series}
    if not shown:
        return empty_figure(title, "One curve per reward function appears<br>" + AFTER_FIRST_STEP)
    window = options.window(max(len(series) for series in shown.values()))
    # Smoothed, and said so in the axis title; each function's raw series stays drawn, faint, beneath its mean.
    figure = base_figure(title, y_title=f"score, rolling mean ({window} steps)" if window > 1 else "score")
    figure.update_layout(showlegend=True)
    for index, (name, series) in enumerate(sorted(shown.items())):
        steps, values = _xy(series)
        color = series_color(index)
        if window > 1:
            figure.add_scatter(
                x=steps,
                y=values,
                name=f"{name} per step",
                showlegend=False,
                opacity=0.3,
                line={"color": color, "width": 1},
            )
        figure.add_scatter(x=steps, y=rolling_mean(values, window), name=name, line={"color": color, "width": 2})
    return options.apply(integer_steps(figure, [s for series in shown.values() for s, _ in series]))


def ratio_kl_figure(
    ratio: Series, kl: Series, tolerance: float = 0.01, options: ChartOptions = ChartOptions()
) -> go.Figure:
    """ratio ≈ 1 is the evidence that the replicas serve the policy the trainer trains (and KL stays tiny). The x axis
    follows `options`; the log scale does not apply (kl starts at 0)."""
    title = "Served vs trained policy: importance ratio and KL"
    if not ratio and not kl:
        return empty_figure(
            title, "ratio and kl appear " + AFTER_FIRST_STEP + "<br>ratio ≈ 1.00: the replicas serve the trained policy"
        )
    figure = base_figure(title, y_title="ratio (served → trained)")
    if ratio:
        steps, values = _xy(ratio)
        figure.add_hrect(y0=1 - tolerance, y1=1 + tolerance, fillcolor=COLORS["ratio"], opacity=0.08, line_width=0)
        figure.add_hline(y=1.0, line={"color": COLORS["limit"], "dash": "dot", "width": 1})
        figure.add_scatter(x=steps, y=values, name="ratio", line={"color": COLORS["ratio"], "width": 2})
    if kl:
        steps, values = _xy(kl)
        figure.add_scatter(
            x=steps, y=values, name="kl (right axis)", yaxis="y2", line={"color": COLORS["kl"], "width": 2}
        )
        figure.update_layout(
            yaxis2={
                "title": {"text": "kl"},
                "overlaying": "y",
                "side": "right",
                "showgrid": False,
                "rangemode": "tozero",
            }
        )
    return replace(options, log_y=False).apply(integer_steps(figure, [s for s, _ in ratio or kl]))


def step_time_figure(
    step: Series, fwd_bwd: Series, rollout_wait: Series, weight_sync: Series, options: ChartOptions = ChartOptions()
) -> go.Figure:
    """Stacked: a trainer-bound run is mostly forward/backward, a generation-bound one mostly rollout wait."""
    title = "Where each step's time goes"
    if not (step or fwd_bwd):
        return empty_figure(title, "Step timings appear from the second optimizer step")
    parts = {"forward/backward": fwd_bwd, "rollout wait": rollout_wait, "weight sync": weight_sync}
    colors = {"forward/backward": "fwd_bwd", "rollout wait": "rollout_wait", "weight sync": "weight_sync"}
    by_step = {name: dict(series) for name, series in parts.items()}
    steps = sorted({s for series in parts.values() for s, _ in series} | {s for s, _ in step})
    figure = base_figure(title, y_title="seconds per step")
    for name, values in by_step.items():
        figure.add_scatter(
            x=steps,
            y=[values.get(s, 0.0) for s in steps],
            name=name,
            stackgroup="time",
            line={"color": COLORS[colors[name]], "width": 0.5},
            fillcolor=COLORS[colors[name]],
        )
    totals = dict(step)
    if totals:
        other = [
            max(0.0, totals[s] - sum(v.get(s, 0.0) for v in by_step.values())) if s in totals else 0.0 for s in steps
        ]
        figure.add_scatter(
            x=steps,
            y=other,
            name="other",
            stackgroup="time",
            line={"color": COLORS["other"], "width": 0.5},
            fillcolor=COLORS["other"],
        )
    return options.apply(integer_steps(figure, steps))


def metrics_figure(metrics: dict[str, Series], options: ChartOptions = ChartOptions()) -> go.Figure:
    """Any metrics the run logged, each in its own chart one above the other, sharing the x axis and the controls
    above the training figures (smoothing, log scale, what x counts): loss, grad_norm, entropy, learning rate,
    completion length, clip ratio, … — all 67 of TRL's, not only the fixed set drawn above."""
    title = "More metrics"
    if not metrics:
        return empty_figure(title, "Pick metrics in the box above: each gets its own chart here")
    from plotly.subplots import make_subplots

    names = list(metrics)
    figure = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.3 / len(names))
    layout = base_figure(title, height=60 + 200 * len(names)).layout
    figure.update_layout(
        {key: layout[key] for key in ("template", "title", "height", "margin", "hovermode", "font", "uirevision")},
        showlegend=False,
    )
    for row, name in enumerate(names, start=1):
        steps, values = _xy(metrics[name])
        window = options.window(len(values))
        color = series_color(row - 1)
        smoothed = window > 1 and len(values) > 1
        raw = {"opacity": 0.35, "line": {"color": color, "width": 1}} if smoothed else {"line": {"color": color}}
        figure.add_scatter(x=steps, y=values, name=f"{name} per step", row=row, col=1, **raw)
        if smoothed:
            mean = rolling_mean(values, window)
            label = f"{name}, rolling mean ({window} steps)"
            figure.add_scatter(x=steps, y=mean, name=label, row=row, col=1, line={"color": color, "width": 2})
        figure.update_yaxes(title_text=name if values else f"{name}: nothing logged yet", row=row, col=1)
    figure.update_xaxes(title_text=options.x_title, row=len(names), col=1)
    figure = options.apply(figure)
    if options.x_values is not None:
        figure.update_xaxes(title_text=None)
        figure.update_xaxes(title_text=options.x_title, row=len(names), col=1)
    return figure

"""The monitor's replica figures, from the proxy's snapshots: routing outcomes, load per replica, adapter sync split.

Proxy counters are totals since the proxy started; routing shares are computed between consecutive snapshots, so
the plot shows how routing behaves now rather than a lifetime average.
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Literal

import plotly.graph_objects as go

from app.charts.style import COLORS, base_figure, elapsed_axis, empty_figure, series_color

if TYPE_CHECKING:
    from jobs.proxy.stats import LatencySummary, ProxySnapshot

# The routing outcomes charted, each a counter of the snapshot's `routing` (typed as its keys, so mypy checks reads).
Outcome = Literal["affinity", "followed", "unmatched", "spilled"]
NO_PROXY = "Appears when the proxy publishes its first snapshot<br>(every 10 s once the trainer is up)"


def routing_figure(snapshots: list[ProxySnapshot]) -> go.Figure:
    title = "Routing: where each completion request went"
    points = [s for s in snapshots if s.get("routing")]
    if len(points) < 2:
        return empty_figure(title, NO_PROXY if not points else "Routing shares appear with the second snapshot")
    start = points[0].get("started") or points[0]["time"]
    elapsed: list[float] = []
    shares: dict[Outcome, list[float]] = {"affinity": [], "followed": [], "unmatched": [], "spilled": []}
    for before, after in pairwise(points):
        if after.get("started") != before.get("started"):
            continue  # the proxy restarted: its counters restarted too
        routed = after["routing"].get("routed", 0) - before["routing"].get("routed", 0)
        if routed <= 0:
            continue
        elapsed.append(after["time"] - start)
        for key in shares:
            delta = after["routing"].get(key, 0) - before["routing"].get(key, 0)
            shares[key].append(100.0 * max(delta, 0) / routed)
    if not elapsed:
        return empty_figure(title, "No requests were routed between the snapshots yet")
    times, x_title = elapsed_axis(elapsed, "the proxy started")
    figure = base_figure(title, x_title=x_title, y_title="% of routed requests")
    labels = {
        "affinity": "prefix affinity (KV cache reuse)",
        "followed": "followed its conversation (after a weight sync)",
        "unmatched": "no cached prefix",
        "spilled": "spilled (preferred replica busy)",
    }
    for key, values in shares.items():
        figure.add_bar(x=times, y=values, name=labels[key], marker={"color": COLORS[key]})
    figure.update_layout(barmode="stack", bargap=0.08)
    figure.update_yaxes(range=[0, 100])
    return figure


def replica_load_figure(latest: ProxySnapshot | None) -> go.Figure:
    title = "Load per replica (requests routed, and in flight now)"
    replicas = (latest.get("replicas") if latest else None) or []
    if not replicas:
        return empty_figure(title, NO_PROXY)
    figure = base_figure(title, x_title="", y_title="requests routed (total)")
    roles = [r.get("role", "?") for r in replicas]
    figure.add_bar(
        x=roles,
        y=[r.get("routed", 0) for r in replicas],
        name="routed",
        marker={"color": [series_color(i) if r.get("healthy", True) else "#cbd5e1" for i, r in enumerate(replicas)]},
        text=[f"{r.get('inflight', 0)} in flight · {r.get('state', '')}" for r in replicas],
        textposition="outside",
        cliponaxis=False,
    )
    figure.update_layout(showlegend=False, hovermode="closest")
    return figure


def sync_figure(latest: ProxySnapshot | None) -> go.Figure:
    """Upload to the bucket, then broadcast to the replicas: the two halves of every adapter sync."""
    title = "Adapter sync time: upload to the bucket + broadcast to replicas"
    upload, broadcast = _window(latest, "upload"), _window(latest, "broadcast")
    if not _count(upload) and not _count(broadcast):
        return empty_figure(title, "Appears after the first adapter version is synced to the replicas")
    figure = base_figure(title, x_title="seconds", y_title="")
    rows: list[Literal["last", "p50", "p95"]] = ["last", "p50", "p95"]
    for key, window in (("upload", upload), ("broadcast", broadcast)):
        values = [(window.get(row) if window else None) or 0.0 for row in rows]
        figure.add_bar(
            y=rows,
            x=values,
            name=key,
            orientation="h",
            marker={"color": COLORS[key]},
            text=[f"{v:.2f}s" for v in values],
            textposition="inside",
        )
    count = max(_count(upload), _count(broadcast))
    figure.update_layout(
        barmode="stack",
        hovermode="closest",
        title={"text": f"{title} ({count} syncs)"},
        uniformtext={"minsize": 10, "mode": "hide"},
    )
    figure.update_yaxes(autorange="reversed")
    return figure


def _window(latest: ProxySnapshot | None, half: Literal["upload", "broadcast"]) -> LatencySummary | None:
    """One half of the snapshot's sync times; None where it holds none (no snapshot yet, or nothing synced)."""
    windows = latest.get("sync_s") if latest else None
    return windows.get(half) if windows else None


def _count(window: LatencySummary | None) -> int:
    return (window.get("count") if window else None) or 0

"""UI figures: time from page open to the monitor's first paint, and the server time of a monitor refresh tick.

A synthetic 10,000-step run is written into a fresh panel database through the poller's own ingest functions
(`backend.ingestion.ingest`): every step logs TRL's metric names, 16 rollout samples, and every 10th step a proxy
snapshot.
Then:

1. tick cost — the monitor's refresh handler is called in-process, as Gradio calls it on every `gr.Timer` tick: once
   per sub-tab with a full redraw (new data arrived), and idle (nothing new: figures skipped);
2. first paint — the real panel (`python -m app`) is started on that database, and headless Chromium opens the page,
   clicks Monitor and waits until the reward figure holds data; median of several fresh page loads.

    .venv/bin/python bench/ui_bench.py [--steps 10000] [--loads 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT_ROOT))

from backend.context import PanelContext  # noqa: E402
from backend.database.connection import Database  # noqa: E402
from backend.ingestion import ingest  # noqa: E402
from backend.services.runs import RunService  # noqa: E402
from jobs.demo.preset import demo_spec  # noqa: E402
from jobs.ports import free_port  # noqa: E402
from tests.support.net import wait_http  # noqa: E402

OWNER = "local"
RUN_ID = "bench-run"
SAMPLES_PER_STEP = 16
CHUNK_STEPS = 100
METRICS = (
    "reward", "reward_std", "rewards/digit_frac", "loss", "grad_norm", "learning_rate", "ratio", "kl", "entropy",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "perf/step_s", "perf/fwd_bwd_s",
    "perf/fwd_s", "perf/optimizer_s", "perf/rollout_wait_s", "perf/weight_sync_s", "sample/rollout_queue_size",
    "sample/time_in_queue_s", "sample/staleness_mean", "sample/staleness_max", "sample/dropped_stale_total",
    "rollout/generated_tok_s", "rollout/backpressure_s", "rollout/inflight", "rollout/score_s",
    "completions/mean_length", "completions/max_length", "completions/min_length", "completions/clipped_ratio",
    "batch/samples_per_step", "batch/groups_per_step", "batch/trained_tokens_per_step",
)  # fmt: skip


def metric_record(step: int, rng: random.Random) -> dict:
    progress = step / 10_000
    record = {name: rng.random() for name in METRICS}
    record.update(
        step=step,
        time=1.7e9 + step,
        reward=0.05 + 0.7 * (1 - math.exp(-5 * progress)) + rng.gauss(0, 0.03),
        ratio=1 + rng.gauss(0, 0.004),
        kl=abs(rng.gauss(1e-4, 5e-5)),
    )
    record["rewards/digit_frac"] = record["reward"]
    return record


def sample_records(step: int, rng: random.Random) -> list[dict]:
    return [
        {
            "step": step,
            "time": 1.7e9 + step,
            "policy_version": max(step - (i % 2), 0),
            "staleness": i % 2,
            "group_id": step * 2 + i // 8,
            "prompt": "user: Write some numbers. apple",
            "completion": " ".join(str(rng.randint(0, 9)) for _ in range(12)),
            "reward": rng.random(),
            "rewards": {"digit_frac": rng.random()},
            "advantage": rng.gauss(0, 1),
        }
        for i in range(SAMPLES_PER_STEP)
    ]


def proxy_snapshot(step: int) -> dict:
    routed = step * 64
    replicas = [
        {"role": f"replica-{i}", "healthy": True, "state": "healthy", "routed": routed // 2, "inflight": 30,
         "loaded_versions": [step - 1, step]}
        for i in range(2)
    ]  # fmt: skip
    window = {"count": step, "last": 0.07, "p50": 0.06, "p95": 0.3, "max": 0.8}
    return {
        "time": 1.7e9 + step,
        "started": 1.7e9,
        "replicas": replicas,
        "routing": {"routed": routed, "affinity": int(routed * 0.8), "unmatched": int(routed * 0.19), "spilled": 0},
        "sync_s": {"upload": window, "broadcast": window, "total": window},
    }


def build_database(folder: Path, steps: int) -> tuple[PanelContext, dict[str, float]]:
    ctx = PanelContext(Database(folder / "panel.sqlite3"), folder=folder)
    spec = demo_spec(RUN_ID, f"file://{folder / 'store'}", grpo={"max_steps": steps})
    RunService(ctx, OWNER).create(spec)
    rng = random.Random(0)
    started = time.perf_counter()
    metric_rows = sample_rows = 0
    for first in range(1, steps + 1, CHUNK_STEPS):
        chunk = range(first, min(first + CHUNK_STEPS, steps + 1))
        with ctx.db.session() as session:
            metric_rows += ingest.ingest_metrics(session, RUN_ID, OWNER, [metric_record(s, rng) for s in chunk])
            records = [r for s in chunk for r in sample_records(s, rng)]
            sample_rows += ingest.ingest_samples(session, RUN_ID, OWNER, records)
            for step in chunk:
                if step % 10 == 0:
                    ingest.ingest_proxy(session, RUN_ID, OWNER, proxy_snapshot(step))
            session.commit()
    seconds = time.perf_counter() - started
    return ctx, {"metric rows": metric_rows, "sample rows": sample_rows, "ingest s": seconds}


def tick_costs(ctx: PanelContext, repeats: int) -> dict[str, float]:
    """Median server time (ms) of one monitor refresh, per sub-tab redrawn, and of an idle tick."""
    import gradio as gr

    from app.pages.monitor import SUBTABS, MonitorPage
    from app.panel import Panel

    with gr.Blocks(analytics_enabled=False):
        monitor = MonitorPage(Panel(ctx, space=False))
        monitor.build()
    costs = {}
    for subtab in SUBTABS:
        times, drawn = [], {}
        for _ in range(repeats):
            started = time.perf_counter()
            outputs = monitor.refresh(RUN_ID, subtab, {}, None, True, "", "", "", "", False)
            times.append((time.perf_counter() - started) * 1000)
            drawn = outputs[monitor.drawn]
        costs[f"redraw {subtab}"] = statistics.median(times)
        idle = []
        for _ in range(repeats):
            started = time.perf_counter()
            monitor.refresh(RUN_ID, subtab, drawn, None, True, "", "", "", "", False)
            idle.append((time.perf_counter() - started) * 1000)
        costs[f"idle {subtab}"] = statistics.median(idle)
    return costs


def first_paint(folder: Path, loads: int) -> dict[str, float]:
    """Median seconds from page.goto to the reward figure drawn with data (real app, real Chromium)."""
    from playwright.sync_api import sync_playwright

    port = free_port()
    env = {**os.environ, "GRPO_PANEL_DATA": str(folder), "GRADIO_SERVER_PORT": str(port),
           "GRADIO_ANALYTICS_ENABLED": "False", "NO_PROXY": "127.0.0.1,localhost"}  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "app"], cwd=PROJECT_ROOT, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/"
    loaded, painted = [], []
    try:
        wait_http(url, timeout=120)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", headless=True)
            for _ in range(loads):
                context = browser.new_context(viewport={"width": 1400, "height": 1000})
                page = context.new_page()
                page.set_default_timeout(120_000)
                started = time.perf_counter()
                page.goto(url)
                tab = page.get_by_role("tab", name="Monitor", exact=True)
                tab.wait_for()
                loaded.append(time.perf_counter() - started)
                tab.click()
                page.wait_for_function(
                    "() => { const g = document.querySelector('#reward-plot .js-plotly-plot');"
                    " return g && g.data && g.data.length && g.data[0].x && g.data[0].x.length > 0 }"
                )
                painted.append(time.perf_counter() - started)
                context.close()
            browser.close()
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    return {"page usable s": statistics.median(loaded), "monitor first paint s": statistics.median(painted)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ui-bench-") as name:
        folder = Path(name)
        ctx, sizes = build_database(folder, args.steps)
        print(json.dumps({"run": RUN_ID, "steps": args.steps, **sizes}, indent=None))
        costs = tick_costs(ctx, args.repeats)
        print("monitor refresh, server time per tick (median ms):")
        for name, value in costs.items():
            print(f"  {name:<18} {value:8.1f}")
        ctx.db.close()
        paint = first_paint(folder, args.loads)
        print(f"page open -> tabs usable:           {paint['page usable s']:.2f} s (median of {args.loads})")
        print(f"page open -> monitor reward painted: {paint['monitor first paint s']:.2f} s (median of {args.loads})")


if __name__ == "__main__":
    main()

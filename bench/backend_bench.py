"""Backend figures: SQLite ingest rate, plot and sample-page query times, poller lag.

    .venv/bin/python bench/backend_bench.py [--samples 1000000] [--points 100000]

Ingest goes through the poller's own ingest functions (backend/ingestion/ingest.py) in chunks as the trainer writes
them; the queries are the ones the UI makes (backend/services/queries.py). Each figure is printed next to its target.
The
"baseline" columns time the naive alternative in the same run (one INSERT per row; an unindexed scan), so the ratios
stay meaningful on a noisy machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import text
from sqlmodel import select

from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.models import MetricPoint, Run
from backend.ingestion import ingest
from backend.ingestion.poller import Poller
from backend.services.queries import QueryService
from jobs.demo.preset import demo_spec
from jobs.store import LocalStore
from jobs.telemetry import ChunkWriter

CHUNK = 512  # samples per chunk (a busy trainer writes a few hundred every 3 s)


def sample_record(step: int, rng: random.Random) -> dict:
    return {
        "step": step,
        "policy_version": step,
        "staleness": 1,
        "group_id": step * 16 + rng.randrange(16),
        "prompt": "user: Write some numbers. apple",
        "completion": "12 apples and 3 pears " * 3,
        "reward": rng.random(),
        "rewards": {"digit_frac": rng.random()},
        "advantage": rng.gauss(0, 1),
        "attempt": 1,
        "time": time.time(),
    }


def add_run(ctx: PanelContext, run_id: str, store_root: Path) -> None:
    spec = demo_spec(run_id, f"file://{store_root}")
    with ctx.db.session() as session:
        session.add(
            Run(
                id=run_id,
                owner="bench",
                spec_json=spec.to_json(),
                storage_uri=spec.storage.uri,
                backend="local",
                status="running",
                created_at=time.time(),
                max_steps=100_000,
            )
        )
        session.commit()


def timed(fn, repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--points", type=int, default=100_000)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        ctx = PanelContext(Database(root / "panel.sqlite3"), root)
        add_run(ctx, "bench-run", root / "store")

        # Ingest: samples in chunks, as the poller does (one executemany + commit per chunk).
        records = [sample_record(i // 64, rng) for i in range(args.samples)]
        start = time.perf_counter()
        for offset in range(0, len(records), CHUNK):
            with ctx.db.session() as session:
                ingest.ingest_samples(session, "bench-run", "bench", records[offset : offset + CHUNK])
                session.commit()
        ingest_s = time.perf_counter() - start
        sample_rate = args.samples / ingest_s
        # Baseline: one INSERT per row and a commit per row (what a naive poller would do), on 5,000 rows.
        baseline_rows = records[:5000]
        start = time.perf_counter()
        for record in baseline_rows:
            with ctx.db.session() as session:
                ingest.ingest_samples(session, "bench-run", "bench", [record])
                session.commit()
        baseline_rate = len(baseline_rows) / (time.perf_counter() - start)

        # Metric points: one series of `points` steps plus 60 other names on a tenth of the steps.
        metric_records = [
            {"step": s, "reward": rng.random(), **({f"m{k}": 1.0 for k in range(60)} if s % 10 == 0 else {})}
            for s in range(args.points)
        ]
        start = time.perf_counter()
        for offset in range(0, len(metric_records), 200):
            with ctx.db.session() as session:
                ingest.ingest_metrics(session, "bench-run", "bench", metric_records[offset : offset + 200])
                session.commit()
        with ctx.db.session() as session:
            point_count = session.exec(select(MetricPoint.id).order_by(MetricPoint.id.desc())).first()
        point_rate = point_count / (time.perf_counter() - start)

        queries = QueryService(ctx, "bench")
        plot_s = timed(lambda: queries.metric_series("bench-run", "reward"))
        plot_full_s = timed(lambda: queries.metric_series("bench-run", "reward", max_points=None), repeat=3)
        page_s = timed(lambda: queries.samples("bench-run", step_from=7000, step_to=7100, limit=50, offset=50))
        filtered_s = timed(lambda: queries.samples("bench-run", min_reward=0.9, limit=50))
        with ctx.db.engine.connect() as connection:
            unindexed_s = timed(
                lambda: connection.execute(
                    text(
                        "SELECT * FROM rolloutsample NOT INDEXED WHERE run_id='bench-run' "
                        "AND step BETWEEN 7000 AND 7100 "
                        "LIMIT 50 OFFSET 50"
                    )
                ).fetchall(),
                repeat=3,
            )

        # Poller lag: a chunk written to the store until its rows are visible, polling every 0.5 s.
        store = LocalStore(root / "store")
        add_run(ctx, "lag-run", root / "store")
        poller = Poller(ctx, interval=0.5).start()
        writer = ChunkWriter(store, "lag-run", "metrics")
        lags = []
        for step in range(20):
            writer.add({"step": step, "reward": 0.5})
            written = time.perf_counter()
            writer.flush()
            while True:
                with ctx.db.session() as session:
                    if session.exec(
                        select(MetricPoint.id).where(MetricPoint.run_id == "lag-run", MetricPoint.step == step)
                    ).first():
                        break
                time.sleep(0.01)
            lags.append(time.perf_counter() - written)
        poller.stop()

    print(
        f"samples ingested: {args.samples:,} in {ingest_s:.1f}s = {sample_rate:,.0f} samples/s (target >= 20,000); "
        f"row-at-a-time baseline {baseline_rate:,.0f}/s (x{sample_rate / baseline_rate:.0f})"
    )
    print(f"metric points ingested: {point_count:,} = {point_rate:,.0f} points/s")
    print(
        f"plot query, {args.points:,}-point series downsampled to ~2,000: {plot_s * 1000:.1f} ms (target <= 200 ms); "
        f"full series {plot_full_s * 1000:.0f} ms"
    )
    print(
        f"samples page (50 of {args.samples:,}, step range): {page_s * 1000:.2f} ms (target <= 50 ms); "
        f"reward filter {filtered_s * 1000:.2f} ms; unindexed baseline {unindexed_s * 1000:.0f} ms"
    )
    print(
        f"poller lag chunk->row at 0.5 s polling: p50 {statistics.median(lags) * 1000:.0f} ms, "
        f"max {max(lags) * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()

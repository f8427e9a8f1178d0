"""The poller ingests telemetry exactly once, across restarts and failures, and derives run status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func
from sqlmodel import select

from backend import ingest
from backend.context import PanelContext
from backend.db import Database
from backend.models import AdapterVersion, Event, Job, MetricPoint, ReplicaStatus, RolloutSample, Run
from backend.poller import Poller
from jobs.contract import layout
from jobs.demo.preset import demo_spec
from jobs.runtime import write_status
from jobs.store import LocalStore, publish_directory
from jobs.telemetry import ChunkWriter
from tests.support.waiting import wait_until


@pytest.fixture
def panel(tmp_path):
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    yield ctx
    ctx.db.close()


def add_run(ctx: PanelContext, store_root, run_id: str = "run-p", owner: str = "alice") -> Run:
    spec = demo_spec(run_id, f"file://{store_root}")
    run = Run(
        id=run_id,
        owner=owner,
        spec_json=spec.to_json(),
        storage_uri=spec.storage.uri,
        backend="local",
        status="running",
        created_at=time.time(),
        max_steps=spec.grpo.max_steps,
    )
    with ctx.db.session() as session:
        session.add(run)
        session.commit()
    return run


def write_steps(store, run_id: str, steps: range, attempt: int = 1) -> None:
    metrics = ChunkWriter(store, run_id, "metrics")
    samples = ChunkWriter(store, run_id, "samples")
    for step in steps:
        metrics.add({"step": step, "time": time.time(), "attempt": attempt, "reward": step / 100, "ratio": 1.0})
        for index in range(4):
            samples.add(
                {
                    "step": step,
                    "policy_version": step,
                    "staleness": 0,
                    "group_id": step,
                    "prompt": "p",
                    "completion": f"c{index}",
                    "reward": index / 4,
                    "rewards": {"digit_frac": index / 4},
                    "advantage": 0.1,
                    "attempt": attempt,
                }
            )
        metrics.flush()
        samples.flush()


def counts(ctx: PanelContext, run_id: str) -> tuple[int, int]:
    with ctx.db.session() as session:
        metrics = session.exec(select(func.count()).where(MetricPoint.run_id == run_id)).one()
        samples = session.exec(select(func.count()).where(RolloutSample.run_id == run_id)).one()
    return metrics, samples


def test_ingests_every_chunk_once_and_a_restarted_poller_adds_nothing(panel, tmp_path):
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    write_steps(store, "run-p", range(1, 11))
    assert Poller(panel).poll_run("run-p") == 20
    assert counts(panel, "run-p") == (20, 40)
    # A new panel process on the same database (the old one was killed): nothing is read twice.
    restarted = PanelContext(Database(panel.db.path), tmp_path)
    assert Poller(restarted).poll_run("run-p") == 0
    write_steps(store, "run-p", range(11, 16))
    Poller(restarted).poll_run("run-p")
    assert counts(restarted, "run-p") == (30, 60)


def test_a_failure_mid_ingest_loses_and_duplicates_nothing(panel, tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    write_steps(store, "run-p", range(1, 7))
    original, calls = ingest.ingest_samples, {"n": 0}

    def flaky(session, run_id, owner, records):
        calls["n"] += 1
        original(session, run_id, owner, records)  # rows are written, then the process "dies" before commit
        if calls["n"] == 3:
            raise RuntimeError("killed mid-chunk")

    monkeypatch.setitem(__import__("backend.poller").poller.STREAM_INGESTERS, "samples", flaky)
    with pytest.raises(RuntimeError):
        Poller(panel).poll_run("run-p")
    monkeypatch.setitem(__import__("backend.poller").poller.STREAM_INGESTERS, "samples", original)
    Poller(panel).poll_run("run-p")
    assert counts(panel, "run-p") == (12, 24)


@pytest.mark.parametrize("chunks_per_pass", [200, 1], ids=["one pass", "a pass per chunk"])
def test_a_resume_supersedes_what_the_lost_attempt_logged_past_the_checkpoint(panel, tmp_path, chunks_per_pass):
    """Read in one pass or chunk by chunk (a long backlog), the resume event arrives before some of the lost
    attempt's later chunks: those are dropped on arrival, not only the ones already ingested."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    write_steps(store, "run-p", range(1, 9), attempt=1)  # attempt 1 got to step 8, its checkpoint was at step 5
    events = ChunkWriter(store, "run-p", "events")
    events.add({"kind": "resume", "attempt": 2, "resumed_from_step": 5, "message": "resumed", "time": time.time()})
    events.flush()
    write_steps(store, "run-p", range(6, 10), attempt=2)
    poller = Poller(panel, chunks_per_pass=chunks_per_pass)
    passes = 1
    while poller.poll_run("run-p"):
        passes += 1
    assert passes == (2 if chunks_per_pass == 200 else 13)  # 12 metric chunks, one per pass, then an empty pass
    with panel.db.session() as session:
        steps = session.exec(
            select(MetricPoint.step, MetricPoint.attempt)
            .where(MetricPoint.run_id == "run-p", MetricPoint.name == "reward")
            .order_by(MetricPoint.step)
        ).all()
    assert steps == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 2), (7, 2), (8, 2), (9, 2)]


def test_versions_audits_heartbeats_and_status(panel, tmp_path):
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"x" * 100)
    write_steps(store, "run-p", range(1, 5))
    publish_directory(store, layout.adapter_prefix("run-p", 1), adapter, {"version": 1, "step": 4})
    store.put_bytes(layout.adapter_prefix("run-p", 2) + "adapter_model.safetensors", b"half")  # unpublished
    store.put_bytes(layout.current_key("run-p"), b"1")
    store.put_bytes(
        layout.audit_key("run-p", 1),
        json.dumps({"version": 1, "ok": True, "replicas": {"replica-0": {"max_abs_diff": 2e-6}}}).encode(),
    )
    write_status(store, "run-p", "replica-0", {"engine": "cpu", "loaded_adapters": ["run-p-v1"]})
    write_status(store, "run-p", "trainer", {"phase": "training", "step": 4})
    poller = Poller(panel)
    poller.poll_run("run-p")
    with panel.db.session() as session:
        versions = session.exec(select(AdapterVersion)).all()
        run = session.get(Run, "run-p")
        roles = set(session.exec(select(ReplicaStatus.role)).all())
    assert [(v.version, v.step, v.audit_ok, v.audit_max_diff) for v in versions] == [(1, 4, True, 2e-6)]
    assert versions[0].reward == pytest.approx((0.01 + 0.02 + 0.03 + 0.04) / 4)
    assert (run.status, run.step, run.current_version, run.best_version) == ("running", 4, 1, 1)
    assert roles == {"replica-0", "trainer"}
    write_status(store, "run-p", "trainer", {"phase": "failed", "step": 4, "last_error": "ValueError: boom"})
    poller.poll_run("run-p")
    with panel.db.session() as session:
        run = session.get(Run, "run-p")
    assert (run.status, run.status_message) == ("failed", "ValueError: boom")


def test_stall_and_ratio_alerts(panel, tmp_path):
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    writer = ChunkWriter(store, "run-p", "metrics")
    for step in range(1, 7):
        writer.add({"step": step, "ratio": 1.2, "reward": 0.1})
    writer.flush()
    write_status(store, "run-p", "trainer", {"phase": "training", "step": 6})
    poller = Poller(panel, stall_after=0.2)
    poller.poll_run("run-p")
    time.sleep(0.3)
    poller.poll_run("run-p")
    with panel.db.session() as session:
        active = {e.kind: e.level for e in session.exec(select(Event).where(Event.active)).all()}
        status = session.get(Run, "run-p").status
    assert status == "stalled"
    assert active.get("ratio_drift") == "warning" and active.get("stalled") == "warning"


def test_a_broken_store_backs_off_that_run_only(panel, tmp_path):
    add_run(panel, tmp_path / "good", "run-good")
    add_run(panel, tmp_path / "bad", "run-bad")
    write_steps(LocalStore(tmp_path / "good"), "run-good", range(1, 3))
    (tmp_path / "bad").write_text("a file where the store folder should be")  # the bad run's store cannot open
    poller = Poller(panel)
    poller.poll_once()
    assert counts(panel, "run-good") == (4, 8)
    assert "run-bad" in poller._backoff


def test_a_run_over_its_cost_cap_is_stopped_gracefully(panel, tmp_path):
    from jobs.contract.control import STOP

    store = LocalStore(tmp_path / "store")
    spec = demo_spec("run-cap", f"file://{tmp_path / 'store'}", compute={"cost_cap_usd": 5.0})
    now = time.time()
    with panel.db.session() as session:
        session.add(
            Run(
                id="run-cap",
                owner="alice",
                spec_json=spec.to_json(),
                storage_uri=spec.storage.uri,
                backend="local",
                status="running",
                created_at=now,
            )
        )
        session.commit()
        # An hour of a $10/hour job: $10 spent, over the $5 cap.
        session.add(
            Job(
                run_id="run-cap",
                owner="alice",
                role="replica-0",
                stage="completed",
                price_per_hour=10.0,
                started_at=now - 3600,
                finished_at=now,
            )
        )
        session.commit()
    write_status(store, "run-cap", "trainer", {"phase": "training", "step": 3})
    Poller(panel).poll_run("run-cap")
    with panel.db.session() as session:
        run = session.get(Run, "run-cap")
        kinds = [e.kind for e in session.exec(select(Event).where(Event.run_id == "run-cap")).all()]
    assert run.status == "stopping" and "cost cap reached: $10.00 of $5.00" in run.status_message
    assert "cost cap reached" in store.get_bytes(layout.control_key("run-cap", STOP)).decode()
    assert "cost_cap" in kinds


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_poll_command_stops_cleanly_on_a_signal_even_started_in_the_background(tmp_path, signum):
    """`python -m backend poll` ends with 0 on Ctrl-C or a service manager's SIGTERM, even when its shell started it
    with SIGINT ignored (what a non-interactive shell does to background jobs)."""
    panel = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    add_run(panel, tmp_path / "store")
    write_steps(LocalStore(tmp_path / "store"), "run-p", range(1, 3))
    command = [sys.executable, "-m", "backend", "poll", "--interval", "0.2"]
    process = subprocess.Popen(
        command,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "GRPO_PANEL_DATA": str(tmp_path)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        wait_until(lambda: counts(panel, "run-p") == (4, 8), 60, what="the poll command ingesting (it is polling)")
        process.send_signal(signum)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        panel.db.close()

"""The poller ingests telemetry exactly once, across restarts and failures, and derives run status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func
from sqlmodel import select

from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.models import (
    AdapterVersion,
    Event,
    Job,
    MetricPoint,
    ProxySnapshot,
    ReplicaStatus,
    RolloutSample,
    Run,
)
from backend.ingestion import ingest, streams
from backend.ingestion.poller import Poller
from backend.launchers.base import JobState
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

    monkeypatch.setitem(streams.STREAM_INGESTERS, "samples", flaky)
    with pytest.raises(RuntimeError):
        Poller(panel).poll_run("run-p")
    monkeypatch.setitem(streams.STREAM_INGESTERS, "samples", original)
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


def test_stall_and_kl_drift_alerts(panel, tmp_path):
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    writer = ChunkWriter(store, "run-p", "metrics")
    for step in range(1, 7):
        writer.add({"step": step, "ratio": 1.0, "kl": 0.8, "reward": 0.1})  # ratio 1.0: drift shows in kl only
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
    assert active == {"kl_drift": "warning", "stalled": "warning"}


def test_a_ratio_off_one_with_a_small_kl_raises_no_drift_alert(panel, tmp_path):
    """The mean ratio wanders with the batch (the demo's moves by ±0.05); only kl says the policies differ."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    writer = ChunkWriter(store, "run-p", "metrics")
    for step in range(1, 7):
        writer.add({"step": step, "ratio": 1.2, "kl": 0.01, "reward": 0.1})
    writer.flush()
    write_status(store, "run-p", "trainer", {"phase": "training", "step": 6})
    Poller(panel).poll_run("run-p")
    with panel.db.session() as session:
        kinds = {e.kind for e in session.exec(select(Event).where(Event.active)).all()}
    assert "kl_drift" not in kinds, kinds  # the test above is its positive control


def test_an_alert_keeps_its_history_through_raise_clear_dismiss_and_a_raise_again(panel, tmp_path):
    """Issue 18, item 5: an alert is listed with the step it was raised at and when it cleared after the banner has
    dropped it; a dismissed one leaves the banner, stays listed as dismissed, and is not raised again while its
    condition lasts; once the condition ends and comes back, it is raised anew."""
    from backend.services.queries import QueryService
    from backend.services.runs import RunService

    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    writer = ChunkWriter(store, "run-p", "metrics")
    poller = Poller(panel)
    queries, runs = QueryService(panel, "alice"), RunService(panel, "alice")

    def steps(first: int, last: int, kl: float) -> None:
        for step in range(first, last + 1):
            writer.add({"step": step, "kl": kl, "reward": 0.1})
        writer.flush()
        write_status(store, "run-p", "trainer", {"phase": "training", "step": last})
        poller.poll_run("run-p")

    def history() -> list[tuple]:
        return [
            (e.kind, e.step, e.active, e.cleared_at is not None, e.dismissed) for e in queries.alert_history("run-p")
        ]

    steps(1, 6, kl=0.8)
    assert history() == [("kl_drift", 6, True, False, False)]
    steps(7, 8, kl=0.01)
    assert history() == [("kl_drift", 6, False, True, False)] and queries.alerts("run-p") == []
    steps(9, 14, kl=0.9)
    (raised,) = queries.alerts("run-p")
    assert raised.step == 14
    runs.dismiss_alert("run-p", raised.id)
    steps(15, 16, kl=0.9)  # still drifting: dismissed, not raised again
    assert queries.alerts("run-p") == []
    assert history() == [("kl_drift", 14, False, False, True), ("kl_drift", 6, False, True, False)]
    steps(17, 17, kl=0.01)
    steps(18, 22, kl=0.9)
    assert [e.step for e in queries.alerts("run-p")] == [22]
    assert [e[1:] for e in history()] == [(22, True, False, False), (14, False, True, True), (6, False, True, False)]


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
        cwd=Path(__file__).resolve().parents[2],
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


# --- what each stream's rows hold, and how a run's status follows its jobs ------------------------------------------


def update_run(ctx: PanelContext, run_id: str, **fields) -> None:
    with ctx.db.session() as session:
        run = session.get(Run, run_id)
        for name, value in fields.items():
            setattr(run, name, value)
        session.add(run)
        session.commit()


def get_run(ctx: PanelContext, run_id: str = "run-p") -> Run:
    with ctx.db.session() as session:
        return session.get(Run, run_id)


def get_job(ctx: PanelContext, role: str, run_id: str = "run-p") -> Job:
    with ctx.db.session() as session:
        return session.exec(select(Job).where(Job.run_id == run_id, Job.role == role)).one()


def add_job(
    ctx: PanelContext,
    role: str,
    stage: str = "running",
    files: dict[str, str] | None = None,
    ended_at: float | None = None,
    run_id: str = "run-p",
    **fields,
) -> str:
    """A local job as the panel last saw it (a Job row) and as its launcher folder shows it now (`files`: `pgid`,
    `started`, `exit`, `canceled`, `log`...; `ended_at` the time the `exit`/`canceled` file was written).

    Jobs that ended are given no `pgid`: whatever the code under test does, it cannot signal a real process group."""
    job_id = f"{role}-{fields.get('attempt', 1):08x}"
    folder = ctx.local_launcher.workdir / run_id / job_id
    folder.mkdir(parents=True)
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
        if ended_at is not None and name in ("exit", "canceled"):
            os.utime(folder / name, (ended_at, ended_at))
    with ctx.db.session() as session:
        session.add(Job(run_id=run_id, owner="alice", role=role, backend_job_id=job_id, stage=stage, **fields))
        session.commit()
    return job_id


def put_proxy_snapshot(store, run_id: str, seq: int, snapshot: dict) -> None:
    store.put_bytes(layout.telemetry_key(run_id, "proxy", seq), json.dumps(snapshot).encode())


def publish_version(store, tmp_path, run_id: str, version: int, step: int):
    adapter = tmp_path / f"adapter-{version}"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"x" * (100 + version))
    return publish_directory(store, layout.adapter_prefix(run_id, version), adapter, {"version": version, "step": step})


@pytest.fixture
def live_group():
    """Start a process in its own process group (what a local job's group leader is); killed at teardown."""
    processes = []

    def start() -> int:
        process = subprocess.Popen(["sleep", "60"], start_new_session=True)
        threading.Thread(target=process.wait, daemon=True).start()  # reaped at once: its group ends when it does
        processes.append(process)
        return process.pid

    yield start
    for process in processes:
        if process.returncode is None:
            process.kill()


def test_an_event_keeps_its_own_time_level_kind_and_message(panel, tmp_path):
    """Events are the run's history: when it happened (the writer's clock, not when the panel read it), how bad,
    what. An event without a level is "info"; only an error stays active (a banner until someone clears it)."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    events = ChunkWriter(store, "run-p", "events")
    events.add({"time": 1700000001.5, "level": "warning", "kind": "reward_error", "message": "reward raised"})
    events.add({"time": 1700000002.5, "level": "error", "kind": "publish", "message": "could not publish v3"})
    events.add({"time": 1700000003.5, "kind": "checkpoint", "message": "saved step 10"})
    events.flush()
    Poller(panel).poll_run("run-p")
    with panel.db.session() as session:
        rows = session.exec(
            select(Event.time, Event.level, Event.kind, Event.message, Event.active)
            .where(Event.run_id == "run-p", Event.kind.in_(("reward_error", "publish", "checkpoint")))
            .order_by(Event.time)
        ).all()
    assert rows == [
        (1700000001.5, "warning", "reward_error", "reward raised", False),
        (1700000002.5, "error", "publish", "could not publish v3", True),
        (1700000003.5, "info", "checkpoint", "saved step 10", False),
    ]


def test_the_latest_proxy_snapshot_is_the_last_one_ingested_and_keeps_its_own_time(panel, tmp_path):
    """Snapshots are ordered by ingestion (the chunks' sequence), not by the time inside: a relaunched trainer's proxy
    may run its clock behind the dead one's. Each keeps the time its proxy wrote."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    put_proxy_snapshot(store, "run-p", 0, {"time": 1700000100.0, "replicas": [{"role": "replica-0", "healthy": True}]})
    later = {"time": 1700000050.0, "replicas": [{"role": "replica-0", "healthy": True, "routed": 7}]}
    put_proxy_snapshot(store, "run-p", 1, later)
    Poller(panel).poll_run("run-p")
    with panel.db.session() as session:
        times = session.exec(select(ProxySnapshot.time).order_by(ProxySnapshot.id)).all()
        latest = ingest.latest_proxy_snapshots(session, "run-p")
    assert times == [1700000100.0, 1700000050.0]
    assert latest == [later]


def test_samples_and_metrics_are_stored_field_for_field(panel, tmp_path):
    """What the sample and chart pages show is what the trainer wrote: prompt, reward and its per-function breakdown,
    advantage (0.0 is a real advantage, and the default when the trainer had none), time and attempt."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    samples = ChunkWriter(store, "run-p", "samples")
    samples.add(
        {
            "step": 3,
            "time": 1700000003.25,
            "attempt": 2,
            "policy_version": 2,
            "staleness": 1,
            "dropped": True,
            "group_id": 7,
            "prompt": "What is 2+2?",
            "completion": "4",
            "reward": 0.75,
            "rewards": {"correct": 1.0, "format": 0.5},
            "advantage": 0.0,
        }
    )
    samples.add({"step": 4, "prompt": "p", "completion": "c", "reward": None, "advantage": None})
    samples.flush()
    metrics = ChunkWriter(store, "run-p", "metrics")
    metrics.add({"step": 3, "time": 1700000003.5, "attempt": 2, "reward": 0.75})
    metrics.add({"step": 4, "loss": 0.5})
    metrics.flush()
    Poller(panel).poll_run("run-p")
    columns = (RolloutSample.step, RolloutSample.policy_version, RolloutSample.staleness, RolloutSample.group_id)
    columns += (RolloutSample.prompt, RolloutSample.completion, RolloutSample.reward, RolloutSample.rewards_json)
    columns += (RolloutSample.advantage, RolloutSample.dropped, RolloutSample.time, RolloutSample.attempt)
    with panel.db.session() as session:
        sample_rows = session.exec(select(*columns).order_by(RolloutSample.step)).all()
        metric_rows = session.exec(
            select(MetricPoint.step, MetricPoint.name, MetricPoint.value, MetricPoint.time, MetricPoint.attempt)
            .where(MetricPoint.run_id == "run-p")
            .order_by(MetricPoint.step)
        ).all()
    assert [(*row[:7], json.loads(row[7]), *row[8:]) for row in sample_rows] == [
        (3, 2, 1, 7, "What is 2+2?", "4", 0.75, {"correct": 1.0, "format": 0.5}, 0.0, True, 1700000003.25, 2),
        (4, 0, 0, 0, "p", "c", None, {}, 0.0, False, None, 1),
    ]
    assert metric_rows == [(3, "reward", 0.75, 1700000003.5, 2), (4, "loss", 0.5, None, 1)]


def test_latest_reward_is_the_newest_reward_logged_not_the_newest_metric(panel, tmp_path):
    """The run list's reward is the reward metric of the latest step that logged one: not another metric, and kept
    when the latest step logged no reward."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    metrics = ChunkWriter(store, "run-p", "metrics")
    metrics.add({"step": 1, "reward": 0.25, "loss": 2.0})
    metrics.add({"step": 2, "reward": 0.5, "loss": 1.5})
    metrics.add({"step": 3, "loss": 1.0})
    metrics.flush()
    Poller(panel).poll_run("run-p")
    run = get_run(panel)
    assert (run.step, run.latest_reward) == (3, 0.5)


@pytest.mark.parametrize(
    ("run_status", "exit_code", "stage", "status"),
    [("running", 1, "error", "failed"), ("stopping", 0, "completed", "stopped")],
    ids=["crashed while running", "exited after a stop"],
)
def test_a_trainer_job_that_ended_ends_the_run_and_its_row_follows_the_launcher(
    panel, tmp_path, run_status, exit_code, stage, status
):
    """The trainer's process ended without writing a final phase (a crash, or a stop that killed it first): the run
    failed, unless a stop was asked, then it is stopped. The job's row copies the launcher's stage, message, log tail
    and times, and the run's message ends with the log's last line."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    update_run(panel, "run-p", status=run_status, stop_requested_at=time.time() if run_status == "stopping" else None)
    log_lines = [f"line {index}" for index in range(29)] + ["ValueError: boom"]
    files = {"started": "1700000000.0", "exit": str(exit_code), "log": "\n".join(log_lines) + "\n"}
    add_job(panel, "trainer", files=files, ended_at=1700000600.0)
    write_status(store, "run-p", "trainer", {"phase": "training", "step": 3})
    Poller(panel).poll_run("run-p")
    job, run = get_job(panel, "trainer"), get_run(panel)
    assert (job.stage, job.message, job.log_tail) == (stage, f"exit code {exit_code}", "\n".join(log_lines[-20:]))
    assert (job.started_at, job.finished_at) == (1700000000.0, 1700000600.0)
    assert run.status == status and run.finished_at is not None
    assert run.status_message == f"the trainer job ended ({stage}: exit code {exit_code}) ValueError: boom"


def test_a_trainer_that_finishes_during_a_pass_finishes_the_run(panel, tmp_path, monkeypatch):
    """The trainer writes its final status, then its job ends. A pass that reads the store before seeing the job end
    must not call the run failed: the job's end is observed first, so the final status is already there to read."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    add_job(panel, "trainer", files={"started": "1700000000.0"})
    write_status(store, "run-p", "trainer", {"phase": "training", "step": 7})
    state = panel.local_launcher.state

    def finishes_now(job):  # the trainer's last act, then its exit, at the moment the poller asks about the job
        write_status(store, "run-p", "trainer", {"phase": "finished", "step": 8})
        (panel.local_launcher.workdir / "run-p" / job.job_id / "exit").write_text("0")
        return state(job)

    monkeypatch.setattr(panel.local_launcher, "state", finishes_now)
    Poller(panel).poll_run("run-p")
    run = get_run(panel)
    assert get_job(panel, "trainer").stage == "completed"
    assert (run.status, run.status_message) == ("finished", "finished at step 8")


def test_a_running_jobs_row_has_no_finish_time_whatever_the_launcher_reports(panel, tmp_path, monkeypatch):
    """`finished_at` is copied only for a job that ended: a finish time reported beside a running stage would stop
    the job's cost at that time while it still bills."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    add_job(panel, "replica-0", stage="scheduling", price_per_hour=2.0)
    monkeypatch.setattr(panel.local_launcher, "state", lambda job: JobState("running", "", 1700000000.0, 1700000600.0))
    monkeypatch.setattr(panel.local_launcher, "logs", lambda job, tail=50: ["serving"])
    write_status(store, "run-p", "trainer", {"phase": "training", "step": 3})
    Poller(panel).poll_run("run-p")
    job = get_job(panel, "replica-0")
    assert (job.stage, job.log_tail, job.started_at, job.finished_at) == ("running", "serving", 1700000000.0, None)


@pytest.mark.parametrize(
    ("files", "stage"),
    [({"exit": "1"}, "error"), ({"exit": "0"}, "completed"), ({"canceled": "0", "exit": "143"}, "canceled")],
    ids=["error", "completed", "canceled"],
)
def test_a_replica_job_that_ended_degrades_a_training_run(panel, tmp_path, files, stage):
    """Training goes on with the other replicas, but the run is degraded, whichever way the replica's job ended."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    add_job(panel, "replica-0", files={"started": "1700000000.0", **files}, ended_at=1700000600.0)
    write_status(store, "run-p", "trainer", {"phase": "training", "step": 3})
    Poller(panel).poll_run("run-p")
    run = get_run(panel)
    assert get_job(panel, "replica-0").stage == stage
    assert (run.status, run.status_message) == ("degraded", "a replica job ended; training continues on the others")


def test_an_unhealthy_replica_in_the_latest_proxy_snapshot_degrades_the_run_until_it_recovers(panel, tmp_path):
    """The proxy ejected a replica (its job still runs): degraded. Once the newest snapshot shows every replica
    healthy again, the run is running, whatever older snapshots said."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    write_status(store, "run-p", "trainer", {"phase": "training", "step": 3})
    healthy = {"role": "replica-0", "state": "healthy", "healthy": True}
    ejected = {"role": "replica-1", "state": "ejected", "healthy": False}
    put_proxy_snapshot(store, "run-p", 0, {"time": 1700000000.0, "replicas": [healthy, ejected]})
    poller = Poller(panel)
    poller.poll_run("run-p")
    assert get_run(panel).status == "degraded"
    put_proxy_snapshot(store, "run-p", 1, {"time": 1700000010.0, "replicas": [healthy, {**ejected, "healthy": True}]})
    poller.poll_run("run-p")
    assert get_run(panel).status == "running"


@pytest.mark.parametrize("phase", ["starting", "waiting_replicas"])
def test_a_trainer_still_starting_shows_the_run_as_launching(panel, tmp_path, phase):
    """A relaunched trainer (the run was set running again) is launching until it trains; an active run has no
    finish time."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    write_status(store, "run-p", "trainer", {"phase": phase, "step": 0})
    Poller(panel).poll_run("run-p")
    run = get_run(panel)
    assert (run.status, run.finished_at) == ("launching", None)


def test_a_trainer_past_its_last_step_shows_the_run_as_finalizing_until_it_ends(panel, tmp_path):
    """Issue 18, item 10: between the last step and the end (the final adapter published, the replicas stopped) the
    run reads `finalizing`, not `running` at 100 %, and not `degraded` while its replicas are stopped; it is still
    polled, and then finishes."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    add_job(panel, "replica-0", stage="completed", files={"started": "1700000000.0", "exit": "0"})
    write_status(store, "run-p", "trainer", {"phase": "saving", "step": 40})
    poller = Poller(panel)
    poller.poll_run("run-p")
    run = get_run(panel)
    assert (run.status, run.finished_at) == ("finalizing", None) and "final adapter" in run.status_message
    write_status(store, "run-p", "trainer", {"phase": "finished", "step": 40})
    poller.poll_once()  # a pass over the active runs: a finalizing run is one of them
    assert get_run(panel).status == "finished"


def test_a_stopping_runs_jobs_are_cancelled_only_after_the_grace_and_only_those_still_running(
    panel, tmp_path, monkeypatch, live_group
):
    """A stop gives the trainer `stop_grace` seconds to save and exit on its own; after that, what still runs is
    cancelled (jobs that already ended are left alone), the job's stage is refreshed, and the run ends stopped."""
    add_run(panel, tmp_path / "store")
    update_run(panel, "run-p", status="stopping", stop_requested_at=time.time())
    trainer = add_job(panel, "trainer", files={"pgid": str(live_group()), "started": "1700000000.0"})
    # An ended replica (cancelling it would fail loudly: its folder has no pgid).
    add_job(panel, "replica-0", stage="completed", files={"started": "1700000000.0", "exit": "0"})
    cancelled, cancel = [], panel.local_launcher.cancel
    monkeypatch.setattr(panel.local_launcher, "cancel", lambda job: (cancelled.append(job.job_id), cancel(job)))
    poller = Poller(panel, stop_grace=120.0)
    poller.poll_run("run-p")
    assert (cancelled, get_job(panel, "trainer").stage, get_run(panel).status) == ([], "running", "stopping")
    update_run(panel, "run-p", stop_requested_at=time.time() - 121.0)  # the grace is over
    poller.poll_run("run-p")
    assert (cancelled, get_job(panel, "trainer").stage) == ([trainer], "canceled")
    poller.poll_run("run-p")
    assert get_run(panel).status == "stopped"


def test_poll_once_still_polls_an_ended_run_whose_jobs_still_run(panel, tmp_path):
    """An ended run is polled as long as one of its jobs is not known to have ended, so nothing keeps billing
    unseen: here the job exited since, and its row says so."""
    add_run(panel, tmp_path / "store")
    update_run(panel, "run-p", status="finished", finished_at=time.time() - 1000)
    add_job(panel, "replica-0", files={"started": "1700000000.0", "exit": "0"}, ended_at=1700000600.0)
    Poller(panel).poll_once()
    assert get_job(panel, "replica-0").stage == "completed"


def test_a_successful_pass_clears_a_runs_backoff(panel, tmp_path):
    """A run that failed before and is polled fine again leaves the backoff: a later failure starts over at the
    shortest delay instead of doubling the old one."""
    add_run(panel, tmp_path / "store")
    poller = Poller(panel)
    poller._backoff["run-p"] = (0.0, 16.0)  # failed four times; its retry is due
    poller.poll_once()
    assert "run-p" not in poller._backoff


def test_a_priced_run_without_a_cost_cap_costs_what_its_jobs_ran_and_is_not_stopped(panel, tmp_path):
    """Cost is hours run times the hourly price (30 minutes at $2/h: $1.00); with no cap set nothing is compared."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    ran = {"price_per_hour": 2.0, "started_at": 1700000000.0, "finished_at": 1700001800.0}
    add_job(panel, "replica-0", stage="completed", **ran)  # ended, so the run is degraded: still active
    write_status(store, "run-p", "trainer", {"phase": "training", "step": 3})
    Poller(panel).poll_run("run-p")
    run = get_run(panel)
    assert (run.cost_usd, run.status) == (1.0, "degraded")


def test_a_heartbeat_keeps_the_time_it_carries(panel, tmp_path):
    """A replica's last heartbeat shows when the replica wrote it, not when the panel read it."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    write_status(store, "run-p", "replica-0", {"time": 1700000000.5, "engine": "cpu"})
    Poller(panel).poll_run("run-p")
    with panel.db.session() as session:
        heartbeat = session.exec(select(ReplicaStatus).where(ReplicaStatus.role == "replica-0")).one()
    assert (heartbeat.time, json.loads(heartbeat.data_json)["engine"]) == (1700000000.5, "cpu")


def test_a_versions_reward_is_the_mean_reward_of_the_five_steps_up_to_it(panel, tmp_path):
    """The final version is published as the trainer finishes: its reward comes from ingestion alone (an ended run's
    aliases are not re-evaluated), the mean of the reward metric (no other metric) over steps 4..8."""
    store = LocalStore(tmp_path / "store")
    add_run(panel, tmp_path / "store")
    write_steps(store, "run-p", range(1, 9))  # reward step/100, ratio 1.0
    publish_version(store, tmp_path, "run-p", 1, step=8)
    write_status(store, "run-p", "trainer", {"phase": "finished", "step": 8})
    Poller(panel).poll_run("run-p")
    with panel.db.session() as session:
        version = session.exec(select(AdapterVersion)).one()
    assert get_run(panel).status == "finished"
    assert version.reward == pytest.approx((0.04 + 0.05 + 0.06 + 0.07 + 0.08) / 5)


def test_a_manifest_that_vanishes_mid_listing_does_not_hide_the_next_version(panel, tmp_path, monkeypatch):
    """A resumed trainer republishing v1 deletes its manifest first; a poller that listed it just before skips it
    and still ingests v2, manifest and all."""
    store_root = tmp_path / "store"
    add_run(panel, store_root)

    class RepublishingStore(LocalStore):
        def list(self, prefix="", start_after=None, limit=None):
            listed = list(super().list(prefix, start_after, limit))
            if prefix == layout.adapters_prefix("run-p"):
                self.delete(layout.manifest_key(layout.adapter_prefix("run-p", 1)))
            return iter(listed)

    store = RepublishingStore(store_root)
    publish_version(store, tmp_path, "run-p", 1, step=2)
    manifest = publish_version(store, tmp_path, "run-p", 2, step=4)
    monkeypatch.setattr(panel, "store_for", lambda run: store)
    Poller(panel).poll_run("run-p")
    with panel.db.session() as session:
        versions = session.exec(select(AdapterVersion)).all()
    assert [(v.version, v.step, json.loads(v.manifest_json)) for v in versions] == [
        (2, 4, json.loads(manifest.to_json()))
    ]

"""A launch survives the panel: killed at each step of a launch through the Hub emulator, the panel leaves a run that
another panel takes over and finishes with exactly one job per role (or, stopped meanwhile, cleans up: everything it
started is cancelled); two launches of one run are refused atomically, whatever the interleaving.

The kill lands at an exact step: the emulator holds one request of the launch (`HubEmulator.hold`), the test kills
the panel process while that request waits, then releases it (a held answer then goes to a dead socket).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlmodel import select

from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.models import Job, Launch, Run
from backend.ingestion.poller import Poller
from backend.services.launches import Launches
from backend.services.runs import RunService, RunStateError, run_row
from jobs.demo.preset import demo_spec
from tests.support.hub_emulator import HubEmulator
from tests.support.hub_panel import OWNER, HubPanel, hub_panel, start_emulator
from tests.support.interleaving import Scheduler
from tests.support.runs import hub_demo_spec
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
# The panel process that gets killed: it drives one launch, renewing its lease every half second.
PANEL = """
import sys
from backend.context import PanelContext
from backend.database.connection import Database
from backend.services.launches import Launches
from backend.services.runs import RunService
Launches.stale_after_s = 3.0
folder, hub, owner, run_id = sys.argv[1:]
ctx = PanelContext(Database(folder + "/panel.sqlite3"), folder, hub_endpoint=hub)
RunService(ctx, owner).launch(run_id, wait=True)
"""

# (the step at which the panel dies, the request held there, which one, held after it was handled)
KILL_POINTS = [
    ("preparing", "hardware", 1, False),
    ("replica-0 submitted, its answer lost", "create", 1, True),
    ("between the two replicas", "create", 2, False),
    ("waiting for the replicas to be healthy", "inspect", 1, False),
    ("trainer submitted, its answer lost", "create", 3, True),
]


@pytest.fixture(scope="module")
def hub(tmp_path_factory, moto_server):
    folder = tmp_path_factory.mktemp("launch-recovery")
    with pytest.MonkeyPatch.context() as patch:  # the module's tests share the emulator and the trust in its edge
        emulator = start_emulator(folder, patch)
        panel = hub_panel(folder, emulator, moto_server)
        yield emulator, panel
        emulator.close()
        panel.ctx.db.close()


def create_run(panel: HubPanel, run_id: str, moto_url: str) -> None:
    spec = hub_demo_spec(run_id, panel.bucket, moto_url, OWNER, engine="auto")
    RunService(panel.ctx, OWNER).create(spec, panel.store_credential_id, panel.hf_credential_id)


def kill_panel_at(emulator: HubEmulator, panel: HubPanel, run_id: str, route: str, nth: int, after: bool) -> str:
    """Start a panel process launching `run_id`, kill it while the chosen request is held; the step it was at."""
    hold = emulator.hold(route, nth, after=after)
    process = subprocess.Popen(
        [sys.executable, "-c", PANEL, str(panel.ctx.folder), emulator.url, OWNER, run_id],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert hold.arrived.wait(120), f"the panel never sent {route} #{nth}"
        step = launch_of(panel.ctx, run_id).step
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    finally:
        process.kill()
        hold.release()
    return step


def launch_of(ctx: PanelContext, run_id: str) -> Launch:
    with ctx.db.session() as session:
        return session.get(Launch, run_id)


def emulated_jobs(emulator: HubEmulator, run_id: str) -> dict[str, list[str]]:
    """role -> ids of every job of the run the Hub ever created."""
    jobs: dict[str, list[str]] = {}
    for job_id, job in emulator.jobs.items():
        labels = job.spec.get("labels") or {}
        if labels.get("grpo-run") == run_id:
            jobs.setdefault(labels["grpo-role"], []).append(job_id)
    return jobs


def jobs_report(emulator: HubEmulator, run_id: str) -> str:
    """Every job of the run the Hub created, with its stage and the tail of its log: why a role got a second job."""
    lines = []
    for role, ids in sorted(emulated_jobs(emulator, run_id).items()):
        for job_id in ids:
            job = emulator.job(job_id)
            lines.append(f"{role} {job_id}: {job.stage} {job.message or ''} (created {job.created_at:%H:%M:%S})")
            lines.extend(f"    {line}" for line in job.lines[-15:])
    return "\n".join(lines)


def take_over(ctx: PanelContext, run_id: str) -> Launch:
    """Another panel's poller: it takes the launch over once the dead panel's lease lapses, and finishes it."""
    poller = Poller(ctx, launches=Launches(ctx, stale_after_s=1.5))

    def ended() -> Launch | None:
        poller.poll_once()
        launch = launch_of(ctx, run_id)
        return launch if launch.step in ("done", "failed", "cancelled") else None

    return wait_until(ended, 300, 1.0, what=f"the launch of {run_id} taken over and ended")


def cancel_run_jobs(emulator: HubEmulator, run_id: str) -> None:
    for ids in emulated_jobs(emulator, run_id).values():
        for job_id in ids:
            emulator.job(job_id).cancel()


@pytest.mark.e2e
@pytest.mark.parametrize(("index", "kill_point"), list(enumerate(KILL_POINTS)), ids=[k[0] for k in KILL_POINTS])
def test_a_panel_killed_mid_launch_is_resumed_with_one_job_per_role(
    hub, moto_server, record_property, index, kill_point
):
    emulator, panel = hub
    label, route, nth, after = kill_point
    run_id = f"killed-{index}"
    create_run(panel, run_id, moto_server.url)
    started = time.monotonic()
    step = kill_panel_at(emulator, panel, run_id, route, nth, after)
    before = {role: len(ids) for role, ids in emulated_jobs(emulator, run_id).items()}
    try:
        launch = take_over(panel.ctx, run_id)
        assert (launch.step, launch.takeovers) == ("done", 1), launch.message
        jobs = emulated_jobs(emulator, run_id)
        assert {role: len(ids) for role, ids in jobs.items()} == {"replica-0": 1, "replica-1": 1, "trainer": 1}, (
            jobs_report(emulator, run_id)
        )
        with panel.ctx.db.session() as session:
            rows = session.exec(select(Job).where(Job.run_id == run_id)).all()
            run = session.get(Run, run_id)
        assert sorted(row.backend_job_id for row in rows) == sorted(ids[0] for ids in jobs.values())
        assert all(row.attempt == 1 for row in rows)
        assert run.status in ("launching", "running"), run.status_message  # a trainer started before the kill trains
    finally:
        cancel_run_jobs(emulator, run_id)
    # One row of the launch-kill table in docs/reliability.md (bench/reliability_report.py collects it).
    record_property(
        "launch_kill",
        {
            "kill": label,
            "step": step,
            "jobs_at_kill": sum(before.values()),
            "outcome": "resumed",
            "jobs_after": sum(len(ids) for ids in jobs.values()),
            "seconds": round(time.monotonic() - started),
        },
    )


@pytest.mark.e2e
def test_a_run_stopped_while_its_panel_was_dead_mid_launch_is_cleaned_up(hub, moto_server, record_property):
    emulator, panel = hub
    run_id = "killed-then-stopped"
    create_run(panel, run_id, moto_server.url)
    started = time.monotonic()
    step = kill_panel_at(emulator, panel, run_id, "create", 2, False)
    assert step == "replicas"
    submitted = emulated_jobs(emulator, run_id)
    assert list(submitted) == ["replica-0"]  # replica-1 was held before the Hub created it
    RunService(panel.ctx, OWNER).stop(run_id, "stopped from the panel")
    launch = take_over(panel.ctx, run_id)
    assert launch.step == "cancelled" and "cancelled 1 job(s)" in launch.message
    run = RunService(panel.ctx, OWNER).get(run_id)
    assert run.status == "stopped" and "stopped while launching" in run.status_message
    wait_until(lambda: emulator.job(submitted["replica-0"][0]).stage == "CANCELED", 60, what="replica-0 cancelled")
    assert emulated_jobs(emulator, run_id) == submitted  # nothing new was started
    record_property(
        "launch_kill",
        {
            "kill": "between the two replicas, then the run stopped",
            "step": step,
            "jobs_at_kill": 1,
            "outcome": "cleaned up: replica-0 cancelled, run stopped",
            "jobs_after": 0,
            "seconds": round(time.monotonic() - started),
        },
    )


def test_a_launch_interrupted_too_often_is_cleaned_up_not_resumed(tmp_path):
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    spec = demo_spec("flaky-launch", f"file://{tmp_path / 'store'}")
    with ctx.db.session() as session:
        session.add(run_row(spec, "alice", "launching"))
        session.commit()
        session.add(Launch(run_id="flaky-launch", owner="alice", step="healthy", holder="dead", takeovers=3))
        session.commit()
    launches = Launches(ctx, stale_after_s=0.01)
    assert launches.recover() == ["flaky-launch"]
    launch = wait_until(lambda: (ended := launch_of(ctx, "flaky-launch")).step == "failed" and ended, 30)
    assert "interrupted 4 times" in launch.message
    assert RunService(ctx, "alice").get("flaky-launch").status == "failed"
    assert launches.recover() == []  # an ended launch is never taken over again


def test_a_live_panel_keeps_its_launch(tmp_path):
    """A launch whose holder renews its lease is not taken over, however many pollers look."""
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    spec = demo_spec("held-launch", f"file://{tmp_path / 'store'}")
    with ctx.db.session() as session:
        session.add(run_row(spec, "alice", "draft"))
        session.commit()
    holder = Launches(ctx)
    assert holder.claim("held-launch", "alice")
    others = [Launches(ctx, stale_after_s=5.0) for _ in range(3)]
    assert [other.recover() for other in others] == [[], [], []]
    assert holder.renew("held-launch")


@settings(max_examples=25, deadline=None)
@given(data=st.data(), claimants=st.integers(2, 3))
def test_a_run_is_launched_once_whatever_the_interleaving_of_launch_requests(tmp_path_factory, data, claimants):
    """Two or three panels (or clicks) claim the same draft at once: exactly one gets it, in every interleaving."""
    folder = tmp_path_factory.mktemp("claims")
    db = Database(folder / "panel.sqlite3")
    with db.session() as session:
        session.add(run_row(demo_spec("once", f"file://{folder / 'store'}"), "alice", "draft"))
        session.commit()
    won: list[bool] = []
    scheduler = Scheduler()
    for index in range(claimants):

        def claim() -> None:
            ctx = PanelContext(Database(folder / "panel.sqlite3"), folder)
            won.append(Launches(ctx).claim("once", "alice"))
            ctx.db.close()

        scheduler.add(f"panel-{index}", claim)
    with scheduler:
        scheduler.run(lambda runnable: (data.draw(st.sampled_from(runnable)), False))
    assert sorted(won) == [False] * (claimants - 1) + [True]
    with db.session() as session:
        assert session.exec(select(Launch)).all()[0].run_id == "once"
        assert Counter(session.exec(select(Run.status)).all()) == {"launching": 1}
    db.close()


def test_a_second_launch_of_a_run_is_refused(tmp_path):
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    spec = demo_spec("twice", f"file://{tmp_path / 'store'}")
    with ctx.db.session() as session:
        session.add(run_row(spec, "alice", "draft"))
        session.commit()
    assert Launches(ctx).claim("twice", "alice")
    with pytest.raises(RunStateError, match="twice is launching; only a new run can be launched"):
        RunService(ctx, "alice").launch("twice")

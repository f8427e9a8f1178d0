"""Per-owner limits (issue 16): one user of a shared panel cannot crowd out the others.

The services enforce them, so the pages and the public API meet the same refusal: what limit, what is using it, and
what to do. The clock is injected: the per-minute window is tested without waiting a minute.
"""

from __future__ import annotations

import pytest
from sqlmodel import select

from backend.api import PanelServices
from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.models import Run
from backend.launch.limits import LimitReached, OwnerLimiter, OwnerLimits
from backend.services.runs import RunService
from jobs.contract import RewardSpec
from jobs.demo.preset import demo_spec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ctx(tmp_path):
    context = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    yield context
    context.db.close()


def test_limits_come_from_the_environment_and_a_bad_one_names_the_fix():
    assert OwnerLimits.from_env("runs=2, reward_tests=10") == OwnerLimits(runs=2, checks=2, reward_tests=10)
    assert OwnerLimits.from_env("") == OwnerLimits()
    for bad in ("runs=0", "runs=two", "jobs=3"):
        with pytest.raises(ValueError, match="GRPO_PANEL_LIMITS: .* use e.g. runs=2,checks=1,reward_tests=10"):
            OwnerLimits.from_env(bad)


def test_reward_tests_per_minute_count_per_owner_and_free_up_as_the_minute_passes():
    clock = Clock()
    limiter = OwnerLimiter(OwnerLimits(reward_tests=3), clock)
    limiter.count_reward_tests("alice", 2)
    clock.now += 20
    limiter.count_reward_tests("alice", 1)
    with pytest.raises(LimitReached, match=r"3 ran in the last minute .* \(3\); try again in 40 s"):
        limiter.count_reward_tests("alice", 1)
    limiter.count_reward_tests("bob", 3)  # bob's minute is his own
    clock.now += 41  # the first two have left the window
    limiter.count_reward_tests("alice", 2)
    with pytest.raises(LimitReached):
        limiter.count_reward_tests("alice", 1)


def test_checks_at_once_are_held_per_owner_and_released_even_on_failure():
    limiter = OwnerLimiter(OwnerLimits(checks=1))
    held = r"1 of your checks or smoke tests are still running, .* \(1\); wait for one to end, then start this smoke"
    with limiter.checking("alice"):
        with pytest.raises(LimitReached, match=held), limiter.checking("alice", "smoke test"):
            pass
        with limiter.checking("bob"):
            pass
    with pytest.raises(RuntimeError, match="boom"), limiter.checking("alice"):
        raise RuntimeError("boom")
    with limiter.checking("alice"):  # the failed check gave its slot back
        pass


def test_a_launch_past_the_owners_active_runs_is_refused_and_changes_nothing(ctx, tmp_path):
    ctx.limits = OwnerLimiter(OwnerLimits(runs=2))
    alice = RunService(ctx, "alice")
    for run_id, status in (("alice-a", "running"), ("alice-b", "launching"), ("alice-c", "finished")):
        alice.create(demo_spec(run_id, f"file://{tmp_path / 'store'}"))
        with ctx.db.session() as session:
            run = session.get(Run, run_id)
            run.status = status
            session.add(run)
            session.commit()
    alice.create(demo_spec("alice-new", f"file://{tmp_path / 'store'}"))
    with pytest.raises(LimitReached, match=r"you have 2 runs active \(alice-a, alice-b\).* \(2\); stop one"):
        alice.launch("alice-new")
    assert alice.get("alice-new").status == "draft"
    with ctx.db.session() as session:
        assert session.exec(select(Run.id).where(Run.owner == "alice", Run.status == "launching")).all() == ["alice-b"]


def test_the_services_hold_a_check_slot_for_preflight_and_count_reward_tests(ctx, tmp_path):
    ctx.limits = OwnerLimiter(OwnerLimits(checks=1, reward_tests=1))
    services = PanelServices(ctx, "alice")
    spec = demo_spec("alice-check", f"file://{tmp_path / 'store'}")
    with ctx.limits.checking("alice"), pytest.raises(LimitReached):
        services.preflight(spec)
    assert services.preflight(spec).ok
    reward = [RewardSpec(name="digit_frac")]
    services.test_rewards(reward, [{"prompt": "p", "answer": "1"}])
    with pytest.raises(LimitReached, match="reward tests"):
        services.test_rewards(reward, [{"prompt": "p", "answer": "1"}])

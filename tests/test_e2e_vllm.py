"""The embedded default with vLLM 0.27.1 itself as the replicas' engine (its CPU build, `scripts/setup vllm`): a real
demo run, the policy audit at vLLM's precision, held-out evaluation during and after the run, a stale replica and a
killed one, and an agent run whose tool calls go through vLLM's completions.

One demo run serves most checks: replica-1 starts stale (its sidecar hands vLLM the version before under each new
name, until its clean re-load heals it), and once it is healed and re-admitted it is killed; the run trains to its
end on replica-0. That is the fault matrix's stale-replica and killed-replica rows (tests/test_faults.py, on our
engine) with vLLM serving.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlmodel import select

from backend.database.models import RolloutSample, Run
from backend.ingestion.poller import Poller
from backend.services.evaluation import EvaluationService
from backend.services.queries import QueryService
from backend.services.runs import RunService
from jobs.contract import layout
from jobs.demo.preset import agent_demo_spec, demo_spec
from jobs.replica.engine_command import find_cpu_build
from jobs.store import LocalStore, list_published
from tests.support.fault_runs import OBSERVE_INTERVAL, OWNER, FaultRun, audit_verdicts, replica_stats, stale_hook
from tests.support.runs import follow_to_end
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
RUN_ID = "vllm-e2e"
STEPS = 20
STALE, KEPT = "replica-1", "replica-0"
# The reward (the fraction of digit tokens) starts near 0.04 and climbs steadily: on vLLM replicas, seed 0, it read
# 0.036 at step 1, 0.097 at 12 and 0.154 at 16 (docs/engines.md); over 20 steps the last five beat the first five by
# more than this.
REWARD_MARGIN = 0.08


@dataclass
class VllmRun:
    run: FaultRun
    final: Run
    store: LocalStore
    orphans: list[int]
    killed_at_step: int
    ejected: dict


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    if find_cpu_build() is None:
        pytest.skip("vLLM's CPU build is not installed here: run scripts/setup vllm")
    data = tmp_path_factory.mktemp("vllm-run")
    spec = demo_spec(
        RUN_ID,
        f"file://{data / 'store'}",
        grpo={"max_steps": STEPS, "seed": 0, "audit_every": 1},
        compute={"engine": "vllm", "replicas": 2},
        eval={"split": "test", "every": 5},
    )
    run = FaultRun(data, spec)
    store = LocalStore(data / "store")
    try:
        run.launch(PYTHONPATH=stale_hook(data / "stale-hook", STALE, "until-emptied"))

        def healed() -> bool:
            verdicts = audit_verdicts(store, RUN_ID)[1]
            caught = [v for v, by_role in verdicts.items() if by_role.get(STALE) == "stale"]
            return bool(caught) and any(
                v > caught[0] and by_role.get(STALE) == "match" for v, by_role in verdicts.items()
            )

        run.wait(lambda r: healed(), 600, what=f"{STALE} caught stale, re-loaded and passing again")
        killed_at = run.observe(poll=True).step
        run.kill(STALE)
        ejected = wait_until(
            lambda: (s := run.proxy_stats()) and replica_stats(s, STALE)["state"] == "ejected" and s,
            60,
            OBSERVE_INTERVAL,
            what=f"{STALE} ejected after its kill",
        )
        final = run.finish(900)
        yield VllmRun(run, final, store, run.processes.running(), killed_at, ejected)
    finally:
        run.close()


def test_the_replicas_run_vllm_and_their_logs_keep_its_output(vllm_run):
    for role in (KEPT, STALE):
        log = (vllm_run.run.job_folder(role) / "log").read_text(errors="replace")
        assert "engine: vllm (compute.engine is vllm, on no GPU: vLLM's CPU build (" in log, log[-2000:]
        assert "version 0.27.1" in log and "(APIServer pid=" in log and "(EngineCore pid=" in log
        heartbeat = vllm_run.store.get_bytes(layout.status_key(RUN_ID, role))
        assert b'"engine": "vllm"' in heartbeat


def test_a_demo_on_vllm_replicas_trains_to_the_end_and_the_reward_rises(vllm_run):
    final = vllm_run.final
    assert final.status == "finished", final.status_message
    rewards = [v for _, v in QueryService(vllm_run.run.ctx, OWNER).metric_series(RUN_ID, "reward", max_points=None)]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    print(f"vLLM replicas: {STEPS} steps, reward first 5 {first:.3f} -> last 5 {last:.3f}")
    assert len(rewards) == STEPS and last - first > REWARD_MARGIN


def test_the_policy_audit_passes_vllm_at_its_precision_and_fails_the_stale_replica(vllm_run):
    """Every version is probed by its name on every replica and scored by the trainer: vLLM in float32 agrees with the
    trainer's forward within the audit's float32 tolerance; the replica handed the previous version is caught at its
    first stale version, ejected, re-loaded clean, and matches from then on."""
    audits, verdicts = audit_verdicts(vllm_run.store, RUN_ID)
    assert set(audits) >= set(range(2, STEPS + 1)), sorted(audits)
    kept = [audits[v]["replicas"][KEPT] for v in audits if v > 1]
    assert all(record["verdict"] == "match" for record in kept), verdicts
    assert max(record["max_abs_diff"] for record in kept) < audits[2]["tolerance"], kept
    stale = [v for v, by_role in verdicts.items() if by_role.get(STALE) == "stale"]
    assert stale and "ejected_at" in audits[stale[0]]["replicas"][STALE], verdicts
    assert "serves v" in audits[stale[0]]["replicas"][STALE]["why"]
    assert any(v > stale[-1] and by_role.get(STALE) == "match" for v, by_role in verdicts.items()), verdicts


def test_a_killed_vllm_replica_is_ejected_the_run_goes_on_and_nothing_is_left_running(vllm_run):
    assert vllm_run.ejected["membership"]["ejections"] >= 2  # once stale, once killed
    assert vllm_run.final.step == STEPS and vllm_run.final.step > vllm_run.killed_at_step
    assert vllm_run.orphans == [], "a process of the run outlived it (a vLLM engine core or worker?)"


def test_every_version_is_published_and_the_last_served_by_name(vllm_run):
    versions = [
        layout.parse_version_dir(name) for name in list_published(vllm_run.store, layout.adapters_prefix(RUN_ID))
    ]
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= STEPS
    final = QueryService(vllm_run.run.ctx, OWNER).proxy_snapshots(RUN_ID)[-1]
    assert final["adapters"]["loads_failed"] == 0 and final["adapters"]["live"][-1] == versions[-1]


def test_held_out_evaluation_scores_versions_through_vllm_during_and_after_the_run(vllm_run, caplog):
    """During the run the evaluator beside the trainer scored v0 and every fifth version by name through the proxy (so
    on vLLM); after it, the panel evaluates a version with other settings on vLLM's CPU build started for it."""
    ctx = vllm_run.run.ctx
    held = {score.version: score for score in QueryService(ctx, OWNER).held_out_series(RUN_ID)}
    assert 0 in held and len(held) >= 3, held
    last = max(held)
    with caplog.at_level(logging.INFO, logger="jobs.evaluation.engine"):
        here = EvaluationService(ctx, OWNER).evaluate(RUN_ID, [last], {"k": 2})
    assert here.cached == [False]
    assert "vLLM's CPU build" in caplog.text, caplog.text
    print(
        f"held-out reward on vLLM: v0 {held[0].mean:.3f}, v{last} {held[last].mean:.3f} (k=2 here: "
        f"{here.results[0].summary('reward').avg.mean:.3f})"
    )
    assert abs(here.results[0].summary("reward").avg.mean - held[last].mean) < 0.15


def test_an_agent_run_calls_its_tool_through_vllm_completions(tmp_path):
    """The agent demo on one vLLM replica for a few steps: TRL's rollout loop sends each turn to vLLM's completions
    and parses the tool calls in what vLLM generated; the episodes reach the panel turn by turn."""
    if find_cpu_build() is None:
        pytest.skip("vLLM's CPU build is not installed here: run scripts/setup vllm")
    from backend.context import PanelContext
    from backend.database.connection import Database

    run_id = "vllm-agent"
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    spec = agent_demo_spec(
        run_id,
        f"file://{tmp_path / 'store'}",
        grpo={"max_steps": 3, "seed": 0},
        compute={"engine": "vllm", "replicas": 1},
        eval={"split": None, "holdout": None},
    )
    service = RunService(ctx, OWNER)
    service.create(spec)
    service.launch(run_id, wait=True)
    assert follow_to_end(Poller(ctx, stall_after=120), service, run_id, 900).status == "finished"
    with ctx.db.session() as session:
        samples = session.exec(select(RolloutSample).where(RolloutSample.run_id == run_id)).all()
    called = [sample.turns for sample in samples if sample.turns and len(sample.turns) > 1]
    assert called and all(turns[1].role == "tool" for turns in called), len(samples)
    log = next((Path(ctx.local_launcher.workdir) / run_id).glob("replica-0-*/log")).read_text(errors="replace")
    assert "(APIServer pid=" in log

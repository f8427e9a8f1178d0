"""Launchers: a demo run through the real huggingface_hub client against the Hub Jobs emulator (moto S3 as the
bucket), failure paths, and the local launcher's process handling."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest
from huggingface_hub.errors import HfHubHTTPError

from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.models import Run
from backend.ingestion.poller import Poller
from backend.launch.plan import JobPlan
from backend.launchers.base import REPLICA_PORT, JobHandle, LaunchError, RunSecrets
from backend.launchers.hf_jobs import (
    HUB_TIMEOUT,
    HfJobsLauncher,
    HubTokenRejected,
    UnknownFlavor,
    _retry_after,
    bound_hub_calls,
)
from backend.launchers.local import LocalLauncher
from backend.services.queries import QueryService
from backend.services.runs import RunService
from jobs import settings as jobs_settings
from jobs.contract import layout, parse_spec
from jobs.demo.preset import demo_spec
from jobs.processes import group_alive
from jobs.store import S3Store, list_published, open_store
from tests.support.hub_panel import OWNER, TOKEN
from tests.support.hub_panel import hub_panel as hub_panel_of
from tests.support.runs import follow_to_end, hub_demo_spec
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hub_panel(tmp_path, emulator, moto_server):
    panel = hub_panel_of(tmp_path, emulator, moto_server)
    yield panel.ctx, panel.hf_credential_id, panel.store_credential_id, panel.bucket
    panel.ctx.db.close()


def hub_spec(run_id: str, bucket: str, endpoint: str, **compute):
    return hub_demo_spec(run_id, bucket, endpoint, OWNER, engine="auto", **compute)


@pytest.mark.e2e
def test_a_demo_run_goes_end_to_end_through_hf_jobs(hub_panel, emulator, moto_server):
    ctx, hf_id, keys_id, bucket = hub_panel
    spec = hub_spec("hub-demo", bucket, moto_server.url)
    service = RunService(ctx, OWNER)
    service.create(spec, store_credential_id=keys_id, hf_credential_id=hf_id)
    started = time.monotonic()
    service.launch("hub-demo", wait=False)
    # While the replicas start, the run says where each one is and for how long (issue 14: stages shown).
    waiting = re.compile(r"^waiting for the jobs: replica-0 (queued|starting) \d+s \(limit [^)]+\); replica-1 ")
    wait_until(lambda: waiting.search(service.get("hub-demo").status_message), 120, what="the replicas' stages")
    poller = Poller(ctx)
    run = follow_to_end(poller, service, "hub-demo", 900, 2)
    print(f"HF Jobs demo ({spec.grpo.max_steps} steps) through the emulator: {time.monotonic() - started:.0f}s")
    assert run.status == "finished", run.status_message
    store = S3Store(ctx.fresh_store(run).location, ctx.vault.store_credentials(OWNER, keys_id))
    assert len(list_published(store, layout.adapters_prefix("hub-demo"))) >= spec.grpo.max_steps
    # Stages moved and every job ended; the trainer cancelled its replicas itself.
    wait_until(lambda: all(j.stage in ("COMPLETED", "CANCELED") for j in emulator.jobs.values()), 60)
    stages = {j.spec["labels"]["grpo-role"]: j.stage for j in emulator.jobs.values()}
    assert stages == {"replica-0": "CANCELED", "replica-1": "CANCELED", "trainer": "COMPLETED"}
    poller.poll_run("hub-demo")
    jobs = {j.role: j for j in QueryService(ctx, OWNER).jobs("hub-demo")}
    assert jobs["trainer"].url.startswith(emulator.url) and "Weight sync" in jobs["trainer"].log_tail
    assert jobs["replica-0"].endpoint.startswith("https://127.0.0.1:")  # behind the emulated HTTPS edge
    # The recorded job specs carry secrets under `secrets` only.
    secret_values = {TOKEN, moto_server.credentials.secret_access_key, moto_server.credentials.access_key_id}
    assert len(emulator.submissions) == 3
    for submission in emulator.submissions:
        body = submission.spec
        exposed = json.dumps({k: v for k, v in body.items() if k != "secrets"})
        assert not any(value in exposed for value in secret_values), "a secret leaked outside `secrets`"
        assert set(body["secrets"]) >= {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        assert body["labels"]["grpo-run"] == "hub-demo"
    replica_bodies = [s.spec for s in emulator.submissions if s.spec["labels"]["grpo-role"] != "trainer"]
    assert all(b["expose"]["ports"] == [8000] and b["flavor"] == "cpu-basic" for b in replica_bodies)
    # What was submitted is exactly what `python -m backend plan` prints for this run (one code path builds both).
    plan = ctx.plan(service.get("hub-demo"))
    submitted = {s.spec["labels"]["grpo-role"]: as_planned(s.spec) for s in emulator.submissions}
    assert submitted == {job.role: as_planned(planned_body(job)) for job in plan.jobs}


def test_a_run_on_a_bucket_in_another_region_is_created_with_that_region(hub_panel, moto_server):
    """Issue 14: a bucket's region left empty is learnt from the bucket (HeadBucket) when the run is created, so the
    jobs' bootstrap signs for it: it cannot follow a redirect to the right region as boto3 does."""
    ctx, hf_id, keys_id, _ = hub_panel
    moto_server.client().create_bucket(Bucket="eu-runs", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    service = RunService(ctx, OWNER)
    run = service.create(
        hub_spec("eu-run", "eu-runs", moto_server.url), store_credential_id=keys_id, hf_credential_id=hf_id
    )
    assert ctx.spec(run).storage.region == "eu-west-1"
    trainer = ctx.plan(service.get("eu-run")).job("trainer").command
    assert trainer[trainer.index("eu-runs") - 1] == "eu-west-1"  # the bootstrap's region argument
    assert trainer[trainer.index("--store-region") + 1] == "eu-west-1"


def planned_body(job: JobPlan) -> dict:
    """The job spec `run_job` sends for a JobPlan, as the Hub receives it (the submission label aside)."""
    body = {
        "dockerImage": job.image,
        "command": job.command,
        "environment": job.env,
        "secrets": dict.fromkeys(job.secrets),
        "flavor": job.flavor,
        "timeoutSeconds": job.timeout_s,
        "labels": {**job.labels, "name": job.name},
    }
    if job.ports:
        body["expose"] = {"ports": job.ports}
    return body


def as_planned(body: dict) -> dict:
    """A submitted job spec with what no plan can know taken out: secret values and the per-submission label."""
    kept = {key: body.get(key) for key in ("dockerImage", "command", "environment", "flavor", "timeoutSeconds")}
    kept["secrets"] = sorted(body.get("secrets") or {})
    kept["labels"] = {k: v for k, v in (body.get("labels") or {}).items() if k != "grpo-submission"}
    kept["ports"] = (body.get("expose") or {}).get("ports", [])
    return kept


def test_a_replica_that_fails_at_start_fails_the_run_before_the_trainer(hub_panel, emulator, moto_server):
    ctx, hf_id, keys_id, bucket = hub_panel
    spec = hub_spec("hub-broken", bucket, moto_server.url)
    data = spec.model_dump()
    data["model"]["id"] = "/nonexistent/model"  # the replica cannot load it and exits 1
    service = RunService(ctx, OWNER)
    service.create(parse_spec(data), store_credential_id=keys_id, hf_credential_id=hf_id)
    service.launch("hub-broken", wait=True)
    run = service.get("hub-broken")
    assert run.status == "failed"
    assert "replica-" in run.status_message and "ended before it was ready" in run.status_message
    roles = [s.spec["labels"]["grpo-role"] for s in emulator.submissions]
    assert "trainer" not in roles
    wait_until(lambda: all(j.stage in ("ERROR", "CANCELED", "COMPLETED") for j in emulator.jobs.values()), 60)


@pytest.mark.e2e
def test_a_trainer_failing_mid_run_cancels_the_replicas(hub_panel, emulator, moto_server):
    ctx, hf_id, keys_id, bucket = hub_panel
    source = "def f(completions, **kw):\n    raise RuntimeError('reward blew up')\n"
    spec = hub_spec("hub-trainfail", bucket, moto_server.url)
    data = spec.model_dump()
    data["rewards"] = [{"kind": "code", "name": "broken", "source": source, "entry_point": "f"}]
    service = RunService(ctx, OWNER)
    service.create(parse_spec(data), store_credential_id=keys_id, hf_credential_id=hf_id)
    service.launch("hub-trainfail", wait=True)
    try:
        run = follow_to_end(Poller(ctx), service, "hub-trainfail", 450, 2)
    except TimeoutError:  # say why: where each job is and what it last said
        jobs = [(j.spec["labels"]["grpo-role"], j.stage, j.lines[-12:]) for j in emulator.jobs.values()]
        raise AssertionError(f"the run did not end: {service.get('hub-trainfail').status}; jobs: {jobs}") from None
    assert run.status == "failed" and "broken" in run.status_message
    wait_until(lambda: all(j.stage != "RUNNING" for j in emulator.jobs.values()), 60)
    stages = {j.spec["labels"]["grpo-role"]: j.stage for j in emulator.jobs.values()}
    assert stages["replica-0"] == stages["replica-1"] == "CANCELED"


def test_a_rejected_token_and_an_unknown_flavor_fail_before_anything_is_submitted(emulator, moto_server, tmp_path):
    spec = hub_spec("hub-checks", "some-bucket", moto_server.url)
    with pytest.raises(HubTokenRejected, match="rejected the token"):
        HfJobsLauncher("hf_not_a_valid_token_at_all_000", endpoint=emulator.url).check_flavors(spec)
    bad = spec.model_copy(update={"compute": spec.compute.model_copy(update={"replica_flavor": "h9000"})})
    with pytest.raises(UnknownFlavor, match=r"compute.replica_flavor: the Hub has no flavor 'h9000'"):
        HfJobsLauncher(TOKEN, endpoint=emulator.url).check_flavors(bad)
    assert emulator.submissions == []


def test_a_running_jobs_log_is_read_in_bounded_time_whatever_its_machines_clock(emulator, monkeypatch):
    """A job's log lines are stamped by its machine's clock, the Hub's `Date` by the API server's: with the machine
    behind, huggingface_hub's non-follow read of a job that logs often never meets a line newer than the Date, and
    never ends (the poller reads every running job's log tail on each poll). The launcher's read ends on its own."""
    from huggingface_hub import HfApi

    from backend.launchers import hf_jobs

    monkeypatch.setattr(hf_jobs, "LOG_TAIL_READ_S", 2.0)
    emulator.log_clock_skew = -3600.0
    code = "import time\nfor i in range(10**6):\n    print(f'line {i}', flush=True)\n    time.sleep(0.2)"
    job = HfApi(endpoint=emulator.url, token=TOKEN).run_job(
        image="python:3.12", command=[sys.executable, "-c", code], namespace=OWNER
    )
    launcher = HfJobsLauncher(TOKEN, endpoint=emulator.url)
    handle = JobHandle("chatty", "replica-0", job.id, "hf_jobs")
    wait_until(lambda: len(emulator.job(job.id).lines) > 5, 60, 0.1, what="the job's first lines")
    read: list[str] = []
    reader = threading.Thread(target=lambda: read.extend(launcher.logs(handle, 5)), daemon=True)
    reader.start()
    reader.join(60)
    try:
        assert not reader.is_alive(), "the log read never ended"
        assert len(read) == 5 and all(line.startswith("line ") for line in read), read
    finally:
        launcher.cancel(handle)


def test_hub_errors_are_retried_without_duplicate_jobs(emulator, moto_server, tmp_path, caplog):
    launcher = HfJobsLauncher(TOKEN, endpoint=emulator.url)
    launcher.retry = type(launcher.retry)(6, 0.05, 0.2)
    spec = hub_spec("hub-retry", "some-bucket", moto_server.url)
    emulator.inject("429", count=2, methods=["POST"])  # the submission itself (GETs are retried by huggingface_hub)
    emulator.inject("5xx-after", count=1, methods=["POST"])  # the job is created, but the answer is lost
    with caplog.at_level("WARNING", logger="jobs.retry"):
        job = launcher.start_job(spec, "replica-0", RunSecrets(hf_token=TOKEN))
    created = [s for s in emulator.submissions if s.job_id is not None]
    assert len(created) == 1 and created[0].job_id == job.job_id
    retries = [record.getMessage() for record in caplog.records if "the Hub call to" in record.getMessage()]
    assert len(retries) == 3, retries  # two 429s and the lost answer, each reported before its retry
    launcher.cancel(job)
    wait_until(lambda: launcher.state(job).stage in ("canceled", "error"), 30)


def test_a_submission_whose_answer_never_comes_times_out_and_is_found_not_resubmitted(emulator, moto_server):
    """Issue 14: huggingface_hub's client has no timeout of its own, and its timeouts are httpx2 errors, not OSError.
    The Hub creates the job and never answers: the call times out, is retried, and the retry finds the job by its
    submission label instead of starting a second one."""
    launcher = HfJobsLauncher(TOKEN, endpoint=emulator.url)
    launcher.retry = type(launcher.retry)(4, 0.05, 0.2)
    held = emulator.hold("create", after=True)  # created, its answer held back
    bound_hub_calls(1.0)
    try:
        job = launcher.start_job(hub_spec("hub-stuck", "some-bucket", moto_server.url), "replica-0", RunSecrets(TOKEN))
    finally:
        bound_hub_calls(HUB_TIMEOUT)
        held.release()
    assert held.arrived.is_set()
    created = [s for s in emulator.submissions if s.job_id is not None]
    assert [s.job_id for s in created] == [job.job_id]
    launcher.cancel(job)
    wait_until(lambda: launcher.state(job).stage in ("canceled", "error"), 30)


def test_a_submission_whose_connection_is_reset_is_found_not_resubmitted(emulator, moto_server, caplog):
    """Issue 14: the Hub creates the job, then the connection is reset with no answer at all (an httpx2 transport
    error, not an OSError): the retry finds the job by its submission label."""
    launcher = HfJobsLauncher(TOKEN, endpoint=emulator.url)
    launcher.retry = type(launcher.retry)(4, 0.05, 0.2)
    emulator.inject("reset-after", count=1, methods=["POST"])
    with caplog.at_level("WARNING", logger="jobs.retry"):
        job = launcher.start_job(hub_spec("hub-reset", "some-bucket", moto_server.url), "replica-0", RunSecrets(TOKEN))
    assert [s.job_id for s in emulator.submissions if s.job_id is not None] == [job.job_id]
    assert any("the Hub call to start the replica-0 job failed" in record.getMessage() for record in caplog.records)
    launcher.cancel(job)


def test_a_retry_never_mistakes_another_job_for_its_own_when_the_hub_ignores_label_filters(emulator, moto_server):
    """The lost-answer retry looks its job up by a submission label. A Hub that ignored the label filter would list
    every job of the namespace: the label is checked on what comes back, so the retry submits again instead of
    taking another job (here an earlier replica's) for this one."""
    launcher = HfJobsLauncher(TOKEN, endpoint=emulator.url)
    launcher.retry = type(launcher.retry)(4, 0.05, 0.2)
    spec = hub_spec("hub-labels", "some-bucket", moto_server.url)
    earlier = launcher.start_job(spec, "replica-0", RunSecrets(TOKEN))
    emulator.label_filters = False
    emulator.inject("5xx", count=1, methods=["POST"])  # refused before it is created: nothing of it to find
    job = launcher.start_job(spec, "replica-1", RunSecrets(TOKEN))
    assert job.job_id != earlier.job_id
    assert len([s for s in emulator.submissions if s.job_id is not None]) == 2
    launcher.cancel_all([earlier, job])


def test_a_429_with_only_the_ratelimit_header_is_waited_out_for_its_reset(emulator, moto_server, caplog):
    """The Hub documents `RateLimit: "api";r=0;t=N`, not `Retry-After`: the wait is the header's reset, not the
    generic back-off."""
    launcher = HfJobsLauncher(TOKEN, endpoint=emulator.url)
    launcher.retry = type(launcher.retry)(4, 0.05, 0.2)
    emulator.inject("429-ratelimit", count=1, retry_after=2, methods=["POST"])
    with caplog.at_level("WARNING", logger="jobs.retry"):
        job = launcher.start_job(
            hub_spec("hub-ratelimit", "some-bucket", moto_server.url), "replica-0", RunSecrets(TOKEN)
        )
    (warning,) = [r.getMessage() for r in caplog.records if "the Hub call to" in r.getMessage()]
    assert warning.endswith("retry 1/3 in 2.00s"), warning
    assert len([s for s in emulator.submissions if s.job_id is not None]) == 1
    launcher.cancel(job)


def test_cancelling_a_job_that_has_ended_is_not_an_error(emulator):
    """The emulator refuses a cancel of an ended job (the real Hub's answer is undocumented; refusing is the harsher
    guess): the launcher, which cancels everything of a run when it ends, takes an ended job as cancelled."""
    launcher = HfJobsLauncher(TOKEN, endpoint=emulator.url)
    info = launcher.api.run_job(image="python:3.12", command=[sys.executable, "-c", "pass"], namespace=OWNER)
    job = JobHandle("hub-ended", "replica-0", info.id, "hf_jobs", url=info.url)
    wait_until(lambda: launcher.state(job).stage == "completed", 30)
    launcher.cancel(job)
    assert launcher.state(job).stage == "completed"
    with pytest.raises(HfHubHTTPError, match="is not running"):  # what the launcher was answered
        launcher.api.cancel_job(job_id=job.job_id, namespace=OWNER)


def fake_jobs(launcher: HfJobsLauncher, roles: list[str]) -> list[JobHandle]:
    """Jobs that serve /health as soon as they run (a fake replica), so a test times only the queue."""
    command = [sys.executable, "-m", "tests.support.fake_replica", "--port", str(REPLICA_PORT)]
    handles = []
    for role in roles:
        info = launcher.api.run_job(
            image="python:3.12", command=command, env={"PYTHONPATH": str(ROOT)}, expose=[REPLICA_PORT], namespace=OWNER
        )
        handles.append(JobHandle("hub-queue", role, info.id, "hf_jobs", url=info.url))
    return handles


def test_queueing_and_start_up_are_timed_apart_and_a_full_queue_says_so(emulator, moto_server):
    """Issue 14: a busy flavor keeps replicas SCHEDULING for longer than their whole start-up limit; they then start
    and answer at once, so the launch goes on. A queue longer than `compute.queue_timeout` fails the launch naming
    that field (not the start-up), and the progress says which stage each job is in and for how long."""
    launcher = HfJobsLauncher(TOKEN, endpoint=emulator.url)
    launcher.poll_interval = 0.5
    secrets = RunSecrets(hf_token=TOKEN, replica_token=TOKEN)
    emulator.scheduling_delay = 6.0
    patient = hub_spec("hub-queue", "some-bucket", moto_server.url, queue_timeout="60s", startup_timeout="4s")
    replicas, progress = fake_jobs(launcher, ["replica-0", "replica-1"]), []
    launcher.wait_ready(patient, replicas, secrets, lambda starts: progress.append("; ".join(map(str, starts))))
    assert all(job.endpoint for job in replicas)
    assert any(re.search(r"replica-0 queued [56]s \(limit 1m 00s\)", line) for line in progress), progress
    assert progress[-1] == "replica-0 ready; replica-1 ready"
    launcher.cancel_all(replicas)

    # The trainer queues too, while the replicas bill: its wait is bounded the same way, naming its own flavor.
    impatient = hub_spec("hub-queue", "some-bucket", moto_server.url, queue_timeout="2s")
    trainer = fake_jobs(launcher, ["trainer"])
    with pytest.raises(LaunchError) as raised:
        launcher.wait_ready(impatient, trainer, secrets)
    message = str(raised.value)
    assert message.startswith("trainer waited 2s for a cpu-upgrade machine without starting")
    assert "compute.queue_timeout: 2s" in message and message.endswith("choose another compute.trainer_flavor")
    launcher.cancel_all(trainer)
    wait_until(lambda: all(j.finished for j in emulator.jobs.values()), 30)


@pytest.mark.parametrize(
    ("headers", "wait"),
    [
        ({"RateLimit": '"api";r=0;t=7', "RateLimit-Policy": '"fixed window";"api";q=500;w=300'}, 7.0),
        ({"RateLimit": '"api";r=3;t=7', "Retry-After": "2"}, 2.0),  # the window is not spent: Retry-After
        ({"Retry-After": "1.5"}, 1.5),
        ({}, None),
    ],
)
def test_a_rate_limit_is_waited_out_as_the_hub_says(headers, wait):
    answer = httpx2.Response(429, headers=headers, request=httpx2.Request("POST", "https://huggingface.co/api/jobs/x"))
    assert _retry_after(HfHubHTTPError("429 Too Many Requests", response=answer)) == wait


def test_prices_and_the_cost_estimate(emulator):
    launcher = HfJobsLauncher(TOKEN, endpoint=emulator.url)
    prices = launcher.prices_per_hour()
    assert prices["a10g-small"] == pytest.approx(1.0, rel=1e-3) and prices["h200"] == pytest.approx(5.0, rel=1e-3)
    from backend.services.costs import estimate_per_hour

    spec = parse_spec(
        {
            "run_id": "cost-1",
            "compute": {
                "backend": "hf_jobs",
                "namespace": OWNER,
                "replicas": 3,
                "trainer_flavor": "h200x2",
                "replica_flavor": "h200",
            },
        }
    )
    assert estimate_per_hour(spec, prices) == pytest.approx(prices["h200x2"] + 3 * prices["h200"])


# --- the local launcher ---------------------------------------------------------------------------------------


def test_local_launcher_submit_status_logs_cancel_and_no_orphans(tmp_path, monkeypatch):
    tuned = (jobs_settings.STORE_READ_TIMEOUT, jobs_settings.STORE_OUTAGE_TIMEOUT, jobs_settings.REPLICA_LOSS_TIMEOUT)
    for variable in tuned:  # what a user tunes the jobs with by hand, in the panel's environment
        monkeypatch.setenv(variable.name, "123")
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    spec = demo_spec("local-l", f"file://{tmp_path / 'store'}", compute={"replicas": 1})
    write_spec(spec)
    launcher = ctx.local_launcher
    secrets = RunSecrets()
    job = launcher.start_job(spec, "replica-0", secrets)
    assert launcher.state(job).stage == "running"
    launcher.wait_ready(spec, [job], secrets)
    assert any(
        "sidecar" in line or "engine" in line or "listening" in line.lower() for line in launcher.logs(job, 200)
    ), launcher.logs(job, 50)
    pgid = int((launcher.workdir / "local-l" / job.job_id / "pgid").read_text())
    # The replica's token reaches it through its environment, never its command line; so do the tuned variables.
    environ = Path(f"/proc/{pgid}/environ").read_bytes().decode(errors="replace").split("\0")
    assert f"{jobs_settings.REPLICA_TOKEN.name}={secrets.replica_token}" in environ
    assert {f"{variable.name}=123" for variable in tuned} <= set(environ)
    assert secrets.replica_token not in (launcher.workdir / "local-l" / job.job_id / "command").read_text()
    # A panel that restarts finds the job from its folder alone (a folder whose process never started is no job).
    (launcher.workdir / "local-l" / "replica-1-deadbeef").mkdir()
    found = LocalLauncher(launcher.workdir).find_jobs(spec)
    assert [(j.job_id, j.role, j.endpoint) for j in found] == [(job.job_id, "replica-0", job.endpoint)]
    launcher.cancel(job)
    assert launcher.state(job).stage == "canceled"
    wait_until(lambda: not group_alive(pgid), 20)
    assert LocalLauncher(launcher.workdir).find_jobs(spec) == []  # an ended job is not taken over
    ctx.db.close()


def test_local_launcher_reports_exit_codes_and_timeouts(tmp_path):
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    spec = demo_spec("local-x", f"file://{tmp_path / 'store'}", compute={"replicas": 1, "timeout": "2s"})
    write_spec(spec)
    launcher = ctx.local_launcher
    job = launcher.start_job(spec, "replica-0", RunSecrets())
    wait_until(lambda: launcher.state(job).stage == "error", 30, 0.5)
    assert "timed out" in launcher.state(job).message
    pgid = int((launcher.workdir / "local-x" / job.job_id / "pgid").read_text())
    wait_until(lambda: not group_alive(pgid), 20)
    ctx.db.close()


def test_a_killed_local_job_stays_an_error_when_cancelled_afterwards(tmp_path):
    """Replacing a replica that crashed cancels its job: that must not relabel the crash "cancelled"."""
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    spec = demo_spec("local-k", f"file://{tmp_path / 'store'}", compute={"replicas": 1})
    write_spec(spec)
    launcher = ctx.local_launcher
    job = launcher.start_job(spec, "replica-0", RunSecrets())
    pgid = int((launcher.workdir / "local-k" / job.job_id / "pgid").read_text())
    os.killpg(pgid, signal.SIGKILL)  # the whole group, exit recorder included: no exit code is written
    wait_until(lambda: not group_alive(pgid), 20)
    launcher.cancel(job)
    state = launcher.state(job)
    assert (state.stage, state.message) == ("error", "the process ended without an exit code")
    ctx.db.close()


def test_a_failed_launch_leaves_nothing_running(tmp_path):
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    spec = demo_spec("local-f", f"file://{tmp_path / 'store'}", model={"id": "/nonexistent/model"})
    ctx.local_launcher.startup_deadline = 120
    with ctx.db.session() as session:
        session.add(
            Run(
                id="local-f",
                owner=OWNER,
                spec_json=spec.to_json(),
                storage_uri=spec.storage.uri,
                backend="local",
                created_at=time.time(),
            )
        )
        session.commit()
    started = []
    with pytest.raises(LaunchError, match="ended before it was ready") as raised:
        ctx.local_launcher.launch(spec, RunSecrets(), ctx.store_for(ctx_run(ctx, "local-f")), on_started=started.append)
    assert raised.value.log_tail
    for job in started:
        pgid = int((ctx.local_launcher.workdir / "local-f" / job.job_id / "pgid").read_text())
        wait_until(lambda pgid=pgid: not group_alive(pgid), 20)
    ctx.db.close()


def write_spec(spec) -> None:
    open_store(spec.storage).put_bytes(layout.spec_key(spec.run_id), spec.to_json().encode())


def ctx_run(ctx: PanelContext, run_id: str) -> Run:
    with ctx.db.session() as session:
        return session.get(Run, run_id)

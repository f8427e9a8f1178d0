"""The smoke test on HF Jobs (issue 14), end to end through the Hub emulator with moto S3 as the user's bucket: one
cpu-basic job fetched through the real bootstrap, probed through its exposed URL with the bearer, then cancelled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backend.context import PanelContext
from backend.database.connection import Database
from backend.services.smoke import SmokeTest
from jobs.contract import layout, parse_storage_uri
from jobs.store import open_store
from tests.support.hub_panel import OWNER, TOKEN
from tests.support.hub_panel import hub_panel as hub_panel_of
from tests.support.runs import hub_demo_spec
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
CLI_OWNER = "local"  # the owner `python -m backend` acts as


@pytest.fixture
def panel(tmp_path, emulator, moto_server):
    panel = hub_panel_of(tmp_path, emulator, moto_server)
    yield panel
    panel.ctx.db.close()


def bucket_keys(panel, moto_server) -> list[str]:
    location = parse_storage_uri(f"s3://{panel.bucket}/panel", endpoint=moto_server.url)
    store = open_store(location, moto_server.credentials)
    return [info.key for info in store.list(layout.RUNS + "/")]


def test_a_smoke_test_proves_the_bucket_the_bootstrap_and_the_url_then_cancels_its_one_job(
    panel, emulator, moto_server
):
    spec = hub_demo_spec("smoke-demo", panel.bucket, moto_server.url, OWNER)
    seen = []
    report = SmokeTest(panel.ctx, OWNER, on_step=seen.append).run(
        spec, panel.store_credential_id, panel.hf_credential_id
    )
    assert report.ok, report.summary()
    names = [step.name for step in report.steps]
    assert names == [
        "upload the spec and the code bundle",
        "submit a cpu-basic job",
        "wait for a cpu-basic machine",
        "start: fetch the code from the bucket, answer /health",
        "read the job's report through its URL",
        "job: read the run's spec from the bucket",
        "job: write and read back a probe object",
        "job: packages the jobs import",
        "read the job's probe object from the panel",
        "cancel the job",
    ]
    assert seen == report.steps  # each step was reported as it ended
    assert "trl 1.16.0" in report.steps[7].detail and "torch 2.13.0" in report.steps[7].detail
    assert report.steps[-1].detail.startswith("canceled after running")
    # One job, submitted as a replica would be but on cpu-basic with the shortest timeout, cancelled; it billed.
    assert len(emulator.submissions) == 1
    body = emulator.submissions[0].spec
    assert (body["flavor"], body["timeoutSeconds"], body["expose"]["ports"]) == ("cpu-basic", 600, [8000])
    assert body["command"][:2] == ["python3", "-c"] and "jobs.smoke" in body["command"]
    exposed = json.dumps({key: value for key, value in body.items() if key != "secrets"})
    assert TOKEN not in exposed and moto_server.credentials.secret_access_key not in exposed
    wait_until(lambda: all(job.stage == "CANCELED" for job in emulator.jobs.values()), 30)
    assert report.cost_usd is not None and 0 < report.cost_usd < 0.01
    assert report.summary().startswith("smoke test passed in ")
    assert bucket_keys(panel, moto_server) == []  # the spec, the bundle and the probe are gone


def test_a_flavor_that_never_comes_fails_the_smoke_test_at_the_queue_and_names_the_limit(panel, emulator, moto_server):
    emulator.scheduling_delay = 60.0
    spec = hub_demo_spec("smoke-queue", panel.bucket, moto_server.url, OWNER, queue_timeout="3s")
    report = SmokeTest(panel.ctx, OWNER).run(spec, panel.store_credential_id, panel.hf_credential_id)
    assert not report.ok
    assert report.failed.name == "wait for a cpu-basic machine"
    assert "compute.queue_timeout: 3s" in report.failed.detail
    assert report.steps[-1].name == "cancel the job" and report.steps[-1].ok
    assert report.cost_usd == 0.0  # it never ran
    assert "smoke test failed at 'wait for a cpu-basic machine'" in report.summary()
    wait_until(lambda: all(job.stage == "CANCELED" for job in emulator.jobs.values()), 30)
    assert bucket_keys(panel, moto_server) == []


def test_a_rejected_token_fails_before_any_job_is_submitted(panel, emulator, moto_server):
    revoked = "hf_revokedtoken000000000000000000"  # made up: a token the emulator does not accept, valid nowhere
    bad = panel.ctx.vault.save(OWNER, "stale", "hf_token", revoked)
    spec = hub_demo_spec("smoke-token", panel.bucket, moto_server.url, OWNER)
    report = SmokeTest(panel.ctx, OWNER).run(spec, panel.store_credential_id, bad.id)
    assert [step.ok for step in report.steps] == [False]
    assert report.failed.name == "upload the spec and the code bundle" and "rejected the token" in report.failed.detail
    assert emulator.submissions == [] and report.cost_usd is None


def test_wrong_bucket_keys_fail_the_first_step_saying_so_and_submit_nothing(panel, emulator, moto_server):
    keys = moto_server.credentials
    wrong = panel.ctx.vault.save(
        OWNER, "wrong", "s3", {"access_key_id": keys.access_key_id, "secret_access_key": "not-the-secret-0000"}
    )
    spec = hub_demo_spec("smoke-keys", panel.bucket, moto_server.url, OWNER)
    report = SmokeTest(panel.ctx, OWNER).run(spec, wrong.id, panel.hf_credential_id)
    assert [step.ok for step in report.steps] == [False]
    assert report.failed.name == "upload the spec and the code bundle"
    assert "not-the-secret" not in report.failed.detail and report.failed.detail, report.failed.detail
    assert emulator.submissions == []


def test_the_smoke_command_prints_each_step_and_passes(tmp_path, emulator, moto_server):
    """What a user runs first on their own account: `python -m backend smoke` with credentials saved by name."""
    data = tmp_path / "cli"
    ctx = PanelContext(Database(data / "panel.sqlite3"), data)
    ctx.vault.save(CLI_OWNER, "my-token", "hf_token", TOKEN)
    keys = moto_server.credentials
    ctx.vault.save(
        CLI_OWNER, "my-bucket", "s3", {"access_key_id": keys.access_key_id, "secret_access_key": keys.secret_access_key}
    )
    ctx.db.close()
    bucket = moto_server.create_bucket()
    spec_file = tmp_path / "run.json"
    spec_file.write_text(hub_demo_spec("smoke-cli", bucket, moto_server.url, OWNER).to_json())
    command = [sys.executable, "-m", "backend", "smoke", "--spec", str(spec_file)]
    command += ["--hf-credential", "my-token", "--store-credential", "my-bucket"]
    environment = {**os.environ, "GRPO_PANEL_DATA": str(data), "HF_ENDPOINT": emulator.url}
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len([line for line in lines if line.startswith("ok   ")]) == 10
    assert lines[-2].startswith("smoke test passed in ") and lines[-1].startswith(f"job: {emulator.url}")
    assert TOKEN not in result.stdout + result.stderr

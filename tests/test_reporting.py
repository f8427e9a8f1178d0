"""Issue 18, item 3: the trainer reports to Trackio and W&B besides the panel, when the spec says so.

The spec's choices become TRL's TrainingArguments and wandb's environment (pure functions, tested for every
combination); the W&B key is a credential the trainer alone receives, as a secret; preflight refuses W&B without a
key before anything starts. A real demo run then reports to a local Trackio project and an offline W&B run, and both
hold TRL's metric names at the steps the panel shows.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import gradio as gr
import pytest

from app.launch_form import FORM
from app.pages.launch import LaunchPage
from app.panel import Panel
from backend.context import PanelContext
from backend.database.connection import Database
from backend.ingestion.poller import Poller
from backend.launch.preflight import run_preflight
from backend.services.queries import QueryService
from backend.services.runs import RunService
from jobs.contract import SpecError, parse_spec
from jobs.demo.preset import demo_spec
from jobs.trainer.config import grpo_config
from jobs.trainer.reporting import missing_packages, report_arguments, report_environment
from tests.support import wandb_records
from tests.support.runs import follow_to_end

OWNER = "local"
WANDB_KEY = "0123456789abcdef" * 2 + "01234567"  # 40 characters, as W&B keys are; never sent anywhere here


def spec_with(tmp_path: Path, reporting: dict, **sections: dict) -> dict:
    return demo_spec("report-demo", f"file://{tmp_path / 'store'}", reporting=reporting, **sections).model_dump()


@pytest.fixture
def ctx(tmp_path):
    context = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    yield context
    context.db.close()


@pytest.mark.parametrize(
    ("reporting", "report_to"),
    [({}, "none"), ({"trackio": True}, ["trackio"]), ({"wandb": True}, ["wandb"]), ({"trackio": True, "wandb": True},
                                                                                     ["trackio", "wandb"])],
)  # fmt: skip
def test_the_spec_picks_where_the_trainer_reports(tmp_path, reporting, report_to):
    spec = parse_spec(spec_with(tmp_path, {"project": "digits", **reporting}))
    arguments = report_arguments(spec)
    assert arguments["report_to"] == report_to
    if report_to != "none":
        assert (arguments["run_name"], arguments["project"]) == ("report-demo", "digits")
    assert ("trackio_space_id" in arguments) == ("trackio" in report_to)
    assert report_environment(spec) == ({"WANDB_PROJECT": "digits"} if "wandb" in report_to else {})
    config = grpo_config(spec, str(tmp_path / "out"), "http://127.0.0.1:9", cuda=False)
    assert config.report_to == ([] if report_to == "none" else report_to)  # as TRL's own arguments take them
    if "trackio" in report_to:
        assert (config.project, config.run_name, config.trackio_space_id) == ("digits", "report-demo", None)


def test_a_space_and_an_entity_reach_trackio_and_wandb(tmp_path):
    spec = parse_spec(
        spec_with(tmp_path, {"trackio": True, "trackio_space": "alice/dash", "wandb": True, "wandb_entity": "team"})
    )
    assert report_arguments(spec)["trackio_space_id"] == "alice/dash"
    assert report_arguments(spec)["trackio_static_space_id"] is False  # no second Space made behind the user's back
    assert report_environment(spec) == {"WANDB_PROJECT": "grpo-panel", "WANDB_ENTITY": "team"}


@pytest.mark.parametrize(
    ("reporting", "compute", "field", "words"),
    [
        ({"trackio": True}, {"backend": "hf_jobs", "namespace": "alice", "replica_flavor": "h200"},
         "reporting.trackio_space", "lost when the job ends"),
        ({"trackio": True, "trackio_space": "dash"}, {}, "reporting.trackio_space", "owner/name"),
        ({"project": "a project"}, {}, "reporting.project", "letters, digits"),
    ],
)  # fmt: skip
def test_reporting_that_cannot_work_is_refused_naming_the_field(tmp_path, reporting, compute, field, words):
    with pytest.raises(SpecError) as refused:
        parse_spec(spec_with(tmp_path, reporting, compute=compute))
    assert field in refused.value.errors and words in refused.value.errors[field], refused.value.errors


def test_wandb_without_a_key_is_refused_before_anything_starts_and_with_one_only_the_trainer_gets_it(ctx, tmp_path):
    data = spec_with(tmp_path, {"wandb": True})
    refused = run_preflight(ctx, OWNER, data, sample_rows=2)
    assert "Account page" in refused.errors["reporting.wandb_key"]

    key = ctx.vault.save(OWNER, "my-wandb", "wandb", WANDB_KEY)
    passed = run_preflight(ctx, OWNER, data, sample_rows=2, wandb_credential_id=key.id)
    assert passed.ok, passed.errors
    secrets = {job["role"]: job["secrets"] for job in passed.plan["jobs"]}
    assert "WANDB_API_KEY" in secrets["trainer"]
    assert all("WANDB_API_KEY" not in names for role, names in secrets.items() if role != "trainer")
    assert WANDB_KEY not in json.dumps(passed.plan)

    unticked = run_preflight(ctx, OWNER, spec_with(tmp_path, {}), sample_rows=2, wandb_credential_id=key.id)
    assert all("WANDB_API_KEY" not in job["secrets"] for job in unticked.plan["jobs"])  # a key picked, W&B not

    other = ctx.vault.save("bob", "bobs-wandb", "wandb", WANDB_KEY[::-1])
    stolen = run_preflight(ctx, OWNER, data, sample_rows=2, wandb_credential_id=other.id)
    assert "reporting.wandb_key" in stolen.errors  # another owner's key is not lent


def test_a_reporting_package_missing_at_its_pin_is_named_with_the_fix(tmp_path):
    requirements = tmp_path / "requirements-reporting.txt"
    requirements.write_text("trackio==0.0.1\nwandb==0.0.1\n")
    spec = parse_spec(spec_with(tmp_path, {"trackio": True}))
    assert missing_packages(spec, requirements) == ["trackio==0.0.1"]  # only what the run picked
    assert missing_packages(spec) == []  # the panel's own environment has them at their pins


def test_the_launch_form_has_a_reporting_section_and_places_its_errors_there(tmp_path):
    panel = Panel(PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path / "panel"), space=False)
    page = LaunchPage(panel)
    with gr.Blocks():
        page.build()
    assert isinstance(page.inputs["reporting.trackio"], gr.Checkbox)
    assert page.inputs["reporting.trackio"].label == "Trackio"
    assert page.inputs["wandb_credential"].label == "W&B key"
    routed = FORM.route_errors({"reporting.wandb_key": "save your W&B key"}, None, code_enabled=False)
    assert routed["reporting"] == ["W&B key: save your W&B key"]


@pytest.mark.e2e
def test_a_demo_run_reports_to_trackio_and_wandb_under_trls_names(tmp_path, monkeypatch):
    trackio_dir, wandb_dir = tmp_path / "trackio", tmp_path / "wandb"
    wandb_dir.mkdir()
    # What a user sets to keep both on this machine; local jobs inherit them from the panel.
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    spec = parse_spec(spec_with(tmp_path, {"trackio": True, "wandb": True}, grpo={"max_steps": 6, "seed": 0}))
    key = ctx.vault.save(OWNER, "my-wandb", "wandb", WANDB_KEY)
    runs = RunService(ctx, OWNER)
    runs.create(spec, wandb_credential_id=key.id)
    runs.launch(spec.run_id, wait=True)
    assert follow_to_end(Poller(ctx), runs, spec.run_id, timeout=600).status == "finished"
    panel = dict(QueryService(ctx, OWNER).metric_series(spec.run_id, "reward", max_points=None))

    with sqlite3.connect(trackio_dir / "grpo-panel.db") as db:
        logged = [
            (step, json.loads(metrics))
            for step, metrics in db.execute(
                "SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY step", (spec.run_id,)
            )
        ]
    # Trackio numbers its own log calls; the trainer's step is TRL's `train/global_step` beside each metric.
    trackio_reward = {m["train/global_step"]: m["train/reward"] for _, m in logged if "train/reward" in m}
    assert trackio_reward == pytest.approx(panel, rel=1e-9)  # every step the panel shows, under TRL's name
    assert any("train/kl" in metrics for _, metrics in logged)

    # Issue 29: each evaluated version's held-out scores as `eval/...`, the last one (evaluated after training) too.
    held_out = {s.version: s.mean for s in QueryService(ctx, OWNER).held_out_series(spec.run_id)}
    last = max(held_out)
    assert set(held_out) == {0, last} and last > 0, held_out  # every 10 versions: none between base and last
    trackio_eval = {int(m["eval/version"]): m["eval/reward"] for _, m in logged if "eval/version" in m}
    assert trackio_eval[last] == pytest.approx(held_out[last]) and set(trackio_eval) <= set(held_out)

    (run_file,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    assert ("grpo-panel", "report-demo") in wandb_records.run_names(run_file)  # the spec's project, the run's id
    rows = wandb_records.history(run_file)
    wandb_reward = {row["train/global_step"]: row["train/reward"] for row in rows if "train/reward" in row}
    assert wandb_reward == pytest.approx(panel, rel=1e-9)
    assert any("train/kl" in row for row in rows)
    wandb_eval = {int(row["eval/version"]): row["eval/reward"] for row in rows if "eval/version" in row}
    assert wandb_eval == pytest.approx(trackio_eval)
    assert not [name for name in QueryService(ctx, OWNER).metric_names(spec.run_id) if name.startswith("eval")]
    job_files = [path for path in (ctx.local_launcher.workdir / spec.run_id).rglob("*") if path.is_file()]
    assert job_files and all(WANDB_KEY not in path.read_text(errors="replace") for path in job_files)
    ctx.db.close()


def test_a_wandb_key_is_kept_from_the_account_page_masked_and_offered_on_the_launch_page(tmp_path):
    from app.pages.account import AccountPage

    panel = Panel(PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path / "panel"), space=False)
    account, launch = AccountPage(panel), LaunchPage(panel)
    with gr.Blocks():
        account.build()
        launch.build()
    refused = account.save_wandb_key("wandb", "not-a-key")
    assert "40 characters" in refused[account.result] and panel.ctx.vault.list(OWNER) == []
    saved = account.save_wandb_key("my-wandb", WANDB_KEY)
    (credential,) = panel.ctx.vault.list(OWNER)
    assert (credential.kind, credential.name) == ("wandb", "my-wandb")
    assert WANDB_KEY not in repr(saved) and saved[account.wandb_key] == ""  # never shown again
    offered = launch.on_open("", "", "", "", None)[launch.inputs["wandb_credential"]]
    assert str(credential.id) in [value for _, value in offered.choices]
    assert WANDB_KEY[-4:] in repr(offered.choices) and WANDB_KEY not in repr(offered.choices)


def test_the_monitor_header_says_where_else_the_run_is_reported_with_links(tmp_path):
    from app.cards import reported_to

    def line(reporting: dict) -> str:
        return reported_to(demo_spec("report-demo", f"file://{tmp_path}", reporting=reporting).to_json())

    assert line({}) == ""  # only the panel: nothing to say
    local = line({"trackio": True})
    assert "trackio show --project grpo-panel" in local and "as run report-demo" in local
    hosted = line({"trackio": True, "trackio_space": "alice/dash", "wandb": True, "wandb_entity": "team"})
    assert 'href="https://huggingface.co/spaces/alice/dash"' in hosted
    assert 'href="https://wandb.ai/team/grpo-panel"' in hosted
    assert "W&amp;B: project grpo-panel" in line({"wandb": True})  # no entity: the key's default, not guessed


def test_a_trainer_on_hf_jobs_finds_the_reporting_pins_in_its_code_bundle(tmp_path):
    """The trainer reads requirements-reporting.txt beside its `jobs/` to install what its run reports with: the
    bundle HF jobs unpack must carry it."""
    import io
    import subprocess
    import sys
    import tarfile

    from backend.launch.bundle import build_bundle

    with tarfile.open(fileobj=io.BytesIO(build_bundle())) as archive:
        archive.extractall(tmp_path, filter="data")
    found = subprocess.run(
        [sys.executable, "-c", "from jobs.trainer.reporting import REQUIREMENTS; print(REQUIREMENTS.read_text())"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "trackio==" in found and "wandb==" in found


def test_a_trainer_that_cannot_install_its_reporting_package_says_what_and_how_to_go_on(tmp_path, monkeypatch):
    """The HF Jobs branch (the job image lacks the packages), driven here: the pin is missing, pip is run for it and
    fails (no index reachable), and the trainer's error names the package and the way out."""
    from jobs.trainer.reporting import install_reporting_packages

    requirements = tmp_path / "requirements-reporting.txt"
    requirements.write_text("trackio==0.0.1\nwandb==0.0.1\n")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once instead of searching the registry
    spec = parse_spec(spec_with(tmp_path, {"wandb": True}))
    with pytest.raises(RuntimeError, match=r"could not install wandb==0\.0\.1 .* without reporting\.trackio / "):
        install_reporting_packages(spec, requirements)
    assert install_reporting_packages(spec) == []  # at its pin here: nothing to install

"""A job's whole log, as the Monitor's "A job's whole log" shows and downloads it (issue 33, item 1): every line,
start-up first, from a local job and from one on (emulated) HF Jobs; where the view holds only the newest lines, its
label says so and how many are only in the download."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import pytest
from huggingface_hub import HfApi

from app.events import Updates
from app.pages.monitor import MonitorPage, log_label
from app.panel import Panel
from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.models import Job
from backend.launchers.base import JobHandle
from backend.launchers.hf_jobs import HfJobsLauncher
from backend.services.queries import QueryService
from backend.services.runs import RunService
from jobs.demo.preset import demo_spec
from tests.support.hub_emulator import HubEmulator
from tests.support.hub_panel import OWNER as HUB_OWNER
from tests.support.hub_panel import TOKEN
from tests.support.waiting import wait_until

OWNER = "local"
FIRST = "2026-12-03 10:00:00,000 trainer WARNING jobs.trainer: a start-up warning, the line a cut log loses first"
# 3,300 lines of ~170 bytes: some 560 KB, more than twice what the panel used to read of a log
BODY = [f"2026-12-03 10:00:{n % 60:02d},{n:04d} trainer INFO trl: step {n} " + "x" * 120 for n in range(1, 3_300)]
LOG = "\n".join([FIRST, *BODY]) + "\n"


@pytest.fixture
def panel(tmp_path: Path) -> Iterator[Panel]:
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path / "panel")
    yield Panel(ctx, space=False)
    ctx.db.close()


def local_job_with_log(panel: Panel, run_id: str, log: str) -> int:
    """A finished local trainer job of a recorded run, whose log file holds `log`; its Job row's id."""
    ctx = panel.ctx
    RunService(ctx, OWNER).create(demo_spec(run_id, f"file://{ctx.folder / 'store'}"))
    folder = ctx.local_launcher.workdir / run_id / "trainer-0000abcd"
    folder.mkdir(parents=True)
    (folder / "log").write_text(log)
    (folder / "exit").write_text("0")
    job = Job(run_id=run_id, owner=OWNER, role="trainer", backend_job_id=folder.name, stage="completed")
    with ctx.db.session() as session:
        session.add(job)
        session.commit()
        session.refresh(job)
    assert job.id is not None
    return job.id


def shown(page: MonitorPage, update: Updates) -> tuple[str, str]:
    """(label, text) of the log view in a `show_log` answer."""
    view = update[page.log_text]
    assert isinstance(view, gr.Code)
    return str(view.label), str(view.value)


def test_the_whole_log_of_a_local_job_is_shown_and_downloaded_start_up_first(panel: Panel) -> None:
    job_id = local_job_with_log(panel, "long-log", LOG)
    page = MonitorPage(panel)
    with gr.Blocks():
        page.build()
    answer = page.show_log("long-log", job_id, "")
    label, text = shown(page, answer)
    assert label == "Log (3,300 lines)"
    assert text.splitlines()[0] == FIRST and text.splitlines()[-1] == BODY[-1] and len(text.splitlines()) == 3_300
    download = answer[page.log_file]
    assert isinstance(download, gr.DownloadButton) and download.label == "Download the whole log (3,300 lines)"
    assert Path(download.value["path"]).read_text() == LOG  # what Gradio serves: byte for byte, as the job wrote it

    label, text = shown(page, page.show_log("long-log", job_id, "step 32"))  # steps 32, 320-329, 3200-3299
    assert label == "Log (111 of 3,300 lines hold “step 32”)"
    assert len(text.splitlines()) == 111 and "step 32 " in text.splitlines()[0]


def test_a_log_longer_than_the_view_says_how_many_lines_only_the_download_has(panel: Panel, tmp_path: Path) -> None:
    job_id = local_job_with_log(panel, "longer-log", LOG)
    log = QueryService(panel.ctx, OWNER).job_log("longer-log", job_id, tmp_path / "whole.log", lines=1_000)
    assert (log.total, log.matching, len(log.shown), log.left_out) == (3_300, 3_300, 1_000, 2_300)
    assert log.shown[-1] == BODY[-1] and log.shown[0] == BODY[-1_000]
    assert (tmp_path / "whole.log").read_text() == LOG
    assert log_label(log, following=True) == (
        "Log (3,300 lines; the newest 1,000 shown, the 2,300 before them only in the download, following)"
    )


def test_a_job_cards_tail_never_starts_mid_line(panel: Panel) -> None:
    """The cards read a few newest lines from the end of the file; a line longer than what is read is left out
    rather than shown from its middle."""
    huge = "y" * 300_000
    local_job_with_log(panel, "wide-log", f"{FIRST}\n{huge}\nthe last line\n")
    handle = JobHandle(run_id="wide-log", role="trainer", job_id="trainer-0000abcd", backend="local")
    assert panel.ctx.local_launcher.logs(handle, 50) == ["the last line"]


def test_the_whole_log_of_a_job_on_hf_jobs_is_every_line_it_printed(emulator: HubEmulator, tmp_path: Path) -> None:
    api = HfApi(endpoint=emulator.url, token=TOKEN)
    code = f"print({FIRST!r})\nfor n in range(1, 3_300):\n    print(f'step {{n}} ' + 'x' * 120)"
    job = api.run_job(image="python:3.12", command=["python", "-c", code], namespace=HUB_OWNER)
    wait_until(lambda: api.inspect_job(job_id=job.id, namespace=HUB_OWNER).status.stage == "COMPLETED", 60, 0.1)
    handle = JobHandle(
        run_id="r", role="trainer", job_id=job.id, backend="hf_jobs", url=f"{emulator.url}/jobs/{HUB_OWNER}/{job.id}"
    )
    HfJobsLauncher(TOKEN, endpoint=emulator.url).write_log(handle, tmp_path / "hub.log")
    lines = (tmp_path / "hub.log").read_text().splitlines()
    assert len(lines) == 3_300 and lines[0] == FIRST and lines[-1] == "step 3299 " + "x" * 120

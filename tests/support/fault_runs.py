"""Demo runs with faults injected, as the fault matrix (tests/test_faults.py) and the vLLM end-to-end run drive them:
the run, the panel's view of it and every process it ever had; the proxy's view of a replica; the policy audits."""

from __future__ import annotations

import json
import os
import shlex
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.models import TERMINAL_STATUSES, Job, Run
from backend.ingestion.poller import Poller
from backend.launchers.base import TERMINAL
from backend.services.runs import RunService
from jobs.contract import RunSpec, layout
from jobs.processes import group_alive
from jobs.store import ObjectStore
from tests.support.processes import RunProcesses
from tests.support.waiting import wait_until

OWNER = "local"
# How often a test looks at what needs no poller pass (SQLite, the proxy's stats, the process table, the bucket).
OBSERVE_INTERVAL = 0.25
# Put on a run's jobs' PYTHONPATH by `stale_hook`.
STALE_HOOK = """
import os, sys

def _stale():
    argv = list(getattr(sys, "orig_argv", ()))
    if "-m" in argv and argv[argv.index("-m") + 1] == "jobs.replica" and "--index" in argv:
        if "replica-" + argv[argv.index("--index") + 1] == __ROLE__:
            os.environ["GRPO_FAULT_SERVE_PREVIOUS_ADAPTER"] = __MODE__

_stale()
"""


class FaultRun:
    """One demo run, the panel's view of it, and every process it ever had."""

    def __init__(self, data: Path, spec: RunSpec, credentials: dict[str, str] | None = None, stall_after=120.0):
        self.data, self.run_id = data, spec.run_id
        self.ctx = PanelContext(Database(data / "panel.sqlite3"), data)
        credential = self.ctx.vault.save(OWNER, "bucket", "s3", credentials).id if credentials else None
        self.service = RunService(self.ctx, OWNER)
        self.service.create(spec, store_credential_id=credential)
        self.poller = Poller(self.ctx, interval=1.0, stall_after=stall_after)
        self.processes = RunProcesses(self.ctx.local_launcher.workdir / self.run_id)
        self.statuses: list[tuple[str, int]] = []  # (status, step) each time the status changed

    def launch(self, **env: str) -> None:
        """Launch the run as the panel does, its jobs started with `env` set (this process's environment is left
        as it was)."""
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            self.service.launch(self.run_id, wait=True)
        self.processes.snapshot()

    def observe(self, poll: bool) -> Run:
        """One look at the run (after a poller pass of our own when `poll`; else another process polls)."""
        if poll:
            self.poller.poll_once()
        self.processes.snapshot()
        run = self.service.get(self.run_id)
        if not self.statuses or self.statuses[-1][0] != run.status:
            self.statuses.append((run.status, run.step))
        return run

    def wait(self, predicate: Callable[[Run], bool], timeout: float, poll: bool = True, what: str = "run") -> Run:
        """Observe until `predicate(run)`; fails at once if the run ended without it. Polling ourselves, once per
        poller interval, as a panel does (each pass reads every stream of the run); else four times a second."""

        def check() -> Run | None:
            run = self.observe(poll)
            if predicate(run):
                return run
            if run.status in TERMINAL_STATUSES:
                raise AssertionError(f"the run ended ({run.status}: {run.status_message}) before {what}")
            return None

        return wait_until(check, timeout, self.interval(poll), what=what)

    def interval(self, poll: bool) -> float:
        """How often to look at the run: a poller pass of our own costs what a panel's does, a look at SQLite little."""
        return self.poller.interval if poll else OBSERVE_INTERVAL

    def finish(self, timeout: float = 600, poll: bool = True) -> Run:
        """Follow the run to its end, then until every process of it is gone and the panel saw every job end."""
        run = self.wait(lambda r: r.status in TERMINAL_STATUSES, timeout, poll, what="run end")
        wait_until(
            lambda: self.processes.snapshot() or not self.processes.running(), 90, OBSERVE_INTERVAL, "processes gone"
        )
        wait_until(
            lambda: self.observe(poll) and all(job.stage in TERMINAL for job in self.jobs()),
            60,
            self.interval(poll),
            what="jobs ended",
        )
        return run

    def jobs(self) -> list[Job]:
        return self.service.jobs(self.run_id)

    def latest_job(self, role: str) -> Job:
        return max((job for job in self.jobs() if job.role == role), key=lambda job: job.attempt)

    def job_folder(self, role: str) -> Path:
        return self.ctx.local_launcher.workdir / self.run_id / self.latest_job(role).backend_job_id

    def pgid(self, role: str) -> int:
        return int((self.job_folder(role) / "pgid").read_text())

    def kill(self, role: str) -> None:
        """SIGKILL the whole process group of a job (its newest attempt): no chance to clean up."""
        pgid = self.pgid(role)
        self.processes.snapshot()
        os.killpg(pgid, signal.SIGKILL)
        wait_until(lambda: not group_alive(pgid), 30, what=f"{role} gone")

    def proxy_stats(self) -> dict[str, Any] | None:
        """The live `/proxy/stats` of the trainer's proxy (None while it does not answer)."""
        command = shlex.split((self.job_folder("trainer") / "command").read_text())
        port = command[command.index("--proxy-port") + 1]
        try:
            return requests.get(f"http://127.0.0.1:{port}/proxy/stats", timeout=5).json()
        except (requests.RequestException, ValueError):
            return None

    def replica_token(self) -> str:
        return self.ctx.secrets_for(self.service.get(self.run_id)).replica_token

    def close(self) -> None:
        """Teardown after a failed assertion: end whatever of the run still runs (the tests assert none does)."""
        for pid in self.processes.running():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.ctx.db.close()


def replica_stats(stats: dict[str, Any], role: str | None = None, url: str | None = None) -> dict[str, Any] | None:
    for replica in stats.get("replicas") or []:
        if replica["role"] == role or replica["url"] == url:
            return replica
    return None


def audit_verdicts(store: ObjectStore, run_id: str) -> tuple[dict[int, dict], dict[int, dict[str, str]]]:
    """(audit record per version, {version: {role: verdict}})."""
    records = (json.loads(store.get_bytes(info.key)) for info in store.list(layout.audit_prefix(run_id)))
    audits = {record["version"]: record for record in records}
    return audits, {v: {role: r["verdict"] for role, r in a["replicas"].items()} for v, a in sorted(audits.items())}


def stale_hook(folder: Path, role: str, mode: str) -> str:
    """The jobs' PYTHONPATH with a hook in `folder` first: `role` alone turns on the sidecar's fault switch (`mode`:
    its value, jobs/replica/sidecar.py), so its engine is handed the adapter loaded before under each new name."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(STALE_HOOK.replace("__ROLE__", repr(role)).replace("__MODE__", repr(mode)))
    return os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))

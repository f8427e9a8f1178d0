"""The embedded default: every job is a local process in its own process group.

Each job gets a folder under the launcher's work directory holding its command, endpoint, log, its process group id
(written by the job's own group leader, so a panel killed right after starting it still leaves it findable) and — once
it ends — its exit code, so a restarted panel can find the job and tell how it ended. Replicas listen on free ports on
127.0.0.1 and demand a per-run bearer token. Cancelling sends SIGTERM to every process of the job — its group and
every descendant, also those in a session of their own, like the ranks torchrun starts for a multi-process trainer
(jobs/processes.py) — then SIGKILL after a grace period. It is the last resort: a run is stopped through its stop
request first (RunService.stop), which lets the trainer save a checkpoint and stop its replicas.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from secrets import token_hex

from backend.database.connection import PROJECT_ROOT
from backend.launch.plan import PORT, JobPlan
from backend.launchers.base import TERMINAL, JobHandle, JobState, Launcher, RunSecrets, job_env, job_module_args
from jobs import settings
from jobs.contract import RunSpec, timeout_seconds
from jobs.contract.control import JobRef, JobsRecord
from jobs.ports import free_port
from jobs.processes import group_alive, terminate_group
from jobs.replica.engine_command import EngineChoice, choose_engine
from jobs.store.base import atomic_write

CANCEL_GRACE_S = 15.0
TAIL_WINDOW_BYTES = 256 * 1024  # where a log's newest lines are looked for: far more than a job card's few
_EXIT_RECORDER = """
echo $$ > "$JOB_FOLDER/pgid.tmp" && mv -f "$JOB_FOLDER/pgid.tmp" "$JOB_FOLDER/pgid"
trap : TERM INT
"$@" &
child=$!
while :; do
  wait "$child"; code=$?
  kill -0 "$child" 2>/dev/null || break
done
echo "$code" > "$JOB_FOLDER/exit"
"""
# Environment a local job inherits; anything else (other credentials of the panel's user) stays out.
_INHERITED_ENV = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    *(variable.name for variable in settings.TUNING_VARIABLES),
    "HF_HOME",
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
    "HF_HUB_DISABLE_TELEMETRY",
    "NO_PROXY",
    "PYTHONPATH",
)


class LocalLauncher(Launcher):
    backend = "local"
    startup_deadline = 300.0
    poll_interval = 0.5

    def __init__(self, workdir: str | os.PathLike[str]):
        self.workdir = Path(workdir)

    def _folder(self, job: JobHandle) -> Path:
        return self.workdir / job.run_id / job.job_id

    def _pgid(self, job: JobHandle) -> int:
        return int((self._folder(job) / "pgid").read_text())

    def trainer_cuda(self, spec: RunSpec) -> bool:
        import torch  # the trainer runs on this machine: on its GPU if it has one

        available: bool = torch.cuda.is_available()
        return available

    def replica_engine(self, spec: RunSpec) -> EngineChoice:
        return choose_engine(spec.compute.engine)  # the replicas run on this machine

    def plan_job(self, spec: RunSpec, role: str, secrets: RunSecrets, port: int | None = None) -> JobPlan:
        """The job's command with `port` (a free port when it starts; `PORT` in a plan shown beforehand): where a
        replica listens, or the trainer's proxy."""
        listen = str(port) if port is not None else PORT
        command = [sys.executable, "-m", *job_module_args(spec, role, port=listen, host="127.0.0.1")]
        if role == "trainer":
            command += ["--proxy-port", listen]
        return JobPlan(
            role=role,
            command=command,
            env={"PYTHONUNBUFFERED": "1", "PYTHONPATH": _python_path()},
            secrets=sorted(job_env(role, secrets, on_hf_jobs=False)),
            timeout_s=timeout_seconds(spec.compute.timeout),
        )

    def start_job(self, spec: RunSpec, role: str, secrets: RunSecrets) -> JobHandle:
        port = free_port()
        plan = self.plan_job(spec, role, secrets, port)
        env = {name: os.environ[name] for name in _INHERITED_ENV if name in os.environ}
        env.update(job_env(role, secrets, on_hf_jobs=False))
        env.update(plan.env)
        job = JobHandle(
            run_id=spec.run_id,
            role=role,
            job_id=f"{role}-{token_hex(4)}",
            backend=self.backend,
            endpoint=f"http://127.0.0.1:{port}" if role != "trainer" else None,
        )
        folder = self._folder(job)
        folder.mkdir(parents=True)
        (folder / "command").write_text(shlex.join(plan.command))  # the command only: secrets are in the environment
        if job.endpoint:
            (folder / "endpoint").write_text(job.endpoint)
        (folder / "timeout").write_text(str(plan.timeout_s))
        with open(folder / "log", "ab") as log_file:
            # `sh` stays the group leader and records the exit code, so a restarted panel still knows how it ended.
            # It survives the group's SIGTERM (a no-op trap; the job itself still gets the signal) to record how the
            # job ended: a replica the trainer stops cleanly is "completed", not "killed".
            process = subprocess.Popen(
                ["/bin/sh", "-c", _EXIT_RECORDER, "sh", *plan.command],
                cwd=PROJECT_ROOT,
                env={**env, "JOB_FOLDER": str(folder)},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        atomic_write(folder / "pgid", str(process.pid).encode())  # the leader writes it too, as soon as it runs
        (folder / "started").write_text(str(time.time()))
        # Reap the group leader the moment it exits, so it never lingers as a zombie that still "belongs" to the group.
        threading.Thread(target=process.wait, name=f"reap-{job.job_id}", daemon=True).start()
        return job

    def state(self, job: JobHandle) -> JobState:
        folder = self._folder(job)
        started = _read_float(folder / "started")
        code = _read_int(folder / "exit")
        limit = _read_float(folder / "timeout")
        if (folder / "timed_out").exists():
            return JobState("error", f"timed out after {limit:.0f}s", started, _mtime(folder / "timed_out"))
        if (folder / "canceled").exists() and (code is not None or not group_alive(self._pgid(job))):
            return JobState("canceled", "cancelled", started, _mtime(folder / "canceled"))
        if code is not None:
            finished = _mtime(folder / "exit")
            if code == 0:
                return JobState("completed", "exit code 0", started, finished)
            return JobState("error", f"exit code {code}", started, finished)
        if group_alive(self._pgid(job)):
            if started is not None and limit is not None and time.time() - started > limit:
                (folder / "timed_out").write_text(str(time.time()))
                terminate_group(self._pgid(job), CANCEL_GRACE_S)
                return self.state(job)
            return JobState("running", "", started)
        return JobState("error", "the process ended without an exit code", started, None)

    def logs(self, job: JobHandle, tail: int = 50) -> list[str]:
        path = self._folder(job) / "log"
        if not path.exists():
            return []
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            start = max(0, handle.tell() - TAIL_WINDOW_BYTES)
            handle.seek(start)
            lines = handle.read().decode(errors="replace").splitlines()
        return lines[1 if start else 0 :][-tail:]  # a window that starts mid-line leaves that line out

    def write_log(self, job: JobHandle, destination: Path) -> None:
        source = self._folder(job) / "log"
        if source.exists():
            shutil.copyfile(source, destination)
        else:
            destination.write_bytes(b"")

    def cancel(self, job: JobHandle) -> None:
        folder = self._folder(job)
        # A job that already ended (with or without recording its exit: a SIGKILLed group records nothing) keeps the
        # way it ended; cancelling it afterwards must not turn a crash into "cancelled".
        if not (folder / "exit").exists() and group_alive(self._pgid(job)):
            (folder / "canceled").write_text(str(time.time()))
        terminate_group(self._pgid(job), CANCEL_GRACE_S)

    def find_jobs(self, spec: RunSpec) -> list[JobHandle]:
        run_id, found = spec.run_id, []
        folders = sorted((self.workdir / run_id).iterdir()) if (self.workdir / run_id).is_dir() else []
        for folder in folders:
            if not (folder / "pgid").exists():
                continue  # the panel died before the job's process started: there is no job
            endpoint = folder / "endpoint"
            job = JobHandle(
                run_id=run_id,
                role=folder.name.rsplit("-", 1)[0],
                job_id=folder.name,
                backend=self.backend,
                endpoint=endpoint.read_text() if endpoint.exists() else None,
            )
            if self.state(job).stage not in TERMINAL:
                found.append(job)
        return found

    def describe_jobs(self, spec: RunSpec, jobs: list[JobHandle]) -> JobsRecord:
        return JobsRecord(
            backend="local", jobs=[JobRef(role=job.role, job_id=job.job_id, pgid=self._pgid(job)) for job in jobs]
        )


def _python_path() -> str:
    """This checkout first (jobs import `jobs`), then whatever the panel's environment had."""
    return os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))


def _read_float(path: Path) -> float | None:
    try:
        return float(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None
